"""The loaded target: architecture, weights (read onto devices when a stage places them), tokenizer, and where they
came from.

    target = load_target(recipe.target)                  # headers and tokenizer read; no weight on any device yet
    params = target.on(mesh)                             # each device reads its share (models.sharding's table)
    params = target.on(jax.local_devices()[2])           # the whole target on one device
    target.params                                        # the whole target on the default device, kept

A stage that spreads the target over several devices (training's mesh, an engine over a host's chips, a regeneration
or capture replica per device group) calls `on`, which reads each device's region straight from the checkpoint
(`models.placement.put`); `params` is for the one-device stages (chat, a one-device server or engine), and a stage on
a mesh never touches it, so no device holds a whole copy beside its share (docs/decisions.md, pods-mesh).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from dflash.configs.schema import require
from dflash.models.config import DecoderConfig, DrafterConfig, TargetConfig
from dflash.models.drafter import DrafterArch, default_mask_token_id, resolve_drafter
from dflash.models.loading import open_weights, weights_fingerprint
from dflash.models.placement import abstract, put
from dflash.models.regions import Lazy
from dflash.models.registry import check_target, resolve_source
from dflash.models.sharding import TARGET_RULES, Rule, tensor_mesh, tree_shardings
from dflash.models.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """A frozen target LLM ready for the forwards in `models.decoder`.

    weights: its params in the decoder's layout, not yet on a device (`models.regions.Lazy` leaves or host arrays,
    as `load_target` makes them) or already placed (jax.Arrays, e.g. a test's); `dtype` is what they are used in."""

    name: str
    path: Path
    cfg: DecoderConfig
    weights: Any
    tokenizer: ChatTokenizer
    dtype: Any

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the weight files (recorded in feature manifests and checkpoints)."""
        return weights_fingerprint(self.path)

    @functools.cached_property
    def params(self) -> dict[str, Any]:
        """The whole target in `dtype` on the default device, read once and kept: for one-device stages. A stage
        over several devices calls `on` instead (this would put a whole copy on one of them)."""
        def one(leaf: Any) -> jax.Array:
            return jnp.asarray(np.asarray(leaf) if isinstance(leaf, Lazy) else leaf, dtype=self.dtype)

        return jax.tree.map(one, self.weights, is_leaf=lambda x: isinstance(x, Lazy))

    def on(self, where: Mesh | jax.Device, rules: Sequence[Rule] = TARGET_RULES, dtype: Any = None) -> dict[str, Any]:
        """The target placed on `where`: over a mesh by `rules` (each of this process's devices reading only its
        region), or whole on one device; in `dtype` (default: the target's), rounded through the target's dtype
        first (as `params` cast to `dtype` would be). Nothing is kept: the caller holds the only copy."""
        base = jnp.dtype(self.dtype)
        dtypes = [base] + ([jnp.dtype(dtype)] if dtype is not None and jnp.dtype(dtype) != base else [])
        weights = self.__dict__.get("params", self.weights)  # already on a device: moved, not read again
        if isinstance(where, Mesh):
            return put(weights, tree_shardings(abstract(weights), rules, where), dtypes)
        return put(weights, SingleDeviceSharding(where), dtypes)

    def on_group(self, group: Sequence[jax.Device]) -> dict[str, Any]:
        """The target on one replica's device group: whole on a group of one, split over a larger group in tensor
        parallel (`models.sharding.tensor_mesh`, as the engine's `Limits.devices` places it)."""
        return self.on(group[0]) if len(group) == 1 else self.on(tensor_mesh(group))

    def drafter_arch(self, cfg: DrafterConfig) -> DrafterArch:
        """The drafter section `cfg` resolved for this target (mask id from its tokenizer when -1; never a
        stop token)."""
        arch = resolve_drafter(cfg, self.cfg, default_mask_token_id(self.tokenizer, self.cfg))
        require(arch.mask_token_id not in self.tokenizer.stop_token_ids, "drafter.mask_token_id",
                arch.mask_token_id, f"not be a stop token {self.tokenizer.stop_token_ids}")
        return arch


def load_target(cfg: TargetConfig, converted: Path | None = None) -> Target:
    """Check `cfg.source`'s architecture from its config.json alone (`check_target`: an unsupported one is refused
    before any download), then resolve it, open its weights (headers read and every tensor's shape checked; no
    weight read: a stage reads them onto its devices, `Target.on` / `Target.params`) and load the tokenizer.
    converted: a directory of converted copies of GGUF weights (`models.converted`; None: dequantise every time)."""
    check_target(cfg.source)
    path = resolve_source(cfg.source)
    decoder_cfg, weights = open_weights(path, converted)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > decoder_cfg.vocab_size:
        raise ValueError(
            f"{path}: the tokenizer's vocabulary ({tokenizer.vocab_size}) must fit the embedding table "
            f"({decoder_cfg.vocab_size} rows)"
        )
    log.info("opened target %s: %d layers, hidden %d, vocab %d (%s)", path.name, decoder_cfg.num_layers,
             decoder_cfg.hidden_size, decoder_cfg.vocab_size, cfg.dtype)
    return Target(name=cfg.source, path=path, cfg=decoder_cfg, weights=weights, tokenizer=tokenizer,
                  dtype=jnp.dtype(cfg.dtype))
