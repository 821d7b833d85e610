"""Log every XLA compile of a run: which test caused it, the program, its seconds (the suite's time is mostly
compiles of distinct programs: docs/decisions.md D59, D62).

Use: put this folder first on PYTHONPATH and name a log file; subprocesses inherit both, and the log gets one
tab-separated line per compile: pid, test id (PYTEST_CURRENT_TEST), program name, seconds, a hash of the program
text, the program's signature (its argument types). Start from an empty compile cache, or cache hits hide the
compiles:

    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) COMPILE_LOG=/tmp/compiles.tsv PYTHONPATH=tools/compile_log \
        .venv/bin/python -m pytest tests/test_engine.py
    awk -F'\t' '$4 >= 1 {n++; s += $4} END {print n " compiles over 1 s, " s " s"}' /tmp/compiles.tsv

It patches `jax._src.compiler.compile_or_get_cached` when JAX first imports it (importing JAX here would read
JAX's environment settings before the tests set them), so a JAX upgrade that renames it breaks only this tool."""

import hashlib
import importlib.abc
import importlib.machinery
import os
import sys
import time

_LOG = os.environ.get("COMPILE_LOG")


def _patch(compiler) -> None:
    original = compiler.compile_or_get_cached

    def logged(backend, computation, *args, **kwargs):
        start = time.perf_counter()
        out = original(backend, computation, *args, **kwargs)
        seconds = time.perf_counter() - start
        text = str(computation)
        name = str(computation.operation.attributes["sym_name"]).strip('"')
        signature = next((line.strip() for line in text.splitlines() if "func.func public @main" in line), "")
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()}\t{test}\t{name}\t{seconds:.3f}\t{hashlib.md5(text.encode()).hexdigest()[:10]}"
                    f"\t{signature}\n")
        return out

    compiler.compile_or_get_cached = logged


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "jax._src.compiler":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if _LOG:
    sys.meta_path.insert(0, _PatchOnImport())
