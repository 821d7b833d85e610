"""Load target weights into the decoder's params layout, from an HF safetensors dir or a GGUF file.

Both loaders return `(DecoderConfig, params)` with params in the layout documented in `models/decoder.py` (weights
transposed to `[in, out]`, layers stacked): `open_weights` as `models.regions.Lazy` leaves that read a region of
the stored tensors when asked (what `models.placement.put` gives each device: its share and nothing more),
`load_weights` as host numpy arrays read whole. Every problem
names the file or the tensor and what was expected: a missing file, an unreadable or corrupt file, an
unsupported architecture, a tensor whose shape disagrees with the config.

GGUF notes: the file is parsed once per process by `dflash.models.gguf_file` (the tokenizer shares the parse) and
tensors are dequantised to fp32 with the `gguf` package. llama.cpp's converter permutes
the rows of Q and K of `llama`-arch models (interleaved RoPE); we undo that permutation so the
rotate-half RoPE of the HF layout applies. Qwen2/Qwen3 GGUFs are not permuted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dflash.models.config import SUPPORTED_FAMILIES, DecoderConfig, RopeScaling
from dflash.models.converted import cached_params
from dflash.models.gguf_file import GGUFFile, read_gguf
from dflash.models.regions import (
    GGUFTensors,
    Index,
    Lazy,
    SafetensorsFile,
    TensorFile,
    every_other,
    materialize,
    stacked,
    transposed,
)

# GGUF files load for these architectures (the newer families load from HF directories only).
GGUF_FAMILIES = ("llama", "qwen2", "qwen3")
_LAYER_KEYS_HF = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
}
# Gemma 3's four norms per layer: its `post_attention_layernorm` normalises the attention output (Llama's, the MLP
# input); the MLP input norm is `pre_feedforward_layernorm`.
_LAYER_KEYS_GEMMA = {
    **_LAYER_KEYS_HF,
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_EXPERT_KEYS_HF = {"we_gate": "gate_proj.weight", "we_up": "up_proj.weight", "we_down": "down_proj.weight"}
_LAYER_KEYS_GGUF = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router")
_EXPERTS = ("we_gate", "we_up", "we_down")
_EXPERT_BIASES = ("be_gate", "be_up", "be_down")
# gpt-oss beyond the shared names (its experts are fused: `_gpt_oss_experts`).
_LAYER_KEYS_GPT_OSS = {**_LAYER_KEYS_HF, "router": "mlp.router.weight", "router_b": "mlp.router.bias",
                       "bo": "self_attn.o_proj.bias", "sinks": "self_attn.sinks"}
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (gpt-oss's expert weights) to fp32: `blocks` uint8 [..., G, 16] hold two e2m1 values a byte (low nibble
    first), `scales` uint8 [..., G] a power-of-two exponent + 127 per group of 32; returns [..., G * 32] (the rows of
    the PyTorch `[out, in]` weight), as transformers' `convert_moe_packed_tensors` before its transpose."""
    blocks = np.asarray(blocks, np.uint8)
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, np.asarray(scales, np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


class WeightsError(ValueError):
    """Weights cannot be loaded: the message names the file or tensor and what was expected."""


# ----------------------------------------------------------------------------- shared


def layer_param_names(cfg: DecoderConfig) -> list[str]:
    names = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm"]
    names += ["router", *_EXPERTS] if cfg.num_experts else ["w_gate", "w_up", "w_down"]
    if cfg.moe_bias:
        names += ["router_b", *_EXPERT_BIASES]
    if cfg.qkv_bias:
        names += ["bq", "bk", "bv"]
    if cfg.o_bias:
        names += ["bo"]
    if cfg.attn_sinks:
        names += ["sinks"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    if cfg.sandwich_norms:
        names += ["post_attn_norm", "post_mlp_norm"]
    return names


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's tensors: 2-D ones in the HF/PyTorch `[out, in]` convention, the stacked experts
    ([E, in, out]) in ours."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    e, fe = cfg.num_experts, cfg.moe_intermediate_size
    return {
        "attn_norm": (d,), "mlp_norm": (d,), "post_attn_norm": (d,), "post_mlp_norm": (d,),
        "wq": (cfg.q_size, d), "wk": (cfg.kv_size, d), "wv": (cfg.kv_size, d), "wo": (d, cfg.q_size),
        "bq": (cfg.q_size,), "bk": (cfg.kv_size,), "bv": (cfg.kv_size,),
        "q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,),
        "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f),
        "router": (e, d), "we_gate": (e, d, fe), "we_up": (e, d, fe), "we_down": (e, fe, d),
        "router_b": (e,), "be_gate": (e, fe), "be_up": (e, fe), "be_down": (e, d), "bo": (d,),
        "sinks": (cfg.num_heads,),
    }


def layer_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """One layer's params in the decoder's layout (matrices `[in, out]`), by name."""
    shapes = expected_shapes(cfg)
    return {k: shapes[k][::-1] if k in _MATRICES else shapes[k] for k in layer_param_names(cfg)}


def _assemble(cfg: DecoderConfig, tensors: TensorFile, layer_name: Callable[[int, str], str],
              embed_name: str, norm_name: str, head_name: str, where: str) -> dict[str, Any]:
    """The decoder's params layout over `tensors`, every leaf a `models.regions.Lazy` (transposed and stacked as the
    decoder wants them, nothing read yet); every tensor's presence and shape checked here, from the headers."""

    def check(name: str, shape: tuple[int, ...]) -> None:
        got = tensors.shape(name)
        if got is None:
            raise WeightsError(f"{where}: tensor {name!r} is missing (expected shape {shape} for this config)")
        if tuple(got) != shape:
            raise WeightsError(
                f"{where}: tensor {name!r} must have shape {shape} for the config "
                f"(hidden {cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
                f"mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}); received {tuple(got)}"
            )

    def fetch(name: str, shape: tuple[int, ...]) -> Lazy:
        check(name, shape)
        return Lazy(shape, lambda index: tensors.read(name, index), tensors.sliced)

    def fetch_experts(i: int, key: str) -> Lazy:
        """[E, in, out] from the per-expert tensors `...experts.{e}.{gate,up,down}_proj.weight` ([out, in] each)
        or transformers 5's fused `experts.gate_up_proj` [E, 2*Ie, D] / `experts.down_proj` [E, D, Ie]."""
        e, fe, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        fused = layer_name(i, "experts.gate_up_proj" if key != "we_down" else "experts.down_proj")
        if tensors.shape(fused) is not None:
            want = (e, 2 * fe, d) if key != "we_down" else (e, d, fe)
            if tuple(tensors.shape(fused)) != want:
                raise WeightsError(f"{where}: tensor {layer_name(i, 'experts')!r} ({key}) must have shape {want}; "
                                   f"received {tuple(tensors.shape(fused))}")
            first = fe if key == "we_up" else 0  # the half this key needs, read by itself

            def read(index: Index) -> np.ndarray:  # ours [E, in, out] is the stored [E, out, in] transposed
                rows, cols = index[2], index[1]
                rows = slice(rows.start + first, rows.stop + first) if key != "we_down" else rows
                return tensors.read(fused, (index[0], rows, cols)).transpose(0, 2, 1)

            return Lazy((e, d, fe) if key != "we_down" else (e, fe, d), read, tensors.sliced)
        shape = (fe, d) if key != "we_down" else (d, fe)
        return stacked([transposed(fetch(layer_name(i, f"experts.{x}.{_EXPERT_KEYS_HF[key]}"), shape))
                        for x in range(e)])

    def gpt_oss_experts(i: int) -> dict[str, Lazy]:
        """gpt-oss's fused experts: `gate_up_proj` [E, D, 2*Ie] (gate and up interleaved along the last axis) and
        `down_proj` [E, Ie, D], each as transformers saves it or as MXFP4 `_blocks` / `_scales` (the released
        checkpoints; dequantised here to fp32, docs/decisions.md D75 says why not kept packed); biases [E, 2*Ie] and
        [E, D]."""
        e, fe, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size

        def weight(name: str, shape: tuple[int, int, int]) -> Lazy:
            full = layer_name(i, f"experts.{name}")
            if tensors.shape(full) is not None:
                return fetch(full, shape)
            blocks, scales = layer_name(i, f"experts.{name}_blocks"), layer_name(i, f"experts.{name}_scales")
            b, s = tensors.shape(blocks), tensors.shape(scales)
            if b is None or s is None:
                raise WeightsError(f"{where}: tensor {full!r} is missing (neither it nor its MXFP4 _blocks/_scales; "
                                   f"expected shape {shape})")
            got = (b[0], b[2] * b[3] * 2, b[1]) if len(b) == 4 else tuple(b)
            if got != shape or tuple(s) != tuple(b[:3]):
                raise WeightsError(f"{where}: tensor {full!r} must have shape {shape}; received {got} (MXFP4 blocks "
                                   f"{tuple(b)}, scales {tuple(s)})")

            def read(index: Index) -> np.ndarray:  # the stored rows are our last axis; a row's groups decode whole
                rows = (index[0], index[2])
                values = dequantize_mxfp4(tensors.read(blocks, rows, raw=True), tensors.read(scales, rows, raw=True))
                return values[:, :, index[1]].transpose(0, 2, 1)

            return Lazy(shape, read, tensors.sliced)

        gate_up = weight("gate_up_proj", (e, d, 2 * fe))
        bias = fetch(layer_name(i, "experts.gate_up_proj_bias"), (e, 2 * fe))
        return {"we_gate": every_other(gate_up, 0), "we_up": every_other(gate_up, 1),
                "we_down": weight("down_proj", (e, fe, d)), "be_gate": every_other(bias, 0),
                "be_up": every_other(bias, 1), "be_down": fetch(layer_name(i, "experts.down_proj_bias"), (e, d))}

    shapes = expected_shapes(cfg)
    layers: dict[str, list[Lazy]] = {k: [] for k in layer_param_names(cfg)}
    for i in range(cfg.num_layers):
        fused = gpt_oss_experts(i) if cfg.moe_bias else {}
        for key in layers:
            if key in fused:
                layers[key].append(fused[key])
            elif key in _EXPERTS:
                layers[key].append(fetch_experts(i, key))
            else:
                leaf = fetch(layer_name(i, key), shapes[key])
                layers[key].append(transposed(leaf) if key in _MATRICES else leaf)
    params: dict[str, Any] = {
        "embed": fetch(embed_name, (cfg.vocab_size, cfg.hidden_size)),
        "final_norm": fetch(norm_name, (cfg.hidden_size,)),
        "layers": {k: stacked(v) for k, v in layers.items()},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = transposed(fetch(head_name, (cfg.vocab_size, cfg.hidden_size)))
    if cfg.embed_scale:
        params["embed_scale"] = np.asarray(cfg.hidden_size ** 0.5, np.float32)
    return params


# ----------------------------------------------------------------------------- Hugging Face dirs


def decoder_config_from_hf(hf: dict[str, Any], where: str = "config.json") -> DecoderConfig:
    """Parse an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`) of a family in
    `models.config.SUPPORTED_FAMILIES`; a WeightsError naming the field for anything the decoder does not compute."""
    family = hf.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise WeightsError(
            f"{where}: model_type must be one of {list(SUPPORTED_FAMILIES)}; received {family!r} "
            f"(architectures {hf.get('architectures')})"
        )
    if hf.get("mlp_bias"):
        raise WeightsError(f"{where}: mlp_bias must be false (no supported target has MLP biases); received true")
    gemma = family == "gemma3_text"
    oss = family == "gpt_oss"
    rope_fields = dict(hf.get("rope_parameters") or {})
    if gemma and "full_attention" in rope_fields:  # transformers 5: one RoPE entry per layer type
        rope = dict(rope_fields.get("full_attention") or {})
        local_theta = float((rope_fields.get("sliding_attention") or {}).get("rope_theta", 10000.0))
    else:
        rope = rope_fields
        local_theta = float(hf.get("rope_local_base_freq", 10000.0))
    rope.update(hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0 if gemma else 10000.0)))
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(name) is not None:
            raise WeightsError(f"{where}: {name} must be null (logit soft-capping is not computed); "
                               f"received {hf[name]}")
    if hf.get("use_bidirectional_attention"):
        raise WeightsError(f"{where}: use_bidirectional_attention must be false (a causal target); received true")
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        layer_types, window = _hf_layer_types(hf, family, num_layers, where)
        act = hf.get("hidden_activation", hf.get("hidden_act", "silu"))
        if act not in _ACTIVATIONS:
            raise WeightsError(f"{where}: hidden_act must be one of {sorted(_ACTIVATIONS)}; received {act!r}")
        cfg = DecoderConfig(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=_rope_scaling_from_hf(rope, where),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family in ("llama", "mistral", "gpt_oss") and bool(hf.get("attention_bias", False)),
            attn_sinks=oss,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            layer_types=layer_types,
            sliding_window=window,
            local_rope_theta=local_theta if gemma else 0.0,
            attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else 0.0,
            hidden_act=_ACTIVATIONS[act],
            embed_scale=gemma,
            sandwich_norms=gemma,
            norm_unit_offset=gemma,
            **_hf_moe_fields(hf, family, num_layers, where),
        )
    except KeyError as err:
        raise WeightsError(f"{where}: required field {err.args[0]!r} is missing") from err
    return cfg


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _hf_layer_types(hf: dict[str, Any], family: str, num_layers: int, where: str) -> tuple[tuple[str, ...], int]:
    """(layer_types, sliding_window): Gemma 3's interleaved local/global layers (`layer_types`, or the older
    `sliding_window_pattern`: every n-th layer global), Mistral's window on every layer when `sliding_window` is set;
    Qwen's `use_sliding_window` (its own layer rule) is refused."""
    window = hf.get("sliding_window")
    if family == "gemma3_text":
        kinds = hf.get("layer_types")
        if kinds is None:
            pattern = int(hf.get("sliding_window_pattern", 6))
            kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        kinds = tuple(kinds)
        if "sliding_attention" not in kinds:
            return (), 0
        if not window:
            raise WeightsError(f"{where}: sliding_window must be a positive integer for sliding_attention layers; "
                               f"received {window!r}")
        return kinds, int(window)
    if family == "mistral":
        return (("sliding_attention",) * num_layers, int(window)) if window else ((), 0)
    if family == "gpt_oss":  # alternating sliding (128) and full layers unless the config lists them
        kinds = tuple(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                  for i in range(num_layers)])
        return (kinds, int(window or 128)) if "sliding_attention" in kinds else ((), 0)
    if window and hf.get("use_sliding_window"):
        raise WeightsError(f"{where}: use_sliding_window must be false (sliding-window attention is not supported "
                           f"for model_type {family!r})")
    return (), 0


def _hf_moe_fields(hf: dict[str, Any], family: str, num_layers: int, where: str) -> dict[str, Any]:
    """Qwen3-MoE's and gpt-oss's expert fields; every layer must be sparse (the layer scan stacks one kind of layer)."""
    if family == "gpt_oss":
        return {"num_experts": int(hf["num_local_experts"]), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
                "moe_intermediate_size": int(hf["intermediate_size"]), "moe_router": "topk_softmax",
                "moe_bias": True, "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
                "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}
    if family != "qwen3_moe":
        return {}
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
        raise WeightsError(
            f"{where}: mlp_only_layers must be [] and decoder_sparse_step 1 (every layer a MoE layer, as Qwen3-30B-A3B "
            f"and Qwen3-235B-A22B); received mlp_only_layers={hf.get('mlp_only_layers')}, "
            f"decoder_sparse_step={hf.get('decoder_sparse_step')}")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return {"num_experts": int(experts), "num_experts_per_tok": int(hf["num_experts_per_tok"]),
            "moe_intermediate_size": int(hf["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _rope_scaling_from_hf(rope: dict[str, Any], where: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "yarn":
        factor = float(rope["factor"])
        attention = rope.get("attention_factor")
        if attention is None:
            mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all
                         else get_mscale(factor))
        return RopeScaling(kind="yarn", factor=factor,
                           original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                           beta_fast=float(rope.get("beta_fast") or 32.0),
                           beta_slow=float(rope.get("beta_slow") or 1.0), truncate=bool(rope.get("truncate", True)),
                           attention_factor=float(attention))
    raise WeightsError(f"{where}: rope scaling type must be default, llama3, linear or yarn; received {kind!r}")


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors weights found (expected model.safetensors or an index)")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"{f}: listed in model.safetensors.index.json but missing")
    return files


def open_hf_dir(directory: str | Path) -> tuple[DecoderConfig, dict[str, Any]]:
    """An HF model directory (config.json + safetensors) of a supported family, its params as `models.regions.Lazy`
    leaves: the headers are read and every tensor's shape checked, no weight is (`models.placement.put` reads each
    device's region)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise WeightsError(f"{config_path}: missing (an HF model directory needs config.json beside its safetensors)")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(f"{config_path}: not valid JSON ({err})") from err
    cfg = decoder_config_from_hf(hf, str(config_path))
    tensors = SafetensorsFile(_safetensors_files(directory), WeightsError)
    prefix = "model." if "model.embed_tokens.weight" in tensors else ""
    keys = {"gemma3_text": _LAYER_KEYS_GEMMA, "gpt_oss": _LAYER_KEYS_GPT_OSS}.get(cfg.family, _LAYER_KEYS_HF)
    params = _assemble(
        cfg,
        tensors,
        lambda i, key: f"{prefix}layers.{i}.{keys.get(key, 'mlp.' + key)}",
        embed_name=f"{prefix}embed_tokens.weight",
        norm_name=f"{prefix}norm.weight",
        head_name="lm_head.weight",
        where=str(directory),
    )
    return cfg, params


def load_hf_dir(directory: str | Path) -> tuple[DecoderConfig, dict[str, Any]]:
    """Load an HF model directory (config.json + safetensors) of a supported family: `open_hf_dir` read whole into
    host numpy arrays."""
    cfg, params = open_hf_dir(directory)
    return cfg, materialize(params)


# ----------------------------------------------------------------------------- GGUF


def unpermute_llama_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout), per head."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise WeightsError(f"{path}: GGUF file not found")
    try:
        return read_gguf(path)
    except Exception as err:  # GGUFFormatError, struct/unicode errors on corrupt files
        raise WeightsError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from err


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays of tokens/merges are skipped)."""
    return {key: value for key, value in reader.fields.items()
            if not (key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type",
                                                                                  "scores"))}


def decoder_config_from_gguf(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                             where: str) -> DecoderConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise WeightsError(
            f"{where}: general.architecture must be one of {list(GGUF_FAMILIES)} (a GGUF; the other supported "
            f"families load from a Hugging Face directory); received {arch!r}"
        )

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full not in meta and default is None:
            raise WeightsError(f"{where}: metadata field {full!r} is missing")
        return meta.get(full, default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    embd = tensor_shapes.get("token_embd.weight")
    if embd is None:
        raise WeightsError(f"{where}: tensor 'token_embd.weight' is missing")
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        scaling = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise WeightsError(f"{where}: {arch}.rope.scaling.type must be none or linear; received {kind!r}")
    return DecoderConfig(
        family=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", embd[0])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        tie_word_embeddings="output.weight" not in tensor_shapes,
    )


def open_gguf(path: str | Path, converted: Path | None = None) -> tuple[DecoderConfig, dict[str, Any]]:
    """A llama / qwen2 / qwen3 GGUF in the decoder params layout, its leaves `models.regions.Lazy` (each tensor
    dequantised to fp32 when its leaf is read: a quantised block spans many values, so a leaf is read whole); with
    `converted`, a directory of converted copies (`models.converted`): the params read from there (memory-mapped
    host arrays) when the file was converted before, else converted, kept there and returned."""
    import gguf

    path = Path(path)
    reader = gguf_reader(path)
    by_name = {t.name: t for t in reader.tensors}
    shapes = {name: t.shape for name, t in by_name.items()}
    cfg = decoder_config_from_gguf(gguf_metadata(reader), shapes, str(path))
    if "rope_freqs.weight" in by_name:
        factors = tuple(float(x) for x in np.asarray(by_name["rope_freqs.weight"].data, np.float32).ravel())
        cfg = dataclasses.replace(cfg, rope_scaling=RopeScaling(kind="freq_factors", freq_factors=factors))

    def decode(name: str) -> np.ndarray:
        t = by_name[name]
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shapes[name])
        except Exception as err:  # corrupt or truncated data blocks
            raise WeightsError(f"{path}: tensor {name!r} could not be dequantised ({err})") from err
        arr = np.asarray(arr, dtype=np.float32)
        if cfg.family == "llama" and name.endswith("attn_q.weight"):
            arr = unpermute_llama_rows(arr, cfg.num_heads)
        elif cfg.family == "llama" and name.endswith("attn_k.weight"):
            arr = unpermute_llama_rows(arr, cfg.num_kv_heads)
        return arr

    params = cached_params(converted, path, lambda: _assemble(
        cfg, GGUFTensors(shapes, decode), lambda i, key: f"blk.{i}.{_LAYER_KEYS_GGUF[key]}",
        embed_name="token_embd.weight", norm_name="output_norm.weight", head_name="output.weight", where=str(path),
    ))
    return cfg, params


def load_gguf(path: str | Path, converted: Path | None = None) -> tuple[DecoderConfig, dict[str, Any]]:
    """Load a llama / qwen2 / qwen3 GGUF, dequantised to fp32, into the decoder params layout (host numpy arrays;
    `open_gguf` read whole)."""
    cfg, params = open_gguf(path, converted)
    return cfg, materialize(params)


# ----------------------------------------------------------------------------- dispatch


def open_weights(path: str | Path, converted: Path | None = None) -> tuple[DecoderConfig, dict[str, Any]]:
    """The architecture and the params of a `.gguf` file (`open_gguf`) or an HF directory (`open_hf_dir`), as
    `models.regions.Lazy` leaves (or host arrays from a converted copy): nothing is read until a leaf is."""
    path = Path(path)
    if path.is_dir():
        return open_hf_dir(path)
    if path.suffix == ".gguf":
        return open_gguf(path, converted)
    raise WeightsError(f"{path}: must be a .gguf file or an HF model directory (config.json + *.safetensors)")


def load_weights(path: str | Path, converted: Path | None = None) -> tuple[DecoderConfig, dict[str, Any]]:
    """Load a `.gguf` file (with `converted`, through a directory of converted copies: `load_gguf`) or an HF
    directory (its safetensors are read as they are stored; nothing to keep), whole into host numpy arrays."""
    cfg, params = open_weights(path, converted)
    return cfg, materialize(params)


def weights_fingerprint(path: str | Path) -> str:
    """sha256 over the weight files (a GGUF, or an HF dir's config.json + safetensors), hex."""
    path = Path(path)
    files = [path] if path.is_file() else [path / "config.json", *_safetensors_files(path)]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()
