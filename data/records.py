"""The record codec: one stored sample <-> the bytes of one ArrayRecord record (`encode_record`, `decode_record`).

A record is a 32-byte header (magic, version, n, feature width, dtype codes, labels, sample index, top-k
width) and the sample's raw arrays; the layout is in `encode_record`'s docstring. Storage choices:
docs/decisions.md D15.
"""

from __future__ import annotations

import dataclasses
import struct

import ml_dtypes
import numpy as np

RECORD_MAGIC = b"DFSR"
RECORD_VERSION = 1
FEATURE_DTYPE = "bfloat16"  # the features' dtype (BF16), as the manifest names it

_HEADER = struct.Struct("<4sHHIIBBBBQH2x")
HEADER_SIZE = _HEADER.size  # 32
_TOKENS_CODE, _MASK_CODE, _FEATURES_CODE = 1, 2, 3  # int32, uint8, bfloat16
# the header's labels byte: none, int32 next ids (`Sample.next_ids`), or next ids and the target's top-k
# next-token distribution (`Sample.topk_ids`, `Sample.topk_probs`; k in the header's u16 after the index)
_NO_LABELS, _NEXT_IDS_CODE, _TOPK_CODE = 0, 1, 2
TOPK_PROB_DTYPE = np.dtype("<f2")
BF16 = np.dtype(ml_dtypes.bfloat16)


class ShardError(ValueError):
    """A capture directory, manifest, shard file or record is missing, inconsistent or corrupt."""


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
    walk: np.ndarray | None = None  # not stored: serving-walk anchor weights f32 [n] the loader attaches (data.walk)


def encode_record(sample_index: int, tokens_S: np.ndarray, loss_mask_S: np.ndarray,
                  features_SxDf: np.ndarray, next_ids_S: np.ndarray | None = None,
                  topk: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """The record bytes of one sample; arrays are validated, not converted.

    `tokens_S` integer [n] (stored int32), `loss_mask_S` [n] of 0/1 values (stored uint8), `features_SxDf`
    bfloat16 [n, F*D] (any other dtype is an error: the cast belongs on device, before the transfer).
    `topk` (with `next_ids_S`): (ids integer [n, k], probabilities [n, k] in [0, 1], stored float16), the
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
    tokens_S = np.asarray(tokens_S)
    loss_mask_S = np.asarray(loss_mask_S)
    features_SxDf = np.asarray(features_SxDf)
    if features_SxDf.ndim != 2 or features_SxDf.dtype != BF16:
        raise ValueError(f"features must be bfloat16 [n, F*D]; received "
                         f"{features_SxDf.dtype}{list(features_SxDf.shape)}")
    n, feature_dim = features_SxDf.shape
    if n < 1 or feature_dim < 1:
        raise ValueError(f"features must hold at least one token and one feature; received shape {features_SxDf.shape}")
    if tokens_S.shape != (n,) or loss_mask_S.shape != (n,):
        raise ValueError(f"tokens and loss_mask must have shape [{n}] (the features' n); received "
                         f"{list(tokens_S.shape)} and {list(loss_mask_S.shape)}")
    if not np.issubdtype(tokens_S.dtype, np.integer) or (n and (tokens_S.min() < 0 or tokens_S.max() >= 2**31)):
        raise ValueError(f"tokens must be non-negative int32 ids; received {tokens_S.dtype} "
                         f"in [{tokens_S.min()}, {tokens_S.max()}]")
    if not np.isin(loss_mask_S, (0, 1)).all():
        raise ValueError(f"loss_mask must hold only 0 and 1; received values {np.unique(loss_mask_S)[:8].tolist()}")
    labels = b""
    if next_ids_S is not None:
        next_ids_S = np.asarray(next_ids_S)
        if next_ids_S.shape != (n,) or not np.issubdtype(next_ids_S.dtype, np.integer) or next_ids_S.min() < 0:
            raise ValueError(f"next_ids must be non-negative integer ids of shape [{n}]; received "
                             f"{next_ids_S.dtype}{list(next_ids_S.shape)}")
        labels = next_ids_S.astype("<i4").tobytes()
    code, k = (_NO_LABELS if next_ids_S is None else _NEXT_IDS_CODE), 0
    if topk is not None:
        ids_SxY, probs_SxY = (np.asarray(a) for a in topk)
        if next_ids_S is None or ids_SxY.ndim != 2 or ids_SxY.shape[0] != n or probs_SxY.shape != ids_SxY.shape:
            raise ValueError(f"topk must come with next_ids as (ids, probs) of one shape [{n}, k]; received "
                             f"{list(ids_SxY.shape)} and {list(probs_SxY.shape)}")
        k = ids_SxY.shape[1]
        if not 1 <= k < 2**16 or not np.issubdtype(ids_SxY.dtype, np.integer) or ids_SxY.min() < 0:
            raise ValueError(f"topk ids must be non-negative integers, 1 <= k < 65536; received {ids_SxY.dtype}, k={k}")
        if not (np.all(probs_SxY >= 0) and np.all(probs_SxY <= 1)):
            raise ValueError("topk probabilities must lie in [0, 1]")
        labels += ids_SxY.astype("<i4").tobytes() + probs_SxY.astype(TOPK_PROB_DTYPE).tobytes()
        code = _TOPK_CODE
    header = _HEADER.pack(RECORD_MAGIC, RECORD_VERSION, HEADER_SIZE, n, feature_dim, _TOKENS_CODE, _MASK_CODE,
                          _FEATURES_CODE, code, sample_index, k)
    return b"".join((header, np.ascontiguousarray(features_SxDf).tobytes(), tokens_S.astype("<i4").tobytes(),
                     labels, loss_mask_S.astype(np.uint8).tobytes()))


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


def record_tokens(record: bytes, *, where: str = "record") -> int:
    """n, the token count of a record, read from its header alone (no decode, no length check); raises
    ShardError (prefixed with `where`) when the record does not start with a valid header's magic."""
    header = _HEADER.unpack_from(record) if len(record) >= HEADER_SIZE else None
    if header is None or header[0] != RECORD_MAGIC:
        raise ShardError(f"{where}: must start with a {RECORD_MAGIC!r} header; received {bytes(record[:4])!r}")
    return header[3]
