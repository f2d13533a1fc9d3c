"""Benchmark modules for tests of bench/run_all.py (run with ``python -m``)."""
