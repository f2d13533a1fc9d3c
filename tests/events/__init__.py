"""Tests of engine/events/: the bus and recording format, metrics, the stats line, phase data."""
