"""Tests of engine/core/: the scheduler, KV cache manager, block pool and step events."""
