"""The DFlash objective (train/objective.py): anchors, same-position labels, strict mask, decayed loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import batch_of, head, labelled, visible_batch

from dflash.train.objective import (
    Blocks,
    Objective,
    build_blocks,
    build_blocks_batch,
    decay_weights,
    default_gamma,
    dense_loss,
    dpace_weights,
    head_loss,
    sample_anchors,
    sample_anchors_batch,
    valid_anchor_positions,
    visible,
)

MASK = 99


def _example(S: int = 24, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Tokens 10..10+S-1 (distinct, so a shifted label is caught) and a prompt/answer/prompt/answer mask."""
    tokens_S = np.arange(10, 10 + S, dtype=np.int32)
    loss_mask_S = np.zeros(S, np.float32)
    loss_mask_S[5:12] = 1
    loss_mask_S[15:] = 1
    return tokens_S, loss_mask_S


# ----------------------------------------------------------------------------- anchors


def test_valid_anchor_positions():
    mask = np.array([0, 1, 1, 1, 0, 1, 0, 1, 1], np.float32)
    got = np.asarray(valid_anchor_positions(mask))
    # p valid iff mask[p] and mask[p+1]; the last position never (p+1 out of range).
    np.testing.assert_array_equal(got, [0, 1, 1, 0, 0, 0, 0, 1, 0])


def test_anchors_valid_distinct_deterministic():
    _, mask = _example()
    valid = set(np.flatnonzero(np.asarray(valid_anchor_positions(mask))).tolist())
    a1, k1 = sample_anchors(mask, 6, 4, jax.random.key(1))
    a1b, k1b = sample_anchors(mask, 6, 4, jax.random.key(1))
    a2, _ = sample_anchors(mask, 6, 4, jax.random.key(2))
    assert a1.dtype == jnp.int32 and a1.shape == (6,) and k1.shape == (6,)
    assert bool(np.all(k1))
    kept = np.asarray(a1)[np.asarray(k1)].tolist()
    assert set(kept) <= valid and len(set(kept)) == len(kept) == 6
    np.testing.assert_array_equal(a1, a1b)
    np.testing.assert_array_equal(k1, k1b)
    assert not np.array_equal(a1, a2)


def test_anchors_padded_when_few_valid():
    _, mask = _example()
    valid = np.flatnonzero(np.asarray(valid_anchor_positions(mask)))
    n = len(valid) + 5
    anchors, keep = sample_anchors(mask, n, 4, jax.random.key(0))
    anchors, keep = np.asarray(anchors), np.asarray(keep)
    assert keep.sum() == len(valid)
    np.testing.assert_array_equal(np.sort(anchors[keep]), valid)  # every valid position, once
    assert not keep[len(valid):].any()  # padding last
    # More anchors than sequence positions: still static N, padded.
    anchors, keep = sample_anchors(mask[:6], 10, 4, jax.random.key(0))
    assert anchors.shape == (10,) and int(np.sum(keep)) == 0  # mask[:6] has a single 1: nothing valid


def test_anchors_uniform_over_valid():
    _, mask = _example()
    valid = np.flatnonzero(np.asarray(valid_anchor_positions(mask)))
    keys = jax.random.split(jax.random.key(3), 400)
    anchors, keep = jax.vmap(lambda r: sample_anchors(mask, 3, 4, r))(keys)
    counts = np.bincount(np.asarray(anchors)[np.asarray(keep)], minlength=len(mask))[valid]
    expected = 400 * 3 / len(valid)
    assert counts.min() > 0.5 * expected and counts.max() < 1.5 * expected


def test_anchors_batch_rows_independent():
    _, mask = _example()
    masks = np.stack([mask, mask])
    anchors, keep = sample_anchors_batch(masks, 4, 4, jax.random.key(0))
    assert anchors.shape == (2, 4) and keep.shape == (2, 4)
    assert not np.array_equal(anchors[0], anchors[1])


# ----------------------------------------------------------------------------- blocks


def test_blocks_same_position_labels():
    tokens, mask = _example()
    K = 4
    anchors = np.array([6, 16, 10, 21, 0], np.int32)
    keep = np.array([True, True, True, True, False])
    b = build_blocks(batch_of(tokens, mask), anchors, keep, K, MASK)
    S = len(tokens)
    for j, (a, kept) in enumerate(zip(anchors, keep, strict=True)):
        sl = slice(j * K, (j + 1) * K)
        np.testing.assert_array_equal(b.block_index_in_block[sl], np.arange(K))
        np.testing.assert_array_equal(b.block_of_query[sl], j)
        np.testing.assert_array_equal(b.anchor_of_query[sl], a if kept else -1)
        np.testing.assert_array_equal(b.block_pos[sl], a + np.arange(K))
        assert int(b.block_ids[sl][0]) == tokens[a]
        np.testing.assert_array_equal(b.block_ids[sl][1:], MASK)
        assert float(b.label_mask[sl][0]) == 0  # index 0: the anchor itself, unlabelled
        for k in range(1, K):
            p = a + k
            want_mask = kept and p < S and mask[p] == 1
            assert float(b.label_mask[sl][k]) == float(want_mask), (j, k)
            if p < S:
                assert int(b.labels[sl][k]) == tokens[p]  # same position ...
                assert int(b.labels[sl][k]) != (tokens[p + 1] if p + 1 < S else -1)  # ... not the +1 shift
    # Block at 10 runs into non-assistant tokens 12..14: 11 labelled, 12 and 13 masked.
    np.testing.assert_array_equal(b.label_mask[2 * K:3 * K], [0, 1, 0, 0])
    # Block at 21 runs past the end (S = 24): 22, 23 labelled, 24 masked with label 0.
    np.testing.assert_array_equal(b.label_mask[3 * K:4 * K], [0, 1, 1, 0])
    assert int(b.labels[4 * K - 1]) == 0
    # Padding block counts nothing.
    np.testing.assert_array_equal(b.label_mask[4 * K:], 0)


def test_target_labels_follow_the_target_while_the_text_agrees():
    """data.labels=target: slot k is labelled with the target's own pick at a+k (next_ids[a+k-1]) and only while
    every earlier slot's text equals the target's pick; where they always agree the labels are the text's."""
    tokens, mask = _example()
    K = 4
    anchors = np.array([6, 16, 10, 21, 0], np.int32)
    keep = np.array([True, True, True, True, False])
    agreeing = np.concatenate([tokens[1:], [-1]]).astype(np.int32)  # the target picks the text everywhere
    plain = build_blocks(batch_of(tokens, mask), anchors, keep, K, MASK)
    same = build_blocks(batch_of(tokens, mask, agreeing), anchors, keep, K, MASK)
    for got, want in zip(jax.tree.leaves(same), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)

    # The target disagrees with the text at position 18 (it would emit 999 there): the block at 16 keeps
    # slot 1 (17, text agreed before it trivially) and slot 2 (18, now labelled 999), but not slot 3: the
    # text at 18 is not the target's, so what the target emits at 19 is unknown.
    picks = agreeing.copy()
    picks[17] = 999
    b = build_blocks(batch_of(tokens, mask, picks), anchors, keep, K, MASK)
    sl = slice(1 * K, 2 * K)
    np.testing.assert_array_equal(b.labels[sl][:3], [0, tokens[17], 999])
    np.testing.assert_array_equal(b.label_mask[sl], [0, 1, 1, 0])
    np.testing.assert_array_equal(b.block_ids[sl], plain.block_ids[sl])  # inputs stay the text's
    # Unknown picks (-1) are never labels; the other blocks are untouched.
    picks[6] = -1
    b = build_blocks(batch_of(tokens, mask, picks), anchors, keep, K, MASK)
    np.testing.assert_array_equal(b.label_mask[:K], [0, 0, 0, 0])
    np.testing.assert_array_equal(b.label_mask[2 * K:], plain.label_mask[2 * K:])
    bb = build_blocks_batch(batch_of(np.stack([tokens] * 2), np.stack([mask] * 2), np.stack([picks, agreeing])),
                            np.stack([anchors] * 2), np.stack([keep] * 2), K, MASK)
    np.testing.assert_array_equal(bb.label_mask[0], b.label_mask)
    np.testing.assert_array_equal(bb.label_mask[1], plain.label_mask)


def test_blocks_batch_matches_rows():
    tokens, mask = _example()
    anchors, keep = sample_anchors_batch(np.stack([mask, mask]), 5, 4, jax.random.key(0))
    bb = build_blocks_batch(batch_of(np.stack([tokens, tokens]), np.stack([mask, mask])), anchors, keep, 4, MASK)
    assert isinstance(bb, Blocks) and bb.labels.shape == (2, 20)
    for r in range(2):
        row = build_blocks(batch_of(tokens, mask), anchors[r], keep[r], 4, MASK)
        for got, want in zip(jax.tree.leaves(bb), jax.tree.leaves(row), strict=True):
            np.testing.assert_array_equal(got[r], want)


# ----------------------------------------------------------------------------- mask


def test_visible_contract():
    S, K = 12, 3
    tokens = np.arange(S, dtype=np.int32)
    mask = np.ones(S, np.float32)
    anchors = np.array([4, 7, 0], np.int32)
    keep = np.array([True, True, False])
    b = build_blocks(batch_of(tokens, mask), anchors, keep, K, MASK)
    ctx_valid = np.ones(S, bool)
    ctx_valid[1] = False  # e.g. a padding token in the context
    vis = np.asarray(visible(b.anchor_of_query, b.block_of_query, ctx_valid, b.block_of_query))
    Q = 3 * K
    assert vis.shape == (Q, S + Q) and vis.dtype == bool
    for q in range(Q):
        j, a = q // K, int(b.anchor_of_query[q])
        if not keep[j]:
            assert not vis[q].any()  # padding queries see nothing
            continue
        for s in range(S):
            assert vis[q, s] == (s < a and ctx_valid[s]), (q, s)
        assert not vis[q, a]  # the anchor's own context feature is NOT visible (the `<= anchor` bug)
        for q2 in range(Q):
            assert vis[q, S + q2] == (q2 // K == j), (q, q2)  # own block, both directions; no other block
    # Padding block keys are never seen by kept queries either.
    assert not vis[:2 * K, S + 2 * K:].any()


def test_visible_batch():
    tokens, mask = _example()
    anchors, keep = sample_anchors_batch(np.stack([mask, mask]), 3, 4, jax.random.key(0))
    bb = build_blocks_batch(batch_of(np.stack([tokens, tokens]), np.stack([mask, mask])), anchors, keep, 4, MASK)
    ctx = np.ones((2, len(tokens)), bool)
    vis = visible_batch(bb.anchor_of_query, bb.block_of_query, ctx, bb.block_of_query)
    assert vis.shape == (2, 12, len(tokens) + 12)
    np.testing.assert_array_equal(vis[1], visible(bb.anchor_of_query[1], bb.block_of_query[1], ctx[1],
                                                  bb.block_of_query[1]))


# ----------------------------------------------------------------------------- weights and loss


def test_decay_weights_k16():
    w = np.asarray(decay_weights(16, 7.0))
    want = np.array([0.0] + [np.exp(-(k - 1) / 7.0) for k in range(1, 16)])
    np.testing.assert_allclose(w, want, rtol=1e-6, atol=0)
    assert w[1] == 1.0


def test_default_gamma():
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)
    assert default_gamma(4) == 2 and default_gamma(2) == 1
    with pytest.raises(ValueError, match="block_size"):
        default_gamma(1)


def _numpy_loss(logits, labels, mask, k_index, K, gamma):
    num = den = 0.0
    for b in range(logits.shape[0]):
        for q in range(logits.shape[1]):
            k = k_index[b, q]
            w = 0.0 if k == 0 else np.exp(-(k - 1) / gamma)
            x = logits[b, q].astype(np.float64)
            logz = np.log(np.sum(np.exp(x - x.max()))) + x.max()
            num += w * mask[b, q] * (logz - x[labels[b, q]])
            den += w * mask[b, q]
    return num / den


def test_loss_matches_numpy():
    B, N, K, V, gamma = 2, 2, 3, 7, 2.0
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B, N * K, V)).astype(np.float32) * 3
    labels = rng.integers(0, V, size=(B, N * K)).astype(np.int32)
    k_index = np.tile(np.arange(K), (B, N))
    mask = (k_index >= 1).astype(np.float32)
    mask[1, 4] = 0
    loss, _ = dense_loss(logits, labels, mask, k_index, K, gamma)
    np.testing.assert_allclose(float(loss), _numpy_loss(logits, labels, mask, k_index, K, gamma), rtol=1e-5)
    # bf16 logits are upcast: same loss as their fp32 values.
    lb = jnp.asarray(logits, jnp.bfloat16)
    loss_b, _ = dense_loss(lb, labels, mask, k_index, K, gamma)
    np.testing.assert_allclose(float(loss_b), _numpy_loss(np.asarray(lb, np.float32), labels, mask, k_index, K, gamma),
                               rtol=1e-5)


def test_loss_ignores_masked_and_padding():
    B, N, K, V = 1, 2, 4, 5
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(B, N * K, V)), jnp.float32)
    labels = np.ones((B, N * K), np.int32)
    k_index = np.tile(np.arange(K), (B, N))
    mask = np.zeros((B, N * K), np.float32)
    mask[0, 1:3] = 1  # block 0: slots 1, 2; block 1 is padding
    grad = jax.grad(lambda x: dense_loss(x, labels, mask, k_index, K, 7.0)[0])(logits)
    nonzero = np.abs(np.asarray(grad)).sum(-1)[0] > 0
    np.testing.assert_array_equal(nonzero, mask[0] > 0)
    _, m = dense_loss(logits, labels, mask, k_index, K, 7.0)
    assert float(m["num_blocks"]) == 1 and float(m["num_labels"]) == 2


def _one_hot_logits(labels, V):
    return jax.nn.one_hot(labels, V, dtype=jnp.float32) * 20.0


def test_perfect_logits_accept_k():
    K, N, V = 16, 3, 32
    labels = np.tile(np.arange(K), (1, N)).astype(np.int32) + 1
    k_index = np.tile(np.arange(K), (1, N))
    mask = (k_index >= 1).astype(np.float32)
    loss, m = dense_loss(_one_hot_logits(labels, V), labels, mask, k_index, K, default_gamma(K))
    assert float(loss) < 1e-6
    np.testing.assert_array_equal(m["accuracy_per_position"][1:], 1.0)
    assert float(m["accuracy_per_position"][0]) == 0.0
    assert float(m["acceptance_length"]) == K


def test_wrong_position_two_accepts_two():
    K, V = 8, 16
    labels = np.arange(K, dtype=np.int32)[None] + 1
    k_index = np.arange(K)[None]
    mask = (k_index >= 1).astype(np.float32)
    predicted = labels.copy()
    predicted[0, 2] = 0  # slot 2 wrong, later slots right: the chain stops at 2
    _, m = dense_loss(_one_hot_logits(predicted, V), labels, mask, k_index, K, 4.0)
    assert float(m["acceptance_length"]) == 2.0
    acc = np.asarray(m["accuracy_per_position"])
    assert acc[2] == 0.0 and acc[1] == 1.0 and np.all(acc[3:] == 1.0)


def test_masked_slot_stops_chain():
    K, V = 6, 16
    labels = np.arange(K, dtype=np.int32)[None] + 1
    k_index = np.arange(K)[None]
    mask = np.array([[0, 1, 1, 0, 0, 0]], np.float32)  # block cut by the end of the sequence
    _, m = dense_loss(_one_hot_logits(labels, V), labels, mask, k_index, K, 3.0)
    assert float(m["acceptance_length"]) == 3.0


# ----------------------------------------------------------------------------- jit end to end


def test_pipeline_under_jit_matches_eager():
    N, K, V = 5, 4, 128
    tokens, mask = _example()
    tokens_BxS = np.stack([tokens, tokens[::-1].copy()])
    mask_BxS = np.stack([mask, mask])
    logits_fn = lambda ids_BxQ: jax.nn.one_hot((ids_BxQ * 7) % V, V) * 3.0

    def step(tokens_BxS, mask_BxS, rng, *, N, K):
        anchors, keep = sample_anchors_batch(mask_BxS, N, K, rng)
        b = build_blocks_batch(batch_of(tokens_BxS, mask_BxS), anchors, keep, K, MASK)
        vis = visible_batch(b.anchor_of_query, b.block_of_query, mask_BxS >= 0, b.block_of_query)
        loss, metrics = dense_loss(logits_fn(b.labels), b.labels, b.label_mask, b.block_index_in_block, K,
                                    default_gamma(K))
        return loss, metrics, vis, b

    jitted = jax.jit(functools.partial(step, N=N, K=K))
    eager = step(tokens_BxS, mask_BxS, jax.random.key(0), N=N, K=K)
    got = jitted(tokens_BxS, mask_BxS, jax.random.key(0))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(eager), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6)
    assert got[2].shape == (2, N * K, len(tokens) + N * K)
    assert isinstance(got[3], Blocks)


# ----------------------------------------------------------------------------- chunked head + D-PACE


def _head_case(vocab_major: bool, seed: int = 0):
    B_, N_, K_, D_, V_ = 2, 3, 4, 16, 50
    r = np.random.default_rng(seed)
    h = jnp.asarray(r.normal(size=(B_, N_ * K_, D_)), jnp.float32)
    w_VxD = jnp.asarray(r.normal(size=(V_, D_)), jnp.float32)
    labels = jnp.asarray(r.integers(0, V_, (B_, N_ * K_)), jnp.int32)
    mask = jnp.asarray(r.integers(0, 2, (B_, N_ * K_)), jnp.float32).at[:, ::K_].set(0.0)
    k_index = jnp.broadcast_to(jnp.arange(N_ * K_) % K_, (B_, N_ * K_))
    return h, (w_VxD if vocab_major else w_VxD.T), w_VxD, labels, mask, k_index, K_


@pytest.mark.parametrize("vocab_major", [True, False])
@pytest.mark.parametrize("chunk", [1, 5, 0])
def test_head_loss_equals_dense_loss_value_grad_and_metrics(vocab_major: bool, chunk: int):
    """The chunked head + CE (slot 0 skipped, gradient formed in the forward) is the dense reference
    `dense_loss(h @ W, ...)`: loss, d loss / d h and every metric, whatever the chunk (5 does not divide
    the 18 rows: padding)."""
    h, w, w_VxD, labels, mask, k_index, K_ = _head_case(vocab_major)
    gamma = 3.0

    def dense(x):
        return dense_loss(jnp.einsum("bqd,vd->bqv", x, w_VxD), labels, mask, k_index, K_, gamma)

    def chunked(x):
        return head_loss(x, head(w, vocab_major), labelled(labels, mask), K_,
                         Objective(gamma=gamma, head_chunk=chunk))

    (l0, m0), g0 = jax.value_and_grad(dense, has_aux=True)(h)
    (l1, m1), g1 = jax.jit(jax.value_and_grad(chunked, has_aux=True))(h)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), atol=1e-6)
    assert float(jnp.abs(g0).max()) > 1e-3  # the comparison is not between zeros
    for name in m0:
        np.testing.assert_allclose(np.asarray(m1[name]), np.asarray(m0[name]), rtol=1e-6, err_msg=name)


def _numpy_dpace(nll, mask, alpha):
    """D-PACE weights by the definition, loop by loop: w_k = sum_{j>=k, labelled} prod_{i<=j} q~_i."""
    q = np.where(mask > 0, (1 - alpha) * np.exp(-nll) + alpha, 1.0)
    w = np.zeros_like(nll)
    for idx in np.ndindex(*nll.shape[:-1]):
        for k in range(nll.shape[-1]):
            if mask[idx][k] > 0:
                w[idx][k] = sum(np.prod(q[idx][: j + 1]) for j in range(k, nll.shape[-1]) if mask[idx][j] > 0)
    return w


def test_dpace_weights_match_definition_and_limits():
    r = np.random.default_rng(1)
    nll = r.exponential(1.0, (2, 3, 5)).astype(np.float32)
    mask = r.integers(0, 2, (2, 3, 5)).astype(np.float32)
    got = np.asarray(dpace_weights(jnp.asarray(nll), jnp.asarray(mask), 0.5))
    np.testing.assert_allclose(got, _numpy_dpace(nll, mask, 0.5), rtol=1e-5)
    assert np.all(got[mask == 0] == 0)
    # A perfectly confident drafter: weights fall linearly K-1 .. 1 over a fully labelled block.
    ones = np.ones((1, 1, 5), np.float32)
    np.testing.assert_allclose(np.asarray(dpace_weights(jnp.zeros((1, 1, 5)), jnp.asarray(ones), 0.5))[0, 0],
                               [5, 4, 3, 2, 1], rtol=1e-6)
    # alpha = 1 ignores confidence entirely (same linear ramp whatever the nll).
    np.testing.assert_allclose(np.asarray(dpace_weights(jnp.asarray(nll[:1, :1]), jnp.asarray(ones), 1.0))[0, 0],
                               [5, 4, 3, 2, 1], rtol=1e-6)


def test_dpace_loss_is_weighted_ce_with_no_gradient_through_weights():
    """loss = sum w CE / sum w with w = dpace_weights(stop_gradient(CE)): the gradient is the weighted CE's."""
    h, _, w_VxD, labels, mask, k_index, K_ = _head_case(True, seed=3)
    obj = Objective(kind="dpace", dpace_alpha=0.4)
    B_, Q_, _ = h.shape

    def reference(x):
        logp = jax.nn.log_softmax(jnp.einsum("bqd,vd->bqv", x, w_VxD), axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0].reshape(B_, Q_ // K_, K_)[..., 1:]
        m = mask.reshape(B_, Q_ // K_, K_)[..., 1:]
        w = dpace_weights(jax.lax.stop_gradient(nll), m, 0.4)
        return jnp.sum(w * nll) / jnp.sum(w)

    l_ref, g_ref = jax.value_and_grad(reference)(h)
    (l_new, _), g_new = jax.value_and_grad(lambda x: head_loss(x, head(w_VxD), labelled(labels, mask), K_, obj),
                                           has_aux=True)(h)
    np.testing.assert_allclose(float(l_new), float(l_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_new), np.asarray(g_ref), atol=1e-6)


def test_objective_rejects_bad_settings():
    for bad in ({"kind": "focal"}, {"gamma": 0.0}, {"dpace_alpha": 0.0}, {"dpace_alpha": 1.5}, {"head_chunk": -1}):
        with pytest.raises(ValueError):
            Objective(**bad)


def test_head_loss_over_a_vocabulary_subset_is_the_subset_softmax():
    """label_map: the softmax runs over the subset's rows only and labels outside it leave the loss."""
    h, _, w_VxD, labels, mask, k_index, K_ = _head_case(True, seed=5)
    ids = np.arange(0, 50, 2)  # even tokens only
    label_map = np.full(50, -1, np.int32)
    label_map[ids] = np.arange(ids.size)
    sub_labels = np.where(label_map[np.asarray(labels)] >= 0, label_map[np.asarray(labels)], 0)
    sub_mask = np.asarray(mask) * (label_map[np.asarray(labels)] >= 0)
    assert 0 < sub_mask.sum() < np.asarray(mask).sum()  # some labels are outside, some inside

    def dense(x):
        return dense_loss(jnp.einsum("bqd,vd->bqv", x, w_VxD[ids]), sub_labels, sub_mask, k_index, K_, 2.0)

    def subset(x):
        return head_loss(x, head(w_VxD[ids], label_map=label_map), labelled(labels, mask), K_, Objective(gamma=2.0))

    (l0, m0), g0 = jax.value_and_grad(dense, has_aux=True)(h)
    (l1, m1), g1 = jax.value_and_grad(subset, has_aux=True)(h)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), atol=1e-6)
    np.testing.assert_allclose(float(m1["num_labels"]), float(m0["num_labels"]))


# ----------------------------------------------------------------------------- soft labels (data.labels: soft)


def test_soft_labels_ride_with_the_slot_they_label():
    """Slot k of the block at anchor a carries the top-T distribution stored at a+k-1 (the one its hard label
    is the argmax of), and zeros wherever it is not labelled; the rest of the blocks is unchanged."""
    tokens, mask = _example()
    K, T = 4, 3
    S = tokens.shape[0]
    anchors = np.array([6, 16, 10, 21, 0], np.int32)
    keep = np.array([True, True, True, True, False])
    picks = np.concatenate([tokens[1:], [-1]]).astype(np.int32)
    ids = np.arange(S * T, dtype=np.int32).reshape(S, T) + 1000  # distinct per position
    probs = np.linspace(0.1, 0.9, S * T, dtype=np.float32).reshape(S, T)
    hard = build_blocks(batch_of(tokens, mask, picks), anchors, keep, K, MASK)
    soft = build_blocks(batch_of(tokens, mask, picks, soft=(ids, probs)), anchors, keep, K, MASK)
    for name in ("block_ids", "block_pos", "labels", "label_mask", "anchor_of_query"):
        np.testing.assert_array_equal(getattr(soft, name), getattr(hard, name))
    assert hard.soft_ids is None and soft.soft_ids.shape == soft.soft_probs.shape == (5 * K, T)
    for q in range(5 * K):
        if soft.label_mask[q] > 0:
            p = int(soft.block_pos[q])
            np.testing.assert_array_equal(soft.soft_ids[q], ids[p - 1])
            np.testing.assert_allclose(soft.soft_probs[q], probs[p - 1])
        else:
            assert not np.any(soft.soft_ids[q]) and not np.any(soft.soft_probs[q])
    batched = build_blocks_batch(batch_of(np.stack([tokens] * 2), np.stack([mask] * 2), np.stack([picks] * 2),
                                          soft=(np.stack([ids] * 2), np.stack([probs] * 2))),
                                 np.stack([anchors] * 2), np.stack([keep] * 2), K, MASK)
    np.testing.assert_array_equal(batched.soft_ids[1], soft.soft_ids)


def _soft_case(seed: int, V_: int = 50, T: int = 5):
    h, _, w_VxD, labels, mask, k_index, K_ = _head_case(True, seed=seed)
    r = np.random.default_rng(seed + 100)
    B_, Q_ = labels.shape
    ids = np.stack([[r.permutation(V_)[:T] for _ in range(Q_)] for _ in range(B_)]).astype(np.int32)
    probs = r.dirichlet(np.ones(T), (B_, Q_)).astype(np.float32) * 0.9  # a top-T cut: mass below 1
    return h, w_VxD, labels, mask, K_, ids, probs


@pytest.mark.parametrize("kind", ["decay", "dpace"])
@pytest.mark.parametrize("chunk", [1, 7, 0])
def test_soft_head_loss_is_the_cross_entropy_against_the_renormalised_top_k(kind: str, chunk: int):
    """loss = sum_q w_q m_q CE_q / sum w m with CE_q = -sum_t q_qt log softmax(h_q W)[id_qt], q the stored
    top-T renormalised to 1; its value and d loss / d h equal the dense fp32 reference, and the weights and
    metrics read the hard labels (D-PACE's confidence is the drafter's probability of the label)."""
    h, w_VxD, labels, mask, K_, ids, probs = _soft_case(seed=11)
    B_, Q_, _ = h.shape
    obj = Objective(kind=kind, gamma=2.0, head_chunk=chunk)

    def reference(x):
        logp = jax.nn.log_softmax(jnp.einsum("bqd,vd->bqv", x, w_VxD), axis=-1)
        q = probs / probs.sum(-1, keepdims=True)
        ce = -jnp.sum(q * jnp.take_along_axis(logp, ids, axis=-1), axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        split = lambda a: a.reshape(B_, Q_ // K_, K_)[..., 1:]  # noqa: E731
        if kind == "dpace":
            w = dpace_weights(jax.lax.stop_gradient(split(nll)), split(mask), 0.5)
        else:
            w = split(decay_weights(K_, 2.0)[jnp.arange(Q_) % K_][None] * mask)
        return jnp.sum(w * split(ce)) / jnp.sum(w)

    l_ref, g_ref = jax.value_and_grad(reference)(h)
    hard = lambda x: head_loss(x, head(w_VxD), labelled(labels, mask), K_, obj)  # noqa: E731
    soft = lambda x: head_loss(x, head(w_VxD), labelled(labels, mask, (ids, probs)), K_, obj)  # noqa: E731
    (l_soft, m_soft), g_soft = jax.jit(jax.value_and_grad(soft, has_aux=True))(h)
    np.testing.assert_allclose(float(l_soft), float(l_ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_soft), np.asarray(g_ref), atol=1e-6)
    assert float(jnp.abs(g_ref).max()) > 1e-3
    (l_hard, m_hard), _ = jax.value_and_grad(hard, has_aux=True)(h)
    assert abs(float(l_hard) - float(l_soft)) > 1e-3  # the soft targets change the loss ...
    for name in m_hard:  # ... but not what the metrics measure
        np.testing.assert_allclose(np.asarray(m_soft[name]), np.asarray(m_hard[name]), rtol=1e-6, err_msg=name)


def test_soft_head_loss_with_one_hot_targets_is_the_hard_loss():
    h, w_VxD, labels, mask, K_, ids, _ = _soft_case(seed=12)
    ids = np.asarray(ids).copy()
    ids[..., 0] = np.asarray(labels)
    one_hot = np.zeros(ids.shape, np.float32)
    one_hot[..., 0] = 0.7  # any mass: renormalised to 1
    obj = Objective(kind="dpace")
    hard = lambda x: head_loss(x, head(w_VxD), labelled(labels, mask), K_, obj)[0]  # noqa: E731
    soft = lambda x: head_loss(x, head(w_VxD), labelled(labels, mask, (ids, one_hot)), K_, obj)[0]  # noqa: E731
    np.testing.assert_allclose(float(soft(h)), float(hard(h)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(soft)(h)), np.asarray(jax.grad(hard)(h)), atol=1e-6)


def test_soft_head_loss_over_a_vocabulary_subset_drops_and_renormalises():
    """With a training vocabulary, top-T tokens outside it leave the distribution, which is renormalised over
    the rest; a slot none of whose tokens the head holds leaves the loss."""
    h, w_VxD, labels, mask, K_, ids, probs = _soft_case(seed=13)
    keep_ids = np.arange(0, 50, 2)
    label_map = np.full(50, -1, np.int32)
    label_map[keep_ids] = np.arange(keep_ids.size)
    mapped = label_map[ids]
    q = np.where(mapped >= 0, probs, 0.0)
    m = np.asarray(mask) * (q.sum(-1) > 0) * (label_map[np.asarray(labels)] >= 0)
    q = q / np.maximum(q.sum(-1, keepdims=True), 1e-20)
    B_, Q_, _ = h.shape
    obj = Objective(gamma=2.0)

    def reference(x):
        logp = jax.nn.log_softmax(jnp.einsum("bqd,vd->bqv", x, w_VxD[keep_ids]), axis=-1)
        ce = -jnp.sum(q * jnp.take_along_axis(logp, np.maximum(mapped, 0), axis=-1), axis=-1)
        w = (decay_weights(K_, 2.0)[jnp.arange(Q_) % K_][None] * m).reshape(B_, Q_ // K_, K_)[..., 1:]
        return jnp.sum(w * ce.reshape(B_, Q_ // K_, K_)[..., 1:]) / jnp.sum(w)

    def subset(x):
        return head_loss(x, head(w_VxD[keep_ids], label_map=label_map), labelled(labels, mask, (ids, probs)), K_,
                         obj)[0]

    np.testing.assert_allclose(float(subset(h)), float(reference(h)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(subset)(h)), np.asarray(jax.grad(reference)(h)), atol=1e-6)
