"""Compiled CPU kernels and the cache they are built into (see build.py)."""
