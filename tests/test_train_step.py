"""The DFlash train step: runs under jit, learns, and its mask holds through gradients (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from reference import batch_of, split_drafter

from dflash.data.batch import TrainBatch
from dflash.models.decoder import embed, forward
from dflash.models.drafter import (
    DFlashDrafter,
    DrafterConfig,
    concat_features,
    hf_tensor_names,
    online_features,
    resolve_drafter,
)
from dflash.models.loading import load_hf_dir
from dflash.train.objective import Objective, build_blocks_batch, default_gamma, sample_anchors_batch
from dflash.train.step import (
    FrozenTarget,
    StepInputs,
    StepSpec,
    TrainState,
    current_lr,
    drafter_loss,
    init_state,
    make_optimizer,
    make_schedule,
    make_train_step,
    train_head,
)

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


LAYER_IDS = (1, 3)
K, N, S, B = 4, 4, 32, 2
MASK_ID = 255  # a token id inside the tiny vocab (256)


@pytest.fixture(scope="module")
def setup(golden_dir):
    target_cfg, target_params = load_hf_dir(golden_dir / "tiny" / "qwen3_untied")
    cfg = DrafterConfig(num_layers=2, num_features=2, layer_ids=LAYER_IDS, block_size=K)
    arch = resolve_drafter(cfg, target_cfg, mask_token_id=MASK_ID)
    return target_cfg, target_params, arch


def _greedy_batch(target_cfg, target_params) -> TrainBatch:
    """A target-regenerated-like batch: random 4-token prompts, then the target's own greedy continuation."""
    prompt_len = 4
    tokens = np.array(jax.random.randint(jax.random.key(7), (B, S), 0, MASK_ID), np.int32)

    @jax.jit
    def next_token(toks):
        logits, _ = forward(target_params, target_cfg, toks)
        return jnp.argmax(logits, axis=-1)

    for s in range(prompt_len, S):
        tokens[:, s] = np.asarray(next_token(jnp.asarray(tokens)))[:, s - 1]
    loss_mask = np.ones((B, S), np.float32)
    loss_mask[:, : prompt_len - 1] = 0.0
    return TrainBatch(tokens=tokens, loss_mask=loss_mask)


def _spec(graphdef, target_cfg, arch, optimizer=None) -> StepSpec:
    """The step spec of these tests: N anchors per row, the paper's decay for K."""
    return StepSpec(graphdef=graphdef, target_cfg=target_cfg, arch=arch, num_anchors=N,
                    objective=Objective(gamma=default_gamma(K)), optimizer=optimizer)


def _frozen(target_cfg, target_params) -> FrozenTarget:
    return FrozenTarget(params=target_params, head=train_head(target_params, target_cfg))


def _new_state(arch, optimizer, seed: int = 0) -> tuple[nnx.GraphDef, TrainState]:
    graphdef, params = split_drafter(DFlashDrafter(arch, nnx.Rngs(seed)))
    return graphdef, init_state(params, optimizer, jax.random.key(seed + 1))


def test_online_features_are_layer_outputs_in_id_order(setup):
    target_cfg, target_params, _ = setup
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, 256)
    feats = online_features(target_params, target_cfg, tokens, LAYER_IDS)
    assert feats.shape == (B, S, len(LAYER_IDS) * target_cfg.hidden_size)
    _, ref = forward(target_params, target_cfg, tokens, layer_ids=LAYER_IDS, with_logits=False)
    np.testing.assert_array_equal(np.asarray(feats), np.asarray(concat_features(ref)))
    d = target_cfg.hidden_size
    _, deep = forward(target_params, target_cfg, tokens, layer_ids=(3,), with_logits=False)
    np.testing.assert_array_equal(np.asarray(feats[..., d:]), np.asarray(deep[0]))


def test_train_step_runs_under_jit_with_finite_metrics(setup):
    target_cfg, target_params, arch = setup
    optimizer = make_optimizer(1e-3, total_steps=10)
    graphdef, state = _new_state(arch, optimizer)
    step = make_train_step(_spec(graphdef, target_cfg, arch, optimizer), _frozen(target_cfg, target_params))
    batch = _greedy_batch(target_cfg, target_params)
    before = jax.tree.map(np.asarray, state.params)
    target_before = jax.tree.map(np.asarray, target_params)
    for _ in range(2):
        prev = jax.tree.map(np.asarray, state.params)
        state, metrics = step(state, batch)
    assert int(state.step) == 2
    # the norms are of the weights after the update and of the update this step applied
    moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, state.params, prev)
    def norm(tree: object) -> float:
        return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree))))

    np.testing.assert_allclose(float(metrics["param_norm"]), norm(state.params), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["update_norm"]), norm(moved), rtol=1e-3)
    assert float(metrics["update_norm"]) > 0
    assert set(metrics) >= {"loss", "acceptance_length", "accuracy_per_position", "grad_norm", "update_norm",
                            "param_norm", "lr"}
    for name, value in metrics.items():
        assert np.all(np.isfinite(np.asarray(value))), name
    assert metrics["accuracy_per_position"].shape == (K,)
    assert float(metrics["lr"]) > 0 and float(metrics["grad_norm"]) > 0
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
    assert any(jax.tree.leaves(changed))
    # The target is an input, never updated; it is not part of the state.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), target_before, target_params)
    state_shapes = {tuple(x.shape) for x in jax.tree.leaves(state)}
    assert target_params["embed"].shape not in state_shapes
    assert target_params["lm_head"].shape not in state_shapes


def test_drafter_holds_no_embedding_or_lm_head(setup):
    _, _, arch = setup
    names = hf_tensor_names(DFlashDrafter(arch, nnx.Rngs(0)))
    assert not any("embed" in n or "lm_head" in n for n in names), names


def test_weight_decay_shrinks_kernels_only_and_zero_decay_keeps_the_state_layout(setup):
    _, _, arch = setup
    _, params = split_drafter(DFlashDrafter(arch, nnx.Rngs(0)))
    params = jax.tree.map(lambda x: x + 0.5, params)  # norm scales start at 1; every leaf is non-zero
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    optimizer = make_optimizer(1e-2, total_steps=4, warmup_frac=0.0, weight_decay=0.5)
    opt_state, new = optimizer.init(params), params
    for _ in range(2):  # the warmup's first update runs at learning rate 0, the second at the peak 1e-2
        updates, opt_state = optimizer.update(zero_grads, opt_state, new)
        new = optax.apply_updates(new, updates)
    assert float(current_lr(opt_state)) == pytest.approx(1e-2)
    flat_old, flat_new = jax.tree.leaves(params), jax.tree.leaves(new)
    kernels = [np.asarray(a).ndim >= 2 for a in flat_old]
    assert any(kernels) and not all(kernels)
    for is_kernel, before, after in zip(kernels, flat_old, flat_new, strict=True):
        if is_kernel:  # AdamW's decoupled decay alone: x (1 - lr * wd)
            np.testing.assert_allclose(np.asarray(after), np.asarray(before) * (1 - 1e-2 * 0.5), rtol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    # without decay the optimizer state is adamw's own (checkpoints written before the mask restore)
    plain = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=make_schedule(1e-3, 4, 0.04), weight_decay=0.0))
    assert (jax.tree.structure(make_optimizer(1e-3, total_steps=4).init(params))
            == jax.tree.structure(plain.init(params)))


def _eval(graphdef, params, target_cfg, target_params, batch, arch) -> tuple[float, float]:
    """(loss, teacher-forced acceptance length) on 16 fixed anchors per row of `batch`."""
    anchors, keep = sample_anchors_batch(batch.loss_mask, 16, K, jax.random.key(11))
    blocks = build_blocks_batch(batch, anchors, keep, K, arch.mask_token_id)
    feats = online_features(target_params, target_cfg, batch.tokens, arch.layer_ids)
    inputs = StepInputs(blocks=blocks, embeds_BxQxD=embed(target_params, blocks.block_ids), feats_BxSxDf=feats)
    loss, metrics = drafter_loss(params, inputs, train_head(target_params, target_cfg),
                                 _spec(graphdef, target_cfg, arch))
    return float(loss), float(metrics["acceptance_length"])


@pytest.mark.slow
def test_overfits_a_fixed_batch(setup):
    """60 steps at lr 3e-3 on one greedy-continuation batch: held-fixed-anchor loss halves, acceptance rises."""
    target_cfg, target_params, arch = setup
    steps = 60
    optimizer = make_optimizer(3e-3, total_steps=steps)
    graphdef, state = _new_state(arch, optimizer)
    step = make_train_step(_spec(graphdef, target_cfg, arch, optimizer), _frozen(target_cfg, target_params))
    batch = _greedy_batch(target_cfg, target_params)
    loss0, accept0 = _eval(graphdef, state.params, target_cfg, target_params, batch, arch)
    for _ in range(steps):
        state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    loss1, accept1 = _eval(graphdef, state.params, target_cfg, target_params, batch, arch)
    assert loss1 < 0.5 * loss0, (loss0, loss1)
    assert accept1 > accept0, (accept0, accept1)


def test_mask_through_gradients(setup):
    """Loss of ONE block: no gradient into other blocks' embeds or context features at s >= its anchor."""
    target_cfg, target_params, arch = setup
    graphdef, params = split_drafter(DFlashDrafter(arch, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(3), (B, S), 0, MASK_ID)
    loss_mask = jnp.ones((B, S), jnp.float32)
    anchors = jnp.array([[2, 9, 15, 27], [1, 5, 12, 20]], jnp.int32)
    keep = jnp.ones((B, N), bool)
    blocks = build_blocks_batch(batch_of(tokens, loss_mask), anchors, keep, K, MASK_ID)
    row, j = 0, 1
    anchor = int(anchors[row, j])
    own = np.zeros((B, N * K), bool)
    own[row, j * K:(j + 1) * K] = True
    one_block = dataclasses.replace(blocks, label_mask=blocks.label_mask * jnp.asarray(own))
    embeds = embed(target_params, blocks.block_ids)
    feats = online_features(target_params, target_cfg, tokens, LAYER_IDS)

    def loss(e, f):
        inputs = StepInputs(blocks=one_block, embeds_BxQxD=e, feats_BxSxDf=f)
        return drafter_loss(params, inputs, train_head(target_params, target_cfg), _spec(graphdef, target_cfg, arch))[0]

    g_embeds, g_feats = (np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1)))(embeds, feats))
    assert np.all(g_embeds[~own] == 0.0)
    assert np.abs(g_embeds[own]).sum() > 0
    assert np.all(g_feats[row, anchor:] == 0.0)  # strictly before the anchor: s == anchor too
    assert np.all(g_feats[1 - row] == 0.0)
    assert np.all(np.abs(g_feats[row, :anchor]).sum(-1) > 0)


def test_a_packed_row_trains_as_its_conversations_alone(setup):
    """Two conversations packed into one row with segment ids give the loss, metrics and gradient of the same
    blocks over the two conversations in rows of their own (fp32); without segment ids they would not (the
    second conversation's blocks would see the first one's context, and a block at the end of the first
    would be labelled with the second's tokens)."""
    target_cfg, target_params, arch = setup
    graphdef, params = split_drafter(DFlashDrafter(arch, nnx.Rngs(0)))
    n1, n2 = 14, 12
    convs = jax.random.randint(jax.random.key(5), (2, S), 0, MASK_ID)
    tokens = jnp.zeros((2, S), jnp.int32).at[0, :n1].set(convs[0, :n1]).at[1, :n2].set(convs[1, :n2])
    loss_mask = jnp.zeros((2, S), jnp.float32).at[0, 2:n1].set(1.0).at[1, :n2].set(1.0)  # conv 2 from its start
    feats = online_features(target_params, target_cfg, tokens, LAYER_IDS)
    anchors = jnp.array([[3, 12], [0, 6]], jnp.int32)  # 12: the block runs past conversation 1's end
    keep = jnp.ones((2, 2), bool)
    spec = _spec(graphdef, target_cfg, arch)

    packed_tokens = jnp.concatenate([tokens[0, :n1], tokens[1, :n2], jnp.zeros(S - n1 - n2, jnp.int32)])[None]
    packed_mask = jnp.concatenate([loss_mask[0, :n1], loss_mask[1, :n2], jnp.zeros(S - n1 - n2)])[None]
    packed_feats = jnp.concatenate([feats[0, :n1], feats[1, :n2], jnp.zeros((S - n1 - n2, feats.shape[-1]))])[None]
    segment = jnp.concatenate([jnp.ones(n1, jnp.int32), jnp.full(n2, 2, jnp.int32),
                               jnp.zeros(S - n1 - n2, jnp.int32)])[None]
    packed_anchors = jnp.array([[3, 12, n1 + 0, n1 + 6]], jnp.int32)

    def loss_and_grad(tok, mask, f, a, k, seg):
        blocks = build_blocks_batch(batch_of(tok, mask, segment_ids=seg), a, k, K, MASK_ID)
        inputs = StepInputs(blocks=blocks, embeds_BxQxD=embed(target_params, blocks.block_ids), feats_BxSxDf=f,
                            segment_ids=seg)

        def loss(p):
            return drafter_loss(p, inputs, train_head(target_params, target_cfg), spec)

        (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return float(value), metrics, grad

    alone = loss_and_grad(tokens, loss_mask, feats, anchors, keep, None)
    packed = loss_and_grad(packed_tokens, packed_mask, packed_feats, packed_anchors, jnp.ones((1, 4), bool), segment)
    assert float(alone[1]["num_labels"]) == float(packed[1]["num_labels"]) == 3 + 1 + 3 + 3
    np.testing.assert_allclose(packed[0], alone[0], rtol=1e-6)
    np.testing.assert_allclose(float(packed[1]["acceptance_length"]), float(alone[1]["acceptance_length"]), rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7),
                 packed[2], alone[2])
    leaky = loss_and_grad(packed_tokens, packed_mask, packed_feats, packed_anchors, jnp.ones((1, 4), bool), None)
    assert float(leaky[1]["num_labels"]) == 3 + 3 + 3 + 3  # the block at 12 labelled with conversation 2
    assert abs(leaky[0] - alone[0]) > 1e-3


def test_the_step_compiles_once_per_shape_and_donates_the_state(setup):
    """`make_train_step`: the spec is its one static argument, so steps of one batch shape share a compiled program
    (another shape compiles once more), and each step consumes the state it was given (donated)."""
    target_cfg, target_params, arch = setup
    optimizer = make_optimizer(1e-3, total_steps=10)
    graphdef, state = _new_state(arch, optimizer)
    spec = _spec(graphdef, target_cfg, arch, optimizer)
    assert hash(spec) == hash(dataclasses.replace(spec)) and spec == dataclasses.replace(spec)
    step = make_train_step(spec, _frozen(target_cfg, target_params))
    batch = _greedy_batch(target_cfg, target_params)
    before = step.jitted._cache_size()  # jit's cache of train_step is shared with the other tests' steps
    for _ in range(3):
        given = state
        state, _ = step(state, batch)
        assert all(x.is_deleted() for x in jax.tree.leaves((given.params, given.step, given.rng)))
    assert step.jitted._cache_size() - before == 1
    shorter = TrainBatch(tokens=batch.tokens[:, : S // 2], loss_mask=batch.loss_mask[:, : S // 2])
    for _ in range(2):
        state, _ = step(state, shorter)
    assert step.jitted._cache_size() - before == 2
