"""Target weights read by region, so that a process reads only the parts of a tensor its devices hold.

    leaf = Lazy((L, D, Q), region)           # nothing read yet
    leaf.region((slice(0, L), slice(0, D // 4), slice(0, Q)))   # fp32, only those values read
    np.asarray(leaf)                          # the whole array

`models.loading` lays a checkpoint out as the decoder's params (matrices transposed to `[in, out]`, layers and experts
stacked) out of `Lazy` leaves over a `TensorFile`: `SafetensorsFile` reads a region of a stored tensor through
safetensors' slices (the bytes of those rows and columns, nothing else), `GGUFTensors` dequantises a whole stored
tensor and cuts the region out (a quantised block spans many values; a GGUF target is the small default, and
`Lazy.sliced` tells `models.placement` to read such a leaf once and cut every device's region from it).
`models.placement.put` reads each device's region of each leaf (`jax.make_array_from_callback`): no device, and no
process, ever holds more of the target than its share (docs/decisions.md, pods-mesh).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Index = tuple[slice, ...]  # one slice per dimension, start and stop set, step 1


def full_index(shape: Sequence[int]) -> Index:
    return tuple(slice(0, n) for n in shape)


def normalize(index: Any, shape: Sequence[int]) -> Index:
    """`index` (slices as `jax.make_array_from_callback` passes them: None bounds allowed) with every bound set;
    a step other than 1 is refused (safetensors' slices would ignore it)."""
    index = tuple(index) if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        if not isinstance(s, slice):
            raise TypeError(f"index must hold slices; received {index!r}")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index slices must have step 1; received {s!r}")
        out.append(slice(start, stop))
    return tuple(out)


def _key(index: Index) -> tuple[tuple[int, int], ...]:
    return tuple((s.start, s.stop) for s in index)


@dataclasses.dataclass(frozen=True, eq=False)
class Lazy:
    """One array not read yet: `region(index)` reads the values of `index` (an `Index` of this shape) as fp32.
    sliced: the region costs only its own bytes (False: it decodes whole stored tensors, so read the leaf once)."""

    shape: tuple[int, ...]
    read: Callable[[Index], np.ndarray]
    sliced: bool = True

    dtype = np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def region(self, index: Any) -> np.ndarray:
        index = normalize(index, self.shape)
        out = np.asarray(self.read(index), np.float32)
        want = tuple(s.stop - s.start for s in index)
        if out.shape != want:
            raise AssertionError(f"a region read {out.shape} for index {_key(index)} of {self.shape}")
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.region(full_index(self.shape))
        return out if dtype is None else out.astype(dtype)


def materialize(tree: Any) -> Any:
    """`tree` (nested dicts) with every `Lazy` leaf read whole into a numpy array."""
    if isinstance(tree, dict):
        return {k: materialize(v) for k, v in tree.items()}
    return np.asarray(tree) if isinstance(tree, Lazy) else tree


# ----------------------------------------------------------------------------- building leaves


def transposed(leaf: Lazy) -> Lazy:
    """A 2-D leaf transposed (a stored PyTorch `[out, in]` matrix as the decoder's `[in, out]`)."""
    return Lazy(leaf.shape[::-1], lambda index: leaf.read(index[::-1]).T, leaf.sliced)


def stacked(parts: Sequence[Lazy]) -> Lazy:
    """Leaves of one shape stacked on a new leading axis (layers, experts): a region reads only its own parts."""
    parts = list(parts)
    shape = (len(parts), *parts[0].shape)
    if any(p.shape != parts[0].shape for p in parts):
        raise ValueError(f"stacked leaves must share one shape; received {sorted({p.shape for p in parts})}")

    def read(index: Index) -> np.ndarray:
        return np.stack([parts[i].read(index[1:]) for i in range(index[0].start, index[0].stop)])

    return Lazy(shape, read, all(p.sliced for p in parts))


def every_other(leaf: Lazy, offset: int) -> Lazy:
    """Columns offset, offset + 2, ... of `leaf`'s last axis (gpt-oss's interleaved gate and up): a region reads
    the stored columns it covers, then keeps every other one."""
    shape = (*leaf.shape[:-1], leaf.shape[-1] // 2)

    def read(index: Index) -> np.ndarray:
        cols = index[-1]
        wide = leaf.read((*index[:-1], slice(2 * cols.start, 2 * cols.stop)))
        return wide[..., offset::2]

    return Lazy(shape, read, leaf.sliced)


def constant(value: np.ndarray) -> Lazy:
    array = np.asarray(value, np.float32)
    return Lazy(array.shape, lambda index: array[index], True)


# ----------------------------------------------------------------------------- the files leaves read


class TensorFile(Protocol):
    """The stored tensors of a checkpoint: `shape(name)` (None when absent) from its header alone, and
    `read(name, index)` of a region of the stored layout (fp32, or the stored dtype with `raw`)."""

    sliced: bool

    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def read(self, name: str, index: Index, raw: bool = False) -> np.ndarray: ...


class SafetensorsFile:
    """The tensors of an HF directory's safetensors files, each read by region through safetensors' slices."""

    sliced = True

    def __init__(self, files: Sequence[Path], error: Callable[[str], Exception]):
        from safetensors import SafetensorError, safe_open

        self._handles: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="numpy")
                names = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as err:
                raise error(f"{f}: not a readable safetensors file ({err})") from err
            self._handles[str(f)] = handle
            for name in names:
                self._where[name] = (f, handle)
        self._error = error

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self._where:
            return None
        return tuple(self._where[name][1].get_slice(name).get_shape())

    def read(self, name: str, index: Index, raw: bool = False) -> np.ndarray:
        path, handle = self._where[name]
        try:
            part = handle.get_slice(name)[index] if index else handle.get_tensor(name)
        except Exception as err:  # noqa: BLE001 - a truncated or corrupt data section
            raise self._error(f"{path}: tensor {name!r} could not be read ({err})") from err
        part = np.asarray(part)
        return part if raw else part.astype(np.float32)


class GGUFTensors:
    """The tensors of a GGUF file, each dequantised whole (`decode(name)`) and cut to the region asked for."""

    sliced = False

    def __init__(self, shapes: dict[str, tuple[int, ...]], decode: Callable[[str], np.ndarray]):
        self._shapes, self._decode = shapes, decode

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def read(self, name: str, index: Index, raw: bool = False) -> np.ndarray:
        return self._decode(name)[index]


__all__ = ["GGUFTensors", "Index", "Lazy", "SafetensorsFile", "TensorFile", "constant", "every_other",
           "full_index", "materialize", "normalize", "stacked", "transposed"]
