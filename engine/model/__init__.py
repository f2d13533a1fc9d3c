"""Everything that touches tensors. Nothing outside this wing, ``engine/startup/`` and the
executors imports torch.

- ``families``: the model classes, Llama's and those built on it
- ``layers``: quantized projections, experts, rope scaling
- ``loading``: weights, GGUF blocks, the tokenizer and the startup cache
- ``memory``: device memory probes, phase D's activation peak, host malloc
- ``plan``: the kernel plan: the measured choice of kernel per projection and step size
- ``runner``: ``ModelRunner``: a step's batch in, sampled tokens out
- ``sampler``: the batched sampler and logprobs
- ``step_sampling``: a step's rows sampled, a failing row alone, logprobs and prompt logprobs
- ``cuda_graphs``: decode steps as CUDA graphs
- ``cpu_caps``: what this CPU can do
- ``parallel``: tensor parallelism's shapes, group and collectives
- ``attention``: the attention backends and the paged layout
- ``kernels``: the compiled CPU kernels and their build cache
"""
