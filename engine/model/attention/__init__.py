"""Attention backends over the paged KV cache.

- ``base``: the backend interface and the paged layout
- ``selector``: ``--attention-backend``
- ``torch_backend``: paged attention in torch
- ``cpu_decode``: the C++ paged decode and prefill kernels
- ``kv_quant``: int8 and fp8 KV caches
- ``triton_backend``, ``triton_kernels``: the GPU path
"""
