"""Plain autoregressive generation with the dense KV cache (one sequence at a time).

This is the AR baseline the engine grows from: a bucketed prefill (prompt padded to a power of two so
few shapes compile, then the cache rolled back to the true length) and a jitted one-token decode step
that donates the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import DecoderConfig
from models.decoder import DenseKVCache, check_capacity, forward_cached
from serve.sampling import SamplingConfig, sample


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_step(params, cfg: DecoderConfig, tokens_1xT, num_valid, cache: DenseKVCache):
    """Append a right-padded prompt chunk; keep only `num_valid` tokens; return last valid logits [1, V]."""
    t = tokens_1xT.shape[1]
    start = cache.lengths
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    last = jnp.full((tokens_1xT.shape[0], 1), num_valid - 1, jnp.int32)
    logits, _, cache = forward_cached(params, cfg, tokens_1xT, positions, cache, logits_at_BxI=last)
    cache = cache.rollback(start + num_valid)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def decode_step(params, cfg: DecoderConfig, token_B, cache: DenseKVCache, key, sampling: SamplingConfig):
    """Feed one token per sequence; return the next sampled token [B] and the cache."""
    positions = cache.lengths[:, None]
    logits, _, cache = forward_cached(params, cfg, token_B[:, None], positions, cache)
    return sample(logits[:, -1], sampling, key), cache


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    stopped: bool

    @property
    def decode_tokens_per_s(self) -> float:
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s > 0 and len(self.token_ids) > 1 else 0.0


def generate(params, cfg: DecoderConfig, prompt_ids: Sequence[int], sampling: SamplingConfig, max_seq_len: int,
             stop_ids: Sequence[int] = (), on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Generate up to `sampling.max_new_tokens` tokens after `prompt_ids` (stops on a stop id)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token; received an empty prompt")
    n = len(prompt_ids)
    chunk = bucket(n)
    check_capacity(np.array([0]), max(chunk, n + sampling.max_new_tokens), max_seq_len)
    dtype = params["embed"].dtype
    cache = DenseKVCache.create(cfg, batch=1, max_len=max_seq_len, dtype=dtype)
    tokens = np.zeros((1, chunk), np.int32)
    tokens[0, :n] = prompt_ids
    key = jax.random.PRNGKey(sampling.seed)
    t0 = time.perf_counter()
    logits, cache = prefill_step(params, cfg, jnp.asarray(tokens), jnp.int32(n), cache)
    key, sub = jax.random.split(key)
    token = sample(logits, sampling, sub)
    first = int(token[0])
    t1 = time.perf_counter()
    out, stops = [first], set(stop_ids)
    if on_token:
        on_token(first)
    while first not in stops and len(out) < sampling.max_new_tokens:
        key, sub = jax.random.split(key)
        token, cache = decode_step(params, cfg, token, cache, sub, sampling)
        first = int(token[0])
        out.append(first)
        if on_token:
            on_token(first)
    t2 = time.perf_counter()
    return GenerationResult(list(prompt_ids), out, t1 - t0, t2 - t1, stopped=out[-1] in stops)
