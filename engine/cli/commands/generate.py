"""``engine generate``: one prompt through the real engine, text out."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from engine.cli.exporters import add_exporter_flags, attach_exporters
from engine.cli.flags import add_engine_flags, engine_config_from_args
from engine.cli.program import Subparsers
from engine.core.sampling_params import SamplingParams
from engine.logs import configure_logging

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def register(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with the real engine")
    add_engine_flags(p, positional_model=True)
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_exporter_flags(p)
    p.set_defaults(func=run, stats_interval=0.0)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format)
    config = engine_config_from_args(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop)
    from engine.events import EventBus

    bus = EventBus()
    exporters = attach_exporters(args, bus)  # a bad exporter flag is refused before torch loads
    from engine.llm_engine import LLMEngine  # torch loads only once the flags are checked

    try:
        _generate(args, LLMEngine(config, bus=bus), params)
    finally:
        exporters.close()
    for line in exporters.summary:
        print(line, file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace, engine: LLMEngine, params: SamplingParams) -> None:
    with engine:
        prompt: str | list[int] = args.prompt
        if args.chat:  # the rendered template holds the BOS already: encoded without a second one
            engine.tokenizer.warn_chat_template_once()  # a GGUF with no template of its own
            rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                            add_generation_prompt=True)
            prompt = engine.encode_prompt(str(rendered), add_special_tokens=False)
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
                if out.finished:
                    sys.stdout.write("\n")
                    print(f"[{len(out.token_ids)} tokens, finish reason {out.finish_reason}]", file=sys.stderr)
