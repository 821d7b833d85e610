"""Sampling filters: temperature, top-k and top-p keep exactly the tokens they should."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash.configs.schema import ConfigError
from dflash.serve.engine import request_keys
from dflash.serve.sampling import SamplingConfig, filtered_logprobs, sample
from dflash.serve.speculative import bucket, prompt_bucket


def test_greedy_is_argmax():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert sample(logits, SamplingConfig(), jax.random.PRNGKey(0)).tolist() == [1, 0]


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept_k = np.isfinite(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_k=2))))
    assert kept_k.tolist() == [[True, True, False, False]]
    # top_p=0.7: 0.5 alone is below 0.7, 0.5+0.3 reaches it -> keep the first two.
    kept_p = np.isfinite(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_p=0.7))))
    assert kept_p.tolist() == [[True, True, False, False]]
    probs = np.exp(np.asarray(filtered_logprobs(logits, SamplingConfig(temperature=1.0, top_p=0.7))))
    np.testing.assert_allclose(probs[0, :2], [0.5 / 0.8, 0.3 / 0.8], rtol=1e-5)


def test_sampled_frequencies_follow_the_distribution():
    logits = jnp.log(jnp.array([[0.6, 0.3, 0.1]]))
    keys = jax.random.split(jax.random.PRNGKey(1), 20000)
    draws = jax.vmap(lambda k: sample(logits, SamplingConfig(temperature=1.0), k)[0])(keys)
    freq = np.bincount(np.asarray(draws), minlength=3) / 20000
    np.testing.assert_allclose(freq, [0.6, 0.3, 0.1], atol=0.015)


def test_bad_sampling_values():
    for bad in (-1.0, 100.5, float("inf"), float("nan")):  # one rule, the request's and the recipe's alike
        with pytest.raises(ConfigError, match=r"sampling.temperature must be a number in \[0, 100\] \(0 = greedy\)"):
            SamplingConfig(temperature=bad)
    assert SamplingConfig(temperature=100.0).temperature == 100.0
    with pytest.raises(ConfigError, match="sampling.max_new_tokens must be >= 1"):
        SamplingConfig(max_new_tokens=0)


def test_prefill_buckets_are_powers_of_two_at_least_16():
    assert [bucket(n) for n in (1, 16, 17, 100, 129)] == [16, 16, 32, 128, 256]
    # prompt lengths: powers of two and 1.5x them from 48, multiples of 16 (a page): padding of a third at most
    assert [prompt_bucket(n) for n in (1, 16, 17, 33, 48, 49, 65, 100, 129, 193, 257, 385)] == \
        [16, 16, 32, 48, 48, 64, 96, 128, 192, 256, 384, 512]
    assert all(prompt_bucket(n) % 16 == 0 and n <= prompt_bucket(n) <= max(32, 1.5 * n) for n in range(1, 5000))


def test_rows_apply_each_sequences_own_rule():
    """One batch, four rules: each row's filtered distribution equals that rule applied alone."""
    from dflash.serve.sampling import SamplingRows, row_logprobs

    logits = jax.random.normal(jax.random.PRNGKey(3), (4, 3, 50)) * 3.0
    rules = [SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.3, top_k=5),
             SamplingConfig(temperature=1.0, top_p=0.6), SamplingConfig(temperature=0.5, top_k=9, top_p=0.8)]
    rows = np.asarray(row_logprobs(logits, SamplingRows.of(rules)))
    for i, rule in enumerate(rules):
        alone = np.asarray(filtered_logprobs(logits[i], rule))
        np.testing.assert_array_equal(np.isfinite(rows[i]), np.isfinite(alone))
        np.testing.assert_allclose(rows[i][np.isfinite(alone)], alone[np.isfinite(alone)], rtol=1e-6, atol=1e-6)
    kept = np.isfinite(rows).sum(-1)
    assert (kept[0] == 50).all() and (kept[1] == 5).all()  # no filter; top-k 5
    # The two filtered rows keep fewer tokens than plain temperature would, so the filters really ran.
    assert (kept[2] < 50).all() and (kept[3] <= 9).all()


def test_top_k_ties_and_top_k_past_the_vocabulary():
    from dflash.serve.sampling import SamplingRows, row_logprobs

    logits = jnp.array([[1.0, 3.0, 3.0, 0.5], [1.0, 3.0, 2.0, 0.5]])
    rows = SamplingRows.of([SamplingConfig(temperature=1.0, top_k=1), SamplingConfig(temperature=1.0, top_k=10)])
    kept = np.isfinite(np.asarray(row_logprobs(logits, rows)))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, True]]


def test_request_keys_are_jax_keys_of_the_whole_64_bit_seed():
    """Below 2**32 a request's key is `jax.random.PRNGKey(seed)` (sampled outputs of those seeds are unchanged);
    at any seed it is JAX's key of the 64-bit seed (as with jax_enable_x64), so seeds that differ only above bit
    32 get different keys, which PRNGKey without x64 would not give them."""
    seeds = [0, 1, 9, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 9, 2**40 + 7, 2**62 + 12345, 2**63 - 1]
    keys = request_keys(seeds)
    assert keys.shape == (len(seeds), 2) and keys.dtype == np.uint32
    for seed, key in zip(seeds, keys, strict=True):
        if seed < 2**32:
            np.testing.assert_array_equal(key, np.asarray(jax.random.PRNGKey(seed)))
        with jax.enable_x64(True):
            np.testing.assert_array_equal(key, np.asarray(jax.random.PRNGKey(np.int64(seed))))
    assert len({tuple(k) for k in keys.tolist()}) == len(seeds)
    assert request_keys([]).shape == (0, 2)


@pytest.mark.parametrize("vocab", ["full", "draft"])
def test_drafts_drawn_from_q_are_accepted_by_speculative_sampling(vocab):
    """`accept_drafted`: with drafts drawn from q (over the whole vocabulary, or over a draft vocabulary of 4 of
    the 6 ids, so that q is zero elsewhere) the first emitted token has exactly the target's law p (chi-square,
    20,000 draws) and the first draft is accepted with probability sum_v min(p(v), q(v)), which is above the
    one-hot rule's p(argmax q) here. Both branches (accepted, and the residual draw) are exercised."""
    from scipy.stats import chisquare

    from dflash.serve.sampling import SamplingRows
    from dflash.serve.speculative import DraftLaw, accept_drafted, accept_sampled

    n, k = 20000, 3
    p = np.array([[0.30, 0.25, 0.20, 0.15, 0.06, 0.04], [0.1, 0.1, 0.2, 0.2, 0.2, 0.2], [1 / 6] * 6])  # [K, V]
    ids = np.arange(6) if vocab == "full" else np.array([4, 0, 2, 1])  # the draft rows' token ids
    q = np.array([[0.10, 0.40, 0.30, 0.20], [0.25, 0.25, 0.25, 0.25]]) if vocab == "draft" else \
        np.array([[0.05, 0.40, 0.25, 0.10, 0.15, 0.05], [1 / 6] * 6])  # [K-1, V'] over the rows
    keys = jax.random.split(jax.random.PRNGKey(7), n)
    rows = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(jnp.asarray(q)), axis=-1))(
        jax.vmap(lambda key: jax.random.split(key, 4)[3])(keys))  # the draft key of `step_keys`
    drafts = jnp.asarray(ids)[rows]
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, k, 6))
    law = DraftLaw(jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (n, k - 1, len(ids))), rows)
    sampling = SamplingRows.of([SamplingConfig(temperature=1.0)] * n)
    draft_ids = None if vocab == "full" else jnp.asarray(ids)
    accepted, bonus, _ = accept_drafted(logits, drafts, law, draft_ids, sampling, keys)
    accepted, bonus, drafts = np.asarray(accepted), np.asarray(bonus), np.asarray(drafts)
    first = np.where(accepted >= 1, drafts[:, 0], bonus)
    observed = np.bincount(first, minlength=6)
    assert chisquare(observed, p[0] * n).pvalue > 1e-3, observed
    q_full = np.zeros(6)
    q_full[ids] = q[0]
    expect = np.minimum(p[0], q_full).sum()
    rate = np.mean(accepted >= 1)
    assert abs(rate - expect) < 4 * np.sqrt(expect * (1 - expect) / n), (rate, expect)
    one_hot = p[0, ids[np.argmax(q[0])]]
    assert expect > one_hot + 0.05
    assert 0.2 < rate < 0.9  # both branches
    # the one-hot rule on the same drafts (treated as fixed) accepts d_1 with probability p(d_1)
    n1, _, _ = accept_sampled(logits, jnp.asarray(drafts), sampling, keys)
    assert abs(np.mean(np.asarray(n1) >= 1) - p[0][drafts[:, 0]].mean()) < 0.02


def test_teacher_forced_sampled_acceptance_sees_only_the_prefix_and_scores_both_rules():
    """`benchmarks/sampled_acceptance.py`: one call scores every anchor of a row at once. Each anchor's numbers
    equal those of a drafter that sees only the row's prefix up to that anchor (target run on the prefix alone,
    one block): p(argmax q) for argmax drafts and sum_v min(p, q) for sampled ones, p from the full row's target
    logits one position before each slot, both at the temperature given; and `chain_tau` is the expected
    accepted length of independent slots."""
    from benchmarks.sampled_acceptance import chain_tau, slot_accept
    from dflash.models.decoder import embed, forward
    from dflash.models.drafter import BlockVisibility, concat_features
    from dflash.serve.speculative import Models, draft_logits
    from tests.conftest import tiny_engine_models

    target_cfg, target_params, drafter = tiny_engine_models(block_size=4)
    models, k, t = Models.of(target_params, target_cfg, drafter), 4, 0.7
    tokens = jax.random.randint(jax.random.key(3), (1, 16), 0, 200, dtype=jnp.int32)
    onehot, sampled = jax.device_get(slot_accept(models, drafter, tokens, t))
    assert onehot.shape == sampled.shape == (16, k - 1)
    logits, _ = forward(target_params, target_cfg, tokens)
    for a in (0, 5, 11):
        prefix = tokens[:, : a + 1]
        _, feats = forward(target_params, target_cfg, prefix, layer_ids=drafter.arch.layer_ids)
        ids = jnp.concatenate([prefix[:, a:], jnp.full((1, k - 1), drafter.arch.mask_token_id, jnp.int32)], 1)
        hidden = drafter(embed(target_params, ids).astype(jnp.float32), a + jnp.arange(k)[None],
                         concat_features(feats), jnp.arange(a + 1)[None],
                         BlockVisibility.from_anchors(jnp.array([[a]]), jnp.ones((1, a + 1), bool)))
        q = np.asarray(jax.nn.softmax(draft_logits(models, hidden[:, 1:]) / t, -1))[0]
        p = np.asarray(jax.nn.softmax(logits[0, a: a + k - 1] / t, -1))
        np.testing.assert_allclose(onehot[a], p[np.arange(k - 1), q.argmax(-1)], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sampled[a], np.minimum(p, q).sum(-1), rtol=1e-5, atol=1e-6)
        assert np.all(sampled[a] >= onehot[a] - 1e-6) or not np.allclose(q.max(-1), 1.0)
    assert chain_tau([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]) == pytest.approx((4.0 + 1.75) / 2)
