"""A GGUF file's header (metadata keys and tensor table) read with ``struct``.

``gguf.GGUFReader`` wraps every value in numpy views: on a model with a
49,152-token vocabulary that is ~250k views and 3-4 s, paid on every startup
just to learn the shapes. The header layout is small and fixed (GGUF v2/v3:
magic, version, counts, then typed key/value pairs, then the tensor infos), so
this reads it directly in milliseconds. Arrays are kept as their element count
(the vocabulary itself is read by the tokenizer path, once, into its cache).
The ``gguf`` package stays the reader of tensor data.
"""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

# GGUF metadata value types: id -> struct format of one value (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class ArrayValue:
    """A metadata array, kept as its element type and count."""

    item_type: int
    count: int


MetadataValue = int | float | bool | str | ArrayValue


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int  # from the start of the data section


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    metadata: dict[str, MetadataValue]
    tensors: list[TensorInfo]
    data_start: int  # file offset of the data section (aligned)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header; a UserError names the file when it is not GGUF v2+.
    Startup reads it from three places (config, quantization choice, raw blocks), so
    the parse is kept per file identity (path, size, mtime): a changed file is re-read."""
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise UserError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    return _read_cached(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_cached(path_text: str, size: int, mtime_ns: int) -> GGUFHeader:
    path = Path(path_text)
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, path)
    except (struct.error, ValueError, OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _string(buf: mmap.mmap, at: int) -> tuple[str, int]:
    """The string at ``at`` and the position after it."""
    (size,) = struct.unpack_from("<Q", buf, at)
    if at + 8 + size > len(buf):
        raise ValueError(f"string of {size} bytes runs past the end of the file")
    return bytes(buf[at + 8 : at + 8 + size]).decode("utf-8", errors="replace"), at + 8 + size


def _skip(buf: mmap.mmap, kind: int, at: int, path: Path) -> int:
    """The position after the metadata value of type ``kind`` at ``at``."""
    if kind in _SCALAR_FORMATS:
        return at + struct.calcsize(_SCALAR_FORMATS[kind])
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SCALAR_FORMATS:
            return at + count * struct.calcsize(_SCALAR_FORMATS[item])
        if item == _STRING:  # a vocabulary: ~100k strings, so one tight loop, no recursion
            unpack_length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                at += 8 + unpack_length(buf, at)[0]
            return at
        for _ in range(count):
            at = _skip(buf, item, at, path)
        return at
    raise UserError(f"{path}: unknown GGUF metadata type {kind} (a newer GGUF version?)")


def _parse(buf: mmap.mmap, path: Path) -> GGUFHeader:
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version < 2:
        raise UserError(f"{path}: not a GGUF v2+ file (magic {magic!r}, version {version})")
    pos = 24
    metadata: dict[str, MetadataValue] = {}
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if kind in _SCALAR_FORMATS:
            (metadata[key],) = struct.unpack_from(_SCALAR_FORMATS[kind], buf, pos)
        elif kind == _STRING:
            metadata[key], _ = _string(buf, pos)
        elif kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, pos)
            metadata[key] = ArrayValue(int(item), int(count))
        pos = _skip(buf, kind, pos, path)
    tensors = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append(TensorInfo(name, int(kind), tuple(int(d) for d in dims), int(offset)))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise UserError(f"{path}: GGUF general.alignment is {alignment!r}, not a positive integer")
    data_start = (pos + alignment - 1) // alignment * alignment
    if tensors:
        last = max(tensors, key=lambda t: t.offset)
        if data_start + last.offset >= len(buf):
            raise UserError(f"{path}: cut short: {len(buf):,} bytes, but tensor {last.name} starts at byte "
                            f"{data_start + last.offset:,}; copy or download the file again")
    return GGUFHeader(metadata, tensors, data_start)
