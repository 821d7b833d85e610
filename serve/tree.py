"""Tree drafting and tree verification (docs/design.md §4.4): a best-first token tree built from one DFlash block's
per-position distributions, verified in one target pass with an ancestor-only mask over the paged cache.

    ids, logp = propose_topk(models, state, block_size=K, m=N - 1, span=span)    # [B, K-1, M] each
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
plus the target's token after it, equal to AR decoding. Sampled: at each node, its children c_1, c_2, .. (distinct
tokens, fixed before the target is read; each is a one-hot draft) are tried in order by recursive rejection
sampling (SpecInfer): c_j is accepted with probability r_j(c_j) where r_1 = p and r_{j+1} is r_j with c_j
removed, renormalised, i.e. p(c_j) / (1 - p(c_1) - .. - p(c_{j-1})); if every child is rejected the next token
is drawn from p with all the children removed, renormalised (from p itself where the children held all of p and
float32 rounding rejected them all: `speculative.residual_logprobs`). Each emitted token then has exactly the target's
filtered distribution p given the path so far (each sibling's draft distribution is the one-hot of its token,
and that is what its residual removes). Only the accepted path is kept: its K/V are copied onto tokens
L .. L + n (`PagedKVCache.copy_tokens`), its target features go to the draft cache, and L moves by n + 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.decoder import embed, forward_cached
from dflash.models.drafter import block_token_ids, drafter_logits
from dflash.serve.lookup import append_history, lookup_paths
from dflash.serve.paged import TreeChunkCache
from dflash.serve.sampling import row_logprobs
from dflash.serve.speculative import (
    Models,
    SpecState,
    TokenLogprobs,
    _add_context,
    _layer_ids,
    residual_logprobs,
    run_steps,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """N nodes per slot: token [B, N] int32 (node 0: the pending token), parent [B, N] int32 (-1: the root, and
    unused nodes, which are no node's child), depth [B, N] int32 (root 0)."""

    token: jax.Array
    parent: jax.Array
    depth: jax.Array

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


@functools.partial(jax.jit, static_argnames=("block_size", "m", "span"))
def propose_topk(models: Models, state: SpecState, block_size: int, m: int,
                 span: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The drafter's M most likely tokens at block positions 1 .. K-1 and their log-probabilities, most likely
    first: (ids [B, K-1, M] int32, logp [B, K-1, M] fp32), from one forward over [pending, MASK x (K-1)] (as
    `speculative.propose`; a draft vocabulary ranks only its rows). A path-selector drafter, whose positions are
    not independent, is refused by the plan (`plan.Tree.check`)."""
    drafter = models.drafter()
    k = block_size
    ids = block_token_ids(state.pending, k, drafter.arch.mask_token_id)
    positions = state.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    span = state.draft.k.shape[2] if span is None else min(span, state.draft.k.shape[2])
    ctx_valid = jnp.arange(span)[None, :] < state.lengths[:, None]
    ctx_kv = [(k_ctx[:, :span], v_ctx[:, :span]) for k_ctx, v_ctx in state.draft.kv()]
    hidden = drafter.draft_block(embed(models.target_params, ids).astype(jnp.float32), positions, ctx_kv, ctx_valid)
    if models.draft_ids is not None:
        logits = jnp.einsum("bkd,vd->bkv", hidden[:, 1:], models.draft_head).astype(jnp.float32)
    else:
        logits = drafter_logits(models.target_params, models.target_cfg, hidden[:, 1:]).astype(jnp.float32)
    values, rank_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), min(m, logits.shape[-1]))
    if models.draft_ids is not None:
        rank_ids = jnp.take(models.draft_ids, rank_ids)
    return rank_ids.astype(jnp.int32), values


def _best_first(ids_DxM: jax.Array, logp_DxM: jax.Array, nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One slot's best-first tree of `nodes` nodes (root included) from per-depth ranked lists: (token, parent,
    depth), each [nodes]; the root's token is left 0."""
    d_max, m = ids_DxM.shape
    c = 2 * nodes  # candidates: each pop adds at most two (first child, next sibling)
    neg = jnp.float32(-jnp.inf)
    score = jnp.full((c,), neg).at[0].set(logp_DxM[0, 0])
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
        token = token.at[i].set(jnp.where(ok, ids_DxM[d - 1, r], 0))
        node_parent = node_parent.at[i].set(jnp.where(ok, parent[j], -1))
        node_depth = node_depth.at[i].set(jnp.where(ok, d, 0))
        score = score.at[j].set(neg)
        child = jnp.where(ok & (d < d_max), s + logp_DxM[jnp.minimum(d, d_max - 1), 0], neg)
        sibling = jnp.where(ok & (r + 1 < m), s - logp_DxM[d - 1, r] + logp_DxM[d - 1, jnp.minimum(r + 1, m - 1)],
                            neg)
        a, b = 2 * i - 1, 2 * i  # free candidate slots after i pops
        score = score.at[a].set(child).at[b].set(sibling)
        parent = parent.at[a].set(i).at[b].set(parent[j])
        depth = depth.at[a].set(d + 1).at[b].set(d)
        rank = rank.at[a].set(0).at[b].set(r + 1)
        return score, parent, depth, rank, token, node_parent, node_depth

    carry = jax.lax.fori_loop(1, nodes, pop, (score, parent, depth, rank, token, node_parent, node_depth))
    return carry[4], carry[5], carry[6]


def _merge_path(token: jax.Array, parent: jax.Array, depth: jax.Array, path_G: jax.Array, length: jax.Array, *,
                start: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Insert one extra path (its first `length` tokens of path_G) from the root as a trie: a token that is
    already a child of the current node is followed, else it becomes node start + g. Unused nodes stay
    childless (parent -1)."""
    index = jnp.arange(token.shape[0])

    def insert(g, carry):
        token, parent, depth, cur = carry
        t = path_G[g]
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

    token, parent, depth, _ = jax.lax.fori_loop(0, path_G.shape[0], insert, (token, parent, depth, jnp.int32(0)))
    return token, parent, depth


@functools.partial(jax.jit, static_argnames=("nodes",))
def build_tree(ids_BxDxM: jax.Array, logp_BxDxM: jax.Array, pending_B: jax.Array, nodes: int,
               extra_BxG: jax.Array | None = None, extra_len_B: jax.Array | None = None) -> Tree:
    """Each slot's tree of `nodes` nodes: the root (pending token), then the most probable paths best-first from
    the ranked lists (depth <= D), then, with `extra_BxG`, one extra path per slot (its first extra_len[b]
    tokens, e.g. a prompt-lookup continuation) merged in as a trie on the last G nodes."""
    g = 0 if extra_BxG is None else extra_BxG.shape[1]
    if not 1 <= g + 1 < nodes:
        raise ValueError(f"nodes must exceed 1 + the extra path's length ({g}); received nodes={nodes}")
    if g > ids_BxDxM.shape[1]:  # a deeper path would be verified past the block: K - 1 drafts at most
        raise ValueError(f"the extra path's length must be <= the tree's depth K - 1 = {ids_BxDxM.shape[1]}; "
                         f"received {g}")
    token, parent, depth = jax.vmap(functools.partial(_best_first, nodes=nodes - g))(ids_BxDxM, logp_BxDxM)
    if g:
        pad = ((0, 0), (0, g))
        token, parent, depth = jnp.pad(token, pad), jnp.pad(parent, pad, constant_values=-1), jnp.pad(depth, pad)
        token, parent, depth = jax.vmap(functools.partial(_merge_path, start=nodes - g))(
            token, parent, depth, extra_BxG.astype(jnp.int32), extra_len_B.astype(jnp.int32))
    return Tree(token.at[:, 0].set(pending_B), parent, depth)


def tree_problems(tree: Tree, max_depth: int) -> list[str]:
    """What breaks the rules the walk relies on, on the host (for tests and debugging; `build_tree` keeps them by
    construction): node 0 the root (parent -1, depth 0); a used node's parent comes before it and its depth is
    its parent's + 1, at most `max_depth` (K - 1); siblings carry distinct token ids (recursive rejection
    sampling removes each rejected sibling's token from the residual, so a repeated one would be tried against
    mass it no longer has). Unused nodes (parent -1 past the root) are ignored. [] when the tree is sound."""
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


def _walk(tree: Tree, logits_BxNxV: jax.Array, state: SpecState, max_depth: int
          ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(path [B, D+1] node ids (path[:, 0] = 0; entries past n repeat node 0), n accepted [B], bonus [B], next
    keys): greedy rows follow the argmax, sampled rows recursive rejection sampling (module docstring). A batch
    of greedy rows never runs the sampling branch (`lax.cond`)."""
    b, n_nodes, vocab = logits_BxNxV.shape
    rows = jnp.arange(b)
    greedy = state.sampling.greedy
    argmax_BxN = jnp.argmax(logits_BxNxV, axis=-1).astype(jnp.int32)

    def run(sampled: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        if sampled:
            keys = jax.vmap(lambda key: jax.random.split(key, 3))(state.rng)
            u_BxDxN = jax.vmap(lambda key: jax.random.uniform(key, (max_depth, n_nodes)))(keys[:, 1])
            logp = row_logprobs(logits_BxNxV, state.sampling)  # [B, N, V]; greedy rows unused
            # p(token of node j | its parent's path): the target's filtered probability at the parent
            p_tok_BxN = jnp.exp(logp[rows[:, None], jnp.maximum(tree.parent, 0), tree.token])
        cur = jnp.zeros((b,), jnp.int32)
        going = jnp.ones((b,), bool)
        n = jnp.zeros((b,), jnp.int32)
        path = [cur]
        for d in range(max_depth):
            child = tree.parent == cur[:, None]
            ok = tree.token == argmax_BxN[rows, cur][:, None]
            if sampled:
                mass = jnp.where(child, p_tok_BxN, 0.0)
                ratio = p_tok_BxN / jnp.maximum(1.0 - (jnp.cumsum(mass, axis=1) - mass), 1e-30)
                ok = jnp.where(greedy[:, None], ok, u_BxDxN[:, d] < ratio)
            ok = child & ok
            step = going & jnp.any(ok, axis=1)
            nxt = jnp.argmax(ok, axis=1).astype(jnp.int32)  # the first accepted child, in sibling order
            cur = jnp.where(step, nxt, cur)
            n = n + step
            going = step
            path.append(jnp.where(step, nxt, 0))
        bonus, rng = argmax_BxN[rows, cur], state.rng
        if sampled:
            removed_BxV = jnp.zeros((b, vocab), bool).at[rows[:, None], tree.token].max(tree.parent == cur[:, None])
            residual = residual_logprobs(logp[rows, cur], removed_BxV)  # children covering p: p itself
            drawn = jax.vmap(jax.random.categorical)(keys[:, 2], residual).astype(jnp.int32)
            bonus = jnp.where(greedy, bonus, drawn)
            rng = jnp.where(greedy[:, None], rng, keys[:, 0])
        return jnp.stack(path, axis=1), n, bonus, rng

    return jax.lax.cond(jnp.all(greedy), lambda _: run(False), lambda _: run(True), None)


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
    path, n, bonus, rng = _walk(tree, logits, state, d_max)
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
    new_state = SpecState(cache.rollback(new_len), draft, new_len, jnp.where(state.active, bonus, state.pending),
                          state.active, jnp.where(state.active[:, None], rng, state.rng), state.sampling)
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


@functools.partial(jax.jit, static_argnames=("block_size", "nodes", "lookup", "steps", "span_pages"),
                   donate_argnames=("state",))
def decode_tree_steps(models: Models, state: SpecState, stop_ids_BxS: jax.Array, budget_B: jax.Array,
                      history_BxH: jax.Array | None, history_len_B: jax.Array | None, block_size: int, nodes: int,
                      lookup: int, steps: int, span_pages: int) -> tuple[SpecState, jax.Array, jax.Array, jax.Array]:
    """`speculative.decode_steps` with tree steps: up to `steps` of `propose_topk` + `build_tree` +
    `verify_tree` in one device loop, with the same exit rules and outputs (tokens [steps, B, K], accepted n
    [steps, B], steps run). lookup > 0 merges a prompt-lookup path of that many nodes into each tree, found on the
    device (`lookup_paths`) in each slot's token history (history_BxH: prompt and output so far, its first
    history_len_B entries real, the last the pending token), to which each step appends its output. Each step is
    the same computation as one engine step at R = 1 (the same trees, outputs and state)."""
    m = nodes - 1 - lookup
    span = span_pages * state.target.page_size

    def step(st: SpecState, hist: tuple[jax.Array, jax.Array] | None) -> tuple[SpecState, Any, jax.Array, jax.Array]:
        ids, logp = propose_topk(models, st, block_size, m, span)
        extra = extra_len = None
        if lookup:
            extra, extra_len = lookup_paths(*hist, lookup)
            extra_len = jnp.where(st.active, extra_len, 0)
        st, out, n, _ = _verify_tree(models, st, build_tree(ids, logp, st.pending, nodes, extra, extra_len),
                                     block_size, span_pages, False)
        if lookup:
            hist = append_history(*hist, out, jnp.where(st.active, n + 1, 0))
        return st, hist, out, n

    hist = (history_BxH, history_len_B) if lookup else None
    return run_steps(step, state, hist, stop_ids_BxS, budget_B, block_size, steps)


__all__ = ["Tree", "build_tree", "decode_tree_steps", "propose_topk", "tree_problems", "verify_tree",
           "verify_tree_logprobs"]
