"""The speculators layout of a DFlash drafter (vllm-project/speculators, `DFlashSpeculatorConfig`; docs/design.md §4.5):
what `vllm serve <dir>` loads as a speculator (the verifier named inside), and what speculators' own
`DFlashDraftModel` reads. `save_speculators` writes `config.json` + `model.safetensors`; `load_speculators`
reads them back, and reads directories written by speculators itself.

config.json, field for field as speculators 0.9.0 writes it (`SCHEMA_VERSION`):
- `speculators_model_type "dflash"`, `architectures ["DFlashSpeculator"]`, `speculators_version`;
- `transformer_layer_config`: the drafter's Qwen3 decoder config (its own layer count, the target's vocab);
  speculators serialises it as a diff against `Qwen3Config()`, so a reader fills missing keys from
  `QWEN3_DEFAULTS`;
- `block_size`, `target_hidden_size`, `mask_token_id`, `draft_vocab_size` (= the target's vocab: no
  draft-vocabulary map, so no t2d/d2t tensors), `sliding_window_non_causal true` (our blocks are bidirectional in
  every layer: speculators reads it for sliding layers only, whose blocks it makes causal without it, its full
  layers being bidirectional anyway; vLLM 0.32 reads it for every layer, `dflash_config.causal = not
  sliding_window_non_causal`, so a false value, speculators' own default for `dflash`, has vLLM run a full-attention
  drafter's blocks causally: docs/export.md), `sample_from_anchor false`;
- `aux_hidden_state_layer_ids`: our layer ids **+ 1**. speculators and vLLM count hidden states with the
  embedding output as index 0, so our id j (the output of decoder layer j, HF `hidden_states[j+1]`) is their
  j + 1 (their converter does the same to z-lab's `target_layer_ids`; vLLM maps them back with - 1);
- `speculators_config`: algorithm `dflash`, one greedy proposal of `block_size - 1` speculative tokens, and
  the verifier entry (`name_or_path`, `architectures`) vLLM starts the target from.

Tensors: the z-lab names (the drafter body is the same module tree). No `embed_tokens` / `lm_head`: vLLM
takes the target's when the drafter ships none; those speculators copies from the verifier are skipped
on import (`VERIFIER_FILLED`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.numpy import save_file

from dflash.models.config import DecoderConfig
from dflash.models.drafter import DFlashDrafter, DrafterArch, DraftVocab
from dflash.models.loading import WeightsError
from dflash.models.zlab import (
    check_import,
    decoder_arch,
    dflash2_fields,
    drafter_from_tensors,
    hf_tensors,
    qwen3_fields,
    read_config,
    read_tensors,
    refuse_retired,
    with_dflash2,
    with_selector,
)

MODEL_TYPE = "dflash"
MODEL_TYPE2 = "dflash2"  # speculators' DFlash2SpeculatorConfig
ARCHITECTURE = "DFlashSpeculator"
ARCHITECTURE2 = "DFlash2DraftModel"
SCHEMA_VERSION = "0.9.0"
VERIFIER_FILLED = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                             "verifier_norm.weight", "t2d", "d2t"})
# Qwen3Config() defaults (transformers 4.57): what speculators leaves out of transformer_layer_config.
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "tie_word_embeddings": False,
}
VERIFIER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def speculators_config(arch: DrafterArch, verifier: str, verifier_architectures: list[str] | None = None,
                       dtype: str = "float32") -> dict[str, Any]:
    """The config.json of a drafter with architecture `arch` for the verifier (target) `verifier` (a Hub id
    or a path); `verifier_architectures` default to the target family's transformers class."""
    if verifier_architectures is None:
        family = VERIFIER_ARCHITECTURES.get(arch.target_family)
        verifier_architectures = [family] if family else []
    layer_config = qwen3_fields(arch, dtype)
    layer_config["architectures"] = ["Qwen3ForCausalLM"]
    dflash2 = arch.variant == "dflash2"
    extra = {**dflash2_fields(arch), "draft_ffn_type": "dense"} if dflash2 else {}
    return {
        "speculators_model_type": MODEL_TYPE2 if dflash2 else MODEL_TYPE,
        "speculators_version": SCHEMA_VERSION,
        "architectures": [ARCHITECTURE2 if dflash2 else ARCHITECTURE],
        **extra,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": arch.target_vocab_size,
        "block_size": arch.block_size,
        "target_hidden_size": arch.hidden_size,
        "aux_hidden_state_layer_ids": [j + 1 for j in arch.layer_ids],
        "mask_token_id": arch.mask_token_id,
        "sliding_window_non_causal": True,  # every layer's blocks are bidirectional (vLLM reads it for all)
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": MODEL_TYPE2 if dflash2 else MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": arch.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def save_speculators(drafter: DFlashDrafter, directory: str | Path, verifier: str,
                     verifier_architectures: list[str] | None = None, dtype: str = "float32") -> Path:
    """Write `config.json` and `model.safetensors` (`dtype`) of `drafter` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(drafter, dtype)
    config = speculators_config(drafter.arch, verifier, verifier_architectures, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if drafter.draft_vocab is not None:
        drafter.draft_vocab.write(directory)
    return directory


def is_speculators(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config


def arch_from_speculators(config: dict[str, Any], where: str, target_family: str,
                          target_num_layers: int) -> DrafterArch:
    """The drafter architecture a speculators config.json describes (the target's family and layer count,
    which the layout does not record, come from the caller)."""
    kind = config.get("speculators_model_type")
    if kind not in (MODEL_TYPE, MODEL_TYPE2):
        raise WeightsError(f"{where}: speculators_model_type must be {MODEL_TYPE!r} or {MODEL_TYPE2!r}; received "
                           f"{kind!r} (not a DFlash speculator)")
    layer = {**QWEN3_DEFAULTS, **(config.get("transformer_layer_config") or {})}
    aux = config.get("aux_hidden_state_layer_ids")
    problems = []
    if not aux:
        problems.append("aux_hidden_state_layer_ids must list the target layers (hidden-state indices, >= 1)")
    elif min(aux) < 1:
        problems.append(f"aux_hidden_state_layer_ids must be >= 1 (index 0 is the embedding output); received {aux}")
    if config.get("mask_token_id") is None:
        problems.append("mask_token_id must be set")
    if config.get("draft_vocab_size") not in (None, layer["vocab_size"]):
        problems.append(f"draft_vocab_size must equal transformer_layer_config.vocab_size {layer['vocab_size']} "
                        f"(a reduced draft vocabulary with t2d/d2t maps is not supported); received "
                        f"{config.get('draft_vocab_size')}")
    if config.get("sample_from_anchor"):
        problems.append("sample_from_anchor must be false (the anchor is the bonus token; K-1 drafts)")
    hidden = config.get("target_hidden_size")
    if hidden is not None and hidden != layer["hidden_size"]:
        problems.append(f"target_hidden_size {hidden} must equal the drafter's hidden_size {layer['hidden_size']}")
    if problems:
        raise WeightsError(f"{where}: " + "; ".join(problems))
    # DFlash2SpeculatorConfig defaults sliding_window_non_causal to true, DFlashSpeculatorConfig to false
    causal = None
    if not config.get("sliding_window_non_causal", kind == MODEL_TYPE2):
        causal = (f"sliding_window_non_causal must be true for sliding_attention layers; received "
                  f"{config.get('sliding_window_non_causal')!r} (speculators then runs those layers' blocks "
                  "causally; these blocks are bidirectional)")
    arch = decoder_arch(layer, layer_ids=tuple(int(a) - 1 for a in aux), block_size=config.get("block_size", 8),
                        mask_token_id=config["mask_token_id"], target_family=target_family,
                        target_num_layers=target_num_layers, where=where, causal_blocks=causal)
    if kind != MODEL_TYPE2:
        return arch
    # DFlash2SpeculatorConfig's defaults for the fields a config leaves out (its to_diff_dict drops them)
    return with_dflash2(arch, {"conv_kernel_size": 2, "conv_group_size": 16, **config}, where)


def load_speculators(directory: str | Path, target_cfg: DecoderConfig,
                     expect: DrafterArch | None = None) -> DFlashDrafter:
    """A drafter from a speculators layout directory, checked against `target_cfg` (and `expect`)."""
    directory = Path(directory).expanduser()
    config = read_config(directory)
    refuse_retired(directory)
    arch = arch_from_speculators(config, str(directory / "config.json"), target_cfg.family, target_cfg.num_layers)
    tensors = read_tensors(directory)
    arch, skip = with_selector(arch, config, tensors, str(directory))
    check_import(arch, target_cfg, str(directory), expect)
    drafter = drafter_from_tensors(arch, tensors, str(directory), ignored=VERIFIER_FILLED | skip)
    drafter.draft_vocab = DraftVocab.read(directory, target_cfg.vocab_size)
    return drafter


__all__ = ["ARCHITECTURE", "ARCHITECTURE2", "MODEL_TYPE", "MODEL_TYPE2", "QWEN3_DEFAULTS", "SCHEMA_VERSION",
           "VERIFIER_FILLED", "arch_from_speculators", "is_speculators", "load_speculators", "save_speculators",
           "speculators_config"]
