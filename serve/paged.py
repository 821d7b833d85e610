"""The engine's paged target KV cache (docs/design.md §4.4): host-side page ownership, device-side paged attention.

    pool = PagePool(num_pages, page_size); table = PageTable(pool, batch, max_pages_per_seq)    # host
    cache = PagedKVCache.create(cfg, batch, max_pages_per_seq, num_pages, page_size)             # device
    table.ensure(slot, num_tokens); cache = cache.with_page_table(table.array())                 # before a step

The host decides which pages a sequence owns; the cache only scatters and attends (layout, null page and
the attention kernel hook: `PagedKVCache`). Admission and the attention span: docs/decisions.md D13.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.config import DecoderConfig
from dflash.models.decoder import attend, in_window

# Never allocated; unused page-table entries point here, and writes to it are dropped (see `PagedKVCache`).
NULL_PAGE = 0


class OutOfPagesError(RuntimeError):
    """The page pool cannot supply the pages asked for (the engine then keeps the request queued)."""


# ----------------------------------------------------------------------------- host: pool and tables


class PagePool:
    """Host-side allocator of pages 1 .. num_pages-1 (page 0 is the reserved NULL page).

    `allocate(n)` is all-or-nothing; `free(pages)` validates every id before freeing any.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page); received {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; received {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: allocation hands out 1, 2, 3, ... first
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"PagePool.allocate: n must be >= 0; received {n}")
        if n > len(self._free):
            raise OutOfPagesError(
                f"PagePool.allocate needs {n} pages, {len(self._free)} free (of {self.num_usable} usable); "
                "release finished sequences or raise num_pages"
            )
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = [int(p) for p in pages]
        if len(set(pages)) != len(pages):
            raise ValueError(f"PagePool.free: pages must be distinct; received {pages}")
        for p in pages:
            if p == NULL_PAGE:
                raise ValueError("PagePool.free: page 0 is the reserved null page and is never allocated")
            if not 0 < p < self.num_pages:
                raise ValueError(f"PagePool.free: page {p} is not a page of this pool (ids 1 .. {self.num_pages - 1})")
            if p not in self._allocated:
                raise ValueError(f"PagePool.free: page {p} is not allocated (double free?)")
        self._allocated.difference_update(pages)
        self._free.extend(pages)


class PageTable:
    """Host-side page ownership of `batch` sequence slots, grown on demand from a `PagePool`.

    `ensure(slot, num_tokens)` makes the slot own pages for its first `num_tokens` tokens (never
    shrinks); `release(slot)` returns all its pages to the pool. `array()` is the int32
    [batch, max_pages_per_seq] table for `PagedKVCache.with_page_table` (unused entries = NULL_PAGE);
    `version` increases whenever the table changes, so the engine uploads it only then.
    """

    def __init__(self, pool: PagePool, batch: int, max_pages_per_seq: int):
        if batch < 1 or max_pages_per_seq < 1:
            raise ValueError(
                f"batch and max_pages_per_seq must be >= 1; received batch={batch}, "
                f"max_pages_per_seq={max_pages_per_seq}"
            )
        self.pool = pool
        self.batch = batch
        self.max_pages_per_seq = max_pages_per_seq
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._table = np.full((batch, max_pages_per_seq), NULL_PAGE, np.int32)
        self.version = 0

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold (max_pages_per_seq * page_size)."""
        return self.max_pages_per_seq * self.pool.page_size

    def pages(self, slot: int) -> tuple[int, ...]:
        return tuple(self._pages[self._check_slot(slot)])

    def tokens_held(self, slot: int) -> int:
        """Tokens the slot's pages can hold now."""
        return len(self._pages[self._check_slot(slot)]) * self.pool.page_size

    def ensure(self, slot: int, num_tokens: int) -> list[int]:
        """Own pages for tokens 0 .. num_tokens-1 of `slot`; returns the newly allocated page ids."""
        self._check_slot(slot)
        if num_tokens > self.capacity:
            raise ValueError(
                f"sequence length must stay within the paged cache capacity {self.capacity} "
                f"(max_pages_per_seq {self.max_pages_per_seq} x page_size {self.pool.page_size}); "
                f"slot {slot} asked for {num_tokens} tokens"
            )
        missing = self.pool.pages_for(num_tokens) - len(self._pages[slot])
        if missing <= 0:
            return []
        new = self.pool.allocate(missing)
        start = len(self._pages[slot])
        self._pages[slot].extend(new)
        self._table[slot, start:start + len(new)] = new
        self.version += 1
        return new

    def ensure_batch(self, num_tokens_B: Sequence[int] | np.ndarray) -> None:
        """`ensure` every slot (0 for slots that need nothing); all-or-nothing on pool exhaustion."""
        need = [max(0, self.pool.pages_for(int(n)) - len(p)) for n, p in zip(num_tokens_B, self._pages, strict=True)]
        if sum(need) > self.pool.num_free:
            raise OutOfPagesError(
                f"PageTable.ensure_batch needs {sum(need)} pages, {self.pool.num_free} free "
                f"(of {self.pool.num_usable} usable); release finished sequences or raise num_pages"
            )
        for slot, n in enumerate(num_tokens_B):
            self.ensure(slot, int(n))

    def release(self, slot: int) -> None:
        """Return all of `slot`'s pages to the pool (the sequence finished)."""
        self._check_slot(slot)
        if not self._pages[slot]:
            return
        self.pool.free(self._pages[slot])
        self._pages[slot] = []
        self._table[slot] = NULL_PAGE
        self.version += 1

    def array(self) -> np.ndarray:
        """A copy of the int32 page table [batch, max_pages_per_seq]."""
        return self._table.copy()

    def _check_slot(self, slot: int) -> int:
        if not 0 <= slot < self.batch:
            raise ValueError(f"slot must lie in [0, {self.batch}); received {slot}")
        return slot


# ----------------------------------------------------------------------------- device: attention


class PagedAttentionFn(Protocol):
    """The kernel hook's signature.

    fn(q [B, Q, H, Dh], k_pages [L, num_pages, page_size, Hk, Dh], v_pages (same), layer (int32 scalar, traced),
       page_table [B, P] int32, lengths [B] int32) -> out [B, Q, H, Dh]

    The chunk's K/V are already written at tokens lengths[b] .. lengths[b]+Q-1 of `layer`; query i of
    sequence b attends to tokens 0 .. lengths[b]+i (kv length of the sequence: lengths[b] + Q), grouped
    query attention (H / Hk queries per KV head), scale 1/sqrt(Dh), softmax in fp32. A query with no
    visible key returns zeros. Entries of page_table beyond a sequence's kv length may be NULL_PAGE.
    A target with sliding layers also passes `window=` (int32 scalar, traced): W > 0 limits query i to tokens
    lengths[b]+i-W+1 .. lengths[b]+i, 0 = the full span; a kernel for such targets takes that keyword. A target with
    attention sinks (gpt-oss) passes `sinks=` [H]: one logit per head in each softmax's denominator (`attend`).
    """

    def __call__(self, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                 page_table: jax.Array, lengths: jax.Array) -> jax.Array:
        ...


def reference_paged_attention(q_BxQxHxDh: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                              page_table_BxP: jax.Array, lengths_B: jax.Array,
                              window: jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Pure-JAX paged attention (runs anywhere): gather each sequence's pages, then masked `attend`.

    Materializes [B, P * page_size, Hk, Dh] per call, so it costs like a dense cache of P pages per
    sequence: callers pass a table cut to the pages in use (`PagedKVCache.view`, power-of-two buckets in
    the engine); a kernel that walks the pages replaces it on TPU/GPU.
    """
    b, t = q_BxQxHxDh.shape[:2]
    _, _, page_size, hk, dh = k_pages.shape
    kv_len = page_table_BxP.shape[1] * page_size
    k_seq = k_pages[layer, page_table_BxP].reshape(b, kv_len, hk, dh)  # [B, P * page_size, Hk, Dh]
    v_seq = v_pages[layer, page_table_BxP].reshape(b, kv_len, hk, dh)
    last_BxQ = lengths_B[:, None] + jnp.arange(t)[None, :]
    visible = in_window(jnp.arange(kv_len)[None, None, :], last_BxQ[:, :, None], window)
    return attend(q_BxQxHxDh, k_seq, v_seq, visible, sinks)


# ----------------------------------------------------------------------------- device: the cache


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k_pages", "v_pages", "page_table", "lengths"],
                   meta_fields=["attention"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged cache implementing `models.decoder.KVCacheLike`, with `DenseKVCache`'s semantics.

        k_pages, v_pages  [L, P, page_size, Hk, Dh]   one pool of P pages shared by all sequences and layers
        page_table        [B, max_pages_per_seq] int32 page ids owned by each sequence slot
        lengths           [B] int32                    tokens held per sequence

    Token t of sequence b lives in page `page_table[b, t // page_size]` at offset `t % page_size`. Tokens
    at or after `lengths[b]` are stale and invisible, so rolling back (rejected drafts) only lowers
    `lengths`; the pages stay owned by the sequence until the host releases them.

    Page 0 is the NULL page: never handed out by `PagePool`; every unused page-table entry points at it.
    Writes that land on it (a slot with no page assigned there, e.g. an inactive or released sequence) or
    past `capacity` are dropped, so it stays all zeros; reads of it are always masked.

    The host (`PagePool`, `PageTable`) must make sure, before every jitted step that appends T tokens,
    that each active sequence owns pages for `lengths[b] + T` tokens (`PageTable.ensure`; the engine
    reserves a request's worst case at admission), then hand the table over with `with_page_table`.

    `attention` (a static field, default `reference_paged_attention`) is any `PagedAttentionFn`; a TPU/GPU
    kernel (e.g. a Pallas ragged paged attention) plugs in with `PagedKVCache.create(..., attention=kernel)`.
    Being static (part of the pytree structure), swapping it recompiles, and jitted steps see it as a
    constant.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    attention: PagedAttentionFn = reference_paged_attention

    @classmethod
    def create(cls, cfg: DecoderConfig, batch: int, max_pages_per_seq: int, num_pages: int, page_size: int,
               dtype: Any = jnp.float32, attention: PagedAttentionFn = reference_paged_attention) -> PagedKVCache:
        """Zeroed pages, every table entry on the null page, lengths 0. `num_pages` counts the null page."""
        if num_pages < 2 or page_size < 1 or max_pages_per_seq < 1 or batch < 1:
            raise ValueError(
                "PagedKVCache.create needs num_pages >= 2 (page 0 is the null page), page_size >= 1, "
                f"max_pages_per_seq >= 1 and batch >= 1; received num_pages={num_pages}, page_size={page_size}, "
                f"max_pages_per_seq={max_pages_per_seq}, batch={batch}"
            )
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.full((batch, max_pages_per_seq), NULL_PAGE, jnp.int32), jnp.zeros((batch,), jnp.int32),
                   attention)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def capacity(self) -> int:
        """Most tokens one sequence can hold."""
        return self.page_table.shape[1] * self.page_size

    def with_page_table(self, page_table: jax.Array | np.ndarray) -> PagedKVCache:
        """The same cache over a new page table (same shape; e.g. `PageTable.array()` after `ensure`)."""
        if page_table.shape != self.page_table.shape:
            raise ValueError(f"page_table must have shape {self.page_table.shape}; received {page_table.shape}")
        new = jnp.asarray(page_table, jnp.int32)
        if getattr(self.page_table, "committed", False):  # placed (an engine over several devices): placed alike,
            new = jax.device_put(new, self.page_table.sharding)  # so that the programs compiled for it still fit
        return dataclasses.replace(self, page_table=new)

    def view(self, num_pages: int) -> PagedKVCache:
        """The same cache seeing only the first `num_pages` entries of each page table (static): attention
        then gathers `num_pages * page_size` tokens per sequence instead of the full capacity. Every
        sequence's tokens, and the chunk about to be written, must lie within them. Undo with
        `with_full_table`."""
        return dataclasses.replace(self, page_table=self.page_table[:, :num_pages])

    def with_full_table(self, full: PagedKVCache) -> PagedKVCache:
        """This (viewed) cache's pages and lengths over `full`'s page table again."""
        return dataclasses.replace(self, page_table=full.page_table)

    def _locate(self, slots_BxQ: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(page, offset) of token slots [B, Q]; a slot past capacity or on the null page gets page
        `num_pages` (out of range), so a scatter there is dropped."""
        max_pages = self.page_table.shape[1]
        index_BxQ = slots_BxQ // self.page_size
        page_BxQ = jnp.take_along_axis(self.page_table, jnp.minimum(index_BxQ, max_pages - 1), axis=1)
        page_BxQ = jnp.where((index_BxQ < max_pages) & (page_BxQ != NULL_PAGE), page_BxQ, self.num_pages)
        return page_BxQ, slots_BxQ % self.page_size

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array) -> PagedKVCache:
        """The cache with a chunk's K/V [B, Q, Hk, Dh] of `layer` stored at tokens lengths[b] .. lengths[b]+Q-1."""
        chunk = k.shape[1]
        page_BxQ, offset_BxQ = self._locate(self.lengths[:, None] + jnp.arange(chunk)[None, :])
        # Scatter only the chunk into the full page arrays: in place in the scan carry (docs/decisions.md D4).
        k_pages = self.k_pages.at[layer, page_BxQ, offset_BxQ].set(k.astype(self.k_pages.dtype), mode="drop")
        v_pages = self.v_pages.at[layer, page_BxQ, offset_BxQ].set(v.astype(self.v_pages.dtype), mode="drop")
        return dataclasses.replace(self, k_pages=k_pages, v_pages=v_pages)

    def write_and_attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                         window: jax.Array | None = None,
                         sinks: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:
        cache = self.write(layer, k, v)
        # Kernels for targets without windows or sinks need not take them.
        extra = {name: x for name, x in (("window", window), ("sinks", sinks)) if x is not None}
        out = self.attention(q, cache.k_pages, cache.v_pages, layer, self.page_table, self.lengths, **extra)
        return out, cache

    def copy_tokens(self, src_BxJ: jax.Array, dst_BxJ: jax.Array) -> PagedKVCache:
        """The cache with token slots `dst` of every layer holding what slots `src` held (all read before any is
        written, so the two may overlap): a tree step moves its accepted path's K/V onto consecutive slots."""
        src_page, src_off = self._locate(src_BxJ)
        dst_page, dst_off = self._locate(dst_BxJ)
        src_page = jnp.minimum(src_page, self.num_pages - 1)  # a read of a dropped slot lands on a dropped write
        k = self.k_pages[:, src_page, src_off]
        v = self.v_pages[:, src_page, src_off]
        return dataclasses.replace(self, k_pages=self.k_pages.at[:, dst_page, dst_off].set(k, mode="drop"),
                                   v_pages=self.v_pages.at[:, dst_page, dst_off].set(v, mode="drop"))

    def advance(self, num_tokens: int) -> PagedKVCache:
        return dataclasses.replace(self, lengths=self.lengths + num_tokens)

    def rollback(self, lengths: jax.Array) -> PagedKVCache:
        """Forget every token at or after `lengths[b]`; pages stay owned (the host frees finished sequences)."""
        return dataclasses.replace(self, lengths=jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths))


def tree_paged_attention(q_BxQxHxDh: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                         page_table_BxP: jax.Array, lengths_B: jax.Array, chunk_visible_BxQxQ: jax.Array,
                         window: jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`reference_paged_attention` for a chunk that is a token tree: query i sees every cached token before
    lengths[b] and, of the chunk (written at lengths[b] ..), only the tokens j with chunk_visible[b, i, j]
    (its ancestors and itself). With `window` W > 0 (a sliding layer), only tokens whose position lies within W of
    the query's: a tree token's position is lengths[b] + its depth (its visible chunk tokens - 1)."""
    b, t = q_BxQxHxDh.shape[:2]
    _, _, page_size, hk, dh = k_pages.shape
    kv_len = page_table_BxP.shape[1] * page_size
    k_seq = k_pages[layer, page_table_BxP].reshape(b, kv_len, hk, dh)
    v_seq = v_pages[layer, page_table_BxP].reshape(b, kv_len, hk, dh)
    rel_BxT = jnp.arange(kv_len)[None, :] - lengths_B[:, None]  # chunk index of each cached token
    in_chunk_BxT = (rel_BxT >= 0) & (rel_BxT < t)
    index_BxQxT = jnp.broadcast_to(jnp.clip(rel_BxT, 0, t - 1)[:, None, :], (b, t, kv_len))
    tree_BxQxT = jnp.take_along_axis(chunk_visible_BxQxQ, index_BxQxT, axis=2)
    visible = (rel_BxT < 0)[:, None, :] | (in_chunk_BxT[:, None, :] & tree_BxQxT)
    if window is not None:
        depth_BxQ = jnp.sum(chunk_visible_BxQxQ, axis=2) - 1
        q_pos_BxQ = lengths_B[:, None] + depth_BxQ
        depth_BxT = jnp.take_along_axis(depth_BxQ, jnp.clip(rel_BxT, 0, t - 1), axis=1)
        k_pos_BxT = jnp.where(in_chunk_BxT, lengths_B[:, None] + depth_BxT, jnp.arange(kv_len)[None, :])
        visible = visible & ((window <= 0) | (k_pos_BxT[:, None, :] > q_pos_BxQ[:, :, None] - window))
    return attend(q_BxQxHxDh, k_seq, v_seq, visible, sinks)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeChunkCache:
    """A `PagedKVCache` whose next chunk is a token tree (`KVCacheLike` for one `forward_cached`): the chunk is
    written at tokens lengths[b] .. like any chunk, but each of its queries attends only to the committed
    tokens and its own ancestors (`tree_paged_attention`, the reference path whatever `paged.attention` is).
    `paged` afterwards holds the whole chunk; the caller keeps the accepted path (`PagedKVCache.copy_tokens`)."""

    paged: PagedKVCache
    chunk_visible: jax.Array  # [B, Q, Q] bool: query i sees chunk token j

    def write_and_attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                         window: jax.Array | None = None,
                         sinks: jax.Array | None = None) -> tuple[jax.Array, TreeChunkCache]:
        cache = self.paged.write(layer, k, v)
        out = tree_paged_attention(q, cache.k_pages, cache.v_pages, layer, cache.page_table, cache.lengths,
                                   self.chunk_visible, window, sinks)
        return out, dataclasses.replace(self, paged=cache)

    def advance(self, num_tokens: int) -> TreeChunkCache:
        return dataclasses.replace(self, paged=self.paged.advance(num_tokens))
