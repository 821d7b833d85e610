"""The cached forward: chunked appends + rollback reproduce the full forward (fp32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.models.loading import load_hf_dir

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


TOL = 1e-4


@pytest.fixture(scope="module",
                params=[pytest.param("llama3_scaled_untied", marks=pytest.mark.slow), "qwen3_qknorm_tied"])
def model(request):
    cfg, params = load_hf_dir(GOLDEN / "tiny" / request.param)
    ref = np.load(GOLDEN / "tiny" / request.param / "reference.npz")
    return cfg, jax.tree.map(jnp.asarray, params), ref


def _append(cfg, params, cache, tokens_BxT, layer_ids=()):
    t = tokens_BxT.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    return decoder.forward_cached(params, cfg, jnp.asarray(tokens_BxT), positions, cache, layer_ids=layer_ids)


def test_chunked_cached_forward_equals_full_forward(model):
    cfg, params, ref = model
    tokens = ref["input_ids"]  # [2, 40]
    full_logits, full_feats = decoder.forward(params, cfg, jnp.asarray(tokens), layer_ids=(1, 3))
    cache = decoder.DenseKVCache.create(cfg, batch=2, max_len=64)
    start = 0
    for chunk in (7, 1, 1, 13, 2, 16):
        logits, feats, cache = _append(cfg, params, cache, tokens[:, start:start + chunk], layer_ids=(1, 3))
        expected = np.asarray(full_logits[:, start:start + chunk])
        np.testing.assert_allclose(np.asarray(logits), expected, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(feats), np.asarray(full_feats[:, :, start:start + chunk]), atol=TOL,
                                   rtol=0)
        start += chunk
    assert start == 40 and np.asarray(cache.lengths).tolist() == [40, 40]


def test_rollback_discards_rejected_tokens(model):
    """Verify-style use: append a block with wrong tokens, roll back, continue; equals the full forward."""
    cfg, params, ref = model
    tokens = ref["input_ids"]
    full_logits, _ = decoder.forward(params, cfg, jnp.asarray(tokens))
    cache = decoder.DenseKVCache.create(cfg, batch=2, max_len=64)
    _, _, cache = _append(cfg, params, cache, tokens[:, :10])
    wrong = (tokens[:, 10:18] + 1) % cfg.vocab_size
    _, _, cache = _append(cfg, params, cache, wrong)
    # Sequence 0 keeps nothing of the wrong block; sequence 1 keeps its first 3 (made correct first).
    cache = cache.rollback(jnp.array([10, 10]))
    _, _, cache = _append(cfg, params, cache, tokens[:, 10:13])
    wrong = (tokens[:, 13:19] + 7) % cfg.vocab_size
    _, _, cache = _append(cfg, params, cache, wrong)
    cache = cache.rollback(jnp.array([13, 13]))
    logits, _, cache = _append(cfg, params, cache, tokens[:, 13:25])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits[:, 13:25]), atol=TOL, rtol=0)


def test_sequences_at_different_lengths_share_a_step(model):
    """After rolling sequences back to different lengths, one chunk continues each at its own offset."""
    cfg, params, ref = model
    tokens = ref["input_ids"]
    full_logits, _ = decoder.forward(params, cfg, jnp.asarray(tokens))
    cache = decoder.DenseKVCache.create(cfg, batch=2, max_len=64)
    _, _, cache = _append(cfg, params, cache, tokens[:, :12])
    cache = cache.rollback(jnp.array([12, 7]))
    chunk = np.stack([tokens[0, 12:17], tokens[1, 7:12]])
    logits, _, cache = _append(cfg, params, cache, chunk)
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(full_logits[0, 12:17]), atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(full_logits[1, 7:12]), atol=TOL, rtol=0)
    assert np.asarray(cache.lengths).tolist() == [17, 12]


def test_capacity_guard():
    with pytest.raises(ValueError, match="cache capacity 64"):
        decoder.check_capacity(np.array([60, 10]), 8, 64)
    decoder.check_capacity(np.array([56, 10]), 8, 64)
