"""Everything that touches tensors: the Llama-family model (:mod:`~engine.model.llama`),
weights (:mod:`~engine.model.loader`, the GGUF header, the startup cache), the tokenizer,
attention backends (:mod:`engine.model.attention`), the CPU kernels and their build cache
(:mod:`engine.model.kernels`), the sampler, the model runner, CUDA graphs, device memory
readings and CPU capabilities, and phase D's stored measurement. Nothing outside this wing,
``engine/startup.py`` and the executors imports torch."""
