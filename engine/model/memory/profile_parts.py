"""Phase D's profile run on CPU in parts: the worst-case step's peak bytes, each part measured
where it is cheap and scaled exactly, kept as a function of the step's tokens.

The whole run (one forward of ``--max-num-batched-tokens`` over ``--max-num-seqs`` sequences,
then the sampler over ``--max-num-seqs`` x vocabulary logits) took 8.6 s at load 1.5 and
174-446 s at load 8-20 for Qwen2.5-0.5B (vocabulary 151,936) on 2 Zen 4 cores: ~1.5 TFLOP of
forward at 2,048 tokens, a 256 x 151,936 LM head and the sampler's top-k, softmax and noise
over 155 MB tensors. Its bytes do not need that time:

* the layers' activations are linear in the step's tokens (each layer frees its temporaries
  before the next; two layers of Qwen2.5-0.5B's shapes held 89,232 bytes a token from 128 to
  4,096 tokens, to the byte): the forward is measured at two step sizes (``POINT_TOKENS``, in
  sequences as long as the budgets the line must hold for give: :func:`forward_points`) and the
  line is evaluated at the budget in force, so a stored profile stays valid when a kernel plan
  changes the budget. A step of at most ``POINT_TOKENS[-1]`` tokens, or one whose points would
  cost more than itself, is measured whole (``ModelRunner.profile_run``);
* the sampler's tensors are ``[rows, vocab]``: it is measured at two row counts and scaled to
  ``--max-num-seqs`` rows (exact: nothing in it depends on the rows otherwise). The LM head runs
  once over ``--max-num-seqs`` rows: its time is mostly reading (or widening) the whole
  vocabulary's weights (a bf16 head of 151,936 x 896: 12 s at 8 rows, 19 s at 256, at load 12);
* the step's peak is the largest of its three phases: the layers; the LM head over what the
  layers leave live (the hidden states, linear in tokens); the sampler, after the forward's
  tensors are freed (as the engine samples: the whole batch at once).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.memory.profile_cache import ProfileResult
    from engine.model.runner import ModelRunner

POINT_TOKENS = (128, 256)  # both in the plan's largest step class (65+ rows): one route for all three
POINT_SEQ_TOKENS = 8  # tokens a sequence at the points: 2,048 over 256, the default step's shape
ROWS_MEASURED = 16  # the sampler is measured at this many rows and half as many


@dataclass(frozen=True, slots=True)
class Line:
    """Bytes at two x values (tokens or rows); linear between and beyond."""

    x: tuple[int, int]
    y: tuple[int, int]

    def at(self, x: int) -> int:
        (x1, x2), (y1, y2) = self.x, self.y
        if x1 == x2:
            return max(y1, y2)
        return max(0, math.ceil(y1 + (y2 - y1) * (x - x1) / (x2 - x1)))


@dataclass(frozen=True, slots=True)
class PeakFunction:
    """The step's peak bytes by its tokens (``--max-num-seqs`` fixed): see the module docstring."""

    forward: Line  # the layers' peak, by step tokens
    head_base: Line  # bytes live when the LM head starts (the layers' output, the step's inputs), by step tokens
    head_bytes: int  # what the LM head adds over --max-num-seqs rows (measured there)
    sampler_base: Line  # bytes the step leaves live while it samples (its inputs, the backend's state), by tokens
    sampler_bytes: int  # the logits and the sampler's pass over --max-num-seqs rows
    rows: tuple[int, int]  # the row counts the sampler was measured at
    seqs: tuple[int, int]  # the sequences of each forward point

    def at(self, tokens: int) -> int:
        return max(self.forward.at(tokens), self.head_base.at(tokens) + self.head_bytes,
                   self.sampler_base.at(tokens) + self.sampler_bytes)

    def describe(self, max_num_seqs: int) -> str:
        """What was measured, for phase D's event and log (the event's max_num_batched_tokens: where
        the line was evaluated)."""
        (t1, t2), (s1, s2), (r1, r2) = self.forward.x, self.seqs, self.rows
        return (f"the forward at {t1:,} and {t2:,} tokens ({s1} and {s2} sequences), linear in the step's "
                f"tokens; the LM head over {max_num_seqs} rows; the sampler at {r1} and {r2} rows, linear in rows, "
                f"at {max_num_seqs}")

    def to_json(self) -> dict[str, Any]:
        def line(value: Line) -> list[list[int]]:
            return [list(value.x), list(value.y)]

        return {"forward": line(self.forward), "head_base": line(self.head_base), "head_bytes": self.head_bytes,
                "sampler_base": line(self.sampler_base), "sampler_bytes": self.sampler_bytes,
                "rows": list(self.rows), "seqs": list(self.seqs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PeakFunction:
        """From :meth:`to_json`; ValueError, KeyError or TypeError if malformed."""
        def line(value: Sequence[Sequence[int]]) -> Line:
            (x1, x2), (y1, y2) = value
            return Line((int(x1), int(x2)), (int(y1), int(y2)))

        r1, r2 = data["rows"]
        s1, s2 = data["seqs"]
        return cls(line(data["forward"]), line(data["head_base"]), int(data["head_bytes"]),
                   line(data["sampler_base"]), int(data["sampler_bytes"]), (int(r1), int(r2)), (int(s1), int(s2)))


Points = tuple[tuple[int, int], tuple[int, int]]  # (tokens, sequences) of the two forwards


def forward_points(budget: int, max_num_seqs: int, cover: int | None = None) -> Points | None:
    """``(tokens, sequences)`` of the two forwards measured for ``budget``, the line to hold up to
    ``cover`` tokens (a budget a kernel plan may raise: the largest it can be; else ``budget``).
    Sequences of the longest the covered budgets give over ``max_num_seqs`` (at least
    ``POINT_SEQ_TOKENS``: attention's bytes grow with a sequence's tokens, so a line measured on
    longer ones is an upper bound on shorter ones), ``POINT_TOKENS[0]`` tokens and twice that. None
    where that costs more than the step itself, or the budget is at most ``POINT_TOKENS[-1]``: the
    whole step is measured then (``ModelRunner.profile_run``), at its budget only."""
    cover = max(budget, cover or budget)
    per_seq = max(POINT_SEQ_TOKENS, -(-cover // max_num_seqs))
    first = max(1, -(-POINT_TOKENS[0] // per_seq))
    seqs = (first, 2 * first) if 2 * first <= max_num_seqs else (max(1, max_num_seqs // 2), max_num_seqs)
    if (budget <= POINT_TOKENS[-1] and cover == budget) or sum(seqs) * per_seq * 2 > 3 * budget:
        return None
    return (seqs[0] * per_seq, seqs[0]), (seqs[1] * per_seq, seqs[1])


def row_points(max_num_seqs: int) -> tuple[int, int]:
    """The rows the sampler is measured at: ``ROWS_MEASURED`` and half, or fewer."""
    high = max(1, min(max_num_seqs, ROWS_MEASURED))
    return max(1, high // 2), high


@dataclass(frozen=True, slots=True)
class PartsMeasured:
    peak: PeakFunction
    forward_s: float  # the two forwards and the LM head
    sample_s: float  # the sampler at its two row counts


def applies(runner: ModelRunner) -> bool:
    """Whether the runner's step is measured in parts: one KV cache table (a hybrid layout's
    groups, with their null block, run the whole step: ``ModelRunner.profile_run``)."""
    return not runner.kv_cache_groups


METHOD = "TorchDispatchMode tensor-bytes tracking in parts"


def profile(runner: ModelRunner, points: Points, budget: int, max_num_seqs: int) -> ProfileResult:
    """Phase D's result from the parts at ``points`` (:func:`forward_points`), its peak at
    ``budget``; what the process's RSS grew by and no live tensor explains is non-torch."""
    import psutil

    from engine.model.memory.profile_cache import ProfileResult

    process = psutil.Process()
    rss = process.memory_info().rss
    parts = measure(runner, points, max_num_seqs)
    non_torch = max(0, process.memory_info().rss - rss)  # every tensor the parts made is freed
    return ProfileResult(parts.peak.at(budget), non_torch, f"{METHOD}: {parts.peak.describe(max_num_seqs)}",
                         parts.forward_s, parts.sample_s, time.time(), peak_function=parts.peak.to_json(),
                         tokens=budget, profiled_tokens=parts.peak.forward.x)


def measure(runner: ModelRunner, points: Points, max_num_seqs: int) -> PartsMeasured:
    """Measure ``runner``'s step in parts, the forward at ``points``; a KV cache of one block is
    made for it when none exists (the profile's sequences share it)."""
    temporary = not runner.kv_caches
    if temporary:
        runner.allocate_kv_cache(1)
    try:
        return _measure(runner, points, max_num_seqs)
    finally:
        if temporary:
            runner.kv_caches = []


def _measure(runner: ModelRunner, points: Points, max_num_seqs: int) -> PartsMeasured:
    """The parts. State a forward makes once and keeps (a kernel's first call, a cache) is
    counted at neither point: what the first point made and the second did not free is taken off
    the first's figures (phase D's RSS reading sees it), as the second never counts it; what a
    step keeps until the next (the backend's last step) stays counted. No warm-up forward: a
    24-layer float32 forward cost ~4.5 s at 8 tokens as at 128 (load 5, 2 cores)."""
    from engine.model.memory.device import TensorBytesTracker

    rows = row_points(max_num_seqs)
    start = time.perf_counter()
    peaks, live, kept, trackers, head = [], [], [], [], 0
    for tokens, seqs in points:
        with TensorBytesTracker() as tracker:
            hidden, prepared = _forward(runner, tokens, seqs)
        trackers.append(tracker)
        peaks.append(tracker.peak)
        live.append(tracker.current)  # the hidden states, the step's inputs, what the backend keeps
        if tokens == points[-1][0]:
            head = _head_bytes(runner, hidden, max_num_seqs)
        del hidden  # as a step samples: its logits made, its hidden states freed
        kept.append(tracker.current)
        del prepared
    made_once = trackers[0].current  # the first point's bytes that outlived the second step
    peaks[0], live[0], kept[0] = peaks[0] - made_once, live[0] - made_once, kept[0] - made_once
    middle = time.perf_counter()
    sampler = Line(rows, (_sampler_bytes(runner, rows[0]), _sampler_bytes(runner, rows[1])))
    xs = (points[0][0], points[1][0])

    def line(values: list[int]) -> Line:
        return Line(xs, (values[0], values[-1]))

    peak = PeakFunction(line(peaks), line(live), head, line(kept), sampler.at(max_num_seqs), rows,
                        (points[0][1], points[1][1]))
    return PartsMeasured(peak, middle - start, time.perf_counter() - middle)


def _forward(runner: ModelRunner, tokens: int, num_seqs: int) -> tuple[Any, Any]:
    """The layers over ``tokens`` spread over ``num_seqs`` sequences from position 0 (the remainder
    on the last; vLLM's dummy run's shape), sharing the cache's blocks: the hidden states, and the
    prepared step they came from (live while the LM head runs, as in a step)."""
    import torch

    from engine.model.runner import ScheduledSeq

    per_seq, extra = divmod(tokens, num_seqs)
    blocks = runner.num_blocks
    batch = []
    for i in range(num_seqs):
        n = per_seq + (extra if i == num_seqs - 1 else 0)
        batch.append(ScheduledSeq(f"profile-{i}", [0] * n, 0, [b % blocks for b in range(-(-n // runner.block_size))]))
    with torch.inference_mode():
        prepared = runner.prepare(batch)
        hidden = runner.model(prepared.input_ids, prepared.positions, runner.kv_caches, prepared.model_meta)
    return hidden, prepared


def _head_bytes(runner: ModelRunner, hidden: Any, rows: int) -> int:
    """What the LM head adds over ``rows`` of ``hidden``: the rows gathered, then its logits."""
    import torch

    from engine.model.memory.device import TensorBytesTracker

    index = torch.arange(rows, device=hidden.device) % hidden.shape[0]
    with torch.inference_mode(), TensorBytesTracker() as tracker:
        runner.model.compute_logits(hidden[index])
    return tracker.peak


def _sampler_bytes(runner: ModelRunner, rows: int) -> int:
    """The logits over ``rows`` and the sampler's pass over them with top-k and top-p on."""
    import torch

    from engine.core.sampling_params import SamplingParams
    from engine.model.memory.device import TensorBytesTracker

    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    with torch.inference_mode(), TensorBytesTracker() as tracker:
        logits = torch.randn(rows, runner.model_config.vocab_size, dtype=torch.float32, device=runner.device)
        runner.sampler.sample(logits, [params] * rows)
    return tracker.peak
