"""The DFlash training objective (docs/design.md §4.2) as plain, jit-friendly functions (static N and K, no
data-dependent shapes): anchors (`sample_anchors`), same-position blocks (`build_blocks` -> `Blocks`: which
logit predicts which token), the attention visibility contract (`visible`, the dense statement of which key each
query may see; training uses `models.drafter.BlockVisibility`, tested equal to it), and the loss the train step
runs: `head_loss`, the frozen LM head (`TrainHead`) and a weighted cross-entropy in chunks of rows, with the
decay weights of the paper or D-PACE's (`Objective`).

Shapes in names follow the dimension alphabet of docs/architecture.md (here also Q = N*K block queries, J = K-1
labelled slots, R = B*N*J loss rows, Rc the rows of one head chunk, Y the target's stored top-k, M loss quantities).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dflash.data.batch import SoftLabels, TrainBatch
from dflash.train.config import LOSS_TERMS

# Paper values (docs/design.md §4.2): block size K -> decay gamma.
PAPER_GAMMA: dict[int, float] = {8: 4.0, 10: 5.0, 16: 7.0}


# ----------------------------------------------------------------------------- anchors


def valid_anchor_positions(loss_mask_S: jax.Array) -> jax.Array:
    """bool [S]: p is a valid anchor iff loss_mask[p] == 1 and loss_mask[p+1] == 1 (so p + 1 < S).

    A valid anchor therefore always has at least one label (index k = 1).
    """
    m_S = jnp.asarray(loss_mask_S) > 0
    next_S = jnp.concatenate([m_S[1:], jnp.zeros((1,), bool)])
    return m_S & next_S


def sample_anchors(loss_mask_S: jax.Array, num_anchors: int, block_size: int, rng: jax.Array,
                   walk_S: jax.Array | None = None, walk_count: int = 0) -> tuple[jax.Array, jax.Array]:
    """Sample up to N distinct valid anchors uniformly without replacement; pad to the static N.

    Returns (anchors_N int32, keep_N bool). Kept anchors come first, in increasing position order;
    padding slots have keep=False and anchor 0 (a dummy in range; `build_blocks` masks them out).
    Deterministic for a given `rng`; resampling each epoch = passing a new key.
    `block_size` (K) does not restrict the choice: blocks may run past the end (labels are masked there);
    it is only checked (K >= 2) so call sites read the same as `build_blocks`.
    Implementation: top-N of iid uniform scores over the valid positions (= a uniform random subset).

    Serving-walk anchors (`walk_S` f32 [S], > 0 at the walk's block starts: their weights; `walk_count` > 0, static,
    `train.walk_anchors`): first up to `walk_count` valid walk positions are drawn without replacement with
    probability by weight (Gumbel top-k: log w + Gumbel noise from `fold_in(rng, 1)`; one draw picks position i
    with probability w_i / sum w), then the remaining N - (those drawn) uniformly among the other valid
    positions, by the same uniform scores as without a walk. With `walk_S` None or `walk_count` 0 the draw is the
    plain one, bit for bit.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1; received {num_anchors}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (index 0 is the anchor); received {block_size}")
    valid_S = valid_anchor_positions(loss_mask_S)
    S = valid_S.shape[0]
    scores_S = jnp.where(valid_S, jax.random.uniform(rng, (S,)), -1.0)
    if walk_S is not None and walk_count > 0:
        w_S = jnp.asarray(walk_S, jnp.float32)
        on_S = valid_S & (w_S > 0)
        keys_S = jnp.where(on_S, jnp.log(jnp.where(on_S, w_S, 1.0)) + jax.random.gumbel(jax.random.fold_in(rng, 1),
                                                                                           (S,)), -jnp.inf)
        top_Nw, idx_Nw = jax.lax.top_k(keys_S, min(walk_count, S))
        drawn_S = jnp.zeros((S,), bool).at[idx_Nw].set(top_Nw > -jnp.inf)
        scores_S = jnp.where(drawn_S, 2.0, scores_S)  # above every uniform score: kept first
    if num_anchors > S:  # static: top_k needs at least N candidates
        scores_S = jnp.concatenate([scores_S, jnp.full((num_anchors - S,), -1.0, scores_S.dtype)])
    top_N, idx_N = jax.lax.top_k(scores_S, num_anchors)
    sentinel = S + num_anchors
    sorted_N = jnp.sort(jnp.where(top_N >= 0, idx_N, sentinel))
    keep_N = sorted_N < sentinel
    anchors_N = jnp.where(keep_N, sorted_N, 0).astype(jnp.int32)
    return anchors_N, keep_N


def sample_anchors_batch(loss_mask_BxS: jax.Array, num_anchors: int, block_size: int, rng: jax.Array,
                         walk_BxS: jax.Array | None = None, walk_count: int = 0) -> tuple[jax.Array, jax.Array]:
    """`sample_anchors` per row with independent keys split from `rng`: (anchors_BxN, keep_BxN); with `walk_BxS`
    and `walk_count` > 0, up to `walk_count` of each row's anchors come from its serving walk."""
    keys_B = jax.random.split(rng, loss_mask_BxS.shape[0])
    if walk_BxS is None or walk_count == 0:
        return jax.vmap(lambda m, r: sample_anchors(m, num_anchors, block_size, r))(loss_mask_BxS, keys_B)
    return jax.vmap(lambda m, r, w: sample_anchors(m, num_anchors, block_size, r, w, walk_count))(
        loss_mask_BxS, keys_B, walk_BxS)


# ----------------------------------------------------------------------------- blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """N blocks of K slots flattened to Q = N*K queries (query q = j*K + k); a leading B when batched.

    Which logit predicts which token (SAME-POSITION, docs/design.md §4.1 and §8 pitfall 2): block j starts at
    anchor a_j; its K slots hold ids [x_{a_j}, MASK x (K-1)] at positions a_j + 0..K-1. The output at block
    index k >= 1 predicts x_{a_j + k} (the token AT that slot's position, not the next one: no +1 shift).
    Index 0 is the known anchor token and has no label.

    block_ids            int32 [Q]  x_{a_j} at k = 0, mask_token_id at k >= 1
    block_pos            int32 [Q]  a_j + k (may exceed S-1: blocks run past the end)
    labels               int32 [Q]  x_{a_j+k} where k >= 1 and a_j+k < S, else 0 (read with label_mask)
    label_mask           f32   [Q]  1 iff k >= 1, a_j+k < S, loss_mask[a_j+k] == 1 and block j is kept
    block_index_in_block int32 [Q]  k
    anchor_of_query      int32 [Q]  a_j, or -1 for padding blocks (keep=False)
    block_of_query       int32 [Q]  j
    soft_ids             int32 [Q, Y] or None  with soft labels (`data.labels: soft`): the target's Y most
                                    likely tokens at a_j+k (after tokens[:a_j+k]), 0 where label_mask is 0
    soft_probs           f32   [Q, Y] or None  their probabilities, 0 where label_mask is 0
    """

    block_ids: jax.Array
    block_pos: jax.Array
    labels: jax.Array
    label_mask: jax.Array
    block_index_in_block: jax.Array
    anchor_of_query: jax.Array
    block_of_query: jax.Array
    soft_ids: jax.Array | None = None
    soft_probs: jax.Array | None = None


def build_blocks(row: TrainBatch, anchors_N: jax.Array, keep_N: jax.Array, block_size: int,
                 mask_token_id: int | jax.Array) -> Blocks:
    """Build the N blocks of one sequence (contract in `Blocks`) from `row`, a `TrainBatch` of one row (every
    field without its leading B; `row.features` is not read).

    Labels are SAME-POSITION: slot k of the block at anchor a is labelled with tokens[a + k].

    Target labels (`row.labels` a `TargetLabels`, `data.labels: target`): next_ids[p] is the target's own greedy
    choice after position p (-1 where unknown). Then slot k is labelled with next_ids[a + k - 1], the token the
    target itself would emit there, and only while the text inside the block agrees with the target
    (tokens[a + j] == next_ids[a + j - 1] for 1 <= j < k): past the first disagreement the target's own
    continuation is unknown. On the target's own greedy answers this gives the text's labels; on reference
    answers every anchor still has its slot-1 label (the target's next token), which is exactly what
    speculative decoding must predict.

    Packed rows (`row.segment_ids`, `data.pack`): a slot whose position belongs to another conversation than its
    anchor's is not labelled (a block never runs into the next one).

    Soft labels (`row.labels` a `SoftLabels`, `data.labels: soft`): the target's Y most likely tokens after each
    position ([S, Y] ids and probabilities) besides its argmax (next_ids, read as target labels); slot k then
    also carries those stored at a + k - 1 (the distribution its hard label is the argmax of), zeroed where it
    is not labelled.
    """
    tokens_S, loss_mask_S, segment_S = row.tokens, row.loss_mask, row.segment_ids
    next_ids_S = row.next_ids
    K = block_size
    S = tokens_S.shape[0]
    N = anchors_N.shape[0]
    tokens_S = jnp.asarray(tokens_S, jnp.int32)
    a_Nx1 = jnp.asarray(anchors_N, jnp.int32)[:, None]
    keep_Nx1 = jnp.asarray(keep_N, bool)[:, None]
    k_1xK = jnp.arange(K, dtype=jnp.int32)[None, :]

    pos_NxK = a_Nx1 + k_1xK
    in_range_NxK = pos_NxK < S
    at_NxK = tokens_S[jnp.clip(pos_NxK, 0, S - 1)]
    ids_NxK = jnp.where(k_1xK == 0, at_NxK, jnp.asarray(mask_token_id, jnp.int32))
    labelled_NxK = (k_1xK >= 1) & in_range_NxK
    if next_ids_S is not None:
        target_NxK = jnp.asarray(next_ids_S, jnp.int32)[jnp.clip(pos_NxK - 1, 0, S - 1)]  # the target's pick at a+k
        agrees_NxK = (at_NxK == target_NxK) | (k_1xK == 0)  # slot j's text is the target's own choice
        on_path_NxK = jnp.cumprod(jnp.concatenate([jnp.ones((N, 1), bool), agrees_NxK[:, :-1]], axis=1)
                                  .astype(jnp.int32), axis=1) > 0  # slots 1..k-1 all agree
        labelled_NxK = labelled_NxK & on_path_NxK & (target_NxK >= 0)
        at_NxK = jnp.where(k_1xK >= 1, target_NxK, at_NxK)
    labels_NxK = jnp.where(labelled_NxK, at_NxK, 0)
    assistant_NxK = jnp.asarray(loss_mask_S)[jnp.clip(pos_NxK, 0, S - 1)] > 0
    if segment_S is not None:
        seg_S = jnp.asarray(segment_S)
        assistant_NxK = assistant_NxK & (seg_S[jnp.clip(pos_NxK, 0, S - 1)] == seg_S[a_Nx1])
    label_mask_NxK = (labelled_NxK & assistant_NxK & keep_Nx1).astype(jnp.float32)

    def flat(x_NxK: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x_NxK, (N, K)).reshape(N * K).astype(x_NxK.dtype)

    soft_ids = soft_probs = None
    if isinstance(row.labels, SoftLabels):
        at_NxK = jnp.clip(pos_NxK - 1, 0, S - 1)
        on_NxKx1 = (label_mask_NxK > 0)[..., None]
        soft_ids = jnp.where(on_NxKx1, jnp.asarray(row.labels.ids, jnp.int32)[at_NxK], 0).reshape(N * K, -1)
        soft_probs = jnp.where(on_NxKx1, jnp.asarray(row.labels.probs, jnp.float32)[at_NxK], 0.0).reshape(N * K, -1)

    return Blocks(
        block_ids=flat(ids_NxK.astype(jnp.int32)),
        block_pos=flat(pos_NxK),
        labels=flat(labels_NxK.astype(jnp.int32)),
        label_mask=flat(label_mask_NxK),
        block_index_in_block=flat(k_1xK),
        anchor_of_query=flat(jnp.where(keep_Nx1, a_Nx1, -1)),
        block_of_query=flat(jnp.arange(N, dtype=jnp.int32)[:, None]),
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def build_blocks_batch(batch: TrainBatch, anchors_BxN: jax.Array, keep_BxN: jax.Array, block_size: int,
                       mask_token_id: int | jax.Array) -> Blocks:
    """`build_blocks` per row of `batch`; every field gains a leading B."""
    rows = dataclasses.replace(batch, features=None)  # the features are not read
    return jax.vmap(lambda row, a, k: build_blocks(row, a, k, block_size, mask_token_id))(rows, anchors_BxN, keep_BxN)


# ----------------------------------------------------------------------------- attention visibility


def visible(anchor_of_query_Q: jax.Array, block_of_query_Q: jax.Array, ctx_valid_S: jax.Array,
            key_block_Q: jax.Array, window: int = 0) -> jax.Array:
    """bool [Q, S+Q]: may block query q attend to key t? Keys are laid out [context S | block Q].

    Contract (query q in block j = block_of_query[q], anchor a_j = anchor_of_query[q]):
      - context key s (column s < S):      visible iff s < a_j STRICTLY and ctx_valid[s]; in a sliding-window
                                           layer (`window` W > 0) also s >= a_j - W: the last W positions;
      - block key q' (column S + q'):      visible iff key_block[q'] == j (same block, bidirectional);
      - any key, padding query (a_j = -1): never visible (the row is all False).
    `key_block_Q` is the block id of each block key (normally `block_of_query` itself). Strictly, because
    at inference the context holds target features only for positions before the block's first token
    (docs/decisions.md D10). This is the dense reference; the drafter's training forward uses the
    block-local `models.drafter.BlockVisibility.from_anchors`, the same on every kept query.
    Built by broadcasting from O(S + Q) inputs; nothing of size Q x (S+Q) is stored per example.
    A row that is all False belongs to a padding block: the attention kernel must tolerate it (e.g. a
    finite NEG_INF bias gives a uniform, finite row whose output is never labelled). Every kept query
    sees at least its own block, so kept rows are never empty.
    """
    a_Qx1 = jnp.asarray(anchor_of_query_Q)[:, None]
    kept_Qx1 = a_Qx1 >= 0
    s_1xS = jnp.arange(ctx_valid_S.shape[0])[None, :]
    ctx_QxS = (s_1xS < a_Qx1) & (jnp.asarray(ctx_valid_S)[None, :] > 0) & kept_Qx1
    if window > 0:
        ctx_QxS = ctx_QxS & (s_1xS >= a_Qx1 - window)
    blk_QxQ = (jnp.asarray(block_of_query_Q)[:, None] == jnp.asarray(key_block_Q)[None, :]) & kept_Qx1
    return jnp.concatenate([ctx_QxS, blk_QxQ], axis=1)


# ----------------------------------------------------------------------------- loss


def default_gamma(block_size: int) -> float:
    """Decay gamma for block size K: the paper's values (K=8 -> 4, 10 -> 5, 16 -> 7), elsewhere
    piecewise-linear interpolation through those three points, extrapolated with the nearest segment's
    slope (1/2 per slot below 8, 1/3 per slot above 16; e.g. K=32 -> 12.33, K=64 -> 23), floored at 1.

    Why this rule: it reproduces the paper exactly, commits to nothing between its points, and above
    16 it keeps the last slot's relative weight exp(-(K-2)/gamma) shrinking towards exp(-3), so wide
    blocks still emphasise early slots as the prefix-product acceptance does. (K/2.3 rounded does not
    reproduce K=10 -> 5 or K=8 -> 4.) For wide K this is a starting point to sweep, not a paper value.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2; received {block_size}")
    ks = sorted(PAPER_GAMMA)
    if block_size in PAPER_GAMMA:
        return PAPER_GAMMA[block_size]
    if block_size < ks[0]:
        lo, hi = ks[0], ks[1]
    elif block_size > ks[-1]:
        lo, hi = ks[-2], ks[-1]
    else:
        hi = next(k for k in ks if k > block_size)
        lo = ks[ks.index(hi) - 1]
    slope = (PAPER_GAMMA[hi] - PAPER_GAMMA[lo]) / (hi - lo)
    return max(1.0, PAPER_GAMMA[lo] + slope * (block_size - lo))


def decay_weights(block_size: int, gamma: float) -> jax.Array:
    """f32 [K]: w_0 = 0 (the anchor slot has no label), w_k = exp(-(k-1)/gamma) for k >= 1."""
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0; received {gamma}")
    k_K = np.arange(block_size, dtype=np.float64)
    w_K = np.where(k_K >= 1, np.exp(-(k_K - 1.0) / gamma), 0.0)
    return jnp.asarray(w_K, jnp.float32)


def block_metrics(correct_BxQ: jax.Array, mask_BxQ: jax.Array, block_size: int) -> dict[str, jax.Array]:
    """Teacher-forced metrics from per-query top-1 hits (`correct`, already masked) and the label mask, queries
    laid out as N blocks of K slots (q = j*K + k).

    accuracy_per_position [K]: top-1 accuracy over labelled slots with index k (k = 0 is always 0);
    acceptance_length: mean over kept blocks (any labelled slot) of 1 + sum_{k>=1} prod_{1<=i<=k} c_i,
      where c_i = 1 iff slot i is labelled AND its argmax equals the label. An unlabelled slot (past the
      end of the sequence, or a non-assistant token) STOPS the chain: we only credit tokens we can check,
      so a block cut by the sequence end scores at most 1 + its labelled prefix;
    num_labels: sum m; num_blocks: kept blocks.
    """
    B, Q = mask_BxQ.shape
    K = block_size
    correct_BxNxK = jax.lax.stop_gradient(correct_BxQ).reshape(B, Q // K, K)
    mask_BxNxK = mask_BxQ.reshape(B, Q // K, K)
    hits_K = jnp.sum(correct_BxNxK, axis=(0, 1))  # slot k of every block (layout q = j*K + k)
    count_K = jnp.sum(mask_BxNxK, axis=(0, 1))
    chain_BxN = jnp.sum(jnp.cumprod(correct_BxNxK[..., 1:], axis=-1), axis=-1)
    kept_BxN = (jnp.sum(mask_BxNxK, axis=-1) > 0).astype(jnp.float32)
    num_blocks = jnp.sum(kept_BxN)
    return {
        "accuracy_per_position": hits_K / jnp.maximum(count_K, 1.0),
        "acceptance_length": jnp.sum(kept_BxN * (1.0 + chain_BxN)) / jnp.maximum(num_blocks, 1.0),
        "num_labels": jnp.sum(mask_BxQ),
        "num_blocks": num_blocks,
    }


def _check_blocks(Q: int, K: int) -> None:
    if Q % K:
        raise ValueError(f"queries Q must be a multiple of block_size K; received Q={Q}, K={K}")


def dense_loss(logits_BxQxV: jax.Array, labels_BxQ: jax.Array, label_mask_BxQ: jax.Array,
                k_index_BxQ: jax.Array, block_size: int, gamma: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """REFERENCE, not used by training (the step runs `head_loss`): the decay-weighted cross-entropy over the full
    vocab from materialised [B, Q, V] logits, in fp32, and the teacher-forced metrics. The tests hold
    `head_loss` against it (value, gradient, metrics), and benchmarks/train_step_variants.py times it as the
    dense baseline.

    loss = sum_q w_{k(q)} m_q CE_q / sum_q w_{k(q)} m_q (0 when nothing is labelled), where
    CE_q = -log_softmax(logits_q)[label_q] and m = label_mask. Queries must be laid out as N blocks of
    K consecutive slots (q = j*K + k), as `build_blocks` does. Metrics: `block_metrics`, plus
    weighted_count = sum w m.
    """
    B, Q, _ = logits_BxQxV.shape
    K = block_size
    _check_blocks(Q, K)
    logp_BxQxV = jax.nn.log_softmax(logits_BxQxV.astype(jnp.float32), axis=-1)
    labels_BxQ = jnp.asarray(labels_BxQ, jnp.int32)
    nll_BxQ = -jnp.take_along_axis(logp_BxQxV, labels_BxQ[..., None], axis=-1)[..., 0]
    mask_BxQ = jnp.asarray(label_mask_BxQ, jnp.float32)
    k_BxQ = jnp.broadcast_to(jnp.asarray(k_index_BxQ, jnp.int32), (B, Q))
    wm_BxQ = decay_weights(K, gamma)[k_BxQ] * mask_BxQ
    weighted_count = jnp.sum(wm_BxQ)
    loss = jnp.sum(wm_BxQ * nll_BxQ) / jnp.maximum(weighted_count, 1e-9)
    correct_BxQ = (jnp.argmax(logits_BxQxV, axis=-1) == labels_BxQ).astype(jnp.float32) * mask_BxQ
    return loss, {**block_metrics(correct_BxQ, mask_BxQ, K), "weighted_count": weighted_count}


# ----------------------------------------------------------------------------- the chunked LM head: one kernel


def auto_head_chunk(vocab_size: int, budget_elements: int = 1 << 25) -> int:
    """Rows per LM-head chunk so one chunk's fp32 logits hold about `budget_elements` (default 2^25:
    128 MiB), a multiple of 8, at least 8."""
    return max(8, (budget_elements // max(vocab_size, 1)) // 8 * 8)


def _map_chunks(fn: Callable[..., tuple[jax.Array, ...]], chunk: int, *rows: jax.Array) -> tuple[jax.Array, ...]:
    """`fn(*chunk_rows)` over the R rows of `rows` (each [R, ...]) in chunks of `chunk` rows (a sequential
    `lax.map`, so only one chunk's [chunk, V] logits are live at a time); rows are zero-padded to a multiple of
    `chunk` and the padding is cut from every output."""
    t = rows[0].shape[0]
    chunk = min(chunk, t)
    n = -(-t // chunk)
    pad = n * chunk - t
    split = [jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)).reshape(n, chunk, *x.shape[1:]) for x in rows]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return tuple(o.reshape(n * chunk, *o.shape[2:])[:t] for o in out)


# The per-row quantities the head kernel forms, each with its gradient: `nll`, the cross-entropy against the hard
# label; and against the target's stored top-k `ce` (renormalised), `tv`, `kl`, `rkl`. The loss terms built on
# them are `train.config.LOSS_TERMS` (`head_loss`).
DIVERGENCES = ("nll", "ce", "tv", "kl", "rkl")
RKL_FLOOR = 1e-6  # the target's 'other' mass below this counts as this much in the reverse KL (else it is infinite)


def _chunk_stats(h_RcxD: jax.Array, head: jax.Array, labels_Rc: jax.Array, ids_RcxY: jax.Array | None,
                 probs_RcxY: jax.Array | None, vocab_major: bool, names: tuple[str, ...],
                 with_grad: bool) -> tuple[jax.Array, ...]:
    """values [Rc, M] of the M quantities `names` (of DIVERGENCES), hard nll [Rc], top-1 hit [Rc] and (with_grad)
    d value_m / d h [Rc, M, D] f32 of one chunk of rows (contract in `head_divergences`).

    Logits z = h @ head in the compute dtype with fp32 accumulation; the softmax is fp32; the head's own gradient is
    never formed (the target is frozen). With p = softmax(z) over the head's rows, y the hard label, t_i the stored
    probabilities of the row's top-Y tokens (0 for an entry that is not a token of the head), the rest of the
    vocabulary one outcome 'other' (the drafter's mass there P_o = 1 - sum_Y p_i, formed as exp(logsumexp over the
    non-top-Y logits - lse) so it keeps its precision near 0; the target's r = 1 - sum t):
      nll = -log p_y
      ce  = -sum_Y t^_i log p_i, t^ = t / sum t  (the soft cross-entropy, renormalised; a row of zeros is 0)
      tv  = 1/2 (sum_Y |p_i - t_i| + |P_o - r|)
      kl  = sum_Y t_i log(t_i / p_i) + r log(r / P_o)
      rkl = sum_Y p_i log(p_i / t_i) + P_o log(P_o / max(r, RKL_FLOOR))
    Gradients w.r.t. the logits z, all of the form p_j (c_j - sum_l p_l c_l) with c the derivative by the
    outcome's probability (the 'other' tokens sharing theirs): nll: p - onehot(y); ce: p - t^; tv: p_j (s_j - sum
    p s), s = sign(p - t)/2 per outcome; kl: p (sum t + r) - t on Y - r p / P_o off Y; rkl: p_j (log(p_j / t_j) -
    rkl) (log(P_o / r) off Y)."""
    spec = "cd,vd->cv" if vocab_major else "cd,dv->cv"
    logits_RcxV = jnp.einsum(spec, h_RcxD, head.astype(h_RcxD.dtype), preferred_element_type=jnp.float32)
    Rc, V = logits_RcxV.shape
    rows_Rcx1 = jnp.arange(Rc)[:, None]
    lse_Rc = jax.nn.logsumexp(logits_RcxV, axis=-1)
    nll_Rc = lse_Rc - jnp.take_along_axis(logits_RcxV, labels_Rc[:, None], axis=-1)[:, 0]
    hit_Rc = (jnp.argmax(logits_RcxV, axis=-1) == labels_Rc).astype(jnp.float32)
    if set(names) - {"nll"}:  # the target's stored top-Y, and the drafter's mass on and off it
        on_RcxY = probs_RcxY > 0  # a stored token of the head (others carry no mass and may repeat id 0)
        t_RcxY = jnp.where(on_RcxY, probs_RcxY, 0.0)
        logp_RcxY = jnp.take_along_axis(logits_RcxV, ids_RcxY, axis=-1) - lse_Rc[:, None]
        p_RcxY = jnp.where(on_RcxY, jnp.exp(logp_RcxY), 0.0)
        other_RcxV = logits_RcxV.at[rows_Rcx1, ids_RcxY].add(jnp.where(on_RcxY, -jnp.inf, 0.0))
        lse_o_Rc = jax.nn.logsumexp(other_RcxV, axis=-1)
        logp_o_Rc = lse_o_Rc - lse_Rc
        p_o_Rc = jnp.exp(logp_o_Rc)
        mass_Rc = jnp.sum(t_RcxY, axis=-1)
        r_Rc = jnp.maximum(1.0 - mass_Rc, 0.0)
        log_t_RcxY = jnp.log(jnp.where(on_RcxY, t_RcxY, 1.0))
    xlogy = lambda x, y: jnp.where(x > 0, x * (jnp.log(jnp.where(x > 0, x, 1.0)) - y), 0.0)  # noqa: E731  x log(x) - x y
    values, grads = [], []
    p_RcxV = jnp.exp(logits_RcxV - lse_Rc[:, None]) if with_grad else None
    for name in names:
        if name == "nll":
            value = nll_Rc
            if with_grad:
                dz = p_RcxV - jax.nn.one_hot(labels_Rc, V, dtype=jnp.float32)
        elif name == "ce":
            that_RcxY = t_RcxY / jnp.maximum(mass_Rc, 1e-20)[:, None]
            value = -jnp.sum(jnp.where(on_RcxY, that_RcxY * logp_RcxY, 0.0), axis=-1)
            if with_grad:
                dz = (p_RcxV * jnp.sum(that_RcxY, axis=-1)[:, None]).at[rows_Rcx1, ids_RcxY].add(-that_RcxY)
        elif name == "tv":
            value = 0.5 * (jnp.sum(jnp.abs(p_RcxY - t_RcxY), axis=-1) + jnp.abs(p_o_Rc - r_Rc))
            if with_grad:
                s_RcxY = jnp.where(on_RcxY, 0.5 * jnp.sign(p_RcxY - t_RcxY), 0.0)
                s_o_Rc = 0.5 * jnp.sign(p_o_Rc - r_Rc)
                mean_Rc = jnp.sum(p_RcxY * s_RcxY, axis=-1) + p_o_Rc * s_o_Rc
                dz = (p_RcxV * (s_o_Rc - mean_Rc)[:, None]).at[rows_Rcx1, ids_RcxY].add(
                    p_RcxY * (s_RcxY - s_o_Rc[:, None]))
        elif name == "kl":
            value = (jnp.sum(jnp.where(on_RcxY, t_RcxY * (log_t_RcxY - logp_RcxY), 0.0), axis=-1)
                     + xlogy(r_Rc, logp_o_Rc))
            if with_grad:
                # p / P_o off the stored Y
                q_o_RcxV = jnp.exp(other_RcxV - jnp.where(jnp.isfinite(lse_o_Rc), lse_o_Rc, 0.0)[:, None])
                dz = (p_RcxV * (mass_Rc + r_Rc)[:, None] - r_Rc[:, None] * q_o_RcxV).at[rows_Rcx1, ids_RcxY].add(
                    -t_RcxY)
        elif name == "rkl":
            ratio_o_Rc = logp_o_Rc - jnp.log(jnp.maximum(r_Rc, RKL_FLOOR))
            ratio_RcxY = jnp.where(on_RcxY, logp_RcxY - log_t_RcxY, 0.0)
            value = jnp.sum(p_RcxY * ratio_RcxY, axis=-1) + jnp.where(p_o_Rc > 0, p_o_Rc * ratio_o_Rc, 0.0)
            if with_grad:
                dz = (p_RcxV * (ratio_o_Rc - value)[:, None]).at[rows_Rcx1, ids_RcxY].add(
                    p_RcxY * (ratio_RcxY - ratio_o_Rc[:, None]))
        else:
            raise ValueError(f"divergence names must be among {DIVERGENCES}; received {name!r}")
        values.append(value)
        if with_grad:
            back = "cv,vd->cd" if vocab_major else "cv,dv->cd"
            grads.append(jnp.einsum(back, dz.astype(h_RcxD.dtype), head.astype(h_RcxD.dtype),
                                    preferred_element_type=jnp.float32))
    values_RcxM = jnp.stack(values, axis=-1)
    if not with_grad:
        return values_RcxM, nll_Rc, hit_Rc
    return values_RcxM, nll_Rc, hit_Rc, jnp.stack(grads, axis=1)


def _over_chunks(h_RxD, head, labels_R, ids_RxY, probs_RxY, vocab_major, chunk, names,  # noqa: ANN001
                 with_grad) -> tuple[jax.Array, ...]:  # noqa: ANN001
    """`_chunk_stats` over R rows in chunks of `chunk` rows (`_map_chunks`); without stored top-k (hard labels
    only) the chunks carry no top-k arrays."""
    if ids_RxY is None:
        fn = lambda h, lab: _chunk_stats(h, head, lab, None, None, vocab_major, names, with_grad)  # noqa: E731
        return _map_chunks(fn, chunk, h_RxD, labels_R)
    fn = lambda h, lab, ids, probs: _chunk_stats(h, head, lab, ids, probs, vocab_major, names, with_grad)  # noqa: E731
    return _map_chunks(fn, chunk, h_RxD, labels_R, ids_RxY, probs_RxY)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def head_divergences(h_RxD: jax.Array, head: jax.Array, labels_R: jax.Array, ids_RxY: jax.Array | None,
                     probs_RxY: jax.Array | None, vocab_major: bool, chunk: int,
                     names: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one LM-head kernel of the loss, over hard labels and the target's stored top-k alike: (values [R, M] f32
    of the quantities `names` (of DIVERGENCES: `nll` against the hard label `labels_R`; `ce`, `tv`, `kl`, `rkl`
    against the stored top-Y; see `_chunk_stats`), hard nll [R] f32, top-1 hit [R] f32) of rows `h_RxD` through
    the frozen LM head `head` ([V, D] when `vocab_major`, a tied embedding or a training vocabulary's rows, else
    [D, V]), `chunk` rows at a time.

    The stored top-Y, `ids_RxY` with `probs_RxY`, are taken AS STORED (not renormalised: their sum is the mass the
    stored tokens of the head hold, the rest of the target's mass is the outcome 'other'; an entry of probability
    0 is not a token, a row of zeros a row without loss, whose values are all 0); both are None with hard labels
    only (`names` then ("nll",)). Differentiable in `h` through the values only: under `jax.grad` the forward also
    forms d value_m / d h per chunk (softmax minus the target, times the head) and keeps that [R, M, D] array
    instead of any [R, V] one, so the backward is a weighted sum: one head matmul forward and one back per value,
    no recomputation, temporary memory O(chunk * V) whatever R (SpecForge's checkpointed chunks recompute the
    forward). The nll and hit outputs carry no gradient."""
    return _over_chunks(h_RxD, head, labels_R, ids_RxY, probs_RxY, vocab_major, chunk, names, False)


def _head_divergences_fwd(h_RxD, head, labels_R, ids_RxY, probs_RxY, vocab_major, chunk, names):  # noqa: ANN001, ANN202
    values, nll_R, hit_R, dh_RxMxD = _over_chunks(h_RxD, head, labels_R, ids_RxY, probs_RxY, vocab_major, chunk,
                                                  names, True)
    return (values, nll_R, hit_R), dh_RxMxD.astype(h_RxD.dtype)


def _head_divergences_bwd(vocab_major, chunk, names, res, cotangents):  # noqa: ANN001, ANN202 (custom_vjp rule)
    g_RxM = cotangents[0]
    none = (None,) * 4  # the head (frozen), the labels and the stored top-k get no gradient
    if g_RxM.shape[1] == 1:  # one value: a rescale of its row gradients
        return (g_RxM[:, :1].astype(res.dtype) * res[:, 0], *none)
    return (jnp.einsum("tm,tmd->td", g_RxM.astype(res.dtype), res), *none)


head_divergences.defvjp(_head_divergences_fwd, _head_divergences_bwd)


@dataclasses.dataclass(frozen=True)
class Objective:
    """The training loss (static: it is part of the compiled step).

    kind: the per-slot weighting, `decay`, the paper's fixed weights w_k = exp(-(k-1)/gamma) (`decay_weights`),
      or `dpace` (D-PACE, arXiv 2605.18810, `dpace_weights`): weights from the drafter's own confidence in the
      label, recomputed every step without gradient.
    terms: the loss terms and their weights, ((name, weight), ...) of LOSS_TERMS (`head_loss`); ce alone is the
      cross-entropy every recipe trained with before; any other needs soft labels.
    gamma: decay of `decay`. dpace_alpha: confidence floor of `dpace`, in (0, 1].
    opd_gamma: the decay, per slot past a block's first rejection, of the `opd` term's reverse KL, in (0, 1].
    head_chunk: rows of the LM head + CE per chunk (0: `auto_head_chunk(V)`).
    selector_weight: the path selector's loss (`train.selector`) weight in the drafter's loss (read only for a
      drafter with `drafter.selector`).
    """

    kind: str = "decay"
    gamma: float = 4.0
    dpace_alpha: float = 0.5
    head_chunk: int = 0
    terms: tuple[tuple[str, float], ...] = (("ce", 1.0),)
    opd_gamma: float = 0.5
    selector_weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.selector_weight >= 0 and np.isfinite(self.selector_weight)):
            raise ValueError(f"selector_weight must be finite and >= 0; received {self.selector_weight}")
        if self.kind not in ("decay", "dpace"):
            raise ValueError(f"kind must be 'decay' or 'dpace'; received {self.kind!r}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0; received {self.gamma}")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"dpace_alpha must lie in (0, 1]; received {self.dpace_alpha}")
        if self.head_chunk < 0:
            raise ValueError(f"head_chunk must be >= 0 (0: automatic); received {self.head_chunk}")
        names = [n for n, _ in self.terms]
        if not names or any(n not in LOSS_TERMS for n in names) or len(set(names)) != len(names):
            raise ValueError(f"terms must name each of {LOSS_TERMS} at most once, at least one; received {self.terms}")
        if any(not (w > 0 and np.isfinite(w)) for _, w in self.terms):
            raise ValueError(f"terms' weights must be finite and > 0; received {self.terms}")
        if not 0 < self.opd_gamma <= 1:
            raise ValueError(f"opd_gamma must lie in (0, 1]; received {self.opd_gamma}")

    @property
    def divergences(self) -> tuple[str, ...]:
        """The per-row divergences (of DIVERGENCES) the terms read from soft labels, in DIVERGENCES order; () for
        ce alone (the hard label's nll, or with soft labels the renormalised `ce`)."""
        names = {n for n, _ in self.terms}
        if names == {"ce"}:
            return ()
        need = names - {"opd"} | ({"kl", "rkl"} if "opd" in names else set())
        return tuple(n for n in DIVERGENCES if n in need)


def dpace_weights(nll_BxNxJ: jax.Array, mask_BxNxJ: jax.Array, alpha: float) -> jax.Array:
    """D-PACE position weights [B, N, J] over the J = K-1 labelled slots of each block (no gradient).

    q_i = exp(-CE_i) is the drafter's probability of the label, smoothed to q~_i = (1-alpha) q_i + alpha
    (1 on unlabelled slots, so they do not break the chain); C_j = prod_{i<=j} q~_i is the chance the
    block's prefix up to j is accepted; w_k = sum_{j>=k, labelled} C_j (0 on unlabelled slots): how many
    accepted tokens ride on slot k. With q = 1 the weights fall linearly, K-1 .. 1; the less confident
    the early slots, the steeper they fall.
    """
    q = jnp.exp(-jax.lax.stop_gradient(nll_BxNxJ))
    q_smooth = jnp.where(mask_BxNxJ > 0, (1.0 - alpha) * q + alpha, 1.0)
    c = jnp.cumprod(q_smooth, axis=-1) * mask_BxNxJ
    suffix = jnp.flip(jnp.cumsum(jnp.flip(c, axis=-1), axis=-1), axis=-1)
    return jax.lax.stop_gradient(suffix * mask_BxNxJ)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainHead:
    """The frozen LM head the training loss runs through (an argument of the step, traced, never trained).

    matrix:      [V', D] when `vocab_major` (a tied embedding, or a training vocabulary's rows) else [D, V]
    label_map:   int32 [V] or None: with a training vocabulary (`train.head_vocab`) token -> its row of `matrix`,
                 -1 for a token outside it (left out of the loss and the metrics); None: the full vocabulary
    vocab_major: static; the layout of `matrix`
    """

    matrix: jax.Array
    label_map: jax.Array | None = None
    vocab_major: bool = dataclasses.field(default=True, metadata={"static": True})


def head_loss(hidden_BxQxD: jax.Array, head: TrainHead, blocks: Blocks, block_size: int,
              objective: Objective) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted loss of `objective` from the drafter's normed hidden states through the frozen LM head `head`,
    without materialising [B, Q, V] logits: loss = sum_q w_q m_q L_q / sum_q w_q m_q, with the label mask m of
    `blocks`, the per-slot weights w of `objective.kind` (decay: exp(-(k-1)/gamma); dpace: from the drafter's
    confidence in the hard label) and L_q = sum over `objective.terms` of weight x term_q.

    Slot 0 of each block (the anchor, never labelled) is skipped before the head, so the head runs on
    B*N*(K-1) rows, `objective.head_chunk` rows at a time; see `head_divergences`, the one kernel every term runs
    through, hard labels included. With `decay` and `ce`, the same loss,
    gradient and metrics as the dense reference (full [B, Q, V] logits, tests/reference.py) in fp32.

    With a training vocabulary (`head.label_map`), the softmax runs over the subset's rows; a label outside it is
    left out of the loss and the metrics.

    `ce` with hard labels is the cross-entropy against label_q; with soft labels (`blocks.soft_ids` /
    `blocks.soft_probs` [B, Q, Y]) against the target's top-Y distribution at q, renormalised over the tokens the
    head holds (a slot none of whose Y tokens it holds is left out, whatever the terms). The other terms need soft
    labels and compare the drafter's distribution p with the target's t as stored (top-Y probabilities of the
    head's tokens, the rest of its mass, beyond its top Y or outside the head, one outcome 'other' against the
    drafter's mass off those Y tokens):
      tv:  total variation 1/2 |p - t|_1, the probability that speculative sampling rejects a token drawn from p
           when the target samples from t (at Y >= its support; with the tail as one outcome it is a lower bound);
      kl:  forward KL(t || p), mass-covering (its gradient is soft ce's plus the tail's);
      rkl: reverse KL(p || t), mode-seeking (the target's tail mass is floored at RKL_FLOOR, so drafter mass off
           the stored tokens is penalised but finite);
      opd: on-policy distillation per block (Draft-OPD, teacher-forced): slot k is accepted when it and every
           earlier labelled slot of its block are top-1 hits (an unlabelled slot stops the chain); accepted slots
           take kl, the first rejected slot and every later one rkl x opd_gamma^(slots past the first rejection).
    The weighting applies on top of every term: decay and dpace weigh slot k's whole L_q (dpace reading the hard
    label's confidence, as with ce); the metrics read the hard labels (the distribution's argmax). With more
    than `ce`, each term's weighted mean is reported as metric `loss/<term>`.
    """
    B, Q, D = hidden_BxQxD.shape
    K = block_size
    _check_blocks(Q, K)
    matrix, label_map, vocab_major = jax.lax.stop_gradient(head.matrix), head.label_map, head.vocab_major
    vocab = matrix.shape[0] if vocab_major else matrix.shape[1]
    rows = lambda x: x.reshape(B, Q // K, K, *x.shape[2:])[:, :, 1:].reshape(-1, *x.shape[2:])  # noqa: E731
    labels_BxQ = jnp.asarray(blocks.labels, jnp.int32)
    mask_BxQ = jnp.asarray(blocks.label_mask, jnp.float32)
    if label_map is not None:
        labels_BxQ = jnp.asarray(label_map, jnp.int32)[labels_BxQ]
        mask_BxQ = mask_BxQ * (labels_BxQ >= 0)
        labels_BxQ = jnp.maximum(labels_BxQ, 0)
    chunk = objective.head_chunk or auto_head_chunk(vocab)
    divergences = objective.divergences
    if divergences and blocks.soft_ids is None:
        raise ValueError(f"loss terms {[n for n, _ in objective.terms]} compare distributions and need soft labels "
                         "(data.labels: soft); only ce trains on hard labels")
    if blocks.soft_ids is None:  # hard labels: ce is the cross-entropy against the label
        names, ids_RxY, probs_RxY = ("nll",), None, None
    else:
        ids_BxQxY = jnp.asarray(blocks.soft_ids, jnp.int32)
        probs_BxQxY = jnp.asarray(blocks.soft_probs, jnp.float32)
        if label_map is not None:
            ids_BxQxY = jnp.asarray(label_map, jnp.int32)[ids_BxQxY]
            probs_BxQxY = jnp.where(ids_BxQxY >= 0, probs_BxQxY, 0.0)
            ids_BxQxY = jnp.maximum(ids_BxQxY, 0)
        mass_BxQ = jnp.sum(probs_BxQxY, axis=-1)
        mask_BxQ = mask_BxQ * (mass_BxQ > 0)
        names, ids_RxY, probs_RxY = divergences or ("ce",), rows(ids_BxQxY), rows(probs_BxQxY * mask_BxQ[..., None])
    values_RxM, nll_R, hit_R = head_divergences(rows(hidden_BxQxD), matrix, rows(labels_BxQ), ids_RxY, probs_RxY,
                                                vocab_major, chunk, names)
    per_row = {"ce" if name == "nll" else name: values_RxM[:, i] for i, name in enumerate(names)}
    k_BxQ = jnp.broadcast_to(jnp.arange(Q, dtype=jnp.int32) % K, (B, Q))
    m_R = rows(mask_BxQ)
    if objective.kind == "dpace":
        m_BxNxJ = m_R.reshape(B, Q // K, K - 1)
        wm_R = dpace_weights(nll_R.reshape(B, Q // K, K - 1), m_BxNxJ, objective.dpace_alpha).reshape(-1)
    else:
        wm_R = rows(decay_weights(K, objective.gamma)[k_BxQ] * mask_BxQ)
    weighted_count = jnp.sum(wm_R)
    mean = lambda x_R: jnp.sum(wm_R * x_R) / jnp.maximum(weighted_count, 1e-9)  # noqa: E731
    if "opd" in dict(objective.terms):
        per_row["opd"] = opd_rows(per_row["kl"], per_row["rkl"], hit_R * m_R, B, Q // K, objective.opd_gamma)
    loss = mean(sum(weight * per_row[name] for name, weight in objective.terms))
    extra = {f"loss/{name}": mean(per_row[name]) for name, _ in objective.terms} if divergences else {}
    zeros_BxNx1 = jnp.zeros((B, Q // K, 1), jnp.float32)
    hit_BxQ = jnp.concatenate([zeros_BxNx1, hit_R.reshape(B, Q // K, K - 1)], axis=-1).reshape(B, Q)
    return loss, {**block_metrics(hit_BxQ * mask_BxQ, mask_BxQ, K), "weighted_count": weighted_count, **extra}


def opd_rows(kl_R: jax.Array, rkl_R: jax.Array, hits_R: jax.Array, B: int, N: int, gamma: float) -> jax.Array:
    """The `opd` term per labelled row (rows laid out [B, N, K-1], slots 1..K-1 of each block): kl where the slot and
    every earlier slot of its block are hits (`hits_R`: top-1 hit times the label mask), else rkl x gamma^d, d the
    slots past the block's first miss (0 at the miss itself). The split carries no gradient."""
    hits_BxNxJ = jax.lax.stop_gradient(hits_R).reshape(B, N, -1)
    accepted = jnp.cumprod(hits_BxNxJ, axis=-1)
    past = jnp.maximum(jnp.cumsum(1.0 - accepted, axis=-1) - 1.0, 0.0)
    w_rkl = (1.0 - accepted) * jnp.power(jnp.float32(gamma), past)
    return accepted.reshape(-1) * kl_R + w_rkl.reshape(-1) * rkl_R


__all__ = [
    "PAPER_GAMMA",
    "Blocks",
    "Objective",
    "TrainHead",
    "dpace_weights",
    "auto_head_chunk",
    "block_metrics",
    "build_blocks",
    "build_blocks_batch",
    "decay_weights",
    "default_gamma",
    "dense_loss",
    "head_loss",
    "head_divergences",
    "opd_rows",
    "DIVERGENCES",
    "sample_anchors",
    "sample_anchors_batch",
    "valid_anchor_positions",
    "visible",
]
