"""The DFlash block-diffusion drafter (docs/design.md §4.1) in Flax NNX, and what it borrows from the frozen target:
its features (`online_features`), its embedding table (the block's ids, `block_token_ids`, embedded with
`models.decoder.embed`) and its LM head (`drafter_logits`, or `draft_head_rows` for a draft vocabulary).

`DFlashDrafter.__call__` is the training forward over N packed blocks; `context_kv` + `draft_block` are the
inference path (the engine caches the context K/V). Architecture and visibility: `DFlashDrafter`; z-lab
tensor names: `hf_tensor_names`. Design notes: docs/decisions.md D8 (mask id: D12).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash.configs.schema import require
from dflash.models.config import (
    DecoderConfig,
    DrafterConfig,
    RopeScaling,
    check_layer_ids,
    check_layer_types,
    default_layer_ids,
)
from dflash.models.decoder import (
    NEG_INF,
    Params,
    apply_rope,
    attend,
    forward,
    head_matrix,
    logits_from_normed,
    rms_norm,
    rope_tables,
)

KV = tuple[jax.Array, jax.Array]  # (k, v), each [B, S, Hk, Dh], RoPE applied to k


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class DrafterArch:
    """A fully resolved drafter architecture (no 'follow the target' placeholders left).

    hidden_size is the target's, D = Dt (fc maps Df = F*Dt -> D). The target_* fields are what the z-lab
    config.json records about the target (family, vocab, layer count).
    """

    hidden_size: int
    num_layers: int
    num_features: int
    layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    target_family: str
    target_vocab_size: int
    target_num_layers: int
    layer_types: tuple[str, ...] = ()  # () = every layer full_attention (the canonical form of that case)
    sliding_window: int = 0
    variant: str = "dflash"
    conv_kernel_size: int = 0  # 0 = no convolution (DFlash v1, or DFlash2 with drafter.conv off)
    conv_group_size: int = 16
    selector_rank: int = 0  # 0 = no path selector (drafts are each slot's argmax)
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        check_layer_types(self.layer_types, self.num_layers, self.sliding_window, self.block_size, "drafter")
        require(self.selector_rank == 0 or 1 <= self.selector_top_k <= self.target_vocab_size,
                "drafter.selector_top_k", self.selector_top_k, f"lie in [1, {self.target_vocab_size}] (the vocab)")
        require(self.conv_kernel_size == 0 or self.hidden_size % self.conv_group_size == 0,
                "drafter.conv_group_size", self.conv_group_size,
                f"divide the hidden size {self.hidden_size} (channels sharing one dynamic kernel)")

    def sliding(self, layer: int) -> bool:
        """Whether drafter layer `layer` is a sliding-window layer (sees the last `sliding_window` context
        positions before its block's anchor only)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def num_sliding(self) -> int:
        return sum(self.sliding(i) for i in range(self.num_layers))

    @property
    def rope_config(self) -> DecoderConfig:
        """A decoder config carrying the drafter's RoPE (head_dim, theta, scaling) for `rope_tables`."""
        return DecoderConfig(
            family="qwen3", vocab_size=self.target_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings, qk_norm=True,
        )


# Architecture fields that left the code (docs/retired.md), each with the value that meant "off". A record written
# before (a checkpoint's meta) may hold them: at that value the field is read as absent, at any other refused.
RETIRED_ARCH_FIELDS: dict[str, Any] = {"markov_rank": 0}


def without_retired(fields: dict[str, Any], where: str) -> dict[str, Any]:
    """`fields` (a recorded DrafterArch, JSON values) without the retired fields at their off value; ValueError
    naming a retired option that is on (such a drafter needs the code at git tag arch3-retired-options)."""
    on = {k: fields[k] for k, off in RETIRED_ARCH_FIELDS.items() if fields.get(k, off) != off}
    if on:
        raise ValueError(f"{where} holds a drafter with {on}, an option retired from this trainer (docs/retired.md); "
                         "load it with the code at git tag arch3-retired-options")
    return {k: v for k, v in fields.items() if k not in RETIRED_ARCH_FIELDS}


DRAFT_VOCAB_FILE = "draft_vocab.json"


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    """The draft vocabulary of a drafter trained with `train.head_vocab`: the target token ids [V'] its
    softmax covered. Proposals are the argmax over these rows of the target's LM head only, so each propose
    reads V'/V of the head (the head is most of a small drafter's step). Static (hashed by identity) on the
    module: it never enters the parameter state."""

    ids: np.ndarray

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids)
        require(ids.ndim == 1 and ids.size >= 1 and np.issubdtype(ids.dtype, np.integer), "draft_vocab",
                f"shape {ids.shape} {ids.dtype}", "be a non-empty 1-D list of token ids")
        require(len(np.unique(ids)) == ids.size and ids.min() >= 0, "draft_vocab", "ids",
                "be distinct, non-negative token ids")
        object.__setattr__(self, "ids", ids.astype(np.int32))

    def check_fits(self, vocab_size: int, where: str) -> None:
        require(int(self.ids.max()) < vocab_size, f"{where} draft_vocab", int(self.ids.max()),
                f"lie inside the target's vocab [0, {vocab_size})")

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / DRAFT_VOCAB_FILE
        path.write_text(json.dumps({"draft_vocab_size": int(self.ids.size), "ids": self.ids.tolist()}) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path, vocab_size: int | None = None) -> DraftVocab | None:
        """`<directory>/draft_vocab.json`, or None when the drafter has none (full-vocabulary proposals);
        with `vocab_size`, checked to fit the target's vocabulary."""
        path = Path(directory) / DRAFT_VOCAB_FILE
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        require(record.get("draft_vocab_size") == len(record.get("ids", ())), str(path), record.get("draft_vocab_size"),
                "equal the number of ids it lists")
        vocab = cls(np.asarray(record["ids"], np.int64))
        if vocab_size is not None:
            vocab.check_fits(vocab_size, str(directory))
        return vocab


def resolve_drafter(cfg: DrafterConfig, target: DecoderConfig, mask_token_id: int | None = None) -> DrafterArch:
    """Resolve `cfg` against the target architecture.

    The mask id is `cfg.mask_token_id` when set (>= 0), else `mask_token_id` (the target's default),
    and must lie inside the target's vocab. Layer ids default to `default_layer_ids(L, F)`.
    """
    mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else mask_token_id
    require(mask is not None and mask >= 0, "drafter.mask_token_id", cfg.mask_token_id,
            f"be set for a {target.family} target (a token id in [0, {target.vocab_size}) whose embedding "
            "row is unused, e.g. Qwen3's 151669)")
    require(mask < target.vocab_size, "drafter.mask_token_id", mask,
            f"lie inside the target's vocab [0, {target.vocab_size})")
    ids = cfg.layer_ids or default_layer_ids(target.num_layers, cfg.num_features)
    ids = check_layer_ids(ids, target.num_layers)
    return DrafterArch(
        hidden_size=target.hidden_size, num_layers=cfg.num_layers, num_features=cfg.num_features,
        layer_ids=ids, block_size=cfg.block_size, mask_token_id=int(mask), num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, intermediate_size=target.intermediate_size,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings, target_family=target.family,
        target_vocab_size=target.vocab_size, target_num_layers=target.num_layers,
        layer_types=tuple(cfg.layer_types) if "sliding_attention" in cfg.layer_types else (),
        sliding_window=cfg.sliding_window, variant=cfg.variant,
        conv_kernel_size=cfg.conv_kernel_size if cfg.variant == "dflash2" and cfg.conv else 0,
        conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank if cfg.selector else 0,
        selector_top_k=cfg.selector_top_k,
    )


def check_fits_target(arch: DrafterArch, target: DecoderConfig, where: str) -> None:
    """Raise ValueError naming every field where a loaded drafter (from `where`) does not fit `target`."""
    fits = {"hidden_size": (arch.hidden_size, target.hidden_size),
            "vocab_size": (arch.target_vocab_size, target.vocab_size),
            "num_layers": (arch.target_num_layers, target.num_layers)}
    bad = [f"{k}: drafter {a} vs target {b}" for k, (a, b) in fits.items() if a != b]
    if max(arch.layer_ids) >= target.num_layers:
        bad.append(f"layer_ids {arch.layer_ids} reach past the target's {target.num_layers} layers")
    if bad:
        raise ValueError(f"the drafter in {where} was trained for another target (" + "; ".join(bad) + ")")


MASK_TOKEN_CANDIDATES = ("<|MASK|>", "<|mask|>", "<empty_output>", "<|reserved_special_token_0|>")


def default_mask_token_id(tokenizer: Any, target: DecoderConfig) -> int | None:
    """The mask id a drafter for this target uses when the config leaves it at -1, or None.

    In order: a named token meant for it or never produced in chat (`<|MASK|>`; SmolLM2's code-pretraining
    special `<empty_output>` = 16; Llama 3's `<|reserved_special_token_0|>` = 128002); else the first
    embedding row past the tokenizer's vocab when the table has spare rows (Qwen3: 151669, as z-lab's
    drafters use). Never a stop token.
    """
    stops = set(getattr(tokenizer, "stop_token_ids", ()))
    for name in MASK_TOKEN_CANDIDATES:
        token_id = tokenizer.backend.token_to_id(name)
        if token_id is not None and token_id not in stops and token_id < target.vocab_size:
            return int(token_id)
    if tokenizer.vocab_size < target.vocab_size:
        return int(tokenizer.vocab_size)
    return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockVisibility:
    """Block-structured visibility of Q = N*K packed block queries (docs/design.md §4.2), O(N*S) instead of
    the dense O(Q*(S+Q)) mask.

    ctx_BxNxS: block n (queries n*K .. n*K+K-1) sees context key s iff ctx_BxNxS[b, n, s];
    every block sees all K keys of its own block (bidirectional) and no key of another block.
    sliding_BxNxS: the same for sliding-window layers (`drafter.layer_types`): ctx_BxNxS and, for a block of
    anchor a, s >= a - W (the last W context positions before the anchor); None when no layer slides.
    """

    ctx_BxNxS: jax.Array
    sliding_BxNxS: jax.Array | None = None

    @staticmethod
    def from_anchors(anchor_BxN: jax.Array, ctx_valid_BxS: jax.Array, segment_BxS: jax.Array | None = None,
                     window: int = 0) -> BlockVisibility:
        """Context s < anchor STRICTLY and valid; a padding block (anchor < 0) sees no context. With
        `segment_BxS` (packed rows: which conversation each position belongs to), only context of the
        anchor's own conversation. With `window` W > 0, also the sliding layers' view: s >= anchor - W."""
        s_1x1xS = jnp.arange(ctx_valid_BxS.shape[1])[None, None, :]
        a_BxNx1 = jnp.asarray(anchor_BxN)[:, :, None]
        ctx_BxNxS = (s_1x1xS < a_BxNx1) & (jnp.asarray(ctx_valid_BxS)[:, None, :] > 0)
        if segment_BxS is not None:
            seg_BxS = jnp.asarray(segment_BxS)
            own_BxNx1 = jnp.take_along_axis(seg_BxS, jnp.maximum(jnp.asarray(anchor_BxN), 0), axis=1)[:, :, None]
            ctx_BxNxS = ctx_BxNxS & (seg_BxS[:, None, :] == own_BxNx1)
        sliding = ctx_BxNxS & (s_1x1xS >= a_BxNx1 - window) if window > 0 else None
        return BlockVisibility(ctx_BxNxS, sliding)

    def for_layer(self, sliding: bool) -> BlockVisibility:
        """The visibility a full (`sliding` False) or sliding-window layer uses."""
        if not sliding:
            return BlockVisibility(self.ctx_BxNxS)
        require(self.sliding_BxNxS is not None, "visible", "no sliding-window view",
                "be built with BlockVisibility.from_anchors(..., window=W) for a drafter with sliding layers")
        return BlockVisibility(self.sliding_BxNxS)

    def dense(self, block_size: int, sliding: bool = False) -> jax.Array:
        """The equivalent dense mask bool [B, Q, S+Q] (tests and reference only) of a full or sliding layer."""
        ctx_BxNxS = self.for_layer(sliding).ctx_BxNxS
        b, n, s = ctx_BxNxS.shape
        q = n * block_size
        ctx = jnp.repeat(ctx_BxNxS, block_size, axis=1)
        blk_of = jnp.arange(q) // block_size
        blk = jnp.broadcast_to(blk_of[:, None] == blk_of[None, :], (b, q, q))
        return jnp.concatenate([ctx, blk], axis=-1)


Visibility = jax.Array | BlockVisibility


def attend_blocks(q_BxQxHxDh: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, blk_k: jax.Array, blk_v: jax.Array,
                  vis: BlockVisibility) -> jax.Array:
    """Softmax attention of N blocks of K queries over [context S | own block K]; fp32 softmax.

    Same result as `attend` with `vis.dense(K)` over keys [context | all Q block keys], at O(Q*(S+K))
    scores instead of O(Q*(S+Q)). Rows never empty (a block always sees itself), so never NaN.
    """
    b, q_len, h, dh = q_BxQxHxDh.shape
    n = vis.ctx_BxNxS.shape[1]
    k = q_len // n
    hk = ctx_k.shape[2]
    q = q_BxQxHxDh.reshape(b, n, k, hk, h // hk, dh)
    kb = blk_k.reshape(b, n, k, hk, dh)
    vb = blk_v.reshape(b, n, k, hk, dh)
    scale = 1.0 / math.sqrt(dh)
    s_ctx = jnp.einsum("bnqhgd,bshd->bnhgqs", q, ctx_k).astype(jnp.float32) * scale
    s_blk = jnp.einsum("bnqhgd,bnjhd->bnhgqj", q, kb).astype(jnp.float32) * scale
    s_ctx = jnp.where(vis.ctx_BxNxS[:, :, None, None, None, :], s_ctx, NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    p_ctx = jnp.where(vis.ctx_BxNxS[:, :, None, None, None, :], probs[..., : ctx_k.shape[1]], 0.0)
    p_blk = probs[..., ctx_k.shape[1]:]
    out = (jnp.einsum("bnhgqs,bshd->bnqhgd", p_ctx.astype(ctx_v.dtype), ctx_v)
           + jnp.einsum("bnhgqj,bnjhd->bnqhgd", p_blk.astype(vb.dtype), vb))
    return out.reshape(b, q_len, h, dh)


# ----------------------------------------------------------------------------- modules


def _linear(d_in: int, d_out: int, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


class RMSNorm(nnx.Module):
    """HF RMSNorm (fp32 statistics, then scale) with a `weight` parameter, as in the z-lab names."""

    def __init__(self, size: int, eps: float):
        self.weight = nnx.Param(jnp.ones((size,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...].astype(x.dtype), self.eps)


class DrafterAttention(nnx.Module):
    """Qwen3 attention (no biases, per-head q/k RMSNorm) whose keys are `[context | block]`."""

    def __init__(self, arch: DrafterArch, dtype: Any, rngs: nnx.Rngs):
        d, h, hk, dh = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, dh
        self.q_proj = _linear(d, h * dh, dtype, rngs)
        self.k_proj = _linear(d, hk * dh, dtype, rngs)
        self.v_proj = _linear(d, hk * dh, dtype, rngs)
        self.o_proj = _linear(h * dh, d, dtype, rngs)
        self.q_norm = RMSNorm(dh, arch.rms_norm_eps)
        self.k_norm = RMSNorm(dh, arch.rms_norm_eps)

    def query(self, h_BxQxD: jax.Array, cos_BxQxDh: jax.Array, sin_BxQxDh: jax.Array) -> jax.Array:
        """Queries [B, Q, H, Dh]: q_norm(q_proj(h)), rotated at the block positions."""
        b, q_len, _ = h_BxQxD.shape
        q = self.q_proj(h_BxQxD).reshape(b, q_len, self.num_heads, self.head_dim)
        return apply_rope(self.q_norm(q), cos_BxQxDh, sin_BxQxDh)

    def project_kv(self, x_BxSxD: jax.Array, cos_BxSxDh: jax.Array, sin_BxSxDh: jax.Array) -> KV:
        """(k, v) [B, S, Hk, Dh] = (RoPE(k_norm(k_proj(x))), v_proj(x)); used for context AND block."""
        b, s, _ = x_BxSxD.shape
        k = self.k_proj(x_BxSxD).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BxSxD).reshape(b, s, self.num_kv_heads, self.head_dim)
        return apply_rope(self.k_norm(k), cos_BxSxDh, sin_BxSxDh), v

    def __call__(self, h_BxQxD: jax.Array, cos_BxQxDh: jax.Array, sin_BxQxDh: jax.Array, ctx_kv: KV,
                 visible: Visibility) -> jax.Array:
        """Attention output [B, Q, D] over keys `[context S | block Q]`.

        `visible` is a `BlockVisibility` (the training and inference paths: block-local, O(Q*(S+K))) or a
        dense bool [B, Q, S+Q] (query q sees key j iff visible[b, q, j]; the reference path for tests).
        """
        b, q_len, _ = h_BxQxD.shape
        q = self.query(h_BxQxD, cos_BxQxDh, sin_BxQxDh)
        k_blk, v_blk = self.project_kv(h_BxQxD, cos_BxQxDh, sin_BxQxDh)
        ctx_k, ctx_v = ctx_kv
        ctx_k, ctx_v = ctx_k.astype(k_blk.dtype), ctx_v.astype(v_blk.dtype)
        if isinstance(visible, BlockVisibility):
            out = attend_blocks(q, ctx_k, ctx_v, k_blk, v_blk, visible)
        else:
            k = jnp.concatenate([ctx_k, k_blk], axis=1)
            v = jnp.concatenate([ctx_v, v_blk], axis=1)
            out = attend(q, k, v, visible)
        return self.o_proj(out.reshape(b, q_len, self.num_heads * self.head_dim))


class DrafterMLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, arch: DrafterArch, dtype: Any, rngs: nnx.Rngs):
        self.gate_proj = _linear(arch.hidden_size, arch.intermediate_size, dtype, rngs)
        self.up_proj = _linear(arch.hidden_size, arch.intermediate_size, dtype, rngs)
        self.down_proj = _linear(arch.intermediate_size, arch.hidden_size, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _block_convolution(x_BxQxD: jax.Array, dyn_BxQxWcxG: jax.Array, base_WcxD: jax.Array, *, taps: int,
                       group_size: int, block_len: int) -> jax.Array:
    """`BlockConv`'s convolution of x with one side's kernels. Rematerialised: its backward recomputes the shifted
    copies of x and the per-tap kernels broadcast over each group's channels (Wc + 1 arrays of x's size per call,
    4 calls per layer) from x and the small dynamic kernels instead of keeping them from the forward
    (docs/decisions.md D58: the 8B DFlash2 train step 70.0 -> 56.6 GiB per chip on v5p-128)."""
    b, q, d = x_BxQxD.shape
    g = d // group_size
    x = x_BxQxD.reshape(b, q // block_len, block_len, g, group_size)
    dyn = dyn_BxQxWcxG.reshape(b, q // block_len, block_len, taps, g, 1)
    base = base_WcxD.astype(x.dtype).reshape(taps, g, group_size)
    out = jnp.zeros_like(x)
    for o in range(taps):
        shifted = x if o == 0 else jnp.pad(x[:, :, :-o], ((0, 0), (0, 0), (o, 0), (0, 0), (0, 0)))
        out = out + (base[o] + dyn[:, :, :, o].astype(x.dtype)) * shifted
    return out.reshape(b, q, d)


class BlockConv(nnx.Module):
    """DFlash2's 2-tap grouped dynamic depthwise convolution around one sublayer (`drafter.variant: dflash2`,
    `drafter.conv`; z-lab's `GroupedDynamicCausalConv`), causal and local to each block of K.

    With G = D / group_size channel groups and Wc = `conv_kernel_size` taps, one projection of the sublayer's
    (normed) input h gives per position t a dynamic kernel for the input side and one for the output side,
    `kernel_projection(h)` viewed [2, Wc, G]; `base_kernel` [2, Wc, D] is the static part. Each side computes

        y_t = sum_{o < Wc} (base[o] + dyn_t[o, group(c)]) * x_{t-o}        (x_{t-o} = 0 before the block's start)

    `prepare(h)` convolves the sublayer's input with side 0 and returns side 1's dynamic kernel, which `finish`
    applies to the sublayer's output. Identity at init (base tap 0 = 1, other taps 0, projection 0), so a new
    DFlash2 drafter computes what a DFlash one does."""

    def __init__(self, arch: DrafterArch, dtype: Any, rngs: nnx.Rngs):
        d, t = arch.hidden_size, arch.conv_kernel_size
        self.taps, self.group_size = t, arch.conv_group_size
        self.base_kernel = nnx.Param(jnp.zeros((2, t, d), jnp.float32).at[:, 0].set(1.0))
        self.kernel_projection = _linear(d, 2 * t * (d // arch.conv_group_size), dtype, rngs)
        self.kernel_projection.kernel.set_value(jnp.zeros_like(self.kernel_projection.kernel.get_value()))

    def prepare(self, h_BxQxD: jax.Array, block_len: int) -> tuple[jax.Array, jax.Array]:
        b, q, d = h_BxQxD.shape
        dyn = self.kernel_projection(h_BxQxD).reshape(b, q, 2, self.taps, d // self.group_size)
        return self._convolve(h_BxQxD, dyn[:, :, 0], self.base_kernel[...][0], block_len), dyn[:, :, 1]

    def finish(self, y_BxQxD: jax.Array, dyn_BxQxWcxG: jax.Array, block_len: int) -> jax.Array:
        return self._convolve(y_BxQxD, dyn_BxQxWcxG, self.base_kernel[...][1], block_len)

    def _convolve(self, x_BxQxD: jax.Array, dyn_BxQxWcxG: jax.Array, base_WcxD: jax.Array,
                  block_len: int) -> jax.Array:
        conv = functools.partial(_block_convolution, taps=self.taps, group_size=self.group_size, block_len=block_len)
        return jax.checkpoint(conv)(x_BxQxD, dyn_BxQxWcxG, base_WcxD)


class CandidateSelector(nnx.Module):
    """DFlash2's low-rank path selector (`drafter.selector`; rank r = `arch.selector_rank`, top-k k =
    `arch.selector_top_k`), tensor names and shapes of the public layout (`candidate_selector.*`).

    Slot t of a block has unary scores u_t (the LM head's logits of its normed hidden state h_t) and candidates
    C_t, its top k tokens by u_t. The edge score of candidate b after token a is

        e_t(a, b) = sum_r P[a, r] * (W h_t)[r] * S[b, r]     (P, S: predecessor / successor codebooks [V, r])

    and the walk (`walk`) picks d_t = argmax_{b in C_t} u_t(b) + e_t(d_{t-1}, b) left to right from d_0 = the
    anchor: still one backbone pass, and a chain of drafts. The successor codebook starts at zero (e = 0): a new
    selector drafts each slot's argmax, i.e. what DFlash2 without it drafts.
    """

    def __init__(self, arch: DrafterArch, dtype: Any, rngs: nnx.Rngs):
        v, r = arch.target_vocab_size, arch.selector_rank
        self.top_k = arch.selector_top_k
        self.predecessor_codebook = nnx.Param(0.02 * jax.random.normal(rngs.params(), (v, r), dtype))
        self.successor_codebook = nnx.Param(jnp.zeros((v, r), dtype))
        self.hidden_projection = _linear(arch.hidden_size, r, dtype, rngs)

    def edges(self, prev_ids: jax.Array, proj_xDr: jax.Array, cand_ids_xC: jax.Array) -> jax.Array:
        """e(prev, c) [..., C] for predecessor ids [...] (or [..., C'] of them: then [..., C', C]), the slot's
        projected hidden state W h [..., Dr] and its candidates [..., C]."""
        pred = self.predecessor_codebook[...][prev_ids]
        succ = self.successor_codebook[...][cand_ids_xC]
        if pred.ndim == proj_xDr.ndim + 1:  # a lattice: every predecessor candidate against every candidate
            return jnp.einsum("...pr,...cr->...pc", pred * proj_xDr[..., None, :], succ)
        return jnp.einsum("...r,...cr->...c", pred * proj_xDr, succ)

    def walk(self, cand_ids_BxJxC: jax.Array, unary_BxJxC: jax.Array, hidden_BxJxD: jax.Array,
             anchor_B: jax.Array) -> jax.Array:
        """Draft ids [B, J]: slot t's candidate with the largest u + e(previous draft, .), the anchor before
        slot 0 (ties: the earlier candidate, i.e. the higher unary score)."""
        proj_BxJxDr = self.hidden_projection(hidden_BxJxD).astype(jnp.float32)
        unary = unary_BxJxC.astype(jnp.float32)

        def step(prev_B, t):
            scores = unary[:, t] + self.edges(prev_B, proj_BxJxDr[:, t], cand_ids_BxJxC[:, t]).astype(jnp.float32)
            pick = jnp.take_along_axis(cand_ids_BxJxC[:, t], jnp.argmax(scores, axis=-1)[:, None], axis=1)[:, 0]
            return pick, pick

        _, ids_JxB = jax.lax.scan(step, anchor_B.astype(jnp.int32), jnp.arange(cand_ids_BxJxC.shape[1]))
        return ids_JxB.T


class DrafterLayer(nnx.Module):
    """One Qwen3-style layer with KV injection of the fused context; with `arch.conv_kernel_size` > 0 (DFlash2) a
    `BlockConv` around the attention (`attention_conv`) and around the MLP (`mlp_conv`)."""

    def __init__(self, arch: DrafterArch, dtype: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = DrafterAttention(arch, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = DrafterMLP(arch, dtype, rngs)
        conv = arch.conv_kernel_size > 0
        self.attention_conv = BlockConv(arch, dtype, rngs) if conv else None
        self.mlp_conv = BlockConv(arch, dtype, rngs) if conv else None

    def context_kv(self, fused_BxSxD: jax.Array, cos_BxSxDh: jax.Array, sin_BxSxDh: jax.Array) -> KV:
        """Context K/V of this layer: the attention's own k/v/k_norm on c; NO input_layernorm on c."""
        return self.self_attn.project_kv(fused_BxSxD, cos_BxSxDh, sin_BxSxDh)

    def __call__(self, x_BxQxD: jax.Array, cos_BxQxDh: jax.Array, sin_BxQxDh: jax.Array, ctx_kv: KV,
                 visible: Visibility, block_len: int = 0) -> jax.Array:
        """x + attn, then + mlp; `block_len` (the K of the blocks packed in Q) bounds the convolutions."""
        h = self.input_layernorm(x_BxQxD)
        if self.attention_conv is None:
            x = x_BxQxD + self.self_attn(h, cos_BxQxDh, sin_BxQxDh, ctx_kv, visible)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, after = self.attention_conv.prepare(h, block_len)
        attn = self.self_attn(h, cos_BxQxDh, sin_BxQxDh, ctx_kv, visible)
        x = x_BxQxD + self.attention_conv.finish(attn, after, block_len)
        h, after = self.mlp_conv.prepare(self.post_attention_layernorm(x), block_len)
        return x + self.mlp_conv.finish(self.mlp(h), after, block_len)


class DFlashDrafter(nnx.Module):
    """The DFlash drafter: fc + hidden_norm fusion, `num_layers` KV-injected layers, final `norm`.

    - fused context `c = hidden_norm(fc(concat_F target_feats))` (fc has no bias), once per context token;
    - `L_d` Qwen3-style layers (per-head RMSNorm on q and k, no biases, SwiGLU) at the target's hidden
      width D, whatever the target's family;
    - in each layer the block stream x gives queries and block K/V after `input_layernorm`; the context
      gives K/V through the SAME `k_proj`/`v_proj`/`k_norm` with NO `input_layernorm`, rotated at the
      context tokens' own positions; keys are `[context | block]`, attention non-causal under a boolean
      visibility (`BlockVisibility`; who sees what: `__call__` for training, `draft_block` for inference);
    - after the last layer `norm`;
    - with `arch.conv_kernel_size` > 0 (`drafter.variant: dflash2`), DFlash2's `BlockConv` around each layer's
      attention and MLP, local to each block;
    - with `arch.selector_rank` > 0 (`drafter.selector`, DFlash2), a `CandidateSelector` (`candidate_selector`)
      that walks each block's top-k candidates instead of taking each slot's argmax.

    Holds no embedding and no LM head: block embeddings come from the target's table (the train step embeds
    `Blocks.block_ids`, the engine `block_token_ids`) and logits from the target's head. Parameter paths map one
    to one onto the z-lab HF tensor names (`hf_tensor_names`; an `nnx.Linear` `kernel` [in, out] is the
    HF `weight` [out, in] transposed).
    """

    def __init__(self, arch: DrafterArch, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.arch = arch
        d = arch.hidden_size
        self.fc = _linear(arch.num_features * d, d, dtype, rngs)
        self.hidden_norm = RMSNorm(d, arch.rms_norm_eps)
        self.layers = nnx.List([DrafterLayer(arch, dtype, rngs) for _ in range(arch.num_layers)])
        self.norm = RMSNorm(d, arch.rms_norm_eps)
        self.candidate_selector = CandidateSelector(arch, dtype, rngs) if arch.selector_rank else None
        self.draft_vocab: DraftVocab | None = None  # set by the loaders for a drafter trained on a head vocabulary

    def fuse(self, ctx_feats_BxSxDf: jax.Array) -> jax.Array:
        """Fused context c [B, S, D] = hidden_norm(fc(concat_F feats)); features in layer-id order."""
        return self.hidden_norm(self.fc(ctx_feats_BxSxDf))

    def context_kv(self, fused_ctx_BxSxD: jax.Array, ctx_pos_BxS: jax.Array) -> list[KV]:
        """Per-layer context (k, v) [B, S, Hk, Dh], k rotated at the context tokens' own positions.

        This is all the engine caches for the drafter (block K/V are never cached).
        """
        cos, sin = rope_tables(self.arch.rope_config, ctx_pos_BxS)
        return [layer.context_kv(fused_ctx_BxSxD, cos, sin) for layer in self.layers]

    def blocks(self, block_embeds_BxQxD: jax.Array, block_pos_BxQ: jax.Array, ctx_kv: list[KV],
               visible: Visibility | Sequence[Visibility]) -> jax.Array:
        """Run the layers on block queries over precomputed context K/V; returns normed hidden [B, Q, D].

        `visible`: a `BlockVisibility` or a dense bool [B, Q, S+Q] over keys `[context S | block Q]`, or one of
        them per layer (`layer_visibility`); layer l's context K/V may have its own length S_l.
        """
        require(len(ctx_kv) == len(self.layers), "ctx_kv", len(ctx_kv), f"hold {len(self.layers)} layers' (k, v)")
        cos, sin = rope_tables(self.arch.rope_config, block_pos_BxQ)
        x = block_embeds_BxQxD
        per_layer = self.layer_visibility(visible)
        block_len = self.block_len(block_embeds_BxQxD.shape[1], per_layer[0])
        for layer, kv, vis in zip(self.layers, ctx_kv, per_layer, strict=True):
            x = layer(x, cos, sin, kv, vis, block_len)
        return self.norm(x)

    def block_len(self, q_len: int, visible: Visibility) -> int:
        """K of the blocks packed in Q = N*K queries (what DFlash2's convolutions stay inside): Q / N of a
        `BlockVisibility`; with a dense mask, which does not say, the training K (one block, or N of them)."""
        if isinstance(visible, BlockVisibility):
            return q_len // visible.ctx_BxNxS.shape[1]
        k = self.arch.block_size
        require(self.arch.conv_kernel_size == 0 or q_len % k == 0, "visible", "a dense mask",
                f"be a BlockVisibility for a DFlash2 drafter whose queries ({q_len}) are not blocks of {k}")
        return k if q_len % k == 0 else q_len

    def layer_visibility(self, visible: Visibility | Sequence[Visibility]) -> list[Visibility]:
        """One visibility per layer: a list is taken as it is; a `BlockVisibility` gives each layer its full or
        sliding-window view (`for_layer`); one dense mask serves a drafter without sliding layers only."""
        n = len(self.layers)
        if isinstance(visible, list | tuple):
            require(len(visible) == n, "visible", len(visible), f"hold one visibility per layer ({n})")
            return list(visible)
        if isinstance(visible, BlockVisibility):
            return [visible.for_layer(self.arch.sliding(i)) for i in range(n)]
        require(self.arch.num_sliding == 0, "visible", "one dense mask",
                "be a list of per-layer masks for a drafter with sliding-window layers")
        return [visible] * n

    def __call__(self, block_embeds_BxQxD: jax.Array, block_pos_BxQ: jax.Array, ctx_feats_BxSxDf: jax.Array,
                 ctx_pos_BxS: jax.Array, visible: Visibility) -> jax.Array:
        """Training forward over Q = N*K packed block tokens; returns normed hidden [B, Q, D].

        docs/design.md §4.2's mask gives a block of anchor a the context keys s < a and the keys of its own
        block only: `BlockVisibility.from_anchors` (or an equivalent dense [B, Q, S+Q] mask).
        """
        fused = self.fuse(ctx_feats_BxSxDf)
        return self.blocks(block_embeds_BxQxD, block_pos_BxQ, self.context_kv(fused, ctx_pos_BxS), visible)

    def draft_block(self, block_embeds_BxKxD: jax.Array, block_pos_BxK: jax.Array, ctx_kv: list[KV],
                    ctx_valid_BxS: jax.Array | Sequence[jax.Array]) -> jax.Array:
        """Inference forward of one block per sequence; returns normed hidden [B, K, D].

        Every block query sees the cached context slots with ctx_valid[b, s] (stale slots are ignored,
        whatever they hold) and all K keys of its own block (bidirectional). `ctx_valid_BxS` is one mask for
        every layer, or one per layer (the engine's sliding-window layers read a ring of their own).
        """
        masks = ctx_valid_BxS if isinstance(ctx_valid_BxS, list | tuple) else [ctx_valid_BxS] * len(self.layers)
        visible = [BlockVisibility(jnp.asarray(m).astype(bool)[:, None, :]) for m in masks]
        return self.blocks(block_embeds_BxKxD, block_pos_BxK, ctx_kv, visible)


def restore_drafter(arch: DrafterArch, value: Callable[[tuple[Any, ...], nnx.Param], Any]) -> DFlashDrafter:
    """A drafter of `arch` whose every parameter is `value(path, abstract)` (an array of `abstract.shape`; `path`
    the parameter's keys): the module is built abstractly (`nnx.eval_shape`, no random init, nothing compiled) and
    then filled, which is what a loader wants, instead of initialising weights it overwrites at once. Raises
    ValueError if a variable is left abstract (a state that is not a `Param`)."""
    drafter = nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0)))
    flat = [(keys, variable.replace(value(keys, variable)))
            for keys, variable in nnx.to_flat_state(nnx.state(drafter, nnx.Param))]
    nnx.update(drafter, nnx.from_flat_state(flat))
    left = [keys for keys, v in nnx.to_flat_state(nnx.state(drafter))
            if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise ValueError(f"restore_drafter fills Params only; the drafter holds other state {left[:3]}: build it "
                         "with DFlashDrafter(arch, rngs) and update that instead")
    return drafter


# ----------------------------------------------------------------------------- inputs and outputs


def concat_features(feats_FxBxSxDt: jax.Array) -> jax.Array:
    """Target features [F, B, S, Dt] (as `decoder.forward` returns them) -> [B, S, Df] (Df = F*Dt), id order."""
    f, b, s, d = feats_FxBxSxDt.shape
    return jnp.moveaxis(feats_FxBxSxDt, 0, 2).reshape(b, s, f * d)


def online_features(target_params: Params, target_cfg: DecoderConfig, tokens_BxS: jax.Array,
                    layer_ids: tuple[int, ...]) -> jax.Array:
    """Frozen target features [B, S, Df]: post-layer outputs of `layer_ids`, concatenated in id order.

    Feature j of token s is the output of target decoder layer j (HF hidden_states[j+1]) at s, computed
    causally over the whole sequence. No gradient flows into the target (stop_gradient on params and
    output). A precomputed feature source must return the same array.
    """
    frozen = jax.lax.stop_gradient(target_params)
    _, feats_FxBxSxDt = forward(frozen, target_cfg, tokens_BxS, layer_ids=tuple(layer_ids), with_logits=False)
    return jax.lax.stop_gradient(concat_features(feats_FxBxSxDt))


def block_token_ids(start_tokens_B: jax.Array, block_size: int, mask_token_id: int) -> jax.Array:
    """Block ids [B, K] = [x_start, MASK * (K-1)]."""
    b = start_tokens_B.shape[0]
    masks = jnp.full((b, block_size - 1), mask_token_id, dtype=start_tokens_B.dtype)
    return jnp.concatenate([start_tokens_B[:, None], masks], axis=1)


def draft_head_rows(target_params: Params, target_cfg: DecoderConfig, token_ids: Any) -> jax.Array:
    """The target LM head's rows [V', D] (vocab-major) of `token_ids`: the draft vocabulary's head, gathered
    once (when the engine is built, or the training vocabulary's when a run starts)."""
    ids = jnp.asarray(token_ids, jnp.int32)
    head, vocab_major = head_matrix(target_params, target_cfg)
    return head[ids] if vocab_major else head[:, ids].T


def drafter_logits(target_params: Params, target_cfg: DecoderConfig, hidden_BxQxD: jax.Array) -> jax.Array:
    """Full-vocab logits [B, Q, V] (fp32) from the drafter's normed output through the target's LM head.

    Output at block index k >= 1 predicts the token at start+k; index 0 is discarded.
    """
    return logits_from_normed(target_params, target_cfg, hidden_BxQxD)


# ----------------------------------------------------------------------------- z-lab HF names


def _hf_items(drafter: DFlashDrafter) -> Iterator[tuple[str, jax.Array, bool]]:
    """(z-lab name, value, transposed) per parameter; `kernel` [in, out] becomes `weight` [out, in]."""
    for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        parts = [str(p) for p in path]
        transpose = parts[-1] == "kernel"
        if transpose:
            parts[-1] = "weight"
        yield ".".join(parts), var.get_value(), transpose


def hf_tensor_names(drafter: DFlashDrafter) -> dict[str, tuple[int, ...]]:
    """z-lab tensor name -> PyTorch [out, in] shape, for every drafter parameter (no embed, no lm_head)."""
    return {name: tuple(value.shape[::-1] if t else value.shape) for name, value, t in _hf_items(drafter)}


def to_hf_tensors(drafter: DFlashDrafter) -> dict[str, np.ndarray]:
    """z-lab tensor name -> host array in PyTorch [out, in] layout (the exporter writes these)."""
    return {name: np.asarray(value.T if t else value) for name, value, t in _hf_items(drafter)}


def param_count(drafter: DFlashDrafter) -> int:
    """Total number of trainable drafter parameters."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(drafter, nnx.Param)))
