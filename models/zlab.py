"""The z-lab Hugging Face layout of a DFlash drafter (docs/design.md §4.5): what vLLM `method: dflash`, SGLang
`DFLASH` and z-lab's own `DFlashDraftModel` load. `save_zlab` writes `config.json` + `model.safetensors`;
`load_zlab` reads them back (and reads z-lab's released drafters).

config.json: `architectures ["DFlashDraftModel"]`, `auto_map` (remote code: a `dflash.py` modelling file
beside the weights, see `export/`), `model_type "qwen3"` (the drafter's layers are Qwen3-style whatever
the target's family), `block_size`, `num_target_layers`, `dflash_config {mask_token_id, target_layer_ids}`
and the Qwen3 decoder fields of the drafter, with RoPE both as `rope_theta` + `rope_scaling` (transformers
4.x and the released configs) and as `rope_parameters` (transformers >= 5).

Layer ids: id j is the output of target decoder layer j (0-based), which Hugging Face calls
`hidden_states[j + 1]` (index 0 is the embedding output); z-lab's `extract_context_feature` reads exactly
`hidden_states[j + 1]`. The last layer (j = L-1) is refused on export and warned about on import: HF's
`hidden_states[L]` is taken after the final norm, our feature j = L-1 before it (`check_exportable_ids`).

Tensors: the names of `models.drafter.hf_tensor_names`, PyTorch [out, in], no `model.` prefix, no
embedding, no LM head; float32 or bfloat16.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from dflash.models.config import DecoderConfig
from dflash.models.drafter import DFlashDrafter, DrafterArch, DraftVocab, restore_drafter, to_hf_tensors
from dflash.models.loading import WeightsError, _rope_scaling_from_hf, _safetensors_files

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"  # z-lab's DFlash2 (the convolutions and the candidate selector)
MODELING_FILE = "dflash.py"
AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}
AUTO_MAP2 = {"AutoModel": "dflash.DFlash2DraftModel"}
# DFlash2's candidate selector (top-k unary candidates re-ranked by a rank-r edge score from the previous slot's
# choice): the layout's default shapes. A drafter with `drafter.selector` exports its own; one without exports a zero
# selector of these shapes, under which the reference's walk picks each slot's top unary candidate (its argmax).
SELECTOR_RANK = 256
SELECTOR_TOP_K = 16
SELECTOR_PREFIX = "candidate_selector."
PUBLISHED_CONV_KERNEL = 2
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def json_float(value: float) -> float:
    """`value` as config.json should show it: a float32 number (a GGUF's 1e-5 read as 9.999999747378752e-06)
    becomes the shortest decimal that rounds to the same float32 (1e-05); any other float is kept."""
    value = float(value)
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


def hf_rope(arch: DrafterArch) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(rope_scaling for transformers 4.x or None, rope_parameters for transformers >= 5) of `arch`."""
    scaling = arch.rope_scaling
    theta = json_float(arch.rope_theta)
    if scaling is None:
        return None, {"rope_type": "default", "rope_theta": theta}
    if scaling.kind == "llama3":
        fields = {"rope_type": "llama3", "factor": json_float(scaling.factor),
                  "low_freq_factor": json_float(scaling.low_freq_factor),
                  "high_freq_factor": json_float(scaling.high_freq_factor),
                  "original_max_position_embeddings": scaling.original_max_position_embeddings}
    elif scaling.kind == "linear":
        fields = {"rope_type": "linear", "factor": json_float(scaling.factor)}
    elif scaling.kind == "yarn":  # a gpt-oss target's RoPE, which the drafter follows
        fields = {"rope_type": "yarn", "factor": json_float(scaling.factor),
                  "original_max_position_embeddings": scaling.original_max_position_embeddings,
                  "beta_fast": json_float(scaling.beta_fast), "beta_slow": json_float(scaling.beta_slow),
                  "truncate": scaling.truncate, "attention_factor": scaling.attention_factor}
    else:
        raise WeightsError(f"rope scaling kind {scaling.kind!r} (GGUF per-frequency factors) has no Hugging Face "
                           "config form; export a drafter of a target loaded from a Hugging Face directory")
    return fields, {**fields, "rope_theta": theta}


def check_exportable_ids(arch: DrafterArch, where: str = "the drafter") -> None:
    """Refuse a layer id equal to the target's last layer (ValueError): Hugging Face's hidden_states[L] (what
    z-lab, vLLM and SGLang would feed for id L-1) is taken after the target's final norm, while our feature
    of id L-1 is the layer's output before it, so the exported drafter would see other features."""
    last = arch.target_num_layers - 1
    if last in arch.layer_ids:
        raise ValueError(
            f"layer_ids must not include {last}, the target's last layer ({arch.target_num_layers} layers), in "
            f"{where}; received {tuple(arch.layer_ids)}. Hugging Face's hidden_states[{last + 1}] (what vLLM, "
            f"SGLang and z-lab feed for id {last}) is taken after the final norm, our id {last} before it: served "
            f"elsewhere this drafter would see other features. Train with ids below {last} (the default ids "
            "stop at L-3).")


def qwen3_fields(arch: DrafterArch, dtype: str = "float32") -> dict[str, Any]:
    """The Qwen3 decoder fields of the drafter (its own layer count; the target's vocab), as config.json
    keys: shared by the z-lab config and the speculators `transformer_layer_config`."""
    rope_scaling, rope_parameters = hf_rope(arch)
    return {
        "model_type": "qwen3",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": json_float(arch.rms_norm_eps),
        "rope_theta": json_float(arch.rope_theta),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.target_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": arch.num_sliding > 0,
        "sliding_window": arch.sliding_window or None,
        "max_window_layers": arch.num_layers,
        "layer_types": list(arch.layer_types) or ["full_attention"] * arch.num_layers,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def zlab_config(arch: DrafterArch, dtype: str = "float32") -> dict[str, Any]:
    """The config.json of a drafter with architecture `arch` whose tensors are stored as `dtype`. A drafter
    with sliding-window layers also says `is_causal false` (the reference would run those layers' blocks
    causally without it)."""
    sliding = {"is_causal": False} if arch.num_sliding else {}
    dflash: dict[str, Any] = {"mask_token_id": arch.mask_token_id, "target_layer_ids": list(arch.layer_ids)}
    if arch.variant == "dflash2":
        dflash.update(dflash2_fields(arch))
    return {
        "architectures": [ARCHITECTURE2 if arch.variant == "dflash2" else ARCHITECTURE],
        "auto_map": dict(AUTO_MAP2 if arch.variant == "dflash2" else AUTO_MAP),
        "block_size": arch.block_size,
        "num_target_layers": arch.target_num_layers,
        "dflash_config": dflash,
        **sliding,
        **qwen3_fields(arch, dtype),
    }


def dflash2_fields(arch: DrafterArch) -> dict[str, Any]:
    """The DFlash2 fields z-lab's `dflash_config` and speculators' `DFlash2SpeculatorConfig` share: block size,
    convolution taps and group size (the published 2 for a drafter trained with `drafter.conv` off, exported as
    identity convolutions), and the selector's rank and top-k (the drafter's, else `SELECTOR_RANK` / `SELECTOR_TOP_K`
    of the zero selector)."""
    return {"block_size": arch.block_size, "conv_kernel_size": arch.conv_kernel_size or PUBLISHED_CONV_KERNEL,
            "conv_group_size": arch.conv_group_size, "selector_rank": arch.selector_rank or SELECTOR_RANK,
            "selector_top_k": arch.selector_top_k if arch.selector_rank else SELECTOR_TOP_K}


def dflash2_extra_tensors(arch: DrafterArch) -> dict[str, np.ndarray]:
    """The DFlash2 layout's tensors a drafter of `arch` does not hold, float32 [out, in]: identity convolutions
    when it was trained with `drafter.conv` off, and the zero candidate selector when it has none (SELECTOR_RANK)."""
    if arch.variant != "dflash2":
        return {}
    d, v, r = arch.hidden_size, arch.target_vocab_size, SELECTOR_RANK
    extra = {} if arch.selector_rank else {SELECTOR_PREFIX + "hidden_projection.weight": np.zeros((r, d), np.float32),
                                           SELECTOR_PREFIX + "predecessor_codebook": np.zeros((v, r), np.float32),
                                           SELECTOR_PREFIX + "successor_codebook": np.zeros((v, r), np.float32)}
    if arch.conv_kernel_size == 0:
        t, groups = PUBLISHED_CONV_KERNEL, d // arch.conv_group_size
        base = np.zeros((2, t, d), np.float32)
        base[:, 0] = 1.0
        for i in range(arch.num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                extra[f"layers.{i}.{conv}.base_kernel"] = base
                extra[f"layers.{i}.{conv}.kernel_projection.weight"] = np.zeros((2 * t * groups, d), np.float32)
    return extra


def hf_tensors(drafter: DFlashDrafter, dtype: str = "float32") -> dict[str, np.ndarray]:
    """The drafter's tensors by z-lab name, PyTorch [out, in], contiguous, cast to `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}; received {dtype!r}")
    tensors = {**to_hf_tensors(drafter), **dflash2_extra_tensors(drafter.arch)}
    return {name: np.ascontiguousarray(np.asarray(value, np.float32).astype(DTYPES[dtype]))
            for name, value in tensors.items()}


RETIRED_MARKOV_DIR = "markov_head"  # where our retired Markov head was exported (docs/retired.md)


def refuse_retired(directory: Path) -> None:
    """WeightsError when `directory` holds an export of a retired option (a `markov_head/` beside the layout):
    this trainer would load it without the head it was trained with."""
    if (directory / RETIRED_MARKOV_DIR).exists():
        raise WeightsError(f"{directory} holds a Markov head ({RETIRED_MARKOV_DIR}/), an option retired from this "
                           "trainer (docs/retired.md): load it with the code at git tag arch3-retired-options, or "
                           f"remove {RETIRED_MARKOV_DIR}/ to use the drafter without its head")


def save_zlab(drafter: DFlashDrafter, directory: str | Path, dtype: str = "float32") -> Path:
    """Write `config.json` and `model.safetensors` (`dtype`: float32 or bfloat16) of `drafter` into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(drafter, dtype)
    (directory / "config.json").write_text(json.dumps(zlab_config(drafter.arch, dtype), indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if drafter.draft_vocab is not None:  # our side file: loaders that do not know it propose over the full head
        drafter.draft_vocab.write(directory)
    return directory


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face weights directory (model.safetensors, or the shards of its index)."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(directory):
        tensors.update(load_file(str(path)))
    return tensors


def read_config(directory: Path) -> dict[str, Any]:
    """config.json of a drafter directory; FileNotFoundError naming what a drafter directory holds."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a drafter directory holds config.json and "
                                "model.safetensors (z-lab or speculators layout)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise WeightsError(f"{path} is not valid JSON ({err}); the export is corrupt: export it again") from err


def sliding_layers(fields: dict[str, Any], block_size: int, causal_blocks: str | None,
                   where: str) -> tuple[tuple[str, ...], int]:
    """(layer_types, sliding_window) of Qwen3 decoder fields as transformers' Qwen3Config and the reference read
    them: `sliding_window` counts only with `use_sliding_window` true (Qwen3Config drops it otherwise), and
    `layer_types`, when absent, makes the layers from index `max_window_layers` on sliding when a window is set.
    `causal_blocks` names the config field that would make the sliding layers' blocks causal (the reference runs
    a sliding layer causally unless `is_causal` is false; speculators unless `sliding_window_non_causal`), or
    None when the blocks are bidirectional. Every problem is named in one WeightsError; returns
    ((), 0) for an all-full drafter."""
    layers = int(fields.get("num_hidden_layers") or 0)
    window = fields.get("sliding_window") if fields.get("use_sliding_window") else None
    kinds = fields.get("layer_types")
    if kinds is None:
        first = int(fields.get("max_window_layers") or 0)
        kinds = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    kinds = tuple(str(k) for k in kinds)
    problems = [f"layer_types[{i}] must be 'full_attention' or 'sliding_attention'; received {k!r}"
                for i, k in enumerate(kinds) if k not in ("full_attention", "sliding_attention")]
    if len(kinds) != layers:
        problems.append(f"layer_types must name num_hidden_layers={layers} layers; received {len(kinds)}")
    if "sliding_attention" in kinds:
        if not fields.get("use_sliding_window"):
            problems.append(f"use_sliding_window must be true when layer_types has sliding_attention layers; received "
                            f"{fields.get('use_sliding_window')!r} (Qwen3Config then drops the window)")
        if not isinstance(fields.get("sliding_window"), int) or fields["sliding_window"] < block_size:
            problems.append(f"sliding_window must be an integer >= block_size={block_size} when layer_types has "
                            f"sliding_attention layers; received {fields.get('sliding_window')!r}")
        if causal_blocks is not None:
            problems.append(causal_blocks)
    if problems:
        raise WeightsError(f"{where}: " + "; ".join(problems))
    if "sliding_attention" not in kinds:
        return (), 0
    return kinds, int(fields["sliding_window"])


def decoder_arch(fields: dict[str, Any], *, layer_ids: tuple[int, ...], block_size: int, mask_token_id: int,
                 target_family: str, target_num_layers: int, where: str,
                 causal_blocks: str | None = None) -> DrafterArch:
    """A DrafterArch from Qwen3 decoder fields (a z-lab config, or a speculators transformer_layer_config
    with Qwen3Config's defaults filled in), refusing what the drafter cannot run (`sliding_layers`)."""
    layer_types, window = sliding_layers(fields, int(block_size), causal_blocks, where)
    if fields.get("attention_bias"):
        raise WeightsError(f"{where}: attention_bias must be false (DFlash drafter layers have no biases)")
    if fields.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"{where}: hidden_act must be 'silu' (SwiGLU); received {fields.get('hidden_act')!r}")
    rope = dict(fields.get("rope_parameters") or {})
    rope.update(fields.get("rope_scaling") or {})
    try:
        hidden, heads = int(fields["hidden_size"]), int(fields["num_attention_heads"])
        return DrafterArch(
            hidden_size=hidden, num_layers=int(fields["num_hidden_layers"]), num_features=len(layer_ids),
            layer_ids=tuple(layer_ids), block_size=int(block_size), mask_token_id=int(mask_token_id),
            num_heads=heads, num_kv_heads=int(fields.get("num_key_value_heads") or heads),
            head_dim=int(fields.get("head_dim") or hidden // heads),
            intermediate_size=int(fields["intermediate_size"]), rms_norm_eps=float(fields["rms_norm_eps"]),
            rope_theta=float(fields.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling_from_hf(rope, where),
            max_position_embeddings=int(fields["max_position_embeddings"]), target_family=target_family,
            target_vocab_size=int(fields["vocab_size"]), target_num_layers=int(target_num_layers),
            layer_types=layer_types, sliding_window=window,
        )
    except KeyError as err:
        raise WeightsError(f"{where}: a DFlash drafter config must have {err.args[0]!r}") from err


def arch_from_zlab(config: dict[str, Any], where: str, target_family: str = "qwen3") -> DrafterArch:
    """The drafter architecture a z-lab config.json describes. `target_family` is the target's (the
    config's model_type is the drafter's own, qwen3)."""
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures and ARCHITECTURE2 not in architectures:
        raise WeightsError(f"{where}: architectures must include {ARCHITECTURE!r} or {ARCHITECTURE2!r}; received "
                           f"{config.get('architectures')!r} (not a z-lab DFlash drafter)")
    dflash = config.get("dflash_config") or {}
    # block_size is top-level in the Qwen3 / Llama releases and inside dflash_config in newer ones.
    block_size = config.get("block_size") or dflash.get("block_size")
    missing = [name for name, value in (("dflash_config.target_layer_ids", dflash.get("target_layer_ids")),
                                        ("dflash_config.mask_token_id", dflash.get("mask_token_id")),
                                        ("block_size", block_size),
                                        ("num_target_layers", config.get("num_target_layers")))
               if value is None]
    if missing:
        raise WeightsError(f"{where}: a DFlash drafter config must have {', '.join(missing)}")
    causal = None if config.get("is_causal") is False else (
        f"is_causal must be false for sliding_attention layers; received {config.get('is_causal')!r} (the "
        "reference runs a sliding layer's block causally unless is_causal is false; these blocks are bidirectional)")
    arch = decoder_arch(config, layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]), block_size=block_size,
                        mask_token_id=dflash["mask_token_id"], target_family=target_family,
                        target_num_layers=config["num_target_layers"], where=where, causal_blocks=causal)
    if ARCHITECTURE2 not in architectures:
        return arch
    return with_dflash2(arch, {**config, **dflash}, where)


def with_dflash2(arch: DrafterArch, fields: dict[str, Any], where: str) -> DrafterArch:
    """`arch` as a DFlash2 drafter with the convolution of `fields` (z-lab's dflash_config, or a speculators
    dflash2 config), refusing what the drafter cannot run and naming every field: the convolution's taps and
    group size must be set (the group size dividing the hidden size), the input embeddings unscaled. The
    selector is read with the tensors (`with_selector`); the logit multiplier and softcap keep each slot's argmax
    and are read only there (a trained selector next to them is skipped)."""
    problems = [f"{name} must be a positive integer (DFlash2's convolution); received {fields.get(name)!r}"
                for name in ("conv_kernel_size", "conv_group_size")
                if not isinstance(fields.get(name), int) or fields[name] < 1]
    if not problems and arch.hidden_size % fields["conv_group_size"]:
        problems.append(f"conv_group_size {fields['conv_group_size']} must divide hidden_size {arch.hidden_size}")
    if float(fields.get("input_embedding_scale", 1.0)) != 1.0:
        problems.append(f"input_embedding_scale must be 1 (block embeddings are the target's, unscaled); received "
                        f"{fields['input_embedding_scale']!r}")
    if fields.get("draft_ffn_type", "dense") != "dense":
        problems.append(f"draft_ffn_type must be 'dense' (SwiGLU layers); received {fields['draft_ffn_type']!r}")
    if problems:
        raise WeightsError(f"{where}: " + "; ".join(problems))
    return dataclasses.replace(arch, variant="dflash2", conv_kernel_size=int(fields["conv_kernel_size"]),
                               conv_group_size=int(fields["conv_group_size"]))


def with_selector(arch: DrafterArch, fields: dict[str, Any], tensors: dict[str, np.ndarray],
                  where: str) -> tuple[DrafterArch, frozenset[str]]:
    """(`arch` with the candidate selector of a DFlash2 layout's `tensors`, the selector tensor names to skip).

    A trained (nonzero) selector is loaded: its rank from `predecessor_codebook` [V, r], its top-k from
    `selector_top_k` of `fields` (the config's DFlash2 fields; the published 16 when absent); the engine drafts with
    its walk. A zero selector (what this project exports for a drafter without one) is skipped: its walk drafts
    each slot's argmax, which is what a drafter without a selector proposes. A trained selector next to a logit
    multiplier or softcap other than 1 / none is skipped with a warning: the walk adds edge scores to the
    unary logits as the target's head gives them, and these would rescale them (drafts stay lossless: each
    slot's argmax)."""
    names = frozenset(n for n in tensors if n.startswith(SELECTOR_PREFIX)) if arch.variant == "dflash2" else frozenset()
    if not any(np.any(np.asarray(tensors[n], np.float32)) for n in names):
        return arch, names
    scale = float(fields.get("output_multiplier", 1.0) or 1.0)
    cap = fields.get("final_logit_softcapping")
    if scale != 1.0 or cap:
        log.warning("%s: the trained DFlash2 candidate selector is not used: output_multiplier %s / "
                    "final_logit_softcapping %s rescale the unary logits its edge scores add to, which this engine "
                    "does not; the drafter proposes each slot's argmax instead (lossless, possibly lower acceptance)",
                    where, scale, cap)
        return arch, names
    book = tensors.get(SELECTOR_PREFIX + "predecessor_codebook")
    if book is None or np.ndim(book) != 2:
        raise WeightsError(f"{where}: a DFlash2 candidate selector must hold {SELECTOR_PREFIX}predecessor_codebook "
                           f"of shape [vocab, rank]; received {None if book is None else np.shape(book)}")
    top_k = fields.get("selector_top_k", SELECTOR_TOP_K)
    if not isinstance(top_k, int) or not 1 <= top_k <= arch.target_vocab_size:
        raise WeightsError(f"{where}: selector_top_k must be an integer in [1, {arch.target_vocab_size}]; "
                           f"received {top_k!r}")
    return dataclasses.replace(arch, selector_rank=int(np.shape(book)[1]), selector_top_k=top_k), frozenset()


def drafter_from_tensors(arch: DrafterArch, tensors: dict[str, np.ndarray], where: str,
                         ignored: frozenset[str] = frozenset()) -> DFlashDrafter:
    """A drafter of `arch` holding `tensors` (z-lab names, [out, in]); the set must match exactly
    (names in `ignored` may be present and are skipped), every shape is checked."""
    expected = set()

    def value(keys: tuple[Any, ...], variable: nnx.Param) -> jax.Array:
        parts = [str(k) for k in keys]
        transpose = parts[-1] == "kernel"
        name = ".".join(parts[:-1] + ["weight"]) if transpose else ".".join(parts)
        expected.add(name)
        if name not in tensors:
            raise WeightsError(f"{where}: tensor {name!r} is missing")
        array = np.asarray(tensors[name]).astype(np.float32)
        array = array.T if transpose else array
        if tuple(array.shape) != tuple(variable.shape):
            raise WeightsError(f"{where}: tensor {name!r} has shape {tuple(tensors[name].shape)}; the config "
                               f"implies {tuple(variable.shape[::-1] if transpose else variable.shape)}")
        return jnp.asarray(array, jnp.float32)

    drafter = restore_drafter(arch, value)  # built abstractly: no random init for the tensors to overwrite
    extra = sorted(set(tensors) - expected - ignored)
    if extra:
        raise WeightsError(f"{where}: unexpected tensors {extra[:5]} (not part of this drafter's config)")
    return drafter


def read_zlab(directory: str | Path, target_family: str = "qwen3") -> DFlashDrafter:
    """The drafter of a z-lab layout directory, unchecked against any target (see `load_zlab`)."""
    directory = Path(directory).expanduser()
    config = read_config(directory)
    refuse_retired(directory)
    arch, tensors = arch_from_zlab(config, str(directory / "config.json"), target_family), read_tensors(directory)
    arch, skip = with_selector(arch, {**config, **(config.get("dflash_config") or {})}, tensors, str(directory))
    drafter = drafter_from_tensors(arch, tensors, str(directory), skip)
    drafter.draft_vocab = DraftVocab.read(directory)
    return drafter


def check_import(arch: DrafterArch, target: DecoderConfig, where: str, expect: DrafterArch | None = None) -> None:
    """Raise ValueError naming every way an imported drafter (from `where`) does not fit `target`: widths
    (hidden size = the target's; the fc input F x hidden is checked on the tensors), vocab, layer count, layer
    ids (inside the target), mask id (inside the vocab); and, with `expect` (e.g. the recipe's resolved
    drafter), every field of layer ids, mask id, block size and widths that differs from it. A layer id equal
    to the target's last layer loads with a warning (a drafter trained on HF's post-norm hidden_states[L] sees
    our pre-norm feature); `check_exportable_ids` refuses it on export."""
    fits = {"hidden_size": (arch.hidden_size, target.hidden_size),
            "vocab_size": (arch.target_vocab_size, target.vocab_size),
            "num_layers": (arch.target_num_layers, target.num_layers)}
    bad = [f"{k}: drafter {a} vs target {b}" for k, (a, b) in fits.items() if a != b]
    if max(arch.layer_ids) >= target.num_layers or min(arch.layer_ids) < 0:
        bad.append(f"layer_ids {arch.layer_ids} reach past the target's {target.num_layers} layers")
    elif target.num_layers - 1 in arch.layer_ids:
        log.warning("the drafter in %s reads layer id %d, the target's last layer: a drafter trained elsewhere on "
                    "Hugging Face's hidden_states[%d] (taken after the final norm) sees our pre-norm feature here "
                    "instead; expect lower acceptance unless it was trained by dflash-tpu", where,
                    target.num_layers - 1, target.num_layers)
    if not 0 <= arch.mask_token_id < target.vocab_size:
        bad.append(f"mask_token_id {arch.mask_token_id} lies outside the target's vocab [0, {target.vocab_size})")
    if expect is not None:
        for name in ("layer_ids", "mask_token_id", "block_size", "hidden_size", "num_features", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "layer_types", "sliding_window",
                     "variant", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            got, want = getattr(arch, name), getattr(expect, name)
            if got != want:
                bad.append(f"{name}: drafter {got} vs expected {want}")
    if bad:
        raise ValueError(f"the drafter in {where} was trained for another target (" + "; ".join(bad) + ")")


def load_zlab(directory: str | Path, target_cfg: DecoderConfig, expect: DrafterArch | None = None) -> DFlashDrafter:
    """A drafter from a z-lab layout directory, checked against `target_cfg` (and `expect`; every mismatch
    named in one error)."""
    directory = Path(directory).expanduser()
    config = read_config(directory)
    refuse_retired(directory)
    arch, tensors = arch_from_zlab(config, str(directory / "config.json"), target_cfg.family), read_tensors(directory)
    arch, skip = with_selector(arch, {**config, **(config.get("dflash_config") or {})}, tensors, str(directory))
    check_import(arch, target_cfg, str(directory), expect)
    drafter = drafter_from_tensors(arch, tensors, str(directory), skip)
    drafter.draft_vocab = DraftVocab.read(directory, target_cfg.vocab_size)
    return drafter


__all__ = ["ARCHITECTURE", "ARCHITECTURE2", "AUTO_MAP", "AUTO_MAP2", "DTYPES", "MODELING_FILE", "RETIRED_MARKOV_DIR",
           "SELECTOR_RANK", "SELECTOR_TOP_K", "arch_from_zlab", "check_exportable_ids", "check_import", "decoder_arch",
           "dflash2_extra_tensors", "dflash2_fields", "drafter_from_tensors", "hf_rope", "hf_tensors", "json_float",
           "load_zlab", "qwen3_fields", "read_config", "read_tensors", "read_zlab", "refuse_retired", "save_zlab",
           "sliding_layers", "with_dflash2", "with_selector", "zlab_config"]
