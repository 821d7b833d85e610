"""The newer target families against transformers (tools/golden_families.py, fp32, no torch): Mistral (with and
without its window), Gemma 3 text (interleaved local/global layers, QK-norm, scaled embeddings, sandwich norms,
GELU-tanh), Qwen3-MoE (router softmax, top-k, renormalised or not) and gpt-oss (attention sinks, alternating
sliding/full layers, YaRN, its MoE with biases and clamped SwiGLU, MXFP4 experts). Logits and every layer's output
are in tests/test_decoder_parity.py (it runs every golden case); here: the switches are read and matter, the cached
forward over the paged cache (windows included) equals the full forward, the MoE dispatch equals its dense form, and
greedy decoding through the engine equals transformers' `generate`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.models.config import SUPPORTED_FAMILIES
from dflash.models.loading import WeightsError, decoder_config_from_hf, load_hf_dir
from dflash.serve.paged import PagedKVCache, PagePool, PageTable, reference_paged_attention, tree_paged_attention

TOL = 1e-4
WINDOWED = ("gemma3_text", "mistral_window")
FAMILY_CASES = ("mistral_untied", "mistral_window", "gemma3_text", "qwen3_moe", "qwen3_moe_unnormed_tied", "gpt_oss")


def _load(case):
    cfg, params = load_hf_dir(GOLDEN / "tiny" / case)
    return cfg, jax.tree.map(jnp.asarray, params), np.load(GOLDEN / "tiny" / case / "reference.npz")


def _long_error(params, cfg, ref) -> float:
    logits, _ = decoder.forward(params, cfg, jnp.asarray(ref["input_ids_long"]))
    return float(np.abs(np.asarray(logits) - ref["logits_long"]).max())


def test_the_families_are_supported_and_read_from_their_configs():
    assert {"mistral", "gemma3_text", "qwen3_moe"} <= set(SUPPORTED_FAMILIES)
    gemma = load_hf_dir(GOLDEN / "tiny" / "gemma3_text")[0]
    assert gemma.layer_types == ("sliding_attention", "full_attention") * 2 and gemma.sliding_window == 16
    assert gemma.embed_scale and gemma.sandwich_norms and gemma.norm_unit_offset and gemma.qk_norm
    assert gemma.hidden_act == "gelu_tanh" and gemma.attn_scale == pytest.approx(24 ** -0.5)
    assert gemma.local_rope_theta == 10000.0 and gemma.rope_theta == 1e6 and gemma.rope_scaling.kind == "linear"
    mistral, window = (load_hf_dir(GOLDEN / "tiny" / c)[0] for c in ("mistral_untied", "mistral_window"))
    assert not mistral.windowed and window.sliding_layers == (True,) * 4 and window.sliding_window == 16
    moe, unnormed = (load_hf_dir(GOLDEN / "tiny" / c)[0] for c in ("qwen3_moe", "qwen3_moe_unnormed_tied"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (8, 2, 32, True)
    assert (unnormed.num_experts, unnormed.num_experts_per_tok, unnormed.norm_topk_prob) == (6, 3, False)
    assert moe.qk_norm and not moe.qkv_bias
    oss = load_hf_dir(GOLDEN / "tiny" / "gpt_oss")[0]
    assert oss.layer_types == ("sliding_attention", "full_attention") * 2 and oss.sliding_window == 8
    assert oss.attn_sinks and oss.qkv_bias and oss.o_bias and oss.moe_bias and oss.moe_router == "topk_softmax"
    assert (oss.num_experts, oss.num_experts_per_tok, oss.moe_intermediate_size) == (8, 2, 32)
    assert (oss.swiglu_limit, oss.swiglu_alpha) == (0.6, 1.702)
    assert oss.rope_scaling.kind == "yarn" and oss.rope_scaling.factor == 8.0 and not oss.rope_scaling.truncate
    assert oss.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(8.0) + 1)


@pytest.mark.parametrize("case, change", [
    ("gemma3_text", {"layer_types": (), "sliding_window": 0}),     # local layers treated as global
    ("gemma3_text", {"local_rope_theta": 0.0}),                      # local layers on the global RoPE
    ("gemma3_text", {"attn_scale": 0.0}),                            # 1/sqrt(head_dim) instead of the family's
    ("mistral_window", {"layer_types": (), "sliding_window": 0}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen3_moe_unnormed_tied", {"norm_topk_prob": True}),
    ("gpt_oss", {"attn_sinks": False}),
    ("gpt_oss", {"swiglu_limit": 0.0}),
    ("gpt_oss", {"layer_types": (), "sliding_window": 0}),
    ("gpt_oss", {"rope_scaling": None}),
])
def test_each_switch_matters(case, change):
    """Parity holds as loaded (test_decoder_parity) and breaks when one switch is flipped: none is inert."""
    cfg, params, ref = _load(case)
    assert _long_error(params, cfg, ref) < TOL
    assert _long_error(params, dataclasses.replace(cfg, **change), ref) > 1e-2


def test_moe_sorted_dispatch_equals_the_dense_form():
    cfg, params, _ = _load("qwen3_moe")
    lp = jax.tree.map(lambda a: a[1], params["layers"])
    h = jax.random.normal(jax.random.key(0), (3, 7, cfg.hidden_size))
    sparse, dense = decoder.moe_mlp(cfg, lp, h), decoder.moe_mlp_dense(cfg, lp, h)
    np.testing.assert_allclose(np.asarray(sparse), np.asarray(dense), atol=1e-5, rtol=0)
    # A token's output does not depend on the other tokens routed with it (no capacity, nothing dropped).
    alone = decoder.moe_mlp(cfg, lp, h[1:2, 3:4])
    np.testing.assert_allclose(np.asarray(alone[0, 0]), np.asarray(sparse[1, 3]), atol=1e-6, rtol=0)


def test_moe_router_follows_the_reference():
    """softmax in fp32, top-k, renormalised when norm_topk_prob: checked on one row by hand."""
    cfg, params, _ = _load("qwen3_moe")
    router = params["layers"]["router"][0]
    x = jax.random.normal(jax.random.key(1), (1, cfg.hidden_size))
    weights, experts = decoder.moe_route(cfg, router, x)
    probs = np.asarray(jax.nn.softmax(x @ router))[0]
    top = np.argsort(-probs)[:2]
    assert np.asarray(experts)[0].tolist() == top.tolist()
    np.testing.assert_allclose(np.asarray(weights)[0], probs[top] / probs[top].sum(), rtol=1e-6)
    raw, _ = decoder.moe_route(dataclasses.replace(cfg, norm_topk_prob=False), router, x)
    np.testing.assert_allclose(np.asarray(raw)[0], probs[top], rtol=1e-6)


@pytest.mark.heavy
@pytest.mark.parametrize("case", ["gemma3_text", "qwen3_moe", "gpt_oss"])
def test_paged_cached_forward_with_rollback_equals_the_full_forward(case):
    """Chunks through the engine's paged cache past the window (16), with a rejected block rolled back, give the
    full forward's logits and features: a local layer's old K/V stay cached and are masked (D75)."""
    cfg, params, ref = _load(case)
    tokens = ref["input_ids"]  # [2, 40]
    full_logits, full_feats = decoder.forward(params, cfg, jnp.asarray(tokens), layer_ids=(0, 2))
    pool = PagePool(40, 4)
    table = PageTable(pool, 2, 12)
    cache = PagedKVCache.create(cfg, 2, 12, 40, 4)

    @jax.jit
    def append(cache, chunk):
        positions = cache.lengths[:, None] + jnp.arange(chunk.shape[1])[None, :]
        return decoder.forward_cached(params, cfg, chunk, positions, cache, layer_ids=(0, 2))

    start = 0
    for size, wrong in ((9, False), (8, True), (8, False), (1, False), (8, True), (8, False), (14, False)):
        table.ensure_batch([start + size] * 2)
        cache = cache.with_page_table(table.array())
        chunk = tokens[:, start:start + size]
        logits, feats, cache = append(cache, jnp.asarray((chunk + 5) % cfg.vocab_size if wrong else chunk))
        if wrong:
            cache = cache.rollback(jnp.array([start, start]))
            continue
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits[:, start:start + size]), atol=TOL,
                                   rtol=0)
        np.testing.assert_allclose(np.asarray(feats), np.asarray(full_feats[:, :, start:start + size]), atol=TOL,
                                   rtol=0)
        start += size
    assert start == 40


def test_windowed_paged_attention_masks_beyond_the_window():
    """reference_paged_attention with a window equals dense attention over the last W keys; a tree chunk that is a
    chain sees exactly what the chain does."""
    rng = np.random.default_rng(0)
    b, t, h, hk, dh, page, pages = 2, 5, 4, 2, 8, 4, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, dh)), jnp.float32)
    k_pages = jnp.asarray(rng.normal(size=(1, pages + 1, page, hk, dh)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(1, pages + 1, page, hk, dh)), jnp.float32)
    table = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    lengths = jnp.asarray([9, 3], jnp.int32)
    window = jnp.int32(6)
    got = reference_paged_attention(q, k_pages, v_pages, jnp.int32(0), table, lengths, window=window)
    k_seq = k_pages[0, table].reshape(b, 16, hk, dh)
    v_seq = v_pages[0, table].reshape(b, 16, hk, dh)
    q_idx = lengths[:, None] + jnp.arange(t)[None, :]
    kv = jnp.arange(16)[None, None, :]
    visible = (kv <= q_idx[:, :, None]) & (kv >= q_idx[:, :, None] - 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(decoder.attend(q, k_seq, v_seq, visible)), atol=1e-6)
    full = reference_paged_attention(q, k_pages, v_pages, jnp.int32(0), table, lengths, window=jnp.int32(0))
    assert np.abs(np.asarray(full) - np.asarray(got)).max() > 1e-3  # the window is not inert
    chain = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    tree = tree_paged_attention(q, k_pages, v_pages, jnp.int32(0), table, lengths, chain, window=window)
    np.testing.assert_allclose(np.asarray(tree), np.asarray(got), atol=1e-6)


def test_unsupported_variants_are_refused_naming_the_field():
    base = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    decoder_config_from_hf(base)
    with pytest.raises(WeightsError, match=r"mlp_only_layers must be \[\].*received mlp_only_layers=\[1\]"):
        decoder_config_from_hf({**base, "mlp_only_layers": [1]})
    gemma = {**base, "model_type": "gemma3_text", "final_logit_softcapping": 30.0}
    with pytest.raises(WeightsError, match="final_logit_softcapping must be null.*received 30.0"):
        decoder_config_from_hf(gemma)
    with pytest.raises(WeightsError, match=r"model_type must be one of \[.*'qwen3_moe', 'gpt_oss'\]; received 'gpt2'"):
        decoder_config_from_hf({**base, "model_type": "gpt2"})


@pytest.mark.heavy
@pytest.mark.parametrize("case, plan_name", [
    ("gemma3_text", "chain"), ("qwen3_moe", "chain"), ("gpt_oss", "chain"),
    # slow: the default tier's three cover windows, sinks and both MoE kinds, AR included (a chain's output is AR's)
    *(pytest.param(case, plan, marks=pytest.mark.slow) for case in FAMILY_CASES for plan in ("ar", "chain")
      if (case, plan) not in {("gemma3_text", "chain"), ("qwen3_moe", "chain"), ("gpt_oss", "chain")}),
])
def test_engine_greedy_equals_transformers_generate(case, plan_name):
    """AR through the engine (paged cache, chunked prefill) and DFlash chain decoding with an untrained drafter
    (rejections and rollbacks at every step) both give transformers' greedy tokens (the windowed and MoE families'
    chains in the default tier; every family with both plans in the slow tier)."""
    from conftest import ALONE_LEN, ALONE_SLOTS
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits

    cfg, params, ref = _load(case)
    prompt, want = ref["greedy_prompt"].tolist(), ref["greedy_tokens"].tolist()
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=4), cfg,
                           mask_token_id=cfg.vocab_size - 1)
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    plan, with_drafter = (AR(), None) if plan_name == "ar" else (Chain(4), drafter)
    engine = Engine(params, cfg, with_drafter, plan, Limits(slots=ALONE_SLOTS, max_len=ALONE_LEN))
    rid = engine.submit(prompt, len(want), ())
    assert engine.run()[rid].token_ids == want


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_architecture_is_known_without_the_weights(case):
    """`known_target` (config.json only) builds the loader's config and `target_param_shapes` its params tree: what
    `dflash launch compile` sizes a pod recipe with (experts and Gemma's embedding scale included)."""
    from dflash.models.registry import known_target, target_param_shapes

    cfg, params = load_hf_dir(GOLDEN / "tiny" / case)
    assert known_target(str(GOLDEN / "tiny" / case)).cfg == cfg
    assert target_param_shapes(cfg) == jax.tree.map(lambda a: tuple(a.shape), params)


def test_experts_split_over_an_expert_mesh_axis():
    """The sharding table names an `expert` axis: on a mesh with one (2 tensor x 4 expert CPU devices) each device
    holds 2 of the 8 experts, a mesh without one keeps them whole per device, and the sharded forward still gives
    transformers' logits."""
    import numpy as np_
    from jax.sharding import Mesh

    from dflash.models.sharding import AXES, EXPERT_AXIS, TARGET_RULES, place, tree_shardings

    cfg, params, ref = _load("qwen3_moe")
    devices = np_.asarray(jax.devices()[:8], dtype=object)
    mesh = Mesh(devices.reshape(1, 1, 2, 4), (*AXES, EXPERT_AXIS))
    placed = place(params, TARGET_RULES, mesh)
    gate = placed["layers"]["we_gate"]  # [L, E, D, Ie]
    assert gate.sharding.shard_shape(gate.shape) == (4, 2, 64, 16)
    plain = tree_shardings(params, TARGET_RULES, Mesh(devices.reshape(1, 4, 2), AXES))
    assert plain["layers"]["we_gate"].shard_shape(gate.shape) == (4, 8, 16, 16)
    logits, _ = jax.jit(lambda p, t: decoder.forward(p, cfg, t))(placed, jnp.asarray(ref["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=TOL, rtol=0)


def test_mxfp4_experts_dequantise_as_transformers_does(tmp_path):
    """The released gpt-oss checkpoints store experts as MXFP4 `_blocks` / `_scales`: dequantised at load, bit for
    bit what transformers' `convert_moe_packed_tensors` gives, and the model then computes transformers' logits."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from dflash.models.loading import dequantize_mxfp4

    src = GOLDEN / "tiny" / "gpt_oss"
    packed = load_file(str(src / "mxfp4" / "experts.safetensors"))
    ref = np.load(src / "mxfp4" / "reference.npz")
    for i in range(4):
        blocks = packed[f"model.layers.{i}.mlp.experts.gate_up_proj_blocks"]
        scales = packed[f"model.layers.{i}.mlp.experts.gate_up_proj_scales"]
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales).transpose(0, 2, 1), ref["gate_up"][i])
    hf = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(src, hf, ignore=shutil.ignore_patterns("mxfp4"))
    tensors = {k: v for k, v in load_file(str(hf / "model.safetensors")).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, str(hf / "model.safetensors"))
    cfg, params = load_hf_dir(hf)
    np.testing.assert_array_equal(params["layers"]["we_gate"], ref["gate_up"][..., 0::2])
    np.testing.assert_array_equal(params["layers"]["we_down"], ref["down"])
    inputs = np.load(src / "reference.npz")["input_ids"]
    logits, _ = decoder.forward(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(inputs))
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=TOL, rtol=0)


@pytest.mark.parametrize("case", ["gemma3_text", "gpt_oss", "qwen3_moe", "mistral_window"])
def test_the_zlab_layout_carries_a_drafter_for_each_family(case, tmp_path):
    """A drafter follows its target's RoPE (Gemma 3's linear-scaled global base, gpt-oss's YaRN with its attention
    factor): the z-lab config writes it, and the drafter loads back equal, checked against the target."""
    import json

    from conftest import assert_same_params
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
    from dflash.models.zlab import load_zlab, save_zlab

    cfg, _ = load_hf_dir(GOLDEN / "tiny" / case)
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(0, 2), block_size=4), cfg,
                           mask_token_id=250)
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    save_zlab(drafter, tmp_path)
    rope = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert rope["rope_type"] == {"gemma3_text": "linear", "gpt_oss": "yarn"}.get(case, "default")
    back = load_zlab(tmp_path, cfg, expect=arch)
    assert back.arch.rope_scaling == cfg.rope_scaling
    assert_same_params(drafter, back)
