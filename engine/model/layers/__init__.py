"""Layers the families share beyond Llama's own: quantized projections, experts, rope scaling.

- ``quantized_linear``: ``QuantizedLinear``, one weight as block parts
- ``kernel_routing``: each projection's kernel, the kernel plan's routes, the fused decode layer
- ``moe``: routing and grouped experts
- ``rope_scaling``: ``llama3`` and ``linear`` rope scaling
"""
