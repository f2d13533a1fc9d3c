"""vLLM command-line flags kvscope does not have, so a ``vllm serve ...`` line that
uses one gets a message naming it as vLLM's (and what to do), not argparse's bare
"unrecognized arguments". The flags kvscope shares with vLLM are defined in
engine/cli/flags.py under vLLM's names; this table is only the difference."""

from __future__ import annotations

from collections.abc import Sequence

# flag -> what kvscope does instead ("" when there is nothing to add)
VLLM_ONLY_FLAGS: dict[str, str] = {
    "--swap-space": "preemption is by recompute; nothing is swapped to CPU memory",
    "--cpu-offload-gb": "",
    "--enable-chunked-prefill": "prefills are always chunked, as vLLM V1 does by default",
    "--no-enable-chunked-prefill": "prefills are always chunked, as vLLM V1 does by default",
    "--max-num-partial-prefills": "",
    "--max-long-partial-prefills": "",
    "--num-gpu-blocks-override": "engine simulate takes it; engine serve sizes the pool with --kv-cache-memory-bytes",
    "--enable-lora": "no LoRA adapters",
    "--lora-modules": "no LoRA adapters",
    "--max-loras": "no LoRA adapters",
    "--max-lora-rank": "no LoRA adapters",
    "--speculative-config": "no speculative decoding",
    "--kv-transfer-config": "no disaggregated prefill",
    # vLLM 0.33: KV blocks spilled from GPU memory to a CPU tier (native or LMCache backend)
    "--kv-offloading-size": "no second KV tier of GiB in host memory: the KV cache is one pool "
                            "(--kv-cache-memory-bytes sizes it; on CPU it is host memory already) and a "
                            "preempted request is recomputed",
    "--kv-offloading-backend": "neither native nor lmcache offloading: no second KV tier (see --kv-offloading-size)",
    "--enable-auto-tool-choice": "no tool calling",
    "--tool-call-parser": "no tool calling",
    "--reasoning-parser": "",
    "--guided-decoding-backend": "no structured outputs",
    "--structured-outputs-config": "no structured outputs",
    "--revision": "models are local files: pass the folder or GGUF of the revision",
    "--code-revision": "",
    "--tokenizer-revision": "",
    "--tokenizer-mode": "the model's own tokenizer (tokenizers library)",
    "--download-dir": "models are local files or presets; nothing is downloaded",
    "--hf-token": "nothing is downloaded",
    "--hf-overrides": "",
    "--max-seq-len-to-capture": "",
    "--disable-sliding-window": "",
    "--disable-custom-all-reduce": "",
    "--enable-expert-parallel": "",
    "--compilation-config": "--compile (CPU) and --enforce-eager (CUDA graphs) are the switches",
    "-O": "--compile (CPU) and --enforce-eager (CUDA graphs) are the switches",
    "--cuda-graph-sizes": "",
    "--generation-config": "",
    "--override-generation-config": "",
    "--max-logprobs": "logprobs are not returned",
    "--limit-mm-per-prompt": "engine serve runs text models; engine plan and engine simulate take it for the "
                             "vision-language presets",
    "--mm-processor-kwargs": "text models only",
    "--enable-sleep-mode": "",
    "--ssl-keyfile": "serve behind a TLS proxy",
    "--ssl-certfile": "serve behind a TLS proxy",
    "--ssl-ca-certs": "serve behind a TLS proxy",
    "--root-path": "",
    "--middleware": "",
    "--response-role": "",
    "--return-tokens-as-token-ids": "",
    "--enable-prompt-tokens-details": "",
    "--enable-force-include-usage": "stream_options.include_usage per request",
    "--disable-frontend-multiprocessing": "one process already",
    "--num-scheduler-steps": "",
    "--preemption-mode": "preemption is by recompute",
    "--scheduler-delay-factor": "",
    "--rope-scaling": "",
    "--rope-theta": "",
    "--calculate-kv-scales": "fp8 KV uses scale 1.0",
    "--prefix-caching-hash-algo": "",
    "--config": "",
    "--worker-cls": "",
    "--async-scheduling": "",
    "--max-parallel-loading-workers": "",
    "--disable-log-stats": "--stats-interval sets the stats line's period",
    "--api-server-count": "one API server per engine",
    "--enable-prompt-embeds": "",
    "--logits-processors": "",
    "--task": "generation only",
    "--runner": "generation only",
    "--chat-template-content-format": "",
    "--enable-log-outputs": "--log-prompts puts prompt and output text in events and logs",
    "--log-config-file": "--log-format text|json",
    "--allowed-methods": "",
    "--allowed-headers": "",
    "--allow-credentials": "",
    "--max-cudagraph-capture-size": "",
    "--quantization-param-path": "",
}


def explain_unknown(args: Sequence[str]) -> str | None:
    """The message for arguments argparse did not know, naming vLLM's flags as such;
    None when none of them is a vLLM flag (argparse's own message is right then)."""
    known: list[str] = []
    others: list[str] = []
    after_flag = False  # the value of a vLLM flag is not "unrecognized" on its own
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in VLLM_ONLY_FLAGS:
            known.append(name)
            after_flag = "=" not in arg
        elif after_flag and not arg.startswith("-"):
            after_flag = False
        else:
            others.append(arg)
            after_flag = False
    if not known:
        return None
    parts = [f"{f} ({VLLM_ONLY_FLAGS[f]})" if VLLM_ONLY_FLAGS[f] else f for f in known]
    message = f"vLLM flag{'s' if len(known) > 1 else ''} kvscope does not have: {'; '.join(parts)}; remove "
    message += "them" if len(known) > 1 else "it"
    if others:
        message += f"; also unrecognized: {' '.join(others)}"
    return message + " (--help lists what kvscope takes)"
