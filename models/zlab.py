"""The z-lab Hugging Face layout of a DFlash drafter (DESIGN §4.5): what vLLM `method: dflash` and SGLang
`DFLASH` load. `save_zlab` writes `config.json` + `model.safetensors`; `load_zlab` reads them back.

config.json: `architectures ["DFlashDraftModel"]`, `model_type` = the target family, `block_size`,
`num_target_layers`, `dflash_config {mask_token_id, target_layer_ids}` (our layer ids: id j = output of
decoder layer j = HF hidden_states[j+1]), and the decoder fields of the drafter. Tensors: the names of
`models.drafter.hf_tensor_names`, PyTorch [out, in], no `model.` prefix, no embedding, no LM head.
The remote-code `auto_map` and the modelling file are the exporter's (`dflash-export`) business.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.config import DecoderConfig
from models.drafter import DFlashDrafter, DrafterArch, check_fits_target, to_hf_tensors
from models.loading import WeightsError, _rope_scaling_from_hf

ARCHITECTURE = "DFlashDraftModel"


def zlab_config(arch: DrafterArch) -> dict[str, Any]:
    """The config.json of a drafter with architecture `arch`."""
    scaling = arch.rope_scaling
    if scaling is None:
        rope_scaling = None
    elif scaling.kind == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                        "high_freq_factor": scaling.high_freq_factor,
                        "original_max_position_embeddings": scaling.original_max_position_embeddings}
    elif scaling.kind == "linear":
        rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
    else:
        raise WeightsError(f"rope scaling kind {scaling.kind!r} (GGUF per-frequency factors) has no Hugging Face "
                           "config form; export a drafter of a target loaded from a Hugging Face directory")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": arch.target_family,
        "block_size": arch.block_size,
        "num_target_layers": arch.target_num_layers,
        "dflash_config": {"mask_token_id": arch.mask_token_id, "target_layer_ids": list(arch.layer_ids)},
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "layer_types": ["full_attention"] * arch.num_layers,
        "torch_dtype": "float32",
    }


def save_zlab(drafter: DFlashDrafter, directory: str | Path) -> Path:
    """Write `config.json` and `model.safetensors` (fp32) of `drafter` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(zlab_config(drafter.arch), indent=2) + "\n")
    tensors = {name: np.ascontiguousarray(value, np.float32) for name, value in to_hf_tensors(drafter).items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def arch_from_zlab(config: dict[str, Any], where: str) -> DrafterArch:
    """The drafter architecture a z-lab config.json describes."""
    if ARCHITECTURE not in config.get("architectures", []):
        raise WeightsError(f"{where}: architectures must include {ARCHITECTURE!r}; received "
                           f"{config.get('architectures')!r} (not a DFlash drafter)")
    try:
        dflash = config["dflash_config"]
        ids = tuple(int(i) for i in dflash["target_layer_ids"])
        return DrafterArch(
            hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
            num_features=len(ids), layer_ids=ids, block_size=int(config["block_size"]),
            mask_token_id=int(dflash["mask_token_id"]), num_heads=int(config["num_attention_heads"]),
            num_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]), rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=float(config["rope_theta"]),
            rope_scaling=_rope_scaling_from_hf(config.get("rope_scaling") or {}, where),
            max_position_embeddings=int(config["max_position_embeddings"]), target_family=str(config["model_type"]),
            target_vocab_size=int(config["vocab_size"]), target_num_layers=int(config["num_target_layers"]),
        )
    except KeyError as err:
        raise WeightsError(f"{where}: a DFlash drafter config must have {err.args[0]!r}") from err


def load_zlab(directory: str | Path, target_cfg: DecoderConfig) -> DFlashDrafter:
    """A drafter from a z-lab layout directory; the tensor set must match the config exactly."""
    directory = Path(directory).expanduser()
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; a z-lab drafter directory holds config.json and "
                                    "model.safetensors")
    arch = arch_from_zlab(json.loads(config_path.read_text()), str(config_path))
    check_fits_target(arch, target_cfg, str(directory))
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    tensors = load_file(str(weights_path))
    flat, expected = [], set()
    for keys, variable in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        parts = [str(k) for k in keys]
        transpose = parts[-1] == "kernel"
        name = ".".join(parts[:-1] + ["weight"]) if transpose else ".".join(parts)
        expected.add(name)
        if name not in tensors:
            raise WeightsError(f"{weights_path}: tensor {name!r} is missing")
        value = tensors[name].T if transpose else tensors[name]
        if tuple(value.shape) != tuple(variable.shape):
            raise WeightsError(f"{weights_path}: tensor {name!r} has shape {tuple(tensors[name].shape)}; the config "
                               f"implies {tuple(variable.shape[::-1] if transpose else variable.shape)}")
        flat.append((keys, variable.replace(jnp.asarray(value, jnp.float32))))
    extra = sorted(set(tensors) - expected)
    if extra:
        raise WeightsError(f"{weights_path}: unexpected tensors {extra[:5]} (not part of this drafter's config)")
    nnx.update(drafter, nnx.from_flat_state(flat))
    return drafter


__all__ = ["ARCHITECTURE", "arch_from_zlab", "load_zlab", "save_zlab", "zlab_config"]
