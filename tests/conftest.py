"""Test setup: simulated 8-device CPU mesh, set once here before JAX starts (STYLE 11)."""

import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

GOLDEN = Path(__file__).parent / "golden"
TINY_CASES = sorted(p.name for p in (GOLDEN / "tiny").iterdir() if p.is_dir())


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
