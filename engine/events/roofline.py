"""The work of one forward pass as the roofline counts it (background parts 4 and 6),
defined once for its two readers: ``engine simulate``'s cost model turns it into
seconds (:class:`engine.sim.simulate.CostModel`), and ``/metrics`` adds it up as vLLM's
MFU estimates (``vllm:estimated_flops_per_gpu_total`` and the read/write bytes
counters, :mod:`engine.events.metrics`)::

    FLOPs         = 2 x parameters x tokens computed
    bytes read    = weights + KV bytes of every scheduled request's context
    bytes written = KV bytes of the tokens computed

Every figure is per GPU: under tensor parallelism each rank holds 1/tp of the
parameters, the weights and the KV heads, so callers pass per-rank numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepWork:
    """One step's FLOPs and memory traffic on one GPU."""

    flops: float
    read_bytes: int
    write_bytes: int


@dataclass(frozen=True, slots=True)
class Roofline:
    """A dense decoder's per-GPU sizes, enough to count a step's work."""

    num_parameters: int
    weights_bytes: int
    bytes_per_kv_token: int

    def flops(self, num_tokens: int) -> float:
        return 2.0 * self.num_parameters * num_tokens

    def read_bytes(self, kv_tokens_read: int) -> int:
        return self.weights_bytes + kv_tokens_read * self.bytes_per_kv_token

    def write_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_kv_token

    def step(self, num_tokens: int, kv_tokens_read: int) -> StepWork:
        """``num_tokens`` computed (prefill and decode together) over ``kv_tokens_read``
        KV entries (:attr:`engine.core.scheduler.SchedulerOutput.kv_tokens_read`)."""
        return StepWork(self.flops(num_tokens), self.read_bytes(kv_tokens_read), self.write_bytes(num_tokens))
