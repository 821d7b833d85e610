"""Generate tiny random-weight Hugging Face golden references for the newer target families (issue 52).

Run (from the repository root), in a Python 3.11 venv with torch (the CPU wheel) and transformers:

    python3.11 -m venv /tmp/goldenv
    /tmp/goldenv/bin/pip install torch numpy safetensors transformers==5.24.0
    /tmp/goldenv/bin/python tools/golden_families.py --out tests/golden/tiny

Pinned: transformers 5.24.0 (it has Mistral, Gemma 3 text, Qwen3-MoE and gpt-oss; `tools/golden_tiny.py`'s families
were made with it too). torch is only the reference's runtime. The tests read the outputs without torch.

Each case is written like `tools/golden_tiny.py`'s (``config.json``, ``model.safetensors``, ``reference.npz``) into
``<out>/<name>/`` so `tests/test_decoder_parity.py` picks it up, plus a greedy reference, and the cases are listed
in ``<out>/MANIFEST_families.json``:

- ``input_ids`` [2, 40], ``logits`` [2, 40, V], ``layer_outputs`` [L, 2, 40, D], ``hf_hidden_states`` [L+1, 2, 40, D],
  ``input_ids_long`` [1, 160], ``logits_long`` [1, 160, V] (as `tools/golden_tiny.py`);
- ``greedy_prompt`` int32 [12] and ``greedy_tokens`` int32 [28]: transformers' ``generate`` (greedy, its own KV cache,
  sliding-window layers included) from that prompt, checked here against a full forward per token;
- gpt-oss only: ``mxfp4/experts.safetensors`` (its experts quantised to MXFP4 as the released checkpoints store
  them) and ``mxfp4/reference.npz`` (transformers' dequantisation of them and the logits of ``input_ids`` with those
  weights).

The windows (``sliding_window`` 16) are shorter than the 40- and 160-token inputs and than prompt + greedy tokens, so a
decoder that treats a local layer as global cannot match.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_tiny import COMMON, Case, check_reload, init_weights, make_reference  # noqa: E402

GREEDY_PROMPT = 12
GREEDY_NEW = 28
WINDOW = 16

CASES: tuple[Case, ...] = (
    Case("mistral_untied", MistralConfig, MistralForCausalLM, {"tie_word_embeddings": False, "sliding_window": None}),
    Case("mistral_window", MistralConfig, MistralForCausalLM, {"tie_word_embeddings": True, "sliding_window": WINDOW}),
    Case(
        "gemma3_text",
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "tie_word_embeddings": True,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,  # != head_dim 16: the attention scale is its own field
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
    Case(
        "qwen3_moe",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    Case(
        "qwen3_moe_unnormed_tied",
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"tie_word_embeddings": True, "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
         "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    Case(
        "gpt_oss",
        GptOssConfig,
        GptOssForCausalLM,
        {"tie_word_embeddings": False, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
         "sliding_window": 8, "swiglu_limit": 0.6,  # small enough that the clamp acts on these weights
         "layer_types": ["sliding_attention", "full_attention"] * 2,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}},
    ),
)


def build_config(case: Case) -> Any:
    kwargs: dict[str, Any] = {**COMMON, **case.overrides}
    config = case.config_cls(**kwargs, attn_implementation="eager")
    config.dtype = "float32"
    return config


def build_model(case: Case, seed: int) -> Any:
    torch.manual_seed(seed)
    model = case.model_cls(build_config(case)).to(torch.float32).eval()
    init_weights(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # gpt-oss's attention sinks: logits of the order of the scores, so that they matter
        generator = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn(param.shape, generator=generator) + 1.0)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == bool(model.config.tie_word_embeddings)
    return model


@torch.no_grad()
def greedy_reference(model: Any, seed: int) -> dict[str, np.ndarray]:
    """transformers' greedy `generate` (its KV cache, windows included), checked against a full forward per token."""
    prompt = np.random.default_rng(seed + 7).integers(0, model.config.vocab_size, size=GREEDY_PROMPT, dtype=np.int32)
    ids = torch.from_numpy(prompt).long()[None]
    out = model.generate(ids, max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW, do_sample=False,
                         attention_mask=torch.ones_like(ids), pad_token_id=0)
    tokens = out[0, GREEDY_PROMPT:].numpy().astype(np.int32)
    seq = ids
    for _ in range(GREEDY_NEW):  # the same tokens without a cache
        logits = model(input_ids=seq, use_cache=False).logits[0, -1]
        seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
    np.testing.assert_array_equal(seq[0, GREEDY_PROMPT:].numpy(), tokens)
    assert len(set(tokens.tolist())) >= 2, tokens  # not one token repeated
    return {"greedy_prompt": prompt, "greedy_tokens": tokens}


FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def quantize_mxfp4(w_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., N] fp32 rows -> (blocks uint8 [..., N/32, 16], scales uint8 [..., N/32]): per group of 32 a power-of-two
    scale (exponent + 127) so the largest value is at most 6, each value the nearest e2m1 code, two a byte (low
    nibble first), as the released gpt-oss checkpoints store their experts."""
    groups = w_rows.reshape(*w_rows.shape[:-1], -1, 32)
    peak = np.maximum(np.abs(groups).max(axis=-1), 1e-30)
    exponent = np.ceil(np.log2(peak / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4[:8]).argmin(axis=-1) + 8 * (scaled < 0)
    codes = codes.astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + 127).astype(np.uint8)


@torch.no_grad()
def mxfp4_reference(model: Any, case_dir: Path, input_ids: np.ndarray) -> None:
    """gpt-oss's experts as MXFP4 (`mxfp4/experts.safetensors`: every layer's `_blocks` / `_scales`) and
    transformers' dequantisation of them (`convert_moe_packed_tensors`) with the logits of the model holding those
    weights (`mxfp4/reference.npz`)."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed, gate_up, down = {}, [], []
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            rows = getattr(experts, name).detach().numpy().transpose(0, 2, 1)  # [E, out, in]
            blocks, scales = quantize_mxfp4(np.ascontiguousarray(rows))
            packed[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
            deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            getattr(experts, name).copy_(deq)
            (gate_up if name == "gate_up_proj" else down).append(deq.numpy())
    (case_dir / "mxfp4").mkdir(exist_ok=True)  # beside, not among, the model's own safetensors
    save_file(packed, str(case_dir / "mxfp4" / "experts.safetensors"))
    logits = model(input_ids=torch.from_numpy(input_ids).long(), use_cache=False).logits.float().numpy()
    np.savez_compressed(case_dir / "mxfp4" / "reference.npz", gate_up=np.stack(gate_up), down=np.stack(down),
                        logits=logits)


def generate_case(case: Case, seed: int, out_dir: Path) -> dict[str, Any]:
    model = build_model(case, seed)
    case_dir = out_dir / case.name
    case_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(case_dir, safe_serialization=True)
    ref = make_reference(model, seed)
    ref.update(greedy_reference(model, seed))
    np.savez_compressed(case_dir / "reference.npz", **ref)
    check_reload(case, case_dir, ref["input_ids_long"], ref["logits_long"])
    if case.config_cls is GptOssConfig:
        mxfp4_reference(model, case_dir, ref["input_ids"])  # last: it overwrites the model's expert weights
    saved = json.loads((case_dir / "config.json").read_text())
    return {"name": case.name, "seed": seed, "model_type": saved["model_type"],
            "architecture": case.model_cls.__name__, "tie_word_embeddings": bool(saved["tie_word_embeddings"]),
            "reference_keys": {k: [str(v.dtype), list(v.shape)] for k, v in ref.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. tests/golden/tiny")
    parser.add_argument("--seed", type=int, default=5200, help="base seed; case i uses seed + i")
    parser.add_argument("--only", nargs="*", default=None, help="case names to (re)generate (default: all)")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / "MANIFEST_families.json"
    old = json.loads(manifest_path.read_text())["cases"] if manifest_path.is_file() else []
    entries = {e["name"]: e for e in old}
    for i, case in enumerate(CASES):
        if args.only is None or case.name in args.only:
            entries[case.name] = generate_case(case, args.seed + i, args.out)
            print(f"wrote {args.out / case.name} (seed {args.seed + i})")
    manifest = {"generator": "tools/golden_families.py", "transformers_version": transformers.__version__,
                "torch_version": torch.__version__, "numpy_version": np.__version__, "seed": args.seed,
                "names": [c.name for c in CASES if c.name in entries],
                "cases": [entries[c.name] for c in CASES if c.name in entries]}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    main()
