"""Kernel plans that hold still (engine/model/plan/stability.py, engine/model/plan/): a
challenger replaces the incumbent only on the margin, over the median of interleaved rounds; a
start on a loaded machine neither stores over a quiet plan nor runs its own skewed choices where a
quiet plan exists, and a quiet start replaces a loaded plan. Every timing and load average here is
injected: nothing is timed."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.model.memory import profile_cache
from engine.model.plan import (
    choice,
    fused_layer,
    kernel_plan,
    measurement,
    resolve,
    setting,
    stability,
    store,
)
from engine.model.plan.choice import choose
from engine.model.plan.kernel_plan import STEP_CLASSES, Cell, KernelPlan

NO_ERROR = {"gemv": 1e-3, "torch": 0.0, "bf16": 2e-3}


def _cell(us: dict[str, float], incumbent: str = "", group: str = "qkv", step: str = "1") -> Cell:
    errors = {name: NO_ERROR[name] for name in us}
    return choose(Cell(group, step, 1, "960x576", us=dict(us), error=errors), incumbent=incumbent)


def test_a_challenger_replaces_the_incumbent_only_past_the_margin() -> None:
    assert pytest.approx(0.10) == stability.MARGIN
    within = _cell({"gemv": 100.0, "bf16": 95.0}, incumbent="gemv")  # 5 % faster: noise between quiet starts
    assert within.chosen == "gemv"
    assert within.why.startswith("kept as incumbent") and "5.3% faster" in within.why and "10% margin" in within.why
    past = _cell({"gemv": 100.0, "bf16": 85.0}, incumbent="gemv")  # 17.6 % faster
    assert past.chosen == "bf16" and "over the 10% margin against the incumbent gemv" in past.why
    assert _cell({"gemv": 110.0, "bf16": 100.0}, incumbent="gemv").chosen == "bf16"  # exactly the margin: replaced
    assert _cell({"gemv": 100.0, "bf16": 95.0}).chosen == "bf16"  # no incumbent: the fastest
    # an incumbent that fails the accuracy bound, or was not timed, is no incumbent
    wrong = choose(Cell("qkv", "1", 1, "", us={"gemv": 100.0, "bf16": 95.0}, error={"gemv": 0.5, "bf16": 0.0}),
                   incumbent="gemv")
    assert wrong.chosen == "bf16" and "gemv" in wrong.rejected
    assert _cell({"torch": 100.0, "bf16": 95.0}, incumbent="gemv").chosen == "bf16"


def test_rounds_are_interleaved_and_their_median_counts() -> None:
    """One lucky round (the GEMV's 50 µs in round two) does not decide: each candidate's median does."""
    script = {"gemv": iter([120e-6, 50e-6, 118e-6, 119e-6, 121e-6]), "bf16": iter([100e-6, 101e-6, 99e-6, 100e-6, 102e-6])}
    now, order = [0.0], []

    def clock() -> float:
        return now[0]

    def call(name: str) -> None:
        order.append(name)
        now[0] += next(script[name])

    calls = {name: (lambda n=name: call(n)) for name in script}
    us = choice.timed_round_robin(calls, reps=3, clock=clock)
    assert order == ["gemv", "bf16"] * choice.MAX_ROUNDS  # interleaved; a cheap cell takes every round
    assert us == pytest.approx({"gemv": 119.0, "bf16": 100.0})
    # cheap cells get up to MAX_ROUNDS rounds within the cell budget; never fewer than TIMED_REPS
    ticks = itertools.count()
    cheap = choice.timed_round_robin({"a": lambda: None}, clock=lambda: next(ticks) * 1e-6)
    assert cheap == pytest.approx({"a": 1.0})
    slow = itertools.count()
    rounds: list[int] = []
    choice.timed_round_robin({"a": lambda: rounds.append(1)}, clock=lambda: next(slow) * 1.0)
    assert len(rounds) == choice.TIMED_REPS


def test_the_fused_layer_changes_sides_only_past_the_margin() -> None:
    one, eight = STEP_CLASSES[:2]
    close = [(one, 100.0, 104.0, 1e-6), (eight, 400.0, 380.0, 1e-6)]  # 4 % and 5 % apart
    assert fused_layer.fused_rows_from(close, 256)[0] == 1  # no incumbent: the faster at each
    rows, notes = fused_layer.fused_rows_from(close, 256, incumbent_rows=256)  # the fallback: fused everywhere
    assert rows == 256 and notes[1].endswith("-> fused (kept as incumbent: within the margin)")
    assert fused_layer.fused_rows_from(close, 256, incumbent_rows=0)[0] == 0  # op by op was running: it stays
    clear = [(one, 100.0, 190.0, 1e-6), (eight, 400.0, 700.0, 1e-6)]
    assert fused_layer.fused_rows_from(clear, 256, incumbent_rows=0)[0] == 256
    assert fused_layer.fused_rows_from([(one, 80.0, 190.0, 0.5)], 256, incumbent_rows=256)[0] == 0  # wrong


def _plan(chosen: str, load: float, key: str = "k", when: float = 1.0, us: dict[str, float] | None = None,
          **fields: Any) -> KernelPlan:
    """Every layer group at every class timed ``us`` (gemv and bf16 passing), choosing ``chosen``."""
    us = us or {"gemv": 100.0, "bf16": 90.0}
    cells = [Cell(g, sc.name, sc.rows, "", us=dict(us), error={n: NO_ERROR[n] for n in us}, chosen=chosen,
                  why="fastest")
             for sc in STEP_CLASSES for g in kernel_plan.LAYER_GROUPS]
    return KernelPlan(cells=cells, isa="avx512", key=key, model="m", threads=2, cpus=2, load_average=load,
                      measured_at=when, fused_max_rows=256, **fields)


def test_measured_choices_hold_the_previous_quiet_plans_or_the_fallbacks() -> None:
    fresh = [Cell("qkv", "1", 1, "", us={"gemv": 100.0, "bf16": 95.0}, error={"gemv": 0.0, "bf16": 0.0})]
    measurement._hold_incumbents(fresh, None, lambda group, rows: "gemv")  # a first plan: the fallback's
    assert fresh[0].chosen == "gemv" and fresh[0].why.startswith("kept as incumbent")
    measurement._hold_incumbents(fresh, _plan("bf16", load=0.5), lambda group, rows: "gemv")
    assert fresh[0].chosen == "bf16"  # the previous quiet plan's choice is the incumbent
    measurement._hold_incumbents(fresh, _plan("bf16", load=17.0), lambda group, rows: "gemv")
    assert fresh[0].chosen == "gemv"  # a loaded plan's choices are no incumbents: the fallback's again
    note = stability.kept_note(fresh)
    assert note is not None and "qkv 1 gemv" in note
    assert stability.incumbent_fused_rows(_plan("gemv", 0.5, fused_timed=True), 256) == 256
    assert stability.incumbent_fused_rows(dataclasses.replace(_plan("gemv", 17.0), fused_max_rows=0), 256) == 256


def _target(candidates: list[str], blocks_only: bool = True) -> Any:
    import torch

    return measurement._Target("down", torch.zeros(8, 32), None, candidates, 640, None, blocks_only)


def test_a_weight_held_only_as_blocks_never_falls_back_to_the_row_by_row_gemv_past_one_row() -> None:
    """A cell the bound leaves unmeasured must not run a 2,048-token step through the plain GEMV
    (Gemma 3 270M's profile step: 73-98 s on it, ~4 s on x16)."""
    constants = lambda group, rows: "gemv"  # noqa: E731  (what KernelRouting's constants say for blocks-only weights)
    every = _target(["gemv", "x16", "dequant", "torch"])
    assert measurement.fallback_choice(every, 1, constants) == "gemv"  # one row: the GEMV is the decode kernel
    assert measurement.fallback_choice(every, 8, constants) == "x16"
    assert measurement.fallback_choice(every, 256, constants) == "x16"
    no_x16 = _target(["gemv", "dequant", "torch"])  # a CPU without the x16 fast path (AVX2)
    assert measurement.fallback_choice(no_x16, 8, constants) == "gemv"
    assert measurement.fallback_choice(no_x16, 256, constants) == "dequant"
    held = _target(["gemv", "x16", "dequant", "torch"], blocks_only=False)  # a float copy is held: the constants'
    assert measurement.fallback_choice(held, 256, constants) == "gemv"
    assert measurement.fallback_choice(every, 256, lambda group, rows: "torch") == "torch"


def test_an_unmeasured_cell_runs_the_incumbent_quiet_plans_choice_where_this_start_can() -> None:
    constants = lambda group, rows: "gemv"  # noqa: E731
    target = _target(["gemv", "x16", "dequant", "torch", "fp32pack"])
    quiet = _plan("fp32pack", load=0.5)
    assert measurement.unmeasured_choice(target, "65+", 256, quiet, constants) == "fp32pack"
    loaded = _plan("fp32pack", load=17.0)  # a loaded plan's choices are no incumbents
    assert measurement.unmeasured_choice(target, "65+", 256, loaded, constants) == "x16"
    assert measurement.unmeasured_choice(target, "65+", 256, None, constants) == "x16"
    elsewhere = _plan("bf16", load=0.5)  # a choice this start does not offer (another dtype, another CPU)
    assert measurement.unmeasured_choice(target, "65+", 256, elsewhere, constants) == "x16"


def test_a_loaded_measurement_gives_way_to_the_quiet_plan_and_is_not_stored_over_it() -> None:
    quiet = _plan("gemv", load=1.2, when=1.0)
    loaded = _plan("bf16", load=17.0, when=2.0)
    settled = stability.settle_measured(loaded, quiet, [])
    assert settled.plan.cells == quiet.cells and not settled.store
    assert "load average 17" in settled.plan.notes[-1] and "last quiet plan" in settled.plan.notes[-1]
    assert "not stored over a quiet plan" in settled.message
    # the same model and ISA under another key (another engine source): its choices run here
    other = _plan("gemv", load=0.8, key="older", when=0.5)
    first = stability.settle_measured(loaded, None, [other])
    assert first.plan.key == "older" and first.store  # nothing quiet under this key: the measurement is kept
    # a quiet measurement runs and replaces whatever was stored
    assert stability.settle_measured(quiet, loaded, [other]) == stability.Settled(quiet, True)
    # another configuration (other candidates timed) or ISA is no fallback
    float32 = _plan("torch", load=0.8, key="f32", us={"gemv": 100.0, "torch": 120.0})
    assert stability.settle_measured(loaded, None, [float32]).plan is loaded
    assert stability.settle_measured(loaded, None, [dataclasses.replace(other, isa="avx2")]).plan is loaded


def test_a_loaded_start_runs_the_last_quiet_plan_and_a_quiet_start_measures_again() -> None:
    loaded = _plan("bf16", load=17.0, when=2.0)
    quiet = [_plan("gemv", load=0.8, key="a", when=0.5), _plan("gemv", load=1.9, key="b", when=1.5),
             _plan("gemv", load=9.0, key="c", when=1.8)]
    settled = stability.settle_stored(loaded, load=12.0, others=quiet)
    assert settled.plan.key == "b" and "load is 12.00 now" in settled.message  # the newest quiet one
    assert stability.settle_stored(loaded, load=12.0, others=[]).plan is loaded  # nothing quiet: its own
    assert stability.settle_stored(loaded, load=1.0, others=quiet).plan is loaded
    assert stability.measured_overloaded(loaded, load=1.0)  # quiet now: measured again
    assert not stability.measured_overloaded(loaded, load=12.0)
    assert not stability.measured_overloaded(quiet[0], load=1.0)
    partial = dataclasses.replace(quiet[0], fused_timed=False)
    assert stability.defer_resume(partial, load=8.0) and not stability.defer_resume(partial, load=1.0)


class _Model:
    """What resolve() touches of a model, with nothing to measure (``measure`` is injected)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(name="m")
        self.backend = SimpleNamespace()
        self.projections = {"head": SimpleNamespace(blocks=None)}  # no blocks: nothing quantized
        self.layers: list[Any] = []
        self.installed: KernelPlan | None = None
        self.routing = SimpleNamespace(bind_pending=lambda: None, fallback_candidate=lambda group, rows: "gemv",
                                       install_plan=self.install)

    def install(self, plan: KernelPlan) -> None:
        self.installed = plan


def _start(monkeypatch: pytest.MonkeyPatch, load: float, measured: KernelPlan | None) -> tuple[KernelPlan, dict]:
    """One resolve() at ``load``; ``measured`` is what measuring would give (None: must not measure)."""
    seen: dict[str, Any] = {}

    def measure(*args: Any, **kwargs: Any) -> KernelPlan:
        assert measured is not None, "this start must not measure"
        seen.update(kwargs, measured=True)
        return dataclasses.replace(measured, cells=[dataclasses.replace(c) for c in measured.cells])

    monkeypatch.setattr(resolve, "measure", measure)
    monkeypatch.setattr(stability, "current_load", lambda: load)
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    model = _Model()
    plan = resolve.resolve(model, "k", native_bf16=True, isa="avx512")
    assert plan is not None and model.installed is plan
    return plan, seen


def test_starts_at_injected_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profile_cache.PROFILE_CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(setting.PLAN_ENV, raising=False)
    stored = tmp_path / store.PLANS_FOLDER / "k.json"
    quiet = _plan("gemv", load=1.0, when=1.0)
    _, seen = _start(monkeypatch, 1.0, quiet)  # a quiet first start: measured against the fallback, stored
    assert seen["incumbent"] is None and json.loads(stored.read_text())["cells"] == quiet.to_json()["cells"]
    assert _start(monkeypatch, 12.0, None)[0].source == "stored"  # a loaded start reuses the quiet plan
    monkeypatch.setenv(setting.PLAN_ENV, "measure")  # told to measure, on a loaded machine
    skewed = _plan("bf16", load=17.0, when=2.0)
    ran, seen = _start(monkeypatch, 17.0, skewed)
    assert seen["incumbent"].measured_at == 1.0  # measured against the quiet plan
    assert [c.chosen for c in ran.cells] == [c.chosen for c in quiet.cells] and "last quiet plan" in ran.notes[-1]
    assert json.loads(stored.read_text())["load_average"] == 1.0  # not stored over the quiet plan
    monkeypatch.delenv(setting.PLAN_ENV)
    stored.write_text(json.dumps({**skewed.to_json(), "source": "measured"}))  # a loaded plan is stored...
    store.store(dataclasses.replace(quiet, key="older", measured_at=0.5))  # ...and an older quiet one
    ran, _ = _start(monkeypatch, 12.0, None)  # still loaded: the quiet one runs, nothing measured
    assert ran.key == "older" and "last quiet plan" in ran.notes[-1]
    assert resolve.stored_for_start("k", "m", "avx512", load=12.0).key == "older"  # the budget's plan too
    replaced, seen = _start(monkeypatch, 1.0, _plan("gemv", load=0.9, when=3.0))  # quiet again: measured
    assert seen["measured"] and seen["incumbent"].key == "older"  # the last quiet plan's choices are the incumbents
    assert replaced.source == "measured" and json.loads(stored.read_text())["load_average"] == 0.9


def test_unmeasured_prefill_attention_runs_the_incumbent_quiet_plans_kernel() -> None:
    """Past the bound, attention keeps the quiet plan's paged kernel rather than per-sequence SDPA
    (Gemma 3 270M's 256-sequence profile step spent about half its time gathering K and V and running SDPA
    sequence by sequence, Zen 4)."""
    import torch

    from engine.model.plan.attention_cells import attention_cells

    model = SimpleNamespace(layers=[SimpleNamespace(num_heads=4, num_kv_heads=1, head_dim=64)])
    quiet = dataclasses.replace(_plan("gemv", load=0.5), cells=[
        Cell(kernel_plan.ATTENTION, sc.name, sc.rows, "", us={"paged": 1.0}, error={"paged": 0.0}, chosen="paged")
        for sc in STEP_CLASSES if sc.lo > 1])
    past = 0.0  # the deadline has passed
    cells = attention_cells(model, ("torch", "paged"), torch.Generator(), past, None, quiet)
    assert cells and all(c.chosen == "paged" and not c.measured and "incumbent" in c.why for c in cells)
    loaded = dataclasses.replace(quiet, load_average=17.0)
    assert all(c.chosen == "torch" for c in attention_cells(model, ("torch", "paged"), torch.Generator(), past,
                                                            None, loaded))
    no_kernel = attention_cells(model, ("torch",), torch.Generator(), past, None, quiet)  # the backend lacks it
    assert all(c.chosen == "torch" and "float32 SDPA" in c.why for c in no_kernel)
