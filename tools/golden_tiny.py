"""Generate tiny random-weight Hugging Face golden references for the decoder model tests.

Run (from the repository root):

    /tmp/goldenv/bin/python tools/golden_tiny.py --out tests/golden/tiny

This script needs ``torch`` and ``transformers`` (plus ``safetensors`` and ``numpy``); they are needed
ONLY to run this script. Its outputs (``<name>/config.json``, ``<name>/model.safetensors``,
``<name>/reference.npz`` and ``MANIFEST.json``) are committed to the repository and consumed by the
tests, which do not import torch or transformers.

For every config in ``CASES`` it builds a tiny Llama / Qwen2 / Qwen3 model in float32 with the eager
attention implementation, re-initialises every weight from a per-config seed, perturbs all RMSNorm
weights and all biases (so an implementation that ignores them cannot match), saves it with
``save_pretrained(..., safe_serialization=True)`` and records reference activations:

- ``input_ids`` int32 [2, 40] and ``logits`` float32 [2, 40, V] (no attention mask, positions 0..39);
- ``layer_outputs`` float32 [L, 2, 40, D]: the raw output of ``model.model.layers[j]`` (forward hook);
- ``hf_hidden_states`` float32 [L+1, 2, 40, D]: ``output_hidden_states=True`` (last entry is normed);
- ``input_ids_long`` int32 [1, 160] and ``logits_long`` float32 [1, 160, V].
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

BATCH = 2
SEQ_LEN = 40
LONG_SEQ_LEN = 160
WEIGHT_STD = 0.1
EMBED_STD = 0.25
NORM_JITTER = 0.1
BIAS_STD = 0.1

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "initializer_range": WEIGHT_STD,
}

LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class Case:
    """One tiny model to generate."""

    name: str
    config_cls: type[PretrainedConfig]
    model_cls: type[PreTrainedModel]
    overrides: dict[str, Any] = field(default_factory=dict)


CASES: tuple[Case, ...] = (
    Case("llama_tied", LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": True}),
    Case(
        "llama3_scaled_untied",
        LlamaConfig,
        LlamaForCausalLM,
        {"tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE},
    ),
    Case("qwen2_bias_untied", Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    Case("qwen2_tied", Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    Case("qwen3_qknorm_tied", Qwen3Config, Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 32}),
    Case(
        "qwen3_untied",
        Qwen3Config,
        Qwen3ForCausalLM,
        {"tie_word_embeddings": False, "attention_bias": False},
    ),
)


def build_config(case: Case) -> PretrainedConfig:
    """Instantiate the HF config for a case (float32, eager attention, no sliding window)."""
    kwargs: dict[str, Any] = {**COMMON, **case.overrides}
    if case.config_cls is not LlamaConfig:
        kwargs["use_sliding_window"] = False
    config = case.config_cls(**kwargs, attn_implementation="eager")
    config.dtype = "float32"
    return config


def init_weights(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Re-initialise every parameter from ``generator``, independently of HF's init scheme.

    The token embedding (also the lm_head when tied) gets ``EMBED_STD`` noise, other matrices ``WEIGHT_STD``,
    RMSNorm weights ``1 + NORM_JITTER * randn`` and biases ``BIAS_STD * randn``. Tied parameters are
    visited once because ``named_parameters`` de-duplicates shared tensors.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("bias"):
                param.copy_(BIAS_STD * noise)
            elif "norm" in name.split(".")[-2]:
                param.copy_(1.0 + NORM_JITTER * noise)
            elif "embed_tokens" in name:
                param.copy_(EMBED_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)


def check_norms_and_biases(model: PreTrainedModel) -> None:
    """Assert every RMSNorm weight and every bias was perturbed away from its trivial value."""
    n_norm = 0
    for module_name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            assert not torch.allclose(module.weight, torch.ones_like(module.weight)), module_name
            n_norm += 1
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert not torch.allclose(param, torch.zeros_like(param)), name
    assert n_norm > 0


def build_model(case: Case, seed: int) -> PreTrainedModel:
    """Build, seed-initialise and perturb the model for ``case``."""
    torch.manual_seed(seed)
    model = case.model_cls(build_config(case)).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    init_weights(model, generator)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    check_norms_and_biases(model)
    return model


def layer_output_tensor(output: Any) -> torch.Tensor:
    """Extract the hidden-state tensor from a decoder layer's forward output (tensor or tuple)."""
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def run_with_hooks(model: PreTrainedModel, input_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Forward ``input_ids``; return logits, raw per-layer outputs and HF hidden states."""
    captured: list[torch.Tensor] = []

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        captured.append(layer_output_tensor(output).detach().clone())

    layers = model.model.layers
    handles = [layer.register_forward_hook(hook) for layer in layers]
    try:
        out = model(input_ids=torch.from_numpy(input_ids).long(), output_hidden_states=True, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    assert len(captured) == len(layers)
    return {
        "logits": out.logits.float().numpy(),
        "layer_outputs": torch.stack(captured).float().numpy(),
        "hf_hidden_states": torch.stack(out.hidden_states).float().numpy(),
    }


@torch.no_grad()
def run_logits(model: PreTrainedModel, input_ids: np.ndarray) -> np.ndarray:
    """Forward ``input_ids`` without a mask and return float32 logits."""
    return model(input_ids=torch.from_numpy(input_ids).long(), use_cache=False).logits.float().numpy()


@torch.no_grad()
def check_hidden_states(model: PreTrainedModel, layer_outputs: np.ndarray, hidden: np.ndarray) -> None:
    """hf_hidden_states[j+1] must equal layer_outputs[j] for j < L-1; the last entry is the normed output."""
    n_layers = layer_outputs.shape[0]
    assert hidden.shape[0] == n_layers + 1
    for j in range(n_layers - 1):
        np.testing.assert_array_equal(hidden[j + 1], layer_outputs[j])
    normed = model.model.norm(torch.from_numpy(layer_outputs[-1])).numpy()
    np.testing.assert_allclose(hidden[-1], normed, rtol=1e-5, atol=1e-5)


def check_logits(logits: np.ndarray, name: str) -> None:
    """Guard against degenerate (near-constant or non-finite) logits."""
    assert np.isfinite(logits).all(), name
    per_row_std = logits.std(axis=-1)
    assert per_row_std.min() > 0.3, (name, float(per_row_std.min()))


def make_reference(model: PreTrainedModel, seed: int) -> dict[str, np.ndarray]:
    """Build all reference arrays for one model."""
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, vocab, size=(BATCH, SEQ_LEN), dtype=np.int32)
    input_ids_long = rng.integers(0, vocab, size=(1, LONG_SEQ_LEN), dtype=np.int32)
    ref = run_with_hooks(model, input_ids)
    check_hidden_states(model, ref["layer_outputs"], ref["hf_hidden_states"])
    logits_long = run_logits(model, input_ids_long)
    # Causality sanity check: the prefix of a longer sequence must give the same logits.
    np.testing.assert_allclose(
        run_logits(model, input_ids_long[:, :SEQ_LEN]), logits_long[:, :SEQ_LEN], rtol=1e-4, atol=1e-4
    )
    check_logits(ref["logits"], "logits")
    check_logits(logits_long, "logits_long")
    return {
        "input_ids": input_ids,
        "logits": ref["logits"].astype(np.float32),
        "layer_outputs": ref["layer_outputs"].astype(np.float32),
        "hf_hidden_states": ref["hf_hidden_states"].astype(np.float32),
        "input_ids_long": input_ids_long,
        "logits_long": logits_long.astype(np.float32),
    }


def check_llama3_scaling_matters(model: PreTrainedModel) -> None:
    """Assert the llama3 rope scaling actually changes some (but not all) inverse frequencies."""
    cfg = model.config
    rope = cfg.rope_parameters
    head_dim = int(cfg.head_dim)
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scaled = model.model.rotary_emb.inv_freq.float().cpu()
    changed = ~torch.isclose(plain, scaled, rtol=1e-6, atol=0.0)
    assert changed.any() and not changed.all(), (plain, scaled)


@torch.no_grad()
def check_reload(case: Case, case_dir: Path, input_ids: np.ndarray, logits: np.ndarray) -> None:
    """Reload the saved checkpoint with ``from_pretrained`` and check it reproduces ``logits`` exactly."""
    reloaded = case.model_cls.from_pretrained(
        case_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(run_logits(reloaded, input_ids), logits)


def generate_case(case: Case, seed: int, out_dir: Path) -> dict[str, Any]:
    """Generate one case directory and return its manifest entry."""
    model = build_model(case, seed)
    if case.overrides.get("rope_parameters", {}).get("rope_type") == "llama3":
        check_llama3_scaling_matters(model)
    case_dir = out_dir / case.name
    case_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(case_dir, safe_serialization=True)
    ref = make_reference(model, seed)
    np.savez_compressed(case_dir / "reference.npz", **ref)
    check_reload(case, case_dir, ref["input_ids_long"], ref["logits_long"])
    saved = json.loads((case_dir / "config.json").read_text())
    return {
        "name": case.name,
        "seed": seed,
        "model_type": saved["model_type"],
        "architecture": case.model_cls.__name__,
        "tie_word_embeddings": bool(saved["tie_word_embeddings"]),
        "reference_keys": {k: [str(v.dtype), list(v.shape)] for k, v in ref.items()},
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory, e.g. tests/golden/tiny")
    parser.add_argument("--seed", type=int, default=1234, help="base seed; case i uses seed + i")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    args.out.mkdir(parents=True, exist_ok=True)
    entries = [generate_case(case, args.seed + i, args.out) for i, case in enumerate(CASES)]
    manifest = {
        "generator": "tools/golden_tiny.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "seed": args.seed,
        "names": [e["name"] for e in entries],
        "cases": entries,
    }
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for entry in entries:
        print(f"wrote {args.out / entry['name']} (seed {entry['seed']})")


if __name__ == "__main__":
    main()
