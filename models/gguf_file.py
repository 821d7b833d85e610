"""GGUF files read once per process: metadata as Python values, tensors as memory-mapped arrays.

`gguf.GGUFReader` builds one numpy view per part of every metadata value, ~1.2 M views for SmolLM2's 49 K tokens
and 49 K merges: 2.8 s per parse, and a target load parsed the file twice (weights, then tokenizer). This reader
parses the metadata with `struct` over one memory map (~0.1 s) and is cached per file (path, size, mtime), so
the weights and the tokenizer of one load, and the later loads of a process, share one parse
(docs/decisions.md D61). Tensor data is what `gguf.GGUFReader` gives (typed arrays for float and integer types,
the raw bytes per row for quantized ones), so `gguf.quants.dequantize` takes it unchanged;
tests/test_loading.py checks both readers agree on every field and tensor."""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader can parse (the message says where it stopped)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # a gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF stores the dimensions innermost first)
    data: np.ndarray  # typed for F16/F32/F64/I8-I64, else uint8 with the bytes of each row last (as gguf's reader)


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: Mapping[str, Any]  # every metadata value: str, bool, int, float, or a tuple of them (shared: cached)
    tensors: tuple[GGUFTensor, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"the file ends at byte {len(self.buf)}, inside the metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError(f"an array of {count} items at byte {self.pos} runs past the end of the file")
                values = tuple(np.frombuffer(self.buf, dtype, count, self.pos).tolist())
                self.pos = end
                return values
            return tuple(self.value(item) for _ in range(count))
        if kind not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {kind} at byte {self.pos}")
        return self.unpack(_SCALARS[kind])


@functools.cache
def _typed_storage() -> dict[Any, type]:
    """The numpy dtype of each tensor type that gguf's reader returns typed (the rest: bytes per row)."""
    from gguf.constants import GGMLQuantizationType as Q

    return {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
            Q.I32: np.int32, Q.I64: np.int64}


def _tensor_data(mm: np.ndarray, offset: int, qtype: Any, dims: tuple[int, ...]) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quant_shape_to_byte_shape

    block, type_size = GGML_QUANT_SIZES[qtype]
    n_bytes = int(np.prod(dims)) * type_size // block
    shape = tuple(reversed(dims))
    typed = _typed_storage().get(qtype)
    if offset + n_bytes > mm.size:
        raise GGUFFormatError(f"tensor data at byte {offset} ({n_bytes} bytes) runs past the end of the file")
    raw = mm[offset:offset + n_bytes]
    if typed is not None:
        return raw.view(typed).reshape(shape)
    return raw.reshape(quant_shape_to_byte_shape(shape, qtype))


def _parse(path: Path) -> GGUFFile:
    from gguf.constants import GGMLQuantizationType

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != _MAGIC:
        raise GGUFFormatError(f"bad magic {bytes(mm[:4])!r} (a GGUF starts with {_MAGIC!r})")
    cur.pos = 4
    version = cur.unpack("<I")
    if version & 0xFFFF == 0 and version:
        raise GGUFFormatError("a big-endian GGUF (only little-endian files are read)")
    if version not in _VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (versions {list(_VERSIONS)} are read)")
    n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two; received {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, kind, offset in infos:
        if name in seen:
            raise GGUFFormatError(f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown type {kind}") from None
        tensors.append(GGUFTensor(name, qtype, tuple(reversed(dims)), _tensor_data(mm, start + offset, qtype, dims)))
    return GGUFFile(path, MappingProxyType(fields), tuple(tensors))


@functools.lru_cache(maxsize=4)
def _cached(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    del size, mtime_ns  # part of the cache key only: a rewritten file is parsed again
    return _parse(path)


def read_gguf(path: str | Path) -> GGUFFile:
    """The parsed GGUF at `path`, cached per (path, size, mtime); raises GGUFFormatError (a ValueError) on a file
    this reader cannot parse and FileNotFoundError when there is none."""
    path = Path(path).expanduser().resolve()
    stat = path.stat()
    return _cached(path, stat.st_size, stat.st_mtime_ns)


__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf"]
