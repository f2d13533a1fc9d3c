"""What a start reads from disk: weights, their blocks, the tokenizer, and the cache of both.

- ``loader``: weights from GGUF, safetensors or dummy, under HF names
- ``hf_layout``: where each HF tensor lands in a model's fused parameters, per family
- ``gguf_blocks``: a GGUF mapped as its blocks, the rest decoded
- ``weight_blocks``: which projections are blocks (``--quantization``, the startup cache's entries), their kernels
- ``tokenizer``: tokenizers, chat templates, the detokenizer, stop strings
- ``startup_cache``: dequantized weights and the tokenizer cached by content
- ``warm_cache``: fills the startup cache at setup
"""
