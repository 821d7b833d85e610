"""Stored target features (offline mode): the record format, the shard writer and reader, the manifest.

A capture directory holds `manifest.json` (`Manifest`) and `shard-00000.array_record`, `shard-00001…`
(shard i = samples [i*S, (i+1)*S), S = samples_per_shard), one ArrayRecord record per sample (`encode_record`).

    writer = ShardWriter(out_dir, header)          # capture (data.capture): atomic per shard, resumes
    with writer.shard(i) as shard: shard.write(tokens_N, loss_mask_N, features_NxFD[, next_ids_N[, topk]])
    source = RecordSource(out_dir, load_manifest(out_dir))     # training (data.offline): random access

Storage choices and ArrayRecord's quirks: docs/decisions.md D15.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
RECORD_MAGIC = b"DFSR"
RECORD_VERSION = 1
FEATURE_DTYPE = "bfloat16"
TMP_SUFFIX = ".tmp"
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # random access (ArrayRecord's advice)

_HEADER = struct.Struct("<4sHHIIBBBBQH2x")
HEADER_SIZE = _HEADER.size  # 32
_TOKENS_CODE, _MASK_CODE, _FEATURES_CODE = 1, 2, 3  # int32, uint8, bfloat16
# the header's labels byte: none, int32 next ids (`Sample.next_ids`), or next ids and the target's top-k
# next-token distribution (`Sample.topk_ids`, `Sample.topk_probs`; k in the header's u16 after the index)
_NO_LABELS, _NEXT_IDS_CODE, _TOPK_CODE = 0, 1, 2
TOPK_PROB_DTYPE = np.dtype("<f2")
BF16 = np.dtype(ml_dtypes.bfloat16)
_SHARD_NAME = re.compile(r"shard-(\d{5})\.array_record")
_COMPRESSIONS = re.compile(r"uncompressed|(zstd|brotli)(:-?\d+)?|snappy")
_HASH_BLOCK = 1 << 22


class ShardError(ValueError):
    """A capture directory, manifest, shard file or record is missing, inconsistent or corrupt."""


class ManifestMismatchError(ValueError):
    """A manifest does not describe the features this run needs (every differing field is named)."""


def shard_name(index: int) -> str:
    """File name of shard `index`: `shard-00000.array_record`."""
    return f"shard-{index:05d}.array_record"


def chat_template_hash(chat_template: str | None) -> str:
    """sha256 hex of a chat template's text ('' when there is none)."""
    return hashlib.sha256((chat_template or "").encode("utf-8")).hexdigest()


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Sample:
    """One stored sample: `tokens` int32[n], `loss_mask` uint8[n] (0/1), `features` bfloat16[n, F*D], and
    with target labels `next_ids` int32[n]: the target's greedy token after each position (None without);
    with the target's top-k (`data.labels: soft`) also `topk_ids` int32[n, k] and `topk_probs` float16[n, k]:
    its k most likely next tokens after each position, most likely first, and their probabilities."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    features: np.ndarray
    next_ids: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_probs: np.ndarray | None = None


def encode_record(sample_index: int, tokens_N: np.ndarray, loss_mask_N: np.ndarray,
                  features_NxFD: np.ndarray, next_ids_N: np.ndarray | None = None,
                  topk: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """The record bytes of one sample; arrays are validated, not converted.

    `tokens_N` integer [n] (stored int32), `loss_mask_N` [n] of 0/1 values (stored uint8), `features_NxFD`
    bfloat16 [n, F*D] (any other dtype is an error: the cast belongs on device, before the transfer).
    `topk` (with `next_ids_N`): (ids integer [n, k], probabilities [n, k] in [0, 1], stored float16), the
    target's k most likely next tokens after each position.

    A record is a fixed 32-byte little-endian header followed by three raw arrays, features first so they
    start 32-byte aligned:

        offset 0   magic b"DFSR", u16 version (1), u16 header size (32), u32 n (tokens), u32 feature_dim
                   (F*D), u8 token dtype (1 = int32), u8 mask dtype (2 = uint8), u8 feature dtype
                   (3 = bfloat16), u8 labels (0 = none, 1 = int32 next ids, 2 = next ids and top-k), u64
                   sample index (global), u16 k (top-k width, 0 unless labels 2), 2 bytes reserved (0)
        offset 32  features  bfloat16[n, F*D]   `online_features` of the sample's padded row, first n positions
                   tokens    int32[n]            the real tokens (no padding)
                   next_ids  int32[n]            only with labels 1 or 2: the target's greedy token after each position
                   topk_ids  int32[n, k]         only with labels 2: the target's k most likely next tokens
                   topk_prob float16[n, k]       only with labels 2: their probabilities
                   loss_mask uint8[n]            the assistant-only mask, 0 or 1

    n is the sample's number of real tokens: padding is not stored (the loader pads again).
    """
    tokens_N = np.asarray(tokens_N)
    loss_mask_N = np.asarray(loss_mask_N)
    features_NxFD = np.asarray(features_NxFD)
    if features_NxFD.ndim != 2 or features_NxFD.dtype != BF16:
        raise ValueError(f"features must be bfloat16 [n, F*D]; received "
                         f"{features_NxFD.dtype}{list(features_NxFD.shape)}")
    n, feature_dim = features_NxFD.shape
    if n < 1 or feature_dim < 1:
        raise ValueError(f"features must hold at least one token and one feature; received shape {features_NxFD.shape}")
    if tokens_N.shape != (n,) or loss_mask_N.shape != (n,):
        raise ValueError(f"tokens and loss_mask must have shape [{n}] (the features' n); received "
                         f"{list(tokens_N.shape)} and {list(loss_mask_N.shape)}")
    if not np.issubdtype(tokens_N.dtype, np.integer) or (n and (tokens_N.min() < 0 or tokens_N.max() >= 2**31)):
        raise ValueError(f"tokens must be non-negative int32 ids; received {tokens_N.dtype} "
                         f"in [{tokens_N.min()}, {tokens_N.max()}]")
    if not np.isin(loss_mask_N, (0, 1)).all():
        raise ValueError(f"loss_mask must hold only 0 and 1; received values {np.unique(loss_mask_N)[:8].tolist()}")
    labels = b""
    if next_ids_N is not None:
        next_ids_N = np.asarray(next_ids_N)
        if next_ids_N.shape != (n,) or not np.issubdtype(next_ids_N.dtype, np.integer) or next_ids_N.min() < 0:
            raise ValueError(f"next_ids must be non-negative integer ids of shape [{n}]; received "
                             f"{next_ids_N.dtype}{list(next_ids_N.shape)}")
        labels = next_ids_N.astype("<i4").tobytes()
    code, k = (_NO_LABELS if next_ids_N is None else _NEXT_IDS_CODE), 0
    if topk is not None:
        ids_NxK, probs_NxK = (np.asarray(a) for a in topk)
        if next_ids_N is None or ids_NxK.ndim != 2 or ids_NxK.shape[0] != n or probs_NxK.shape != ids_NxK.shape:
            raise ValueError(f"topk must come with next_ids as (ids, probs) of one shape [{n}, k]; received "
                             f"{list(ids_NxK.shape)} and {list(probs_NxK.shape)}")
        k = ids_NxK.shape[1]
        if not 1 <= k < 2**16 or not np.issubdtype(ids_NxK.dtype, np.integer) or ids_NxK.min() < 0:
            raise ValueError(f"topk ids must be non-negative integers, 1 <= k < 65536; received {ids_NxK.dtype}, k={k}")
        if not (np.all(probs_NxK >= 0) and np.all(probs_NxK <= 1)):
            raise ValueError("topk probabilities must lie in [0, 1]")
        labels += ids_NxK.astype("<i4").tobytes() + probs_NxK.astype(TOPK_PROB_DTYPE).tobytes()
        code = _TOPK_CODE
    header = _HEADER.pack(RECORD_MAGIC, RECORD_VERSION, HEADER_SIZE, n, feature_dim, _TOKENS_CODE, _MASK_CODE,
                          _FEATURES_CODE, code, sample_index, k)
    return b"".join((header, np.ascontiguousarray(features_NxFD).tobytes(), tokens_N.astype("<i4").tobytes(),
                     labels, loss_mask_N.astype(np.uint8).tobytes()))


def record_size(n: int, feature_dim: int, next_ids: bool = False, topk: int = 0) -> int:
    """Bytes of one record of n tokens: 32 + n * (2 * F*D + 4 + 1), plus 4n with next ids, plus 6nk with the
    top-k."""
    return HEADER_SIZE + n * (2 * feature_dim + 5 + (4 if next_ids else 0) + 6 * topk)


def decode_record(record: bytes, *, feature_dim: int, sample_index: int | None = None,
                  where: str = "record", next_ids: bool | None = None, topk: int | None = None) -> Sample:
    """The `Sample` stored in `record` (format: `encode_record`); raises ShardError (prefixed with `where`,
    the shard file and record index) on any inconsistency.

    Checked: the magic, version, dtypes, that the record length is exactly 32 + n*(2*F*D + 5), the mask
    is 0/1, and that `feature_dim`, `sample_index`, `next_ids` (labels present) and `topk` (its width, 0 =
    none) equal the header's when given. Arrays are zero-copy views of `record` (read-only).
    """
    if len(record) < HEADER_SIZE:
        raise ShardError(f"{where}: must be at least the {HEADER_SIZE}-byte header; received {len(record)} bytes")
    magic, version, header_size, n, width, tcode, mcode, fcode, lcode, index, k = _HEADER.unpack_from(record)
    if magic != RECORD_MAGIC:
        raise ShardError(f"{where}: must start with {RECORD_MAGIC!r}; received {magic!r} (not a feature record)")
    if version != RECORD_VERSION or header_size != HEADER_SIZE:
        raise ShardError(f"{where}: must be record version {RECORD_VERSION} with a {HEADER_SIZE}-byte header; "
                         f"received version {version}, header {header_size} bytes (written by another release?)")
    if ((tcode, mcode, fcode) != (_TOKENS_CODE, _MASK_CODE, _FEATURES_CODE)
            or lcode not in (_NO_LABELS, _NEXT_IDS_CODE, _TOPK_CODE) or (k > 0) != (lcode == _TOPK_CODE)):
        raise ShardError(f"{where}: dtype codes must be (int32, uint8, bfloat16) = (1, 2, 3), labels 0, 1 or 2 "
                         f"and a top-k width exactly with labels 2; received {(tcode, mcode, fcode)}, labels {lcode}, "
                         f"k {k}")
    if width != feature_dim:
        raise ShardError(f"{where}: feature width must be {feature_dim} (the manifest's F*D); received {width}")
    if sample_index is not None and index != sample_index:
        raise ShardError(f"{where}: must hold sample {sample_index}; received sample {index} (shards out of order?)")
    labelled = lcode in (_NEXT_IDS_CODE, _TOPK_CODE)
    if next_ids is not None and labelled != next_ids:
        raise ShardError(f"{where}: must {'' if next_ids else 'not '}hold target labels (next ids), as its "
                         f"manifest says; received a record {'with' if labelled else 'without'} them")
    if topk is not None and k != topk:
        raise ShardError(f"{where}: must hold the target's top-{topk} as its manifest says; received top-{k}")
    if n < 1 or len(record) != record_size(n, width, labelled, k):
        raise ShardError(f"{where}: length must be {record_size(n, width, labelled, k)} bytes for n={n} tokens of "
                         f"width {width}; received {len(record)} bytes (truncated or corrupt record)")
    features_end = HEADER_SIZE + 2 * n * width
    features = np.frombuffer(record, BF16, n * width, HEADER_SIZE).reshape(n, width)
    tokens = np.frombuffer(record, "<i4", n, features_end)
    next_ids = np.frombuffer(record, "<i4", n, features_end + 4 * n) if labelled else None
    topk_ids = topk_probs = None
    if k:
        topk_ids = np.frombuffer(record, "<i4", n * k, features_end + 8 * n).reshape(n, k)
        topk_probs = np.frombuffer(record, TOPK_PROB_DTYPE, n * k, features_end + (8 + 4 * k) * n).reshape(n, k)
    loss_mask = np.frombuffer(record, np.uint8, n, features_end + (8 if labelled else 4) * n + 6 * k * n)
    if loss_mask.max() > 1:
        raise ShardError(f"{where}: loss mask must hold only 0 and 1; received {sorted(set(loss_mask.tolist()))[:8]}")
    return Sample(tokens=tokens, loss_mask=loss_mask, features=features, next_ids=next_ids, topk_ids=topk_ids,
                  topk_probs=topk_probs)


# ----------------------------------------------------------------------------- manifest


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
        matches = [_SHARD_NAME.fullmatch(entry.file) for entry in shards]
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


def _describe_differences(differences: Sequence[tuple[str, Any, Any]], left: str, right: str) -> str:
    return "; ".join(f"{name}: {left} {a!r}, {right} {b!r}" for name, a, b in differences)


def check_manifest(manifest: Manifest, *, target_fingerprint: str | None = None,
                   tokenizer_fingerprint: str | None = None, chat_template_hash: str | None = None,
                   layer_ids: Sequence[int] | None = None, hidden_size: int | None = None,
                   seq_len: int | None = None, feature_dim: int | None = None,
                   examples_hash: str | None = None, target_labels: bool | None = None,
                   target_topk: int | None = None) -> None:
    """Raise ManifestMismatchError naming EVERY given field whose run value differs from the manifest's.

    Fields left None are not compared. Call it with the run's target, tokenizer, layer ids and seq_len
    before the first training step (STYLE 8).
    """
    run = {"target_fingerprint": target_fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint,
           "chat_template_hash": chat_template_hash,
           "layer_ids": None if layer_ids is None else tuple(int(j) for j in layer_ids),
           "hidden_size": hidden_size, "seq_len": seq_len, "feature_dim": feature_dim,
           "examples_hash": examples_hash, "target_labels": target_labels, "target_topk": target_topk}
    differences = [(name, getattr(manifest, name), value) for name, value in run.items()
                   if value is not None and getattr(manifest, name) != value]
    if differences:
        raise ManifestMismatchError(
            f"stored features must match this run; {len(differences)} field(s) differ: "
            f"{_describe_differences(differences, 'manifest', 'run')} (capture again with this run's settings, "
            "or point the run at a matching capture)")


def _read_manifest_file(path: Path) -> Manifest:
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
    if not path.is_file():
        raise ShardError(f"{path}: must exist in a capture directory; received a directory without one "
                         "(not a capture, or the capture never started)")
    manifest = _read_manifest_file(path)
    if not manifest.complete and not allow_incomplete:
        raise ShardError(f"{path}: capture must be complete; received {len(manifest.shards)} of "
                         f"{manifest.num_shards} shards finished (rerun the capture to resume it)")
    for entry in manifest.shards:
        _check_shard_file(shard_dir, entry, verify)
    return manifest


def _check_shard_file(shard_dir: Path, entry: ShardEntry, verify: bool) -> None:
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, then `root` itself (deepest first: files before their
    directories), so a directory about to be renamed into place is durable whole."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        fsync_path(path)


def _created_info() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("jax", "grain", "array-record", "numpy"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(), "versions": versions}


# ----------------------------------------------------------------------------- writer


def writer_options(compression: str = "uncompressed") -> str:
    """ArrayRecord writer options: one record per group (random access) and `compression`."""
    if not _COMPRESSIONS.fullmatch(compression):
        raise ValueError(f"compression must be uncompressed, snappy, zstd[:level] or brotli[:level]; "
                         f"received {compression!r}")
    return f"group_size:1,{compression}"


class ShardWriter:
    """Writes a capture directory shard by shard, atomically, resuming an interrupted capture.

    `ShardWriter(out_dir, header)` where `header` is the manifest to produce with no shards yet
    (`complete=False`, `shards=()`). Opening the directory:
    - empty or missing: starts a new capture and writes the initial manifest;
    - holding a manifest: its identity fields must equal `header`'s (else ManifestMismatchError naming
      each differing field, manifest vs this run); listed shards whose size (and sha256 if `verify`)
      match are kept, the rest and any unlisted shard file are deleted, `.tmp` leftovers are deleted;
    - holding shard files without a manifest, or any other file: ShardError (not a capture directory).

    Then `pending` lists the shard indices still to write; `with writer.shard(i) as shard:
    shard.write(tokens, loss_mask, features)` writes shard i (its exact sample count, or ShardError), and
    `finish()` marks the capture complete.

    Crash safety: a shard is written to `shard-XXXXX.array_record.tmp`, closed, fsynced, hashed (sha256,
    size) and renamed with `os.replace`; only then is the manifest rewritten (tmp + fsync + replace) with
    the shard's entry. A shard is therefore visible under its final name only when complete, and a crash
    loses at most the shard in progress. Samples are assigned to shards by index (shard i = samples
    [i*S, (i+1)*S)), so a shard rewritten on resume is byte-identical to the one an uninterrupted capture
    would have written.
    """

    def __init__(self, out_dir: str | Path, header: Manifest, *, verify: bool = True) -> None:
        if header.shards or header.complete:
            raise ValueError("header must be a manifest with no shards and complete=False")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._entries: dict[int, ShardEntry] = {}
        self.kept: list[int] = []
        self._header = header
        self._open(verify)

    # -- directory state

    def _open(self, verify: bool) -> None:
        names = sorted(p.name for p in self.out_dir.iterdir())
        ours = {MANIFEST_NAME, MANIFEST_NAME + TMP_SUFFIX}
        shard_files = [n for n in names if _SHARD_NAME.fullmatch(n.removesuffix(TMP_SUFFIX))]
        foreign = [n for n in names if n not in ours and n not in shard_files]
        if foreign:
            raise ShardError(f"{self.out_dir}: capture directory must hold only {MANIFEST_NAME} and shard files; "
                             f"received {foreign[:5]} (use an empty or new directory)")
        manifest_path = self.out_dir / MANIFEST_NAME
        if not manifest_path.is_file():
            finished = [n for n in shard_files if not n.endswith(TMP_SUFFIX)]
            if finished:
                raise ShardError(f"{self.out_dir}: shard files without a {MANIFEST_NAME} must not be resumed; "
                                 f"received {finished[:3]} (not written by this capture: use an empty directory)")
            for name in names:
                (self.out_dir / name).unlink()
            self._created = _created_info()
            self._write_manifest()
            return
        previous = _read_manifest_file(manifest_path)
        differences = [(name, getattr(previous, name), getattr(self._header, name)) for name in IDENTITY_FIELDS
                       if getattr(previous, name) != getattr(self._header, name)]
        if differences:
            raise ManifestMismatchError(
                f"{self.out_dir} holds a capture of other data and must not be resumed by this run; "
                f"{len(differences)} field(s) differ: {_describe_differences(differences, 'manifest', 'run')} "
                "(use a new directory, or rerun with the original settings)")
        self._created = previous.created
        for index, entry in enumerate(previous.shards):
            try:
                _check_shard_file(self.out_dir, entry, verify)
            except ShardError:
                continue  # rewritten below, like an unfinished shard
            self._entries[index] = entry
        keep = {entry.file for entry in self._entries.values()} | ours
        for name in names:
            if name not in keep and (self.out_dir / name).exists():
                (self.out_dir / name).unlink()
        self.kept = sorted(self._entries)
        self._write_manifest()

    @property
    def pending(self) -> list[int]:
        """Indices of the shards still to write, in order."""
        return [i for i in range(self._header.num_shards) if i not in self._entries]

    @property
    def entries(self) -> dict[int, ShardEntry]:
        return dict(self._entries)

    def manifest(self) -> Manifest:
        """The manifest as it stands: the finished shards by index, totals over them, complete when all are."""
        shards = tuple(self._entries[i] for i in sorted(self._entries))
        tokens = sum(entry.tokens for entry in shards)
        size = sum(entry.bytes for entry in shards)
        return dataclasses.replace(
            self._header, shards=shards, total_tokens=tokens, bytes_per_token=size / tokens if tokens else 0.0,
            complete=len(shards) == self._header.num_shards, created=self._created)

    def _write_manifest(self) -> None:
        _write_atomic(self.out_dir / MANIFEST_NAME, self.manifest().to_json())

    # -- writing

    def shard(self, index: int) -> _OpenShard:
        """Open shard `index` for writing (a context manager); it is committed when the block exits cleanly."""
        if index in self._entries:
            raise ValueError(f"shard {index} is already finished in {self.out_dir}")
        if not 0 <= index < self._header.num_shards:
            raise ValueError(f"shard index must lie in [0, {self._header.num_shards}); received {index}")
        if self.pending[0] != index:
            raise ValueError(f"shards must be written in order; shard {self.pending[0]} is next, received {index}")
        return _OpenShard(self, index)

    def _commit(self, index: int, tmp: Path, samples: int, tokens: int) -> None:
        expected = self._header.shard_samples(index)
        if samples != expected:
            tmp.unlink(missing_ok=True)
            raise ShardError(f"{self.out_dir / shard_name(index)}: shard must hold {expected} samples; "
                             f"received {samples}")
        with tmp.open("rb+") as fh:
            os.fsync(fh.fileno())
        entry = ShardEntry(file=shard_name(index), samples=samples, tokens=tokens, bytes=tmp.stat().st_size,
                           sha256=file_sha256(tmp))
        os.replace(tmp, self.out_dir / entry.file)
        fsync_path(self.out_dir)
        self._entries[index] = entry
        self._write_manifest()

    def finish(self) -> Manifest:
        """Mark the capture complete (every shard must be finished) and return the final manifest."""
        if self.pending:
            raise ShardError(f"{self.out_dir}: every shard must be finished before finish(); "
                             f"pending {self.pending[:5]}")
        self._write_manifest()
        return self.manifest()


class _OpenShard:
    """A shard being written to its `.tmp` file; see `ShardWriter.shard`."""

    def __init__(self, writer: ShardWriter, index: int) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        self._writer = writer
        self.index = index
        self._tmp = writer.out_dir / (shard_name(index) + TMP_SUFFIX)
        self._file = ArrayRecordWriter(str(self._tmp), writer._header.writer_options)
        self.samples = 0
        self.tokens = 0
        self._first = index * writer._header.samples_per_shard

    def write(self, tokens_N: np.ndarray, loss_mask_N: np.ndarray, features_NxFD: np.ndarray,
              next_ids_N: np.ndarray | None = None, topk: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Append the next sample of this shard (its global index is implied by the order of writes);
        `next_ids_N` exactly when the manifest has `target_labels`, `topk` (ids, probs [n, k]) exactly when it
        has `target_topk` = k > 0."""
        header = self._writer._header
        if (next_ids_N is not None) != header.target_labels:
            raise ValueError(f"next_ids must be given {'with' if header.target_labels else 'only with'} "
                             "target_labels in the manifest")
        width = 0 if topk is None else np.shape(topk[0])[-1]
        if width != header.target_topk:
            raise ValueError(f"topk must have the manifest's width target_topk={header.target_topk} (0 = none); "
                             f"received {width}")
        if features_NxFD.shape[-1] != header.feature_dim:
            raise ValueError(f"features must have width {header.feature_dim}; received {features_NxFD.shape}")
        if len(tokens_N) > header.seq_len:
            raise ValueError(f"a sample must have at most seq_len={header.seq_len} tokens; received {len(tokens_N)}")
        self._file.write(encode_record(self._first + self.samples, tokens_N, loss_mask_N, features_NxFD, next_ids_N,
                                       topk))
        self.samples += 1
        self.tokens += len(tokens_N)

    def __enter__(self) -> _OpenShard:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._file.close()
        if exc_type is not None:
            self._tmp.unlink(missing_ok=True)
            return
        self._writer._commit(self.index, self._tmp, self.samples, self.tokens)


# ----------------------------------------------------------------------------- reader


class RecordSource:
    """Random access to every sample of a complete capture by global index (0 .. num_samples - 1).

    Global index g lives in shard g // samples_per_shard at record g % samples_per_shard. Readers open
    lazily, one per shard per process (never pickled: Grain's worker processes open their own), and each
    checks its record count against the manifest. `read(indices)` returns the decoded samples in order;
    any read or decode failure is a ShardError naming the shard file and the record index.
    """

    def __init__(self, shard_dir: str | Path, manifest: Manifest) -> None:
        if not manifest.complete:
            raise ShardError(f"{Path(shard_dir) / MANIFEST_NAME}: capture must be complete to be read; received "
                             f"{len(manifest.shards)} of {manifest.num_shards} shards finished")
        self.shard_dir = Path(shard_dir)
        self.manifest = manifest
        self._readers: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.manifest.num_samples

    def __getstate__(self) -> dict[str, Any]:
        return {"shard_dir": self.shard_dir, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["shard_dir"], state["manifest"])

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, record) of global sample `index`."""
        if not 0 <= index < self.manifest.num_samples:
            raise IndexError(f"sample index must lie in [0, {self.manifest.num_samples}); received {index}")
        return divmod(int(index), self.manifest.samples_per_shard)

    def where(self, index: int) -> str:
        """'<shard file>: record <r>' of global sample `index` (for error messages)."""
        shard, record = self.locate(index)
        return f"{self.shard_dir / self.manifest.shards[shard].file}: record {record}"

    def _reader(self, shard: int) -> Any:
        if self._pid != os.getpid():  # forked: do not share the parent's readers
            self._readers, self._pid = {}, os.getpid()
        reader = self._readers.get(shard)
        if reader is None:
            from array_record.python.array_record_module import ArrayRecordReader

            entry = self.manifest.shards[shard]
            path = self.shard_dir / entry.file
            try:
                reader = ArrayRecordReader(str(path), READER_OPTIONS)
            except Exception as err:  # noqa: BLE001 - the C++ reader raises RuntimeError/ValueError/OSError
                raise ShardError(f"{path}: shard must open as an ArrayRecord file; received {err}") from err
            if reader.num_records() != entry.samples:
                raise ShardError(f"{path}: shard must hold {entry.samples} records as the manifest records; "
                                 f"received {reader.num_records()} (truncated or replaced shard)")
            self._readers[shard] = reader
        return reader

    def read_one(self, index: int) -> Sample:
        """The decoded sample of global index `index` (ShardError naming shard and record on failure)."""
        shard, record = self.locate(index)
        where = self.where(index)
        try:
            (raw,) = self._reader(shard).read([record])
        except ShardError:
            raise
        except Exception as err:  # noqa: BLE001 - Riegeli reports corruption as RuntimeError
            raise ShardError(f"{where}: must read back; received {type(err).__name__}: {err}") from err
        return decode_record(raw, feature_dim=self.manifest.feature_dim, sample_index=int(index), where=where,
                             next_ids=self.manifest.target_labels, topk=self.manifest.target_topk)

    def read(self, indices: Sequence[int]) -> list[Sample]:
        """Decoded samples of `indices`, in order; raises the first record's ShardError."""
        samples = self.read_or_errors(indices)
        for sample in samples:
            if isinstance(sample, ShardError):
                raise sample
        return samples  # type: ignore[return-value]

    def lengths(self, progress: bool = False) -> np.ndarray:
        """int64 [num_samples]: every sample's token count, read from the record headers (one scan of the
        capture, shard by shard; a record that does not start with a valid header is a ShardError)."""
        out = np.zeros(self.manifest.num_samples, np.int64)
        shards: Any = range(self.manifest.num_shards)
        if progress:
            from tqdm import tqdm

            shards = tqdm(shards, desc="sample lengths", unit="shard", leave=False)
        for shard in shards:
            first = shard * self.manifest.samples_per_shard
            for record, raw in enumerate(self._reader(shard).read_all()):
                header = _HEADER.unpack_from(raw) if len(raw) >= HEADER_SIZE else None
                if header is None or header[0] != RECORD_MAGIC:
                    raise ShardError(f"{self.shard_dir / self.manifest.shards[shard].file}: record {record}: must "
                                     f"start with a {RECORD_MAGIC!r} header; received {bytes(raw[:4])!r}")
                out[first + record] = header[3]
        return out

    def read_or_errors(self, indices: Sequence[int]) -> list[Sample | ShardError]:
        """Per index, its decoded sample or the ShardError naming its shard and record; one batched read per
        shard, and record by record only in a shard whose batched read failed (to name the bad record)."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for position, index in enumerate(indices):
            shard, record = self.locate(int(index))
            by_shard.setdefault(shard, []).append((position, record))
        raws: list[bytes | None] = [None] * len(indices)
        for shard, items in by_shard.items():
            try:
                records = self._reader(shard).read([record for _, record in items])
            except ShardError:
                raise  # the shard itself is unusable (cannot open, wrong record count): never skipped
            except Exception:  # noqa: BLE001 - find and name the bad record one read at a time below
                records = [None] * len(items)
            for (position, _), raw in zip(items, records, strict=True):
                raws[position] = raw
        out: list[Sample | ShardError] = []
        for index, raw in zip(indices, raws, strict=True):
            try:
                if raw is None:
                    out.append(self.read_one(int(index)))
                else:
                    out.append(decode_record(raw, feature_dim=self.manifest.feature_dim, sample_index=int(index),
                                             where=self.where(int(index)), next_ids=self.manifest.target_labels,
                                             topk=self.manifest.target_topk))
            except ShardError as err:
                out.append(err)
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers = {}


def iter_shard(shard_dir: str | Path, manifest: Manifest, shard: int) -> Iterator[Sample]:
    """Every sample of shard `shard`, in order (a sequential scan, e.g. for inspection)."""
    source = RecordSource(shard_dir, manifest)
    first = shard * manifest.samples_per_shard
    try:
        for index in range(first, first + manifest.shard_samples(shard)):
            yield source.read_one(index)
    finally:
        source.close()
