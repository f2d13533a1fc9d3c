"""Assembling a chunked model file: only a complete file whose sha256 matched ever sits at
the final name; a failed or interrupted assemble leaves nothing there."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.modelspec.model_files import GEMMA3_270M, assemble_atomically, models_dir


def _chunks(tmp_path: Path) -> tuple[list[Path], str]:
    parts = [b"GGUF" + bytes(range(256)) * 40, b"middle" * 1000, b"tail"]
    paths = []
    for i, data in enumerate(parts):
        p = tmp_path / f"model.gguf.part{i:02d}"
        p.write_bytes(data)
        paths.append(p)
    return paths, hashlib.sha256(b"".join(parts)).hexdigest()


def test_assembles_and_checks_the_sha256(tmp_path: Path) -> None:
    chunks, sha = _chunks(tmp_path)
    target = tmp_path / "out" / "model.gguf"
    assert assemble_atomically(chunks, target, sha) == target
    assert hashlib.sha256(target.read_bytes()).hexdigest() == sha
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]  # no temporary left behind


def test_wrong_sha256_leaves_no_file(tmp_path: Path) -> None:
    chunks, _ = _chunks(tmp_path)
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError, match="sha256"):
        assemble_atomically(chunks, target, "0" * 64)
    assert list(target.parent.iterdir()) == []


def test_interrupted_assemble_leaves_no_file(tmp_path: Path) -> None:
    """A chunk that fails mid-way (as a kill would stop the copy) leaves neither the target
    nor a partial file a later start could take for the model."""
    chunks, sha = _chunks(tmp_path)

    class Interrupted(BaseException):
        pass

    def chunks_then_interrupt():
        yield chunks[0]
        raise Interrupted

    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(Interrupted):
        assemble_atomically(chunks_then_interrupt(), target, sha)
    assert list(target.parent.iterdir()) == []


def test_model_folder_follows_the_cache_dir(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    assert models_dir() == tmp_path / "models"
    assert GEMMA3_270M.installed_path() is None  # an empty folder: not set up, never a partial file
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", "off")  # the cache off still has a model folder
    assert models_dir() == Path.home() / ".cache" / "kvscope" / "models"
