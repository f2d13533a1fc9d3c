"""Tests of engine/sim/: simulate and replay."""
