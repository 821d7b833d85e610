"""One DFlash training step (docs/design.md §4.2): `train_step(state, batch, frozen, spec)` is a module-level pure
function over a typed batch (`data.batch.TrainBatch`); `make_train_step` jits it once with the state and the batch
donated and `spec` (`StepSpec`: everything fixed at trace time, one frozen hashable value) static.

    anchors -> blocks -> target features and block embeddings (no gradient) -> drafter -> frozen LM head -> loss

Only the drafter's parameters are differentiated and updated; the frozen target and its LM head (`FrozenTarget`;
`TrainHead`: the full vocabulary or a training vocabulary's rows) are a traced argument of the step, never part of
the state.
Design: docs/decisions.md D9, D10, D39.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dflash.data.batch import TrainBatch
from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params, embed, head_matrix
from dflash.models.drafter import BlockVisibility, DrafterArch, draft_head_rows, online_features
from dflash.train.objective import (
    Blocks,
    Objective,
    TrainHead,
    build_blocks_batch,
    head_loss,
    sample_anchors_batch,
)
from dflash.train.selector import selector_loss

Metrics = dict[str, jax.Array]

# ----------------------------------------------------------------------------- state and optimizer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step reads and writes (a pytree; donated to the jitted step).

    params:    the drafter's nnx.State of `nnx.Param`s (fp32 master weights); no embedding, no LM head.
    opt_state: the optax state for `params` (fp32).
    step:      int32 scalar, number of updates applied so far.
    rng:       PRNG key; each step splits it into the next key and the step's anchor key.
    """

    params: nnx.State
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array


StepOut = tuple[TrainState, Metrics]


def make_schedule(lr: float, total_steps: int, warmup_frac: float = 0.04) -> optax.Schedule:
    """Linear warmup from 0 over round(warmup_frac * total_steps) steps (at least 1), then cosine to 0."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1; received {total_steps}")
    if not 0.0 <= warmup_frac < 1.0:
        raise ValueError(f"warmup_frac must lie in [0, 1); received {warmup_frac}")
    warmup = max(1, round(warmup_frac * total_steps))
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), end_value=0.0)


def make_optimizer(lr: float, total_steps: int, warmup_frac: float = 0.04, clip: float = 1.0,
                   weight_decay: float = 0.0) -> optax.GradientTransformation:
    """clip_by_global_norm(clip) then AdamW on the warmup+cosine schedule (`make_schedule`).

    The learning rate is injected as a hyperparameter, so the rate used by the latest update can be read
    from the optimizer state (`current_lr`). Weight decay applies to matrices only (`decays`): the RMSNorm
    scales are left alone, as is usual, since decaying them pulls every normed activation towards zero.
    """
    if clip <= 0:
        raise ValueError(f"clip must be > 0; received {clip}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0; received {weight_decay}")
    # without decay the state keeps adamw's unmasked layout, so runs and checkpoints from before the mask resume
    mask = {"mask": decays} if weight_decay > 0 else {}
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=make_schedule(lr, total_steps, warmup_frac), weight_decay=weight_decay, **mask)
    return optax.chain(optax.clip_by_global_norm(clip), adamw)


def decays(params: Any) -> Any:
    """The weight-decay mask of `make_optimizer`: True for a parameter of 2 or more dimensions (kernels)."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def current_lr(opt_state: optax.OptState) -> jax.Array:
    """The learning rate the latest update used; `opt_state` must come from `make_optimizer`'s chain
    (index 1 is the injected-hyperparameter AdamW state)."""
    return jnp.asarray(opt_state[1].hyperparams["learning_rate"], jnp.float32)


def init_state(params: nnx.State, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
    """A fresh state: fp32 copies of the drafter params, `optimizer.init`, step 0 and `rng`."""
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32), rng=rng)


# ----------------------------------------------------------------------------- the frozen head


def train_head(target_params: Params, target_cfg: DecoderConfig, token_ids: Any = None) -> TrainHead:
    """The LM head the loss runs through: the target's own (the full vocabulary; the same arrays as
    `target_params`'), or with `token_ids` a training vocabulary (`train.head_vocab`, docs/decisions.md D19): its
    rows of the head ([V', D], vocab-major) and the label map token -> row (-1 outside), so the softmax runs over
    those V' tokens only; the served drafter proposes over the same rows (D24)."""
    if token_ids is None:
        matrix, vocab_major = head_matrix(target_params, target_cfg)
        return TrainHead(matrix=matrix, vocab_major=vocab_major)
    ids = jnp.asarray(token_ids, jnp.int32)
    label_map = jnp.full((target_cfg.vocab_size,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
    return TrainHead(matrix=draft_head_rows(target_params, target_cfg, ids), label_map=label_map, vocab_major=True)


# ----------------------------------------------------------------------------- what a step fixes and reads


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the train step and its siblings fix at trace time: one frozen, hashable value, passed to their jit as
    the one static argument (an equal spec reuses the compiled program; a shape change compiles once more).

    graphdef:      the drafter's graph (`train.loop.drafter_graphdef`), its matmuls in `compute_dtype`
    target_cfg:    the frozen target's architecture (its forward computes online features)
    arch:          the drafter's architecture (K, mask id, layer ids, draft window)
    num_anchors:   N, blocks per row
    objective:     the loss (`train.objective.Objective`)
    optimizer:     the update the train step applies (None for the eval step, which applies none)
    compute_dtype: the forward's dtype (params are cast inside the step; master weights and optimizer stay fp32)
    walk_count:    anchors per row drawn from the serving walk's block starts (`train.walk_anchors`; 0 = none)
    """

    graphdef: nnx.GraphDef
    target_cfg: DecoderConfig
    arch: DrafterArch
    num_anchors: int
    objective: Objective
    optimizer: optax.GradientTransformation | None = None
    compute_dtype: Any = jnp.float32
    walk_count: int = 0

    def __post_init__(self) -> None:  # jit hashes its static argument at every call: once here, not per step
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self) -> int:
        return self._hash


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrozenTarget:
    """The frozen target a step reads: traced arguments (not compiled in as constants), never trained and never
    part of the state.

    params: the target's weights, already in the compute dtype (cast once by the caller)
    head:   the LM head the loss runs through (`train_head`: the target's, or a training vocabulary's rows)
    """

    params: Params
    head: TrainHead


# ----------------------------------------------------------------------------- the loss from explicit inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What the drafter's loss reads, made from a batch by `block_inputs` (no gradient flows into any of it).

    blocks:       the N blocks of K slots of each row (`train.objective.Blocks`, [B, Q] fields)
    embeds_BxQxD: the target's embeddings of the block ids
    feats_BxSxDf: the target's features at the drafter's layer ids (the context)
    segment_ids:  int32 [B, S] of packed rows (each block sees only its own conversation), or None
    """

    blocks: Blocks
    embeds_BxQxD: jax.Array
    feats_BxSxDf: jax.Array
    segment_ids: jax.Array | None = None


def drafter_loss(params: nnx.State, inputs: StepInputs, head: TrainHead, spec: StepSpec) -> tuple[jax.Array, Metrics]:
    """DFlash loss of the drafter (`spec.graphdef` with `params`) on explicit inputs (so gradients w.r.t. embeds
    and features exist), through the frozen LM head `head`.

    Context positions are 0..S-1 and every context token is valid; `BlockVisibility.from_anchors` gives
    block j the context keys s < a_j and its own block's keys only (block-local attention, no dense
    Q x (S+Q) mask); with `inputs.segment_ids` (packed rows) only those of a_j's own conversation; in a
    sliding-window layer only the last W of them (s >= a_j - W, `drafter.sliding_window`). Positions stay
    the row's: RoPE sees only differences, which are the same within a conversation wherever it sits. The
    frozen head and the CE run in chunks (`head_loss`), in the dtype of the drafter's output (the compute dtype)
    with fp32 accumulation and softmax. With DFlash2's path selector (`drafter.selector`),
    `objective.selector_weight` x its loss (`train.selector`) is added. Returns (loss, head_loss metrics, and the
    selector's).
    """
    blocks, feats_BxSxDf, block_size, objective = inputs.blocks, inputs.feats_BxSxDf, spec.arch.block_size, \
        spec.objective
    b, s, _ = feats_BxSxDf.shape
    drafter = nnx.merge(spec.graphdef, params)
    ctx_pos_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    anchor_BxN = blocks.anchor_of_query.reshape(b, -1, block_size)[:, :, 0]  # -1 for padding blocks
    visible = BlockVisibility.from_anchors(anchor_BxN, jnp.ones((b, s), bool), inputs.segment_ids,
                                           window=drafter.arch.sliding_window)
    hidden_BxQxD = drafter(inputs.embeds_BxQxD, blocks.block_pos, feats_BxSxDf, ctx_pos_BxS, visible)
    loss, metrics = head_loss(hidden_BxQxD, head, blocks, block_size, objective)
    if drafter.candidate_selector is None or objective.selector_weight == 0:
        return loss, metrics
    extra, sel_metrics = selector_loss(drafter.candidate_selector, hidden_BxQxD, head, blocks, block_size, objective)
    return loss + objective.selector_weight * extra, {**metrics, **sel_metrics}


# ----------------------------------------------------------------------------- the step


def cast_floats(tree: Any, dtype: Any) -> Any:
    """`tree` with every floating-point leaf cast to `dtype` (integer leaves untouched)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def check_batch(batch: TrainBatch, arch: DrafterArch) -> None:
    """At trace time: every array of `batch` has its field's shape and dtype, and stored features are the drafter's
    F layers of width D (ValueError naming the field otherwise)."""
    width = arch.num_features * arch.hidden_size if batch.features is not None else 0
    batch.check(dataclasses.replace(batch.layout(), feature_dim=width))


def block_inputs(batch: TrainBatch, target_params: Params, spec: StepSpec, rng: jax.Array) -> StepInputs:
    """The blocks, block embeddings and target features of `batch` with `spec.num_anchors` anchors per row drawn
    from `rng`: what the drafter's loss reads (no gradient into any of it).

    Features are `batch.features` when the batch holds them (offline mode: stored bf16 features, cast to the
    target params' dtype, i.e. the compute dtype), else the target's forward over the tokens (online). The labels
    (`batch.labels`: the text's, the target's, or its top-k distributions) and packed rows' segments shape the
    blocks (`build_blocks`). With `batch.walk` (`data.walk`), `spec.walk_count` of each row's anchors are drawn
    from the serving walk's block starts (`sample_anchors`, `train.walk_anchors`)."""
    arch = spec.arch
    anchors_BxN, keep_BxN = sample_anchors_batch(batch.loss_mask, spec.num_anchors, arch.block_size, rng, batch.walk,
                                                 spec.walk_count)
    blocks = build_blocks_batch(batch, anchors_BxN, keep_BxN, arch.block_size, arch.mask_token_id)
    if batch.features is not None:
        feats_BxSxDf = jax.lax.stop_gradient(batch.features.astype(target_params["embed"].dtype))
    else:
        feats_BxSxDf = online_features(target_params, spec.target_cfg, batch.tokens, arch.layer_ids)
    embeds_BxQxD = jax.lax.stop_gradient(embed(target_params, blocks.block_ids))
    return StepInputs(blocks=blocks, embeds_BxQxD=embeds_BxQxD, feats_BxSxDf=feats_BxSxDf,
                      segment_ids=batch.segment_ids)


def train_step(state: TrainState, batch: TrainBatch, frozen: FrozenTarget, spec: StepSpec) -> StepOut:
    """One update of the drafter on `batch`; pure. `frozen` is traced, `spec` static (`make_train_step`).

    Data flow (F captured layers, D hidden, Q = N*K, V' the head's rows):

        batch.check(...)      shapes and dtypes, at trace time
        rng -> (next rng, anchor rng)
        anchors_BxN, keep_BxN = sample_anchors_batch(batch.loss_mask, N, K, anchor rng)
        blocks [B, Q]         = build_blocks_batch(batch, anchors, keep, K, MASK)
        feats_BxSxDf          = batch.features (offline) or online_features(target, batch.tokens)  (no gradient)
        embeds_BxQxD          = target embedding of the block ids                                 (no gradient)
        hidden_BxQxD          = drafter(embeds, block_pos, feats, ctx_pos, BlockVisibility.from_anchors(...))
        loss, metrics         = head_loss(hidden, head, blocks): the frozen head and a weighted CE in chunks of
                                rows; only one chunk's [rows, V'] logits exist at a time, never [B, Q, V']

    Anchors are resampled from `state.rng` each step (new key per step); with `batch.walk` (`data.walk`),
    `spec.walk_count` of each row's are drawn from the serving walk's block starts first. Gradients are taken
    w.r.t. `state.params` only. The forward runs in `spec.compute_dtype` (params cast inside the differentiated
    function, so gradients and `spec.optimizer` stay in the fp32 master precision); the loss's softmax is fp32.
    metrics: loss, acceptance_length, accuracy_per_position [K], grad_norm (before clipping), update_norm (the
    update applied) and param_norm (after it), lr (used by this update), num_labels, num_blocks, and with terms
    beyond ce each term's weighted mean (loss/<term>).
    """
    check_batch(batch, spec.arch)
    rng, anchor_rng = jax.random.split(state.rng)
    inputs = block_inputs(batch, frozen.params, spec, anchor_rng)

    def loss_fn(params: nnx.State) -> tuple[jax.Array, Metrics]:
        return drafter_loss(cast_floats(params, spec.compute_dtype), inputs, frozen.head, spec)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = spec.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "acceptance_length": aux["acceptance_length"],
        "accuracy_per_position": aux["accuracy_per_position"],
        "grad_norm": optax.global_norm(grads),
        "update_norm": optax.global_norm(updates),  # what this step moved the weights by (after clip and AdamW)
        "param_norm": optax.global_norm(params),
        "lr": current_lr(opt_state),
        "num_labels": aux["num_labels"],
        "num_blocks": aux["num_blocks"],
        **{k: v for k, v in aux.items() if k.startswith(("loss/", "selector/"))},  # each term of a mix (train.loss)
    }
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1, rng=rng)
    return new_state, metrics


def make_train_step(spec: StepSpec, frozen: FrozenTarget,
                    state_shardings: Any = None) -> Callable[[TrainState, TrainBatch], StepOut]:
    """`(state, batch) -> (state, metrics)`: `train_step` jitted once with the state and the batch donated and
    `spec` its static argument; `frozen` is passed at every call.

    Input shardings follow the arguments (create the state, the frozen target and each batch already sharded, see
    `train.sharding`); `state_shardings`, when given, pins the new state to the same layout and metrics are
    replicated. Do not reuse a state or a batch after passing it in (their buffers are donated).
    `step.lower(state, batch)` lowers the same jitted program (for ahead-of-time compilation and XLA memory
    analysis); `step.jitted` is that program.
    """
    if spec.optimizer is None:
        raise ValueError("make_train_step needs spec.optimizer; received a spec without one (an eval step's)")
    if state_shardings is None:
        jitted = jax.jit(train_step, static_argnums=3, donate_argnums=(0, 1))
    else:
        mesh = jax.tree.leaves(state_shardings)[0].mesh
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        jitted = jax.jit(train_step, static_argnums=3, donate_argnums=(0, 1),
                         out_shardings=(state_shardings, replicated))

    def step(state: TrainState, batch: TrainBatch) -> StepOut:
        with _batch_donation_note():
            return jitted(state, batch, frozen, spec)

    def lower(state: TrainState, batch: TrainBatch) -> Any:  # for AOT compile / memory stats
        with _batch_donation_note():
            return jitted.lower(state, batch, frozen, spec)

    step.lower, step.jitted = lower, jitted
    return step


@contextlib.contextmanager
def _batch_donation_note() -> Iterator[None]:
    """XLA reuses a donated buffer only for an output of its shape and dtype; the step has none of the batch's,
    so JAX notes at each compile that those donations were not usable (docs/decisions.md D39). The state's
    donations always are (its new value has the same tree), so only that note is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def eval_metrics(params: nnx.State, batch: TrainBatch, frozen: FrozenTarget, rng: jax.Array,
                 spec: StepSpec) -> Metrics:
    """The step's loss and teacher-forced metrics on `batch` with anchors drawn from `rng`; no update."""
    check_batch(batch, spec.arch)
    inputs = block_inputs(batch, frozen.params, spec, rng)
    loss, aux = drafter_loss(cast_floats(params, spec.compute_dtype), inputs, frozen.head, spec)
    return {"loss": loss, "acceptance_length": aux["acceptance_length"],
            "accuracy_per_position": aux["accuracy_per_position"], "num_labels": aux["num_labels"]}


def make_eval_step(spec: StepSpec, frozen: FrozenTarget) -> Callable[[nnx.State, TrainBatch, jax.Array], Metrics]:
    """`(params, batch, rng) -> metrics`: `eval_metrics` jitted with `spec` static (nothing donated)."""
    jitted = jax.jit(eval_metrics, static_argnums=4)

    def run(params: nnx.State, batch: TrainBatch, rng: jax.Array) -> Metrics:
        return jitted(params, batch, frozen, rng, spec)

    return run


__all__ = [
    "FrozenTarget",
    "StepInputs",
    "StepSpec",
    "TrainState",
    "block_inputs",
    "cast_floats",
    "check_batch",
    "current_lr",
    "decays",
    "drafter_loss",
    "eval_metrics",
    "init_state",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "train_head",
    "train_step",
]
