"""The distribution losses of `train.loss` (train/objective.py `head_divergences`, `head_loss` terms tv, kl,
rkl, opd and mixes) against loop-by-loop fp32 references: plain Python loops over rows and the vocabulary, values
and gradients (by central differences of the loop reference), masked slots, tokens outside the head's
vocabulary and the target's mass beyond its stored top-k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import head, labelled

from dflash.train.config import TrainConfig, parse_loss
from dflash.train.objective import (
    RKL_FLOOR,
    Objective,
    decay_weights,
    head_divergences,
    head_loss,
)

B, N, K, D, V, T = 2, 2, 4, 8, 12, 3


def _case(seed: int = 0):
    """Hidden states, a head, hard labels, a label mask with masked slots, and a stored top-T per slot whose mass
    is below 1 (a tail beyond the stored tokens); slot 0 of every block unlabelled."""
    r = np.random.default_rng(seed)
    Q = N * K
    h = r.normal(size=(B, Q, D)).astype(np.float32)
    w = (r.normal(size=(V, D)) * 0.8).astype(np.float32)
    ids = np.stack([[r.permutation(V)[:T] for _ in range(Q)] for _ in range(B)]).astype(np.int32)
    probs = (r.dirichlet(np.ones(T), (B, Q)) * r.uniform(0.6, 0.99, (B, Q, 1))).astype(np.float32)
    order = np.argsort(-probs, axis=-1)  # stored most likely first, the label their argmax
    ids, probs = np.take_along_axis(ids, order, -1), np.take_along_axis(probs, order, -1)
    labels = ids[..., 0].copy()
    mask = np.ones((B, Q), np.float32)
    mask[:, ::K] = 0
    mask[0, 2] = 0  # a masked slot mid-block
    ids[mask == 0] = 0
    probs[mask == 0] = 0
    return h, w, labels, mask, ids, probs


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _divergence_loop(z, ids, probs, name):
    """One row's divergence by the definition, loop over the vocabulary (float64): the target's distribution is
    its stored probabilities on the stored tokens of the head (an id < 0 or a 0 probability is not one) and
    the rest of its mass on one outcome 'other', the drafter's on the others too."""
    p = _softmax(z.astype(np.float64))
    stored = {int(i): float(t) for i, t in zip(ids, probs, strict=True) if i >= 0 and t > 0}
    r = max(1.0 - sum(stored.values()), 0.0)
    p_other = sum(p[j] for j in range(len(p)) if j not in stored)
    if name == "ce":
        mass = sum(stored.values())
        return -sum(t / mass * np.log(p[i]) for i, t in stored.items()) if mass > 0 else 0.0
    if name == "tv":
        return 0.5 * (sum(abs(p[i] - t) for i, t in stored.items()) + abs(p_other - r))
    if name == "kl":
        return sum(t * np.log(t / p[i]) for i, t in stored.items()) + (r * np.log(r / p_other) if r > 0 else 0.0)
    if name == "rkl":
        return sum(p[i] * np.log(p[i] / t) for i, t in stored.items()) + p_other * np.log(p_other / max(r, RKL_FLOOR))
    raise AssertionError(name)


def _loop_loss(h, w, labels, mask, ids, probs, terms, kind="decay", gamma=2.0, opd_gamma=0.5, label_map=None,
               fixed=None):
    """`head_loss` by loops: per block, per labelled slot: weight (decay or D-PACE from the hard label's
    probability), the OPD split by the chain of top-1 hits, the weighted terms; float64. The D-PACE weights and
    the OPD split read `fixed` (default h): neither carries gradient."""
    fixed = h if fixed is None else fixed
    Bq, Q, _ = h.shape
    rows_w = w if label_map is None else w[np.flatnonzero(label_map >= 0)]
    total, count = 0.0, 0.0
    for b in range(Bq):
        for j in range(Q // K):
            slots = []
            for k in range(1, K):
                q = j * K + k
                z = rows_w.astype(np.float64) @ h[b, q].astype(np.float64)
                z_fixed = rows_w.astype(np.float64) @ fixed[b, q].astype(np.float64)
                lab = labels[b, q] if label_map is None else label_map[labels[b, q]]
                sid = ids[b, q] if label_map is None else np.where(label_map[ids[b, q]] >= 0, label_map[ids[b, q]], -1)
                on = mask[b, q] > 0 and lab >= 0 and any(sid[t] >= 0 and probs[b, q, t] > 0 for t in range(T))
                slots.append((k, z, int(lab), sid, on, z_fixed))
            hits = [on and int(np.argmax(zf)) == lab for k, z, lab, sid, on, zf in slots]
            nll = np.array([-np.log(_softmax(zf)[max(lab, 0)]) for _, _, lab, _, _, zf in slots])
            m = np.array([float(s[4]) for s in slots])
            if kind == "dpace":  # w_k = sum_{j >= k, labelled} prod_{i <= j} ((1 - a) q_i + a), a = 0.5
                q = np.where(m > 0, 0.5 * np.exp(-nll) + 0.5, 1.0)
                wk = np.array([m[k] * sum(np.prod(q[: j + 1]) for j in range(k, K - 1) if m[j] > 0)
                               for k in range(K - 1)])
            else:
                wk = np.asarray(decay_weights(K, gamma))[1:] * m
            chain, first_miss = True, None
            for i, (k, z, _lab, sid, on, _) in enumerate(slots):
                chain = chain and hits[i]
                if not chain and first_miss is None:
                    first_miss = i
                if not on:
                    continue
                value = 0.0
                for name, lam in terms:
                    if name == "opd":
                        d = _divergence_loop(z, sid, probs[b, j * K + k], "kl" if chain else "rkl")
                        value += lam * (d if chain else opd_gamma ** (i - first_miss) * d)
                    else:
                        value += lam * _divergence_loop(z, sid, probs[b, j * K + k], name)
                total += wk[i] * value
                count += wk[i]
    return total / count


def _numeric_grad(f, x, eps=1e-3):
    """d f / d x by central differences, one element at a time (float64)."""
    g = np.zeros_like(x, dtype=np.float64)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.astype(np.float64).copy(), x.astype(np.float64).copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("terms", [(("tv", 1.0),), (("kl", 1.0),), (("rkl", 1.0),), (("opd", 1.0),),
                                   (("ce", 0.1), ("tv", 0.9))])
def test_each_loss_is_its_loop_reference_value_and_gradient(terms):
    """head_loss (chunked, custom gradient, 3 rows per chunk so chunks split blocks) equals the loop reference in
    value and in d loss / d h; the frozen head gets no gradient."""
    h, w, labels, mask, ids, probs = _case(seed=1)
    obj = Objective(gamma=2.0, head_chunk=3, terms=terms, opd_gamma=0.5)
    blocks = labelled(labels, mask, (ids, probs))
    fn = jax.jit(lambda x, m: head_loss(x, head(m), blocks, K, obj)[0])
    value, (g_h, g_w) = jax.value_and_grad(fn, argnums=(0, 1))(jnp.asarray(h), jnp.asarray(w))
    want = _loop_loss(h, w, labels, mask, ids, probs, terms)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    num = _numeric_grad(lambda x: _loop_loss(x, w, labels, mask, ids, probs, terms, fixed=h), h)
    np.testing.assert_allclose(np.asarray(g_h), num, atol=2e-5)
    assert np.abs(num).max() > 1e-2  # not a comparison between zeros
    assert not np.asarray(g_h)[mask == 0].any()  # masked slots (and every anchor slot) get no gradient
    assert not np.asarray(g_w).any()  # the target's head is frozen


@pytest.mark.slow  # ~10 s: 128 central differences of the loop reference; the fast test above covers each term
def test_dpace_weighting_and_a_vocabulary_subset_apply_to_the_distribution_losses():
    """D-PACE weights from the hard label on top of a mix, over a training vocabulary: stored tokens outside it
    join the target's 'other' mass, a label outside it leaves the slot out."""
    h, w, labels, mask, ids, probs = _case(seed=2)
    label_map = np.full(V, -1, np.int32)
    keep = np.array([0, 1, 2, 4, 5, 7, 8, 9, 11])  # 3, 6 and 10 are outside
    label_map[keep] = np.arange(keep.size)
    terms = (("ce", 0.5), ("tv", 1.0), ("rkl", 0.25))
    obj = Objective(kind="dpace", head_chunk=0, terms=terms)
    blocks = labelled(labels, mask, (ids, probs))
    fn = lambda x: head_loss(x, head(w[keep], label_map=label_map), blocks, K, obj)[0]  # noqa: E731
    value, g_h = jax.value_and_grad(fn)(jnp.asarray(h))
    want = _loop_loss(h, w, labels, mask, ids, probs, terms, kind="dpace", label_map=label_map)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    num = _numeric_grad(lambda x: _loop_loss(x, w, labels, mask, ids, probs, terms, kind="dpace",
                                             label_map=label_map, fixed=h), h)
    np.testing.assert_allclose(np.asarray(g_h), num, atol=2e-5)


def test_divergences_know_their_limits():
    """A drafter equal to the target has tv = kl = rkl = 0 (up to rounding), kl and rkl with zero gradient (tv has a
    kink there); tv is the
    rejection probability 1 - sum min(p, t) when the stored tokens hold all the target's mass; kl with the
    mass renormalised is ce minus the target's entropy."""
    t = np.array([0.6, 0.3, 0.1], np.float32)
    ids = np.array([[2, 0, 5]], np.int32)
    w = np.eye(6, dtype=np.float32)
    z = np.full(6, -40.0, np.float32)
    z[[2, 0, 5]] = np.log(t)
    names = ("ce", "tv", "kl", "rkl")
    f = lambda x: head_divergences(x, jnp.asarray(w), jnp.asarray([2]), jnp.asarray(ids), jnp.asarray(t[None]),  # noqa: E731
                                   True, 8, names)[0]
    vals = np.asarray(f(jnp.asarray(z[None])))[0]
    np.testing.assert_allclose(vals[1:], 0.0, atol=1e-6)
    np.testing.assert_allclose(vals[0], -(t * np.log(t)).sum(), rtol=1e-5)
    jac = np.asarray(jax.jacobian(lambda x: f(x)[0, 2:])(jnp.asarray(z[None])))
    np.testing.assert_allclose(jac, 0.0, atol=1e-5)
    # another drafter: tv = 1 - sum_i min(p_i, t_i) over the whole vocabulary
    z2 = np.random.default_rng(0).normal(size=6).astype(np.float32)
    p = _softmax(z2.astype(np.float64))
    full_t = np.zeros(6)
    full_t[[2, 0, 5]] = t
    vals2 = np.asarray(f(jnp.asarray(z2[None])))[0]
    np.testing.assert_allclose(vals2[1], 1 - np.minimum(p, full_t).sum(), rtol=1e-5)
    np.testing.assert_allclose(vals2[2], vals2[0] + (t * np.log(t)).sum(), rtol=1e-5)


def test_bfloat16_hidden_states_run_and_agree():
    """The terms in the bfloat16 compute dtype (fp32 softmax): finite, the same loss to bf16 precision, and a
    bfloat16 gradient."""
    h, w, labels, mask, ids, probs = _case(seed=3)
    obj = Objective(terms=(("ce", 0.1), ("tv", 0.9), ("opd", 1.0)))
    blocks = labelled(labels, mask, (ids, probs))
    f32 = head_loss(jnp.asarray(h), head(w), blocks, K, obj)[0]
    fn = lambda x: head_loss(x, head(jnp.asarray(w, jnp.bfloat16)), blocks, K, obj)[0]  # noqa: E731
    bf16, g = jax.value_and_grad(fn)(jnp.asarray(h, jnp.bfloat16))
    assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_allclose(float(bf16), float(f32), rtol=3e-2)


def test_distribution_losses_need_soft_labels_and_ce_alone_is_the_old_loss():
    h, w, labels, mask, ids, probs = _case(seed=4)
    with pytest.raises(ValueError, match="soft labels"):
        head_loss(jnp.asarray(h), head(w), labelled(labels, mask), K, Objective(terms=(("tv", 1.0),)))
    soft = labelled(labels, mask, (ids, probs))
    plain = head_loss(jnp.asarray(h), head(w), soft, K, Objective())
    twice = head_loss(jnp.asarray(h), head(w), soft, K, Objective(terms=(("ce", 2.0),)))
    np.testing.assert_allclose(float(twice[0]), 2 * float(plain[0]), rtol=1e-6)
    assert not any(k.startswith("loss/") for k in plain[1])
    mix = head_loss(jnp.asarray(h), head(w), soft, K, Objective(terms=(("ce", 1.0), ("kl", 1.0))))
    np.testing.assert_allclose(float(mix[1]["loss/ce"]), float(plain[0]), rtol=1e-6)
    for name in ("acceptance_length", "accuracy_per_position", "num_labels", "weighted_count"):
        np.testing.assert_allclose(np.asarray(mix[1][name]), np.asarray(plain[1][name]), rtol=1e-6, err_msg=name)


def test_loss_spelling_is_parsed_and_validated():
    assert parse_loss("ce") == (("ce", 1.0),)
    assert parse_loss(" ce:0.1, tv:0.9 ") == (("ce", 0.1), ("tv", 0.9))
    assert parse_loss("opd") == (("opd", 1.0),)
    assert TrainConfig(loss="kl:2").loss_terms == (("kl", 2.0),)
    for bad, rule in (("", "name"), ("focal", "name"), ("ce:0", "> 0"), ("ce:-1", "> 0"), ("ce:x", "number"),
                      ("ce,ce", "once"), ("ce:nan", "> 0"), ("decay", "train.weighting")):
        with pytest.raises(ValueError, match="train.loss") as err:
            TrainConfig(loss=bad)
        assert rule in str(err.value), (bad, str(err.value))
    with pytest.raises(ValueError, match="train.opd_gamma"):
        TrainConfig(opd_gamma=0.0)
    with pytest.raises(ValueError):
        Objective(terms=(("ce", 1.0), ("ce", 1.0)))
