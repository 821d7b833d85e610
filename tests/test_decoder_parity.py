"""Model parity against golden outputs of HF transformers (tools/golden_tiny.py), fp32, no torch.

Each tiny random config covers one switch of the family: llama tied / untied with Llama-3 RoPE scaling,
qwen2 with qkv bias (tied, untied), qwen3 with q/k norm and an independent head_dim (tied, untied).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, TINY_CASES

from dflash.models import decoder
from dflash.models.config import default_layer_ids
from dflash.models.loading import load_hf_dir

TOL = 1e-4


def _load(case):
    cfg, params = load_hf_dir(GOLDEN / "tiny" / case)
    return cfg, jax.tree.map(jnp.asarray, params), np.load(GOLDEN / "tiny" / case / "reference.npz")


@pytest.mark.parametrize("case", TINY_CASES)
def test_logits_and_every_layer_output_match_transformers(case):
    cfg, params, ref = _load(case)
    logits, feats = decoder.forward(params, cfg, jnp.asarray(ref["input_ids"]),
                                    layer_ids=tuple(range(cfg.num_layers)))
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=TOL, rtol=0)
    # Layer id j is the raw output of decoder layer j (HF hidden_states[j + 1], before the final norm).
    np.testing.assert_allclose(np.asarray(feats), ref["layer_outputs"], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(feats[:-1]), ref["hf_hidden_states"][1:-1], atol=TOL, rtol=0)
    long_logits, _ = decoder.forward(params, cfg, jnp.asarray(ref["input_ids_long"]))
    np.testing.assert_allclose(np.asarray(long_logits), ref["logits_long"], atol=TOL, rtol=0)


def test_switches_are_read_from_the_configs():
    seen = {case: load_hf_dir(GOLDEN / "tiny" / case)[0] for case in TINY_CASES}
    assert seen["qwen2_bias_untied"].qkv_bias and not seen["qwen2_bias_untied"].tie_word_embeddings
    assert seen["qwen3_qknorm_tied"].qk_norm and seen["qwen3_qknorm_tied"].head_dim == 32
    assert seen["llama3_scaled_untied"].rope_scaling.kind == "llama3"
    assert seen["llama_tied"].tie_word_embeddings and not seen["llama_tied"].qk_norm


def test_rope_scaling_matters():
    """Dropping the Llama-3 scaling must break parity at long positions (the switch is not inert)."""
    import dataclasses

    cfg, params, ref = _load("llama3_scaled_untied")
    unscaled = dataclasses.replace(cfg, rope_scaling=None)
    logits, _ = decoder.forward(params, unscaled, jnp.asarray(ref["input_ids_long"]))
    assert np.abs(np.asarray(logits) - ref["logits_long"]).max() > 1e-2


def test_features_only_forward_stops_early_and_matches():
    cfg, params, ref = _load("qwen3_untied")
    logits, feats = decoder.forward(params, cfg, jnp.asarray(ref["input_ids"]), layer_ids=(0, 2), with_logits=False)
    assert logits is None
    np.testing.assert_allclose(np.asarray(feats), ref["layer_outputs"][[0, 2]], atol=TOL, rtol=0)
    # Only layers 0..2 are in the program: layer 3's weights can be garbage without changing anything.
    broken = jax.tree.map(lambda a: a, params)
    broken["layers"] = {k: v.at[3].set(jnp.nan) for k, v in params["layers"].items()}
    _, feats_broken = decoder.forward(broken, cfg, jnp.asarray(ref["input_ids"]), layer_ids=(0, 2), with_logits=False)
    np.testing.assert_array_equal(np.asarray(feats_broken), np.asarray(feats))


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    assert default_layer_ids(30, 1) == (15,)
    assert default_layer_ids(30, 5) == (1, 8, 14, 20, 27)


def test_layer_id_out_of_range_is_a_clear_error():
    cfg, params, ref = _load("llama_tied")
    with pytest.raises(ValueError, match=r"layer_ids must lie in \[0, 4\).*out of range: \[4\]"):
        decoder.forward(params, cfg, jnp.asarray(ref["input_ids"]), layer_ids=(1, 4))
    with pytest.raises(ValueError, match="strictly increasing"):
        decoder.forward(params, cfg, jnp.asarray(ref["input_ids"]), layer_ids=(2, 1))
