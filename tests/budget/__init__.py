"""Tests of engine/budget/: the memory formula and model configs."""
