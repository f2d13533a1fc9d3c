"""Layers the families share beyond Llama's own: quantized projections, experts, rope scaling.

- ``quantized_linear``: ``QuantizedLinear``, one weight as block parts
- ``moe``: routing and grouped experts
- ``rope_scaling``: ``llama3`` and ``linear`` rope scaling
"""
