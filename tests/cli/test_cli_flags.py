"""One flag vocabulary (issue 17): every ``engine`` subcommand's parser has one
argument per destination, retired spellings live on only as aliases of the
current flag, ``--help`` shows one spelling, and the workload flags of
run-workload, demo and simulate are one definition (engine/cli/flags.py)."""

from __future__ import annotations

import argparse
import re

import pytest

from engine.cli import build_parser
from engine.cli.flags import RETIRED_SPELLINGS, workload_spec_from_args
from engine.errors import UserError
from engine.sim.simulate import DEFAULT_MODEL
from engine.sim.workload import (
    VocabTokenIds,
    WorkloadSpec,
    generate_workload,
    ordinary_token_ids,
    parse_range,
)

WORKLOAD_COMMANDS = ("run-workload", "demo", "simulate")
# The destinations the retired spellings had: none may come back as an argument of its own.
RETIRED_DESTS = {old.lstrip("-").replace("-", "_") for old in RETIRED_SPELLINGS}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


SUBCOMMANDS = subcommands()


def dest_of(parser: argparse.ArgumentParser, option: str) -> str:
    return parser._option_string_actions[option].dest


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_one_argument_per_destination(name: str) -> None:
    parser = SUBCOMMANDS[name]
    seen: dict[str, list[str]] = {}
    for action in parser._actions:
        seen.setdefault(action.dest, []).append("/".join(action.option_strings) or action.dest)
    twice = {dest: args for dest, args in seen.items() if len(args) > 1}
    assert not twice, f"engine {name}: arguments sharing a destination (make them one argument): {twice}"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_retired_spellings_are_only_aliases(name: str) -> None:
    parser = SUBCOMMANDS[name]
    actions = parser._option_string_actions
    for old, new in RETIRED_SPELLINGS.items():
        if old in actions:
            assert new in actions and actions[old] is actions[new], (
                f"engine {name}: {old} must be an alias of {new}, not an argument of its own")
    dests = {a.dest for a in parser._actions}
    assert not dests & RETIRED_DESTS, f"engine {name}: retired destinations {sorted(dests & RETIRED_DESTS)}"


@pytest.mark.parametrize("name", WORKLOAD_COMMANDS)
def test_help_shows_one_spelling_and_no_markup(name: str) -> None:
    text = SUBCOMMANDS[name].format_help()
    for old in RETIRED_SPELLINGS:
        assert not re.search(rf"(?<![\w-]){re.escape(old)}(?![\w-])", text), f"engine {name} --help shows {old}"
    assert "``" not in text, f"engine {name} --help shows raw double-backtick markup"
    assert "--events-file" not in text  # the flag is --events
    assert "(HI exclusive, like a Python slice)" in " ".join(text.split())  # the range semantics, said once


def test_simulate_help_names_the_model_it_runs() -> None:
    text = " ".join(SUBCOMMANDS["simulate"].format_help().split())
    assert f"(default {DEFAULT_MODEL})" in text


def test_the_workload_flags_are_one_definition() -> None:
    """Every workload option the three commands share has the same destination in each."""
    options = {name: set(SUBCOMMANDS[name]._option_string_actions) for name in WORKLOAD_COMMANDS}
    shared = set.intersection(*options.values())
    for flag in ("--num-prompts", "--random-input-len", "--random-output-len", "--request-rate",
                 "--shared-prefix-fraction", "--shared-prefix-len", "--workload-seed", *RETIRED_SPELLINGS):
        assert flag in shared, flag
        dests = {dest_of(SUBCOMMANDS[name], flag) for name in WORKLOAD_COMMANDS}
        assert len(dests) == 1, (flag, dests)


@pytest.mark.parametrize(
    ("command", "old", "new", "dest", "value"),
    [
        ("run-workload", "--num-requests", "--num-prompts", "num_prompts", "7"),
        ("run-workload", "--prompt-len", "--random-input-len", "random_input_len", "40:100"),
        ("run-workload", "--output-len", "--random-output-len", "random_output_len", "30:70"),
        ("run-workload", "--rate", "--request-rate", "request_rate", "2.5"),
        ("demo", "--output-len", "--random-output-len", "random_output_len", "4:12"),
        ("demo", "--shared-prefix-tokens", "--shared-prefix-len", "shared_prefix_len", "64"),
        ("simulate", "--prompt-tokens", "--random-input-len", "random_input_len", "100:900"),
        ("simulate", "--output-tokens", "--random-output-len", "random_output_len", "20:160"),
        ("simulate", "--shared-prefix-tokens", "--shared-prefix-len", "shared_prefix_len", "512"),
        ("simulate", "--rate", "--request-rate", "request_rate", "12"),
    ],
)
def test_an_old_spelling_parses_to_the_new_destination(command: str, old: str, new: str, dest: str,
                                                       value: str) -> None:
    parser = build_parser()
    by_old = vars(parser.parse_args([command, old, value]))
    by_new = vars(parser.parse_args([command, new, value]))
    default = vars(parser.parse_args([command]))[dest]
    assert by_old == by_new and by_old[dest] != default and not any(k in by_old for k in RETIRED_DESTS)


def test_old_command_lines_draw_the_same_workload() -> None:
    """The background's command line in either spelling is the background's draw."""
    parser = build_parser()
    old = parser.parse_args(["simulate", "--num-requests", "60", "--prompt-tokens", "500:3000",
                             "--output-tokens", "150:400"])
    new = parser.parse_args(["simulate", "--num-prompts", "60", "--random-input-len", "500:3000",
                             "--random-output-len", "150:400"])
    background = WorkloadSpec(60, (500, 3000), (150, 400))
    assert workload_spec_from_args(old) == workload_spec_from_args(new) == background
    assert workload_spec_from_args(parser.parse_args(["simulate"])) == background  # the defaults are the background's
    assert generate_workload(workload_spec_from_args(old)) == generate_workload(background)


def test_real_engine_arrivals_are_poisson_seconds_or_at_once() -> None:
    parser = build_parser()
    at_once = workload_spec_from_args(parser.parse_args(["run-workload"]))
    assert (at_once.arrival, at_once.unit, at_once.prompt_range) == ("at-once", "s", (64, 256))
    paced = workload_spec_from_args(parser.parse_args(["demo", "--num-prompts", "5", "--workload-seed", "4"]))
    assert (paced.arrival, paced.unit, paced.rate, paced.seed) == ("poisson", "s", 3.0, 4)
    with pytest.raises(UserError, match="--request-rate"):
        workload_spec_from_args(parser.parse_args(["run-workload", "--rate", "0"]))


def test_ranges_are_hi_exclusive_everywhere() -> None:
    assert parse_range("500:3000", "--x") == (500, 3000)
    assert parse_range("1,000", "--x") == (1000, 1001)  # one number: exactly that length
    for bad in ("9:9", "0:5", "abc", "1:2:3", "5:3"):
        with pytest.raises(UserError, match="HI exclusive"):
            parse_range(bad, "--random-input-len")
    lengths = {r.prompt_tokens for r in generate_workload(WorkloadSpec(400, (10, 13), (1, 2)))}
    assert lengths == {10, 11, 12}


def test_vocab_token_ids_are_ordinary_seeded_and_share_the_prefix() -> None:
    special = {0, 1, 2}
    vocab = ordinary_token_ids(500, special)
    spec = WorkloadSpec(30, (20, 60), (1, 5), shared_prefix_fraction=0.5, shared_prefix_tokens=16, seed=9)
    workload = generate_workload(spec)
    first, again, other = VocabTokenIds(vocab, seed=9), VocabTokenIds(vocab, seed=9), VocabTokenIds(vocab, seed=10)
    first, again, other = ([source.prompt(r) for r in workload] for source in (first, again, other))
    assert first == again and first != other
    assert [len(p) for p in first] == [r.prompt_tokens for r in workload]
    assert not special & {t for p in first for t in p}
    shared = [p for p, r in zip(first, workload, strict=True) if r.shared_prefix_tokens]
    assert len(shared) >= 2 and all(p[:16] == shared[0][:16] for p in shared)
    unshared = [p for p, r in zip(first, workload, strict=True) if not r.shared_prefix_tokens]
    assert len({tuple(p[:16]) for p in unshared}) == len(unshared)  # no accidental common prefixes
