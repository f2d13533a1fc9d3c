"""Everything that touches tensors. Nothing outside this wing, ``engine/startup.py`` and the
executors imports torch.

- ``llama``: the Llama-family decoder over one flattened batch
- ``qwen3``, ``gemma3``: their own layers on Llama's machinery
- ``moe``: routing and grouped experts
- ``qwen3_moe``, ``qwen2_moe``, ``mixtral``: the mixture-of-experts families
- ``rope_scaling``: ``llama3`` and ``linear`` rope scaling
- ``loader``: weights from GGUF, safetensors or dummy, under HF names
- ``gguf_blocks``: a GGUF mapped as its blocks, the rest decoded
- ``quantized_linear``: ``QuantizedLinear``, one weight as block parts
- ``weight_blocks``: which projections are blocks, their kernels, float fallbacks
- ``kernel_plan``: the measured choice of kernel per projection and step size
- ``plan_stability``: plans that hold still: margins and load
- ``startup_cache``: dequantized weights and the tokenizer cached by content
- ``warm_cache``: fills the startup cache at setup
- ``profile_cache``: phase D's result stored for warm starts
- ``profile_parts``: phase D measured in parts and scaled
- ``tokenizer``: tokenizers, chat templates, the detokenizer, stop strings
- ``sampler``: the batched sampler and logprobs
- ``runner``: ``ModelRunner``: a step's batch in, sampled tokens out
- ``cuda_graphs``: decode steps as CUDA graphs
- ``device``: memory probes and the measured activation peak
- ``cpu_caps``: what this CPU can do
- ``host_allocator``: glibc malloc tuned for step tensors
- ``parallel``: tensor parallelism's shapes, group and collectives
- ``parallel_llama``: one rank's slice of a Llama
- ``attention``: the attention backends and the paged layout
- ``kernels``: the compiled CPU kernels and their build cache
"""
