"""Layers the families share beyond Llama's own: quantized projections, experts, rope scaling.

- ``quantized_linear``: ``QuantizedLinear``, one weight as block parts
- ``projection_linear``: ``ProjectionLinear``, one projection's ``x @ W.T``: the plan's route, the
  blocks' kernel or the float weight, decided in one place
- ``kernel_routing``: ``KernelRouting`` (``model.routing``): each projection's kernel bound, the kernel
  plan's routes installed, the fused decode layer, the float weights dropped, the precision report
- ``moe``: routing and grouped experts
- ``rope_scaling``: ``llama3`` and ``linear`` rope scaling
"""
