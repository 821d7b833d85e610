"""DFlash2's convolution (`drafter.variant: dflash2`, `drafter.conv`, issue 34): the grouped dynamic depthwise
convolution equals a loop reference and stays inside each block, starts as the identity (a new DFlash2 drafter
computes what DFlash does), trains (gradients reach it), serves losslessly (greedy == AR), and both DFlash2
layouts (z-lab `DFlash2DraftModel`, speculators `dflash2`) round-trip bit-exactly in fp32 with the published
fields and tensor shapes, refusing configs the drafter cannot run with every field named (fp32, CPU)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, assert_greedy_equals_ar, assert_same_params, export_round_trip
from flax import nnx
from reference import split_drafter
from safetensors.numpy import load_file

from dflash.data.batch import TrainBatch
from dflash.models.config import DrafterConfig
from dflash.models.decoder import embed
from dflash.models.drafter import BlockVisibility, DFlashDrafter, online_features, resolve_drafter
from dflash.models.loading import WeightsError, load_hf_dir
from dflash.models.zlab import SELECTOR_RANK, load_zlab, save_zlab
from dflash.serve.engine import decode
from dflash.serve.plan import Chain
from dflash.train.objective import Objective, build_blocks_batch
from dflash.train.step import StepInputs, StepSpec, drafter_loss, train_head

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`

K = 4
GROUP = 16


_forward = nnx.jit(lambda drafter, *args: drafter(*args))  # the training forward, compiled (eager is slow on CPU)
_features = jax.jit(online_features, static_argnums=(1, 3))


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")

    def arch(**kwargs):
        return resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K, **kwargs),
                               target_cfg, mask_token_id=255)

    return target_cfg, target_params, arch


def _live(arch, seed: int) -> DFlashDrafter:
    """A DFlash2 drafter whose convolutions are not the identity (base kernels and projections drawn at random)."""
    drafter = DFlashDrafter(arch, nnx.Rngs(seed))
    key = jax.random.PRNGKey(seed)
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            key, a, b = jax.random.split(key, 3)
            base = conv.base_kernel.get_value()
            conv.base_kernel.set_value(base + 0.3 * jax.random.normal(a, base.shape))
            proj = conv.kernel_projection.kernel
            proj.set_value(0.05 * jax.random.normal(b, proj.get_value().shape))
    return drafter


def test_variant_and_convolution_fields_are_validated(setup):
    target_cfg, _, arch = setup
    with pytest.raises(ValueError, match="drafter.variant"):
        DrafterConfig(variant="dflash3")
    for field in ("conv_kernel_size", "conv_group_size"):
        with pytest.raises(ValueError, match=f"drafter.{field}"):
            DrafterConfig(variant="dflash2", **{field: 0})
    with pytest.raises(ValueError, match="drafter.conv_group_size must divide the hidden size 64"):
        arch(variant="dflash2", conv_group_size=24)
    assert arch(variant="dflash2").conv_kernel_size == 2 and arch(variant="dflash2", conv=False).conv_kernel_size == 0
    assert arch(conv_kernel_size=3).conv_kernel_size == 0  # DFlash v1 has no convolution


def test_the_convolution_equals_a_loop_reference_inside_each_block(setup):
    _, _, arch = setup
    conv = _live(arch(variant="dflash2", conv_kernel_size=3), 0).layers[0].attention_conv
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3 * K, 64)).astype(np.float32)
    y = rng.standard_normal((1, 3 * K, 64)).astype(np.float32)
    pre, after = conv.prepare(jnp.asarray(x), K)
    post = conv.finish(jnp.asarray(y), after, K)
    base = np.asarray(conv.base_kernel[...], np.float64)
    dyn = (x.astype(np.float64) @ np.asarray(conv.kernel_projection.kernel[...], np.float64)).reshape(1, 3 * K, 2, 3,
                                                                                                         64 // GROUP)
    for side, inp, got in ((0, x, pre), (1, y, post)):
        want = np.zeros_like(inp, np.float64)
        for t in range(3 * K):
            for o in range(3):
                if t % K - o < 0:  # before the block's first position: nothing (local to the block)
                    continue
                for c in range(64):
                    want[0, t, c] += (base[side, o, c] + dyn[0, t, side, o, c // GROUP]) * inp[0, t - o, c]
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_the_convolution_keeps_only_its_inputs_for_the_backward_and_its_gradient_is_unchanged(setup, capsys):
    """The convolution is rematerialised (docs/decisions.md D58: the 8B DFlash2 train step 70.0 -> 56.6 GiB per
    chip): its backward keeps x, the dynamic kernels and the base kernel, not the shifted copies of x and the
    per-tap kernels broadcast over each group (x-sized each); the gradient is that of the same function without
    rematerialisation."""
    import functools

    from jax.ad_checkpoint import print_saved_residuals

    from dflash.models.drafter import _block_convolution

    _, _, arch = setup
    conv = _live(arch(variant="dflash2"), 0).layers[0].attention_conv
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 3 * K, 64)), jnp.float32)
    dyn = jnp.asarray(rng.standard_normal((2, 3 * K, 2, 64 // GROUP)), jnp.float32)
    base = conv.base_kernel[...][1]
    plain = functools.partial(_block_convolution, taps=2, group_size=GROUP, block_len=K)
    remat = functools.partial(conv._convolve, block_len=K)
    loss = {name: (lambda a, b, c, f=f: jnp.sum(jnp.sin(f(a, b, c)))) for name, f in (("plain", plain),
                                                                                       ("remat", remat))}
    print_saved_residuals(loss["remat"], x, dyn, base)
    kept = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert all("from the argument" in line or "output of cos" in line for line in kept), kept
    print_saved_residuals(loss["plain"], x, dyn, base)
    assert sum("_block_convolution" in line for line in capsys.readouterr().out.splitlines()) >= 3
    want = jax.grad(loss["plain"], argnums=(0, 1, 2))(x, dyn, base)
    got = jax.grad(loss["remat"], argnums=(0, 1, 2))(x, dyn, base)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_init_from_a_dflash_drafter_starts_a_dflash2_recipe_with_identity_convolutions(setup, tmp_path):
    """`train.init_from` a DFlash v1 export into a DFlash2 recipe: every tensor of the source is loaded as it was
    and the convolutions are added at the identity (base tap 0 = 1, other taps and the kernel projections 0),
    so step 0 computes what the source does; a different depth is still refused by name."""
    import dataclasses
    from types import SimpleNamespace

    from dflash.configs.schema import ConfigError
    from dflash.train.loop import init_from_params

    target_cfg, _, arch = setup
    source = DFlashDrafter(arch(), nnx.Rngs(4))
    save_zlab(source, tmp_path)
    want = arch(variant="dflash2")
    grown = DFlashDrafter(want, nnx.Rngs(0))
    nnx.update(grown, jax.tree.map(jnp.asarray, init_from_params(str(tmp_path), want,
                                                                 SimpleNamespace(cfg=target_cfg))))
    theirs = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    added = []
    for keys, value in nnx.to_flat_state(nnx.state(grown, nnx.Param)):
        if keys in theirs:
            np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(theirs[keys][...]), err_msg=str(keys))
        else:
            added.append(keys)
            identity = np.zeros_like(np.asarray(value[...]))
            if keys[-1] == "base_kernel":
                identity[:, 0] = 1.0
            np.testing.assert_array_equal(np.asarray(value[...]), identity, err_msg=str(keys))
    assert {k[2] for k in added} == {"attention_conv", "mlp_conv"} and len(added) == 2 * 2 * 2  # 2 layers
    rng = np.random.default_rng(2)
    embeds = jnp.asarray(rng.standard_normal((1, 2 * K, 64)), jnp.float32)
    pos = jnp.asarray(np.arange(10, 10 + K)[None].repeat(2, 0).reshape(1, -1) + np.array([[0] * K + [5] * K]))
    feats = jnp.asarray(rng.standard_normal((1, 16, 2 * 64)), jnp.float32)
    visible = BlockVisibility.from_anchors(jnp.asarray([[10, 15]]), jnp.ones((1, 16), bool))
    ctx = jnp.arange(16)[None]
    np.testing.assert_allclose(np.asarray(_forward(grown, embeds, pos, feats, ctx, visible)),
                               np.asarray(_forward(source, embeds, pos, feats, ctx, visible)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="num_layers"):
        init_from_params(str(tmp_path), dataclasses.replace(want, num_layers=3), SimpleNamespace(cfg=target_cfg))


def test_init_from_a_drafter_trained_at_another_block_size_loads_every_weight(setup, tmp_path):
    """A K = 4 DFlash export starts a K = 8 DFlash2 recipe (conv and selector on): no weight's shape depends on K,
    so every tensor of the source is loaded as it was, and the drafter drafts 8-token blocks; a different feature
    layer is still refused by name."""
    import dataclasses
    from types import SimpleNamespace

    from dflash.configs.schema import ConfigError
    from dflash.train.loop import init_from_params

    target_cfg, _, arch = setup
    source = DFlashDrafter(arch(), nnx.Rngs(4))
    save_zlab(source, tmp_path)
    want = dataclasses.replace(arch(variant="dflash2", conv=True, selector=True), block_size=2 * K)
    wide = DFlashDrafter(want, nnx.Rngs(0))
    nnx.update(wide, jax.tree.map(jnp.asarray, init_from_params(str(tmp_path), want, SimpleNamespace(cfg=target_cfg))))
    assert wide.arch.block_size == 2 * K
    theirs = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    mine = dict(nnx.to_flat_state(nnx.state(wide, nnx.Param)))
    assert set(theirs) < set(mine)
    for keys, value in theirs.items():
        np.testing.assert_array_equal(np.asarray(mine[keys][...]), np.asarray(value[...]), err_msg=str(keys))
    with pytest.raises(ConfigError, match="layer_ids"):
        init_from_params(str(tmp_path), dataclasses.replace(want, layer_ids=(0, 3)), SimpleNamespace(cfg=target_cfg))


@pytest.mark.slow
def test_a_new_dflash2_drafter_computes_what_dflash_does(setup):
    """Identity-initialised convolutions: the same weights with and without them give the same hidden states."""
    target_cfg, target_params, arch = setup
    two = DFlashDrafter(arch(variant="dflash2"), nnx.Rngs(1))
    one = DFlashDrafter(arch(), nnx.Rngs(2))
    shared = {k: v for k, v in nnx.to_flat_state(nnx.state(two, nnx.Param)) if "conv" not in ".".join(map(str, k))}
    nnx.update(one, nnx.from_flat_state(list(shared.items())))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 255, size=(1, 24)), jnp.int32)
    feats = _features(target_params, target_cfg, tokens, (1, 3))
    anchors = jnp.asarray([[4, 11, 19]])
    ids = jnp.concatenate([jnp.concatenate([tokens[:, a:a + 1], jnp.full((1, K - 1), 255, jnp.int32)], 1)
                           for a in (4, 11, 19)], 1)
    pos = jnp.asarray([[a + k for a in (4, 11, 19) for k in range(K)]], jnp.int32)
    vis = BlockVisibility.from_anchors(anchors, jnp.ones((1, 24), bool))
    ctx_pos = jnp.arange(24, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(two(embed(target_params, ids), pos, feats, ctx_pos, vis),
                                  one(embed(target_params, ids), pos, feats, ctx_pos, vis))


def test_training_reaches_the_convolution_and_keeps_blocks_apart(setup):
    """A packed training forward gives each block what its forward alone gives (the convolutions never mix
    blocks), and the loss has a gradient on every convolution parameter."""
    target_cfg, target_params, arch = setup
    drafter = _live(arch(variant="dflash2"), 3)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 255, size=(1, 24)), jnp.int32)
    batch = TrainBatch(tokens=tokens, loss_mask=jnp.ones(tokens.shape, jnp.float32))
    blocks = build_blocks_batch(batch, jnp.asarray([[3, 9, 16]]), jnp.asarray([[True, True, True]]), K, 255)
    feats = _features(target_params, target_cfg, tokens, (1, 3))
    embeds = embed(target_params, blocks.block_ids)
    ctx_pos = jnp.arange(24, dtype=jnp.int32)[None]
    packed = _forward(drafter, embeds, blocks.block_pos, feats, ctx_pos,
                      BlockVisibility.from_anchors(jnp.asarray([[3, 9, 16]]), jnp.ones((1, 24), bool)))
    for j, a in enumerate((3, 9, 16)):
        alone = _forward(drafter, embeds[:, j * K:(j + 1) * K], blocks.block_pos[:, j * K:(j + 1) * K], feats,
                         ctx_pos, BlockVisibility.from_anchors(jnp.asarray([[a]]), jnp.ones((1, 24), bool)))
        np.testing.assert_allclose(packed[:, j * K:(j + 1) * K], alone, rtol=1e-5, atol=1e-5)
    graphdef, params = split_drafter(drafter)
    inputs = StepInputs(blocks=blocks, embeds_BxQxD=embeds, feats_BxSxDf=feats)
    head = train_head(target_params, target_cfg)
    spec = StepSpec(graphdef=graphdef, target_cfg=target_cfg, arch=drafter.arch, num_anchors=3, objective=Objective())
    grad_fn = jax.jit(jax.grad(lambda p: drafter_loss(p, inputs, head, spec)[0]))
    grads = grad_fn(params)
    conv_grads = {".".join(map(str, k)): np.abs(np.asarray(v[...])).max()
                  for k, v in nnx.to_flat_state(grads) if "conv" in ".".join(map(str, k))}
    assert len(conv_grads) == 2 * 2 * 2 and min(conv_grads.values()) > 0, conv_grads


# slow: test_selector's test_greedy_with_the_selector_equals_ar (a DFlash2 drafter, its convolutions and the selector,
# through the engine equals AR) and test_sliding_window's ring test (sliding layers in the engine)
@pytest.mark.slow
def test_greedy_dflash2_equals_ar(setup):
    target_cfg, target_params, arch = setup
    drafter = _live(arch(variant="dflash2", layer_types=("sliding_attention", "full_attention"), sliding_window=8), 4)
    prompts = [list(np.random.default_rng(5).integers(0, 255, size=n)) for n in (6, 21)]
    assert_greedy_equals_ar(target_params, target_cfg, drafter, prompts, 20, block_size=K)


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_dflash2_layouts_round_trip_bit_exact(setup, tmp_path, layout):
    target_cfg, _, arch = setup
    a = arch(variant="dflash2")
    drafter = _live(a, 6)
    loaded, config = export_round_trip(drafter, layout, tmp_path, target_cfg, a)
    if layout == "zlab":
        assert config["architectures"] == ["DFlash2DraftModel"]
        assert config["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
        fields = config["dflash_config"]
    else:
        fields = config
        assert fields["speculators_model_type"] == "dflash2" and fields["architectures"] == ["DFlash2DraftModel"]
    assert {k: fields[k] for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                                   "selector_top_k")} == {"block_size": K, "conv_kernel_size": 2,
                                                          "conv_group_size": GROUP, "selector_rank": 256,
                                                          "selector_top_k": 16}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["layers.1.attention_conv.base_kernel"].shape == (2, 2, 64)
    assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 64 // GROUP, 64)
    assert tensors["candidate_selector.predecessor_codebook"].shape == (256, SELECTOR_RANK)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (SELECTOR_RANK, 64)
    assert loaded.arch == a
    assert_same_params(drafter, loaded)


def test_a_dflash2_drafter_without_its_convolution_exports_identity_convolutions(setup, tmp_path):
    """`drafter.conv` off: the layout still holds every convolution (identity), and the import drafts the same."""
    target_cfg, target_params, arch = setup
    plain = DFlashDrafter(arch(variant="dflash2", conv=False), nnx.Rngs(7))
    assert plain.layers[0].attention_conv is None
    save_zlab(plain, tmp_path)
    loaded = load_zlab(tmp_path, target_cfg)
    assert loaded.arch.variant == "dflash2" and loaded.arch.conv_kernel_size == 2
    prompts = [list(np.random.default_rng(8).integers(0, 255, size=9))]
    a = decode(target_params, target_cfg, prompts, 12, max_len=64, plan=Chain(K), drafter=plain)
    b = decode(target_params, target_cfg, prompts, 12, max_len=64, plan=Chain(K), drafter=loaded)
    assert a[0].accepted == b[0].accepted and a[0].token_ids == b[0].token_ids


def test_importing_a_dflash2_config_names_every_field(setup, tmp_path):
    target_cfg, _, arch = setup
    save_zlab(_live(arch(variant="dflash2"), 9), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"].pop("conv_kernel_size")
    config["dflash_config"].update(conv_group_size=24, input_embedding_scale=2.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as err:
        load_zlab(tmp_path, target_cfg)
    for part in ("conv_kernel_size must be a positive integer (DFlash2's convolution); received None",
                 "input_embedding_scale must be 1"):
        assert part in str(err.value)
    config["dflash_config"]["conv_kernel_size"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="conv_group_size 24 must divide hidden_size 64"):
        load_zlab(tmp_path, target_cfg)


def test_the_published_dflash2_config_contract_imports_with_its_tensor_shapes():
    """z-lab's DFlash2 release config (the fields and values of its public test fixture: 5 sliding layers, window
    2048, blocks bidirectional, conv 2 / 16, selector 256 / 16, a 6656-wide 52-layer target) resolves to the
    architecture it describes, and a drafter of it (built abstractly: nothing allocated) has the release's
    convolution tensor names and shapes: base_kernel [2, 2, 6656], kernel_projection [1664, 6656]."""
    from dflash.models.drafter import hf_tensor_names
    from dflash.models.zlab import arch_from_zlab

    config = {
        "architectures": ["DFlash2DraftModel"], "attention_bias": False, "is_causal": False, "head_dim": 128,
        "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2,
                          "final_logit_softcapping": 20.0, "mask_token_id": 201818,
                          "output_multiplier": 0.19611613513818404, "selector_rank": 256, "selector_top_k": 16,
                          "target_layer_ids": [1, 13, 25, 37, 49]},
        "hidden_act": "silu", "hidden_size": 6656, "intermediate_size": 19968,
        "layer_types": ["sliding_attention"] * 5, "max_position_embeddings": 131072, "max_window_layers": 5,
        "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8,
        "num_target_layers": 52, "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0,
                                                                            "rope_type": "default"},
        "sliding_window": 2048, "tie_word_embeddings": False, "use_sliding_window": True, "vocab_size": 202048}
    arch = arch_from_zlab(config, "dflash2-config.json")
    assert (arch.variant, arch.conv_kernel_size, arch.conv_group_size) == ("dflash2", 2, 16)
    assert arch.layer_types == ("sliding_attention",) * 5 and arch.sliding_window == 2048
    assert (arch.block_size, arch.mask_token_id, arch.layer_ids) == (16, 201818, (1, 13, 25, 37, 49))
    shapes = hf_tensor_names(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))))
    for i in range(5):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, 2, 6656)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (1664, 6656)
    assert len(shapes) == 58 + 5 * 4  # DFlash's tensors and four per layer; the selector's are the layout's own
    # the blocks of a sliding layer are causal in the reference unless is_causal says otherwise: refused
    with pytest.raises(WeightsError, match="is_causal must be false"):
        arch_from_zlab({k: v for k, v in config.items() if k != "is_causal"}, "dflash2-config.json")
