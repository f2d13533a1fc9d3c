"""Pick the attention backend for ``--attention-backend auto|torch|triton``:
auto means Triton on CUDA and torch elsewhere."""

from __future__ import annotations

import os

import torch

from engine.errors import UserError
from engine.model.attention.base import AttentionBackend

ATTENTION_BACKEND_CHOICES = ("auto", "torch", "triton")


def resolve_backend_name(name: str, device: torch.device | str) -> str:
    """``auto`` -> ``triton`` on CUDA, ``torch`` otherwise; other names pass through after validation."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise UserError(f"unknown attention backend {name!r}; pass --attention-backend auto, torch or triton")
    if name == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    resolved = resolve_backend_name(name, device)
    if resolved == "torch":
        from engine.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()

    device_type = torch.device(device).type
    # Without CUDA the kernels can only run interpreted, which Triton fixes at import
    # from TRITON_INTERPRET: refuse before importing triton at all when it is unset.
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError(
            f"--attention-backend triton needs a CUDA device (got {device_type}); use --attention-backend torch, "
            "or set TRITON_INTERPRET=1 before starting to run the kernels in the (slow) Triton interpreter"
        )
    # Imported here so that choosing torch never needs triton to import.
    from engine.model.attention.triton_backend import TritonAttentionBackend
    from engine.model.attention.triton_kernels import kernels_interpreted

    if device_type != "cuda" and not kernels_interpreted():
        raise UserError(
            f"--attention-backend triton needs a CUDA device (got {device_type}); use --attention-backend torch, "
            "or set TRITON_INTERPRET=1 before starting to run the kernels in the (slow) Triton interpreter"
        )
    return TritonAttentionBackend()
