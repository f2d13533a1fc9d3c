"""The flags are declared once (issue 48): engine/config.py's EngineConfig fields, whose
metadata says how the CLI spells each, are what ``engine serve`` defines and what
:func:`engine_config_from_args` copies; no list of names stands beside them."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from engine.cli import build_parser
from engine.cli import flags as cli_flags
from engine.cli.flags import engine_config_from_args
from engine.config import PARSE, EngineConfig, cli_dest, cli_flag

FIELDS = dataclasses.fields(EngineConfig)


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


SERVE = serve_parser()


@pytest.mark.parametrize("f", [f for f in FIELDS if cli_flag(f) is not None], ids=lambda f: f.name)
def test_each_flag_a_field_declares_is_an_argument_of_serve(f: dataclasses.Field[Any]) -> None:
    flag = cli_flag(f)
    assert flag in SERVE._option_string_actions, f"EngineConfig.{f.name}: engine serve has no {flag}"
    assert SERVE._option_string_actions[flag].dest == cli_dest(f)


def test_no_serve_argument_named_as_a_field_goes_uncopied() -> None:
    """An argument whose destination is a field's name is the flag of that field: one the
    metadata declared as having no flag (cli=None) would be parsed and dropped."""
    copied = {cli_dest(f) for f in FIELDS}
    names = {f.name for f in FIELDS}
    stray = {a.dest for a in SERVE._actions if a.dest in names and a.dest not in copied}
    assert not stray
    assert {f.name for f in FIELDS if cli_flag(f) is None} == {"cuda_graph_sizes", "data_parallel_rank"}


def test_every_field_with_a_flag_is_copied_into_the_config() -> None:
    args = SERVE.parse_args([])
    given: dict[str, Any] = {}
    for f in FIELDS:
        dest = cli_dest(f)
        if dest is None:
            continue
        # a parsed field gets a value its parser takes; the others a marker only this field has
        value = "float16" if PARSE in f.metadata else f"value of {f.name}"
        setattr(args, dest, value)
        given[f.name] = f.metadata[PARSE](value) if PARSE in f.metadata else value
    config = engine_config_from_args(args)
    assert {name: getattr(config, name) for name in given} == given
    assert config.cuda_graph_sizes == EngineConfig().cuda_graph_sizes and config.data_parallel_rank is None


def test_the_renamed_flags_reach_their_fields() -> None:
    args = SERVE.parse_args(["--device-memory", "3.5", "--threads", "2", "--events", "run.jsonl",
                             "--rendezvous-timeout", "7", "--dtype", "fp16", "--served-model-name", "",
                             "--no-enable-prefix-caching", "-tp", "2"])
    config = engine_config_from_args(args, seed=5)
    assert (config.device_memory_gib, config.num_threads, config.events_path, config.rendezvous_timeout_s) == (
        3.5, 2, "run.jsonl", 7.0)
    assert (config.dtype, config.served_model_name, config.enable_prefix_caching) == ("float16", None, False)
    assert (config.tensor_parallel_size, config.seed) == (2, 5)


def test_a_new_field_is_copied_without_a_line_in_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class Wider(EngineConfig):
        new_budget_knob: int | None = None

    monkeypatch.setattr(cli_flags, "EngineConfig", Wider)
    args = SERVE.parse_args([])
    args.new_budget_knob = 9  # what a new add_argument("--new-budget-knob", ...) would parse
    assert engine_config_from_args(args).new_budget_knob == 9
