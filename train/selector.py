"""The training loss of DFlash2's path selector (`drafter.selector`, `models.drafter.CandidateSelector`), added to
the drafter's loss with weight `train.selector_weight` (`train.step.drafter_loss`).

Each block slot t >= 1 has candidates C_t: its top k tokens by the unary logits (the frozen LM head on the
drafter's normed hidden state), the label put in place of the k-th candidate when it is not among them (so every
labelled slot has a label inside its set; speculators does the same). Scores s_t(a, b) = u_t(b) + e_t(a, b), with
e the selector's edge score (predecessor a, candidate b). The objective is speculators': a per-slot k-way
cross-entropy of s_t(y_{t-1}, .) over C_t given the label before it (teacher forcing, exact for greedy acceptance:
slot t only counts when the slots before it were right), weighted per slot with the paper's decay
exp(-(t-1)/gamma). (A second objective, the labelled path's CRF log-likelihood through the lattice, measured no
better and left: docs/retired.md.)

Only the selector's parameters learn from it: the hidden states and unary logits it reads are constants here
(stop_gradient), so the backbone trains on the unary loss alone, as without a selector. Decision and
measurements: docs/decisions.md (the DFlash2 selector record).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash.models.drafter import CandidateSelector
from dflash.train.objective import Blocks, Objective, TrainHead, _map_chunks, auto_head_chunk, decay_weights


def head_topk(h_RxD: jax.Array, matrix: jax.Array, vocab_major: bool, k: int, chunk: int) -> tuple[jax.Array, ...]:
    """(unary logits [R, k] f32, their token rows [R, k] int32): each row's top k logits of the LM head, in
    chunks of `chunk` rows (only one chunk's [chunk, V] logits exist at a time)."""
    spec = "cd,vd->cv" if vocab_major else "cd,dv->cv"

    def top(h_RcxD):
        logits = jnp.einsum(spec, h_RcxD, matrix.astype(h_RcxD.dtype), preferred_element_type=jnp.float32)
        values, rows = jax.lax.top_k(logits, k)
        return values, rows.astype(jnp.int32)

    return _map_chunks(top, chunk, h_RxD)


def with_labels(cand_RxC: jax.Array, unary_RxC: jax.Array, labels_R: jax.Array,
                label_logit_R: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(candidates, unary scores, the label's index [R]): the label put in place of the last candidate (with its
    own unary logit) where it is not among them."""
    match = cand_RxC == labels_R[:, None]
    found = jnp.any(match, axis=-1)
    last = cand_RxC.shape[1] - 1
    cand = cand_RxC.at[:, last].set(jnp.where(found, cand_RxC[:, last], labels_R))
    unary = unary_RxC.at[:, last].set(jnp.where(found, unary_RxC[:, last], label_logit_R))
    return cand, unary, jnp.where(found, jnp.argmax(match, axis=-1), last).astype(jnp.int32)


def selector_loss(selector: CandidateSelector, hidden_BxQxD: jax.Array, head: TrainHead, blocks: Blocks,
                  block_size: int, objective: Objective) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the selector's loss on the blocks, metrics); with a training vocabulary
    (`head.label_map`) the candidates are its rows' tokens and a label outside it is left out. Metrics:
    `selector/accuracy` (teacher-forced top-1 of the selector's scores among the labelled slots whose label is a
    candidate) and
    `selector/acceptance_length` (the walk `CandidateSelector.walk` over the unary candidates from each block's
    anchor, scored like `acceptance_length`: 1 + the labelled prefix it gets right)."""
    B, Q, D = hidden_BxQxD.shape
    K, N, C = block_size, Q // block_size, selector.top_k
    Nb, J = B * N, K - 1
    rows = lambda x: x.reshape(B, N, K, *x.shape[2:])[:, :, 1:].reshape(Nb * J, *x.shape[2:])  # noqa: E731
    matrix, vocab_major = jax.lax.stop_gradient(head.matrix), head.vocab_major
    h_RxD = jax.lax.stop_gradient(rows(hidden_BxQxD)).astype(jnp.float32)
    labels_R = rows(jnp.asarray(blocks.labels, jnp.int32))
    mask_R = rows(jnp.asarray(blocks.label_mask, jnp.float32)) > 0
    vocab = matrix.shape[0] if vocab_major else matrix.shape[1]
    unary0, cand0 = head_topk(h_RxD, matrix, vocab_major, C, objective.head_chunk or auto_head_chunk(vocab))
    row_R = labels_R
    if head.label_map is not None:  # a training vocabulary: head rows -> token ids (the codebooks' index)
        label_map = jnp.asarray(head.label_map, jnp.int32)
        row_R = label_map[labels_R]
        mask_R = mask_R & (row_R >= 0)
        row_R = jnp.maximum(row_R, 0)
        ids_of_row = jnp.zeros(vocab, jnp.int32).at[jnp.where(label_map >= 0, label_map, vocab)].set(
            jnp.arange(label_map.shape[0], dtype=jnp.int32), mode="drop")
        cand0 = ids_of_row[cand0]
    label_rows = matrix[row_R] if vocab_major else matrix[:, row_R].T
    label_logit_R = jnp.sum(h_RxD * label_rows.astype(jnp.float32), axis=-1)
    anchor_Nb = jnp.asarray(blocks.block_ids, jnp.int32).reshape(Nb, K)[:, 0]
    return lattice_loss(selector, h_RxD.reshape(Nb, J, D), cand0.reshape(Nb, J, C), unary0.reshape(Nb, J, C),
                        labels_R.reshape(Nb, J), label_logit_R.reshape(Nb, J), mask_R.reshape(Nb, J), anchor_Nb,
                        objective.gamma)


def lattice_loss(selector: CandidateSelector, h_NbxJxD: jax.Array, cand_NbxJxC: jax.Array, unary_NbxJxC: jax.Array,
                 labels_NbxJ: jax.Array, label_logit_NbxJ: jax.Array, mask_NbxJ: jax.Array, anchor_Nb: jax.Array,
                 gamma: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`selector_loss` of Nb blocks of J = K-1 slots from their unary candidates (token ids, top first) and
    scores, labels (token ids), the labels' own unary logits, the label mask and the anchors (`gamma`: the
    per-slot decay)."""
    Nb, J, C = cand_NbxJxC.shape
    cand0, unary0 = cand_NbxJxC.reshape(Nb * J, C), unary_NbxJxC.reshape(Nb * J, C)
    labels_R = labels_NbxJ.reshape(-1)
    cand, unary, gold_R = with_labels(cand0, unary0, labels_R, label_logit_NbxJ.reshape(-1))
    proj_RxDr = selector.hidden_projection(h_NbxJxD.reshape(Nb * J, -1)).astype(jnp.float32)
    prev_NbxJ = jnp.concatenate([anchor_Nb[:, None], labels_NbxJ[:, :-1]], axis=1)
    scores_RxC = unary + selector.edges(prev_NbxJ.reshape(-1), proj_RxDr, cand).astype(jnp.float32)
    nll_R = jax.nn.logsumexp(scores_RxC, axis=-1) - jnp.take_along_axis(scores_RxC, gold_R[:, None], 1)[:, 0]
    w_R = jnp.broadcast_to(decay_weights(J + 1, gamma)[1:], (Nb, J)).reshape(-1) * mask_NbxJ.reshape(-1)
    loss = jnp.sum(w_R * nll_R) / jnp.maximum(jnp.sum(w_R), 1e-9)
    m_R = mask_NbxJ.reshape(-1)
    hit_R = (jnp.argmax(scores_RxC, axis=-1) == gold_R) & jnp.any(cand0 == labels_R[:, None], axis=-1)
    walk_NbxJ = selector.walk(cand_NbxJxC, unary_NbxJxC, h_NbxJxD, anchor_Nb)
    chain_Nb = jnp.sum(jnp.cumprod((walk_NbxJ == labels_NbxJ) & mask_NbxJ, axis=1), axis=1)
    kept_Nb = jnp.any(mask_NbxJ, axis=1)
    metrics = {
        "loss/selector": loss,
        "selector/accuracy": jnp.sum(hit_R & m_R) / jnp.maximum(jnp.sum(m_R), 1),
        "selector/acceptance_length": jnp.sum(kept_Nb * (1.0 + chain_Nb)) / jnp.maximum(jnp.sum(kept_Nb), 1),
    }
    return loss, jax.lax.stop_gradient(metrics)
