"""Tests of logparse/: the vLLM log parser and explain."""
