"""Where the tests find the repository's files, wherever a test module sits."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root
SAMPLES = ROOT / "samples"  # recordings and a real vLLM log
DATA = ROOT / "tests" / "data"  # the vLLM log corpus (tests/data/vllm-logs/)
