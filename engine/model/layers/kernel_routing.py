"""How a decoder model's projections run: each projection's kernel bound, the kernel plan's
route for each projection and the LM head, the fused C++ decode layer, and the float weights
no routed step multiplies by.

Each projection (:class:`~engine.model.layers.projection_linear.ProjectionLinear`) decides per
step between the plan's route, its blocks' bound kernel up to ``max_rows`` and its float weight.
:class:`KernelRouting` (``model.routing``) sets what it decides by: it binds the kernels (the
limits ``GEMV_MAX_ROWS`` where no plan is installed), installs the plan's routes, decides whether
pure-decode steps run each layer as one C++ call, drops the float weights the plan never uses (a
GGUF's own blocks make them again), and says which parts of a step run in which precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.loading import weight_blocks
from engine.model.loading.weight_blocks import PROJECTIONS

# Token rows (a step's tokens) up to which the GEMV kernel beats torch's float32 GEMM, per
# kernel ISA: per format for the projections, and for the LM head (49152 x 576, where float
# GEMM is slowest per row). AVX2 (Zen 3, 1 thread, shared machine, bench/bench_gemv.py, µs
# fp32 -> q4_1): 8 rows qkv 966 -> 275, down 1320 -> 719, head 70738 -> 15217; 16 rows
# qkv 1010 -> 608, gate_up 3104 -> 1862 but down 618 -> 1281 (the kernel's FMAs grow with
# rows, GEMM's do not), head 72022 -> 31841. q4_1x8 (int8 activations, 32 products per
# maddubs) beats float GEMM at every step size: AVX2, 2 threads, weights streamed from
# memory, fp32 -> q4_1x8 µs: gate_up 8 rows 1458 -> 165, 64 rows 2652 -> 1075, 512 rows
# 14822 -> 9483; down 512 rows 6020 -> 4283. AVX-512 is not measured yet: AVX2's limits.
EVERY_STEP = 1 << 30
GEMV_MAX_ROWS: dict[str, dict[str, int]] = {
    "avx2": {"q8_0": 8, "q4_1": 8, "q4_1x8": EVERY_STEP, "head": 16},
    "avx512": {"q8_0": 8, "q4_1": 8, "q4_1x8": EVERY_STEP, "head": 16},
    "scalar": {"q8_0": 1, "q4_1": 1, "q4_1x8": 1, "head": 1},
}
# The kernel plan's group of each projection (engine/model/plan/kernel_plan.py GROUP_ATTRS), and back.
GROUP_OF = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}
GROUP_ATTRS = {**{group: name for name, group in GROUP_OF.items()}, "head": "head"}


# Phase F's ``precision`` of prefill attention where the kernel plan gave every chunk size to the
# paged prefill kernel (engine/model/attention/cpu_decode.py).
PAGED_PREFILL = "the paged prefill kernel over the cache in place, float32 sums (the kernel plan)"
PAGED_PREFILL_BF16 = ("the paged prefill kernel over the cache in place, bf16 products (q and the softmax weights "
                      "rounded to bf16), float32 sums (the kernel plan)")


class KernelRouting:
    """The kernels and routes of ``model`` (a :class:`~engine.model.families.llama.LlamaForCausalLM`),
    and what other modules read of them: ``plan`` (the installed kernel plan; None: the constants),
    ``fused_layers`` (each layer's fixed arguments to the fused decode layer, or empty) and
    ``pending`` (blocks installed, kernels not bound yet: the first forward binds them). A family
    whose layers the fused layer does not serve says why in ``model.fused_layer_refusal``."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.plan: Any = None  # engine/model/plan/kernel_plan.KernelPlan once installed; None: the constants
        self.pending = False
        # Pure-decode steps of at most cpu_layer.MAX_ROWS sequences run each layer as one C++
        # call (engine/model/kernels/cpu_layer.py) when every layer qualifies; set by resolve.
        self.fused_layers: list[tuple[tuple[object, ...], tuple[object, ...]]] = []
        self.fused_max_rows = 1 << 30  # the plan's limit for fused pure-decode steps (cpu_layer.MAX_ROWS caps it)
        self.fallback: str | None = None  # why the quantized copies are not used

    def bind_pending(self) -> None:
        """Bind the kernels of blocks installed since the last :meth:`resolve` (a forward's first step)."""
        if self.pending:
            self.resolve()

    def resolve(self) -> str | None:
        """Point every quantized projection at its kernel, or record (and log) why some run their
        float weights: no compiler, a kernel switched off, not on CPU. Returns that reason,
        or None when the kernels are in use."""
        from engine.model.kernels import cpu_gemv

        model = self.model
        self.pending = False
        self.fused_layers = []
        if not weight_blocks.quantized_linears(model):
            if self.plan is not None:
                self.route_by_plan(None)
            return None
        self.fallback = weight_blocks.bind(model)
        if self.fallback is not None:
            from engine.logs import get_logger

            get_logger("kvscope.quantization").warning(self.fallback)
        gemv_kernel = cpu_gemv.load_kernel() if model.embed_tokens.device.type == "cpu" else None
        isa = gemv_kernel.isa() if gemv_kernel is not None else "scalar"
        limits = GEMV_MAX_ROWS.get(isa, GEMV_MAX_ROWS["scalar"])
        for projection in weight_blocks.quantized_projections(model):
            q = projection.blocks
            if q is None or q.gemv is None:
                continue
            # A weight read as blocks has no float copy for torch past the limit: its kernel runs every step.
            limit = "head" if projection.name == "head" else q.fmt
            q.max_rows = limits[limit] if projection.holds_float() and q.fmt in limits else EVERY_STEP
        if self.plan is not None:
            self.route_by_plan(gemv_kernel)
        self.fused_layers = self.fused_args()
        if self.plan is not None and self.drop_unused_float_weights():
            self.fused_layers = self.fused_args()  # the args held the dropped parameters
        return self.fallback

    def fused_args(self) -> list[tuple[tuple[object, ...], tuple[object, ...]]]:
        fused = [layer.fused_decode_args() for layer in self.model.layers]
        return [f for f in fused if f is not None] if fused and all(f is not None for f in fused) else []

    def install_plan(self, plan: Any) -> None:
        """Run by ``plan`` (engine/model/plan/): each projection's route by step size,
        the copies it uses (bf16, int8; buffers, so ``weights_bytes`` counts them) made now,
        the fused layer's GEMV limits and row limit from the plan."""
        from engine.model.plan.kernel_plan import ATTENTION

        model = self.model
        self.plan = plan
        if hasattr(model.backend, "prefill_attention"):
            model.backend.prefill_attention = tuple(plan.choices(ATTENTION))
        self.resolve()

    def route_by_plan(self, kernel: Any) -> None:
        """Each projection's and the head's route from the plan's choices (a choice of the GEMV
        where no kernel is bound runs torch), the copies the routes use held as buffers."""
        from engine.model.kernels.cpu_layer import MAX_ROWS
        from engine.model.plan.candidates import BLOCK_CANDIDATES, PLAN_COPY_SUFFIXES
        from engine.model.plan.routes import build_route

        plan = self.plan
        for projection in weight_blocks.projections(self.model).values():
            name, q = projection.name, projection.blocks
            group = "head" if name == "head" else GROUP_OF[name]
            usable = q is not None and q.gemv is not None
            choices = [(hi, "torch" if c == "gemv" and not usable else c) for hi, c in plan.choices(group)]
            weight = projection.weight
            if not projection.holds_float() and any(c not in BLOCK_CANDIDATES for _, c in choices):
                # not held (read as blocks, or an earlier plan dropped it); this plan multiplies by it
                weight = projection.restore_float()
            projection.route, extra = build_route(choices, weight, q, kernel, group)
            module = projection.owner
            for suffix in PLAN_COPY_SUFFIXES:  # an earlier plan's copies
                module._buffers.pop(f"{name}_{suffix}", None)
            for suffix, tensor in extra.items():
                module.register_buffer(f"{name}_{suffix}", tensor, persistent=False)
            if q is not None:
                # The fused decode layer (pure decodes up to the plan's fused_max_rows, which the plan
                # times against these routes at every class) runs its GEMV at every size it serves:
                # its only other path is a dense at::linear, which reorders a bf16 weight on every
                # call (Zen 4: 16-row decode steps took 80 ms on it against ~25 ms on the GEMV).
                q.max_rows = (MAX_ROWS if name != "head" else plan.gemv_limit(group)) if usable else 0
        self.fused_max_rows = plan.fused_max_rows

    def fallback_candidate(self, group: str, rows: int) -> str:
        """What the constants (``GEMV_MAX_ROWS``) run for ``group`` (a kernel plan group) at
        ``rows``: the kernel plan's choice for cells it did not measure."""
        self.bind_pending()
        module = self.model if group == "head" else self.model.layers[0]
        q = module.projections[GROUP_ATTRS[group]].blocks
        return "gemv" if q is not None and q.gemv is not None and rows <= q.max_rows else "torch"

    # ------------------------------------------------------------------ weights the plan never multiplies by
    def float_weight_unused(self, projection: Any) -> bool:
        """True when no step the kernel plan routes multiplies by a layer ``projection``'s float
        weight: the GEMV (or a bf16/int8 copy) at every step size, and the fused layer (if on)
        never past its GEMV limit on the float weight. Only a GGUF's own blocks: their values are
        the float weights exactly, so ``restore_float_weights`` can make them again."""
        from engine.model.kernels.cpu_layer import MAX_ROWS

        q = projection.blocks
        if q is None or q.gemv is None or q.source != "gguf":
            return False
        if any(c == "torch" for _, c in self.plan.choices(GROUP_OF[projection.name])):
            return False
        fused_rows = min(self.fused_max_rows, MAX_ROWS) if self.fused_layers else 0
        return fused_rows <= q.max_rows

    def drop_unused_float_weights(self) -> int:
        """Replace each layer projection's float weight that the plan never multiplies by with a
        placeholder of its shape that holds one element (``weights_bytes`` counts nothing for
        it; phase C's ``kernel_plan_bytes`` goes down by it). Returns the bytes dropped."""
        dropped = 0
        for layer in self.model.layers:
            for name in PROJECTIONS:
                projection = layer.projections[name]
                if projection.holds_float() and self.float_weight_unused(projection):
                    dropped += projection.drop_float()
        return dropped + self.drop_unused_head_weight()

    def drop_unused_head_weight(self) -> int:
        """The LM head's float weight when no step multiplies by it (the plan routes every step size
        to the GEMV or to a copy of its own) and its GGUF blocks make it again. A tied head is the
        embedding: dropped only where the embedding reads its rows from the blocks too (Gemma 3
        270M's 262,144 x 640 head: 640 MiB, held beside its 640 MiB fp32pack copy before)."""
        model = self.model
        head = model.projections["head"]
        q = head.blocks
        if (q is None or q.gemv is None or q.source != "gguf" or not head.holds_float()
                or any(c == "torch" for _, c in self.plan.choices("head"))
                or (model.lm_head is None and model._embed_blocks is None)):
            return 0
        return int(head.drop_float())

    def dropped_float_bytes(self) -> int:
        """Bytes of the float weights the kernel plan dropped (phase C's ``kernel_plan_dropped_bytes``)."""
        return sum(p.float_bytes() for p in weight_blocks.projections(self.model).values() if not p.holds_float())

    # ------------------------------------------------------------------ the fused decode layer
    def layer_kernel_for(self, meta: AttentionMetadata, kv_caches: Sequence[torch.Tensor]) -> Any:
        """The fused-layer kernel module when this step can use it: a pure decode of at
        most ``cpu_layer.MAX_ROWS`` sequences, the paged-decode kernel switched on (phase F),
        a float32 or int8 cache, and the kernel built (else None: the op-by-op path)."""
        from engine.model.kernels import cpu_layer

        model = self.model
        rows = meta.slot_mapping.shape[0]
        if (not self.fused_layers or not meta.is_pure_decode or rows > cpu_layer.MAX_ROWS
                or rows > self.fused_max_rows):
            return None
        if getattr(model.backend, "decode_kernel", None) is None or kv_caches[0].dtype not in cpu_layer.KV_DTYPES:
            return None
        return cpu_layer.load_kernel()

    def fused_decode_status(self, kv_cache_dtype: torch.dtype) -> str:
        """Whether pure-decode steps run each layer as one C++ call, for phase F's event:
        ``"enabled for pure-decode steps of <= N rows"`` or why not."""
        from engine.model.kernels import cpu_layer

        model = self.model
        refusal = getattr(model, "fused_layer_refusal", None)
        if refusal is not None:
            return f"off: {refusal}"
        self.bind_pending()
        if not self.fused_layers:
            if not weight_blocks.quantized_linears(model):
                return "off: no quantized projections (--quantization int8/int4 or a Q4_1/Q8_0 GGUF)"
            if self.fallback is not None:
                return "off: the CPU GEMV kernel is unavailable"
            return f"off: {model.dtype} weights (the fused layer serves float32)"
        if kv_cache_dtype not in cpu_layer.KV_DTYPES:
            return f"off: {kv_cache_dtype} KV cache (the fused layer serves float32, bfloat16 and int8)"
        if getattr(model.backend, "decode_kernel", None) is None:
            return "off: the paged-decode kernel is not in use"
        if cpu_layer.load_kernel() is None:
            return f"off: {cpu_layer.KERNEL.unavailable_reason or 'the kernel could not be built'}"
        if self.plan is not None:
            if not self.fused_max_rows:
                return "off: the kernel plan measured the op-by-op layer faster"
            return (f"enabled for pure-decode steps of <= {min(self.fused_max_rows, cpu_layer.MAX_ROWS)} sequences "
                    "(the kernel plan's measurement)")
        head = model.projections["head"].blocks
        gemv_rows = min(q.max_rows for q in weight_blocks.quantized_linears(model) if q is not head)
        return (f"enabled for pure-decode steps of <= {cpu_layer.MAX_ROWS} sequences "
                + ("(GEMV at every batch size)" if gemv_rows >= cpu_layer.MAX_ROWS
                   else f"(GEMV up to {gemv_rows} rows, float GEMM above)"))

    # ------------------------------------------------------------------ precision
    def precision_report(self, kv_cache_dtype: torch.dtype) -> dict[str, str]:
        """Which parts of a CPU step run in bf16 and which in float32 (phase F's ``precision``):
        the activations' dtype, or under a float32 model the kernel plan's bf16 choices."""
        from engine.model.plan.kernel_plan import ATTENTION, STEP_CLASSES

        self.bind_pending()
        model = self.model
        name = str(model.dtype).removeprefix("torch.")
        bf16_model = model.dtype == torch.bfloat16
        projections = self.planned_classes(("qkv", "o", "gate_up", "down"))
        attention = self.planned_classes((ATTENTION,))
        paged = self.planned_classes((ATTENTION,), "paged")
        paged_bf16 = self.planned_classes((ATTENTION,), "paged_bf16")
        every_class = f"{ATTENTION} " + ",".join(sc.name for sc in STEP_CLASSES if sc.lo > 1)
        sdpa = ("torch SDPA in bfloat16" if bf16_model else
                f"torch SDPA in float32; bf16 for chunks of {attention.split(' ', 1)[1]} rows (the kernel plan)"
                if attention else f"torch SDPA in {name}")
        report = {
            "activations": name,
            "rms_norm": f"{name} in and out, float32 sums",
            "projections": ("bfloat16 weights and activations (bf16 GEMM; the GEMV over GGUF blocks sums in float32)"
                            if bf16_model else f"float32; bf16 GEMM (the kernel plan) for {projections}"
                            if projections else name),
            "prefill_attention": (
                PAGED_PREFILL if paged == every_class else PAGED_PREFILL_BF16 if paged_bf16 == every_class
                else sdpa + (f"; the paged prefill kernel, float32 sums, for chunks of {paged.split(' ', 1)[1]} rows "
                             "(the kernel plan)" if paged else "")
                + (f"; the paged prefill kernel with bf16 products, float32 sums, for chunks of "
                   f"{paged_bf16.split(' ', 1)[1]} rows (the kernel plan)" if paged_bf16 else "")),
            "decode_attention": f"{name} queries over a {str(kv_cache_dtype).removeprefix('torch.')} cache, "
                                "float32 sums",
            "lm_head": "float32 sums, float32 logits (bf16 weights widened exactly)" if bf16_model
                       else "float32 sums, float32 logits",
        }
        if self.fused_layers:
            report["fused_decode_layer"] = "float32 activations, the GEMV over the GGUF blocks"
        return report

    def planned_classes(self, groups: Sequence[str], candidate: str = "bf16") -> str:
        """``group classes`` the plan runs by ``candidate``, e.g. "gate_up 33-64,65+" ("": no plan)."""
        from engine.model.plan.kernel_plan import STEP_CLASSES

        if self.plan is None:
            return ""
        parts = []
        for group in groups:
            steps = [sc.name for sc in STEP_CLASSES if (c := self.plan.cell(group, sc.name)) and c.chosen == candidate]
            if steps:
                parts.append(f"{group} {','.join(steps)}")
        return "; ".join(parts)
