"""The DFlash drafter (docs/design.md §4.1, §4.5, pitfalls 3, 4, 7): inference == training path, KV injection
without the input norm, RoPE positions, z-lab parameter names, config errors. fp32 on CPU."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from flax import nnx
from reference import block_positions, mask_token_embeds

from dflash.configs.schema import ConfigError
from dflash.models import decoder
from dflash.models.config import DecoderConfig
from dflash.models.drafter import (
    BlockVisibility,
    DFlashDrafter,
    DrafterConfig,
    block_token_ids,
    concat_features,
    drafter_logits,
    hf_tensor_names,
    param_count,
    resolve_drafter,
    to_hf_tensors,
)
from dflash.models.loading import load_hf_dir

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


TOL = 1e-5
ROPE_SHIFT_TOL = 1e-4  # relative-position invariance at shifted absolute positions (fp32 sin/cos error)
K = 4
LAYER_IDS = (1, 3)
MASK_ID = 255


@pytest.fixture(scope="module", params=["qwen3_untied", pytest.param("llama_tied", marks=pytest.mark.slow)])
def setup(request):
    """(target cfg, target params, drafter, target features [B, S, F*D], tokens [B, S])."""
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / request.param)
    cfg = DrafterConfig(num_layers=2, num_features=2, layer_ids=LAYER_IDS, block_size=K)
    arch = resolve_drafter(cfg, target_cfg, mask_token_id=MASK_ID)
    drafter = _random_norms(DFlashDrafter(arch, nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, target_cfg.vocab_size)
    _, feats = decoder.forward(target_params, target_cfg, tokens, layer_ids=LAYER_IDS, with_logits=False)
    return target_cfg, target_params, drafter, concat_features(feats), tokens


def _random_norms(drafter: DFlashDrafter) -> DFlashDrafter:
    """Give every RMSNorm weight random values (at init they are all ones, which would hide a norm
    applied twice or to the wrong stream)."""
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(drafter, nnx.Param)) if "norm" in str(p[-2])]
    for i, path in enumerate(paths):
        module = drafter
        for name in path[:-1]:
            module = module[name] if isinstance(name, int) else getattr(module, name)
        shape = module.weight[...].shape
        module.weight[...] = 1.0 + 0.5 * jax.random.normal(jax.random.key(100 + i), shape)
    return drafter


def _training_mask(anchors_B: np.ndarray, ctx_len: int, block_size: int) -> jax.Array:
    """One block per row: query sees context key s iff s < anchor, and all keys of its block."""
    ctx = np.arange(ctx_len)[None, None, :] < anchors_B[:, None, None]
    ctx = np.broadcast_to(ctx, (len(anchors_B), block_size, ctx_len))
    return jnp.asarray(np.concatenate([ctx, np.ones((len(anchors_B), block_size, block_size), bool)], axis=-1))


def _block(target_params, tokens, anchors_B: np.ndarray):
    starts = jnp.take_along_axis(tokens, jnp.asarray(anchors_B)[:, None], axis=1)[:, 0]
    return mask_token_embeds(target_params, starts, K, MASK_ID), block_positions(jnp.asarray(anchors_B), K)


def _inference(drafter, feats, embeds, pos, anchors_B: np.ndarray, slots: int = 16, fill: float = 0.0):
    """Engine-style: context = positions < anchor in a padded buffer of `slots`; stale slots hold `fill`."""
    b, s, fd = feats.shape
    buf = jnp.full((b, slots, fd), fill, feats.dtype).at[:, :s].set(feats)
    valid = jnp.arange(slots)[None, :] < jnp.asarray(anchors_B)[:, None]
    buf = jnp.where(valid[:, :, None], buf, fill)
    ctx_pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (b, slots))
    ctx_kv = drafter.context_kv(drafter.fuse(buf), ctx_pos)
    return drafter.draft_block(embeds, pos, ctx_kv, valid)


def _close(a, b, tol=TOL) -> bool:
    return float(jnp.max(jnp.abs(a - b))) <= tol


# ----------------------------------------------------------------------------- inference == training


def test_inference_path_equals_training_call(setup):
    target_cfg, target_params, drafter, feats, tokens = setup
    anchors = np.array([5, 9])
    embeds, pos = _block(target_params, tokens, anchors)
    ctx_pos = jnp.broadcast_to(jnp.arange(feats.shape[1], dtype=jnp.int32), feats.shape[:2])
    train = drafter(embeds, pos, feats, ctx_pos, _training_mask(anchors, feats.shape[1], K))
    infer = _inference(drafter, feats, embeds, pos, anchors, fill=3.0)  # stale slots hold garbage
    assert train.shape == (2, K, target_cfg.hidden_size)
    assert _close(train, infer)
    logits = drafter_logits(target_params, target_cfg, infer)
    assert logits.shape == (2, K, target_cfg.vocab_size) and logits.dtype == jnp.float32


def test_packed_blocks_equal_separate_blocks(setup):
    """Two blocks packed in one training call (block-diagonal mask) == each block drafted alone."""
    _, target_params, drafter, feats, tokens = setup
    s = feats.shape[1]
    anchors = [3, 8]
    parts = [_block(target_params, tokens[:1], np.array([a])) for a in anchors]
    embeds = jnp.concatenate([e for e, _ in parts], axis=1)
    pos = jnp.concatenate([p for _, p in parts], axis=1)
    q = K * len(anchors)
    visible = np.zeros((1, q, s + q), bool)
    for j, a in enumerate(anchors):
        rows = slice(j * K, (j + 1) * K)
        visible[0, rows, :a] = True
        visible[0, rows, s + j * K: s + (j + 1) * K] = True
    ctx_pos = jnp.arange(s, dtype=jnp.int32)[None]
    packed = drafter(embeds, pos, feats[:1], ctx_pos, jnp.asarray(visible))
    for j, (a, (e, p)) in enumerate(zip(anchors, parts, strict=True)):
        alone = _inference(drafter, feats[:1], e, p, np.array([a]))
        assert _close(packed[:, j * K:(j + 1) * K], alone)


def test_block_local_attention_equals_the_dense_mask(setup):
    """The training path's block-local attention (O(Q*(S+K))) == the dense [B, Q, S+Q] mask, forward and
    gradients, with a padding block (anchor -1) and an invalid context slot in the batch."""
    _, _, drafter, feats, _ = setup
    b, s, _ = feats.shape
    anchors = jnp.array([[3, 8, -1], [1, 5, 11]])
    n = anchors.shape[1]
    ctx_valid = jnp.ones((b, s), bool).at[1, 0].set(False)
    vis = BlockVisibility.from_anchors(anchors, ctx_valid)
    dense = vis.dense(K)
    assert dense.shape == (b, n * K, s + n * K)
    assert not bool(dense[0, 0, 3]) and bool(dense[0, 0, 2])  # strictly before the anchor
    embeds = jax.random.normal(jax.random.key(5), (b, n * K, feats.shape[-1] // 2))
    pos = jnp.maximum(anchors, 0).repeat(K, axis=1) + jnp.tile(jnp.arange(K), n)[None]
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    kept = (anchors >= 0).repeat(K, axis=1)[..., None]

    def out(x, visible):
        return jnp.where(kept, drafter(x, pos, feats, ctx_pos, visible), 0.0)

    assert _close(out(embeds, vis), out(embeds, dense))
    g_blk = jax.grad(lambda x: jnp.sum(jnp.sin(out(x, vis))))(embeds)
    g_dense = jax.grad(lambda x: jnp.sum(jnp.sin(out(x, dense))))(embeds)
    assert _close(g_blk, g_dense)


# ----------------------------------------------------------------------------- pitfall 3: no input norm on c


def test_context_kv_matches_hand_computation(setup):
    """Context K of layer l = RoPE_ctx(k_norm(c @ Wk)), V = c @ Wv: no input_layernorm applied to c."""
    _, _, drafter, feats, _ = setup
    arch = drafter.arch
    b, s, _ = feats.shape
    c = decoder.rms_norm(feats @ drafter.fc.kernel[...], drafter.hidden_norm.weight[...], arch.rms_norm_eps)
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) + 2, (b, s))
    cos, sin = decoder.rope_tables(arch.rope_config, ctx_pos)
    kvs = drafter.context_kv(drafter.fuse(feats), ctx_pos)
    for layer, (k, v) in zip(drafter.layers, kvs, strict=True):
        att = layer.self_attn
        k_ref = (c @ att.k_proj.kernel[...]).reshape(b, s, arch.num_kv_heads, arch.head_dim)
        k_ref = decoder.apply_rope(decoder.rms_norm(k_ref, att.k_norm.weight[...], arch.rms_norm_eps), cos, sin)
        v_ref = (c @ att.v_proj.kernel[...]).reshape(b, s, arch.num_kv_heads, arch.head_dim)
        assert _close(k, k_ref) and _close(v, v_ref)


def _perturbed(drafter: DFlashDrafter, path: tuple, scale: float = 1.5) -> DFlashDrafter:
    """A copy of the drafter with one parameter scaled elementwise by a non-constant factor."""
    other = nnx.clone(drafter)
    module = other
    for name in path[:-1]:
        module = module[name] if isinstance(name, int) else getattr(module, name)
    var = getattr(module, path[-1])
    value = var[...]
    var[...] = value * (scale + jnp.linspace(0.0, 1.0, value.size).reshape(value.shape))
    return other


def test_input_layernorm_does_not_touch_context_but_k_proj_does(setup):
    _, _, drafter, feats, _ = setup
    b, s, _ = feats.shape
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = jax.random.normal(jax.random.key(2), (b, K, drafter.arch.hidden_size))
    cos, sin = decoder.rope_tables(drafter.arch.rope_config, ctx_pos[:, :K] + s)

    def kv(d):
        ctx = d.context_kv(d.fuse(feats), ctx_pos)[0]
        layer = d.layers[0]
        block = layer.self_attn.project_kv(layer.input_layernorm(x), cos, sin)
        return ctx, block

    (ctx0, blk0) = kv(drafter)
    (ctx1, blk1) = kv(_perturbed(drafter, ("layers", 0, "input_layernorm", "weight")))
    assert _close(ctx0[0], ctx1[0]) and _close(ctx0[1], ctx1[1])  # context K/V unchanged
    assert not _close(blk0[0], blk1[0])  # block K does go through input_layernorm
    for name in ("k_proj", "k_norm"):
        leaf = "kernel" if name == "k_proj" else "weight"
        (ctx2, blk2) = kv(_perturbed(drafter, ("layers", 0, "self_attn", name, leaf)))
        assert not _close(ctx0[0], ctx2[0]) and not _close(blk0[0], blk2[0])  # shared weights
    (ctx3, blk3) = kv(_perturbed(drafter, ("layers", 0, "self_attn", "v_proj", "kernel")))
    assert not _close(ctx0[1], ctx3[1]) and not _close(blk0[1], blk3[1])


# ----------------------------------------------------------------------------- pitfall 4: RoPE and concat


def test_rope_positions_of_context_matter(setup):
    _, target_params, drafter, feats, tokens = setup
    b, s, _ = feats.shape
    embeds, _ = _block(target_params, tokens, np.array([s - 1, s - 1]))
    pos = block_positions(jnp.array([s, s]), K)  # the block right after the full context
    valid = jnp.ones((b, s), bool)
    ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    fused = drafter.fuse(feats)
    base = drafter.draft_block(embeds, pos, drafter.context_kv(fused, ctx_pos), valid)
    shifted_ctx = drafter.draft_block(embeds, pos, drafter.context_kv(fused, ctx_pos + 1), valid)
    assert not _close(base, shifted_ctx)  # context rotated at its own positions, not the block's
    both = drafter.draft_block(embeds, pos + 7, drafter.context_kv(fused, ctx_pos + 7), valid)
    assert _close(base, both, ROPE_SHIFT_TOL)  # only relative positions matter when both shift


def test_block_sees_exactly_valid_context_plus_block(setup):
    _, target_params, drafter, feats, tokens = setup
    anchors = np.array([3, 3])
    embeds, pos = _block(target_params, tokens, anchors)
    padded = _inference(drafter, feats, embeds, pos, anchors, slots=16, fill=-7.0)
    ctx_kv = drafter.context_kv(drafter.fuse(feats[:, :3]), block_positions(jnp.zeros(2, jnp.int32), 3))
    exact = drafter.draft_block(embeds, pos, ctx_kv, jnp.ones((2, 3), bool))  # 3 context keys + K block keys
    assert _close(padded, exact)
    empty = _inference(drafter, feats, embeds, pos, np.array([0, 0]))
    assert bool(jnp.all(jnp.isfinite(empty)))
    no_ctx = [(k[:, :0], v[:, :0]) for k, v in ctx_kv]
    assert _close(empty, drafter.draft_block(embeds, pos, no_ctx, jnp.ones((2, 0), bool)))


def test_block_is_bidirectional(setup):
    """Changing the last block token's embedding changes the output at index 0 (non-causal)."""
    _, target_params, drafter, feats, tokens = setup
    anchors = np.array([5, 5])
    embeds, pos = _block(target_params, tokens, anchors)
    out = _inference(drafter, feats, embeds, pos, anchors)
    out2 = _inference(drafter, feats, embeds.at[:, -1].add(1.0), pos, anchors)
    assert not _close(out[:, 0], out2[:, 0])


# ----------------------------------------------------------------------------- names and parameters


def _zlab_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


def test_hf_names_and_shapes(setup):
    target_cfg, _, drafter, _, _ = setup
    names = hf_tensor_names(drafter)
    assert set(names) == _zlab_names(2)
    d, dh, inter = target_cfg.hidden_size, target_cfg.head_dim, target_cfg.intermediate_size
    h, hk = target_cfg.num_heads * dh, target_cfg.num_kv_heads * dh
    assert names["fc.weight"] == (d, 2 * d)
    assert names["layers.1.self_attn.q_proj.weight"] == (h, d)
    assert names["layers.1.self_attn.k_proj.weight"] == (hk, d)
    assert names["layers.1.self_attn.o_proj.weight"] == (d, h)
    assert names["layers.1.self_attn.k_norm.weight"] == (dh,)
    assert names["layers.0.mlp.down_proj.weight"] == (d, inter)
    assert names["layers.0.mlp.gate_proj.weight"] == (inter, d)
    tensors = to_hf_tensors(drafter)
    assert {k: v.shape for k, v in tensors.items()} == names
    assert np.array_equal(tensors["fc.weight"], np.asarray(drafter.fc.kernel[...]).T)


def test_five_layer_drafter_has_58_tensors_and_no_embedding(setup):
    target_cfg, _, _, _, _ = setup
    arch = resolve_drafter(DrafterConfig(num_layers=5, num_features=2, layer_ids=LAYER_IDS), target_cfg, MASK_ID)
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    names = hf_tensor_names(drafter)
    assert len(names) == 3 + 5 * 11 == 58
    assert set(names) == _zlab_names(5)
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert param_count(drafter) == sum(math.prod(s) for s in names.values())
    d, dh, inter = target_cfg.hidden_size, target_cfg.head_dim, target_cfg.intermediate_size
    h, hk = target_cfg.num_heads * dh, target_cfg.num_kv_heads * dh
    per_layer = 2 * d + d * h + 2 * d * hk + h * d + 2 * dh + 3 * d * inter
    assert param_count(drafter) == 2 * d * d + 2 * d + 5 * per_layer  # no V-sized table anywhere


def test_block_ids_layout():
    ids = block_token_ids(jnp.array([7, 9]), 4, 99)
    assert ids.tolist() == [[7, 99, 99, 99], [9, 99, 99, 99]]
    assert block_positions(jnp.array([0, 5]), 3).tolist() == [[0, 1, 2], [5, 6, 7]]


# ----------------------------------------------------------------------------- config


def _target(num_layers: int = 36) -> DecoderConfig:
    return DecoderConfig(family="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                         num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16)


def test_resolve_defaults_and_overrides():
    arch = resolve_drafter(DrafterConfig(), _target(), mask_token_id=5)
    assert arch.layer_ids == (1, 9, 17, 25, 33)
    assert (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (64, 4, 2, 16)
    assert arch.mask_token_id == 5 and arch.block_size == 16 and arch.num_layers == 5
    assert arch.intermediate_size == 128  # the geometry and MLP width are the target's
    arch = resolve_drafter(DrafterConfig(mask_token_id=7), _target(), 5)
    assert arch.mask_token_id == 7
    scaled = dataclasses.replace(_target(), rope_theta=5e5, rms_norm_eps=1e-5)
    arch = resolve_drafter(DrafterConfig(), scaled, 5)
    assert arch.rope_theta == 5e5 and arch.rms_norm_eps == 1e-5


def test_config_errors():
    with pytest.raises(ConfigError, match=r"drafter.block_size must be at least 2.*received 1"):
        DrafterConfig(block_size=1)
    with pytest.raises(ConfigError, match=r"drafter.layer_ids must name num_features=5 ids"):
        DrafterConfig(layer_ids=(1, 2))
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id must lie inside the target's vocab \[0, 1000\)"):
        resolve_drafter(DrafterConfig(mask_token_id=1000), _target())
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id must be set"):
        resolve_drafter(DrafterConfig(), _target())
    with pytest.raises(ValueError, match=r"layer_ids must lie in \[0, 36\).*out of range: \[36\]"):
        resolve_drafter(DrafterConfig(num_features=2, layer_ids=(3, 36)), _target(), 5)
    with pytest.raises(TypeError, match="num_heads"):  # the geometry is the target's, not a recipe's (retired)
        DrafterConfig(num_heads=3)  # type: ignore[call-arg]
