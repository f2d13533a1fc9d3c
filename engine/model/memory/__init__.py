"""Memory: the device's probes, phase D's measured activation peak and its cache, host malloc.

- ``device``: memory probes and the measured activation peak
- ``profile_parts``: phase D measured in parts and scaled
- ``profile_cache``: phase D's result stored for warm starts
- ``host_allocator``: glibc malloc tuned for step tensors
"""
