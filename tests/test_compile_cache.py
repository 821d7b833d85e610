"""The persistent compilation cache of serve, eval and regenerate (serve/compile_cache.py, D78): where it lives, how
it is turned off, that a second process loads what the first compiled, and how compiles are counted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from dflash.eval.servers import stop_process
from dflash.serve.compile_cache import compile_cache_dir, compile_counts, converted_dir

# JAX imported before the cache is turned on (its options set through jax.config), or after it, as
# `dflash.launch.cli` does (set through the environment JAX reads their defaults from)
PROBE = """
import json, sys
{first}
from dflash.serve.compile_cache import compile_counts, enable_compile_cache
directory = enable_compile_cache()
assert ("jax" in sys.modules) == {jax_first}
import jax, jax.numpy as jnp
before = compile_counts()
jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0))(jnp.ones((32, 32))).block_until_ready()
after = compile_counts()
print(json.dumps({{"dir": None if directory is None else str(directory), "obtained": after.total(["jit(<lambda>)"]),
                  "loaded": after.loaded_total(["jit(<lambda>)"])}}))
"""


def _env(cache: Path | str) -> dict[str, str]:
    """This environment with the compilation cache in `cache` (the tests' own JAX_COMPILATION_CACHE_DIR dropped) and
    every program written, however fast it compiled."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(DFLASH_COMPILE_CACHE=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def test_where_the_cache_lives():
    home = {"HOME": "/h"}
    assert compile_cache_dir(home) == Path("/h/.cache/dflash/jax")
    assert compile_cache_dir({**home, "XDG_CACHE_HOME": "/x"}) == Path("/x/dflash/jax")
    assert compile_cache_dir({**home, "JAX_COMPILATION_CACHE_DIR": "/j"}) == Path("/j")  # JAX's own, when set
    assert compile_cache_dir({**home, "JAX_COMPILATION_CACHE_DIR": "/j", "DFLASH_COMPILE_CACHE": "/d"}) == Path("/d")
    assert compile_cache_dir({**home, "DFLASH_COMPILE_CACHE": "~/c"}) == Path("~/c").expanduser()
    for off in ("off", "OFF", "0", "none", ""):
        assert compile_cache_dir({**home, "DFLASH_COMPILE_CACHE": off}) is None
        assert converted_dir({**home, "DFLASH_COMPILE_CACHE": off}) is None  # the same switch
    assert converted_dir({**home, "DFLASH_COMPILE_CACHE": "/d"}) == Path("/d/converted")  # GGUF weights, converted


def _probe(env: dict[str, str], jax_first: bool) -> dict:
    code = PROBE.format(first="import jax" if jax_first else "", jax_first=jax_first)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("jax_first", [True, False], ids=["jax-imported-first", "cache-turned-on-first"])
def test_a_second_process_loads_what_the_first_compiled(tmp_path, jax_first):
    """Two processes over one cache directory: the first compiles the program and writes it, the second loads it
    (counted as loaded); turned off, the program is compiled again and nothing is written, not even where the
    environment names JAX's own cache directory."""
    cache = tmp_path / "cache"
    first, second = _probe(_env(cache), jax_first), _probe(_env(cache), jax_first)
    assert first == {"dir": str(cache), "obtained": 1, "loaded": 0} and any(cache.iterdir())
    assert second == {"dir": str(cache), "obtained": 1, "loaded": 1}
    jax_own = tmp_path / "jax-own"
    off = _probe({**_env("off"), "JAX_COMPILATION_CACHE_DIR": str(jax_own), "XDG_CACHE_HOME": str(tmp_path / "xdg")},
                 jax_first)
    assert off == {"dir": None, "obtained": 1, "loaded": 0}
    assert not (tmp_path / "xdg").exists() and not (jax_own.exists() and any(jax_own.iterdir()))


def test_compiles_are_counted_once_per_program_in_the_compiling_thread():
    """An ahead-of-time compile counts; the call after it, which reuses it, does not; another thread's compiles are
    not this thread's."""
    import threading

    @jax.jit
    def twice(x):
        return 2 * x

    name = ["jit(twice)"]
    x = jnp.ones((3, 5))
    before = compile_counts()
    twice.lower(x).compile()
    mid = compile_counts()
    twice(x).block_until_ready()
    after = compile_counts()
    assert mid.total(name) - before.total(name) == 1 and after.total(name) == mid.total(name)
    seen = []
    worker = threading.Thread(target=lambda: (twice(jnp.ones((4, 5))).block_until_ready(),
                                              seen.append(compile_counts().total(name))))
    worker.start()
    worker.join()
    assert seen == [1] and compile_counts().total(name) == after.total(name)


PRECOMPILED = re.compile(r"precompiled (\d+) programs .*?in [\d.]+ s, (\d+) of them loaded from the compilation cache")


def _serve_start(env: dict[str, str]) -> tuple[int, int]:
    """Start `dflash serve` on the tiny recipe (AR, one slot, 32-token context: few programs), read its precompile
    line, stop it; returns (programs precompiled, of them loaded from the compilation cache)."""
    cmd = [sys.executable, "-m", "dflash.launch.cli", "serve", "--config", "tiny", "--ar", "--slots", "1",
           "--port", "0", "target.max_seq_len=32"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if match := PRECOMPILED.search(line):
                return int(match.group(1)), int(match.group(2))
        raise AssertionError(f"no precompile line; the server exited with {proc.wait()}:\n{''.join(lines)[-3000:]}")
    finally:
        stop_process(proc, timeout=60)


@pytest.mark.slow  # ~1 min of SmolLM2 compiles; test_a_second_process_loads_what_the_first_compiled keeps the property
@pytest.mark.e2e
def test_a_second_serve_start_loads_every_program_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    programs, loaded = _serve_start(_env(cache))
    assert programs > 0 and loaded == 0
    written = sorted(p.name for p in cache.iterdir())
    assert written
    assert _serve_start(_env(cache)) == (programs, programs)  # every program read back, none compiled
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith("-atime")) == \
        sorted(p for p in written if not p.endswith("-atime"))  # nothing new written
