"""Test helpers: the typed training inputs (`TrainBatch`, `Blocks`, `TrainHead`) from plain arrays, and small
references the tests build inputs with (the drafter's block embeddings and positions, the dense visibility per
row, a drafter split into graph and params)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dflash.data.batch import SoftLabels, TargetLabels, TrainBatch
from dflash.models.decoder import embed
from dflash.models.drafter import DFlashDrafter, block_token_ids
from dflash.train.objective import Blocks, TrainHead, visible


def batch_of(tokens: Any, loss_mask: Any, next_ids: Any = None, segment_ids: Any = None,
             soft: tuple[Any, Any] | None = None, features: Any = None) -> TrainBatch:
    """A `TrainBatch` (or one row of one: any leading shape) from plain arrays: target labels when `next_ids` is
    given, soft labels when `soft` = (ids, probs) is given too."""
    labels = None
    if soft is not None:
        labels = SoftLabels(next_ids=jnp.asarray(next_ids, jnp.int32), ids=jnp.asarray(soft[0], jnp.int32),
                            probs=jnp.asarray(soft[1], jnp.float32))
    elif next_ids is not None:
        labels = TargetLabels(next_ids=jnp.asarray(next_ids, jnp.int32))
    return TrainBatch(tokens=jnp.asarray(tokens, jnp.int32), loss_mask=jnp.asarray(loss_mask, jnp.float32),
                      features=features,
                      segment_ids=None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32),
                      labels=labels)


def labelled(labels_BxQ: Any, label_mask_BxQ: Any, soft: tuple[Any, Any] | None = None) -> Blocks:
    """`Blocks` holding only what the loss reads (labels, label mask, soft labels); the rest zeros."""
    zeros = jnp.zeros(jnp.shape(labels_BxQ), jnp.int32)
    return Blocks(block_ids=zeros, block_pos=zeros, labels=jnp.asarray(labels_BxQ, jnp.int32),
                  label_mask=jnp.asarray(label_mask_BxQ, jnp.float32), block_index_in_block=zeros,
                  anchor_of_query=zeros, block_of_query=zeros,
                  soft_ids=None if soft is None else jnp.asarray(soft[0], jnp.int32),
                  soft_probs=None if soft is None else jnp.asarray(soft[1], jnp.float32))


def head(matrix: Any, vocab_major: bool = True, label_map: Any = None) -> TrainHead:
    return TrainHead(matrix=jnp.asarray(matrix), label_map=None if label_map is None else jnp.asarray(label_map),
                     vocab_major=vocab_major)


def split_drafter(drafter: DFlashDrafter) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of a drafter; it must hold nothing but `nnx.Param`s."""
    graphdef, params = nnx.split(drafter, nnx.Param)
    return graphdef, params


def visible_batch(anchor_of_query_BxQ: jax.Array, block_of_query_BxQ: jax.Array, ctx_valid_BxS: jax.Array,
                  key_block_BxQ: jax.Array) -> jax.Array:
    """`visible` per row: bool [B, Q, S+Q]."""
    return jax.vmap(visible)(anchor_of_query_BxQ, block_of_query_BxQ, ctx_valid_BxS, key_block_BxQ)


def block_positions(starts_B: jax.Array, block_size: int) -> jax.Array:
    """Block positions [B, K] = start .. start+K-1."""
    return starts_B[:, None].astype(jnp.int32) + jnp.arange(block_size, dtype=jnp.int32)[None, :]


def mask_token_embeds(target_params: Any, start_tokens_B: jax.Array, block_size: int,
                      mask_token_id: int) -> jax.Array:
    """Block embeddings [B, K, D] from the target's (frozen) embedding table."""
    return embed(target_params, block_token_ids(start_tokens_B, block_size, mask_token_id))
