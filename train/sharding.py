"""The training mesh and the sharding rules (docs/design.md §6): a table beside the models, not inside their math.

One `jax.sharding.Mesh` with named axes (data, fsdp, tensor):
- data:   pure data parallelism (params replicated along it);
- fsdp:   batch AND parameters split along it (ZeRO-3 style: weights gathered per use by XLA);
- tensor: the heads / MLP width of each matmul split along it.

Rules map a parameter path (joined with '/', e.g. `layers/0/self_attn/q_proj/kernel`, or
`layers/wq` for the target's stacked layers) to mesh axes per array dimension. The first rule whose regex
`re.search`es the path wins; optimizer states reuse the rule of the parameter they mirror (their paths
end with the parameter's path). A dimension not divisible by its axis' size is replicated instead (the
shapes of small models rarely divide 8 ways), so every rule is legal on every mesh.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dflash.configs.schema import require
from dflash.train.config import MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both

Rule = tuple[str, tuple[str | None, ...]]

# Drafter (nnx.Linear kernels are [in, out]).
DRAFTER_RULES: tuple[Rule, ...] = (
    (r"fc/kernel$", ("fsdp", None)),  # [F*D, D]; output NOT on tensor: see docs/decisions.md D11
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", ("fsdp", "tensor")),  # [D, heads | mlp]
    (r"(o_proj|down_proj)/kernel$", ("tensor", "fsdp")),                  # [heads | mlp, D]
    (r"kernel_projection/kernel$", ("fsdp", None)),  # DFlash2's convolutions: [D, 2*taps*D/group], as fc
    (r".", ()),                                                           # norms, conv base kernels: replicated
)

# Target (models.decoder params: layers stacked on a leading L axis; kernels are [in, out]).
TARGET_RULES: tuple[Rule, ...] = (
    (r"^embed$", ("tensor", "fsdp")),                                     # [V, D]
    (r"^lm_head$", ("fsdp", "tensor")),                                   # [D, V]
    (r"^layers/(wq|wk|wv|w_gate|w_up)$", (None, "fsdp", "tensor")),       # [L, D, heads | mlp]
    (r"^layers/(wo|w_down)$", (None, "tensor", "fsdp")),                  # [L, heads | mlp, D]
    (r"^layers/b[qkv]$", (None, "tensor")),                               # [L, heads]
    (r".", ()),
)




def head_rules(vocab_major: bool) -> tuple[Rule, ...]:
    """Rules of the training loss's frozen head (`train.objective.TrainHead`): its matrix as the target's embedding
    ([V, D], or a training vocabulary's [V', D] rows) or LM head ([D, V]) is laid out; its label map replicated."""
    return ((r"^matrix$", ("tensor", "fsdp") if vocab_major else ("fsdp", "tensor")), (r".", ()))


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `num_devices`, the -1 filled in."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        require(num_devices % known == 0, "train.mesh", tuple(sizes),
                f"divide the {num_devices} devices (the fixed axes multiply to {known})")
        sizes[sizes.index(-1)] = num_devices // known
    require(math.prod(sizes) == num_devices, "train.mesh", tuple(sizes),
            f"multiply to the number of devices ({num_devices})")
    return sizes[0], sizes[1], sizes[2]


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def path_str(path: tuple[Any, ...]) -> str:
    """'a/b/0/c' for a jax key path (nnx Variable `.value` steps dropped)."""
    parts = []
    for key in path:
        name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
        if name is None:
            name = str(key)
        if name == "value":
            continue
        parts.append(str(name))
    return "/".join(parts)


def spec_for(path: str, shape: tuple[int, ...], rules: Sequence[Rule], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of one array: its rule's axes, replicated where a dimension does not divide."""
    axes = next((rule_axes for pattern, rule_axes in rules if re.search(pattern, path)), ())
    if len(axes) > len(shape):  # e.g. an optimizer scalar whose path ends like a kernel's
        return PartitionSpec()
    spec = []
    for dim, axis in zip(shape, axes, strict=False):
        size = mesh.shape[axis] if axis is not None else 1
        spec.append(axis if axis is not None and size > 1 and dim % size == 0 else None)
    return PartitionSpec(*spec)


def tree_shardings(tree: Any, rules: Sequence[Rule], mesh: Mesh) -> Any:
    """A pytree of NamedShardings matching `tree` (arrays or ShapeDtypeStructs) under `rules`."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, spec_for(path_str(p), tuple(x.shape), rules, mesh)), tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Batch dimension over (data, fsdp); the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_divisor(mesh: Mesh) -> int:
    """The global batch must be a multiple of this (data x fsdp)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Global arrays from this process's rows of the batch (a `data.batch.TrainBatch` of host arrays, or any pytree
    of them), the rows split over (data, fsdp) (`jax.make_array_from_process_local_data`)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(x)),
                                                                         np.asarray(x)), batch)


def place(tree: Any, rules: Sequence[Rule], mesh: Mesh) -> Any:
    """`tree` (host arrays) put on `mesh` under `rules`."""
    return jax.device_put(tree, tree_shardings(tree, rules, mesh))


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
    "shard_batch",
    "spec_for",
    "tree_shardings",
]
