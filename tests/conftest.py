"""Test setup: simulated 8-device CPU mesh, set once here before JAX starts (STYLE 11)."""

import builtins
import dataclasses
import gc
import io
import os
import tomllib
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs persist on disk, keyed by program, JAX version, backend and flags (so an entry is never stale),
# shared by the xdist workers and by the `dflash` subprocesses the tests start (they inherit the environment):
# the suite compiles the same SmolLM2 and tiny-model programs in many modules, and jax.clear_caches() below only
# clears the in-memory cache. tests/test_engine.py alone: 86 s cold, 18 s warm; caching every small program too
# (threshold 0) made the whole suite slower, so only compiles over 1 s are kept (docs/decisions.md D44).
_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "jax-tests"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")  # big programs only: small ones cost more
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # least recently used entries go past 2 GiB

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parent.parent
# The package folders at the repository root, each installed as `dflash.<folder>` (pyproject's package-dir, D67).
PACKAGE_DIRS = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
GOLDEN = Path(__file__).parent / "golden"
TINY_CASES = sorted(p.name for p in (GOLDEN / "tiny").iterdir() if p.is_dir())


def tiny_engine_models(block_size: int = 8):
    """The tiny qwen3 target (fp32) and a fresh 2-layer drafter over it: what the engine tests decode with."""
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
    from dflash.models.loading import load_hf_dir

    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=block_size),
                           target_cfg, mask_token_id=255)
    return target_cfg, target_params, DFlashDrafter(arch, nnx.Rngs(0))


# The reference engine's shape: one for every file, so that the references (and the engines of tests that take
# this shape) share their compiled programs.
ALONE_SLOTS, ALONE_LEN = 3, 128


def decode_alone(target_params, target_cfg, drafter, prompt, budget: int, *, block_size=None, stop_ids=(),
                 sampling=None, seed: int = 0) -> list[int]:
    """The tokens of `prompt` decoded alone: the only request of an engine of ALONE_SLOTS slots and ALONE_LEN
    context (AR without a block_size), the reference the engine tests compare against."""
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits

    plan = AR() if block_size is None else Chain(block_size)
    engine = Engine(target_params, target_cfg, drafter, plan, Limits(slots=ALONE_SLOTS, max_len=ALONE_LEN))
    rid = engine.submit(prompt, budget, stop_ids, seed=seed, sampling=sampling)
    return engine.run()[rid].token_ids


def ar_alone(target_params, target_cfg, prompt, budget: int, stop_ids=()) -> list[int]:
    """The greedy AR tokens of `prompt` decoded alone (`decode_alone` without a drafter)."""
    return decode_alone(target_params, target_cfg, None, prompt, budget, stop_ids=stop_ids)


def drafter_params(drafter) -> dict:
    """A drafter's parameters as {path: numpy array}."""
    import numpy as np
    from flax import nnx

    return {keys: np.asarray(v[...]) for keys, v in nnx.to_flat_state(nnx.state(drafter, nnx.Param))}


def assert_same_params(want, got) -> None:
    """The two drafters hold the same parameter paths with bit-identical values."""
    import numpy as np

    want, got = drafter_params(want), drafter_params(got)
    assert want.keys() == got.keys()
    for keys in want:
        np.testing.assert_array_equal(got[keys], want[keys])


def assert_greedy_equals_ar(target_params, target_cfg, drafter, prompts, max_new_tokens: int, *, block_size: int,
                            max_len: int = 128) -> None:
    """Greedy DFlash decodes of `prompts` with `drafter` equal AR's token for token (through the engine)."""
    from dflash.serve.engine import decode
    from dflash.serve.plan import Chain

    ar = decode(target_params, target_cfg, prompts, max_new_tokens, max_len=max_len)
    spec = decode(target_params, target_cfg, prompts, max_new_tokens, max_len=max_len, drafter=drafter,
                  plan=Chain(block_size))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]


def export_round_trip(drafter, layout: str, directory: Path, target_cfg, expect):
    """Save `drafter` in `layout` ("zlab" | "speculators", verifier "tiny") into `directory` and load it back
    against `expect`; returns (the loaded drafter, the config.json written)."""
    import json

    from dflash.models.speculators import load_speculators, save_speculators
    from dflash.models.zlab import load_zlab, save_zlab

    if layout == "zlab":
        save_zlab(drafter, directory)
        loaded = load_zlab(directory, target_cfg, expect=expect)
    else:
        save_speculators(drafter, directory, verifier="tiny")
        loaded = load_speculators(directory, target_cfg, expect=expect)
    return loaded, json.loads((directory / "config.json").read_text())


@dataclasses.dataclass
class IoCount:
    """Files opened for writing under a root, fsyncs and renames (any path) while counting."""

    writes: int = 0
    fsyncs: int = 0
    renames: int = 0

    def most(self) -> int:
        return max(self.writes, self.fsyncs, self.renames)


@pytest.fixture
def io_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> IoCount:
    """Count the writes under tmp_path (every `open` for writing: builtins, io, pathlib; every ArrayRecord file
    written), every os.fsync and every rename (os.replace, os.rename, which pathlib's calls)."""
    from array_record.python import array_record_module

    count = IoCount()
    real_open, real_fsync, real_replace, real_rename = io.open, os.fsync, os.replace, os.rename
    root = str(tmp_path)

    def counting_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and str(file).startswith(root):
            count.writes += 1
        return real_open(file, mode, *args, **kwargs)

    def counting_fsync(fd):
        count.fsyncs += 1
        return real_fsync(fd)

    def counting_replace(src, dst, **kwargs):
        count.renames += 1
        return real_replace(src, dst, **kwargs)

    def counting_rename(src, dst, **kwargs):
        count.renames += 1
        return real_rename(src, dst, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(os, "fsync", counting_fsync)
    monkeypatch.setattr(os, "replace", counting_replace)
    monkeypatch.setattr(os, "rename", counting_rename)
    real_writer = array_record_module.ArrayRecordWriter

    def counting_writer(path, *args):
        count.writes += str(path).startswith(root)
        return real_writer(path, *args)

    monkeypatch.setattr(array_record_module, "ArrayRecordWriter", counting_writer)
    return count


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def smollm2_target():
    """The embedded default target, loaded once per session (fp32)."""
    from dflash.models.config import TargetConfig
    from dflash.models.target import load_target

    return load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=512))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs and collect garbage: one pytest process runs the
    whole suite, and the programs of finished modules would otherwise accumulate."""
    yield
    jax.clear_caches()
    gc.collect()


# The files that take longest in the default tier (--durations and compile seconds per file, 2026-12-05), longest
# first. They are collected first so that pytest-xdist starts them early (bin/test's `--dist loadfile
# --no-loadscope-reorder` hands out files in collection order; xdist's default reorders them by number of tests,
# which ran the one-test SIGKILL resume file, 2-3 min, alone at the end) and the short files fill the other worker
# around them.
_LONGEST_FIRST = ("test_eval.py", "test_train_resume.py", "test_engine.py", "test_tree.py", "test_speculative.py",
                  "test_sliding_window.py", "test_engine_pages.py", "test_dflash2.py", "test_server_compat.py",
                  "test_train_step.py", "test_walk.py", "test_data_regenerate.py", "test_server.py", "test_trainer.py",
                  "test_selector.py", "test_objective.py", "test_export.py", "test_decoder_cache.py", "test_drafter.py",
                  "test_shipped_drafter.py", "test_server_fuzz.py", "test_multihost.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order is kept otherwise
