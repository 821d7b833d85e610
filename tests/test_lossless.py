"""Sampled verification is lossless at every position (issue 54 item 5): the accept rules of the chain (one-hot
drafts, `accept_sampled`; drafts drawn from the drafter, `accept_drafted`) and the tree's walk (with a prompt-lookup
path merged in by `build_tree`) emit, at every draft position and at the all-accepted bonus, exactly the target's
filtered law given the tokens before it. Each test has a negative control that must fail (a duplicated sibling, a
verifier at the wrong temperature), so the statistic is shown to have the power to see an error of that size.

The kernels run on synthetic targets, vectorised over 20,000 rows (no model, no engine): the target's logits at
each position depend on the tokens drafted before it, so a rule that leaked the wrong prefix would show. The test
is Pearson's chi-square of the emitted token against the law of its prefix, summed over (position, prefix) groups
of at least 40 rows (conditioning on the prefix leaves the token's law p(prefix); the groups' sizes are free).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2

from dflash.serve.sampling import SamplingConfig, SamplingRows
from dflash.serve.speculative import DraftLaw, accept_drafted, accept_sampled, residual_logprobs
from dflash.serve.tree import Tree, _walk, build_tree, rank_drafts, tree_problems

ROWS = 20_000
V = 6  # vocabulary
K = 4  # block: K - 1 = 3 drafts, then the bonus
RULE = SamplingConfig(temperature=0.7, top_k=5)
WRONG = SamplingConfig(temperature=1.0, top_k=5)  # the verifier at the wrong temperature
MIN_GROUP = 40
PASS, FAIL = 1e-3, 1e-6  # p-value bounds: a sound rule passes, a broken one fails by far


def law(logits_NxV: np.ndarray, rule: SamplingConfig) -> np.ndarray:
    """The target's filtered law of each row [N, V] in float64, computed here independently of the engine's
    filter: logits / temperature, top-k (ties at the k-th kept), softmax. (The rules here use no top-p.)"""
    assert rule.top_p == 1.0
    x = np.asarray(logits_NxV, np.float64) / rule.temperature
    if rule.top_k:
        kth = -np.sort(-x, axis=-1)[:, rule.top_k - 1: rule.top_k]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def chisquare_by_group(keys: np.ndarray, emitted: np.ndarray, p_NxV: np.ndarray) -> tuple[float, int]:
    """(p-value, groups tested) of Pearson's statistic for `emitted[i] ~ p_NxV[i]`, rows grouped by `keys` (rows
    of one key share one law); an emitted token outside its law's support is a p-value of 0."""
    stat, dof, groups = 0.0, 0, 0
    for key in np.unique(keys):
        rows = keys == key
        count = int(rows.sum())
        p = p_NxV[rows][0]
        assert np.allclose(p_NxV[rows], p), "rows of one group must share one law"
        observed = np.bincount(emitted[rows], minlength=len(p))
        if np.any(observed[p == 0] > 0):
            return 0.0, groups + 1
        if count < MIN_GROUP:
            continue
        expected = count * p[p > 0]
        stat += float(np.sum((observed[p > 0] - expected) ** 2 / expected))
        dof += int(np.count_nonzero(p > 0)) - 1
        groups += 1
    return float(chi2.sf(stat, dof)) if dof else 1.0, groups


# ------------------------------------------------------------------------------------------------ the chain


def chain_target(drafts_NxKm1: np.ndarray) -> np.ndarray:
    """Logits [N, K, V]: position i's depend on i and on the drafts before it (a hash of the prefix), as a real
    target's conditional does; position 0 follows the pending token alone."""
    base = np.random.default_rng(11).normal(0.0, 1.2, size=(K, 3, V))
    base[:, :, 0] += 2.0  # token 0 is likely everywhere, as the drafter guesses: deep positions are reached
    prefix_hash = np.zeros((len(drafts_NxKm1), K), np.int64)
    for i in range(1, K):
        prefix_hash[:, i] = (prefix_hash[:, i - 1] * 7 + drafts_NxKm1[:, i - 1] + 1) % 3
    return base[np.arange(K)[None, :], prefix_hash]  # [N, K, V]


def emitted_by_position(drafts: np.ndarray, n: np.ndarray, bonus: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per output position j = 0 .. K-1 (j = K-1: the all-accepted bonus): (the rows that reached it (n >= j), the
    token they emitted there); the prefix before j is drafts[:, :j]."""
    out = []
    for j in range(K):
        rows = np.flatnonzero(n >= j)
        out.append((rows, np.where(n[rows] > j, drafts[rows, min(j, K - 2)], bonus[rows])))
    return out


ACCEPT_SAMPLED, ACCEPT_DRAFTED = jax.jit(accept_sampled), jax.jit(accept_drafted)


def chain_pvalues(rule_name: str, verifier: SamplingConfig) -> list[float]:
    """The chain's p-value at each output position (3 drafts, then the bonus) under `rule_name` ("argmax": fixed
    one-hot drafts; "sample": drafts drawn from a drafter law q, accepted by speculative sampling), the target's
    law taken at `RULE` and the verifier run at `verifier`."""
    draft_key, verify_key = jax.random.split(jax.random.PRNGKey(5))
    q = np.array([[0.7, 0.1, 0.1, 0.05, 0.03, 0.02], [0.6, 0.1, 0.1, 0.1, 0.05, 0.05],
                  [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]])  # [K-1, V]: the drafter's law per slot
    rows = jax.random.categorical(draft_key, jnp.log(jnp.asarray(q, jnp.float32)), shape=(ROWS, K - 1))
    drafts = np.asarray(rows, np.int32)
    logits = chain_target(drafts)
    sampling = SamplingRows.of([verifier] * ROWS)
    keys = jax.random.split(verify_key, ROWS)
    if rule_name == "argmax":  # any drafts fixed before the target is read are one-hot drafts
        n, bonus, _ = ACCEPT_SAMPLED(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts), sampling, keys)
    else:
        logq = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (ROWS, K - 1, V))
        n, bonus, _ = ACCEPT_DRAFTED(jnp.asarray(logits, jnp.float32), jnp.asarray(drafts), DraftLaw(logq, rows),
                                     None, sampling, keys)
    n, bonus = np.asarray(n), np.asarray(bonus)
    p_NxKxV = law(logits.reshape(-1, V), RULE).reshape(ROWS, K, V)
    pvalues = []
    for j, (reached, token) in enumerate(emitted_by_position(drafts, n, bonus)):
        prefix = np.zeros(len(reached), np.int64)
        for i in range(j):
            prefix = prefix * V + drafts[reached, i]
        pvalue, groups = chisquare_by_group(prefix, token, p_NxKxV[reached, j])
        assert groups >= 1 and len(reached) > 500, (j, groups, len(reached))  # every position is exercised
        pvalues.append(pvalue)
    return pvalues


@pytest.mark.parametrize("rule_name", ["argmax", "sample"])
def test_the_chain_emits_the_target_law_at_every_position_and_the_bonus(rule_name):
    """Both draft rules: the token at each of the 3 draft positions and the all-accepted bonus has the target's law
    given the drafts before it; run at the wrong temperature the same test fails at every position."""
    assert all(p > PASS for p in chain_pvalues(rule_name, RULE)), chain_pvalues(rule_name, RULE)
    wrong = chain_pvalues(rule_name, WRONG)
    assert all(p < FAIL for p in wrong), wrong


def test_a_residual_with_nothing_left_falls_back_to_the_node_law():
    """`residual_logprobs`: the rejected tokens leave p (renormalised by the draw); when they held all of p's
    support the draw comes from p itself, never from an all -inf row (which draws token 0)."""
    logp = jnp.log(jnp.asarray([[0.0, 0.5, 0.5, 0.0], [0.0, 0.2, 0.3, 0.5]], jnp.float32))
    removed = jnp.asarray([[False, True, True, False], [False, True, False, False]])
    out = np.asarray(residual_logprobs(logp, removed))
    np.testing.assert_array_equal(out[0], np.asarray(logp[0]))  # every supported token removed: p itself
    assert np.isneginf(out[1, :2]).all() and np.allclose(np.exp(out[1, 2:]), [0.3, 0.5])
    draws = jax.vmap(jax.random.categorical, (0, None))(jax.random.split(jax.random.PRNGKey(0), 2000),
                                                        residual_logprobs(logp[:1], removed[:1])[0])
    assert set(np.asarray(draws).tolist()) == {1, 2}


# ------------------------------------------------------------------------------------------------ the tree

NODES, DEPTH = 16, K - 1  # every walk here has this shape (one compile): smaller trees leave nodes unused


@dataclasses.dataclass(frozen=True)
class WalkState:
    """What `_walk` reads of a `SpecState`: the rows' sampling rules and keys."""

    sampling: SamplingRows
    rng: jax.Array


jax.tree_util.register_dataclass(WalkState, data_fields=["sampling", "rng"], meta_fields=[])
WALK = jax.jit(_walk, static_argnums=3)


def padded(token: np.ndarray, parent: np.ndarray, depth: np.ndarray, rows: int = ROWS) -> Tree:
    """One tree (or one per row, [rows, n]) as `rows` slots of NODES nodes (the unused ones childless)."""
    token, parent, depth = (np.broadcast_to(np.atleast_2d(a), (rows, np.shape(a)[-1])) for a in (token, parent, depth))
    pad = ((0, 0), (0, NODES - token.shape[1]))
    return Tree(jnp.asarray(np.pad(token, pad), jnp.int32), jnp.asarray(np.pad(parent, pad, constant_values=-1),
                                                                        jnp.int32),
                jnp.asarray(np.pad(depth, pad), jnp.int32))


def walk(tree: Tree, logits_RxNxV: np.ndarray, verifier: SamplingConfig, seed: int = 3
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(path [R, DEPTH + 1], n [R], bonus [R]) of the tree walk on R = ROWS slots, node logits [R, n, V]."""
    logits = np.zeros((ROWS, NODES, V), np.float32)
    logits[:, : logits_RxNxV.shape[1]] = logits_RxNxV
    state = WalkState(SamplingRows.of([verifier] * ROWS), jax.random.split(jax.random.PRNGKey(seed), ROWS))
    path, n, bonus, _ = WALK(tree, jnp.asarray(logits), state, DEPTH)
    return np.asarray(path), np.asarray(n), np.asarray(bonus)


def tree_target(token_N: np.ndarray, parent_N: np.ndarray, seed: int = 2) -> np.ndarray:
    """Logits [nodes, V] at each node: a function of the node's whole path (its tokens from the root), so two
    nodes with different paths see different laws."""
    base = np.random.default_rng(seed).normal(0.0, 1.3, size=(7, V))
    base[:, 0] += 1.0
    out = np.zeros((len(token_N), V))
    for i in range(len(token_N)):
        h, j = 0, i
        while j > 0:
            h, j = (h * 5 + int(token_N[j]) + 1) % 7, int(parent_N[j])
        out[i] = base[h]
    return out


ROOT_LAW = law(tree_target(np.zeros(1, np.int64), np.full(1, -1)), RULE)[0]


def tree_pvalues(tree: Tree, verifier: SamplingConfig) -> list[float]:
    """The walk's p-value at each depth 1 .. K (K: the bonus after a fully accepted path of K - 1 tokens) of one
    tree (its slot 0, in every row): the token emitted after the node reached at depth d - 1 has that node's law
    (rows grouped by the node); depths no row reached are left out."""
    token, parent, depth = (np.asarray(a)[0] for a in (tree.token, tree.parent, tree.depth))
    assert tree_problems(tree, DEPTH) == []
    logits_NxV = tree_target(token, parent)
    path, n, bonus = walk(padded(token, parent, depth), np.broadcast_to(logits_NxV, (ROWS, *logits_NxV.shape)),
                          verifier)
    p_at = law(logits_NxV, RULE)  # [nodes, V]
    pvalues = []
    for d in range(int(depth.max()) + 1):
        reached = np.flatnonzero(n >= d)
        node = path[reached, d]  # the node whose law the next token follows
        nxt = np.where(n[reached] > d, token[path[reached, min(d + 1, DEPTH)]], bonus[reached])
        pvalue, groups = chisquare_by_group(node, nxt, p_at[node])
        assert groups >= 1 and len(reached) > 200, (d, groups, len(reached))
        pvalues.append(pvalue)
    return pvalues


def test_the_tree_walk_with_a_merged_lookup_path_emits_the_target_law_at_every_depth():
    """A best-first tree (12 drafter nodes, from ranked lists with a token outside top-k's support first at each
    depth) with a prompt-lookup path of K - 1 tokens merged in as a trie (following a drafter node, then new
    nodes): the token after the node reached at every depth, and the bonus after a fully accepted path, has the
    target's law there; the same test fails at the wrong temperature."""
    order = np.argsort(-ROOT_LAW)
    ids = np.array([[[order[5], order[0], order[1]], [order[0], order[1], order[2]], [order[1], order[0], order[3]]]])
    logp = np.log(np.array([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]]))
    lookup = np.array([[order[0], order[3], order[4]]])  # follows node 2 (order[0] at depth 1), then new nodes
    tree = build_tree(jnp.asarray(ids, jnp.int32), jnp.asarray(logp, jnp.float32), jnp.asarray([0]), NODES,
                      jnp.asarray(lookup, jnp.int32), jnp.asarray([K - 1]))
    parent = np.asarray(tree.parent)[0]
    new = [i for i in range(NODES - (K - 1), NODES) if parent[i] >= 0]
    assert len(new) == K - 2 and parent[new[0]] < NODES - (K - 1), "the lookup path must follow a drafter node"
    good = tree_pvalues(tree, RULE)
    assert len(good) == K and all(p > PASS for p in good), good
    wrong = tree_pvalues(tree, WRONG)
    assert all(p < FAIL for p in wrong[:2]), wrong  # the deeper depths see fewer rows


def test_a_duplicated_sibling_is_refused_and_never_accepted():
    """The distinct-sibling rule (`tree_problems` names a repeat; `build_tree` never makes one): a root whose
    children repeat a token (a trie merge that failed to follow the existing child) wastes a node. The walk's
    residual has no mass left on a rejected token, so the repeat is never accepted and the law stays exact (a
    point mass tried again is a draft like any other: the rule holds for any sequence of drafts whose laws are
    known). What a repeat does break is drawn children verified as drawn without replacement: the negative
    control of `test_the_sampled_tree_emits_the_target_law_at_every_depth`."""
    a, b, c = (int(t) for t in np.argsort(-ROOT_LAW)[:3])
    parent, depth = np.array([-1, 0, 0, 0]), np.array([0, 1, 1, 1])
    sound, duplicated = (padded(np.array([0, *children]), parent, depth, rows=1) for children in ([a, b, c], [a, b, a]))
    assert all(p > PASS for p in tree_pvalues(sound, RULE))
    assert tree_problems(duplicated, DEPTH) == ["slot 0: siblings must carry distinct token ids; nodes 1 and 3 under "
                                                f"node 0 both hold {a}"]
    with pytest.raises(AssertionError):
        tree_pvalues(duplicated, RULE)  # refused before the walk
    token = np.array([0, a, b, a])
    logits = tree_target(token, parent)
    path, n, bonus = walk(padded(token, parent, depth), np.broadcast_to(logits, (ROWS, 4, V)), RULE)
    assert not np.any(path[:, 1] == 3), "a repeated token was accepted against mass its residual no longer holds"
    first = np.where(n > 0, token[path[:, 1]], bonus)
    pvalue, _ = chisquare_by_group(np.zeros(ROWS), first, np.broadcast_to(law(logits[:1], RULE), (ROWS, V)))
    assert pvalue > PASS, pvalue


def test_children_covering_the_support_rejected_by_rounding_draw_from_the_node_law(monkeypatch):
    """top-k 2 and the root's two children are its whole support: in exact arithmetic the second child is accepted
    with probability p(c2) / (1 - p(c1)) = 1 once the first is rejected. With the acceptance uniforms forced to
    the largest float32 below 1, float32 rounding of that ratio (below 1 for some laws) rejects both; the draw then
    comes from the node's law, never from an all -inf residual (token 0, outside the support here)."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 2.0, size=(ROWS, 3, V)).astype(np.float32)
    logits[:, :, 0] -= 50.0  # token 0 is never in the support
    top = np.argsort(-logits[:, 0], axis=-1)[:, :2]
    tree = padded(np.concatenate([np.zeros((ROWS, 1), np.int64), top], 1), np.array([-1, 0, 0]), np.array([0, 1, 1]))
    below_one = np.nextafter(np.float32(1.0), np.float32(0.0))
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape: jnp.full(shape, below_one, jnp.float32))
    jax.clear_caches()  # `WALK` traces again, with the forced uniforms
    try:
        path, n, bonus = walk(tree, logits, SamplingConfig(temperature=1.0, top_k=2))
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    rejected_all = n == 0
    assert rejected_all.sum() > 0, "no law rounded the last child's ratio below 1: the case is not exercised"
    assert all(b in t for b, t in zip(bonus[rejected_all], top[rejected_all], strict=True))


def test_built_trees_keep_the_walks_rules():
    """`build_tree` on random ranked lists and lookup paths with repeated tokens (paths that follow drafter nodes,
    repeat a token at two depths, or stop early): every tree has distinct sibling ids, parents before children,
    depths within K - 1; a lookup path longer than K - 1 is refused when traced."""
    rng = np.random.default_rng(4)
    b, d, m, g = 64, K - 1, 4, K - 1
    logp = -np.sort(rng.exponential(1.0, size=(b, d, m)), axis=-1).astype(np.float32)
    ids = np.stack([np.stack([rng.choice(8, m, replace=False) for _ in range(d)]) for _ in range(b)]).astype(np.int32)
    extra = rng.integers(0, 8, size=(b, g)).astype(np.int32)
    extra[::3, 0] = ids[::3, 0, 0]  # follows the first drafter node
    for nodes in (g + 2, NODES):
        tree = build_tree(jnp.asarray(ids), jnp.asarray(logp), jnp.zeros(b, jnp.int32), nodes, jnp.asarray(extra),
                          jnp.asarray(rng.integers(0, g + 1, size=b)))
        assert tree_problems(tree, d) == []
    with pytest.raises(ValueError, match=r"the extra path's length must be <= the tree's depth K - 1 = 3; "
                                         r"received 4"):
        build_tree(jnp.asarray(ids), jnp.asarray(logp), jnp.zeros(b, jnp.int32), 12,
                   jnp.zeros((b, K), jnp.int32), jnp.zeros(b, jnp.int32))


# ------------------------------------------------------------------------------------------------ the sampled tree

# The drafter's law at block positions 1 .. K-1 (before the request's rule): a DFlash block predicts each position
# independently of the tokens before it, so every node at depth d draws its children from row d.
DRAFTER_Q = np.array([[0.45, 0.2, 0.15, 0.1, 0.06, 0.04], [0.5, 0.2, 0.1, 0.1, 0.06, 0.04],
                      [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]])
LOOKUP = K - 1  # a prompt-lookup path of K - 1 nodes, merged as point masses
DRAWN = NODES - 1 - LOOKUP  # the drafter's nodes
TARGET_LAWS = np.random.default_rng(21).normal(0.0, 1.3, size=(7, V))  # the target's logits by path hash
RANK = jax.jit(rank_drafts, static_argnames=("m", "sample"))


def walk_state(verifier: SamplingConfig, seed: int = 3) -> WalkState:
    return WalkState(SamplingRows.of([verifier] * ROWS), jax.random.split(jax.random.PRNGKey(seed), ROWS))


def path_hash(token_RxN: np.ndarray, parent_RxN: np.ndarray) -> np.ndarray:
    """[R, N]: a hash of each node's path from the root (its tokens in order), 0 .. 6; the target's law at a node
    is a function of it (`TARGET_LAWS`), so nodes on different paths see different laws."""
    rows = np.arange(len(token_RxN))
    h = np.zeros(token_RxN.shape, np.int64)
    for i in range(1, token_RxN.shape[1]):  # a parent comes before its children
        up = h[rows, np.maximum(parent_RxN[:, i], 0)]
        h[:, i] = np.where(parent_RxN[:, i] >= 0, (up * 5 + token_RxN[:, i] + 1) % 7, 0)
    return h


def sampled_tree(state: WalkState, drafts: str = "without replacement", draft_ids: np.ndarray | None = None) -> Tree:
    """Each row's sampled tree: the drafter's 12 nodes drawn from `DRAFTER_Q` under the row's rule by
    `rank_drafts` (the engine's draws), shaped best-first, with a prompt-lookup path of K - 1 tokens (random per
    row, independent of the draws) merged in. Negative controls: drafts "with replacement" (each rank drawn
    independently from q, so siblings repeat, then verified as drawn without), or "shape by draws" (the shape
    taken from the drawn tokens' own probabilities, so which draws become nodes depends on what was drawn). With
    `draft_ids` the drafter has a draft vocabulary: its law covers those token ids only (`DRAFTER_Q`'s columns
    there)."""
    q = DRAFTER_Q if draft_ids is None else DRAFTER_Q[:, draft_ids]
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (ROWS, K - 1, q.shape[1]))
    ids, logp, logq = RANK(logits, state, DRAWN, None if draft_ids is None else jnp.asarray(draft_ids), sample=True)
    if drafts == "with replacement":
        keys = jax.random.split(jax.random.PRNGKey(17), ROWS)
        ids = jax.vmap(lambda key, lq: jax.random.categorical(key, lq[:, None, :], axis=-1,
                                                              shape=(K - 1, V)))(keys, logq).astype(jnp.int32)
    elif drafts == "shape by draws":
        logp = jnp.take_along_axis(logq, ids, axis=-1)
        logp = jnp.where(jnp.arange(ids.shape[-1]) < 5, logp, -jnp.inf)  # only the support's draws are tokens
    rng = np.random.default_rng(8)
    lookup = rng.integers(0, V, size=(ROWS, LOOKUP)).astype(np.int32)
    return build_tree(ids, logp, jnp.zeros(ROWS, jnp.int32), NODES, jnp.asarray(lookup),
                      jnp.asarray(rng.integers(0, LOOKUP + 1, size=ROWS)), logq)


def sampled_pvalues(tree: Tree, state: WalkState, every_depth: bool = True,
                    draft_ids: np.ndarray | None = None) -> tuple[list[float], np.ndarray]:
    """The walk's p-value at each depth 1 .. K of a sampled tree per row (K: the bonus after a fully accepted
    path), the target's law taken at `RULE` whatever rule `state` verifies with; rows grouped by the path hash
    of the node reached; and n [R]. Depths reached by few rows are left out unless `every_depth` (which requires
    each to be exercised)."""
    token, parent = np.asarray(tree.token), np.asarray(tree.parent)
    h = path_hash(token, parent)
    ids = None if draft_ids is None else jnp.asarray(draft_ids)
    path, n, bonus, _ = (np.asarray(a) for a in WALK(tree, jnp.asarray(TARGET_LAWS[h], jnp.float32), state, DEPTH,
                                                     ids))
    p_by_hash = law(TARGET_LAWS, RULE)
    pvalues = []
    for d in range(DEPTH + 1):
        reached = np.flatnonzero(n >= d)
        node = path[reached, d]
        nxt = np.where(n[reached] > d, token[reached, path[reached, min(d + 1, DEPTH)]], bonus[reached])
        key = h[reached, node]
        pvalue, groups = chisquare_by_group(key, nxt, p_by_hash[key])
        if every_depth:
            assert groups >= 1 and len(reached) > 200, (d, groups, len(reached))  # every depth is exercised
        if groups:
            pvalues.append(pvalue)
    return pvalues, n


def test_drafts_are_drawn_without_replacement_in_the_argmax_trees_shape():
    """`rank_drafts(..., sample=True)`: a sampled row's first draft has the law q (the drafter's, under the row's
    rule), its second, given the first, q without the first renormalised; the shape scores are q's sorted
    log-probabilities (-inf past its support of top-k 5, where no draft is a token), and greedy rows keep the
    ranked lists."""
    state = walk_state(RULE)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(DRAFTER_Q, jnp.float32)), (ROWS, K - 1, V))
    ids, logp, logq = (np.asarray(a) for a in RANK(logits, state, DRAWN, sample=True))
    q = law(np.log(DRAFTER_Q), RULE)  # [K - 1, V]
    np.testing.assert_allclose(np.exp(logq[0]), q, atol=1e-6)
    np.testing.assert_allclose(np.exp(logp[0, :, :5]), -np.sort(-q, axis=-1)[:, :5], atol=1e-6)
    assert np.isneginf(logp[:, :, 5:]).all()
    assert ids.shape == (ROWS, K - 1, V)  # M = 12 ranks of a vocabulary of 6: all of it
    assert all(len(set(row[:5])) == 5 for row in ids.reshape(-1, V))  # the support, each token once
    for d in range(K - 1):
        first = ids[:, d, 0]
        assert chisquare_by_group(np.zeros(ROWS), first, np.broadcast_to(q[d], (ROWS, V)))[0] > PASS
        rest = np.broadcast_to(q[d], (ROWS, V)) * (np.arange(V)[None, :] != first[:, None])
        assert chisquare_by_group(first, ids[:, d, 1], rest / rest.sum(-1, keepdims=True))[0] > PASS
    greedy = walk_state(SamplingConfig())
    ranked_ids, ranked_logp, _ = (np.asarray(a) for a in RANK(logits, greedy, DRAWN, sample=True))
    plain_ids, plain_logp = (np.asarray(a) for a in RANK(logits, greedy, DRAWN))
    np.testing.assert_array_equal(ranked_ids, plain_ids)
    np.testing.assert_array_equal(ranked_logp, plain_logp)
    np.testing.assert_array_equal(plain_ids[0, :, 0], np.argmax(DRAFTER_Q, axis=-1))


def test_the_sampled_tree_emits_the_target_law_at_every_depth():
    """Multi-draft speculative sampling without replacement, with a prompt-lookup path merged in as point masses:
    per row a tree of 12 drafter nodes drawn from the drafter's law and the lookup path, the target's law a
    function of each node's path. The token after the node reached at every depth, and the bonus after a fully
    accepted path, has the target's law there. Negative controls, each failing: the verifier at the wrong
    temperature; drafts drawn with replacement (repeated siblings) verified as drawn without; the tree's shape
    chosen by the drawn tokens."""
    state = walk_state(RULE)
    tree = sampled_tree(state)
    assert tree_problems(tree, DEPTH) == []
    good, n = sampled_pvalues(tree, state)
    assert len(good) == K and all(p > PASS for p in good), good
    assert np.mean(n == DEPTH) > 0.05 and np.mean(n == 0) > 0.05  # rejection and full acceptance both occur
    token, parent, drawn = (np.asarray(a) for a in (tree.token, tree.parent, tree.drawn))
    assert drawn[:, 1:DRAWN + 1].all() and not drawn[:, DRAWN + 1:].any() and not drawn[:, 0].any()
    wrong, _ = sampled_pvalues(tree, walk_state(WRONG))
    assert all(p < FAIL for p in wrong[:2]), wrong
    repeated, _ = sampled_pvalues(sampled_tree(state, "with replacement"), state, every_depth=False)
    assert min(repeated) < FAIL, repeated
    chosen, _ = sampled_pvalues(sampled_tree(state, "shape by draws"), state, every_depth=False)
    assert min(chosen) < FAIL, chosen


def test_a_sampled_tree_over_a_draft_vocabulary_emits_the_target_law():
    """A drafter with a draft vocabulary (its rows are token ids 0, 2, 3, 5 of the 6): the draws come back as token
    ids and the walk reads their law through the same map (`models.draft_ids`), exact at every depth; a walk that
    maps the rows to the wrong ids fails."""
    draft_ids = np.array([0, 2, 3, 5])
    state = walk_state(RULE)
    tree = sampled_tree(state, draft_ids=draft_ids)
    drawn = np.asarray(tree.token)[np.asarray(tree.drawn) & (np.asarray(tree.parent) >= 0)]
    assert set(drawn.tolist()) == {0, 2, 3, 5}
    good, _ = sampled_pvalues(tree, state, draft_ids=draft_ids)
    assert len(good) == K and all(p > PASS for p in good), good
    wrong, _ = sampled_pvalues(tree, state, every_depth=False, draft_ids=np.array([0, 2, 5, 3]))
    assert min(wrong) < FAIL, wrong
