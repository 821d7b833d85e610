"""The `launch` section of a recipe: where its stages run.

`tpu_type` is the Cloud TPU slice a pod recipe is sized for (`v5p-128`): what `dflash launch compile` compiles
for when no `--topology` is given. The slice-name rule lives here (`split_tpu_type`) so that loading a recipe
checks it without importing the launcher; `launch.tpus.parse_tpu_type` builds the full slice from it.
"""

from __future__ import annotations

import dataclasses
import re

from dflash.configs.schema import ConfigError

# TensorCores per chip counted in a slice name (`v5p-128` = 64 chips; v5e and v6e names count chips), by generation.
TPU_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5litepod": 1, "v6e": 1}
TPU_ALIASES = {"v5e": "v5litepod"}


def split_tpu_type(name: str, field: str = "--tpu-type") -> tuple[str, int, int]:
    """(generation, size, chips) of a slice name such as `v5p-128` -> ("v5p", 128, 64); a ConfigError naming
    `field`, the value and the rule otherwise."""
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name.strip()) if isinstance(name, str) else None
    gen = TPU_ALIASES.get(m.group(1), m.group(1)) if m else None
    if m is None or gen not in TPU_CORES_PER_CHIP:
        raise ConfigError(f"{field} must be <generation>-<size> with a generation of {sorted(TPU_CORES_PER_CHIP)} "
                          f"(e.g. v5p-128, v5litepod-16, v6e-256); received {name!r}")
    size = int(m.group(2))
    chips, rest = divmod(size, TPU_CORES_PER_CHIP[gen])
    if rest or chips < 1 or chips & (chips - 1):
        per = "TensorCores (2 per chip)" if TPU_CORES_PER_CHIP[gen] == 2 else "chips"
        raise ConfigError(f"{field} {name!r}: the size must be a power of two number of {per}; received {size}")
    return gen, size, chips


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Where the recipe runs.

    tpu_type: the TPU slice the recipe's mesh and batch are sized for (`v5p-128`, `v5litepod-16`, `v6e-256`):
              `dflash launch compile` compiles for it unless `--topology` says otherwise; None (the default) for
              a recipe meant for one machine.
    """

    tpu_type: str | None = None

    def __post_init__(self) -> None:
        if self.tpu_type is not None:
            split_tpu_type(self.tpu_type, "launch.tpu_type")


__all__ = ["TPU_ALIASES", "TPU_CORES_PER_CHIP", "LaunchConfig", "split_tpu_type"]
