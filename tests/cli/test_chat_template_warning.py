"""A GGUF with no chat template of its own: ``engine generate --chat`` and ``LLM.chat`` say so,
once, in one line naming the fallback template (Gemma 3's instruction-tuned turns) or that
there is none; the note survives the tokenizer cache. Tiny random-weight Gemma 3 GGUFs
(tests/model/tiny_gemma3.py), with and without a template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.model.loading.startup_cache import CACHE_ENV, cached_tokenizer, tokenizer_paths
from engine.model.loading.tokenizer import Tokenizer
from tests.model.tiny_gemma3 import build_tiny_gemma3, write_gemma3_gguf
from tests.model.tiny_hf import save_tiny_checkpoint, write_tiny_gguf

NO_TEMPLATE = "carries no chat template"
FALLBACK = "Gemma 3's instruction-tuned template"
OWN_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
ENGINE_FLAGS = {"dtype": "float32", "max_model_len": 64}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> GGUF: Gemma 3 without a template, with its own, and a byte-level BPE Qwen2 without one."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("chat-template")
    gemma = build_tiny_gemma3(root / "gemma3")
    qwen = save_tiny_checkpoint("qwen2-tied", root / "qwen2")
    return {"bare": write_gemma3_gguf(gemma, root / "bare.gguf"),
            "own": write_gemma3_gguf(gemma, root / "own.gguf", chat_template=OWN_TEMPLATE),
            "bpe": write_tiny_gguf(qwen, root / "bpe.gguf")}


def test_the_note_names_the_fallback_or_its_absence(ggufs: dict[str, Path]) -> None:
    bare, own, bpe = (Tokenizer.from_gguf(ggufs[k]) for k in ("bare", "own", "bpe"))
    assert bare.chat_template_note is not None and "\n" not in bare.chat_template_note
    assert bare.chat_template_note.startswith(f"bare.gguf {NO_TEMPLATE}: chats use {FALLBACK}")
    assert own.chat_template_note is None and own.chat_template == OWN_TEMPLATE
    assert bpe.chat_template is None and bpe.chat_template_note is not None
    assert "no fallback" in bpe.chat_template_note


def test_the_tokenizer_cache_keeps_the_note(ggufs: dict[str, Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Built (miss), read back (hit), and an entry written before the note existed is rebuilt."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    note = Tokenizer.from_gguf(ggufs["bare"]).chat_template_note
    assert cached_tokenizer(ggufs["bare"]).chat_template_note == note
    assert cached_tokenizer(ggufs["bare"]).chat_template_note == note
    paths = tokenizer_paths(ggufs["bare"])
    assert paths is not None
    meta = json.loads(paths[1].read_text())
    del meta["chat_template_note"]
    paths[1].write_text(json.dumps(meta))
    assert cached_tokenizer(ggufs["bare"]).chat_template_note == note
    assert "chat_template_note" in json.loads(paths[1].read_text())


def test_generate_chat_warns_once(ggufs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(ggufs["bare"]), "--prompt", "hello", "--chat", "--max-tokens", "2",
                 "--dtype", "float32", "--max-model-len", "64"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if NO_TEMPLATE in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING") and FALLBACK in lines[0]


def test_llm_chat_warns_once_and_not_for_a_template_of_its_own(ggufs: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    params = SamplingParams(max_tokens=2)
    for name, warnings in (("bare", 1), ("own", 0)):
        with LLM(str(ggufs[name]), **ENGINE_FLAGS) as llm:
            llm.chat([{"role": "user", "content": "hi"}], params)
            llm.chat([[{"role": "user", "content": "hello"}], [{"role": "user", "content": "hey"}]], params)
        err = capsys.readouterr().err
        assert sum(NO_TEMPLATE in line for line in err.splitlines()) == warnings, name
