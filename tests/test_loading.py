"""Weight loading: GGUF round trip (with llama's Q/K row permutation) and clear errors on bad input."""

import dataclasses
import json
import os
import re
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models import decoder
from dflash.models.config import SUPPORTED_FAMILIES
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
    families = re.escape(str(list(SUPPORTED_FAMILIES)))
    assert {"llama", "qwen3", "gemma3_text", "qwen3_moe"} <= set(SUPPORTED_FAMILIES)
    with pytest.raises(WeightsError, match=rf"model_type must be one of {families}; received 'gpt2'"):
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


def _every_kind_gguf(path, note: str = "") -> None:
    """A GGUF with a value of every metadata type and tensors stored as F32, F16, I32 and Q8_0."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    w = gguf.GGUFWriter(str(path), "llama")
    for i, (kind, value) in enumerate([(V.UINT8, 200), (V.INT8, -3), (V.UINT16, 60000), (V.INT16, -30000),
                                       (V.UINT32, 4_000_000_000), (V.INT32, -2_000_000_000), (V.FLOAT32, 0.5),
                                       (V.BOOL, True), (V.STRING, "héllo " + note), (V.UINT64, 2**63),
                                       (V.INT64, -(2**62)), (V.FLOAT64, 1e-300)]):
        w.add_key_value(f"test.scalar{i}", value, kind)
    w.add_array("test.strings", ["a", "", "ü€", "x" * 300])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.25, -1.5])
    w.add_array("test.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_readers_agree(path, dequantize: bool = True) -> None:
    from dflash.models.gguf_file import read_gguf

    want, got = gguf.GGUFReader(str(path)), read_gguf(path)
    keys = [k for k in want.fields if not k.startswith("GGUF.")]
    assert list(got.fields) == keys
    for key in keys:
        value = want.fields[key].contents()
        assert (list(got.fields[key]) if isinstance(got.fields[key], tuple) else got.fields[key]) == value, key
        assert type(got.fields[key]) is (tuple if isinstance(value, list) else type(value)), key
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for a, b in zip(want.tensors, got.tensors, strict=True):
        assert b.tensor_type == a.tensor_type and b.shape == tuple(reversed(a.shape.tolist())), a.name
        assert b.data.dtype == a.data.dtype and b.data.shape == a.data.shape, a.name
        np.testing.assert_array_equal(b.data, a.data)
        if dequantize and a.tensor_type != gguf.GGMLQuantizationType.I32:  # gguf: float and quantised only
            np.testing.assert_array_equal(gguf.quants.dequantize(b.data, b.tensor_type),
                                          gguf.quants.dequantize(a.data, a.tensor_type))


def test_gguf_reader_agrees_with_the_gguf_package(tmp_path):
    """dflash.models.gguf_file reads every field and tensor as gguf.GGUFReader does: a file with every value and
    storage type, and the shipped SmolLM2 GGUF (Q4_1, 49 K tokens and merges); a rewritten file is read again."""
    from dflash.models.gguf_file import read_gguf

    path = tmp_path / "kinds.gguf"
    _every_kind_gguf(path)
    _assert_readers_agree(path)
    assert read_gguf(path) is read_gguf(path)  # one parse per file
    _every_kind_gguf(path, note="again")
    assert read_gguf(path).get("test.scalar8") == "héllo again"
    _assert_readers_agree(resolve_source("smollm2"), dequantize=False)  # equal bytes: equal weights


def test_gguf_reader_refuses_what_it_cannot_read(tmp_path):
    from dflash.models.gguf_file import GGUFFormatError, read_gguf

    good = tmp_path / "good.gguf"
    _every_kind_gguf(good)
    data = good.read_bytes()
    cases = {"magic": (b"GGUX" + data[4:], r"bad magic"),
             "version": (data[:4] + (1).to_bytes(4, "little") + data[8:], r"GGUF version 1 \(versions \[2, 3\]"),
             "big": (data[:4] + (3).to_bytes(4, "big") + data[8:], r"big-endian"),
             "cut": (data[:200], r"the file ends at byte 200|runs past the end of the file"),
             "data": (data[:-100], r"tensor data at byte \d+ .* runs past the end of the file")}
    for name, (content, message) in cases.items():
        (tmp_path / f"{name}.gguf").write_bytes(content)
        with pytest.raises(GGUFFormatError, match=message):
            read_gguf(tmp_path / f"{name}.gguf")


def _leaves(params) -> dict:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def test_a_converted_copy_loads_bit_exact_and_is_rewritten_when_the_file_changes(tmp_path, monkeypatch):
    """`load_gguf(path, converted)` dequantises once and keeps the params (models/converted.py, D78); the next load
    reads them back without dequantising, bit-exact; a changed file, a corrupt copy or a copy cut short converts
    again; the older copy of the file goes."""
    from dflash.models import converted

    path, cache = tmp_path / "t.gguf", tmp_path / "converted"
    write_gguf_from_hf("qwen2_bias_untied", path)
    cfg, want = load_gguf(path)
    calls = []
    dequantize = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(1) or dequantize(*a))

    def load():
        calls.clear()
        got_cfg, got = load_gguf(path, cache)
        assert got_cfg == cfg and _leaves(got).keys() == _leaves(want).keys()
        for name, value in _leaves(got).items():
            assert value.dtype == np.float32
            np.testing.assert_array_equal(value, _leaves(want)[name], err_msg=name)
        return bool(calls)

    assert load() and load() is False  # converted, then read back without dequantising
    _, mapped = load_gguf(path, cache)  # memory-mapped, copy-on-write: the forward is the same, the file unchanged
    ids = jnp.asarray(np.load(GOLDEN / "tiny" / "qwen2_bias_untied" / "reference.npz")["input_ids"])
    logits, _ = decoder.forward(jax.tree.map(jnp.asarray, mapped), cfg, ids)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(decoder.forward(jax.tree.map(jnp.asarray, want),
                                                                                 cfg, ids)[0]))
    mapped["embed"][:] = 0
    assert load() is False  # what a loaded array's writes did stays in this process
    [entry] = [p for p in cache.iterdir()]
    np.save(entry / "layers.wq.npy", np.zeros((3,), np.float32))  # a copy that does not match its meta.json
    assert load() and load() is False
    (entry / "meta.json").write_text("{")
    assert load() and load() is False
    path.write_bytes(path.read_bytes())  # the same bytes, a new modification time: another entry
    os.utime(path, ns=(1, 1))
    assert load() and load() is False
    assert [p.name for p in cache.iterdir()] == [converted.entry_key(path)]  # the older entry was removed
    monkeypatch.setattr(converted, "MAX_BYTES", 100)  # a copy over the bound is not kept
    shutil.rmtree(cache)
    assert load() and load() and not cache.exists()


def test_load_target_without_a_directory_keeps_no_copy(tmp_path, monkeypatch):
    from dflash.models import converted

    monkeypatch.setattr(converted, "_write", lambda *a: pytest.fail("wrote a converted copy without a directory"))
    path = tmp_path / "t.gguf"
    write_gguf_from_hf("qwen3_qknorm_tied", path)
    load_weights(path)
