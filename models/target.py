"""The loaded target: architecture, params on device, tokenizer, and where they came from."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from models.config import DecoderConfig, TargetConfig
from models.loading import load_weights, weights_fingerprint
from models.registry import resolve_source
from models.tokenizer import ChatTokenizer, load_tokenizer

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


def load_target(cfg: TargetConfig) -> Target:
    """Resolve `cfg.source`, load weights and tokenizer, cast params to `cfg.dtype` on device."""
    path = resolve_source(cfg.source)
    decoder_cfg, host_params = load_weights(path)
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
