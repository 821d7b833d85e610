"""The target decoder (Llama 3.x / Mistral / Qwen2 / Qwen3 dense, Gemma 3 text, Qwen3-MoE) as pure JAX functions
over a params pytree.

`forward` is the full causal pass (logits, and the post-layer features at chosen layer ids);
`forward_cached` appends a chunk of Q >= 1 tokens per sequence to any `KVCacheLike` cache (`DenseKVCache`
here, the engine's paged cache) and returns the chunk's logits. Why pure functions over one layer scan,
and the cache interface: docs/decisions.md D3, D4.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.config import DecoderConfig, check_layer_ids

# Params layout (ours is `x @ W`, i.e. HF weights transposed; layer weights stacked on a leading L axis
# so the layer loop is one `lax.scan` and compiles once):
#     embed        [V, D]                 final_norm [D]            lm_head [D, V] (untied only)
#     embed_scale  []  (embed_scale only: sqrt(D) in the params' dtype, as HF rounds it)
#     layers.attn_norm [L, D]   wq [L, D, H*Dh]   wk/wv [L, D, Hk*Dh]   wo [L, H*Dh, D]
#            bq/bk/bv [L, ·] (qkv_bias)   q_norm/k_norm [L, Dh] (qk_norm)
#            post_attn_norm, post_mlp_norm [L, D] (sandwich_norms: Gemma 3)
#            mlp_norm [L, D]   w_gate/w_up [L, D, I]   w_down [L, I, D]   (I = intermediate_size; dense MLP)
#            router [L, D, E]   we_gate/we_up [L, E, D, Ie]   we_down [L, E, Ie, D]   (num_experts E > 0 instead of
#            the dense MLP; Ie = moe_intermediate_size; the E axis is the sharding table's `expert` axis)
#            gpt-oss: bo [L, D] (o_bias), sinks [L, H] (attn_sinks), router_b [L, E], be_gate/be_up [L, E, Ie],
#            be_down [L, E, D] (moe_bias)
# Norm weights are stored as the checkpoint holds them (Gemma's `1 + w` is applied in `norm`).
Params = dict[str, Any]
NEG_INF = -1e30


# ----------------------------------------------------------------------------- small pieces


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32, cast back to x's dtype, then scaled (HF order)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def norm(cfg: DecoderConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    """The decoder's RMSNorm: `rms_norm`, or with `norm_unit_offset` (Gemma) the scale `1 + w` applied in fp32 before
    the cast back (HF Gemma's order)."""
    if not cfg.norm_unit_offset:
        return rms_norm(x, weight, cfg.rms_norm_eps)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(cfg: DecoderConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies [Dh/2] (float64 on host), with the configured scaling applied; `local`: the sliding
    layers' own unscaled base (`local_rope_theta`, Gemma 3)."""
    half = cfg.head_dim // 2
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, half, dtype=np.float64) * 2 / cfg.head_dim))
    scaling = None if local else cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inv_freq(cfg.head_dim, theta, scaling)
    if scaling.kind == "freq_factors":
        factors = np.asarray(scaling.freq_factors, dtype=np.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors must have {half} entries; received {factors.shape[0]}")
        return inv_freq / factors
    # llama3: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: Any) -> np.ndarray:
    """YaRN's blend of interpolated and extrapolated frequencies (transformers' `_compute_yarn_parameters`)."""
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float32).astype(np.float64) / head_dim)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(cfg: DecoderConfig, positions_BxS: jax.Array, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, Dh] (fp32) for the given absolute positions (rotate-half layout); YaRN scales both by its
    attention factor."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg, local), dtype=jnp.float32)
    angles = positions_BxS.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    scaling = None if local else cfg.rope_scaling
    if scaling is not None and scaling.kind == "yarn" and scaling.attention_factor != 1.0:
        return jnp.cos(angles) * scaling.attention_factor, jnp.sin(angles) * scaling.attention_factor
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxSxHxDh: jax.Array, cos_BxSxDh: jax.Array, sin_BxSxDh: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF layout; GGUF llama rows are un-permuted at load to match)."""
    half = x_BxSxHxDh.shape[-1] // 2
    x32 = x_BxSxHxDh.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos_BxSxDh[:, :, None, :] + rotated * sin_BxSxDh[:, :, None, :]
    return out.astype(x_BxSxHxDh.dtype)


def attend(q_BxQxHxDh: jax.Array, k_BxTxHkxDh: jax.Array, v_BxTxHkxDh: jax.Array,
           visible_BxQxT: jax.Array, sinks_H: jax.Array | None = None) -> jax.Array:
    """Grouped-query softmax attention with a boolean visibility mask; softmax in fp32. `sinks_H` (gpt-oss): one
    logit per head that joins every row's softmax denominator and attends to nothing.

    A query row with no visible key returns zeros (never NaN).
    """
    b, q_len, h, dh = q_BxQxHxDh.shape
    hk = k_BxTxHkxDh.shape[2]
    q = q_BxQxHxDh.reshape(b, q_len, hk, h // hk, dh)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k_BxTxHkxDh).astype(jnp.float32) / math.sqrt(dh)
    mask = visible_BxQxT[:, None, None, :, :]
    scores = jnp.where(mask, scores, NEG_INF)
    if sinks_H is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks_H.astype(jnp.float32).reshape(1, hk, h // hk, 1, 1)
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        exp = jnp.exp(scores - top)
        probs = exp / (jnp.sum(exp, axis=-1, keepdims=True) + jnp.exp(sink - top))
    probs = jnp.where(mask, probs, 0.0).astype(v_BxTxHkxDh.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v_BxTxHkxDh)
    return out.reshape(b, q_len, h, dh)


def in_window(key_index: jax.Array, query_index: jax.Array, window: jax.Array | None) -> jax.Array:
    """Causal visibility of keys to queries by index (broadcast), limited to the last `window` indices when
    window > 0 (a sliding layer: HF's `kv_idx > q_idx - W`); None or 0 = plain causal."""
    visible = key_index <= query_index
    if window is None:
        return visible
    return visible & ((window <= 0) | (key_index > query_index - window))


# ----------------------------------------------------------------------------- KV caches


class KVCacheLike(Protocol):
    """What the cached forward needs of a cache; the dense and the engine's paged cache implement it.

    The cache rides in the carry of the layer scan. `write_and_attend(layer, q, k, v, window)` stores the chunk's
    K/V of decoder layer `layer` (a traced index) after each sequence's current length and attends the
    chunk's queries causally over everything cached so far; it returns (attention output [B, Q, H, Dh],
    updated cache). `window` is None for a target without sliding layers, else a traced int32 scalar: W > 0 for a
    sliding layer (a query at cache index i sees only indices i-W+1 .. i; older K/V stay cached, masked, so a
    rollback never needs them back: docs/decisions.md D75), 0 for a full layer. `sinks` [H] (gpt-oss) is the
    layer's attention sinks (`attend`), None without. `advance(Q)` then moves every length on by Q.
    """

    def write_and_attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                         window: jax.Array | None = None, sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
        ...

    def advance(self, num_tokens: int) -> Any:
        ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Contiguous per-sequence cache: k, v [L, B, T, Hk, Dh]; lengths [B] = tokens held per sequence. The reference
    cache: the engine runs on the paged one (`serve.paged.PagedKVCache`), which the tests hold equal to this.

    Slot t of sequence b holds the token at cache index t; slots >= lengths[b] are stale and invisible,
    so rolling back is just lowering `lengths`.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def create(cls, cfg: DecoderConfig, batch: int, max_len: int, dtype: Any = jnp.float32) -> DenseKVCache:
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write_and_attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                         window: jax.Array | None = None,
                         sinks: jax.Array | None = None) -> tuple[jax.Array, DenseKVCache]:
        b, chunk = q.shape[:2]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, chunk))
        slots = self.lengths[:, None] + jnp.arange(chunk)[None, :]
        # Scatter only the chunk into the full cache: in place in the scan carry (a per-layer slice
        # through scan xs/ys costs a full cache copy per call; see docs/decisions.md D4).
        k_all = self.k.at[layer, rows, slots].set(k.astype(self.k.dtype), mode="drop")
        v_all = self.v.at[layer, rows, slots].set(v.astype(self.v.dtype), mode="drop")
        visible = in_window(jnp.arange(self.capacity)[None, None, :], slots[:, :, None], window)
        return attend(q, k_all[layer], v_all[layer], visible, sinks), DenseKVCache(k_all, v_all, self.lengths)

    def advance(self, num_tokens: int) -> DenseKVCache:
        return DenseKVCache(self.k, self.v, self.lengths + num_tokens)

    def rollback(self, lengths: jax.Array) -> DenseKVCache:
        """Forget every slot at or after `lengths[b]` (e.g. rejected draft tokens)."""
        return DenseKVCache(self.k, self.v, jnp.minimum(jnp.asarray(lengths, jnp.int32), self.lengths))


# ----------------------------------------------------------------------------- the layer


def _qkv(cfg: DecoderConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array):
    b, s, _ = x.shape
    h = norm(cfg, x, lp["attn_norm"])
    q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, s, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = norm(cfg, q, lp["q_norm"])
        k = norm(cfg, k, lp["k_norm"])
    q = apply_rope(q, cos, sin)
    if cfg.attn_scale:  # `attend` scales by 1/sqrt(Dh): fold the family's own scale into q (kernels keep theirs)
        q = q * jnp.asarray(cfg.attn_scale * math.sqrt(cfg.head_dim), q.dtype)
    return q, apply_rope(k, cos, sin), v


def _act(cfg: DecoderConfig, x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(x)


def moe_route(cfg: DecoderConfig, router_DtxE: jax.Array, x_RxDt: jax.Array,
              bias_E: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The reference routers, logits in the compute dtype. Qwen3-MoE (`softmax_topk`): softmax in fp32, top-k
    experts, their probabilities renormalised to sum 1 when `norm_topk_prob`, cast back. gpt-oss (`topk_softmax`):
    logits plus the router bias, top-k of them, a softmax over those k. (weights [R, Ek], experts [R, Ek] int32)."""
    logits_RxE = x_RxDt @ router_DtxE
    if bias_E is not None:
        logits_RxE = logits_RxE + bias_E
    if cfg.moe_router == "topk_softmax":
        top_RxEk, experts_RxEk = jax.lax.top_k(logits_RxE, cfg.num_experts_per_tok)
        weights_RxEk = jax.nn.softmax(top_RxEk.astype(jnp.float32), axis=-1)
        return weights_RxEk.astype(x_RxDt.dtype), experts_RxEk.astype(jnp.int32)
    probs_RxE = jax.nn.softmax(logits_RxE.astype(jnp.float32), axis=-1)
    weights_RxEk, experts_RxEk = jax.lax.top_k(probs_RxE, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights_RxEk = weights_RxEk / jnp.sum(weights_RxEk, axis=-1, keepdims=True)
    return weights_RxEk.astype(x_RxDt.dtype), experts_RxEk.astype(jnp.int32)


def _expert_act(cfg: DecoderConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU, or gpt-oss's clamped form when `swiglu_limit` > 0."""
    if not cfg.swiglu_limit:
        return _act(cfg, gate) * up
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha))


def moe_mlp(cfg: DecoderConfig, lp: Params, h_BxSxDt: jax.Array) -> jax.Array:
    """The sparse MoE block, exact (no capacity, no dropped token): the R*Ek (token, expert) assignments sorted by
    expert, each expert's rows one group of a grouped matmul (`jax.lax.ragged_dot`, TPU's megablox-style kernel),
    weighted and summed back per token. Nothing depends on which other tokens share the batch, so the engine's
    verify and AR steps route each token as a forward over it alone would (lossless greedy)."""
    b, s, d = h_BxSxDt.shape
    x_RxDt = h_BxSxDt.reshape(b * s, d)
    k = cfg.num_experts_per_tok
    weights_RxEk, experts_RxEk = moe_route(cfg, lp["router"], x_RxDt, lp.get("router_b"))
    flat_A = experts_RxEk.reshape(-1)                       # A = R*Ek assignments
    order_A = jnp.argsort(flat_A, stable=True)             # grouped by expert
    token_A = order_A // k
    group_sizes_E = jnp.bincount(flat_A, length=cfg.num_experts).astype(jnp.int32)
    rows_AxDt = x_RxDt[token_A]
    gate_AxIe = jax.lax.ragged_dot(rows_AxDt, lp["we_gate"], group_sizes_E)
    up_AxIe = jax.lax.ragged_dot(rows_AxDt, lp["we_up"], group_sizes_E)
    if cfg.moe_bias:
        expert_A = flat_A[order_A]
        gate_AxIe, up_AxIe = gate_AxIe + lp["be_gate"][expert_A], up_AxIe + lp["be_up"][expert_A]
    out_AxDt = jax.lax.ragged_dot(_expert_act(cfg, gate_AxIe, up_AxIe), lp["we_down"], group_sizes_E)
    if cfg.moe_bias:
        out_AxDt = out_AxDt + lp["be_down"][expert_A]
    out_AxDt = out_AxDt * weights_RxEk.reshape(-1)[order_A][:, None]
    return jnp.zeros_like(x_RxDt).at[token_A].add(out_AxDt).reshape(b, s, d)


def moe_mlp_dense(cfg: DecoderConfig, lp: Params, h_BxSxDt: jax.Array) -> jax.Array:
    """The same block computed densely: every expert on every token, combined with the router's top-k weights
    (zeros elsewhere). E/k times the FLOPs of `moe_mlp`; the reference it is tested against and benchmarked with."""
    b, s, d = h_BxSxDt.shape
    x_RxDt = h_BxSxDt.reshape(b * s, d)
    weights_RxEk, experts_RxEk = moe_route(cfg, lp["router"], x_RxDt, lp.get("router_b"))
    combine_RxE = jnp.zeros((b * s, cfg.num_experts), x_RxDt.dtype).at[
        jnp.arange(b * s)[:, None], experts_RxEk].set(weights_RxEk)
    gate = jnp.einsum("td,edi->tei", x_RxDt, lp["we_gate"])
    up = jnp.einsum("td,edi->tei", x_RxDt, lp["we_up"])
    if cfg.moe_bias:
        gate, up = gate + lp["be_gate"], up + lp["be_up"]
    out = jnp.einsum("tei,eid->ted", _expert_act(cfg, gate, up), lp["we_down"])
    if cfg.moe_bias:
        out = out + lp["be_down"]
    return jnp.einsum("ted,te->td", out, combine_RxE).reshape(b, s, d)


def _mlp(cfg: DecoderConfig, lp: Params, h: jax.Array) -> jax.Array:
    if cfg.num_experts:
        return moe_mlp(cfg, lp, h)
    return (_act(cfg, h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


def _finish_layer(cfg: DecoderConfig, lp: Params, x: jax.Array, attn_BxSxHxDh: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    attn = attn_BxSxHxDh.reshape(b, s, cfg.q_size) @ lp["wo"]
    if cfg.o_bias:
        attn = attn + lp["bo"]
    if cfg.sandwich_norms:
        attn = norm(cfg, attn, lp["post_attn_norm"])
    x = x + attn
    out = _mlp(cfg, lp, norm(cfg, x, lp["mlp_norm"]))
    if cfg.sandwich_norms:
        out = norm(cfg, out, lp["post_mlp_norm"])
    return x + out


def layer_forward(cfg: DecoderConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
                  visible_BxSxS: jax.Array) -> jax.Array:
    """One decoder layer over a full sequence (no cache)."""
    q, k, v = _qkv(cfg, lp, x, cos, sin)
    return _finish_layer(cfg, lp, x, attend(q, k, v, visible_BxSxS, lp["sinks"] if cfg.attn_sinks else None))


def _layer_rope(cfg: DecoderConfig, positions_BxS: jax.Array) -> Callable[[jax.Array], tuple[jax.Array, jax.Array]]:
    """cos, sin for a layer given its traced `sliding` flag: the sliding layers' own base where the family has one."""
    full = rope_tables(cfg, positions_BxS)
    if not cfg.local_rope_theta:
        return lambda sliding: full
    local = rope_tables(cfg, positions_BxS, local=True)
    return lambda sliding: (jnp.where(sliding, local[0], full[0]), jnp.where(sliding, local[1], full[1]))


# ----------------------------------------------------------------------------- embedding and head


def embed(params: Params, tokens_BxS: jax.Array) -> jax.Array:
    """Token embeddings, times `params["embed_scale"]` where the family scales them (Gemma: sqrt(hidden))."""
    x = jnp.take(params["embed"], tokens_BxS, axis=0)
    if "embed_scale" in params:
        x = x * params["embed_scale"].astype(x.dtype)
    return x


def lm_head(params: Params, cfg: DecoderConfig, hidden_BxSxDt: jax.Array) -> jax.Array:
    """Final norm + LM head (the tied embedding, or the separate untied head). Logits in fp32."""
    h = norm(cfg, hidden_BxSxDt, params["final_norm"])
    return logits_from_normed(params, cfg, h)


def head_matrix(params: Params, cfg: DecoderConfig) -> tuple[jax.Array, bool]:
    """(the LM head's weight, vocab_major): the tied embedding [V, D] (True) or the untied head [D, V]."""
    if cfg.tie_word_embeddings:
        return params["embed"], True
    return params["lm_head"], False


def logits_from_normed(params: Params, cfg: DecoderConfig, normed_BxSxDt: jax.Array) -> jax.Array:
    """Project already-normed hidden states to full-vocabulary logits (the drafter reuses this)."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("bsd,vd->bsv", normed_BxSxDt, params["embed"]).astype(jnp.float32)
    return (normed_BxSxDt @ params["lm_head"]).astype(jnp.float32)


# ----------------------------------------------------------------------------- forwards


def _segments(layer_ids: tuple[int, ...], num_layers: int, with_logits: bool) -> list[tuple[int, int, bool]]:
    """Split [0, L) into contiguous layer ranges ending at each captured id: (start, stop, capture)."""
    out, start = [], 0
    for j in layer_ids:
        out.append((start, j + 1, True))
        start = j + 1
    if with_logits and start < num_layers:
        out.append((start, num_layers, False))
    return out


def _scan_layers(step: Callable, carry: Any, layers: Any, start: int, stop: int) -> Any:
    """Run `step(carry, layer_xs)` over layers [start, stop) with one lax.scan (`layers`: arrays with a leading L)."""
    seg = jax.tree.map(lambda a: a[start:stop], layers)
    carry, _ = jax.lax.scan(lambda c, lp: (step(c, lp), None), carry, seg)
    return carry


def forward(params: Params, cfg: DecoderConfig, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
            layer_ids: tuple[int, ...] = (), with_logits: bool = True,
            key_valid_BxS: jax.Array | None = None) -> tuple[jax.Array | None, jax.Array | None]:
    """Full causal forward.

    Returns (logits [B, S, V] fp32 or None, features [F, B, S, D] or None) where features[i] is the
    output of decoder layer layer_ids[i] (id j = output of layer j = HF hidden_states[j+1]). With
    `with_logits=False` only the layers up to the deepest requested id run. `key_valid_BxS` marks real
    (non-padding) tokens.
    """
    layer_ids = check_layer_ids(layer_ids, cfg.num_layers) if layer_ids else ()
    if not with_logits and not layer_ids:
        raise ValueError("forward must return logits or features; received with_logits=False and no layer_ids")
    b, s = tokens_BxS.shape
    if positions_BxS is None:
        positions_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    rope = _layer_rope(cfg, positions_BxS)
    index = jnp.arange(s)
    visible = index[None, :] <= index[:, None]
    local = in_window(index[None, :], index[:, None], jnp.int32(cfg.sliding_window))[None]
    visible = visible[None]
    if key_valid_BxS is not None:
        visible = visible & key_valid_BxS[:, None, :].astype(bool)
        local = local & key_valid_BxS[:, None, :].astype(bool)
    visible = jnp.broadcast_to(visible, (b, s, s))

    def step(x, xs):
        lp, sliding = xs
        cos, sin = rope(sliding)
        vis = jnp.where(sliding, local, visible) if cfg.windowed else visible
        return layer_forward(cfg, lp, x, cos, sin, vis)

    x = embed(params, tokens_BxS)
    features = []
    layers = (params["layers"], jnp.asarray(cfg.sliding_layers))
    for start, stop, capture in _segments(layer_ids, cfg.num_layers, with_logits):
        x = _scan_layers(step, x, layers, start, stop)
        if capture:
            features.append(x)
    logits = lm_head(params, cfg, x) if with_logits else None
    return logits, (jnp.stack(features) if features else None)


def forward_cached(params: Params, cfg: DecoderConfig, tokens_BxQ: jax.Array, positions_BxQ: jax.Array,
                   cache: KVCacheLike, layer_ids: tuple[int, ...] = (),
                   logits_at_BxQo: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None, Any]:
    """Append a chunk of Q tokens per sequence to `cache` and return (logits [B,Q,V], features, cache).

    `features` is [F, B, Q, Dt] (outputs of decoder layers `layer_ids`) or None. With `logits_at_BxQo`,
    logits are computed only at those chunk indices ([B, Qo, V]), e.g. the last prompt token in prefill.

    `cache` is any `KVCacheLike` (`DenseKVCache`, the engine's `serve.paged.PagedKVCache`). Token i of
    sequence b lands at cache index cache.lengths[b] + i and is rotated at positions_BxQ[b, i]. The caller
    guarantees lengths + Q <= capacity (see `check_capacity`). Rolling back is `cache.rollback(lengths)`.
    """
    layer_ids = check_layer_ids(layer_ids, cfg.num_layers) if layer_ids else ()
    rope = _layer_rope(cfg, positions_BxQ)

    b, t = tokens_BxQ.shape
    num_feats = max(len(layer_ids), 1)
    slot_of_layer = np.zeros(cfg.num_layers, np.int32)
    captured = np.zeros(cfg.num_layers, bool)
    for i, j in enumerate(layer_ids):
        slot_of_layer[j], captured[j] = i, True

    def step(carry, xs):
        x, feats, kv = carry
        lp, index, slot, keep, sliding = xs
        q, k, v = _qkv(cfg, lp, x, *rope(sliding))
        extra = {}  # only what the target has: caches and kernels for the others need not take them
        if cfg.windowed:
            extra["window"] = jnp.where(sliding, cfg.sliding_window, 0)
        if cfg.attn_sinks:
            extra["sinks"] = lp["sinks"]
        attn, kv = kv.write_and_attend(index, q, k, v, **extra)
        x = _finish_layer(cfg, lp, x, attn)
        feats = feats.at[slot].set(jnp.where(keep, x, feats[slot]))  # features carried, not all layers kept
        return (x, feats, kv), None

    x = embed(params, tokens_BxQ)
    feats = jnp.zeros((num_feats, b, t, cfg.hidden_size), x.dtype)
    xs = (params["layers"], jnp.arange(cfg.num_layers), jnp.asarray(slot_of_layer), jnp.asarray(captured),
          jnp.asarray(cfg.sliding_layers))
    (x, feats, cache), _ = jax.lax.scan(step, (x, feats, cache), xs)
    if logits_at_BxQo is not None:
        x = jnp.take_along_axis(x, logits_at_BxQo[:, :, None].astype(jnp.int32), axis=1)
    return lm_head(params, cfg, x), (feats if layer_ids else None), cache.advance(t)


def check_capacity(lengths: np.ndarray, chunk: int, capacity: int) -> None:
    """Host-side guard for a `DenseKVCache` caller: appending `chunk` tokens must fit in the cache (no silent
    clamped writes). The paged cache checks its own capacity (`serve.paged.PageTable.ensure`)."""
    worst = int(np.max(lengths)) + chunk
    if worst > capacity:
        raise ValueError(
            f"sequence length must stay within the cache capacity {capacity} (target.max_seq_len); "
            f"appending {chunk} tokens would reach {worst}"
        )
