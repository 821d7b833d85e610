"""The training mesh (docs/design.md §6): its shape from the recipe's `train.mesh`, the batch split over (data, fsdp),
and the frozen head's rules; the parameters' rules and the rule machinery live beside the models
(`models.sharding`) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash.models.sharding import (
    AXES,
    DRAFTER_RULES,
    TARGET_RULES,
    Rule,
    path_str,
    place,
    replicated,
    spec_for,
    tree_shardings,
)
from dflash.train.config import MeshConfig, mesh_shape

BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both


def head_rules(vocab_major: bool) -> tuple[Rule, ...]:
    """Rules of the training loss's frozen head (`train.objective.TrainHead`): its matrix as the target's embedding
    ([V, D], or a training vocabulary's [V', D] rows) or LM head ([D, V]) is laid out; its label map replicated."""
    return ((r"^matrix$", ("tensor", "fsdp") if vocab_major else ("fsdp", "tensor")), (r".", ()))


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch dimension over (data, fsdp); the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_divisor(mesh: Mesh) -> int:
    """The global batch must be a multiple of this (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Global arrays from this process's rows of the batch (a `data.batch.TrainBatch` of host arrays, or any pytree
    of them), the rows split over (data, fsdp) (`jax.make_array_from_process_local_data`)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(x)),
                                                                         np.asarray(x)), batch)


__all__ = [
    "AXES",
    "DRAFTER_RULES",
    "MeshConfig",
    "TARGET_RULES",
    "batch_divisor",
    "batch_sharding",
    "head_rules",
    "make_mesh",
    "mesh_shape",
    "path_str",
    "place",
    "replicated",
    "Rule",
    "shard_batch",
    "spec_for",
    "tree_shardings",
]
