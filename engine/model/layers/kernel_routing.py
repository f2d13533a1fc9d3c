"""How a decoder model's projections run: each quantized linear's kernel bound, the kernel
plan's route for each projection and the LM head, the fused C++ decode layer, and the float
weights no routed step multiplies by.

A projection (a layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, or the
model's LM head as ``"head"``) multiplies by one of three paths (:func:`linear_maybe_quantized`):
the kernel plan's route for its step size when a plan is installed
(engine/model/plan/); else its :class:`~engine.model.layers.quantized_linear.QuantizedLinear`'s
bound kernel for decode-sized steps (``GEMV_MAX_ROWS``); else the float weight through torch.
:class:`KernelRouting` is the model's side of that: it binds the kernels, installs the plan's
routes, decides whether pure-decode steps run each layer as one C++ call, and drops the float
weights the plan never uses (a GGUF's own blocks make them again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention.base import AttentionMetadata
from engine.model.loading import weight_blocks
from engine.model.loading.weight_blocks import PROJECTIONS, BlockHolder, holds_nothing

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


def linear_maybe_quantized(module: BlockHolder, x: torch.Tensor, name: str, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``: by the kernel plan's route for ``name`` and this step's
    rows when there is one (engine/model/plan/); else (the plan off) through the
    quantized copy when the step is decode-sized by ``GEMV_MAX_ROWS``, or the float weight."""
    route = module.kernel_routes.get(name)
    if route is not None:
        out = route(x)
        return out if bias is None else out + bias
    q = module.quantized.get(name)
    if q is None or x.shape[0] > q.max_rows:
        return F.linear(x, weight, bias)
    out = q.gemv(x)
    return out if bias is None else out + bias


def head_logits_on_cpu(model: Any, x: torch.Tensor) -> torch.Tensor | None:
    """The LM head's float32 logits of float32 rows ``x`` by the plan's route or the quantized
    head's GEMV (which sums in float32 and returns float32 rows); None: the float weight's turn."""
    route = model.kernel_routes.get("head")
    if route is not None:
        return route(x)
    q = model.quantized.get("head")
    if q is not None and q.gemv is not None and x.shape[0] <= q.max_rows:
        return q.gemv(x)
    return None


class KernelRouting:
    """The kernels and routes of ``model`` (a :class:`~engine.model.families.llama.LlamaForCausalLM`).
    The model keeps what other modules read: ``kernel_plan`` (None: the constants),
    ``_fused_layers`` (each layer's fixed arguments to the fused decode layer, or empty) and
    ``_gemv_pending`` (quantized, kernels not bound yet: the first forward binds them)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.fused_max_rows = 1 << 30  # the plan's limit for fused pure-decode steps (cpu_layer.MAX_ROWS caps it)
        self.fallback: str | None = None  # why the quantized copies are not used

    def resolve(self) -> str | None:
        """Point every quantized entry at its kernel, or record (and log) why some run their
        float weights: no compiler, a kernel switched off, not on CPU. Returns that reason,
        or None when the kernels are in use."""
        from engine.model.kernels import cpu_gemv

        model = self.model
        model._gemv_pending = False
        model._fused_layers = []
        if not model.quantized_linears():
            if model.kernel_plan is not None:
                self.route_by_plan(None)
            return None
        self.fallback = weight_blocks.bind(model)
        if self.fallback is not None:
            from engine.logs import get_logger

            get_logger("kvscope.quantization").warning(self.fallback)
        gemv_kernel = cpu_gemv.load_kernel() if model.embed_tokens.device.type == "cpu" else None
        isa = gemv_kernel.isa() if gemv_kernel is not None else "scalar"
        limits = GEMV_MAX_ROWS.get(isa, GEMV_MAX_ROWS["scalar"])
        for module, name, q in weight_blocks.entries_of(model):
            if q.gemv is None:
                continue
            held = not holds_nothing(getattr(module, weight_blocks.float_attr(model, module, name)))
            # A weight read as blocks has no float copy for torch past the limit: its kernel runs every step.
            q.max_rows = limits["head" if name == "head" else q.fmt] if held and q.fmt in limits else EVERY_STEP
        if model.kernel_plan is not None:
            self.route_by_plan(gemv_kernel)
        model._fused_layers = self.fused_args()
        if model.kernel_plan is not None and self.drop_unused_float_weights():
            model._fused_layers = self.fused_args()  # the args held the dropped parameters
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
        model.kernel_plan = plan
        if hasattr(model.backend, "prefill_attention"):
            model.backend.prefill_attention = tuple(plan.choices(ATTENTION))
        model.resolve_gemv()

    def route_by_plan(self, kernel: Any) -> None:
        """Each projection's and the head's route from the plan's choices (a choice of the GEMV
        where no kernel is bound runs torch), the copies the routes use held as buffers."""
        from engine.model.kernels.cpu_layer import MAX_ROWS
        from engine.model.plan.candidates import BLOCK_CANDIDATES, PLAN_COPY_SUFFIXES
        from engine.model.plan.routes import build_route

        model = self.model
        plan = model.kernel_plan
        for prefix, module in weight_blocks.quantized_modules(model).items():
            for name in ("head",) if prefix == "" else PROJECTIONS:
                group = "head" if name == "head" else GROUP_OF[name]
                q = module.quantized.get(name)
                usable = q is not None and q.gemv is not None
                choices = [(hi, "torch" if c == "gemv" and not usable else c) for hi, c in plan.choices(group)]
                weight = model.head_weight if name == "head" else getattr(module, name)
                if holds_nothing(weight) and any(c not in BLOCK_CANDIDATES for _, c in choices):
                    # not held (read as blocks, or an earlier plan dropped it); this plan multiplies by it
                    weight = weight_blocks.restore_float(model, module, name)
                route, extra = build_route(choices, weight, q, kernel, group)
                module.kernel_routes[name] = route
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
        model = self.model
        if model._gemv_pending:
            model.resolve_gemv()
        module = model if group == "head" else model.layers[0]
        q = module.quantized.get(GROUP_ATTRS[group])
        return "gemv" if q is not None and q.gemv is not None and rows <= q.max_rows else "torch"

    # ------------------------------------------------------------------ weights the plan never multiplies by
    def float_weight_unused(self, layer: Any, name: str) -> bool:
        """True when no step the kernel plan routes multiplies by ``layer``'s float ``name``:
        the GEMV (or a bf16/int8 copy) at every step size, and the fused layer (if on) never
        past its GEMV limit on the float weight. Only a GGUF's own blocks: their values are the
        float weights exactly, so ``restore_float_weights`` can make them again."""
        from engine.model.kernels.cpu_layer import MAX_ROWS

        q = layer.quantized.get(name)
        if q is None or q.gemv is None or q.source != "gguf":
            return False
        if any(c == "torch" for _, c in self.model.kernel_plan.choices(GROUP_OF[name])):
            return False
        fused_rows = min(self.fused_max_rows, MAX_ROWS) if self.model._fused_layers else 0
        return fused_rows <= q.max_rows

    def drop_unused_float_weights(self) -> int:
        """Replace each layer projection's float weight that the plan never multiplies by with a
        placeholder of its shape that holds one element (``weights_bytes`` counts nothing for
        it; phase C's ``kernel_plan_bytes`` goes down by it). Returns the bytes dropped."""
        dropped = 0
        for layer in self.model.layers:
            for name in PROJECTIONS:
                weight = getattr(layer, name)
                if holds_nothing(weight) or not self.float_weight_unused(layer, name):
                    continue
                dropped += weight.numel() * weight.element_size()
                placeholder = torch.zeros(1, 1, dtype=weight.dtype, device=weight.device).expand(weight.shape)
                setattr(layer, name, nn.Parameter(placeholder, requires_grad=False))
        return dropped + self.drop_unused_head_weight()

    def drop_unused_head_weight(self) -> int:
        """The LM head's float weight when no step multiplies by it (the plan routes every step size
        to the GEMV or to a copy of its own) and its GGUF blocks make it again. A tied head is the
        embedding: dropped only where the embedding reads its rows from the blocks too (Gemma 3
        270M's 262,144 x 640 head: 640 MiB, held beside its 640 MiB fp32pack copy before)."""
        model = self.model
        q = model.quantized.get("head")
        attr = weight_blocks.head_attr(model)
        weight = getattr(model, attr)
        if (q is None or q.gemv is None or q.source != "gguf" or holds_nothing(weight)
                or any(c == "torch" for _, c in model.kernel_plan.choices("head"))
                or (model.lm_head is None and model._embed_blocks is None)):
            return 0
        setattr(model, attr, weight_blocks.placeholder(weight))
        return weight.numel() * weight.element_size()

    def dropped_float_bytes(self) -> int:
        """Bytes of the float weights the kernel plan dropped (phase C's ``kernel_plan_dropped_bytes``)."""
        model = self.model
        head = getattr(model, weight_blocks.head_attr(model))
        return (sum(w.numel() * w.element_size() for layer in model.layers for name in PROJECTIONS
                    if holds_nothing(w := getattr(layer, name)))
                + (head.numel() * head.element_size() if holds_nothing(head) else 0))

    # ------------------------------------------------------------------ the fused decode layer
    def layer_kernel_for(self, meta: AttentionMetadata, kv_caches: Sequence[torch.Tensor]) -> Any:
        """The fused-layer kernel module when this step can use it: a pure decode of at
        most ``cpu_layer.MAX_ROWS`` sequences, the paged-decode kernel switched on (phase F),
        a float32 or int8 cache, and the kernel built (else None: the op-by-op path)."""
        from engine.model.kernels import cpu_layer

        model = self.model
        rows = meta.slot_mapping.shape[0]
        if (not model._fused_layers or not meta.is_pure_decode or rows > cpu_layer.MAX_ROWS
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
        if model._gemv_pending:
            model.resolve_gemv()
        if not model._fused_layers:
            if not model.quantized_linears():
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
        if model.kernel_plan is not None:
            if not self.fused_max_rows:
                return "off: the kernel plan measured the op-by-op layer faster"
            return (f"enabled for pure-decode steps of <= {min(self.fused_max_rows, cpu_layer.MAX_ROWS)} sequences "
                    "(the kernel plan's measurement)")
        gemv_rows = min(q.max_rows for q in model.quantized_linears() if q is not model.quantized.get("head"))
        return (f"enabled for pure-decode steps of <= {cpu_layer.MAX_ROWS} sequences "
                + ("(GEMV at every batch size)" if gemv_rows >= cpu_layer.MAX_ROWS
                   else f"(GEMV up to {gemv_rows} rows, float GEMM above)"))


# Phase F's ``precision`` of prefill attention where the kernel plan gave every chunk size to the
# paged prefill kernel (engine/model/attention/cpu_decode.py).
PAGED_PREFILL = "the paged prefill kernel over the cache in place, float32 sums (the kernel plan)"
PAGED_PREFILL_BF16 = ("the paged prefill kernel over the cache in place, bf16 products (q and the softmax weights "
                      "rounded to bf16), float32 sums (the kernel plan)")




def precision_report(model: Any, kv_cache_dtype: torch.dtype) -> dict[str, str]:
    """Which parts of a CPU step run in bf16 and which in float32 (phase F's ``precision``):
    the activations' dtype, or under a float32 model the kernel plan's bf16 choices."""
    from engine.model.plan.kernel_plan import ATTENTION, STEP_CLASSES

    if model._gemv_pending:
        model.resolve_gemv()
    plan, name = model.kernel_plan, str(model.dtype).removeprefix("torch.")
    bf16_model = model.dtype == torch.bfloat16

    def picked(groups: Sequence[str], candidate: str = "bf16") -> str:
        """``group classes`` the plan runs by ``candidate``, e.g. "gate_up 33-64,65+"."""
        if plan is None:
            return ""
        parts = []
        for group in groups:
            steps = [sc.name for sc in STEP_CLASSES if (c := plan.cell(group, sc.name)) and c.chosen == candidate]
            if steps:
                parts.append(f"{group} {','.join(steps)}")
        return "; ".join(parts)

    projections = picked(("qkv", "o", "gate_up", "down"))
    attention = picked((ATTENTION,))
    paged = picked((ATTENTION,), "paged")
    paged_bf16 = picked((ATTENTION,), "paged_bf16")
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
    if model._fused_layers:
        report["fused_decode_layer"] = "float32 activations, the GEMV over the GGUF blocks"
    return report
