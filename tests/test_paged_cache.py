"""The paged target cache: same logits as the dense cache (fp32), a leak-free page allocator, one compile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.models.loading import load_hf_dir
from dflash.serve.paged import NULL_PAGE, OutOfPagesError, PagedKVCache, PagePool, PageTable

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3_untied", pytest.param("llama3_scaled_untied", marks=pytest.mark.slow)])
def model(request):
    cfg, params = load_hf_dir(GOLDEN / "tiny" / request.param)
    return cfg, jax.tree.map(jnp.asarray, params)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _append(params, cfg, tokens_BxT, cache):
    positions = cache.lengths[:, None] + jnp.arange(tokens_BxT.shape[1])[None, :]
    logits, _, cache = decoder.forward_cached(params, cfg, tokens_BxT, positions, cache)
    return logits, cache


def _scrambled_pool(num_pages: int, page_size: int, seed: int) -> PagePool:
    """A pool whose next allocations come out non-contiguous and shuffled (allocate all, free shuffled)."""
    pool = PagePool(num_pages, page_size)
    pages = pool.allocate(pool.num_free)
    np.random.default_rng(seed).shuffle(pages)
    for i in range(0, len(pages), 3):
        pool.free(pages[i:i + 3])
    return pool


class Pair:
    """A dense and a paged cache fed the same chunks; every append checks their logits agree."""

    def __init__(self, model, batch: int = 2, page_size: int = 4, max_pages: int = 12, num_pages: int = 40,
                 seed: int = 0):
        self.cfg, self.params = model
        self.pool = _scrambled_pool(num_pages, page_size, seed)
        self.table = PageTable(self.pool, batch, max_pages)
        self.dense = decoder.DenseKVCache.create(self.cfg, batch, max_pages * page_size)
        self.paged = PagedKVCache.create(self.cfg, batch, max_pages, num_pages, page_size)
        self.lengths = np.zeros(batch, np.int64)

    def append(self, tokens_BxT) -> np.ndarray:
        tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
        self.table.ensure_batch(self.lengths + tokens_BxT.shape[1])  # the engine's step before each append
        self.paged = self.paged.with_page_table(self.table.array())
        dense_logits, self.dense = _append(self.params, self.cfg, tokens_BxT, self.dense)
        paged_logits, self.paged = _append(self.params, self.cfg, tokens_BxT, self.paged)
        np.testing.assert_allclose(np.asarray(paged_logits), np.asarray(dense_logits), atol=TOL, rtol=0)
        self.lengths += tokens_BxT.shape[1]
        assert np.asarray(self.paged.lengths).tolist() == self.lengths.tolist()
        return np.asarray(paged_logits)

    def rollback(self, lengths) -> None:
        self.dense = self.dense.rollback(jnp.asarray(lengths))
        self.paged = self.paged.rollback(jnp.asarray(lengths))
        self.lengths = np.minimum(self.lengths, np.asarray(lengths))


def _tokens(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


# ----------------------------------------------------------------------------- parity with the dense cache


def test_prefill_then_decode(model):
    cfg = model[0]
    tokens = _tokens(2, 30, cfg.vocab_size)
    pair = Pair(model, num_pages=20)
    pair.append(tokens[:, :13])
    for i in range(13, 25):  # crosses page boundaries at 16, 20, 24
        pair.append(tokens[:, i:i + 1])
    assert len(pair.table.pages(0)) == 7 and pair.pool.num_free == 19 - 14


@pytest.mark.parametrize("page_size", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_appends(model, page_size):
    cfg = model[0]
    tokens = _tokens(2, 40, cfg.vocab_size, seed=1)
    pair = Pair(model, page_size=page_size, max_pages=48 // page_size, num_pages=100, seed=page_size)
    start = 0
    for chunk in (7, 1, 1, 13, 4, 7, 4):  # the shapes the other tests use too (fewer compiles)
        pair.append(tokens[:, start:start + chunk])
        start += chunk


def test_batch_of_different_prompt_lengths(model):
    """Right-padded prompts prefilled together, rolled back to their true lengths, then decoded together."""
    cfg = model[0]
    prompt_lengths = np.array([5, 17, 11])
    tokens = _tokens(3, 17, cfg.vocab_size, seed=2)
    pair = Pair(model, batch=3, num_pages=24, seed=3)
    pair.append(tokens)
    pair.rollback(prompt_lengths)
    decode = _tokens(3, 10, cfg.vocab_size, seed=4)
    for i in range(6):
        pair.append(decode[:, i:i + 1])
    pair.append(decode[:, 6:10])
    assert np.asarray(pair.paged.lengths).tolist() == (prompt_lengths + 10).tolist()


def test_speculative_rollback_then_reappend(model):
    """Verify pattern: append K, keep L + n + 1 (n differs per sequence), append the next block."""
    cfg = model[0]
    k = 4
    pair = Pair(model, seed=5)
    pair.append(_tokens(2, 13, cfg.vocab_size, seed=6))
    rng = np.random.default_rng(7)
    for step in range(6):
        lengths = pair.lengths.copy()
        pair.append(_tokens(2, k, cfg.vocab_size, seed=10 + step))
        accepted = rng.integers(0, k, size=2)  # n in [0, K-1]
        pair.rollback(lengths + accepted + 1)
    # Pages past the kept length stay owned until release; lengths are what the sequences kept.
    assert all(pair.table.tokens_held(b) >= pair.lengths[b] for b in range(2))


def test_pages_are_noncontiguous_and_shuffled(model):
    cfg = model[0]
    pair = Pair(model, seed=11)
    pair.append(_tokens(2, 13, cfg.vocab_size, seed=12))
    pair.append(_tokens(2, 7, cfg.vocab_size, seed=13))
    table = pair.table.array()
    assert (table[:, 5:] == NULL_PAGE).all()  # 20 tokens = 5 pages of 4
    used = table[:, :5]
    assert not (np.diff(used, axis=1) == 1).all(axis=1).any(), table  # no sequence got consecutive pages
    assert (used != NULL_PAGE).all() and len(set(used.ravel().tolist())) == used.size


def test_inactive_slot_writes_are_dropped(model):
    """A slot without pages (released or never started) writes nowhere: the null page stays zero."""
    cfg, params = model
    pool = PagePool(8, 4)
    table = PageTable(pool, 2, 4)
    table.ensure(0, 6)
    cache = PagedKVCache.create(cfg, 2, 4, 8, 4).with_page_table(table.array())
    _, cache = _append(params, cfg, jnp.asarray(_tokens(2, 6, cfg.vocab_size)), cache)
    assert not np.asarray(cache.k_pages[:, NULL_PAGE]).any() and not np.asarray(cache.v_pages[:, NULL_PAGE]).any()
    assert np.asarray(cache.k_pages[:, table.pages(0)]).any()


def test_decode_step_compiles_once(model):
    cfg, params = model
    traces = []

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def decode_step(params, token_B, cache):
        traces.append(1)  # runs only while tracing
        positions = cache.lengths[:, None]
        logits, _, cache = decoder.forward_cached(params, cfg, token_B[:, None], positions, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    pool = _scrambled_pool(16, 4, seed=20)
    table = PageTable(pool, 2, 6)
    cache = PagedKVCache.create(cfg, 2, 6, 16, 4)
    token = jnp.array([3, 7], jnp.int32)
    version = None
    for _ in range(20):
        table.ensure_batch(np.asarray(cache.lengths) + 1)
        if table.version != version:
            cache, version = cache.with_page_table(table.array()), table.version
        token, cache = decode_step(params, token, cache)
    assert len(traces) == 1
    assert np.asarray(cache.lengths).tolist() == [20, 20]


# ----------------------------------------------------------------------------- the allocator


def test_random_allocate_release_cycles_leak_nothing():
    pool = PagePool(num_pages=33, page_size=4)
    table = PageTable(pool, batch=5, max_pages_per_seq=10)
    rng = np.random.default_rng(0)
    exhausted = 0
    for _ in range(1000):
        slot = int(rng.integers(5))
        if rng.random() < 0.3:
            table.release(slot)
        else:
            before = (pool.num_free, table.pages(slot))
            try:
                table.ensure(slot, int(rng.integers(0, table.capacity + 1)))
            except OutOfPagesError:
                exhausted += 1
                assert (pool.num_free, table.pages(slot)) == before  # all-or-nothing
        owned = [p for b in range(5) for p in table.pages(b)]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert NULL_PAGE not in owned
        assert len(owned) + pool.num_free == pool.num_usable
        arr = table.array()
        for b in range(5):
            n = len(table.pages(b))
            assert arr[b, :n].tolist() == list(table.pages(b)) and (arr[b, n:] == NULL_PAGE).all()
    assert exhausted > 0  # the cycles did hit exhaustion
    for b in range(5):
        table.release(b)
    assert pool.num_free == pool.num_usable == 32


def test_exhaustion_errors():
    pool = PagePool(num_pages=4, page_size=2)
    with pytest.raises(OutOfPagesError, match="needs 5 pages, 3 free"):
        pool.allocate(5)
    assert pool.num_free == 3
    table = PageTable(pool, batch=2, max_pages_per_seq=3)
    table.ensure(0, 4)
    with pytest.raises(OutOfPagesError, match="needs 2 pages, 1 free"):
        table.ensure(1, 3)
    with pytest.raises(OutOfPagesError, match="needs 3 pages, 1 free"):
        table.ensure_batch([6, 3])
    assert table.pages(1) == () and pool.num_free == 1
    with pytest.raises(ValueError, match="capacity 6"):
        table.ensure(0, 7)


def test_double_free_and_foreign_pages():
    pool = PagePool(num_pages=6, page_size=2)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match=f"page {pages[0]} is not allocated"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="not a page of this pool"):
        pool.free([6])
    with pytest.raises(ValueError, match="null page"):
        pool.free([NULL_PAGE])
    with pytest.raises(ValueError, match="distinct"):
        pool.free([pages[1], pages[1]])
    pool.free(pages[1:])
    assert pool.num_free == 5
    with pytest.raises(ValueError, match="num_pages must be >= 2"):
        PagePool(1, 4)


def test_page_table_shape_guard(model):
    cfg = model[0]
    cache = PagedKVCache.create(cfg, batch=2, max_pages_per_seq=3, num_pages=8, page_size=4)
    assert cache.capacity == 12 and cache.page_size == 4 and cache.num_pages == 8
    with pytest.raises(ValueError, match=r"page_table must have shape \(2, 3\)"):
        cache.with_page_table(np.zeros((2, 4), np.int32))


def test_a_view_of_the_pages_in_use_equals_the_full_table(model):
    """Attention over `view(n)` (the first n table entries, as the engine's power-of-two spans) gives the
    full table's logits and writes, and `with_full_table` hands the full table back."""
    cfg = model[0]
    tokens = _tokens(2, 24, cfg.vocab_size, seed=5)
    pair = Pair(model, num_pages=40)
    pair.append(tokens[:, :13])  # 13 tokens: 4 pages of 4 in use, 12 in the table
    chunk = jnp.asarray(tokens[:, 13:17])
    pair.table.ensure_batch(pair.lengths + 4)
    full = pair.paged.with_page_table(pair.table.array())
    want, cache_full = _append(pair.params, pair.cfg, chunk, full)
    got, cache_view = _append(pair.params, pair.cfg, chunk, full.view(5))  # 17 tokens fit in 5 pages
    assert cache_view.page_table.shape == (2, 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    back = cache_view.with_full_table(full)
    assert back.page_table.shape == (2, 12)
    k_back, k_full = np.asarray(back.k_pages), np.asarray(cache_full.k_pages)
    # Layer 0's keys come from the same embeddings through the same matmul: bit for bit. Deeper layers' keys come
    # from hidden states after attention over 5 vs 12 pages of keys, whose reductions XLA may order differently by
    # shape (seen: 1.5e-6 apart under load), so they are held to the logits' tolerance.
    np.testing.assert_array_equal(k_back[0], k_full[0])
    np.testing.assert_allclose(k_back, k_full, atol=TOL, rtol=0)
    assert np.abs(k_back).max() > 0.1  # the pages were written
