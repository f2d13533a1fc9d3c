"""Vision-language models in the budget (background part 7): the vision tower's
shapes, how many tokens an image or a video becomes, and what the profile run
adds to phase D.

A VL model is a text LLM (its :class:`~engine.modelspec.config.ModelConfig`) plus a
:class:`VisionConfig`. What changes (vLLM's ``profile_run``, ``supports_mm_inputs``
branch, and ``compute_mm_encoder_budget``):

* weights: the vision tower's (and for Llama-3.2-Vision the cross-attention
  adapter's) parameters load with the LLM's, so they are part of "Model loading took";
* tokens per item: the patch grid after the spatial merge (Qwen2.5-VL: 28x28-pixel
  merged patches, sizes rounded to multiples of 28; videos grouped 2 frames at a
  time by the temporal patch), or tiles of 1,601 patch embeddings (Llama-3.2-Vision);
* the encoder budget: ``min(encoder compute budget, encoder cache size)`` in tokens,
  each ``max(--max-num-batched-tokens, largest item)`` by default; the profile runs
  the encoder on ``min(budget // largest item, max-num-seqs x items per prompt)``
  items of the largest size and parks their outputs in the encoder cache while the
  text dummy step runs on top, so the measured spike is
  ``max(encoder activations, encoder cache + LLM activations)``;
* ``--skip-mm-profiling`` drops both from the profile: a larger pool, with the
  encoder's runtime memory unbudgeted.

Shapes only, integers and floats: the simulator's core and logparse read it too.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from engine.errors import UserError
from engine.modelspec.config import DTYPE_BYTES, ModelConfig

MODALITIES = ("image", "video")
QWEN_VL = "qwen2.5-vl"
MLLAMA = "mllama"


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A vision tower's shapes, from the model's config.json (``vision_config``)."""

    kind: str  # QWEN_VL | MLLAMA: how pixels become tokens
    depth: int  # transformer blocks (mllama: local + global)
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int  # pixels per patch side
    gated_mlp: bool  # SwiGLU (gate, up, down) or a plain two-matrix MLP
    spatial_merge_size: int = 1  # Qwen: 2x2 patches become one token
    temporal_patch_size: int = 1  # Qwen: frames per temporal patch
    min_pixels: int = 0  # Qwen's image processor limits
    max_pixels: int = 0
    tile_size: int = 0  # mllama: square tile in pixels
    max_num_tiles: int = 0
    output_size: int = 0  # what the projector reads (mllama: 5 concatenated layers of 1280)
    cross_attention_layers: int = 0  # mllama: the LLM's extra layers that read the image (the adapter)
    video: bool = False  # the model takes videos

    @property
    def merge_pixels(self) -> int:
        """The side of one output token's square in pixels (Qwen: 14 x 2 = 28)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def tokens_per_tile(self) -> int:
        """mllama: one embedding per patch plus the class token (40 x 40 + 1)."""
        return (self.tile_size // self.patch_size) ** 2 + 1


# Facts of the models' config.json and preprocessor_config.json.
VISION_PRESETS: dict[str, VisionConfig] = {
    # Qwen/Qwen2.5-VL-7B-Instruct: vision_config depth 32, hidden 1280, intermediate 3420, 16 heads,
    # patch 14, spatial_merge_size 2, temporal_patch_size 2, out_hidden_size 3584 (the LLM's hidden);
    # preprocessor min_pixels 3136, max_pixels 12845056.
    "qwen2.5-vl-7b": VisionConfig(
        kind=QWEN_VL, depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
        gated_mlp=True, spatial_merge_size=2, temporal_patch_size=2, min_pixels=3136, max_pixels=12845056,
        video=True,
    ),
    # meta-llama/Llama-3.2-11B-Vision: vision_config 32 local + 8 global layers, hidden 1280,
    # intermediate 5120, 16 heads, patch 14, image_size 560, max_num_tiles 4, vision_output_dim 7680;
    # text_config cross_attention_layers [3, 8, 13, 18, 23, 28, 33, 38] among its 40 layers.
    "llama-3.2-11b-vision": VisionConfig(
        kind=MLLAMA, depth=40, hidden_size=1280, intermediate_size=5120, num_heads=16, patch_size=14,
        gated_mlp=False, tile_size=560, max_num_tiles=4, output_size=7680, cross_attention_layers=8,
    ),
}


def vision_preset(model_name: str) -> VisionConfig | None:
    return VISION_PRESETS.get(model_name)


# ------------------------------------------------------------------ parameters
def vision_parameters(vision: VisionConfig, llm: ModelConfig) -> int:
    """Parameters that load besides the text LLM: the tower, its projector into the
    LLM's hidden size and (mllama) the cross-attention layers, from the shapes."""
    h, i = vision.hidden_size, vision.intermediate_size
    attn = 4 * h * h + (4 * h if vision.kind == QWEN_VL else 0)  # q, k, v, o (Qwen's with biases)
    mlp = (3 * h * i + 2 * i + h) if vision.gated_mlp else (2 * h * i + i + h)
    if vision.kind == QWEN_VL:
        norms = 2 * h  # two RMSNorms
        patch_embed = 3 * vision.temporal_patch_size * vision.patch_size**2 * h
        merged = h * vision.spatial_merge_size**2
        projector = h + merged * merged + merged + merged * llm.hidden_size + llm.hidden_size
        return patch_embed + vision.depth * (attn + mlp + norms) + projector
    norms = 4 * h  # two LayerNorms with biases per layer
    positions = vision.tokens_per_tile
    patch_embed = 3 * vision.patch_size**2 * h + h + 4 * h  # conv, class embedding, pre/post LayerNorms
    # gated positional embeddings: one table, one per (aspect ratio, tile) of the 9 supported ratios
    tile_positions = 9 * vision.max_num_tiles * positions * h + positions * h + 2 * 9 * vision.max_num_tiles * h
    projector = vision.output_size * llm.hidden_size + llm.hidden_size
    q = llm.num_attention_heads * llm.head_dim
    kv = llm.num_kv_heads * llm.head_dim
    cross_layer = 2 * llm.hidden_size * q + 2 * llm.hidden_size * kv + 3 * llm.hidden_size * llm.intermediate_size
    cross_layer += 2 * llm.hidden_size + 2 * llm.head_dim + 2  # norms, q/k norms, the two gates
    return patch_embed + tile_positions + vision.depth * (attn + mlp + norms) + projector \
        + vision.cross_attention_layers * cross_layer


# ------------------------------------------------------------------ tokens
@dataclass(frozen=True, slots=True)
class ItemSize:
    """An image (``frames`` 1) or a video: pixels per frame and the frame count."""

    width: int
    height: int
    frames: int = 1

    def __str__(self) -> str:
        size = f"{self.width}x{self.height}"
        return f"{self.frames} frames of {size}" if self.frames > 1 else size


def qwen_resized(vision: VisionConfig, width: int, height: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: each side rounded to a multiple of 28 pixels, then
    scaled to stay within ``[min_pixels, max_pixels]``. Returns (width, height)."""
    factor = vision.merge_pixels
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > vision.max_pixels:
        beta = math.sqrt(height * width / vision.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < vision.min_pixels:
        beta = math.sqrt(vision.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return w, h


def mllama_tiles(vision: VisionConfig, width: int, height: int) -> int:
    """The tiles mllama's processor cuts an image into: the canvas of at most
    ``max_num_tiles`` tiles that needs the least upscaling, else the least
    downscaling (smallest canvas on a tie)."""
    n = vision.max_num_tiles
    canvases = [(a, b) for a in range(1, n + 1) for b in range(1, n + 1) if a * b <= n]
    scales = {c: min(c[0] * vision.tile_size / width, c[1] * vision.tile_size / height) for c in canvases}
    upscales = [s for s in scales.values() if s >= 1]
    chosen = min(upscales) if upscales else max(scales.values())
    best = min((c for c, s in scales.items() if s == chosen), key=lambda c: c[0] * c[1])
    return best[0] * best[1]


def item_tokens(vision: VisionConfig, size: ItemSize) -> int:
    """Embeddings the encoder produces for one item: LLM prompt tokens (Qwen) or
    cross-attention states (mllama)."""
    if size.width < 1 or size.height < 1 or size.frames < 1:
        raise UserError(f"item size {size}: width, height and frames must be positive")
    if vision.kind == MLLAMA:
        if size.frames > 1:
            raise UserError("Llama-3.2-Vision takes images only, not videos")
        return mllama_tiles(vision, size.width, size.height) * vision.tokens_per_tile
    w, h = qwen_resized(vision, size.width, size.height)
    groups = math.ceil(size.frames / vision.temporal_patch_size) if size.frames > 1 else 1
    return groups * (w // vision.merge_pixels) * (h // vision.merge_pixels)


def encoder_positions(vision: VisionConfig, tokens: int) -> int:
    """Sequence positions inside the tower for ``tokens`` output embeddings
    (Qwen: 4 patches per merged token; mllama: one per embedding)."""
    return tokens * vision.spatial_merge_size**2


DEFAULT_VIDEO = ItemSize(840, 560, 16)  # kvscope's video when no size is given: 8 frame pairs x 600 tokens


def largest_item(vision: VisionConfig, modality: str) -> ItemSize:
    """The item profiled when no size is given: for images the largest the processor
    allows (Qwen's max_pixels as a square: 16,384 tokens; mllama's four-tile canvas),
    as vLLM does; for videos :data:`DEFAULT_VIDEO` (vLLM sizes its dummy video from
    the context length instead)."""
    if vision.kind == MLLAMA:
        return ItemSize(2 * vision.tile_size, 2 * vision.tile_size)
    if modality == "video":
        return DEFAULT_VIDEO
    side = math.isqrt(vision.max_pixels)
    return ItemSize(side, side)


# ------------------------------------------------------------------ the flags
def parse_item_size(text: str, flag: str) -> tuple[int, int]:
    """``"1280x720"`` -> (1280, 720)."""
    parts = str(text).lower().replace(" ", "").split("x")
    try:
        w, h = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"{flag} {text!r}: give WIDTHxHEIGHT in pixels, for example 1280x720") from None
    if w < 1 or h < 1:
        raise UserError(f"{flag} {text!r}: width and height must be positive")
    return w, h


@dataclass(frozen=True, slots=True)
class MultimodalLimits:
    """``--limit-mm-per-prompt`` (items per prompt by modality; vLLM's per-item
    ``width``/``height``/``num_frames`` too) and the item sizes to profile."""

    counts: dict[str, int]
    sizes: dict[str, ItemSize]

    def count(self, modality: str) -> int:
        return self.counts.get(modality, 0)


def parse_limit_mm_per_prompt(text: str | None) -> tuple[dict[str, int], dict[str, ItemSize]]:
    """vLLM's two spellings: ``image=2,video=1`` or JSON ``{"image": 2}``, where an
    item may be ``{"count": 2, "width": 1280, "height": 720, "num_frames": 16}``."""
    flag = "--limit-mm-per-prompt"
    counts: dict[str, int] = {}
    sizes: dict[str, ItemSize] = {}
    if text is None or not str(text).strip():
        return counts, sizes
    raw = str(text).strip()
    items: dict[str, Any]
    if raw.startswith("{"):
        try:
            items = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"{flag} {raw!r}: not valid JSON ({exc.msg}); write '{{\"image\": 2}}' or image=2") from None
        if not isinstance(items, dict):
            raise UserError(f"{flag} {raw!r}: give a JSON object such as '{{\"image\": 2}}'")
    else:
        items = {}
        for part in raw.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                raise UserError(f"{flag} {raw!r}: write MODALITY=N[,MODALITY=N], for example image=2,video=1")
            items[key.strip()] = value.strip()
    for key, value in items.items():
        if key not in MODALITIES:
            raise UserError(f"{flag}: unknown modality {key!r}; kvscope knows {', '.join(MODALITIES)}")
        if isinstance(value, dict):
            count = value.get("count", 1)
            if "width" in value or "height" in value:
                try:
                    sizes[key] = ItemSize(int(value["width"]), int(value["height"]), int(value.get("num_frames", 1)))
                except (KeyError, TypeError, ValueError):
                    raise UserError(f"{flag} {key}: give both width and height (pixels), "
                                    "and num_frames for a video") from None
        else:
            count = value
        try:
            n = int(count)
        except (TypeError, ValueError):
            raise UserError(f"{flag} {key}={count!r}: the count must be a whole number") from None
        if n < 0:
            raise UserError(f"{flag} {key}={n}: the count must be 0 or more")
        counts[key] = n
    return counts, sizes


# ------------------------------------------------------------------ the budget
@dataclass(frozen=True, slots=True)
class MultimodalBudget:
    """What a VL model adds to phases C and D, with the numbers behind them."""

    vision_parameters: int
    vision_weights_bytes: int
    modality: str  # the one the profile runs (the most tokens per item)
    item: ItemSize  # its size
    tokens_per_item: int
    items_per_prompt: dict[str, int]
    tokens_per_prompt: int  # the most a prompt's items can carry
    tokens_by_modality: dict[str, int]  # one item's tokens at the planned size
    encoder_compute_budget: int  # tokens the encoder may produce per step
    encoder_cache_size: int  # tokens the cache may hold
    items_profiled: int
    encoder_activation_peak_bytes: int  # estimated from shapes
    encoder_cache_bytes: int
    embedding_bytes_per_token: int  # one encoder output in the LLM's hidden size
    skip_profiling: bool
    image_tokens_in_kv: bool  # Qwen: image tokens are prompt tokens; mllama: cross-attention states

    def prompt_items(self) -> tuple[tuple[str, int], ...]:
        """(modality, tokens) of every item a prompt carries at the limits, images first."""
        return tuple((m, self.tokens_by_modality[m]) for m, n in self.items_per_prompt.items() for _ in range(n))

    @property
    def encoder_budget_tokens(self) -> int:
        """vLLM's "encoder cache budget": min(compute budget, cache size)."""
        return min(self.encoder_compute_budget, self.encoder_cache_size)

    def profile_peak_bytes(self, llm_activation_peak: int) -> int:
        """Phase D's spike: the encoder's run, or the parked outputs under the text step."""
        if self.skip_profiling:
            return llm_activation_peak
        return max(self.encoder_activation_peak_bytes, self.encoder_cache_bytes + llm_activation_peak)

    def to_json(self) -> dict[str, Any]:
        return {
            "vision_parameters": self.vision_parameters,
            "vision_weights_bytes": self.vision_weights_bytes,
            "modality": self.modality,
            "item": str(self.item),
            "tokens_per_item": self.tokens_per_item,
            "items_per_prompt": dict(self.items_per_prompt),
            "tokens_per_prompt": self.tokens_per_prompt,
            "encoder_compute_budget": self.encoder_compute_budget,
            "encoder_cache_size": self.encoder_cache_size,
            "encoder_cache_tokens": self.encoder_budget_tokens,
            "encoder_cache_bytes": self.encoder_cache_bytes,
            "items_profiled": self.items_profiled,
            "encoder_activation_peak_bytes": self.encoder_activation_peak_bytes,
            "skip_mm_profiling": self.skip_profiling,
            "image_tokens_in_kv": self.image_tokens_in_kv,
        }


def estimate_encoder_activation_bytes(vision: VisionConfig, positions: int, dtype_bytes: float,
                                      output_bytes: int) -> int:
    """A shape-based guess at the tower's live tensors on ``positions`` patch
    positions at once (the same terms as the LLM's estimate in memory.py: a few
    hidden-state copies, the MLP intermediate, q/k/v; attention through a fused
    kernel, so no positions² scores), plus its outputs."""
    h, i = vision.hidden_size, vision.intermediate_size
    hidden = 4 * positions * h * dtype_bytes
    mlp = (3 if vision.gated_mlp else 2) * positions * i * dtype_bytes
    qkv = 3 * positions * h * dtype_bytes
    return int(hidden + mlp + qkv) + output_bytes


def plan_multimodal(
    *,
    model: ModelConfig,
    vision: VisionConfig,
    counts: dict[str, int],
    sizes: dict[str, ItemSize],
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str | None = None,
    tensor_parallel_size: int = 1,
    skip_profiling: bool = False,
) -> MultimodalBudget:
    """The encoder budget and the profile's extra memory for ``counts`` items per
    prompt of ``sizes`` (default: :func:`largest_item`). Without ``counts`` a prompt
    may carry 1 item of each modality the model takes; with them, only the
    modalities named (vLLM V1 keeps a default limit for a modality left out: name
    it ``=0`` there)."""
    supported = ("image", "video") if vision.video else ("image",)
    for modality, n in counts.items():
        if n > 0 and modality not in supported:
            raise UserError(f"--limit-mm-per-prompt {modality}={n}: {model.name} takes "
                            f"{' and '.join(m + 's' for m in supported)} only")
    per_prompt = {m: counts.get(m, 0) for m in supported} if counts else dict.fromkeys(supported, 1)
    active = [m for m, n in per_prompt.items() if n > 0]
    if not active:
        raise UserError(f"--limit-mm-per-prompt gives 0 items of every modality: {model.name} runs as a text model "
                        "then; drop the flag or allow at least one image")
    b = DTYPE_BYTES[(dtype or model.dtype).lower()]
    tokens = {m: item_tokens(vision, sizes.get(m) or largest_item(vision, m)) for m in active}
    modality = max(active, key=lambda m: tokens[m])
    per_item = tokens[modality]
    compute_budget = max(max_num_batched_tokens, per_item)
    cache_size = max(max_num_batched_tokens, per_item)
    budget = min(compute_budget, cache_size)
    items = max(1, min(budget // per_item, max_num_seqs * per_prompt[modality]))
    embedding = int(model.hidden_size * b)
    cache_bytes = int(budget * embedding / tensor_parallel_size)
    outputs = items * per_item * embedding
    activation = estimate_encoder_activation_bytes(vision, encoder_positions(vision, items * per_item), b, outputs)
    params = vision_parameters(vision, model)
    return MultimodalBudget(
        vision_parameters=params,
        vision_weights_bytes=int(params * b / tensor_parallel_size),
        modality=modality,
        item=sizes.get(modality) or largest_item(vision, modality),
        tokens_per_item=per_item,
        items_per_prompt=per_prompt,
        tokens_per_prompt=sum(tokens[m] * per_prompt[m] for m in active),
        tokens_by_modality=tokens,
        encoder_compute_budget=compute_budget,
        encoder_cache_size=cache_size,
        items_profiled=items,
        encoder_activation_peak_bytes=int(activation / tensor_parallel_size),
        encoder_cache_bytes=cache_bytes,
        embedding_bytes_per_token=embedding,
        skip_profiling=skip_profiling,
        image_tokens_in_kv=vision.kind != MLLAMA,
    )


def encoder_cache_line(budget: MultimodalBudget) -> str:
    """vLLM's line (v1 gpu_model_runner.profile_run), as logparse reads it."""
    if budget.skip_profiling:
        return "Skipping memory profiling for multimodal encoder and encoder cache."
    return (f"Encoder cache will be initialized with a budget of {budget.encoder_budget_tokens} tokens, "
            f"and profiled with {budget.items_profiled} {budget.modality} items of the maximum feature size.")


def multimodal_from_flags(
    model: ModelConfig,
    *,
    limit_mm_per_prompt: str | None = None,
    image_size: tuple[int, int] | None = None,
    video_size: tuple[int, int] | None = None,
    video_frames: int | None = None,
    skip_mm_profiling: bool = False,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    dtype: str | None = None,
    tensor_parallel_size: int = 1,
) -> MultimodalBudget | None:
    """The budget for ``model``'s vision tower under the multimodal flags, or None
    for a text model (which refuses the flags: they would change nothing)."""
    vision = vision_preset(model.name)
    given = [flag for flag, value in (("--limit-mm-per-prompt", limit_mm_per_prompt), ("--mm-image-size", image_size),
                                      ("--mm-video-size", video_size), ("--mm-video-frames", video_frames),
                                      ("--skip-mm-profiling", skip_mm_profiling or None)) if value is not None]
    if vision is None:
        if given:
            raise UserError(f"{', '.join(given)}: {model.name} is a text model; the vision-language presets are "
                            f"{', '.join(VISION_PRESETS)}")
        return None
    counts, sizes = parse_limit_mm_per_prompt(limit_mm_per_prompt)
    if image_size is not None:
        sizes["image"] = ItemSize(*image_size)
    if video_size is not None or video_frames is not None:
        if not vision.video:
            raise UserError(f"--mm-video-size/--mm-video-frames: {model.name} takes images only")
        known = sizes.get("video")
        if video_size is not None:
            w, h = video_size
        elif known is not None:
            w, h = known.width, known.height
        else:
            raise UserError("--mm-video-frames needs --mm-video-size WIDTHxHEIGHT (the frames' size)")
        frames = video_frames if video_frames is not None else (known.frames if known else 2 * vision.temporal_patch_size)
        if frames < 1:
            raise UserError(f"--mm-video-frames {frames}: give at least 1")
        sizes["video"] = ItemSize(w, h, frames)
    return plan_multimodal(model=model, vision=vision, counts=counts, sizes=sizes,
                           max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           dtype=dtype, tensor_parallel_size=tensor_parallel_size, skip_profiling=skip_mm_profiling)
