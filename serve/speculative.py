"""The engine's jitted kernels (docs/design.md §4.3): prefill, propose, verify, over the paged target cache and the
drafter's per-slot context cache; greedy acceptance, or for sampled requests one-hot rejection sampling of argmax
drafts or speculative sampling of drafts drawn from the drafter's distributions (`draft_rule`, D64).

Between steps each sequence b holds its committed tokens 0 .. L_b-1 in both caches and its newest token
(`pending`, already output) at position L_b. One step: `propose` drafts d_1 .. d_{K-1} from the block
[pending, MASK x (K-1)]; `verify` runs [pending, d_1 .. d_{K-1}] through the target, accepts the longest
matching prefix n, outputs d_1 .. d_n plus the target's bonus token, and keeps exactly the n + 1 verified
positions in both caches. In AR mode there is no drafter (`Models.graphdef` is None): K = 1, the state has
no draft cache and verify is a plain one-token decode step. Rationale and measurements: docs/decisions.md
D13 and D16.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params, embed, forward_cached
from dflash.models.drafter import (
    KV,
    DFlashDrafter,
    DrafterArch,
    block_token_ids,
    concat_features,
    draft_head_rows,
    drafter_logits,
)
from dflash.serve.paged import NULL_PAGE, PagedKVCache, PageTable
from dflash.serve.requests import MAX_TOP_LOGPROBS
from dflash.serve.sampling import SamplingRows, row_logprobs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftLaw:
    """What drafts drawn from the drafter's distributions were drawn from (`propose(..., sample=True)`): per slot
    the drafter's log-probabilities over its draft rows under the request's sampling rule, logq [B, K-1, V'], and
    the row drawn, rows [B, K-1] (a token id when the drafter has no draft vocabulary). Verify needs both:
    q(d) for the acceptance ratio, q for the residual at the first rejection (`accept_drafted`)."""

    logq: jax.Array
    rows: jax.Array


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (int32): the first index of the largest entry, or of the first NaN where there is
    one. As a max, then the first index holding it: on the CPU 3-5x faster than XLA's variadic argmax reduction
    over a vocabulary (docs/benchmarks.md "The tree step's CPU cost")."""
    top = jnp.max(x, axis=-1, keepdims=True)
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1).astype(jnp.int32)


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """`jax.random.categorical(key, logits)` over the last axis, token for token (the same Gumbel noise, added to
    the same logits), with `first_argmax` for the argmax."""
    return first_argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def step_keys(rng_Bx2: jax.Array) -> jax.Array:
    """The keys [B, 4, 2] of one step of a request sampled with `accept_drafted`, one split of its key: the
    request's next key, the acceptance uniforms, the replacement draw, and (index 3) the drafts' draw in `propose`
    (both programs split the same key the same way, so the four streams are distinct)."""
    return jax.vmap(lambda key: jax.random.split(key, 4))(rng_Bx2)


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (row counts, attention spans: few shapes compile)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def prompt_bucket(n: int) -> int:
    """The padded length of a prompt of n tokens: the smallest of 16, 32, 48, 64, 96, 128, 192, 256, 384, ...
    (powers of two and one and a half times them, multiples of 16) that holds n. A prefill's cost grows with its
    padded length, so this ladder pads by a third at most (a power of two alone: by half, a 130-token prompt
    computing 256), for two more programs per doubling (D99)."""
    b = 16
    while n > b:
        if b >= 32 and n <= b + b // 2:
            return b + b // 2
        b *= 2
    return b


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Models:
    """What the kernels compute with: the frozen target, and the drafter (None in AR mode). A drafter with a
    draft vocabulary (`DraftVocab`) brings its head rows [V', D] and their ids [V'], gathered once here."""

    target_params: Params
    drafter_params: nnx.State | None
    target_cfg: DecoderConfig = dataclasses.field(metadata={"static": True})
    graphdef: nnx.GraphDef | None = dataclasses.field(metadata={"static": True})
    draft_head: jax.Array | None = None
    draft_ids: jax.Array | None = None

    @classmethod
    def of(cls, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter | None = None) -> Models:
        if drafter is None:
            return cls(target_params, None, target_cfg, None)
        graphdef, params = nnx.split(drafter, nnx.Param)
        vocab = drafter.draft_vocab
        if vocab is None:
            return cls(target_params, params, target_cfg, graphdef)
        vocab.check_fits(target_cfg.vocab_size, "the drafter's")
        return cls(target_params, params, target_cfg, graphdef, draft_head_rows(target_params, target_cfg, vocab.ids),
                   jnp.asarray(vocab.ids))

    def drafter(self) -> DFlashDrafter | None:
        return None if self.graphdef is None else nnx.merge(self.graphdef, self.drafter_params)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftCache:
    """The drafter's context K/V (static per-slot arrays).

    Full-attention layers: k and v [L_full, B, T, Hk, Dh], position p at slot p (T = the context length).
    Sliding-window layers (`drafter.layer_types`, window W): a ring wk and wv [L_sliding, B, Tw, Hk, Dh] of
    Tw = W + K_train slots per sequence, position p at slot p mod Tw, and ring_pos [B, Tw] the position each slot
    holds (-1: none). A block at L sees the ring slots holding positions L-W .. L-1. Verify writes K <= K_train
    positions from L on and the next L is at most L + K, so the window [L-W, L) and every position written since
    fit in Tw slots without overwriting each other; slots holding positions >= L are stale and invisible until
    rewritten, as in the full cache. `sliding` (static) marks each drafter layer."""

    k: jax.Array
    v: jax.Array
    wk: jax.Array
    wv: jax.Array
    ring_pos: jax.Array
    sliding: tuple[bool, ...] = dataclasses.field(metadata={"static": True})
    window: int = dataclasses.field(metadata={"static": True})
    rows: jax.Array | None = None  # a view of some slots (`take_rows`): the batch row of each view row, B = none

    @classmethod
    def create(cls, arch: DrafterArch, batch: int, max_len: int, dtype: Any = jnp.float32) -> DraftCache:
        sliding = tuple(arch.sliding(i) for i in range(arch.num_layers))
        n_ring = sum(sliding)
        ring = arch.sliding_window + arch.block_size if n_ring else 0
        full = (arch.num_layers - n_ring, batch, max_len, arch.num_kv_heads, arch.head_dim)
        windowed = (n_ring, batch, ring, arch.num_kv_heads, arch.head_dim)
        return cls(jnp.zeros(full, dtype), jnp.zeros(full, dtype), jnp.zeros(windowed, dtype),
                   jnp.zeros(windowed, dtype), jnp.full((batch, ring), -1, jnp.int32), sliding, arch.sliding_window)

    def _rows(self, x: jax.Array, axis: int) -> jax.Array:
        """x's rows along its batch `axis` as this cache's rows (a view's: gathered, a missing row reads row B-1)."""
        if self.rows is None:
            return x
        return jnp.take(x, self.rows, axis=axis, mode="clip")

    def _batch_rows(self, rows_B: jax.Array) -> jax.Array:
        """The batch rows of the arrays that rows `rows_B` of this cache (of a view: its rows) write to."""
        return rows_B if self.rows is None else self.rows[rows_B]

    def kv(self, span: int | None = None) -> list[KV]:
        """Per-layer context (k, v) [B, S_l, Hk, Dh]: the first `span` slots (default all) of a full layer's
        cache, the ring of a sliding one."""
        full, ring = iter(range(self.k.shape[0])), iter(range(self.wk.shape[0]))
        out = []
        for s in self.sliding:
            if s:
                i = next(ring)
                out.append((self._rows(self.wk[i], 0), self._rows(self.wv[i], 0)))
            else:
                i = next(full)
                out.append((self._rows(self.k[i, :, :span], 0), self._rows(self.v[i, :, :span], 0)))
        return out

    def visible(self, lengths_B: jax.Array, span: int | None = None) -> tuple[list[KV], list[jax.Array]]:
        """(per-layer context (k, v), per-layer valid [B, S_l]) for blocks at positions `lengths_B`: a full
        layer the first `span` slots (default all) below L, a sliding layer the ring slots holding L-W .. L-1."""
        span = self.k.shape[2] if span is None else min(span, self.k.shape[2])
        full_valid = jnp.arange(span)[None, :] < lengths_B[:, None]
        pos, lengths = self._rows(self.ring_pos, 0), lengths_B[:, None]
        ring_valid = (pos >= 0) & (pos < lengths) & (pos >= lengths - self.window)
        return self.kv(span), [ring_valid if s else full_valid for s in self.sliding]

    def write(self, new_kv: list[KV], starts_B: jax.Array, rows_B: jax.Array | None = None,
              counts_B: jax.Array | None = None) -> DraftCache:
        """Write Q new context positions per sequence (starting at `starts_B`; the first `counts_B`, default all
        Q, are real) into batch rows `rows_B` (default 0 .. B-1). Full layers: slots past the end are dropped.
        Sliding layers: each ring slot takes the latest real new position that maps to it, if any (so a prompt
        longer than the ring keeps its last Tw positions); with `counts_B` (a prefill) the rows' other ring slots
        are emptied when the prefill starts at 0, forgetting what the slot held before (a later chunk of a chunked
        prefill keeps the earlier chunks' positions)."""
        b, t = new_kv[0][0].shape[:2]
        rows_B = self._batch_rows(jnp.arange(b) if rows_B is None else rows_B)  # B (a view's missing row): dropped
        full_kv = [kv for kv, s in zip(new_kv, self.sliding, strict=True) if not s]
        ring_kv = [kv for kv, s in zip(new_kv, self.sliding, strict=True) if s]
        k, v = self.k, self.v
        if full_kv:
            rows = jnp.broadcast_to(rows_B[:, None], (b, t))
            slots = starts_B[:, None] + jnp.arange(t)[None, :]
            k = k.at[:, rows, slots].set(jnp.stack([x for x, _ in full_kv]).astype(k.dtype), mode="drop")
            v = v.at[:, rows, slots].set(jnp.stack([x for _, x in full_kv]).astype(v.dtype), mode="drop")
        wk, wv, pos = self.wk, self.wv, self.ring_pos
        if ring_kv:
            r = pos.shape[1]
            counts = jnp.full((b,), t, jnp.int32) if counts_B is None else counts_B.astype(jnp.int32)
            last_Bx1 = (starts_B + counts - 1)[:, None]
            held_BxTw = last_Bx1 - jnp.mod(last_Bx1 - jnp.arange(r)[None, :], r)  # latest new position per slot
            take_BxTw = held_BxTw >= starts_B[:, None]
            src_BxTw = jnp.clip(held_BxTw - starts_B[:, None], 0, t - 1)
            gather = jax.vmap(lambda x: jnp.take_along_axis(x, src_BxTw[:, :, None, None], axis=1))
            new_k = gather(jnp.stack([x for x, _ in ring_kv]).astype(wk.dtype))
            new_v = gather(jnp.stack([x for _, x in ring_kv]).astype(wv.dtype))
            keep = take_BxTw[None, :, :, None, None]
            old_k, old_v = (jnp.take(w, rows_B, axis=1, mode="clip") for w in (wk, wv))
            wk = wk.at[:, rows_B].set(jnp.where(keep, new_k, old_k), mode="drop")
            wv = wv.at[:, rows_B].set(jnp.where(keep, new_v, old_v), mode="drop")
            old_pos = jnp.take(pos, rows_B, axis=0, mode="clip")
            if counts_B is not None:  # a prefill: its first chunk (start 0) forgets the slot's previous request
                old_pos = jnp.where(starts_B[:, None] == 0, -1, old_pos)
            pos = pos.at[rows_B].set(jnp.where(take_BxTw, held_BxTw, old_pos), mode="drop")
        return dataclasses.replace(self, k=k, v=v, wk=wk, wv=wv, ring_pos=pos)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    """Decoding state of B slots: caches (no draft cache in AR mode), committed lengths L [B], pending token
    [B], active [B], one key per slot [B, 2], and each slot's sampling rule (temperature 0 = greedy).

    oracle [B, T] (the oracle-ceiling benchmark only, else None): each slot's whole expected sequence, prompt and
    greedy continuation (-1 where unknown); greedy rows then draft it (`oracle_drafts`), so every draft is
    accepted while a step still costs what the drafter's costs (D99)."""

    target: PagedKVCache
    draft: DraftCache | None
    lengths: jax.Array
    pending: jax.Array
    active: jax.Array
    rng: jax.Array
    sampling: SamplingRows
    oracle: jax.Array | None = None


@functools.partial(jax.jit, static_argnames=("park",))
def gather_rows(leaves: tuple[Any, ...], rows_b: jax.Array, park: int) -> tuple[Any, ...]:
    """`take_rows`'s gather: (lengths, target lengths, pending, key, sampling rules, page table) at rows `rows_b`,
    with the view's `active`; a missing row (B) is inactive, parked at `park` and on the null page."""
    lengths, target_lengths, pending, rng, sampling, table = leaves
    valid = rows_b < lengths.shape[0]
    lengths, target_lengths, pending, rng, sampling, table = jax.tree.map(
        lambda x: jnp.take(x, rows_b, axis=0, mode="clip"), leaves)
    return (jnp.where(valid, lengths, park), jnp.where(valid, target_lengths, park), pending, valid, rng, sampling,
            jnp.where(valid[:, None], table, NULL_PAGE))


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_rows(full: tuple[jax.Array, ...], view: tuple[jax.Array, ...], rows_b: jax.Array) -> tuple[jax.Array, ...]:
    """`put_rows`'s scatter: the view's per-slot leaves written back at rows `rows_b` (a missing row, B, dropped)."""
    return tuple(f.at[rows_b].set(v, mode="drop") for f, v in zip(full, view, strict=True))


def step_leaves(state: SpecState) -> tuple[jax.Array, ...]:
    """The per-slot leaves a decode step changes: committed lengths (of both caches), pending token, active, key."""
    return state.lengths, state.target.lengths, state.pending, state.active, state.rng


def take_rows(state: SpecState, rows_b: np.ndarray) -> SpecState:
    """A view of `state` holding only the slots `rows_b` [b] (int32; B marks a missing row, which pads b to a
    bucket), for a decode step that computes b rows instead of B: the per-slot leaves (lengths, pending token,
    key, sampling rule, page-table row) gathered; the big arrays shared, not copied: the paged pool as it is
    (pages are global), the draft cache's arrays read and written at the view's rows (`DraftCache.rows`). A missing
    row is inactive, its lengths parked past the cache and its table on the null page, so it writes nothing. Each
    row of the view is active. `put_rows` writes the step's result back."""
    rows = np.asarray(rows_b, np.int32)
    lengths, target_lengths, pending, active, rng, sampling, table = gather_rows(
        (state.lengths, state.target.lengths, state.pending, state.rng, state.sampling, state.target.page_table),
        jnp.asarray(rows), park=state.target.capacity)
    target = dataclasses.replace(state.target, page_table=table, lengths=target_lengths)
    draft = None if state.draft is None else dataclasses.replace(state.draft, rows=jnp.asarray(rows))
    oracle = None if state.oracle is None else jnp.take(state.oracle, jnp.asarray(rows), axis=0, mode="fill",
                                                          fill_value=-1)
    return SpecState(target, draft, lengths, pending, active, rng, sampling, oracle)


def view_slots(state: SpecState) -> np.ndarray:
    """The slot of each row of a step's state (`take_rows`'s view: the running slots in increasing order, then B for
    the rows padding the bucket; a state that is no view: 0 .. B-1). What a test's drafts hook (`plan.Chain.drafts`)
    reads to know whose row it drafts."""
    if state.draft is not None and state.draft.rows is not None:
        return np.asarray(state.draft.rows)
    return np.arange(state.lengths.shape[0])


def put_rows(state: SpecState, view: SpecState, rows_b: np.ndarray) -> SpecState:
    """`state` after a decode step over its view `take_rows(state, rows_b)` returned `view`: the view's per-slot
    leaves written back at their slots, its caches' big arrays taken as they are (the step donated the view, and
    with it `state`'s caches: only `state`'s per-slot leaves are read here, and donated)."""
    lengths, target_lengths, pending, active, rng = scatter_rows(step_leaves(state), step_leaves(view),
                                                                  jnp.asarray(rows_b, jnp.int32))
    target = dataclasses.replace(view.target, page_table=state.target.page_table, lengths=target_lengths)
    draft = None if view.draft is None else dataclasses.replace(view.draft, rows=None)
    return SpecState(target, draft, lengths, pending, active, rng, state.sampling, state.oracle)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """Ba right-padded prompts entering distinct slots: slots [Ba], tokens [Ba, S], true lengths [Ba], keys
    [Ba, 2], sampling rules."""

    slots: jax.Array
    tokens: jax.Array
    num_valid: jax.Array
    rng: jax.Array
    sampling: SamplingRows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probabilities (log_softmax of its fp32 logits: temperature 1, no filtering) at Q positions
    of B rows: chosen [B, Q] (of the token that follows each position), top_values / top_ids [B, Q, n] (the n
    most likely tokens there, most likely first; n = min(MAX_TOP_LOGPROBS, V))."""

    chosen: jax.Array
    top_values: jax.Array
    top_ids: jax.Array

    @classmethod
    def of(cls, logits_BxQxV: jax.Array, next_BxQ: jax.Array) -> TokenLogprobs:
        logp = jax.nn.log_softmax(logits_BxQxV.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, next_BxQ[..., None].astype(jnp.int32), axis=-1)[..., 0]
        values, ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
        return cls(chosen, values, ids.astype(jnp.int32))


def empty_state(target_cfg: DecoderConfig, arch: DrafterArch | None, batch: int, max_len: int, num_pages: int,
                page_size: int, dtype: Any = jnp.float32, oracle: bool = False) -> SpecState:
    """B empty, inactive slots: a paged target cache of `num_pages` pages (the null page included) whose
    tables hold ceil(max_len / page_size) pages per slot; a draft cache [.., max_len, ..] unless AR; with
    `oracle`, an empty oracle table [B, max_len]."""
    target = PagedKVCache.create(target_cfg, batch, -(-max_len // page_size), num_pages, page_size, dtype)
    draft = None if arch is None else DraftCache.create(arch, batch, max_len)
    return SpecState(target, draft, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32),
                     jnp.zeros((batch,), bool), jnp.zeros((batch, 2), jnp.uint32), SamplingRows.of([None] * batch),
                     jnp.full((batch, max_len), -1, jnp.int32) if oracle else None)


def oracle_tokens(state: SpecState, d: int) -> tuple[jax.Array, jax.Array]:
    """(tokens [B, d], use [B, d]): each slot's oracle sequence (`SpecState.oracle`) at positions L + 1 .. L + d,
    and where a perfect drafter proposes them: the greedy rows' known positions."""
    positions = state.lengths[:, None] + 1 + jnp.arange(d)[None, :]
    known = jnp.take_along_axis(state.oracle, jnp.clip(positions, 0, state.oracle.shape[1] - 1), axis=1)
    known = jnp.where(positions < state.oracle.shape[1], known, -1)
    return known, (known >= 0) & state.sampling.greedy[:, None]


def oracle_drafts(state: SpecState, drafts_BxJ: jax.Array) -> jax.Array:
    """`drafts_BxJ` (J = K - 1) with each greedy row's known tokens of its oracle sequence in their place
    (`oracle_tokens`; unchanged without an oracle): what a perfect drafter proposes."""
    if state.oracle is None:
        return drafts_BxJ
    known, use = oracle_tokens(state, drafts_BxJ.shape[1])
    return jnp.where(use, known, drafts_BxJ).astype(drafts_BxJ.dtype)


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


def _add_context(drafter: DFlashDrafter | None, draft: DraftCache | None, feats_FxBxQxDt: jax.Array | None,
                 starts_B: jax.Array, rows_B: jax.Array | None = None,
                 counts_B: jax.Array | None = None) -> DraftCache | None:
    """Fuse the target features of Q new positions (starting at `starts_B`; the first `counts_B` real, for a
    prefill) into the draft cache."""
    if drafter is None:
        return draft
    t = feats_FxBxQxDt.shape[2]
    positions = starts_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    fused = drafter.fuse(concat_features(feats_FxBxQxDt).astype(jnp.float32))
    return draft.write(drafter.context_kv(fused, positions), starts_B, rows_B, counts_B)


def _layer_ids(drafter: DFlashDrafter | None) -> tuple[int, ...]:
    return () if drafter is None else drafter.arch.layer_ids


def _first_tokens(logits_BaxV: jax.Array, rules: SamplingRows, rng_Bax2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first token [Ba], next keys): argmax for a greedy row, else drawn with the row's key and rule."""
    greedy = first_argmax(logits_BaxV)

    def draw(_: None) -> tuple[jax.Array, jax.Array]:
        keys = jax.vmap(jax.random.split)(rng_Bax2)
        drawn = jax.vmap(categorical)(keys[:, 1], row_logprobs(logits_BaxV, rules))
        return jnp.where(rules.greedy, greedy, drawn), jnp.where(rules.greedy[:, None], rng_Bax2, keys[:, 0])

    return jax.lax.cond(jnp.all(rules.greedy), lambda _: (greedy, rng_Bax2), draw, None)


def _prefill(models: Models, state: SpecState, new: Admission, logprobs: bool, starts_Ba: jax.Array | None = None,
             span_pages: int | None = None) -> tuple[SpecState, TokenLogprobs | None]:
    drafter = models.drafter()
    r, t = new.tokens.shape
    starts_Ba = jnp.zeros((r,), jnp.int32) if starts_Ba is None else starts_Ba.astype(jnp.int32)
    pages = min(state.target.page_table.shape[1], -(-t // state.target.page_size) if span_pages is None else span_pages)
    real = new.slots < state.lengths.shape[0]  # padding rows (slot B) write nowhere: their table is the null page
    rows = jnp.where(real[:, None], state.target.page_table[jnp.minimum(new.slots, state.lengths.shape[0] - 1)],
                     NULL_PAGE)
    view = dataclasses.replace(state.target, page_table=rows[:, :pages], lengths=starts_Ba)
    positions = starts_Ba[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    num_valid = new.num_valid.astype(jnp.int32)
    last = None if logprobs else (num_valid - 1)[:, None]  # logprobs: the logits of every prompt position
    logits, feats, view = forward_cached(models.target_params, models.target_cfg, new.tokens, positions, view,
                                         layer_ids=_layer_ids(drafter), logits_at_BxQo=last)
    target = dataclasses.replace(state.target, k_pages=view.k_pages, v_pages=view.v_pages,
                                 lengths=state.target.lengths.at[new.slots].set(starts_Ba + num_valid, mode="drop"))
    draft = _add_context(drafter, state.draft, feats, starts_Ba, new.slots, num_valid)
    if logprobs:
        at_last = jnp.take_along_axis(logits, (num_valid - 1)[:, None, None], axis=1)[:, 0]
    else:
        at_last = logits[:, 0]
    pending, rng = _first_tokens(at_last, new.sampling, new.rng)
    scores = None
    if logprobs:  # position i scores the token after it: prompt token i + 1, then the first generated token
        following = jnp.pad(new.tokens[:, 1:], ((0, 0), (0, 1))).at[jnp.arange(r), num_valid - 1].set(pending)
        scores = TokenLogprobs.of(logits, following)
    return dataclasses.replace(
        state, target=target, draft=draft, lengths=state.lengths.at[new.slots].set(starts_Ba + num_valid, mode="drop"),
        pending=state.pending.at[new.slots].set(pending, mode="drop"),
        active=state.active.at[new.slots].set(True, mode="drop"), rng=state.rng.at[new.slots].set(rng, mode="drop"),
        sampling=state.sampling.set(new.slots, new.sampling)), scores


@functools.partial(jax.jit, donate_argnames=("state",))
def prefill(models: Models, state: SpecState, new: Admission) -> SpecState:
    """`state` with the prompts of `new` prefilled into their slots: both caches filled from position 0
    (whatever the slot held is forgotten), sampling rules set, the first token pending, the slots active.
    A row whose slot is B (one past the last) is padding (the engine pads R to a bucket): it writes nothing.

    The host must have given each slot pages for its prompt (`PageTable.ensure`) and uploaded the table;
    the prompt runs through a view of the cache holding only those slots' page-table rows, so it writes
    straight into their pages."""
    return _prefill(models, state, new, False)[0]


@functools.partial(jax.jit, donate_argnames=("state",))
def prefill_logprobs(models: Models, state: SpecState, new: Admission) -> tuple[SpecState, TokenLogprobs]:
    """`prefill`, and the target's log-probabilities at every prompt position [Ba, S]: position i scores prompt
    token i + 1, position num_valid - 1 the first generated token (the logits of the whole prompt are
    computed, so only requests that ask pay for them)."""
    return _prefill(models, state, new, True)


@functools.partial(jax.jit, static_argnames=("span_pages",), donate_argnames=("state",))
def prefill_chunk(models: Models, state: SpecState, new: Admission, starts_Ba: jax.Array,
                  span_pages: int) -> SpecState:
    """`prefill` of a chunk of each prompt, tokens [Ba, Q] at positions starts_Ba .. starts_Ba + Q - 1, after the
    starts_Ba tokens already in the slots' caches (a long prompt prefilled over several engine steps). The chunk
    attends over the first `span_pages` (static) pages of its slot, which must hold starts_Ba + Q tokens. After
    the last chunk the slot holds its whole prompt and the first token is pending, as after `prefill`; after an
    earlier one the pending token is meaningless (the engine keeps the slot inactive until the last chunk)."""
    return _prefill(models, state, new, False, starts_Ba, span_pages)[0]


@functools.partial(jax.jit, static_argnames=("block_size", "span", "sample"))
def propose(models: Models, state: SpecState, block_size: int, span: int | None = None,
            sample: bool = False) -> jax.Array | tuple[jax.Array, DraftLaw]:
    """Drafts [B, K-1] for positions L+1 .. L+K-1 from one drafter forward over the block: the argmax of each
    slot's distribution. With `sample`, a sampled request's drafts are drawn instead from each slot's distribution
    under the request's own rule (temperature, top-k, top-p over the draft rows), and the laws they were drawn
    from come back too, `(drafts, DraftLaw)`, for `verify` to accept them by speculative sampling
    (`accept_drafted`); greedy requests keep the argmax.

    span: context slots the full-attention layers attend over (static; default: all). Every L must be <= span.
    Sliding-window layers attend over their ring (the last W positions) whatever the span."""
    drafter = models.drafter()
    hidden = draft_hidden(models, drafter, state, block_size, span)
    if sample:  # a path-selector drafter is refused by the plan (`plan.Chain.check`)
        drafts, law = sampled_drafts(models, hidden[:, 1:], state)
        return oracle_drafts(state, drafts), law  # (the oracle drafts greedy rows only)
    if drafter.candidate_selector is not None:
        return oracle_drafts(state, selector_drafts(models, drafter, hidden[:, 1:], state.pending))
    return oracle_drafts(state, argmax_drafts(models, hidden[:, 1:]))


def draft_hidden(models: Models, drafter: DFlashDrafter, state: SpecState, block_size: int,
                 span: int | None) -> jax.Array:
    """The drafter's final hidden states [B, K, D] over each slot's block [pending, MASK x (K-1)] at positions
    L .. L+K-1, attending to the context its layers see (`DraftCache.visible`: the first `span` slots of a full
    layer, the window of a sliding one)."""
    ids = block_token_ids(state.pending, block_size, drafter.arch.mask_token_id)
    positions = state.lengths[:, None] + jnp.arange(block_size, dtype=jnp.int32)[None, :]
    ctx_kv, ctx_valid = state.draft.visible(state.lengths, span)
    return drafter.draft_block(embed(models.target_params, ids).astype(jnp.float32), positions, ctx_kv, ctx_valid)


def sampled_drafts(models: Models, hidden_BxJxD: jax.Array, state: SpecState) -> tuple[jax.Array, DraftLaw]:
    """(drafts [B, J], their law): each sampled row's slots drawn independently from the drafter's distribution
    under the row's rule (`row_logprobs` over the draft rows) with the row's draft key (`step_keys`); greedy rows
    take the argmax. A batch of greedy rows never draws (`lax.cond`)."""
    logits = draft_logits(models, hidden_BxJxD)
    logq = row_logprobs(logits, state.sampling)
    argmax = first_argmax(logits)

    def draw(_: None) -> jax.Array:
        keys = step_keys(state.rng)[:, 3]
        drawn = jax.vmap(categorical)(keys, logq)
        return jnp.where(state.sampling.greedy[:, None], argmax, drawn)

    rows = jax.lax.cond(jnp.all(state.sampling.greedy), lambda _: argmax, draw, None)
    ids = rows if models.draft_ids is None else jnp.take(models.draft_ids, rows).astype(jnp.int32)
    return ids, DraftLaw(logq, rows)


def argmax_drafts(models: Models, hidden_BxJxD: jax.Array) -> jax.Array:
    """Greedy token ids [B, J] from the drafter's final hidden states: the argmax over the draft vocabulary's
    rows of the target's head when the drafter has one, else over the full head."""
    rows = first_argmax(draft_logits(models, hidden_BxJxD))
    return (rows if models.draft_ids is None else jnp.take(models.draft_ids, rows)).astype(jnp.int32)


def draft_logits(models: Models, hidden_BxJxD: jax.Array) -> jax.Array:
    """The drafter's unary logits [B, J, V'] (fp32): over the draft vocabulary's rows of the target's head when
    the drafter has one (`models.draft_ids` maps them to token ids), else over the full head."""
    if models.draft_ids is not None:
        return jnp.einsum("bkd,vd->bkv", hidden_BxJxD, models.draft_head).astype(jnp.float32)
    return drafter_logits(models.target_params, models.target_cfg, hidden_BxJxD)


def selector_drafts(models: Models, drafter: DFlashDrafter, hidden_BxJxD: jax.Array, anchor_B: jax.Array) -> jax.Array:
    """Drafts [B, J] of DFlash2's path selector (`CandidateSelector.walk`): each slot's top-k unary candidates,
    re-ranked by the edge score from the token chosen before it (the anchor for the first slot). Deterministic
    given the context, like the argmax, so the one-hot verify stays exact at any temperature."""
    selector = drafter.candidate_selector
    unary, rows = jax.lax.top_k(draft_logits(models, hidden_BxJxD), selector.top_k)
    ids = rows if models.draft_ids is None else jnp.take(models.draft_ids, rows)
    return selector.walk(ids.astype(jnp.int32), unary, hidden_BxJxD, anchor_B)


def residual_logprobs(logp_BxV: jax.Array, removed_BxV: jax.Array) -> jax.Array:
    """The residual after one-hot drafts were rejected: log p with the `removed` tokens taken out (-inf; the draw
    renormalises). Where that leaves nothing, p itself (as `accept_drafted` does when max(p - q, 0) is zero): the
    drafts covered p's whole filtered support (top-k <= the drafts, a tight top-p) and float32 rejected them all,
    e.g. at an acceptance ratio of 0.9999999, which exact arithmetic never does; a draw from an all -inf row
    would return token 0 whatever p is."""
    residual = jnp.where(removed_BxV, -jnp.inf, logp_BxV)
    return jnp.where(jnp.any(jnp.isfinite(residual), axis=-1, keepdims=True), residual, logp_BxV)


def accept_greedy(logits_BxKxV: jax.Array, drafts_BxJ: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(n accepted [B], bonus [B]): the longest prefix with d_i == argmax after token i-1; bonus = argmax."""
    preds = first_argmax(logits_BxKxV)  # preds[:, i] follows tokens[:, i]
    n = jnp.sum(jnp.cumprod((drafts_BxJ == preds[:, :-1]).astype(jnp.int32), axis=1), axis=1)
    return n, jnp.take_along_axis(preds, n[:, None], axis=1)[:, 0]


def accept_sampled(logits_BxKxV: jax.Array, drafts_BxJ: jax.Array, sampling: SamplingRows,
                   rng_Bx2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One-hot-draft rejection sampling (lossless; docs/design.md §8 pitfall 8): (n [B], bonus [B], next keys).

    The drafts are argmax proposals, i.e. q = one-hot(d_i), so draft i is accepted with probability
    min(1, p_i(d_i) / 1) = p_i(d_i) under the target's filtered distribution p_i; at the first rejection
    the replacement is drawn from the residual max(p - q, 0) = p with d_i removed, renormalised
    (`residual_logprobs`: p itself where float32 rejected a draft holding all of p); when all K-1 drafts are
    accepted the bonus is drawn from p_{K-1}. The output then has exactly the target's
    distribution, as if sampled token by token.
    """
    k = drafts_BxJ.shape[1] + 1
    keys = jax.vmap(lambda key: jax.random.split(key, 3))(rng_Bx2)
    logp = row_logprobs(logits_BxKxV, sampling)  # [B, K, V]
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts_BxJ[..., None], axis=-1)[..., 0])
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 1])
    n = jnp.sum(jnp.cumprod((u < p_draft).astype(jnp.int32), axis=1), axis=1)
    logp_n = jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = jnp.take_along_axis(jnp.pad(drafts_BxJ, ((0, 0), (0, 1)), constant_values=-1), n[:, None], 1)
    residual = residual_logprobs(logp_n, jnp.arange(logp.shape[-1])[None, :] == rejected)
    bonus = jax.vmap(categorical)(keys[:, 2], residual)
    return n, bonus, keys[:, 0]


def accept_drafted(logits_BxKxV: jax.Array, drafts_BxJ: jax.Array, law: DraftLaw, draft_ids: jax.Array | None,
                   sampling: SamplingRows, rng_Bx2: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Speculative sampling of drafts drawn from the drafter's distributions q_i (`sampled_drafts`; lossless for
    any q): (n [B], bonus [B], next keys). Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)) under
    the target's filtered distribution p_i; at the first rejection the replacement is drawn from the residual
    max(p_i - q_i, 0), renormalised (q is zero off the draft rows); when all K-1 drafts are accepted the bonus is
    drawn from p_{K-1}. Each slot's q is independent of the drafts before it (one forward drafts the block), which
    the rule allows: the output has exactly the target's distribution. Against one-hot drafts (`accept_sampled`,
    acceptance p_i(d_i)) a slot is accepted with probability sum_v min(p_i(v), q_i(v)), more where the target
    spreads its mass and the drafter follows it."""
    k = drafts_BxJ.shape[1] + 1
    keys = step_keys(rng_Bx2)
    logp = row_logprobs(logits_BxKxV, sampling)  # [B, K, V]
    logp_d = jnp.take_along_axis(logp[:, :-1], drafts_BxJ[..., None], axis=-1)[..., 0]
    logq_d = jnp.take_along_axis(law.logq, law.rows[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda key: jax.random.uniform(key, (k - 1,)))(keys[:, 1])
    n = jnp.sum(jnp.cumprod((u < jnp.exp(jnp.minimum(logp_d - logq_d, 0.0))).astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.exp(jnp.take_along_axis(logp, n[:, None, None], axis=1)[:, 0])  # [B, V]
    q_n = jnp.exp(jnp.take_along_axis(law.logq, jnp.minimum(n, k - 2)[:, None, None], axis=1)[:, 0])  # [B, V']
    q_n = jnp.where((n < k - 1)[:, None], q_n, 0.0)  # all accepted: the bonus is drawn from p alone
    q_full = q_n if draft_ids is None else jnp.zeros_like(p_n).at[:, draft_ids].set(q_n)
    residual = jnp.maximum(p_n - q_full, 0.0)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)  # p == q: never rejected
    bonus = jax.vmap(categorical)(keys[:, 2], jnp.log(residual))
    return n, bonus, keys[:, 0]


def _accept(logits_BxKxV: jax.Array, drafts_BxJ: jax.Array, state: SpecState, law: DraftLaw | None = None,
            draft_ids: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """(n, bonus, next keys), each row by its own rule (sampled rows: one-hot rejection, or with `law` speculative
    sampling of drafts drawn from it); a batch of greedy rows never runs the sampling branch (`lax.cond`)."""
    n_greedy, bonus_greedy = accept_greedy(logits_BxKxV, drafts_BxJ)

    def mixed(_: None) -> tuple[jax.Array, jax.Array, jax.Array]:
        if law is None:
            n_s, bonus_s, rng_s = accept_sampled(logits_BxKxV, drafts_BxJ, state.sampling, state.rng)
        else:
            n_s, bonus_s, rng_s = accept_drafted(logits_BxKxV, drafts_BxJ, law, draft_ids, state.sampling,
                                                 state.rng)
        greedy = state.sampling.greedy
        return (jnp.where(greedy, n_greedy, n_s), jnp.where(greedy, bonus_greedy, bonus_s),
                jnp.where(greedy[:, None], state.rng, rng_s))

    return jax.lax.cond(jnp.all(state.sampling.greedy), lambda _: (n_greedy, bonus_greedy, state.rng), mixed, None)


def _verify(models: Models, state: SpecState, drafts_BxJ: jax.Array, span_pages: int | None, logprobs: bool,
            law: DraftLaw | None = None) -> tuple[SpecState, jax.Array, jax.Array, TokenLogprobs | None]:
    drafter = models.drafter()
    k = drafts_BxJ.shape[1] + 1
    tokens = jnp.concatenate([state.pending[:, None], drafts_BxJ], axis=1)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    seen = state.target if span_pages is None else state.target.view(span_pages)
    logits, feats, cache = forward_cached(models.target_params, models.target_cfg, tokens, positions, seen,
                                          layer_ids=_layer_ids(drafter))
    cache = cache.with_full_table(state.target)
    n, bonus, rng = _accept(logits, drafts_BxJ, state, law, models.draft_ids)
    n = jnp.where(state.active, n, 0)
    idx = jnp.arange(k)[None, :]
    out = jnp.where(idx < n[:, None], jnp.pad(drafts_BxJ, ((0, 0), (0, 1))), 0)
    out = jnp.where(idx == n[:, None], bonus[:, None], out)
    new_len = jnp.where(state.active, state.lengths + n + 1, state.lengths)
    draft = _add_context(drafter, state.draft, feats, state.lengths)  # slots >= new_len stay invisible
    new_state = dataclasses.replace(state, target=cache.rollback(new_len), draft=draft, lengths=new_len,
                                    pending=jnp.where(state.active, bonus, state.pending), rng=rng)
    # logits[:, i] follows block token i, and out[:, i] is the token emitted after it (for i <= n)
    return new_state, out, n, TokenLogprobs.of(logits, out) if logprobs else None


@functools.partial(jax.jit, static_argnames=("span_pages",), donate_argnames=("state",))
def verify(models: Models, state: SpecState, drafts_BxJ: jax.Array,
           span_pages: int | None = None, law: DraftLaw | None = None) -> tuple[SpecState, jax.Array, jax.Array]:
    """Verify drafts with one target forward; returns (state, tokens [B, K], accepted n [B]). Sampled requests
    accept one-hot drafts by `accept_sampled`, or drafts drawn from `law` (`propose(..., sample=True)`) by
    `accept_drafted`.

    The host must have given every active slot pages for L + K tokens (the K block tokens are written
    before the rollback to L + n + 1). `span_pages` (static; default: the whole table) is how many
    page-table entries attention sees. tokens[b, :n+1] are the step's output (d_1 .. d_n, then the bonus);
    the rest is padding. Inactive slots are left as they were (n = 0, nothing output)."""
    return _verify(models, state, drafts_BxJ, span_pages, False, law)[:3]


@functools.partial(jax.jit, static_argnames=("span_pages",), donate_argnames=("state",))
def verify_logprobs(models: Models, state: SpecState, drafts_BxJ: jax.Array, span_pages: int | None = None,
                    law: DraftLaw | None = None) -> tuple[SpecState, jax.Array, jax.Array, TokenLogprobs]:
    """`verify`, and the target's log-probabilities [B, K] of the output tokens (position i scores tokens[b, i];
    only i <= n are emitted). A separate program, so that steps with no request asking pay nothing."""
    return _verify(models, state, drafts_BxJ, span_pages, True, law)


def run_steps(step: Any, state: SpecState, aux: Any, stop_ids_BxZ: jax.Array, budget_B: jax.Array, width: int,
              steps: int) -> tuple[SpecState, jax.Array, jax.Array, jax.Array]:
    """The device loop of `decode_steps` (traced inside a jitted caller): up to `steps` calls of
    step(state, aux) -> (state, aux, tokens [B, width], accepted n [B]); returns (state, tokens [steps, B, width],
    accepted n [steps, B], steps run). It stops after a step in which an active slot emitted one of its stop ids
    (stop_ids_BxZ, padded with -1) or reached `budget_B` new tokens (counted from this call). `aux` is carried
    from step to step (e.g. the token history of prompt lookup; None for none)."""
    b = state.lengths.shape[0]

    def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
        i, st, aux, tokens, accepted, emitted, _ = carry
        st, aux, out, n = step(st, aux)
        valid = jnp.arange(width)[None, :] <= n[:, None]
        hit = jnp.any(valid & jnp.any(out[:, :, None] == stop_ids_BxZ[:, None, :], axis=-1), axis=-1)
        emitted = emitted + jnp.where(st.active, n + 1, 0)
        finished = jnp.any(st.active & (hit | (emitted >= budget_B)))
        return i + 1, st, aux, tokens.at[i].set(out), accepted.at[i].set(n), emitted, finished

    carry = (jnp.int32(0), state, aux, jnp.zeros((steps, b, width), jnp.int32), jnp.zeros((steps, b), jnp.int32),
             jnp.zeros((b,), jnp.int32), jnp.bool_(False))
    i, state, _, tokens, accepted, _, _ = jax.lax.while_loop(lambda c: (c[0] < steps) & ~c[6], body, carry)
    return state, tokens, accepted, i


@functools.partial(jax.jit, static_argnames=("block_size", "steps", "span_pages", "sample"),
                   donate_argnames=("state",))
def decode_steps(models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, block_size: int,
                 steps: int, span_pages: int,
                 sample: bool = False) -> tuple[SpecState, jax.Array, jax.Array, jax.Array]:
    """Up to `steps` decode steps (the drafter's `propose` then `verify`; AR when block_size is 1) in one device
    loop; returns (state, tokens [steps, B, K], accepted n [steps, B], steps run). Row i < steps run holds step
    i's `verify` output; the loop ends early after a step in which an active slot emitted one of its stop ids
    (stop_ids_BxZ, padded with -1) or reached `budget_B` new tokens (counted from this call), so the host, which
    checks stops and budgets exactly, finds a finished request only in the last step run (`run_steps`). Each step
    is the same computation as one `propose` + `verify` call (the same outputs, the same state; `sample` as
    `propose`'s). The tree's twin is `tree.decode_tree_steps`."""
    b, k = state.lengths.shape[0], block_size
    page_size = state.target.page_size

    def step(st: SpecState, aux: None) -> tuple[SpecState, None, jax.Array, jax.Array]:
        law = None
        if k == 1:
            drafts = jnp.zeros((b, 0), jnp.int32)
        elif sample:
            drafts, law = propose(models, st, k, span_pages * page_size, sample=True)
        else:
            drafts = propose(models, st, k, span_pages * page_size)
        st, out, n, _ = _verify(models, st, drafts, span_pages, False, law)
        return st, aux, out, n

    return run_steps(step, state, None, stop_ids_BxZ, budget_B, k, steps)


__all__ = [
    "Admission",
    "DraftCache",
    "DraftLaw",
    "Models",
    "MAX_TOP_LOGPROBS",
    "SpecState",
    "TokenLogprobs",
    "accept_drafted",
    "accept_greedy",
    "accept_sampled",
    "argmax_drafts",
    "bucket",
    "categorical",
    "decode_steps",
    "draft_hidden",
    "draft_logits",
    "empty_state",
    "first_argmax",
    "gather_rows",
    "oracle_drafts",
    "oracle_tokens",
    "prefill",
    "prefill_chunk",
    "prefill_logprobs",
    "prompt_bucket",
    "propose",
    "put_rows",
    "residual_logprobs",
    "run_steps",
    "sampled_drafts",
    "scatter_rows",
    "span_pages",
    "step_keys",
    "step_leaves",
    "sync_page_table",
    "take_rows",
    "verify",
    "verify_logprobs",
    "view_slots",
]
