"""Rope frequency scaling: Llama 3.1/3.2's ``llama3`` rule, as transformers'
``_compute_llama3_parameters`` computes it (and vLLM's ``Llama3RotaryEmbedding``), and the
``linear`` rule of Gemma 3's larger models (every frequency divided by ``factor``: vLLM's
``LinearScalingRotaryEmbedding``).

Each rotary frequency's wavelength ``2 pi / f`` is compared with the context the model was
first trained on (``original_max_position_embeddings``): wavelengths longer than
``original / low_freq_factor`` are divided by ``factor`` (stretched to the longer context),
shorter than ``original / high_freq_factor`` kept, and those between blended linearly in
``original / wavelength``. The attention scale is unchanged. llama.cpp's converter stores the
result as one divisor per frequency (a GGUF's ``rope_freqs`` tensor), applied as it is."""

from __future__ import annotations

import math

import torch

from engine.modelspec.config import RopeScaling


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``inv_freq`` (the plain rope's ``1 / theta ** (2i / head_dim)``) scaled by ``scaling``:
    by the llama3 rule, by the linear rule, or divided by a GGUF's per-frequency factors
    (llama.cpp's rope_freqs)."""
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "freq_factors" and scaling.freq_factors is not None:
        if len(scaling.freq_factors) != inv_freq.shape[0]:
            raise ValueError(f"rope_freqs holds {len(scaling.freq_factors)} factors; the heads rotate "
                             f"{inv_freq.shape[0]} frequencies")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=inv_freq.dtype)
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope scaling {scaling.rope_type!r}: only llama3, linear and GGUF freq_factors are "
                         "implemented")
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)
