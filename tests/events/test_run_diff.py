"""The fold and the verdict behind ``engine diff`` (engine/events/folds/run_diff.py): batch-shape
classes, the bootstrap interval of a median ratio on seeded samples, the threshold, and
the comparability check over recordings of the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from engine.events import read_events
from engine.events.folds.run_diff import (
    IMPROVEMENT,
    ONLY_IN_A,
    REGRESSION,
    TOO_FEW,
    UNCHANGED,
    BatchShape,
    comparability,
    compare_samples,
    diff_runs,
    median_ratio_interval,
    profile_run,
)
from engine.sim.replay import recorded_flags
from tests.paths import ROOT

SAMPLE = ROOT / "samples" / "smollm2_run.jsonl"


@pytest.mark.parametrize(("prefill", "decode", "labels"), [
    (0, 0, ("0", "0")), (0, 1, ("0", "1")), (0, 3, ("0", "2-3")), (1, 4, ("1-64", "4-7")),
    (64, 15, ("1-64", "8-15")), (65, 16, ("65-256", "16-31")), (512, 0, ("257-1024", "0")),
    (16384, 255, ("4097-16384", "128-255")), (16385, 256, (">16384", "256-511")),
])
def test_batch_shape_classes(prefill: int, decode: int, labels: tuple[str, str]) -> None:
    shape = BatchShape.of(prefill, decode)
    assert (shape.prefill_label, shape.decode_label) == labels


def test_interval_of_the_median_ratio_covers_the_true_ratio_and_is_seeded() -> None:
    rng = np.random.default_rng(7)
    a = rng.lognormal(np.log(0.020), 0.2, 200)
    b = rng.lognormal(np.log(0.030), 0.2, 200)  # 1.5x slower
    ratio, low, high = median_ratio_interval(a, b)
    assert low < 1.5 < high and 1.3 < ratio < 1.7
    assert median_ratio_interval(a, b) == (ratio, low, high)  # the same seed, the same interval


def test_verdicts_regression_noise_small_change_and_too_few() -> None:
    rng = np.random.default_rng(1)
    base = rng.lognormal(np.log(0.020), 0.15, 150)
    same = rng.lognormal(np.log(0.020), 0.15, 150)  # another draw of the same distribution
    slow = base * 1.5
    slightly = base * 1.04  # certainly slower, but less than the threshold
    assert compare_samples("s", base, slow, 0.10).verdict == REGRESSION
    assert compare_samples("s", slow, base, 0.10).verdict == IMPROVEMENT
    assert compare_samples("s", base, same, 0.10).verdict == UNCHANGED
    assert compare_samples("s", base, slightly, 0.10).verdict == UNCHANGED
    assert compare_samples("s", base, slightly, 0.02).verdict == REGRESSION
    assert compare_samples("s", base[:4], slow[:4], 0.10).verdict == TOO_FEW
    assert compare_samples("s", base, [], 0.10).verdict == ONLY_IN_A


def test_one_outlier_moves_no_verdict() -> None:
    """A mean would call this 2x slower; the median sees one stalled step among 100."""
    a = [0.010] * 100
    b = [0.010] * 99 + [1.0]
    assert np.mean(b) / np.mean(a) > 1.9
    assert compare_samples("s", a, b, 0.10).verdict == UNCHANGED


def profile(path):
    recording = read_events(path)
    return profile_run(recording.events, recorded_flags(recording), name=str(path))


def test_a_real_recording_against_itself_is_unchanged_everywhere() -> None:
    run = profile(SAMPLE)
    diff = diff_runs(run, run)
    assert diff.comparable and diff.exit_status == 0 and not diff.regressions
    assert run.kv_blocks == 45 and run.tally.preemptions == 14 and len(run.workload) == 40
    assert set(run.phases) == set("ABCDEFG") and run.phases["C"].seconds > 0
    judged = [c for _, c in diff.shapes if c.verdict != TOO_FEW]
    assert judged and all(c.ratio == 1.0 and c.verdict == UNCHANGED for c in judged)
    # every step lands in exactly one shape
    assert sum(len(v) for v in run.step_seconds.values()) == run.steps == 295


def test_comparability_names_the_fields_that_differ() -> None:
    a = profile(SAMPLE)
    b = profile(SAMPLE)
    b.flags["max_num_seqs"] = 8
    b.flags["events_path"] = "elsewhere.jsonl"  # where a run was recorded changes nothing
    b.model["num_layers"] = 31
    b.workload = b.workload[:-1]
    fields = {(d.kind, d.field) for d in comparability(a, b)}
    assert fields == {("flags", "max_num_seqs"), ("model", "num_layers"), ("workload", "requests"),
                      ("workload", "prompt_tokens"), ("workload", "max_tokens")}
