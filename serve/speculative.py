"""DFlash speculative decoding (DESIGN §4.3), batched, over the dense target cache; greedy or sampled.

Per sequence b the state keeps an invariant between steps:
    the target cache holds the committed tokens 0 .. L_b-1 (their K/V), and the draft cache holds the
    drafter's context K/V of the same positions (fused target features of layer_ids);
    `pending_b` is the newest token, at position L_b: already output, not yet in either cache.

One step = propose + verify:
    propose: the drafter reads the block [pending, MASK x (K-1)] at positions L .. L+K-1 against the
             context slots s < L (block K/V are computed, never cached: pitfall 5) and proposes the
             argmax d_1 .. d_{K-1} (pitfall 8);
    verify:  the target runs [pending, d_1 .. d_{K-1}] through its cache in one forward (capturing the
             drafter's layer features), predicts p_0 .. p_{K-1}; n = the longest prefix with
             d_i == p_{i-1}; the step outputs d_1 .. d_n and the bonus p_n (n + 1 tokens);
             both caches keep exactly the n + 1 verified tokens [pending, d_1 .. d_n]: the target
             cache is rolled back to L + n + 1 and the draft cache gets the fused features of those
             positions; the next step's proposer sees L + n + 1, the ACCEPTED length (pitfall 6).
Greedy output therefore equals AR decoding token for token (up to fp32 ties in the logits). At T > 0
acceptance is one-hot rejection sampling (`accept_sampled`), so the output has AR sampling's distribution.

`propose` and `verify` are separate jitted programs so that a test (or a future proposer) can supply
the drafts, and so the draft and verify costs can be measured apart. The paged cache, continuous
batching and the server are the rest of the engine issue.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import DecoderConfig, RopeScaling
from models.decoder import DenseKVCache, check_capacity, embed, forward_cached
from models.drafter import KV, DFlashDrafter, DrafterArch, check_fits_target, concat_features, drafter_logits
from serve.generate import bucket
from serve.sampling import SamplingConfig, filtered_logprobs

Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """The drafter's context K/V per layer, k and v [L_d, B, S, Hk, Dh] (static per-slot arrays)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(cls, arch: DrafterArch, batch: int, max_len: int, dtype: Any = jnp.float32) -> DraftCache:
        shape = (arch.num_layers, batch, max_len, arch.num_kv_heads, arch.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def kv(self) -> list[KV]:
        return [(self.k[i], self.v[i]) for i in range(self.k.shape[0])]

    def write(self, new_kv: list[KV], starts_B: jax.Array) -> DraftCache:
        """Write T new context slots per sequence at `starts_B` (in bounds: the caller checks capacity)."""
        b, t = new_kv[0][0].shape[:2]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        slots = starts_B[:, None] + jnp.arange(t)[None, :]
        k_new = jnp.stack([k for k, _ in new_kv]).astype(self.k.dtype)
        v_new = jnp.stack([v for _, v in new_kv]).astype(self.v.dtype)
        return DraftCache(self.k.at[:, rows, slots].set(k_new, mode="drop"),
                          self.v.at[:, rows, slots].set(v_new, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Decoding state of B sequences: caches, committed lengths L [B], pending token [B], active [B], keys."""

    target: DenseKVCache
    draft: DraftCache
    lengths: jax.Array
    pending: jax.Array
    active: jax.Array
    rng: jax.Array  # [B, 2] uint32: one key per sequence (per-request seeds)


def _add_context(drafter: DFlashDrafter, draft: DraftCache, feats_FxBxTxD: jax.Array,
                 starts_B: jax.Array) -> DraftCache:
    """Fuse the target features of T new positions (starting at `starts_B`) into the draft cache."""
    t = feats_FxBxTxD.shape[2]
    positions = starts_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    fused = drafter.fuse(concat_features(feats_FxBxTxD).astype(jnp.float32))
    return draft.write(drafter.context_kv(fused, positions), starts_B)


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef", "max_len", "sampling"))
def prefill(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
            tokens_BxT: jax.Array, num_valid_B: jax.Array, max_len: int, rng_Bx2: jax.Array,
            sampling: SamplingConfig | None = None) -> SpecState:
    """Fresh state for B right-padded prompts: both caches filled, the target's first token pending
    (argmax, or drawn with each sequence's key when `sampling` is not greedy)."""
    drafter = nnx.merge(graphdef, drafter_params)
    arch = drafter.arch
    b, t = tokens_BxT.shape
    cache = DenseKVCache.create(target_cfg, b, max_len, target_params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    last = (num_valid_B - 1)[:, None].astype(jnp.int32)
    logits, feats, cache = forward_cached(target_params, target_cfg, tokens_BxT, positions, cache,
                                          layer_ids=arch.layer_ids, logits_at_BxI=last)
    cache = cache.rollback(num_valid_B)
    draft = _add_context(drafter, DraftCache.create(arch, b, max_len), feats, jnp.zeros((b,), jnp.int32))
    if sampling is None or sampling.greedy:
        pending = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    else:
        keys = jax.vmap(jax.random.split)(rng_Bx2)
        rng_Bx2 = keys[:, 0]
        logp = filtered_logprobs(logits[:, 0], sampling)
        pending = jax.vmap(jax.random.categorical)(keys[:, 1], logp).astype(jnp.int32)
    return SpecState(cache, draft, num_valid_B.astype(jnp.int32), pending, jnp.ones((b,), bool), rng_Bx2)


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef", "block_size"))
def propose(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
            state: SpecState, block_size: int) -> jax.Array:
    """Greedy drafts [B, K-1] for positions L+1 .. L+K-1 from one drafter forward over the block."""
    drafter = nnx.merge(graphdef, drafter_params)
    b, k = state.pending.shape[0], block_size
    ids = jnp.concatenate([state.pending[:, None], jnp.full((b, k - 1), drafter.arch.mask_token_id, jnp.int32)], 1)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    ctx_valid = jnp.arange(state.draft.k.shape[2])[None, :] < state.lengths[:, None]
    hidden = drafter.draft_block(embed(target_params, ids).astype(jnp.float32), positions, state.draft.kv(),
                                 ctx_valid)
    logits = drafter_logits(target_params, target_cfg, hidden)
    return jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)


def accept_greedy(logits_BxKxV: jax.Array, drafts_BxKm1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n accepted [B], bonus [B]): the longest prefix with d_i == argmax after token i-1; bonus = argmax."""
    preds = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)  # preds[:, i] follows tokens[:, i]
    n = jnp.sum(jnp.cumprod((drafts_BxKm1 == preds[:, :-1]).astype(jnp.int32), axis=1), axis=1)
    return n, jnp.take_along_axis(preds, n[:, None], axis=1)[:, 0]


def accept_sampled(logits_BxKxV: jax.Array, drafts_BxKm1: jax.Array, sampling: SamplingConfig,
                   rng_Bx2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-hot-draft rejection sampling (lossless; DESIGN pitfall 8): (n [B], bonus [B], next keys).

    The drafts are argmax proposals, i.e. q = one-hot(d_i), so draft i is accepted with probability
    min(1, p_i(d_i) / 1) = p_i(d_i) under the target's filtered distribution p_i; at the first rejection
    the replacement is drawn from the residual max(p - q, 0) = p with d_i removed, renormalised; when all
    K-1 drafts are accepted the bonus is drawn from p_{K-1}. The output then has exactly the target's
    distribution, as if sampled token by token.
    """
    k = drafts_BxKm1.shape[1] + 1
    keys = jax.vmap(lambda key: jax.random.split(key, 3))(rng_Bx2)
    logp = filtered_logprobs(logits_BxKxV, sampling)  # [B, K, V]
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts_BxKm1[..., None], axis=-1)[..., 0])
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 1])
    n = jnp.sum(jnp.cumprod((u < p_draft).astype(jnp.int32), axis=1), axis=1)
    logp_n = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = jnp.take_along_axis(jnp.pad(drafts_BxKm1, ((0, 0), (0, 1)), constant_values=-1), n[:, None], 1)
    residual = jnp.where(jnp.arange(logp.shape[-1])[None, :] == rejected, -jnp.inf, logp_n)
    bonus = jax.vmap(jax.random.categorical)(keys[:, 2], residual).astype(jnp.int32)
    return n, bonus, keys[:, 0]


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef", "sampling"), donate_argnames=("state",))
def verify(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
           state: SpecState, drafts_BxKm1: jax.Array,
           sampling: SamplingConfig | None = None) -> tuple[SpecState, jax.Array, jax.Array]:
    """Verify drafts with one target forward; returns (state, tokens [B, K], accepted n [B]).

    tokens[b, :n+1] are the step's output (d_1 .. d_n, then the target's bonus token); the rest is
    padding. Greedy (`sampling` None or temperature 0): exact-match acceptance; otherwise one-hot
    rejection sampling with each sequence's key (`accept_sampled`). Inactive sequences are left as they
    were (n reported as 0, nothing output).
    """
    drafter = nnx.merge(graphdef, drafter_params)
    k = drafts_BxKm1.shape[1] + 1
    tokens = jnp.concatenate([state.pending[:, None], drafts_BxKm1], axis=1)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    logits, feats, cache = forward_cached(target_params, target_cfg, tokens, positions, state.target,
                                          layer_ids=drafter.arch.layer_ids)
    if sampling is None or sampling.greedy:
        n, bonus = accept_greedy(logits, drafts_BxKm1)
        rng = state.rng
    else:
        n, bonus, rng = accept_sampled(logits, drafts_BxKm1, sampling, state.rng)
    n = jnp.where(state.active, n, 0)
    idx = jnp.arange(k)[None, :]
    out = jnp.where(idx < n[:, None], jnp.pad(drafts_BxKm1, ((0, 0), (0, 1))), 0)
    out = jnp.where(idx == n[:, None], bonus[:, None], out)
    new_len = jnp.where(state.active, state.lengths + n + 1, state.lengths)
    draft = _add_context(drafter, state.draft, feats, state.lengths)  # slots >= new_len stay invisible
    new_state = SpecState(cache.rollback(new_len), draft, new_len, jnp.where(state.active, bonus, state.pending),
                          state.active, rng)
    return new_state, out, n


@dataclasses.dataclass
class SpecResult:
    """One sequence's output and acceptance statistics.

    steps: verify steps this sequence took part in; accepted: drafts accepted per step;
    tau: mean tokens per step (accepted + 1, bonus included), in [1, K];
    accept_per_position[i]: share of steps whose draft i+1 was accepted.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    accepted: list[int]
    block_size: int
    seconds: float

    @property
    def tau(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        if not self.accepted:
            return [0.0] * (self.block_size - 1)
        acc = np.asarray(self.accepted)
        return [float(np.mean(acc > i)) for i in range(self.block_size - 1)]


DraftFn = Callable[[SpecState, int], jax.Array]


def speculative_generate(target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter,
                         prompts: Sequence[Sequence[int]], max_new_tokens: int, max_seq_len: int,
                         block_size: int | None = None, stop_ids: Sequence[int] = (),
                         draft_fn: DraftFn | None = None, sampling: SamplingConfig | None = None,
                         seeds: Sequence[int] | None = None) -> list[SpecResult]:
    """DFlash decoding of a batch of prompts: greedy equals AR greedy decoding token for token; with a
    non-greedy `sampling` (temperature, top-p, top-k) the output has AR sampling's distribution.

    seeds: one per prompt (default: sampling.seed + index); `sampling.max_new_tokens` is not used
    (`max_new_tokens` is).

    block_size: K at inference, 2 .. the drafter's training K (default: the training K).
    draft_fn:   replaces the drafter's proposals (tests: an oracle or a deliberately wrong proposer);
                called with (state, K), returns drafts [B, K-1].
    """
    arch = drafter.arch
    k = block_size or arch.block_size
    if not 2 <= k <= arch.block_size:
        raise ValueError(f"block_size must lie in [2, {arch.block_size}] (the drafter's training K); received {k}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; received {max_new_tokens}")
    b = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    chunk = bucket(int(lengths.max()))
    # Room for the prompt bucket and for the last step's K verified tokens past max_new_tokens.
    check_capacity(np.zeros(1, np.int64), max(chunk, int(lengths.max()) + max_new_tokens + k), max_seq_len)
    tokens = np.zeros((b, chunk), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    if sampling is not None and sampling.greedy:
        sampling = None
    if seeds is None:
        seeds = [(sampling.seed if sampling else 0) + i for i in range(b)]
    if len(seeds) != b:
        raise ValueError(f"seeds must hold one seed per prompt ({b}); received {len(seeds)}")
    rng = jnp.stack([jax.random.PRNGKey(int(seed)) for seed in seeds])
    graphdef, params = nnx.split(drafter, nnx.Param)
    t0 = time.perf_counter()
    state = prefill(target_params, target_cfg, graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths),
                    max_seq_len, rng, sampling)
    outputs = [[int(t)] for t in np.asarray(state.pending)]
    accepted: list[list[int]] = [[] for _ in range(b)]
    stops = set(stop_ids)
    done = np.array([o[-1] in stops or len(o) >= max_new_tokens for o in outputs])
    while not done.all():
        if not np.array_equal(np.asarray(state.active), ~done):
            state = dataclasses.replace(state, active=jnp.asarray(~done))
        drafts = (draft_fn(state, k) if draft_fn is not None
                  else propose(target_params, target_cfg, graphdef, params, state, k))
        state, out, n = verify(target_params, target_cfg, graphdef, params, state, jnp.asarray(drafts, jnp.int32),
                               sampling)
        out, n = np.asarray(out), np.asarray(n)
        for i in np.flatnonzero(~done):
            accepted[i].append(int(n[i]))
            for tok in out[i, : n[i] + 1]:
                outputs[i].append(int(tok))
                if tok in stops or len(outputs[i]) >= max_new_tokens:
                    done[i] = True
                    break
    seconds = time.perf_counter() - t0
    return [SpecResult(list(p), outputs[i], accepted[i], k, seconds) for i, p in enumerate(prompts)]


def load_drafter_checkpoint(path: str | Path, target_cfg: DecoderConfig, step: int | None = None) -> DFlashDrafter:
    """The drafter of a `dflash train` checkpoint: `path` is a run dir or its `checkpoints/` dir; `step`
    defaults to the latest. The architecture comes from the checkpoint and must fit `target_cfg`."""
    from train.checkpoint import Checkpointer, CheckpointError

    path = Path(path).expanduser()
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise FileNotFoundError(f"drafter checkpoint directory {str(directory)!r} does not exist; pass a "
                                "`dflash train` run dir (train.run_dir) or its checkpoints/ directory")
    ckpt = Checkpointer(directory, {})
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{directory} holds no finished checkpoint")
        saved, _, meta = ckpt.restore_raw(step)
    finally:
        ckpt.close()
    fields = dict(meta["arch"])
    fields["layer_ids"] = tuple(fields["layer_ids"])
    if fields.get("rope_scaling") is not None:
        scaling = dict(fields["rope_scaling"])
        scaling["freq_factors"] = tuple(scaling.get("freq_factors", ()))
        fields["rope_scaling"] = RopeScaling(**scaling)
    arch = DrafterArch(**fields)
    try:
        check_fits_target(arch, target_cfg, f"{directory} (step {step})")
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    state = nnx.state(drafter, nnx.Param)
    flat = []
    for keys, variable in nnx.to_flat_state(state):
        node = saved["params"]
        for key in (*keys, "value"):
            node = node[str(key)]
        if tuple(node.shape) != tuple(variable.shape):
            raise CheckpointError(f"{directory} step {step}: parameter {'/'.join(map(str, keys))} has shape "
                                  f"{tuple(node.shape)}, the architecture says {tuple(variable.shape)}")
        flat.append((keys, variable.replace(jnp.asarray(node, jnp.float32))))
    nnx.update(drafter, nnx.from_flat_state(flat))
    return drafter


__all__ = [
    "DraftCache",
    "SpecResult",
    "SpecState",
    "accept_greedy",
    "accept_sampled",
    "load_drafter_checkpoint",
    "prefill",
    "propose",
    "speculative_generate",
    "verify",
]
