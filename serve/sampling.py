"""Sampling policy: a small frozen dataclass (greedy when temperature == 0)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from configs.schema import require


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.temperature >= 0.0, "sampling.temperature", self.temperature, "be >= 0")
        require(0.0 < self.top_p <= 1.0, "sampling.top_p", self.top_p, "lie in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "be >= 0 (0 disables top-k)")
        require(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens, "be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logprobs(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p filtering (fp32). Not for greedy."""
    logits = logits_BxV.astype(jnp.float32) / cfg.temperature
    if cfg.top_k > 0:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_desc = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(cum_before < cfg.top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def sample(logits_BxV: jax.Array, cfg: SamplingConfig, key: jax.Array) -> jax.Array:
    """Next token ids [B]: argmax when greedy, else a draw from the filtered distribution."""
    if cfg.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logprobs(logits_BxV, cfg), axis=-1).astype(jnp.int32)
