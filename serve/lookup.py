"""Prompt lookup (n-gram drafting): the continuation of the most recent earlier occurrence of the text's last few
tokens, searched in each request's prompt and output so far. On the host for one step at a time
(`ngram_continuation`, `lookup_rows`) and on the device inside a decode loop (`lookup_paths`, `append_history`),
the same rule both ways. `plan.Lookup` drafts with it alone; `plan.Tree` merges it into the tree as an extra path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_NGRAM = 3  # the longest suffix searched for


def ngram_continuation(history: list[int], length: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the longest suffix of `history` (max_ngram
    tokens down to 1) that occurred before, at most `length` of them ([] if none)."""
    size = len(history)
    for g in range(min(max_ngram, size - 1), 0, -1):
        suffix = history[size - g:]
        for start in range(size - g - 1, -1, -1):
            if history[start:start + g] == suffix:
                return history[start + g:start + g + length]
    return []


def lookup_rows(histories: Mapping[int, Sequence[int]], slots: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """`ngram_continuation` of each slot's history ({slot: prompt + output}): (continuations [slots, length] int32,
    padded with 0, and their lengths [slots]); slots without a history get none."""
    paths = np.zeros((slots, length), np.int32)
    lengths = np.zeros(slots, np.int32)
    for slot, history in histories.items():
        found = ngram_continuation(list(history), length)
        paths[slot, :len(found)] = found
        lengths[slot] = len(found)
    return paths, lengths


def history_rows(histories: Mapping[int, Sequence[int]], slots: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each slot's history as the device loop reads it: ([slots, width] int32, the first sizes[b] entries real;
    sizes [slots])."""
    rows = np.zeros((slots, width), np.int32)
    sizes = np.zeros(slots, np.int32)
    for slot, history in histories.items():
        tokens = list(history)[:width]
        rows[slot, :len(tokens)] = tokens
        sizes[slot] = len(tokens)
    return rows, sizes


def lookup_paths(history_BxS: jax.Array, size_B: jax.Array, length: int, max_ngram: int = MAX_NGRAM
                 ) -> tuple[jax.Array, jax.Array]:
    """`ngram_continuation` of every row on the device: (continuations [B, L] int32, L = `length`, padded with 0,
    and their lengths [B]) for histories history_BxS[b, :size_B[b]]."""
    h = history_BxS.shape[1]
    s = jnp.arange(h)

    def one(hist_S: jax.Array, size: jax.Array) -> tuple[jax.Array, jax.Array]:
        found, after = jnp.bool_(False), jnp.int32(0)
        for g in range(max_ngram, 0, -1):  # the longest suffix first; within it the latest start
            match = (s <= size - g - 1) & (g <= size - 1)
            for i in range(g):
                match &= hist_S[jnp.minimum(s + i, h - 1)] == hist_S[jnp.clip(size - g + i, 0, h - 1)]
            start = jnp.max(jnp.where(match, s, -1))
            after = jnp.where(found | (start < 0), after, start + g)
            found = found | (start >= 0)
        n = jnp.where(found, jnp.clip(size - after, 0, length), 0)
        idx = jnp.arange(length)
        return jnp.where(idx < n, hist_S[jnp.minimum(after + idx, h - 1)], 0).astype(jnp.int32), n.astype(jnp.int32)

    return jax.vmap(one)(history_BxS, size_B)


def append_history(history_BxS: jax.Array, size_B: jax.Array, tokens_BxK: jax.Array, count_B: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """The histories with the first count_B[b] of tokens_BxK[b] appended (entries past the buffer dropped)."""
    t = jnp.arange(tokens_BxK.shape[1])[None, :]
    pos = jnp.where(t < count_B[:, None], size_B[:, None] + t, history_BxS.shape[1])
    rows = jnp.arange(history_BxS.shape[0])[:, None]
    return history_BxS.at[rows, pos].set(tokens_BxK, mode="drop"), size_B + count_B


__all__ = ["MAX_NGRAM", "append_history", "history_rows", "lookup_paths", "lookup_rows", "ngram_continuation"]
