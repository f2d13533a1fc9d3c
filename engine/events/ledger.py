"""The memory ledger's quantities, named once for every consumer.

``name`` is the field of the phase records (engine/events/phase_data.py) and of
``EngineView``'s ledger, in bytes or counts; ``label`` is what kvscope's screens
(``engine plan``, ``engine replay --at``, the dashboard, logparse) call it;
``vllm_phrase`` is what vLLM prints before the figure in its log (logparse's
diff and comparison show it); ``report_key`` the one key every JSON report uses for
it (``engine plan --json``, ``logparse explain --json``'s ledger and comparison rows;
bytes as GiB under a ``_gib`` key, in vLLM's words where vLLM prints the figure).
Imports nothing, so the events layer, the budget formula and logparse can all read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LedgerItem:
    name: str
    phase: str  # the startup phase whose record reports it
    label: str
    unit: str  # bytes | tokens | blocks | x | "" (a fraction)
    vllm_phrase: str = ""
    report_key: str = ""  # "" : the name itself, or for bytes the name with _gib for _bytes

    def __post_init__(self) -> None:
        if not self.report_key:
            key = self.name.removesuffix("_bytes") + "_gib" if self.unit == "bytes" else self.name
            object.__setattr__(self, "report_key", key)

    def report_value(self, value: float) -> float:
        """A value in this quantity's report unit (GiB for bytes)."""
        return value / 2**30 if self.report_key.endswith("_gib") else value


LEDGER: tuple[LedgerItem, ...] = (
    LedgerItem("total_bytes", "B", "device total", "bytes", "total_gpu_memory"),
    LedgerItem("gpu_memory_utilization", "B", "utilization", "", "gpu_memory_utilization"),
    LedgerItem("requested_bytes", "B", "requested", "bytes", "the current vLLM instance can use"),
    LedgerItem("weights_bytes", "C", "weights", "bytes", "Model loading took"),
    LedgerItem("vision_weights_bytes", "C", "vision weights", "bytes"),
    LedgerItem("activation_peak_bytes", "D", "activation peak", "bytes", "PyTorch activation peak memory",
               "peak_activation_gib"),
    LedgerItem("non_torch_bytes", "D", "non-torch", "bytes", "non_torch_memory"),
    LedgerItem("encoder_activation_peak_bytes", "D", "encoder activation peak", "bytes"),
    LedgerItem("encoder_cache_tokens", "D", "encoder cache budget", "tokens",
               "Encoder cache will be initialized with a budget of"),
    LedgerItem("encoder_cache_bytes", "D", "encoder cache", "bytes"),
    LedgerItem("mm_items_profiled", "D", "multimodal items profiled", "", "profiled with", "encoder_profile_items"),
    LedgerItem("cuda_graph_bytes", "F", "CUDA graphs", "bytes", "Graph capturing finished … took"),
    LedgerItem("kv_pool_bytes", "E", "KV cache pool", "bytes", "Available KV cache memory", "kv_cache_gib"),
    LedgerItem("num_blocks", "E", "KV blocks", "blocks", "# GPU blocks"),
    LedgerItem("block_size", "E", "block size", "tokens"),
    LedgerItem("kv_cache_tokens", "E", "KV tokens", "tokens", "GPU KV cache size"),
    LedgerItem("max_model_len", "E", "max model len", "tokens", "max_seq_len"),
    LedgerItem("max_concurrency", "E", "max concurrency", "x", "Maximum concurrency"),
    LedgerItem("bytes_per_token", "E", "bytes per KV token", "bytes", report_key="bytes_per_token"),
)
BY_NAME: dict[str, LedgerItem] = {item.name: item for item in LEDGER}
BY_REPORT_KEY: dict[str, LedgerItem] = {item.report_key: item for item in LEDGER}


def label(name: str) -> str:
    """The screen label of ledger quantity ``name``."""
    return BY_NAME[name].label
