"""Sharding rules beside the models (docs/design.md §6): a table per model, not inside its math, shared by the
trainer's mesh (`train.sharding`) and the engine's (`serve.engine`, a host's devices in tensor parallel).

One `jax.sharding.Mesh` with named axes (data, fsdp, tensor):
- data:   pure data parallelism (params replicated along it);
- fsdp:   batch AND parameters split along it (ZeRO-3 style: weights gathered per use by XLA);
- tensor: the heads / MLP width of each matmul split along it;
- expert: a mixture-of-experts target's experts split along it (expert parallel). The rules name it; a mesh
  without it (today's `AXES`) places those dimensions as if it had size 1, a mesh with it splits them.

Rules map a parameter path (joined with '/', e.g. `layers/0/self_attn/q_proj/kernel`, or
`layers/wq` for the target's stacked layers) to mesh axes per array dimension. The first rule whose regex
`re.search`es the path wins; optimizer states reuse the rule of the parameter they mirror (their paths
end with the parameter's path). A dimension not divisible by its axis' size is replicated instead (the
shapes of small models rarely divide 8 ways), so every rule is legal on every mesh.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
EXPERT_AXIS = "expert"  # named by the MoE rules; used where a mesh has it (see the module docstring)

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
    (r"^layers/(we_gate|we_up)$", (None, "expert", "fsdp", "tensor")),   # [L, E, D, moe mlp]
    (r"^layers/we_down$", (None, "expert", "tensor", "fsdp")),            # [L, E, moe mlp, D]
    (r"^layers/router$", (None, "fsdp", None)),                           # [L, D, E]
    (r"^layers/(be_gate|be_up)$", (None, "fsdp", "tensor")),  # [L, E, moe mlp] (gpt-oss; small: fsdp, not expert)
    (r"^layers/be_down$", (None, "expert", "fsdp")),                      # [L, E, D]
    (r".", ()),
)

# The engine's caches: the target's paged K/V [L, P, page_size, Hk, Dh] split over its kv heads, as the target's
# k/v projections are; the drafter (replicated in the engine) keeps its context cache whole; the rest (page tables,
# lengths, keys) replicated.
CACHE_RULES: tuple[Rule, ...] = (
    (r"(^|/)(k_pages|v_pages)$", (None, None, None, "tensor", None)),
    (r".", ()),
)


def tensor_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A (data, fsdp, tensor) mesh of `devices` all on the tensor axis: one host's chips serving one engine."""
    return Mesh(np.asarray(list(devices), dtype=object).reshape(1, 1, len(devices)), AXES)


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
        size = mesh.shape.get(axis, 1) if axis is not None else 1  # an axis the mesh lacks: size 1
        spec.append(axis if axis is not None and size > 1 and dim % size == 0 else None)
    return PartitionSpec(*spec)


def tree_shardings(tree: Any, rules: Sequence[Rule], mesh: Mesh) -> Any:
    """A pytree of NamedShardings matching `tree` (arrays or ShapeDtypeStructs) under `rules`."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, spec_for(path_str(p), tuple(x.shape), rules, mesh)), tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(tree: Any, rules: Sequence[Rule], mesh: Mesh) -> Any:
    """`tree` (host arrays) put on `mesh` under `rules`."""
    return jax.device_put(tree, tree_shardings(tree, rules, mesh))


__all__ = ["AXES", "CACHE_RULES", "DRAFTER_RULES", "EXPERT_AXIS", "TARGET_RULES", "Rule", "path_str", "place",
           "replicated", "spec_for", "tensor_mesh", "tree_shardings"]
