"""Sliding-window draft layers (`drafter.layer_types`, `drafter.sliding_window`, issue 34): a sliding layer's
block sees exactly the last W context positions before its anchor, in the training mask and forward and in the
engine's ring cache (each checked against a loop reference), greedy decoding stays equal to AR when the ring
wraps, the ring holds a window's worth of K/V per slot, and both HF layouts carry the layer types bit-exactly
and refuse configs the drafter cannot run, naming every field (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, assert_greedy_equals_ar, assert_same_params, export_round_trip
from flax import nnx

from dflash.models.config import DrafterConfig
from dflash.models.decoder import embed
from dflash.models.drafter import BlockVisibility, DFlashDrafter, drafter_logits, online_features, resolve_drafter
from dflash.models.loading import WeightsError, load_hf_dir
from dflash.models.speculators import load_speculators, save_speculators
from dflash.models.zlab import load_zlab, save_zlab
from dflash.serve.engine import Engine
from dflash.serve.plan import Chain, Limits
from dflash.serve.speculative import propose
from dflash.train.objective import visible

pytestmark = pytest.mark.heavy  # compiles a model's engine: not in `bin/test --fast`

K = 4
W = 8
TYPES = ("sliding_attention", "full_attention")


_forward = nnx.jit(lambda drafter, *args: drafter(*args))  # the training forward, compiled (eager is slow on CPU)
_features = jax.jit(online_features, static_argnums=(1, 3))
_blocks = nnx.jit(lambda drafter, *args: drafter.blocks(*args))
_draft_block = nnx.jit(lambda drafter, *args: drafter.draft_block(*args))


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                         layer_types=TYPES, sliding_window=W), target_cfg, mask_token_id=255)
    return target_cfg, target_params, arch


def test_layer_types_and_window_are_validated():
    for kwargs, field in (({"layer_types": ("full_attention",)}, "drafter.layer_types"),
                          ({"layer_types": ("full_attention", "local")}, r"drafter.layer_types\[1\]"),
                          ({"layer_types": TYPES}, "drafter.sliding_window"),
                          ({"layer_types": TYPES, "sliding_window": K - 1}, "drafter.sliding_window"),
                          ({"sliding_window": 64}, "drafter.sliding_window")):
        with pytest.raises(ValueError, match=field):
            DrafterConfig(num_layers=2, block_size=K, **kwargs)
    assert DrafterConfig(num_layers=2, block_size=K, layer_types=TYPES, sliding_window=K).sliding_window == K


def test_the_training_mask_gives_a_sliding_layer_the_last_w_positions():
    """`BlockVisibility.from_anchors(window=W)` and the dense contract `visible(window=W)` equal a loop over
    (block, key): s < a, s >= a - W, valid, same conversation; full layers keep every s < a."""
    rng = np.random.default_rng(0)
    s, n = 40, 5
    anchors = np.array([[3, 12, 25, 39, -1]])
    valid = rng.random((1, s)) > 0.1
    segments = np.repeat(np.arange(2), s // 2)[None]
    vis = BlockVisibility.from_anchors(jnp.asarray(anchors), jnp.asarray(valid), jnp.asarray(segments), window=W)
    want_sliding = np.zeros((1, n, s), bool)
    want_full = np.zeros((1, n, s), bool)
    for j, a in enumerate(anchors[0]):
        for key in range(s):
            ok = a >= 0 and key < a and valid[0, key] and segments[0, key] == segments[0, max(a, 0)]
            want_full[0, j, key] = ok
            want_sliding[0, j, key] = ok and key >= a - W
    np.testing.assert_array_equal(vis.for_layer(False).ctx_BxNxS, want_full)
    np.testing.assert_array_equal(vis.for_layer(True).ctx_BxNxS, want_sliding)
    assert want_sliding[0, 3].sum() == W  # anchor 39: exactly the W positions 31..38
    # the dense statement (one conversation, every position valid, kept blocks) agrees with the block-local one
    kept = anchors[:, :-1]
    q_anchor = np.repeat(kept[0], K)
    blocks = np.repeat(np.arange(n - 1), K)
    dense = visible(jnp.asarray(q_anchor), jnp.asarray(blocks), jnp.ones(s), jnp.asarray(blocks), window=W)
    local = BlockVisibility.from_anchors(jnp.asarray(kept), jnp.ones((1, s), bool), window=W)
    np.testing.assert_array_equal(dense, local.dense(K, sliding=True)[0])


def test_a_sliding_drafter_in_training_reads_only_the_window(setup):
    """The training forward of an all-sliding drafter over a whole row equals, block by block, its forward over
    only the W context positions before the anchor (at their own positions)."""
    target_cfg, target_params, arch = setup
    arch = dataclasses.replace(arch, layer_types=("sliding_attention",) * 2)
    drafter = DFlashDrafter(arch, nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 255, size=(1, 32)), jnp.int32)
    feats = _features(target_params, target_cfg, tokens, arch.layer_ids)
    anchors = [5, 13, 27]
    ids = jnp.concatenate([jnp.concatenate([tokens[:, a:a + 1], jnp.full((1, K - 1), 255, jnp.int32)], 1)
                           for a in anchors], 1)
    pos = jnp.asarray([[a + k for a in anchors for k in range(K)]], jnp.int32)
    ctx_pos = jnp.arange(32, dtype=jnp.int32)[None]
    vis = BlockVisibility.from_anchors(jnp.asarray([anchors]), jnp.ones((1, 32), bool), window=W)
    whole = _forward(drafter, embed(target_params, ids), pos, feats, ctx_pos, vis)
    for j, a in enumerate(anchors):
        lo = max(0, a - W)
        alone = _forward(drafter, embed(target_params, ids[:, j * K:(j + 1) * K]), pos[:, j * K:(j + 1) * K],
                         feats[:, lo:a], ctx_pos[:, lo:a], [BlockVisibility(jnp.ones((1, 1, a - lo), bool))] * 2)
        np.testing.assert_allclose(whole[:, j * K:(j + 1) * K], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("chunk", "w", "n"), [(None, W, 29),
                                               pytest.param(16, 24, 45, marks=pytest.mark.slow)])  # chunked: nightly
def test_the_engine_ring_holds_the_last_w_positions(setup, chunk, w, n):
    """After a prompt longer than the ring and a few steps, the engine's draft (hidden states and drafts) equals
    a reference that recomputes the context of every committed token and gives the sliding layer only the last
    W positions, the full layer all of them; the ring holds W + K_train slots per sequence. With a chunked
    prefill (16-token chunks, shorter than a 28-slot ring) each later chunk keeps what the earlier ones wrote."""
    target_cfg, target_params, arch = setup
    arch = dataclasses.replace(arch, sliding_window=w)
    drafter = DFlashDrafter(arch, nnx.Rngs(2))
    engine = Engine(target_params, target_cfg, drafter, Chain(K), Limits(slots=2, max_len=128, prefill_chunk=chunk))
    prompts = [list(np.random.default_rng(s).integers(0, 255, size=n)) for s, n in ((3, n), (4, 6))]
    for prompt in prompts:
        engine.submit(prompt, 40)
    for _ in range(5 if chunk is None else 7):
        engine.step()
    assert len(engine.running) == 2 and not engine.prefilling
    state = engine.state
    assert state.draft.wk.shape == (1, 2, w + K, arch.num_kv_heads, arch.head_dim)
    assert state.draft.k.shape[0] == 1  # the full layer only
    drafts = np.asarray(propose(engine.models, state, K))
    for slot, request in engine.running.items():
        committed = request.prompt_ids + request.token_ids[:-1]
        length = len(committed)
        assert length == int(state.lengths[slot])
        tokens = jnp.asarray([committed], jnp.int32)
        fused = drafter.fuse(_features(target_params, target_cfg, tokens, arch.layer_ids))
        kv = drafter.context_kv(fused, jnp.arange(length, dtype=jnp.int32)[None])
        lo = max(0, length - w)
        per_layer = [(k[:, lo:], v[:, lo:]) if arch.sliding(i) else (k, v) for i, (k, v) in enumerate(kv)]
        ids = jnp.asarray([[request.token_ids[-1]] + [255] * (K - 1)], jnp.int32)
        pos = length + jnp.arange(K, dtype=jnp.int32)[None]
        all_visible = [BlockVisibility(jnp.ones((1, 1, k.shape[1]), bool)) for k, _ in per_layer]
        want = _blocks(drafter, embed(target_params, ids), pos, per_layer, all_visible)
        ctx_kv, valid = state.draft.visible(state.lengths)
        ctx_kv = [(k[slot:slot + 1], v[slot:slot + 1]) for k, v in ctx_kv]
        got = _draft_block(drafter, embed(target_params, ids), pos, ctx_kv, [m[slot:slot + 1] for m in valid])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert int(valid[0][slot].sum()) == min(w, length)
        want_drafts = np.asarray(jnp.argmax(drafter_logits(target_params, target_cfg, want[:, 1:]), -1))[0]
        np.testing.assert_array_equal(drafts[slot], want_drafts)


# slow: test_the_engine_ring_holds_the_last_w_positions[None-8-29] (the sliding drafter's ring and drafts in the
# engine equal a reference); test_speculative's test_greedy_dflash_equals_ar_batch_4[4] and test_selector's
# test_greedy_with_the_selector_equals_ar keep greedy DFlash == AR (verification does not depend on the drafts)
@pytest.mark.slow
def test_greedy_dflash_with_sliding_layers_equals_ar(setup):
    target_cfg, target_params, arch = setup
    drafter = DFlashDrafter(arch, nnx.Rngs(3))
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 255, size=n)) for n in (5, 17, 30)]
    assert_greedy_equals_ar(target_params, target_cfg, drafter, prompts, 24, block_size=K)


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_sliding_layers_export_and_import_bit_exact(setup, tmp_path, layout):
    target_cfg, _, arch = setup
    drafter = DFlashDrafter(arch, nnx.Rngs(4))
    loaded, config = export_round_trip(drafter, layout, tmp_path, target_cfg, arch)
    if layout == "zlab":
        assert config["is_causal"] is False
    else:
        assert config["sliding_window_non_causal"] is True
        config = config["transformer_layer_config"]
    assert config["layer_types"] == list(TYPES) and config["sliding_window"] == W
    assert config["use_sliding_window"] is True
    assert loaded.arch == arch
    assert_same_params(drafter, loaded)


def test_importing_a_sliding_config_names_every_mismatching_field(setup, tmp_path):
    target_cfg, _, arch = setup
    drafter = DFlashDrafter(arch, nnx.Rngs(4))
    save_zlab(drafter, tmp_path / "z")
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    config.update(use_sliding_window=False, sliding_window=2, layer_types=["sliding_attention", "chunked"])
    config.pop("is_causal")
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as err:
        load_zlab(tmp_path / "z", target_cfg)
    for part in ("layer_types[1] must be 'full_attention' or 'sliding_attention'; received 'chunked'",
                 "use_sliding_window must be true", "sliding_window must be an integer >= block_size=4 when",
                 "received 2", "is_causal must be false"):
        assert part in str(err.value)
    save_speculators(drafter, tmp_path / "s", verifier="tiny")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    config["sliding_window_non_causal"] = False
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="sliding_window_non_causal must be true"):
        load_speculators(tmp_path / "s", target_cfg)
    # a recipe that expects other layer types or another window is told both
    save_zlab(drafter, tmp_path / "ok")
    expect = dataclasses.replace(arch, layer_types=(), sliding_window=0)
    with pytest.raises(ValueError) as err:
        load_zlab(tmp_path / "ok", target_cfg, expect=expect)
    assert "layer_types: drafter ('sliding_attention', 'full_attention') vs expected ()" in str(err.value)
    assert "sliding_window: drafter 8 vs expected 0" in str(err.value)
    # a config without layer_types: Qwen3Config's rule (layers from max_window_layers on slide when a window is set)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    config.pop("layer_types")
    config["max_window_layers"] = 1
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    assert load_zlab(tmp_path / "ok", target_cfg).arch.layer_types == ("full_attention", "sliding_attention")


def test_init_from_may_change_the_draft_window(setup, tmp_path):
    """No weight depends on the window: a sliding-window export starts a full-attention recipe and a
    full-attention export a sliding-window one, every tensor loaded as it was; another layer count is still
    refused by name."""
    from types import SimpleNamespace

    from dflash.configs.schema import ConfigError
    from dflash.train.loop import init_from_params

    target_cfg, _, arch = setup
    full = dataclasses.replace(arch, layer_types=(), sliding_window=0)
    for source_arch, recipe in ((arch, full), (full, dataclasses.replace(arch, sliding_window=2 * W))):
        source = DFlashDrafter(source_arch, nnx.Rngs(4))
        save_zlab(source, tmp_path / str(source_arch.sliding_window))
        params = init_from_params(str(tmp_path / str(source_arch.sliding_window)), recipe,
                                  SimpleNamespace(cfg=target_cfg))
        started = DFlashDrafter(recipe, nnx.Rngs(0))
        nnx.update(started, jax.tree.map(jnp.asarray, params))
        assert started.arch.sliding_window == recipe.sliding_window
        assert_same_params(source, started)
    with pytest.raises(ConfigError, match="num_layers"):
        init_from_params(str(tmp_path / "0"), dataclasses.replace(arch, num_layers=3, layer_types=(*TYPES, TYPES[0])),
                         SimpleNamespace(cfg=target_cfg))
