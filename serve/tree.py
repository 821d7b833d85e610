"""Tree drafting and tree verification (docs/design.md §4.4): a best-first token tree built from one DFlash block's
per-position distributions, verified in one target pass with an ancestor-only mask over the paged cache.

    ids, logp = propose_topk(models, state, block_size=K, m=N - 1, span=span)    # [B, J, C] each
    tree = build_tree(ids, logp, state.pending, nodes=N)                           # N nodes per slot
    state, out, n = verify_tree(models, state, tree, K, span_pages)                # like `verify`

The drafter predicts every block position at once and independently (same-position prediction, §4.1), so a
node at depth d with the tokens t_1 .. t_d has path probability prod_i q_i(t_i), and the children of every node
at depth d are the same ranked list, the top tokens of q_{d+1}. `build_tree` pops the N - 1 most probable paths
best-first (a node's path probability never exceeds its parent's or its elder sibling's, so a frontier of
"first child" and "next sibling" candidates enumerates paths in order; the training-free DDTree tree of
issue 35, here on the device with static shapes). Node 0 is the root (the pending token); nodes are numbered in
the order they were popped, so a parent comes before its children and siblings come in rank order. Optional
extra paths (prompt lookup, `ngram`) are merged in as a trie after the drafter's nodes.

`verify_tree` writes all N nodes after each slot's committed tokens (node j at token L + j, rotated at position
L + depth(j)), each node attending to the committed tokens and its ancestors only (`paged.TreeChunkCache`), then
walks the tree from the root. Greedy: the child equal to the target's argmax, until none is; output = that path
plus the target's token after it, equal to AR decoding. Only the accepted path is kept: its K/V are copied onto
tokens L .. L + n (`PagedKVCache.copy_tokens`), its target features go to the draft cache, and L moves by n + 1.

Sampled requests: multi-draft speculative sampling with recursive rejection (SpecInfer's rule; without replacement
as in Jeon et al., "Recursive Speculative Decoding", 2024). Each node's children are drafts, each with the law it
was drawn from given its elder siblings: a point mass on its token (`rule` "argmax": the drafter's top-ranked
tokens; a prompt-lookup node under either rule), or (`rule` "sample", `Tree.drawn`) the drafter's law q at that
depth under the request's rule with the elder drawn siblings removed, renormalised (the drafter's nodes of a
sampled tree are drawn from q without replacement, `rank_drafts`). At a node with target law p (filtered,
`row_logprobs`) the walk keeps a residual r, first p, and tries the children in order: child c with law q_c is
accepted with probability min(1, r(c) / q_c(c)); a rejection sets r to max(r - q_c, 0), renormalised (for a point
mass: r with c removed). The first accepted child is the next node; when every child is rejected the token is
drawn from r (after a fully accepted path of K - 1: from p). Why the token has exactly p's law: by induction from
the last child, the rest of the procedure draws from its r whatever the later children are (their laws given the
earlier ones are known), so P(token = x) = min(q_c(x), r(x)) + (1 - sum min(q_c, r)) * max(r - q_c, 0)(x) / Z
= r(x) (Z = 1 - sum min(q_c, r)); at the first child r = p. This needs each child drawn from the law it is tried
with, given everything the walk has read before it: the tree's shape (how many children each node has) is fixed
before the drafts are drawn (best-first over the drafter's sorted probabilities, `build_tree`), never chosen by
the drawn tokens, and nodes at one depth share the depth's draws (a DFlash block predicts each position
independently of the tokens before it, and the walk reads the children of one node per depth). Where a rejection
leaves r empty (r <= q_c everywhere: float32 rounding of r = q_c, which exact arithmetic never rejects) the
token is drawn from the node's p (item 5's fallback, as `speculative.residual_logprobs` does for the chain).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.decoder import forward_cached
from dflash.serve.lookup import append_history, lookup_paths
from dflash.serve.paged import TreeChunkCache
from dflash.serve.sampling import row_logprobs
from dflash.serve.speculative import (
    Models,
    SpecState,
    TokenLogprobs,
    _add_context,
    _layer_ids,
    categorical,
    draft_hidden,
    draft_logits,
    first_argmax,
    oracle_tokens,
    run_steps,
    step_keys,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """N nodes per slot: token [B, N] int32 (node 0: the pending token), parent [B, N] int32 (-1: the root, and
    unused nodes, which are no node's child), depth [B, N] int32 (root 0). A sampled tree also holds the law its
    drafter nodes were drawn from: law [B, K-1, V'] (log q of block position d + 1, the children of depth-d nodes,
    under each row's rule; V' the draft rows) and drawn [B, N] bool (nodes drawn from it; the others, prompt-lookup
    nodes and every node of an argmax tree, are point-mass drafts)."""

    token: jax.Array
    parent: jax.Array
    depth: jax.Array
    law: jax.Array | None = None
    drawn: jax.Array | None = None

    @property
    def nodes(self) -> int:
        return self.token.shape[1]

    def ancestors(self, max_depth: int) -> jax.Array:
        """bool [B, N, N]: [b, i, j] = node j lies on the path from the root to node i (i itself included)."""
        n = self.nodes
        eye = jnp.eye(n, dtype=bool)
        up = jnp.where(self.parent >= 0, self.parent, jnp.arange(n)[None, :])  # the root points at itself
        anc = jnp.broadcast_to(eye, (self.token.shape[0], n, n))
        for _ in range(max_depth):
            anc = eye[None] | jnp.take_along_axis(anc, jnp.broadcast_to(up[:, :, None], anc.shape), axis=1)
        return anc


@functools.partial(jax.jit, static_argnames=("block_size", "m", "span", "sample"))
def propose_topk(models: Models, state: SpecState, block_size: int, m: int, span: int | None = None,
                 sample: bool = False) -> tuple[jax.Array, ...]:
    """The drafter's ranked lists at block positions 1 .. K-1 from one forward over [pending, MASK x (K-1)] (as
    `speculative.propose`): (ids [B, J, C] int32, logp [B, J, C] fp32), the C = m most likely tokens and their
    log-probabilities, most likely first (a draft vocabulary ranks only its rows). With `sample`, a sampled row's
    ids are instead C draws without replacement from its law q and the law comes back too, (ids, logp, law)
    (`rank_drafts`). A path-selector drafter, whose positions are not independent, is refused by the plan
    (`plan.Tree.check`)."""
    hidden = draft_hidden(models, models.drafter(), state, block_size, span)
    ranked = rank_drafts(draft_logits(models, hidden[:, 1:]), state, m, models.draft_ids, sample)
    if state.oracle is None:
        return ranked
    # The oracle benchmark: each greedy row's first choice at every depth is its known token, certain (log p 0), so
    # the best-first tree holds the whole known path, and its other nodes as the drafter ranks them.
    ids, logp, *law = ranked
    known, use = oracle_tokens(state, ids.shape[1])
    return (ids.at[:, :, 0].set(jnp.where(use, known, ids[:, :, 0])),
            logp.at[:, :, 0].set(jnp.where(use, 0.0, logp[:, :, 0])), *law)


def rank_drafts(logits_BxJxV: jax.Array, state: SpecState, m: int, draft_ids: jax.Array | None = None,
                sample: bool = False) -> tuple[jax.Array, ...]:
    """(ids, logp) [B, J, C] of the drafter's logits [B, J, V'] (V' its draft rows, `draft_ids` their token ids):
    the C = m most likely rows and their log-probabilities, most likely first. With `sample`, (ids, logp, law): law
    [B, J, V'] is each row's log q under its own rule (`row_logprobs`), and a sampled row's ids are C draws from
    q without replacement in draw order (Gumbel top-C: sequential draws, each from q with the earlier ones
    removed), its logp q's C largest log-probabilities sorted (the tree's shape, which must not depend on the
    draws); beyond q's support (fewer than C tokens after top-k / top-p) both are -inf and `build_tree` makes no
    node of them. Greedy rows keep the ranked lists, and a batch of greedy rows never draws (`lax.cond`); the
    draws take the fourth key of the step's split (`step_keys`), which the walk leaves to the drafts."""
    m = min(m, logits_BxJxV.shape[-1])
    logp, rows = jax.lax.top_k(jax.nn.log_softmax(logits_BxJxV.astype(jnp.float32), axis=-1), m)
    law = None
    if sample:
        law = row_logprobs(logits_BxJxV, state.sampling)

        def draw(_: None) -> tuple[jax.Array, jax.Array]:
            keys = step_keys(state.rng)[:, 3]
            gumbel = jax.vmap(lambda key: jax.random.gumbel(key, law.shape[1:], jnp.float32))(keys)
            drawn = jax.lax.top_k(law + gumbel, m)[1]
            shape = jax.lax.top_k(law, m)[0]
            greedy = state.sampling.greedy[:, None, None]
            return jnp.where(greedy, rows, drawn), jnp.where(greedy, logp, shape)

        rows, logp = jax.lax.cond(jnp.all(state.sampling.greedy), lambda _: (rows, logp), draw, None)
    ids = (rows if draft_ids is None else jnp.take(draft_ids, rows)).astype(jnp.int32)
    return (ids, logp) if law is None else (ids, logp, law)


def _best_first(ids_JxC: jax.Array, logp_JxC: jax.Array, nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One slot's best-first tree of `nodes` nodes (root included) from per-depth ranked lists: (token, parent,
    depth), each [nodes]; the root's token is left 0."""
    d_max, m = ids_JxC.shape
    c = 2 * nodes  # candidates: each pop adds at most two (first child, next sibling)
    neg = jnp.float32(-jnp.inf)
    score = jnp.full((c,), neg).at[0].set(logp_JxC[0, 0])
    parent = jnp.zeros((c,), jnp.int32)
    depth = jnp.ones((c,), jnp.int32)
    rank = jnp.zeros((c,), jnp.int32)
    token = jnp.zeros((nodes,), jnp.int32)
    node_parent = jnp.full((nodes,), -1, jnp.int32)
    node_depth = jnp.zeros((nodes,), jnp.int32)

    def pop(i, carry):
        score, parent, depth, rank, token, node_parent, node_depth = carry
        j = jnp.argmax(score)
        ok = score[j] > neg
        d, r, s = depth[j], rank[j], score[j]
        token = token.at[i].set(jnp.where(ok, ids_JxC[d - 1, r], 0))
        node_parent = node_parent.at[i].set(jnp.where(ok, parent[j], -1))
        node_depth = node_depth.at[i].set(jnp.where(ok, d, 0))
        score = score.at[j].set(neg)
        child = jnp.where(ok & (d < d_max), s + logp_JxC[jnp.minimum(d, d_max - 1), 0], neg)
        sibling = jnp.where(ok & (r + 1 < m), s - logp_JxC[d - 1, r] + logp_JxC[d - 1, jnp.minimum(r + 1, m - 1)],
                            neg)
        a, b = 2 * i - 1, 2 * i  # free candidate slots after i pops
        score = score.at[a].set(child).at[b].set(sibling)
        parent = parent.at[a].set(i).at[b].set(parent[j])
        depth = depth.at[a].set(d + 1).at[b].set(d)
        rank = rank.at[a].set(0).at[b].set(r + 1)
        return score, parent, depth, rank, token, node_parent, node_depth

    carry = jax.lax.fori_loop(1, nodes, pop, (score, parent, depth, rank, token, node_parent, node_depth))
    return carry[4], carry[5], carry[6]


def _merge_path(token: jax.Array, parent: jax.Array, depth: jax.Array, path_L: jax.Array, length: jax.Array, *,
                start: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Insert one extra path (its first `length` tokens of path_L) from the root as a trie: a token that is
    already a child of the current node is followed, else it becomes node start + g. Unused nodes stay
    childless (parent -1)."""
    index = jnp.arange(token.shape[0])

    def insert(g, carry):
        token, parent, depth, cur = carry
        t = path_L[g]
        match = (parent == cur) & (token == t) & (index < start + g)
        found = jnp.any(match)
        new = start + g
        live = g < length
        make = live & ~found
        token = token.at[new].set(jnp.where(make, t, token[new]))
        parent = parent.at[new].set(jnp.where(make, cur, parent[new]))
        depth = depth.at[new].set(jnp.where(make, depth[cur] + 1, depth[new]))
        cur = jnp.where(live, jnp.where(found, jnp.argmax(match), new), cur)
        return token, parent, depth, cur

    token, parent, depth, _ = jax.lax.fori_loop(0, path_L.shape[0], insert, (token, parent, depth, jnp.int32(0)))
    return token, parent, depth


@functools.partial(jax.jit, static_argnames=("nodes",))
def build_tree(ids_BxJxC: jax.Array, logp_BxJxC: jax.Array, pending_B: jax.Array, nodes: int,
               extra_BxL: jax.Array | None = None, extra_len_B: jax.Array | None = None,
               law: jax.Array | None = None) -> Tree:
    """Each slot's tree of `nodes` nodes: the root (pending token), then the most probable paths best-first from
    the ranked lists (depth <= J), then, with `extra_BxL`, one extra path per slot (its first extra_len[b]
    tokens, e.g. a prompt-lookup continuation) merged in as a trie on the last L nodes. The shape comes from logp
    alone, the tokens from ids: the node of rank r at depth d holds ids[d - 1, r], and the children of a node are
    ranks 0, 1, .. of the next depth. With `law` (drafts drawn by `rank_drafts(..., sample=True)`), the tree is
    sampled: its drafter nodes are marked drawn from it, the extra path's nodes are point masses."""
    g = 0 if extra_BxL is None else extra_BxL.shape[1]
    if not 1 <= g + 1 < nodes:
        raise ValueError(f"nodes must exceed 1 + the extra path's length ({g}); received nodes={nodes}")
    if g > ids_BxJxC.shape[1]:  # a deeper path would be verified past the block: K - 1 drafts at most
        raise ValueError(f"the extra path's length must be <= the tree's depth K - 1 = {ids_BxJxC.shape[1]}; "
                         f"received {g}")
    token, parent, depth = jax.vmap(functools.partial(_best_first, nodes=nodes - g))(ids_BxJxC, logp_BxJxC)
    if g:
        pad = ((0, 0), (0, g))
        token, parent, depth = jnp.pad(token, pad), jnp.pad(parent, pad, constant_values=-1), jnp.pad(depth, pad)
        token, parent, depth = jax.vmap(functools.partial(_merge_path, start=nodes - g))(
            token, parent, depth, extra_BxL.astype(jnp.int32), extra_len_B.astype(jnp.int32))
    drawn = None
    if law is not None:
        index = jnp.arange(nodes)[None, :]
        drawn = jnp.broadcast_to((index >= 1) & (index < nodes - g), token.shape)
    return Tree(token.at[:, 0].set(pending_B), parent, depth, law, drawn)


def tree_problems(tree: Tree, max_depth: int) -> list[str]:
    """What breaks the rules the tree relies on, on the host (for tests and debugging; `build_tree` keeps them by
    construction): node 0 the root (parent -1, depth 0); a used node's parent comes before it (the walk tries
    nodes in index order) and its depth is its parent's + 1, at most `max_depth` (K - 1); siblings carry distinct
    token ids (a repeated point-mass sibling finds no mass left in the residual, so it is a wasted node; drawn
    children are distinct because they are drawn without replacement, which their laws assume). Unused nodes
    (parent -1 past the root) are ignored. [] when the tree is sound."""
    token, parent, depth = (np.asarray(a) for a in (tree.token, tree.parent, tree.depth))
    problems = []
    for b in range(token.shape[0]):
        if parent[b, 0] != -1 or depth[b, 0] != 0:
            problems.append(f"slot {b}: node 0 must be the root (parent -1, depth 0); received parent "
                            f"{parent[b, 0]}, depth {depth[b, 0]}")
        seen: dict[tuple[int, int], int] = {}
        for i in range(1, token.shape[1]):
            p = int(parent[b, i])
            if p < 0:
                continue
            if p >= i:
                problems.append(f"slot {b}: node {i}'s parent must come before it; received parent {p}")
            elif depth[b, i] != depth[b, p] + 1 or not 1 <= depth[b, i] <= max_depth:
                problems.append(f"slot {b}: node {i}'s depth must be its parent's + 1 and <= {max_depth}; received "
                                f"{depth[b, i]} under a parent at depth {depth[b, p]}")
            elder = seen.setdefault((p, int(token[b, i])), i)
            if elder != i:
                problems.append(f"slot {b}: siblings must carry distinct token ids; nodes {elder} and {i} under "
                                f"node {p} both hold {token[b, i]}")
    return problems


def _walk(tree: Tree, logits_BxQxV: jax.Array, state: SpecState, max_depth: int,
          draft_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(path [B, K] node ids (path[:, 0] = 0; entries past n are node 0), n accepted [B], bonus [B], next keys):
    greedy rows follow the argmax, sampled rows recursive rejection sampling (`_sampled_walk`; module docstring).
    A batch of greedy rows never runs the sampling branch (`lax.cond`)."""
    b = logits_BxQxV.shape[0]
    rows = jnp.arange(b)
    greedy = state.sampling.greedy
    argmax_BxQ = first_argmax(logits_BxQxV)
    cur = jnp.zeros((b,), jnp.int32)
    going = jnp.ones((b,), bool)
    n = jnp.zeros((b,), jnp.int32)
    path = [cur]
    for _ in range(max_depth):
        ok = (tree.parent == cur[:, None]) & (tree.token == argmax_BxQ[rows, cur][:, None])
        step = going & jnp.any(ok, axis=1)
        nxt = jnp.argmax(ok, axis=1).astype(jnp.int32)
        cur = jnp.where(step, nxt, cur)
        n = n + step
        going = step
        path.append(jnp.where(step, nxt, 0))
    by_argmax = (jnp.stack(path, axis=1), n, argmax_BxQ[rows, cur], state.rng)

    def mixed(_: None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        sampled = _sampled_walk(tree, logits_BxQxV, state, max_depth, draft_ids)
        return tuple(jnp.where(greedy.reshape(-1, *(1,) * (g.ndim - 1)), g, s)
                     for g, s in zip(by_argmax, sampled, strict=True))

    return jax.lax.cond(jnp.all(greedy), lambda _: by_argmax, mixed, None)


def _sampled_walk(tree: Tree, logits_BxQxV: jax.Array, state: SpecState, max_depth: int,
                  draft_ids: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The walk of recursive rejection sampling (module docstring) for every row. Each iteration tries one child
    per row: the first node past the last one tried whose parent is the node reached (a parent comes before its
    children, siblings in the order they are tried), so a row runs one iteration per child it tries and the loop
    ends when no row has one left. Carried per row: the node reached, its law p, the residual r, and the law the
    next drawn child of that node comes from (q of the next depth without the drawn siblings tried so far)."""
    b, n_nodes, vocab = logits_BxQxV.shape
    rows, index = jnp.arange(b), jnp.arange(n_nodes)
    keys = step_keys(state.rng)  # next key, acceptance uniforms, the draw from the residual, (the drafts' draws)
    u_BxQ = jax.vmap(lambda key: jax.random.uniform(key, (n_nodes,)))(keys[:, 1])

    def node_law(j_B: jax.Array) -> jax.Array:
        """[B, V]: the target's filtered law at node j_B of each row (only the nodes a row reaches are computed)."""
        return jnp.exp(row_logprobs(logits_BxQxV[rows, j_B], state.sampling))

    drawn_BxQ = jnp.zeros((b, n_nodes), bool) if tree.drawn is None else tree.drawn
    if tree.law is None:  # no drawn children: their law is never read
        q_BxJxV = jnp.zeros((b, 1, vocab), jnp.float32)
    else:
        q_BxJxV = jnp.exp(tree.law)
        if draft_ids is not None:
            q_BxJxV = jnp.zeros((*q_BxJxV.shape[:2], vocab), jnp.float32).at[:, :, draft_ids].set(q_BxJxV)

    def children_law(depth_B: jax.Array) -> jax.Array:
        """[B, V]: the law the drawn children of a node at depth_B were drawn from."""
        return q_BxJxV[rows, jnp.minimum(depth_B, q_BxJxV.shape[1] - 1)]

    def next_child(cur_B: jax.Array, after_B: jax.Array) -> jax.Array:
        """[B]: the first node past `after_B` whose parent is cur_B (n_nodes: none left)."""
        ok = (tree.parent == cur_B[:, None]) & (index[None, :] > after_B[:, None])
        return jnp.where(jnp.any(ok, axis=1), jnp.argmax(ok, axis=1), n_nodes).astype(jnp.int32)

    def normalised(x_BxV: jax.Array, fallback_BxV: jax.Array) -> jax.Array:
        total = jnp.sum(x_BxV, axis=-1, keepdims=True)
        return jnp.where(total > 0, x_BxV / jnp.where(total > 0, total, 1.0), fallback_BxV)

    def body(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        i, cur, p_cur, r, q, path, n = carry
        tried = i < n_nodes
        j = jnp.minimum(i, n_nodes - 1)
        token, drawn, depth = tree.token[rows, j], drawn_BxQ[rows, j], tree.depth[rows, j]
        q_token = jnp.where(drawn, q[rows, token], 1.0)
        r_token = r[rows, token]
        accept = tried & (u_BxQ[rows, j] * q_token < r_token)  # u < min(1, r(c) / q_c(c))
        reject = tried & ~accept

        def rejected(rq: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            r, q = rq  # r <- max(r - q_c, 0) renormalised (a point mass: r without c); the node's p where empty
            left = jnp.where(drawn[:, None], jnp.maximum(r - q, 0.0), r)
            left = left.at[rows, token].set(jnp.where(drawn, jnp.maximum(r_token - q_token, 0.0), 0.0))
            r = jnp.where(reject[:, None], normalised(left, p_cur), r)
            q_rest = normalised(q.at[rows, token].set(0.0), q)  # the next drawn sibling's law: q without c
            return r, jnp.where((reject & drawn)[:, None], q_rest, q)

        def accepted(cpq: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            cur, p_cur, r, q, path, n = cpq  # move to node j: its law, and its children's
            p_j = node_law(j)
            return (jnp.where(accept, j, cur), jnp.where(accept[:, None], p_j, p_cur),
                    jnp.where(accept[:, None], p_j, r), jnp.where(accept[:, None], children_law(depth), q),
                    path.at[rows, depth].set(jnp.where(accept, j, path[rows, depth])), jnp.where(accept, depth, n))

        r, q = jax.lax.cond(jnp.any(reject), rejected, lambda rq: rq, (r, q))
        cur, p_cur, r, q, path, n = jax.lax.cond(jnp.any(accept), accepted, lambda c: c, (cur, p_cur, r, q, path, n))
        return next_child(cur, jnp.where(tried, j, n_nodes)), cur, p_cur, r, q, path, n

    zeros = jnp.zeros((b,), jnp.int32)
    p_root = node_law(zeros)
    carry = (next_child(zeros, zeros), zeros, p_root, p_root, children_law(zeros),
             jnp.zeros((b, max_depth + 1), jnp.int32), zeros)
    _, _, _, r, _, path, n = jax.lax.while_loop(lambda c: jnp.any(c[0] < n_nodes), body, carry)
    bonus = jax.vmap(categorical)(keys[:, 2], jnp.log(r))
    return path, n, bonus, keys[:, 0]


def _verify_tree(models: Models, state: SpecState, tree: Tree, block_size: int, span_pages: int | None,
                 logprobs: bool) -> tuple[SpecState, jax.Array, jax.Array, TokenLogprobs | None]:
    drafter = models.drafter()
    d_max = block_size - 1
    positions = state.lengths[:, None] + tree.depth
    seen = state.target if span_pages is None else state.target.view(span_pages)
    chunk = TreeChunkCache(seen, tree.ancestors(d_max))
    logits, feats, chunk = forward_cached(models.target_params, models.target_cfg, tree.token, positions, chunk,
                                          layer_ids=_layer_ids(drafter))
    cache = chunk.paged.with_full_table(state.target)
    path, n, bonus, rng = _walk(tree, logits, state, d_max, models.draft_ids)
    n = jnp.where(state.active, n, 0)
    idx = jnp.arange(block_size)[None, :]
    path_tokens = jnp.take_along_axis(tree.token, path, axis=1)  # [B, K]: path_tokens[:, i] is the i-th token
    out = jnp.where(idx < n[:, None], jnp.pad(path_tokens[:, 1:], ((0, 0), (0, 1))), 0)
    out = jnp.where(idx == n[:, None], bonus[:, None], out)
    # Keep the accepted path: node path[i] (at token L + path[i]) moves to token L + i, i = 1 .. n.
    dst = state.lengths[:, None] + idx[:, 1:]
    src = jnp.where(idx[:, 1:] <= n[:, None], state.lengths[:, None] + path[:, 1:], dst)
    cache = cache.copy_tokens(src, dst)
    new_len = jnp.where(state.active, state.lengths + n + 1, state.lengths)
    path_feats = None if feats is None else jnp.take_along_axis(feats, path[None, :, :, None], axis=2)
    draft = _add_context(drafter, state.draft, path_feats, state.lengths)  # slots >= new_len stay invisible
    new_state = dataclasses.replace(state, target=cache.rollback(new_len), draft=draft, lengths=new_len,
                                    pending=jnp.where(state.active, bonus, state.pending),
                                    rng=jnp.where(state.active[:, None], rng, state.rng))
    scores = None
    if logprobs:
        scores = TokenLogprobs.of(jnp.take_along_axis(logits, path[:, :, None], axis=1), out)
    return new_state, out, n, scores


@functools.partial(jax.jit, static_argnames=("block_size", "span_pages"), donate_argnames=("state",))
def verify_tree(models: Models, state: SpecState, tree: Tree, block_size: int,
                span_pages: int | None = None) -> tuple[SpecState, jax.Array, jax.Array]:
    """Verify each slot's tree with one target forward; returns (state, tokens [B, K], accepted n [B]) as
    `speculative.verify` does (tokens[b, :n+1]: the accepted path's n tokens, then the target's). The host
    must have given every active slot pages for L + N tokens (N = tree.nodes); tree depth <= K - 1."""
    return _verify_tree(models, state, tree, block_size, span_pages, False)[:3]


@functools.partial(jax.jit, static_argnames=("block_size", "span_pages"), donate_argnames=("state",))
def verify_tree_logprobs(models: Models, state: SpecState, tree: Tree, block_size: int, span_pages: int | None = None
                         ) -> tuple[SpecState, jax.Array, jax.Array, TokenLogprobs]:
    """`verify_tree`, and the target's log-probabilities [B, K] of the output tokens (as `verify_logprobs`)."""
    return _verify_tree(models, state, tree, block_size, span_pages, True)


@dataclasses.dataclass(frozen=True)
class TreeLoop:
    """The static shape of a `decode_tree_steps` program (one compile each): K = `block_size`, trees of `nodes`
    nodes of which `lookup` are a prompt-lookup path, up to `steps` steps per dispatch, attention over `span_pages`
    pages, and whether sampled rows draw the drafter's nodes from its law (`sample`)."""

    block_size: int
    nodes: int
    lookup: int
    steps: int
    span_pages: int
    sample: bool = False


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def decode_tree_steps(models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array,
                      history_BxS: jax.Array | None, history_len_B: jax.Array | None,
                      loop: TreeLoop) -> tuple[SpecState, jax.Array, jax.Array, jax.Array]:
    """`speculative.decode_steps` with tree steps, of the static shape `loop` (`TreeLoop`): up to `steps` of
    `propose_topk` + `build_tree` + `verify_tree` in one device loop, with the same exit rules and outputs (tokens
    [steps, B, K], accepted n [steps, B], steps run). lookup > 0 merges a prompt-lookup path of that many nodes into
    each tree, found on the device (`lookup_paths`) in each slot's token history (history_BxS: prompt and output so
    far, its first history_len_B entries real, the last the pending token), to which each step appends its output.
    `sample`: sampled rows draw the drafter's nodes from its law (`propose_topk`). Each step is the same computation
    as one engine step at R = 1 (the same trees, outputs and state)."""
    block_size, nodes, lookup, steps = loop.block_size, loop.nodes, loop.lookup, loop.steps
    span_pages, sample = loop.span_pages, loop.sample
    m = nodes - 1 - lookup
    span = span_pages * state.target.page_size

    def step(st: SpecState, hist: tuple[jax.Array, jax.Array] | None) -> tuple[SpecState, Any, jax.Array, jax.Array]:
        ranked = propose_topk(models, st, block_size, m, span, sample)
        extra = extra_len = None
        if lookup:
            extra, extra_len = lookup_paths(*hist, lookup)
            extra_len = jnp.where(st.active, extra_len, 0)
        tree = build_tree(*ranked[:2], st.pending, nodes, extra, extra_len, *ranked[2:])
        st, out, n, _ = _verify_tree(models, st, tree, block_size, span_pages, False)
        if lookup:
            hist = append_history(*hist, out, jnp.where(st.active, n + 1, 0))
        return st, hist, out, n

    hist = (history_BxS, history_len_B) if lookup else None
    return run_steps(step, state, hist, stop_ids_BxZ, budget_B, block_size, steps)


__all__ = ["Tree", "TreeLoop", "build_tree", "decode_tree_steps", "propose_topk", "rank_drafts", "tree_problems",
           "verify_tree", "verify_tree_logprobs"]
