"""Configs owned by `models/`: the target and drafter sections of a recipe, and the decoder architecture.

`TargetConfig` is the recipe section (what to load, at which dtype). `DecoderConfig` describes the
architecture of a target decoder of a supported family (`SUPPORTED_FAMILIES`); it is read from the weights (HF
config.json or GGUF metadata), never written by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from dflash.configs.schema import require

Family = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe", "gpt_oss"]
# The one list of supported target families: HF config.json `model_type` / GGUF `general.architecture` values. A new
# family is a new entry of `Family` (its switches in `DecoderConfig`, its parsing in `models.loading`); every check
# (the early refusal `models.registry.check_target`, the loaders) reads it from here.
SUPPORTED_FAMILIES: tuple[str, ...] = get_args(Family)
Activation = Literal["silu", "gelu_tanh"]
DType = Literal["float32", "bfloat16"]
LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES = ("full_attention", "sliding_attention")
Variant = Literal["dflash", "dflash2"]


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Which target LLM to load and how.

    source: `smollm2` (the embedded default, a packaged GGUF), a `.gguf` file, or a Hugging Face
      model directory (config.json + safetensors).
    dtype: parameter and compute dtype. `float32` is exact (parity and lossless tests use it).
    max_seq_len: the KV-cache length per sequence (prompt + generated tokens).
    """

    source: str = "smollm2"
    dtype: DType = "float32"
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        require(bool(self.source), "target.source", self.source, "name a model (smollm2, a .gguf or an HF dir)")
        require(self.max_seq_len >= 16, "target.max_seq_len", self.max_seq_len, "be at least 16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `llama3` (Llama 3.1+), `linear`, `freq_factors` (GGUF rope_freqs), or `yarn`
    (gpt-oss: frequencies blended between `factor`-interpolated and extrapolated over the correction range of
    `beta_fast` / `beta_slow` rotations, cos and sin times `attention_factor`)."""

    kind: Literal["llama3", "linear", "freq_factors", "yarn"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of one decoder of a supported family: Llama 3.x / Mistral / Qwen2 / Qwen3 dense, Gemma 3 text,
    Qwen3-MoE.

    Switches: `qkv_bias` (Qwen2), `qk_norm` (Qwen3, Gemma 3: per-head RMSNorm on q and k), `tie_word_embeddings`,
    `rope_scaling`; GQA through `num_kv_heads`; `head_dim` independent of hidden/heads (Qwen3).
    Windows: `layer_types` per layer (`full_attention` / `sliding_attention`; () = all full) and `sliding_window` W:
      a sliding layer's query at position p sees keys at p-W+1 .. p (HF's `kv_idx > q_idx - W`); `local_rope_theta`
      (> 0: Gemma 3) gives the sliding layers their own unscaled RoPE base.
    Gemma 3: `embed_scale` (embeddings times sqrt(hidden), rounded to the params' dtype as HF does),
      `sandwich_norms` (RMSNorm after attention and after the MLP too), `norm_unit_offset` (norms scale by 1 + w),
      `attn_scale` (query_pre_attn_scalar ** -0.5; 0 = head_dim ** -0.5), `hidden_act` `gelu_tanh`.
    Mixture of experts (`num_experts` > 0, Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU experts of
      `moe_intermediate_size`; a router softmax picks `num_experts_per_tok` of them per token, their weights
      renormalised to sum 1 when `norm_topk_prob` (`models.decoder.moe_mlp`).
    gpt-oss: `o_bias` (o_proj bias), `attn_sinks` (a learned logit per head in every softmax's denominator),
      `moe_router` `topk_softmax` (top-k of the router logits, with bias, then a softmax over those k), `moe_bias`
      (expert biases), `swiglu_limit` > 0 (gate clamped above, up clamped both ways, `(up + 1) * gate *
      sigmoid(swiglu_alpha * gate)`).
    """

    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int = 0
    local_rope_theta: float = 0.0
    attn_scale: float = 0.0
    hidden_act: Activation = "silu"
    embed_scale: bool = False
    sandwich_norms: bool = False
    norm_unit_offset: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    o_bias: bool = False
    attn_sinks: bool = False
    moe_router: Literal["softmax_topk", "topk_softmax"] = "softmax_topk"
    moe_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"decoder.{name}", value, "be a positive integer")
        require(self.num_heads % self.num_kv_heads == 0, "decoder.num_heads", self.num_heads,
                f"be a multiple of num_kv_heads={self.num_kv_heads}")
        require(self.head_dim % 2 == 0, "decoder.head_dim", self.head_dim, "be even (RoPE rotates pairs)")
        require(not self.layer_types or len(self.layer_types) == self.num_layers, "decoder.layer_types",
                list(self.layer_types), f"name one type per layer (num_layers={self.num_layers}), or be []")
        for i, kind in enumerate(self.layer_types):
            require(kind in LAYER_TYPES, f"decoder.layer_types[{i}]", kind, f"be one of {list(LAYER_TYPES)}")
        sliding = "sliding_attention" in self.layer_types
        require(self.sliding_window >= 1 if sliding else self.sliding_window == 0, "decoder.sliding_window",
                self.sliding_window, "be >= 1 when a layer is sliding_attention, else 0")
        require(self.hidden_act in ("silu", "gelu_tanh"), "decoder.hidden_act", self.hidden_act,
                "be 'silu' or 'gelu_tanh'")
        if self.num_experts:
            require(0 < self.num_experts_per_tok <= self.num_experts, "decoder.num_experts_per_tok",
                    self.num_experts_per_tok, f"lie in [1, num_experts={self.num_experts}]")
            require(self.moe_intermediate_size > 0, "decoder.moe_intermediate_size", self.moe_intermediate_size,
                    "be a positive integer when num_experts > 0")

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend over a sliding window?"""
        return tuple(kind == "sliding_attention" for kind in self.layer_types) or (False,) * self.num_layers

    @property
    def windowed(self) -> bool:
        return any(self.sliding_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """The drafter section of a recipe.

    num_layers: drafter decoder layers L_d.
    num_features: F, the target layers whose post-layer outputs are fused.
    layer_ids: target layer ids to capture (id j = output of decoder layer j); () = the default ids.
    block_size: K, tokens per block (1 anchor + K-1 masks, K-1 draft tokens).
    mask_token_id: the MASK id inside the target's vocab; -1 = resolved from the target's default.
    The drafter's attention geometry (heads, kv heads, head dim) and MLP width are the target's, as in every
    published DFlash drafter (docs/retired.md).
    layer_types: per drafter layer `full_attention` or `sliding_attention`; () = all full. A sliding layer's
      block sees only the last `sliding_window` context positions before its anchor (and its own block), in
      training and in the engine, whose draft cache keeps only a window's worth of K/V per slot for it.
    sliding_window: W, the context positions a sliding layer sees (0 = no sliding layer); at least block_size.
    variant: `dflash` (DFlash v1) or `dflash2` (DFlash2's backbone: with `conv`, a 2-tap grouped dynamic
      depthwise convolution around each attention and MLP sublayer, local to the block, identity-initialised;
      exported in the DFlash2 layouts).
    conv: DFlash2's convolution on (dflash2 only; off = the DFlash2 layout with identity convolutions).
    conv_kernel_size / conv_group_size: the convolution's taps and the channels sharing one dynamic kernel
      (DFlash2's published 2 and 16).
    selector: DFlash2's low-rank path selector on (dflash2 only): each draft slot re-ranks its top
      `selector_top_k` unary candidates (the LM head's logits) by an edge score from the token chosen at the slot
      before (the anchor for the first), <P[prev] * (W h), S[cand]> at rank `selector_rank`, walked left to
      right (`models.drafter.CandidateSelector`); still one backbone pass and a chain verify. Off = each slot's
      argmax (the layout then carries a zero selector). Published 256 / 16.
    """

    num_layers: int = 5
    num_features: int = 5
    layer_ids: tuple[int, ...] = ()
    block_size: int = 16
    mask_token_id: int = -1
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int = 0
    variant: Variant = "dflash"
    conv: bool = True
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector: bool = False
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        check_layer_types(self.layer_types, self.num_layers, self.sliding_window, self.block_size, "drafter")
        require(self.variant in ("dflash", "dflash2"), "drafter.variant", self.variant, "be 'dflash' or 'dflash2'")
        require(self.conv_kernel_size >= 1, "drafter.conv_kernel_size", self.conv_kernel_size, "be >= 1")
        require(self.conv_group_size >= 1, "drafter.conv_group_size", self.conv_group_size, "be >= 1")
        require(not self.selector or self.variant == "dflash2", "drafter.selector", self.selector,
                "be false unless drafter.variant is dflash2 (the path selector is DFlash2's)")
        require(self.selector_rank >= 1, "drafter.selector_rank", self.selector_rank, "be >= 1")
        require(self.selector_top_k >= 1, "drafter.selector_top_k", self.selector_top_k, "be >= 1")
        require(self.num_layers >= 1, "drafter.num_layers", self.num_layers, "be at least 1")
        require(self.num_features >= 1, "drafter.num_features", self.num_features, "be at least 1")
        require(not self.layer_ids or len(self.layer_ids) == self.num_features, "drafter.layer_ids",
                self.layer_ids, f"name num_features={self.num_features} ids, or be () for the default ids")
        require(self.block_size >= 2, "drafter.block_size", self.block_size,
                "be at least 2 (one anchor token plus at least one masked draft position)")
        require(self.mask_token_id >= -1, "drafter.mask_token_id", self.mask_token_id,
                "be a token id >= 0, or -1 to use the target's default")


def check_layer_types(layer_types: tuple[str, ...], num_layers: int, sliding_window: int, block_size: int,
                      where: str) -> None:
    """Validate a drafter's `layer_types` (() = all full) against its layer count and `sliding_window`: a
    window is set (>= block_size, so a block always sees all of itself) exactly when some layer slides."""
    require(not layer_types or len(layer_types) == num_layers, f"{where}.layer_types", list(layer_types),
            f"name one type per layer (num_layers={num_layers}), or be [] for all full_attention")
    for i, kind in enumerate(layer_types):
        require(kind in LAYER_TYPES, f"{where}.layer_types[{i}]", kind, f"be one of {list(LAYER_TYPES)}")
    sliding = "sliding_attention" in layer_types
    require(sliding_window >= 0, f"{where}.sliding_window", sliding_window, "be >= 0 (0 = no sliding layer)")
    require(not sliding or sliding_window >= block_size, f"{where}.sliding_window", sliding_window,
            f"be at least block_size={block_size} when a layer is sliding_attention")
    require(sliding or sliding_window == 0, f"{where}.sliding_window", sliding_window,
            "be 0 unless some layer_types entry is sliding_attention")


def default_layer_ids(num_layers: int, num_features: int) -> tuple[int, ...]:
    """Default target layers to capture (docs/design.md §4.1): round(1 + i*(L-4)/(n-1)), or (L//2,) for n=1.

    Layer id j is the output of decoder layer j (0-based) = HF `hidden_states[j+1]`.
    Qwen3 (36 layers, n=5) -> (1, 9, 17, 25, 33); Llama 32 -> (1, 8, 15, 22, 29).
    """
    require(num_features >= 1, "num_features", num_features, "be at least 1")
    require(num_layers >= 4 or num_features == 1, "num_layers", num_layers, "be at least 4 for n > 1")
    if num_features == 1:
        return (num_layers // 2,)
    return tuple(round(1 + i * (num_layers - 4) / (num_features - 1)) for i in range(num_features))


def check_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Validate capture layer ids: strictly increasing, each in [0, num_layers)."""
    ids = tuple(int(j) for j in layer_ids)
    if not ids:
        raise ValueError("layer_ids must name at least one layer; received ()")
    bad = [j for j in ids if not 0 <= j < num_layers]
    if bad:
        raise ValueError(
            f"layer_ids must lie in [0, {num_layers}) for a {num_layers}-layer target "
            f"(id j = output of decoder layer j); received {ids} (out of range: {bad})"
        )
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"layer_ids must be strictly increasing (shallow to deep); received {ids}")
    return ids
