"""The loaded target: architecture, params on device, tokenizer, and where they came from."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from dflash.configs.schema import require
from dflash.models.config import DecoderConfig, DrafterConfig, TargetConfig
from dflash.models.drafter import DrafterArch, default_mask_token_id, resolve_drafter
from dflash.models.loading import load_weights, weights_fingerprint
from dflash.models.registry import check_target, resolve_source
from dflash.models.tokenizer import ChatTokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """A frozen target LLM ready for the forwards in `models.decoder`."""

    name: str
    path: Path
    cfg: DecoderConfig
    params: dict[str, Any]
    tokenizer: ChatTokenizer
    dtype: Any

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the weight files (recorded in feature manifests and checkpoints)."""
        return weights_fingerprint(self.path)

    def drafter_arch(self, cfg: DrafterConfig) -> DrafterArch:
        """The drafter section `cfg` resolved for this target (mask id from its tokenizer when -1; never a
        stop token)."""
        arch = resolve_drafter(cfg, self.cfg, default_mask_token_id(self.tokenizer, self.cfg))
        require(arch.mask_token_id not in self.tokenizer.stop_token_ids, "drafter.mask_token_id",
                arch.mask_token_id, f"not be a stop token {self.tokenizer.stop_token_ids}")
        return arch


def load_target(cfg: TargetConfig, converted: Path | None = None) -> Target:
    """Check `cfg.source`'s architecture from its config.json alone (`check_target`: an unsupported one is refused
    before any download), then resolve it, load weights and tokenizer, cast params to `cfg.dtype` on device.
    converted: a directory of converted copies of GGUF weights (`models.converted`; None: dequantise every time)."""
    check_target(cfg.source)
    path = resolve_source(cfg.source)
    decoder_cfg, host_params = load_weights(path, converted)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > decoder_cfg.vocab_size:
        raise ValueError(
            f"{path}: the tokenizer's vocabulary ({tokenizer.vocab_size}) must fit the embedding table "
            f"({decoder_cfg.vocab_size} rows)"
        )
    dtype = jnp.dtype(cfg.dtype)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), host_params)
    log.info("loaded target %s: %d layers, hidden %d, vocab %d (%s)", path.name, decoder_cfg.num_layers,
             decoder_cfg.hidden_size, decoder_cfg.vocab_size, cfg.dtype)
    return Target(name=cfg.source, path=path, cfg=decoder_cfg, params=params, tokenizer=tokenizer, dtype=dtype)
