"""A persistent compilation cache for the stages that compile the engine (`dflash serve`, `chat`, `demo`, `eval`'s
servers, `data regenerate | capture | walk`): JAX's own, on disk, so a restart loads the programs a previous start
compiled instead of compiling them again (D78).

    enable_compile_cache()        # before the first compile; returns the directory (None: off)
    before = compile_counts()     # the programs this thread has compiled or loaded so far, by name
    ...; after = compile_counts()
    after.total(names) - before.total(names), after.loaded_total(names) - before.loaded_total(names)

Where: `DFLASH_COMPILE_CACHE` (a directory, or `off`), else `JAX_COMPILATION_CACHE_DIR` when the environment
already sets JAX's own (the tests do), else `$XDG_CACHE_HOME/dflash/jax` (`~/.cache/dflash/jax`). Safe across
versions and machines: JAX keys every entry by the program, the jax and jaxlib versions, the backend and device
kind, and the compile flags, so a changed program or an upgrade misses and compiles afresh; stale entries are
never loaded and go when the cache passes its size bound (least recently used first). Processes share one cache:
`dflash eval`'s DFlash and AR servers (subprocesses with the same environment) read and write the same directory.

Counting: `compile_counts()` is what the calling thread has compiled, read from JAX's monitoring events: each
program JAX obtained for a jit call or an ahead-of-time `.lower().compile()` (a miss of its in-memory caches:
compiled, or loaded from this cache), by name (`jit(prefill)`), and which of them were loaded from this cache. The
engine counts its programs with it (`Engine.compiles`, `Engine.loaded`): a program compiled ahead of time and
then called counts once, when it was compiled.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "DFLASH_COMPILE_CACHE"
OFF = ("off", "0", "false", "none", "")
MIN_COMPILE_SECS = 0.2  # programs that compile faster are not worth a file (JAX's default: 1 s)
MAX_BYTES = 4 << 30  # least recently used entries go past 4 GiB


def compile_cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The cache directory the environment asks for (see the module docstring); None when it is turned off."""
    env = os.environ if env is None else env
    if ENV in env:
        value = env[ENV].strip()
        return None if value.lower() in OFF else Path(value).expanduser()
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(env["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base).expanduser() / "dflash" / "jax"


def enable_compile_cache(env: Mapping[str, str] | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `compile_cache_dir(env)` (created if missing) and cache every
    program that takes over `MIN_COMPILE_SECS` to compile, unless the environment sets JAX's own thresholds. Call
    before the first compile. Returns the directory, or None when turned off (JAX's cache off too, even where the
    environment sets JAX_COMPILATION_CACHE_DIR) or not writable (a warning; the stage runs without it).

    Imports nothing: before JAX is imported the settings go into this process's environment, where JAX reads its
    options' defaults (`JAX_COMPILATION_CACHE_DIR` and the rest), so a stage that refuses its input before it needs
    JAX never loads it (tests/test_refuse_early.py); once JAX is imported they go to `jax.config`."""
    env = os.environ if env is None else env
    directory = compile_cache_dir(env)
    if directory is None:
        _set_jax_option("jax_enable_compilation_cache", False)
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.warning("compilation cache: cannot create %s (%s); compiling without it", directory, err)
        return None
    _set_jax_option("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in env:
        _set_jax_option("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in env:
        _set_jax_option("jax_compilation_cache_max_size", MAX_BYTES)
    log.info("compilation cache: %s (%s=off turns it off)", directory, ENV)
    return directory


def converted_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the serving stages keep converted copies of GGUF targets' weights (`models.converted`):
    `converted/` inside the compilation cache's directory (JAX's own eviction only touches its `*-cache` files
    there); None when the cache is turned off."""
    directory = compile_cache_dir(env)
    return None if directory is None else directory / "converted"


def _set_jax_option(name: str, value: bool | float | int | str) -> None:
    """`jax.config.update(name, value)` once JAX is imported; before, the environment variable JAX reads the
    option's default from when it is imported (its name upper-cased)."""
    if "jax" in sys.modules:
        sys.modules["jax"].config.update(name, value)
    else:
        os.environ[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)


# JAX's monitoring events, recorded in the compiling thread: a read of the persistent cache that found the program
# (jax._src.compiler.compile_or_get_cached), then, when compile_or_get_cached returns, the program obtained (compiled
# or read; jax._src.dispatch.BACKEND_COMPILE_EVENT, with the program's name).
_FOUND = "/jax/compilation_cache/cache_hits"
_OBTAINED = "/jax/core/compile/backend_compile_duration"
_local = threading.local()
_registering = threading.Lock()
_registered: list[bool] = []


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """The programs a thread has obtained from JAX's compiler, by name (`jit(prefill)`): every one (compiled, or
    loaded from the persistent compilation cache) and those loaded."""

    obtained: Counter[str]
    loaded: Counter[str]

    def total(self, names: Iterable[str] | None = None) -> int:
        """Programs obtained, of these names (None: all)."""
        return sum(self.obtained.values()) if names is None else sum(self.obtained[n] for n in names)

    def loaded_total(self, names: Iterable[str] | None = None) -> int:
        """Programs loaded from the persistent cache, of these names (None: all)."""
        return sum(self.loaded.values()) if names is None else sum(self.loaded[n] for n in names)


def _thread_counts() -> CompileCounts:
    if not hasattr(_local, "counts"):
        _local.counts, _local.found = CompileCounts(Counter(), Counter()), False
    return _local.counts


def _on_event(event: str, **_: object) -> None:
    if event == _FOUND:
        _thread_counts()
        _local.found = True


def _on_duration(event: str, _seconds: float, **kwargs: object) -> None:
    if event == _OBTAINED:
        counts, name = _thread_counts(), str(kwargs.get("fun_name", "?"))
        counts.obtained[name] += 1
        if _local.found:
            counts.loaded[name] += 1
        _local.found = False


def _register() -> None:
    """Register the listeners with jax.monitoring, once per process: counting starts here."""
    with _registering:
        if not _registered:
            import jax

            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered.append(True)


def compile_counts() -> CompileCounts:
    """A copy of what the calling thread has obtained so far; counting starts at the first call in the process
    (`Engine` makes one when it is built), which registers the listeners with jax.monitoring."""
    _register()
    counts = _thread_counts()
    return CompileCounts(Counter(counts.obtained), Counter(counts.loaded))


def compile_totals(names: Iterable[str]) -> tuple[int, int]:
    """`compile_counts().total(names), compile_counts().loaded_total(names)` without copying the counters: what
    the engine reads around every program it calls."""
    _register()
    counts = _thread_counts()
    return counts.total(names), counts.loaded_total(names)


__all__ = ["ENV", "CompileCounts", "compile_cache_dir", "compile_counts", "compile_totals", "converted_dir",
           "enable_compile_cache"]
