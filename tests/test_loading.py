"""Weight loading: GGUF round trip (with llama's Q/K row permutation) and clear errors on bad input."""

import dataclasses
import json
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.models.loading import (
    WeightsError,
    load_gguf,
    load_hf_dir,
    load_weights,
    unpermute_llama_rows,
)
from dflash.models.registry import resolve_source

TOL = 1e-4


def permute_llama_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (rotate-half -> interleaved), the inverse of `unpermute_llama_rows`."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(case: str, path, permute: bool = True) -> None:
    """Write an F32 GGUF the way llama.cpp's converter lays it out (llama: Q/K rows permuted)."""
    src = GOLDEN / "tiny" / case
    hf = json.loads((src / "config.json").read_text())
    from safetensors.numpy import load_file

    tensors = load_file(str(src / "model.safetensors"))
    arch = hf["model_type"]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, arr in tensors.items():
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{names[rest]}"
            if permute and arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = permute_llama_rows(arr, heads)
            elif permute and arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = permute_llama_rows(arr, kv_heads)
        w.add_tensor(out, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("case", ["llama_tied", "qwen2_bias_untied", "qwen3_qknorm_tied"])
def test_gguf_round_trip_matches_transformers(case, tmp_path):
    path = tmp_path / f"{case}.gguf"
    write_gguf_from_hf(case, path)
    cfg, params = load_gguf(path)
    hf_cfg, _ = load_hf_dir(GOLDEN / "tiny" / case)
    # GGUF stores eps as float32 and the context length under its own key; all else must agree exactly.
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert cfg == dataclasses.replace(hf_cfg, rms_norm_eps=cfg.rms_norm_eps)
    ref = np.load(GOLDEN / "tiny" / case / "reference.npz")
    logits, _ = decoder.forward(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(ref["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=TOL, rtol=0)


def test_llama_permutation_is_undone():
    """Without un-permuting llama Q/K rows, the RoPE pairs would be wrong: check the inverse exactly."""
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    np.testing.assert_array_equal(unpermute_llama_rows(permute_llama_rows(w, 8), 8), w)
    assert not np.array_equal(permute_llama_rows(w, 8), w)


def test_unpermuted_llama_gguf_breaks_parity(tmp_path):
    """A llama GGUF written WITHOUT llama.cpp's permutation loads wrongly: the un-permutation is not inert."""
    path = tmp_path / "raw.gguf"
    write_gguf_from_hf("llama_tied", path, permute=False)
    cfg, params = load_gguf(path)
    ref = np.load(GOLDEN / "tiny" / "llama_tied" / "reference.npz")
    logits, _ = decoder.forward(jax.tree.map(jnp.asarray, params), cfg, jnp.asarray(ref["input_ids"]))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() > 1e-2


# ----------------------------------------------------------------------------- bad input


def test_missing_weights_file(tmp_path):
    shutil.copy(GOLDEN / "tiny" / "llama_tied" / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match=r"no \*\.safetensors weights found"):
        load_hf_dir(tmp_path)
    with pytest.raises(WeightsError, match="config.json: missing"):
        load_hf_dir(tmp_path / "nowhere")
    with pytest.raises(WeightsError, match="GGUF file not found"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match="neither 'smollm2' nor an existing path"):
        resolve_source(str(tmp_path / "absent"))


def test_corrupt_weights_files(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(GOLDEN / "tiny" / "llama_tied", hf)
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf_dir(hf)
    good = tmp_path / "good.gguf"
    write_gguf_from_hf("llama_tied", good)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(WeightsError, match=r"bad\.gguf: not a readable GGUF file"):
        load_gguf(bad)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(WeightsError, match=r"junk\.gguf: not a readable GGUF file"):
        load_weights(tmp_path / "junk.gguf")


def test_unsupported_architecture(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(GOLDEN / "tiny" / "llama_tied", hf)
    config = json.loads((hf / "config.json").read_text())
    config["model_type"] = "gpt2"
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"model_type must be one of \['llama', 'qwen2', 'qwen3'\]; received 'gpt2'"):
        load_hf_dir(hf)


def test_config_that_does_not_match_the_weights(tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(GOLDEN / "tiny" / "qwen2_tied", hf)
    config = json.loads((hf / "config.json").read_text())
    config["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' must have shape \(96, 64\).*"
                                           r"received \(128, 64\)"):
        load_hf_dir(hf)
    config["intermediate_size"] = 128
    config["num_hidden_layers"] = 5
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"tensor 'model\.layers\.4\.input_layernorm\.weight' is missing"):
        load_hf_dir(hf)


def test_not_a_model_path(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(WeightsError, match="must be a .gguf file or an HF model directory"):
        load_weights(f)
