"""The work of one forward pass as the roofline counts it (background parts 4 and 6),
defined once for its two readers: ``engine simulate``'s cost model turns it into
seconds (:class:`engine.sim.simulate.CostModel`), and ``/metrics`` adds it up as vLLM's
MFU estimates (``vllm:estimated_flops_per_gpu_total`` and the read/write bytes
counters, :mod:`engine.events.exporters.metrics`)::

    FLOPs         = 2 x parameters x tokens computed
    bytes read    = weights + KV bytes of every scheduled request's context
    bytes written = KV bytes of the tokens computed

A mixture-of-experts model counts what the router makes a step use: FLOPs over the active
parameters (each token runs its top-k experts of each MoE layer), and of the expert weights
only the experts some token of the step was routed to, expected ``E (1 - (1 - k/E)^N)`` of a
layer's ``E`` for ``N`` tokens routed uniformly (a decode of one sequence reads k/E of them;
a 512-token prefill of Qwen3-30B-A3B's 128 experts, top-8, reads all but ~0).

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
    """A decoder's per-GPU sizes, enough to count a step's work; a MoE model's experts too."""

    num_parameters: int
    weights_bytes: int
    bytes_per_kv_token: int
    # Mixture of experts (0: dense): the experts' parameters and bytes (inside the totals above),
    # experts per MoE layer and the router's top-k.
    expert_parameters: int = 0
    expert_weights_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0

    @property
    def active_parameters(self) -> int:
        """The parameters one token uses: all but the experts its router did not pick."""
        if not self.num_experts:
            return self.num_parameters
        idle = self.num_experts - self.experts_per_token
        return self.num_parameters - self.expert_parameters * idle // self.num_experts

    def experts_read(self, num_tokens: int) -> float:
        """Expected share of a MoE layer's experts that ``num_tokens`` tokens route to (uniform routing)."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens

    def flops(self, num_tokens: int) -> float:
        return 2.0 * self.active_parameters * num_tokens

    def read_bytes(self, kv_tokens_read: int, num_tokens: int | None = None) -> int:
        """Weights and KV read; a MoE model's idle experts are not read when ``num_tokens`` is given."""
        weights = self.weights_bytes
        if self.num_experts and num_tokens is not None:
            weights -= round(self.expert_weights_bytes * (1.0 - self.experts_read(num_tokens)))
        return weights + kv_tokens_read * self.bytes_per_kv_token

    def write_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_kv_token

    def step(self, num_tokens: int, kv_tokens_read: int) -> StepWork:
        """``num_tokens`` computed (prefill and decode together) over ``kv_tokens_read``
        KV entries (:attr:`engine.core.scheduler.SchedulerOutput.kv_tokens_read`)."""
        return StepWork(self.flops(num_tokens), self.read_bytes(kv_tokens_read, num_tokens),
                        self.write_bytes(num_tokens))
