"""Sampling policy: a small frozen dataclass (greedy when temperature == 0), and its per-sequence form.

`SamplingConfig` is one request's rule. `SamplingRows` holds the rules of a whole batch as arrays [B]
(temperature, top_p, top_k), so one jitted step serves requests that sample differently: the rules are
data, not static arguments, and changing them never recompiles. A row with temperature 0 is greedy.

Filtering (`row_logprobs`): logits / temperature, then top-k (keep the k largest, ties at the k-th
included; 0 = off), then top-p over what top-k kept (keep the smallest set of largest logits whose
probability reaches top_p; 1 = off), then log-softmax. One sort serves both filters; when no row filters
(every top_k 0 and top_p 1) the sort is skipped at run time (`lax.cond`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from dflash.serve.config import SamplingConfig

GREEDY = SamplingConfig()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-sequence sampling rules: temperature float32[B] (0 = greedy), top_p float32[B], top_k int32[B]."""

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array

    @classmethod
    def of(cls, configs: Sequence[SamplingConfig | None]) -> SamplingRows:
        """Rows from one config per sequence (None = greedy)."""
        configs = [c or GREEDY for c in configs]
        return cls(jnp.asarray([c.temperature for c in configs], jnp.float32),
                   jnp.asarray([c.top_p for c in configs], jnp.float32),
                   jnp.asarray([c.top_k for c in configs], jnp.int32))

    @property
    def greedy(self) -> jax.Array:
        """bool[B]: rows decoded by argmax."""
        return self.temperature == 0.0

    def set(self, rows_Ba: jax.Array, values: SamplingRows) -> SamplingRows:
        """These rules with rows `rows_Ba` replaced by `values` (R rows)."""
        return jax.tree.map(lambda a, v: a.at[rows_Ba].set(v, mode="drop"), self, values)  # rows >= B: dropped


def row_logprobs(logits: jax.Array, rows: SamplingRows) -> jax.Array:
    """Filtered log-probabilities (fp32) of logits [B, ..., V] under each row's rule (see the module
    docstring). Greedy rows are computed at temperature 1 (their values are not used)."""
    extra = (1,) * (logits.ndim - 1)  # broadcast [B] over [B, ..., V]
    temperature = jnp.where(rows.greedy, 1.0, rows.temperature).reshape(-1, *extra)
    top_p = rows.top_p.reshape(-1, *extra)
    top_k = rows.top_k.reshape(-1, *extra)
    logits = logits.astype(jnp.float32) / temperature

    def filtered(x: jax.Array) -> jax.Array:
        sorted_desc = -jnp.sort(-x, axis=-1)
        kth = jnp.take_along_axis(sorted_desc, jnp.clip(top_k - 1, 0, x.shape[-1] - 1), axis=-1)
        kth = jnp.where(top_k > 0, kth, -jnp.inf)
        x = jnp.where(x < kth, -jnp.inf, x)
        sorted_desc = jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(cum_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((top_p < 1.0) & (x < cutoff), -jnp.inf, x)

    needs_filter = jnp.any(rows.top_k > 0) | jnp.any(rows.top_p < 1.0)
    logits = jax.lax.cond(needs_filter, filtered, lambda x: x, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def filtered_logprobs(logits_BxV: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p filtering (fp32), one rule for every row.
    Not for greedy. Logits may be [V] or [B, ..., V]."""
    if logits_BxV.ndim == 1:
        return filtered_logprobs(logits_BxV[None], cfg)[0]
    return row_logprobs(logits_BxV, SamplingRows.of([cfg] * logits_BxV.shape[0]))


def sample(logits_BxV: jax.Array, cfg: SamplingConfig, key: jax.Array) -> jax.Array:
    """Next token ids [B]: argmax when greedy, else a draw from the filtered distribution."""
    if cfg.greedy:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logprobs(logits_BxV, cfg), axis=-1).astype(jnp.int32)
