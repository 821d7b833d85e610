"""Converted copies of GGUF targets' weights, so a restart skips dequantising them (D78).

    params = cached_params(directory, gguf_path, lambda: convert(...))   # directory None: convert every time

A GGUF target is dequantised to fp32 and laid out as the decoder's params (transposed, layers stacked) on every
load: 1.9 s of each `dflash serve --config demo` start for SmolLM2-135M, most of the load. With a directory (the
serving stages pass `serve.compile_cache.converted_dir()`, beside JAX's compiled programs), the first load writes
the converted params there, one `.npy` per leaf, and later loads map them back (copy-on-write: a write to a loaded
array never reaches the file; on a CPU device JAX takes the mapped arrays as they are, so the 513 MiB of that target
are neither read nor copied at load, and their pages come from the OS's file cache as programs touch them).

An entry is keyed by the source file (resolved path, size, modification time), the code that converts it (the
bytes of `models/loading.py` and `models/gguf_file.py`) and the `gguf` and numpy versions, so a changed file or
converter misses and converts afresh; a copy whose files do not match its `meta.json` is discarded and rewritten.
Entries over `MAX_BYTES` are not written; a new entry of a file removes its older ones, and past `MAX_BYTES` in all
the least recently used go. Safe to delete at
any time. Writes go to a temporary directory renamed into place, so concurrent processes never read half an entry;
a failure to write only logs a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

FORMAT = 1
MAX_BYTES = 4 << 30  # an entry, and all of them together (least recently used go first)
_CONVERTERS = ("loading.py", "gguf_file.py", "regions.py")  # the code whose output an entry holds


def entry_key(source: Path) -> str:
    """The entry name of `source` as it is now (see the module docstring)."""
    stat = source.stat()
    digest = hashlib.sha256(json.dumps([FORMAT, str(source.resolve()), stat.st_size, stat.st_mtime_ns,
                                        np.__version__, _version("gguf")]).encode())
    for name in _CONVERTERS:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:32]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for name, value in params.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = np.asarray(value)
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = params
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return params


def _read(entry: Path) -> dict[str, Any] | None:
    """The params of `entry`, or None when it is missing or does not match its meta.json (then it is removed)."""
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        flat = {}
        for name, (shape, dtype) in meta["leaves"].items():
            array = np.load(entry / f"{name}.npy", mmap_mode="c", allow_pickle=False)  # pages read when touched
            if list(array.shape) != shape or str(array.dtype) != dtype:
                raise ValueError(f"{name} is {array.shape} {array.dtype}; meta.json says {shape} {dtype}")
            flat[name] = array
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("converted weights: discarding %s (%s)", entry, err)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    os.utime(entry / "meta.json")  # recently used
    return _unflatten(flat)


def _write(directory: Path, key: str, source: Path, flat: dict[str, np.ndarray]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=directory))
    try:
        for name, array in flat.items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        leaves = {name: [list(a.shape), str(a.dtype)] for name, a in flat.items()}
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "source": str(source.resolve()),
                                                   "leaves": leaves}))
        try:
            tmp.rename(directory / key)
        except OSError:  # another process wrote the same entry first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _evict(directory: Path, keep: str, source: Path) -> None:
    """Remove the other entries of `source` (an older file or converter) and the least recently used ones (not
    `keep`) until all of them fit `MAX_BYTES`."""
    entries = []
    for entry in directory.iterdir():
        if entry.name.startswith(".") or entry.name == keep or not (entry / "meta.json").is_file():
            continue
        try:
            stale = json.loads((entry / "meta.json").read_text()).get("source") == str(source.resolve())
        except ValueError:
            stale = True
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            continue
        size = sum(f.stat().st_size for f in entry.iterdir())
        entries.append(((entry / "meta.json").stat().st_mtime, size, entry))
    total = sum(f.stat().st_size for f in (directory / keep).iterdir()) + sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries):
        if total <= MAX_BYTES:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size


def cached_params(directory: Path | None, source: Path, convert: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`convert()` (the params of the file `source` as host numpy arrays, nested dicts), read from its entry in
    `directory` when one is there and written to it when not (None: no copy, convert every time)."""
    if directory is None:
        return convert()
    key = entry_key(source)
    params = _read(directory / key)
    if params is not None:
        log.info("loaded the converted weights of %s from %s", source.name, directory / key)
        return params
    t0 = time.perf_counter()
    params = convert()
    flat = _flatten(params)  # read whole (a converter may return `models.regions.Lazy` leaves)
    size = sum(a.nbytes for a in flat.values())
    if size > MAX_BYTES:
        log.info("converted weights: %s converts to %.1f GiB, over the %.0f GiB bound; not kept", source.name,
                 size / 2**30, MAX_BYTES / 2**30)
        return params
    try:
        _write(directory, key, source, flat)
        _evict(directory, key, source)
    except OSError as err:
        log.warning("converted weights: cannot keep a copy in %s (%s); converting on every load", directory, err)
        return params
    log.info("converted %s in %.1f s; kept a copy (%.0f MiB) in %s for the next load (safe to delete)", source.name,
             time.perf_counter() - t0, size / 2**20, directory / key)
    return _unflatten(flat)


__all__ = ["FORMAT", "MAX_BYTES", "cached_params", "entry_key"]
