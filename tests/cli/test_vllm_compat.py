"""A `vllm serve ...` command line runs as `engine serve ...`: vLLM's serve flags
parse (or get a message naming them as vLLM's), and a real server started with
them prints vLLM's request lines on its real stderr and uvicorn's access lines on
stdout, where uvicorn (and so vLLM) writes them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.bench_server import free_port, wait_healthy
from engine.cli import build_parser, main
from engine.cli.commands.serve import settings_from_args
from engine.modelspec.presets import bundled_gguf_path
from tests.paths import ROOT

TEMPLATE = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"


def test_a_vllm_serve_command_line_parses(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    args = build_parser().parse_args([
        "serve", "smollm2-135m", "--tokenizer", "smollm2-135m", "--chat-template", str(template),
        "--trust-remote-code", "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--allowed-origins", '["*"]', "--max-log-len", "100", "--served-model-name", "smol",
        "--gpu-memory-utilization", "0.5", "--max-model-len", "1024", "--max-num-seqs", "8",
    ])  # fmt: skip
    settings = settings_from_args(args)
    assert settings.chat_template == TEMPLATE and settings.allowed_origins == ("*",)
    assert settings.log_requests is False and settings.max_log_len == 100 and settings.served_model_name == "smol"
    assert build_parser().parse_args(["serve", "--enable-log-requests"]).log_requests is True


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["serve", "--swap-space", "4"], ["vLLM flag kvscope does not have: --swap-space", "recompute"]),
        (["serve", "--enable-chunked-prefill", "--max-num-partial-prefills=2", "--nope"],
         ["vLLM flags kvscope does not have: --enable-chunked-prefill", "--max-num-partial-prefills",
          "also unrecognized: --nope"]),
        (["serve", "--nope"], ["unrecognized arguments: --nope"]),
        # vLLM 0.33's KV offloading: each refused with what kvscope has instead
        (["serve", "--kv-offloading-size", "64"], ["vLLM flag kvscope does not have: --kv-offloading-size",
                                                    "--kv-cache-memory-bytes sizes it", "remove it"]),
        (["serve", "--kv-offloading-backend=native"], ["--kv-offloading-backend (neither native nor lmcache"]),
        (["serve", "--tokenizer", "meta-llama/Llama-3.1-8B"], ["--tokenizer meta-llama/Llama-3.1-8B", "leave --tokenizer out"]),
        (["serve", "--chat-template", "{{ broken"], ["--chat-template: not a Jinja template"]),
        (["serve", "--chat-template", "missing.jinja"], ["--chat-template missing.jinja: cannot read it"]),
    ],
)
def test_flags_kvscope_lacks_are_named_in_one_line(argv: list[str], needles: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)  # a UserError (a flag's value) returns 2 ...
    except SystemExit as exc:  # ... an argument argparse does not know exits 2
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("engine serve: error: "), err
    for needle in needles:
        assert needle in err, err




@pytest.mark.skipif(bundled_gguf_path() is None, reason="the bundled SmolLM2 GGUF is not installed")
@pytest.mark.slow  # a server of its own, ~15 s; tests/test_logs.py checks the line format
def test_served_with_vllm_flags_logs_like_vllm(tmp_path: Path, smollm_tokenizer) -> None:  # type: ignore[no-untyped-def]
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    stderr, stdout = tmp_path / "stderr.log", tmp_path / "stdout.log"
    with stderr.open("w") as err, stdout.open("w") as out:
        proc = subprocess.Popen([
            sys.executable, "-m", "engine.cli", "serve", "smollm2-135m", "--port", str(port), "--max-model-len", "512",
            "--kv-cache-memory-bytes", "32Mi", "--chat-template", str(template), "--enable-log-requests",
            "--max-log-len", "5", "--trust-remote-code", "--threads", "1",
        ], cwd=ROOT, stdout=out, stderr=err)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, {proc: stderr}, timeout_s=180)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = stderr.read_text()
    # the template replaced the model's own: the prompt is exactly its rendering
    assert prompt_tokens == len(smollm_tokenizer.encode("Q: What is the capital of France?\nA:"))
    assert "chat template from --chat-template replaces the model's own" in log
    assert "--trust-remote-code changes nothing" in log
    request = re.search(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[routes_openai\.py:\d+\] Received request chatcmpl-\S+: "
                        r"params: .*, prompt_token_ids: \[(.*?)\] \.\.\. \(([\d,]+) in all\), lora_request: None\.$",
                        log, re.M)
    assert request, log
    assert len(request.group(1).split(",")) == 5 and int(request.group(2).replace(",", "")) == prompt_tokens
    # uvicorn's access line, on stdout as uvicorn (and so vLLM) writes it
    access = stdout.read_text()
    assert re.search(r'^INFO: +127\.0\.0\.1:\d+ - "POST /v1/chat/completions HTTP/1\.1" 200', access, re.M), access
