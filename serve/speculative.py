"""DFlash speculative decoding (DESIGN §4.3), batched, over the paged target cache; greedy or sampled.

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

The target cache is a `serve.paged.PagedKVCache` made once on the host (`empty_state`) and threaded
through the jitted steps, which donate it. The host owns the pages (`PagePool`, `PageTable`): before
each step that appends T tokens it makes every active slot own pages for L + T tokens (prefill: T = the
prompt's true length, the bucket padding past it falls on unowned pages and is dropped; verify: T = K,
written before the rollback to L + n + 1) and uploads the table when it changed (`sync_page_table`; same
shape, so no recompile). `prefill` fills chosen slots of an existing state, so the engine prefills a new
request straight into its slot's pages. The draft context cache stays per-slot static arrays.

`propose` and `verify` are separate jitted programs so that a test (or a future proposer) can supply
the drafts, and so the draft and verify costs can be measured apart.
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
from models.decoder import embed, forward_cached
from models.drafter import KV, DFlashDrafter, DrafterArch, check_fits_target, concat_features, drafter_logits
from serve.generate import bucket
from serve.paged import PagedKVCache, PagePool, PageTable
from serve.sampling import SamplingConfig, SamplingRows, row_logprobs

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

    def write(self, new_kv: list[KV], starts_B: jax.Array, rows_B: jax.Array | None = None) -> DraftCache:
        """Write T new context slots per sequence at `starts_B` into batch rows `rows_B` (default 0 .. B-1);
        slots past the end are dropped."""
        b, t = new_kv[0][0].shape[:2]
        rows_B = jnp.arange(b) if rows_B is None else rows_B
        rows = jnp.broadcast_to(rows_B[:, None], (b, t))
        slots = starts_B[:, None] + jnp.arange(t)[None, :]
        k_new = jnp.stack([k for k, _ in new_kv]).astype(self.k.dtype)
        v_new = jnp.stack([v for _, v in new_kv]).astype(self.v.dtype)
        return DraftCache(self.k.at[:, rows, slots].set(k_new, mode="drop"),
                          self.v.at[:, rows, slots].set(v_new, mode="drop"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Decoding state of B sequences: caches, committed lengths L [B], pending token [B], active [B], keys,
    and each sequence's sampling rule (set at prefill; temperature 0 = greedy)."""

    target: PagedKVCache
    draft: DraftCache
    lengths: jax.Array
    pending: jax.Array
    active: jax.Array
    rng: jax.Array  # [B, 2] uint32: one key per sequence (per-request seeds)
    sampling: SamplingRows


def empty_state(target_cfg: DecoderConfig, arch: DrafterArch, batch: int, max_len: int, num_pages: int,
                page_size: int, dtype: Any = jnp.float32) -> SpecState:
    """B empty, inactive slots: a paged target cache of `num_pages` pages (the null page included) whose
    tables hold ceil(max_len / page_size) pages per slot, all on the null page; draft cache [.., max_len, ..]."""
    target = PagedKVCache.create(target_cfg, batch, -(-max_len // page_size), num_pages, page_size, dtype)
    return SpecState(target, DraftCache.create(arch, batch, max_len), jnp.zeros((batch,), jnp.int32),
                     jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), jnp.zeros((batch, 2), jnp.uint32),
                     SamplingRows.of([None] * batch))


def span_pages(max_tokens: int, page_size: int, max_pages: int) -> int:
    """Pages a step must see for sequences of up to `max_tokens` tokens (the chunk included): a power of two
    (so a long generation compiles at most log2(max_pages) + 1 spans), capped at the table's width."""
    return min(max_pages, bucket(-(-max_tokens // page_size), minimum=1))


def sync_page_table(state: SpecState, table: PageTable, uploaded_version: int) -> tuple[SpecState, int]:
    """`state` over the host table's pages, uploading it only when `table.version` moved past
    `uploaded_version`; returns (state, the version now on the device)."""
    if table.version == uploaded_version:
        return state, uploaded_version
    return dataclasses.replace(state, target=state.target.with_page_table(table.array())), table.version


def _add_context(drafter: DFlashDrafter, draft: DraftCache, feats_FxBxTxD: jax.Array,
                 starts_B: jax.Array, rows_B: jax.Array | None = None) -> DraftCache:
    """Fuse the target features of T new positions (starting at `starts_B`) into the draft cache."""
    t = feats_FxBxTxD.shape[2]
    positions = starts_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    fused = drafter.fuse(concat_features(feats_FxBxTxD).astype(jnp.float32))
    return draft.write(drafter.context_kv(fused, positions), starts_B, rows_B)


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef"), donate_argnames=("state",))
def prefill(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
            state: SpecState, slots_R: jax.Array, tokens_RxT: jax.Array, num_valid_R: jax.Array, rng_Rx2: jax.Array,
            sampling_R: SamplingRows | None = None) -> SpecState:
    """`state` with R right-padded prompts prefilled into its slots `slots_R` (distinct): both caches filled
    from position 0 (whatever the slot held before is forgotten), the slots' sampling rules set to
    `sampling_R` (None: greedy), the target's first token pending (argmax for a greedy row, else drawn with
    the row's key and rule), the slots active. Other slots are untouched.

    The host must have given each slot pages for its first num_valid tokens (`PageTable.ensure`) and
    uploaded the table; the prompt runs through a view of the cache holding only the R slots' page-table
    rows and sharing the page arrays, so it writes straight into the slots' pages.
    """
    drafter = nnx.merge(graphdef, drafter_params)
    arch = drafter.arch
    r, t = tokens_RxT.shape
    pages = min(state.target.page_table.shape[1], -(-t // state.target.page_size))  # the prompt's pages only
    view = dataclasses.replace(state.target, page_table=state.target.page_table[slots_R][:, :pages],
                               lengths=jnp.zeros((r,), jnp.int32))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    last = (num_valid_R - 1)[:, None].astype(jnp.int32)
    logits, feats, view = forward_cached(target_params, target_cfg, tokens_RxT, positions, view,
                                         layer_ids=arch.layer_ids, logits_at_BxI=last)
    num_valid_R = num_valid_R.astype(jnp.int32)
    target = dataclasses.replace(state.target, k_pages=view.k_pages, v_pages=view.v_pages,
                                 lengths=state.target.lengths.at[slots_R].set(num_valid_R))
    draft = _add_context(drafter, state.draft, feats, jnp.zeros((r,), jnp.int32), slots_R)
    rules = SamplingRows.of([None] * r) if sampling_R is None else sampling_R
    greedy_pending = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    def draw(_: None) -> tuple[jax.Array, jax.Array]:
        keys = jax.vmap(jax.random.split)(rng_Rx2)
        drawn = jax.vmap(jax.random.categorical)(keys[:, 1], row_logprobs(logits[:, 0], rules)).astype(jnp.int32)
        return jnp.where(rules.greedy, greedy_pending, drawn), jnp.where(rules.greedy[:, None], rng_Rx2, keys[:, 0])

    pending, rng_Rx2 = jax.lax.cond(jnp.all(rules.greedy), lambda _: (greedy_pending, rng_Rx2), draw, None)
    return SpecState(target, draft, state.lengths.at[slots_R].set(num_valid_R), state.pending.at[slots_R].set(pending),
                     state.active.at[slots_R].set(True), state.rng.at[slots_R].set(rng_Rx2),
                     state.sampling.set(slots_R, rules))


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef", "block_size", "span"))
def propose(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
            state: SpecState, block_size: int, span: int | None = None) -> jax.Array:
    """Greedy drafts [B, K-1] for positions L+1 .. L+K-1 from one drafter forward over the block.

    span: context slots the drafter attends over (static; default: all). Every L must be <= span."""
    drafter = nnx.merge(graphdef, drafter_params)
    b, k = state.pending.shape[0], block_size
    ids = jnp.concatenate([state.pending[:, None], jnp.full((b, k - 1), drafter.arch.mask_token_id, jnp.int32)], 1)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    span = state.draft.k.shape[2] if span is None else min(span, state.draft.k.shape[2])
    ctx_valid = jnp.arange(span)[None, :] < state.lengths[:, None]
    ctx_kv = [(k_ctx[:, :span], v_ctx[:, :span]) for k_ctx, v_ctx in state.draft.kv()]
    hidden = drafter.draft_block(embed(target_params, ids).astype(jnp.float32), positions, ctx_kv, ctx_valid)
    logits = drafter_logits(target_params, target_cfg, hidden)
    return jnp.argmax(logits[:, 1:], axis=-1).astype(jnp.int32)


def accept_greedy(logits_BxKxV: jax.Array, drafts_BxKm1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n accepted [B], bonus [B]): the longest prefix with d_i == argmax after token i-1; bonus = argmax."""
    preds = jnp.argmax(logits_BxKxV, axis=-1).astype(jnp.int32)  # preds[:, i] follows tokens[:, i]
    n = jnp.sum(jnp.cumprod((drafts_BxKm1 == preds[:, :-1]).astype(jnp.int32), axis=1), axis=1)
    return n, jnp.take_along_axis(preds, n[:, None], axis=1)[:, 0]


def accept_sampled(logits_BxKxV: jax.Array, drafts_BxKm1: jax.Array, sampling: SamplingRows,
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
    logp = row_logprobs(logits_BxKxV, sampling)  # [B, K, V]
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts_BxKm1[..., None], axis=-1)[..., 0])
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 1])
    n = jnp.sum(jnp.cumprod((u < p_draft).astype(jnp.int32), axis=1), axis=1)
    logp_n = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = jnp.take_along_axis(jnp.pad(drafts_BxKm1, ((0, 0), (0, 1)), constant_values=-1), n[:, None], 1)
    residual = jnp.where(jnp.arange(logp.shape[-1])[None, :] == rejected, -jnp.inf, logp_n)
    bonus = jax.vmap(jax.random.categorical)(keys[:, 2], residual).astype(jnp.int32)
    return n, bonus, keys[:, 0]


@functools.partial(jax.jit, static_argnames=("target_cfg", "graphdef", "span_pages"), donate_argnames=("state",))
def verify(target_params: Params, target_cfg: DecoderConfig, graphdef: nnx.GraphDef, drafter_params: nnx.State,
           state: SpecState, drafts_BxKm1: jax.Array,
           span_pages: int | None = None) -> tuple[SpecState, jax.Array, jax.Array]:
    """Verify drafts with one target forward; returns (state, tokens [B, K], accepted n [B]).

    The host must have given every active slot pages for L + K tokens: the K block tokens are written
    at L .. L+K-1 before the cache is rolled back to the accepted length L + n + 1. `span_pages` (static;
    default: the whole table) is how many page-table entries the target's attention sees
    (`span_pages(max L + K, ...)`): the reference attention's cost follows it, not the capacity.

    tokens[b, :n+1] are the step's output (d_1 .. d_n, then the target's bonus token); the rest is
    padding. Each row follows its own rule (`state.sampling`): a greedy row (temperature 0) takes
    exact-match acceptance, any other one-hot rejection sampling with its key (`accept_sampled`); a batch
    of greedy rows never runs the sampling branch (`lax.cond`). Inactive sequences are left as they were
    (n reported as 0, nothing output).
    """
    drafter = nnx.merge(graphdef, drafter_params)
    k = drafts_BxKm1.shape[1] + 1
    tokens = jnp.concatenate([state.pending[:, None], drafts_BxKm1], axis=1)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    seen = state.target if span_pages is None else state.target.view(span_pages)
    logits, feats, cache = forward_cached(target_params, target_cfg, tokens, positions, seen,
                                          layer_ids=drafter.arch.layer_ids)
    cache = cache.with_full_table(state.target)
    n_greedy, bonus_greedy = accept_greedy(logits, drafts_BxKm1)

    def mixed(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        n_s, bonus_s, rng_s = accept_sampled(logits, drafts_BxKm1, state.sampling, state.rng)
        greedy = state.sampling.greedy
        return (jnp.where(greedy, n_greedy, n_s), jnp.where(greedy, bonus_greedy, bonus_s),
                jnp.where(greedy[:, None], state.rng, rng_s))

    n, bonus, rng = jax.lax.cond(jnp.all(state.sampling.greedy), lambda _: (n_greedy, bonus_greedy, state.rng),
                                 mixed, None)
    n = jnp.where(state.active, n, 0)
    idx = jnp.arange(k)[None, :]
    out = jnp.where(idx < n[:, None], jnp.pad(drafts_BxKm1, ((0, 0), (0, 1))), 0)
    out = jnp.where(idx == n[:, None], bonus[:, None], out)
    new_len = jnp.where(state.active, state.lengths + n + 1, state.lengths)
    draft = _add_context(drafter, state.draft, feats, state.lengths)  # slots >= new_len stay invisible
    new_state = SpecState(cache.rollback(new_len), draft, new_len, jnp.where(state.active, bonus, state.pending),
                          state.active, rng, state.sampling)
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

    The target cache is paged (16-token pages) from a pool sized for every prompt at `max_seq_len`;
    pages are taken step by step as sequences grow and given back as each one finishes.

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
    # Room for the last step's K verified tokens past max_new_tokens (bucket padding past the prompt is dropped).
    need = int(lengths.max()) + max_new_tokens + k
    if need > max_seq_len:
        raise ValueError(f"sequence length must stay within the cache capacity {max_seq_len} (max_seq_len): the "
                         f"longest prompt ({int(lengths.max())}) + max_new_tokens ({max_new_tokens}) + K ({k}) "
                         f"reaches {need}")
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
    page_size = 16
    max_pages = -(-max_seq_len // page_size)
    pool = PagePool(b * max_pages + 1, page_size)
    table = PageTable(pool, b, max_pages)
    state = empty_state(target_cfg, arch, b, max_seq_len, pool.num_pages, page_size, target_params["embed"].dtype)
    t0 = time.perf_counter()
    table.ensure_batch(lengths)
    state, version = sync_page_table(state, table, 0)
    state = prefill(target_params, target_cfg, graphdef, params, state, jnp.arange(b, dtype=jnp.int32),
                    jnp.asarray(tokens), jnp.asarray(lengths), rng, SamplingRows.of([sampling] * b))
    held = lengths.astype(np.int64)  # committed tokens per sequence, mirrored on the host
    outputs = [[int(t)] for t in np.asarray(state.pending)]
    accepted: list[list[int]] = [[] for _ in range(b)]
    stops = set(stop_ids)
    done = np.array([o[-1] in stops or len(o) >= max_new_tokens for o in outputs])
    while not done.all():
        if not np.array_equal(np.asarray(state.active), ~done):
            state = dataclasses.replace(state, active=jnp.asarray(~done))
        for i in np.flatnonzero(done):
            table.release(int(i))
        table.ensure_batch(np.where(done, 0, held + k))
        state, version = sync_page_table(state, table, version)
        pages = span_pages(int(held.max()) + k, page_size, max_pages)
        drafts = (draft_fn(state, k) if draft_fn is not None
                  else propose(target_params, target_cfg, graphdef, params, state, k, pages * page_size))
        state, out, n = verify(target_params, target_cfg, graphdef, params, state, jnp.asarray(drafts, jnp.int32),
                               pages)
        out, n = np.asarray(out), np.asarray(n)
        held = np.where(done, held, held + n + 1)
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
    "empty_state",
    "load_drafter_checkpoint",
    "prefill",
    "propose",
    "speculative_generate",
    "sync_page_table",
    "verify",
]
