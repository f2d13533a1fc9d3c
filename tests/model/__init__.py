"""Tests of engine/model/: tensors, kernels, loader, runner, sampler, tokenizer, caches."""
