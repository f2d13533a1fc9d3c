"""Tests of monitor/: the Textual dashboard, its state and SVG snapshots."""
