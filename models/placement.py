"""Params onto devices, each device reading its own share, and what every device holds.

    params = put(weights, shardings, dtype)        # each device's region of each leaf read by itself
    log_memory_per_device("train")                 # memory per device: max X GiB (device i), min Y GiB (device j)

`put` builds every array with `jax.make_array_from_callback`: the callback runs for this process's devices only and
reads the region of a leaf that device owns (`models.regions.Lazy`: safetensors slices; a GGUF leaf, whose tensors
decode whole, is read once and cut), cast on the host to the dtype the stage computes in. So no device ever holds a
full copy of a sharded target, and a process reads only its devices' shares (docs/design.md §6; decisions.md,
pods-mesh).

`resident_bytes` is what each device holds now: the allocator's bytes in use where the backend reports them (TPU,
GPU), else the bytes of every live array's shards on it (CPU), each buffer counted once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dflash.models.regions import Lazy, full_index, normalize

log = logging.getLogger(__name__)

GIB = 1 << 30


def _host(region: Any, dtypes: Sequence[Any]) -> np.ndarray:
    """`region` copied (never a view that would keep a larger host array alive) and cast through each of `dtypes`."""
    out = np.array(region, copy=True)
    for dtype in dtypes:
        out = out.astype(dtype, copy=False)
    return out


def put_leaf(leaf: Any, sharding: jax.sharding.Sharding, dtypes: Sequence[Any] = ()) -> jax.Array:
    """One leaf (a `Lazy`, a host array, or a jax.Array) as a global array of `sharding`, cast through `dtypes`
    (e.g. the target's storage dtype, then the stage's compute dtype). Each of this process's devices gets its
    region, read once per distinct region; a jax.Array is cast where it is and moved (`jax.device_put`)."""
    if isinstance(leaf, jax.Array):
        for dtype in dtypes:
            leaf = leaf.astype(dtype)
        return jax.device_put(leaf, sharding)
    shape = tuple(leaf.shape)
    source = leaf
    if isinstance(leaf, Lazy) and not leaf.sliced:
        source = leaf.region(full_index(shape))  # decoded whole once (GGUF), each device's region cut from it
    read = source.region if isinstance(source, Lazy) else (lambda index: np.asarray(source)[index])
    done: dict[tuple, np.ndarray] = {}

    def region(index: Any) -> np.ndarray:
        index = normalize(index, shape)
        key = tuple((s.start, s.stop) for s in index)
        if key not in done:
            done[key] = _host(read(index), dtypes)
        return done[key]

    dtype = np.dtype(dtypes[-1]) if dtypes else np.dtype(getattr(leaf, "dtype", np.float32))
    return jax.make_array_from_callback(shape, sharding, region, dtype=dtype)


def put(tree: Any, shardings: Any, dtypes: Sequence[Any] = ()) -> Any:
    """`tree` (nested dicts of `Lazy` leaves, host arrays or jax.Arrays) placed leaf by leaf by `shardings` (a tree
    of the same structure, or one sharding for every leaf), cast through `dtypes`; see `put_leaf`."""
    is_leaf = lambda x: isinstance(x, Lazy)  # noqa: E731
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: put_leaf(x, shardings, dtypes), tree, is_leaf=is_leaf)
    return jax.tree.map(lambda x, s: put_leaf(x, s, dtypes), tree, shardings, is_leaf=is_leaf)


def abstract(tree: Any, dtype: Any = None) -> Any:
    """`tree`'s leaves as `jax.ShapeDtypeStruct`s (of `dtype` when given): what `tree_shardings` lays out."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(dtype or x.dtype)), tree,
                        is_leaf=lambda x: isinstance(x, Lazy))


# ----------------------------------------------------------------------------- what each device holds


def resident_bytes(devices: Sequence[jax.Device] | None = None) -> dict[jax.Device, int]:
    """Bytes each of `devices` (default: this process's) holds now: the allocator's `bytes_in_use` where the
    backend reports memory stats, else the sum of the live arrays' shards on it, each buffer counted once (two
    arrays over the same buffers, e.g. a `device_put` to the sharding an array already has, count once)."""
    devices = list(jax.local_devices() if devices is None else devices)
    stats = {d: d.memory_stats() for d in devices}
    if all(s and "bytes_in_use" in s for s in stats.values()):
        return {d: int(s["bytes_in_use"]) for d, s in stats.items()}
    totals = dict.fromkeys(devices, 0)
    seen: set[tuple[int, int]] = set()
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device not in totals:
                continue
            data = shard.data
            try:
                key = (shard.device.id, data.unsafe_buffer_pointer())
            except Exception:  # noqa: BLE001 - a backend without raw pointers: count every shard
                key = (shard.device.id, id(data))
            if key in seen:
                continue
            seen.add(key)
            totals[shard.device] += int(data.nbytes)
    return totals


def free_bytes(devices: Sequence[jax.Device] | None = None) -> int:
    """Bytes the fullest of `devices` (default: this process's) can still allocate: the allocator's `bytes_limit`
    less `bytes_in_use` where the backend reports them (TPU, GPU); else (CPU devices share the host's memory) the
    host's available memory (`MemAvailable`, or free pages where /proc/meminfo is absent) split evenly."""
    devices = list(jax.local_devices() if devices is None else devices)
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s and "bytes_in_use" in s for s in stats):
        return min(int(s["bytes_limit"]) - int(s["bytes_in_use"]) for s in stats)
    return _host_available() // len(devices)


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_line(totals: dict[jax.Device, int]) -> str:
    """`memory per device: max X GiB (device i), min Y GiB (device j)` of `resident_bytes`' totals; in MiB when the
    largest is under 0.1 GiB (a tiny model's skew would read 0.000 GiB everywhere)."""
    high = max(totals, key=lambda d: (totals[d], -d.id))
    low = min(totals, key=lambda d: (totals[d], -d.id))
    scale, unit = (GIB, "GiB") if totals[high] >= GIB / 10 else (1 << 20, "MiB")
    return (f"memory per device: max {totals[high] / scale:.3f} {unit} (device {high.id}), "
            f"min {totals[low] / scale:.3f} {unit} (device {low.id})")


def log_memory_per_device(stage: str, devices: Sequence[jax.Device] | None = None) -> dict[jax.Device, int]:
    """Log (and return) what each of this process's devices holds at the start of `stage`, one line: a pod user
    sees a device holding more than its share before the first step."""
    totals = resident_bytes(devices)
    where = f"process {jax.process_index()}/{jax.process_count()}, " if jax.process_count() > 1 else ""
    log.info("%s: %s (%s%d local devices)", stage, memory_line(totals), where, len(totals))
    return totals


__all__ = ["GIB", "abstract", "free_bytes", "log_memory_per_device", "memory_line", "put", "put_leaf", "resident_bytes"]
