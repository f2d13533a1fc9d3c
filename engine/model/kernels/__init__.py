"""Compiled CPU kernels and the cache they are built into.

- ``build``: the compiled-kernel cache and its lock
- ``background``: kernels built during startup
- ``cpu_gemv``: Q8_0 / Q4_1 GEMV
- ``cpu_quant``: every GGUF block format's matmul
- ``cpu_norm``: RMSNorm
- ``cpu_act``: SiLU-and-multiply
- ``cpu_layer``: the fused decode layer
"""
