"""glibc malloc tuned for step-sized tensors (engine/model/memory/host_allocator.py): set where glibc
is, turned off by its variable, and reported in phase A's event."""

from __future__ import annotations

import platform

import pytest

from engine.model.memory import host_allocator


def test_it_is_set_on_glibc_and_off_by_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    tune = host_allocator.tune_for_steps.__wrapped__  # uncached: each call decides again
    monkeypatch.setenv(host_allocator.MALLOC_TUNE_ENV, "0")
    assert tune() == f"glibc defaults ({host_allocator.MALLOC_TUNE_ENV}=0)"
    monkeypatch.delenv(host_allocator.MALLOC_TUNE_ENV)
    said = tune()
    if platform.libc_ver()[0] == "glibc":
        assert said.startswith("glibc mallopt: mmap threshold 32 MiB")
    else:
        assert "defaults" in said
