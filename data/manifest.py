"""The manifest of a capture directory (`manifest.json`): what the shards hold and where they come from.

`Manifest` (its JSON form and parse checks), `ShardEntry` (one finished shard), `Provenance` (target and
tokenizer fingerprints), `load_manifest` (the manifest with every listed shard file checked) and
`check_manifest` (a run against the capture it reads, STYLE 8). Shard i is the file `shard_name(i)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.data.files import file_sha256
from dflash.data.records import ShardError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
SHARD_NAME = re.compile(r"shard-(\d{5})\.array_record")
PARTS_DIR = "parts"  # a multi-process capture's shares record their finished shards here until merged
PART_NAME = re.compile(r"part-(\d{5})-of-(\d{5})\.json")


class ManifestMismatchError(ValueError):
    """A manifest does not describe the features this run needs (every differing field is named)."""


def shard_name(index: int) -> str:
    """File name of shard `index`: `shard-00000.array_record`."""
    return f"shard-{index:05d}.array_record"


def chat_template_hash(chat_template: str | None) -> str:
    """sha256 hex of a chat template's text ('' when there is none)."""
    return hashlib.sha256((chat_template or "").encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where captured features come from; recorded in the manifest and compared on resume and at training.

    target_name: the target as configured (`smollm2`, a path); informative, not compared.
    target_fingerprint: `Target.fingerprint` (sha256 of the weight files).
    tokenizer_fingerprint: `ChatTokenizer.fingerprint()` (tokenizer JSON + chat template).
    chat_template_hash: `chat_template_hash(tok.chat_template)`.
    """

    target_name: str
    target_fingerprint: str
    tokenizer_fingerprint: str
    chat_template_hash: str

    @classmethod
    def of(cls, target_name: str, target_fingerprint: str, tokenizer: Any) -> Provenance:
        """From a target's name and weights fingerprint and its `ChatTokenizer`."""
        return cls(target_name=str(target_name), target_fingerprint=target_fingerprint,
                   tokenizer_fingerprint=tokenizer.fingerprint(),
                   chat_template_hash=chat_template_hash(tokenizer.chat_template))

    @classmethod
    def of_target(cls, target: Any) -> Provenance:
        """From a loaded `models.target.Target`."""
        return cls.of(target.name, target.fingerprint, target.tokenizer)


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One finished shard: file name, sample and token counts, size in bytes, sha256 hex."""

    file: str
    samples: int
    tokens: int
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """`manifest.json`: what a capture directory holds (JSON object with exactly these keys).

    Identity (compared on resume; `check_manifest` compares the ones a training run knows):
      format_version, target_fingerprint, tokenizer_fingerprint, chat_template_hash, layer_ids,
      hidden_size (D), feature_dim (F*D), feature_dtype ("bfloat16"), seq_len (padded row length at
      capture), examples_hash (sha256 of every example's padded row, mask and length), num_samples,
      samples_per_shard, writer_options.
    Progress: shards (finished, in index order, each a `ShardEntry`), total_tokens and bytes_per_token
      (over finished shards), complete (all num_shards shards finished).
    Informative: target_name, pad_id (the capture rows' padding id, None if no row was padded), created
      (time, host, library versions of the first run).
    target_labels (identity): every record also holds the target's greedy next token at each position
      (`data.labels: target`); absent from manifests written before it existed (= False).
    target_topk (identity): every record also holds the target's k most likely next tokens and their
      probabilities at each position (`data.labels: soft`, with target_labels); 0 = none (and when absent).
    """

    format_version: int
    complete: bool
    target_name: str
    target_fingerprint: str
    tokenizer_fingerprint: str
    chat_template_hash: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    feature_dim: int
    feature_dtype: str
    seq_len: int
    pad_id: int | None
    examples_hash: str
    num_samples: int
    samples_per_shard: int
    num_shards: int
    writer_options: str
    total_tokens: int
    bytes_per_token: float
    shards: tuple[ShardEntry, ...]
    created: dict[str, Any]
    target_labels: bool = False
    target_topk: int = 0

    def shard_samples(self, index: int) -> int:
        """Number of samples shard `index` holds: samples_per_shard, less for the last shard."""
        return min(self.samples_per_shard, self.num_samples - index * self.samples_per_shard)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> Manifest:
        """Parse a JSON object; unknown or missing keys and wrong types raise ShardError naming `where`."""
        names = [f.name for f in dataclasses.fields(cls)]
        optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        missing = sorted(set(names) - set(raw) - optional)
        unknown = sorted(set(raw) - set(names))
        if missing or unknown:
            raise ShardError(f"{where}: must have exactly the manifest keys; missing {missing}, unknown {unknown}")
        if raw["format_version"] != MANIFEST_VERSION:
            raise ShardError(f"{where}: format_version must be {MANIFEST_VERSION}; received {raw['format_version']!r} "
                             "(captured by another release: capture again)")
        wrong = [f"{name} ({type(raw[name]).__name__})" for name, kinds in _MANIFEST_TYPES.items()
                 if name in raw
                 and (not isinstance(raw[name], kinds) or (kinds is int and isinstance(raw[name], bool)))]
        if wrong:
            raise ShardError(f"{where}: manifest fields must have their JSON types; received wrong types for {wrong}")
        try:
            shards = tuple(ShardEntry(**entry) for entry in raw["shards"])
            values = dict(raw, layer_ids=tuple(int(j) for j in raw["layer_ids"]), shards=shards)
            manifest = cls(**values)
        except (TypeError, ValueError) as err:
            raise ShardError(f"{where}: malformed manifest ({err})") from err
        matches = [SHARD_NAME.fullmatch(entry.file) for entry in shards]
        indices = [int(m.group(1)) if m else -1 for m in matches]
        if indices != sorted(set(indices)) or any(not 0 <= i < manifest.num_shards for i in indices):
            raise ShardError(f"{where}: shards must be listed by increasing index in [0, {manifest.num_shards}); "
                             f"received {[entry.file for entry in shards][:5]}")
        if manifest.complete and len(shards) != manifest.num_shards:
            raise ShardError(f"{where}: a complete capture must list all {manifest.num_shards} shards; "
                             f"received {len(shards)}")
        return manifest


_MANIFEST_TYPES: dict[str, Any] = {
    "format_version": int, "complete": bool, "target_name": str, "target_fingerprint": str,
    "tokenizer_fingerprint": str, "chat_template_hash": str, "layer_ids": list, "hidden_size": int,
    "feature_dim": int, "feature_dtype": str, "seq_len": int, "pad_id": (int, type(None)), "examples_hash": str,
    "num_samples": int, "samples_per_shard": int, "num_shards": int, "writer_options": str, "total_tokens": int,
    "bytes_per_token": (int, float), "shards": list, "created": dict, "target_labels": bool,
    "target_topk": int}

IDENTITY_FIELDS = ("format_version", "target_fingerprint", "tokenizer_fingerprint", "chat_template_hash",
                   "layer_ids", "hidden_size", "feature_dim", "feature_dtype", "seq_len", "examples_hash",
                   "num_samples", "samples_per_shard", "writer_options", "target_labels", "target_topk")


def describe_differences(differences: Sequence[tuple[str, Any, Any]], left: str, right: str) -> str:
    """'name: <left> a, <right> b; …' for (name, a, b) triples (error messages naming each differing field)."""
    return "; ".join(f"{name}: {left} {a!r}, {right} {b!r}" for name, a, b in differences)


@dataclasses.dataclass(frozen=True)
class ExpectedFeatures:
    """What a run expects of stored features, field by field as the manifest names them; a field left None is not
    compared (`check_manifest`)."""

    target_fingerprint: str | None = None
    tokenizer_fingerprint: str | None = None
    chat_template_hash: str | None = None
    layer_ids: Sequence[int] | None = None
    hidden_size: int | None = None
    seq_len: int | None = None
    feature_dim: int | None = None
    examples_hash: str | None = None
    target_labels: bool | None = None
    target_topk: int | None = None


def check_manifest(manifest: Manifest, expected: ExpectedFeatures) -> None:
    """Raise ManifestMismatchError naming EVERY given field of `expected` whose run value differs from the
    manifest's.

    Fields left None are not compared. Call it with the run's target, tokenizer, layer ids and seq_len
    before the first training step (STYLE 8).
    """
    run = {field.name: getattr(expected, field.name) for field in dataclasses.fields(expected)}
    if expected.layer_ids is not None:
        run["layer_ids"] = tuple(int(j) for j in expected.layer_ids)
    differences = [(name, getattr(manifest, name), value) for name, value in run.items()
                   if value is not None and getattr(manifest, name) != value]
    if differences:
        raise ManifestMismatchError(
            f"stored features must match this run; {len(differences)} field(s) differ: "
            f"{describe_differences(differences, 'manifest', 'run')} (capture again with this run's settings, "
            "or point the run at a matching capture)")


def read_manifest_file(path: Path) -> Manifest:
    """The manifest stored in `path` (a ShardError naming it when it is not valid JSON or not a manifest)."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ShardError(f"{path}: must be valid JSON; received a parse error ({err})") from err
    if not isinstance(raw, dict):
        raise ShardError(f"{path}: must hold a JSON object; received {type(raw).__name__}")
    return Manifest.from_dict(raw, str(path))


def load_manifest(shard_dir: str | Path, *, verify: bool = False, allow_incomplete: bool = False) -> Manifest:
    """The manifest of a capture directory, after checking every listed shard file exists with its size.

    verify=True also recomputes each shard's sha256 (reads every byte) and names the first corrupt shard.
    An incomplete capture (interrupted, `complete: false`) is an error unless `allow_incomplete`.
    """
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        raise ShardError(f"{shard_dir}: capture directory must exist; received a missing path "
                         "(run the capture first, or fix the path)")
    path = shard_dir / MANIFEST_NAME
    if not path.is_file() and (shard_dir / PARTS_DIR).is_dir():
        raise ShardError(f"{path}: must exist in a capture directory; received the unmerged shares of a "
                         f"multi-process capture under {shard_dir / PARTS_DIR} (rerun `dflash data capture` to finish "
                         "and merge them)")
    if not path.is_file():
        raise ShardError(f"{path}: must exist in a capture directory; received a directory without one "
                         "(not a capture, or the capture never started)")
    manifest = read_manifest_file(path)
    if not manifest.complete and not allow_incomplete:
        raise ShardError(f"{path}: capture must be complete; received {len(manifest.shards)} of "
                         f"{manifest.num_shards} shards finished (rerun the capture to resume it)")
    for entry in manifest.shards:
        check_shard_file(shard_dir, entry, verify)
    return manifest


def check_shard_file(shard_dir: Path, entry: ShardEntry, verify: bool) -> None:
    """ShardError unless `entry`'s file exists in `shard_dir` with its recorded size (and sha256 if `verify`)."""
    file = shard_dir / entry.file
    if not file.is_file():
        raise ShardError(f"{file}: shard listed in the manifest must exist; received a missing file")
    size = file.stat().st_size
    if size != entry.bytes:
        raise ShardError(f"{file}: shard must be {entry.bytes} bytes as the manifest records; received {size} bytes "
                         "(truncated or overwritten shard)")
    if verify:
        digest = file_sha256(file)
        if digest != entry.sha256:
            raise ShardError(f"{file}: shard sha256 must be {entry.sha256} as the manifest records; received "
                             f"{digest} (corrupt shard: capture it again)")


def created_info() -> dict[str, Any]:
    """The manifest's `created`: time, host and the versions of the libraries that write and read captures."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("jax", "grain", "array-record", "numpy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "versions": versions}
