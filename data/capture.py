"""Offline capture: run the frozen target over tokenized examples and store its features as shards.

`capture(...)` computes exactly what the trainer computes online (`models.drafter.online_features` on the
padded rows, docs/design.md §4.1: post-layer outputs of `layer_ids`, concatenated in id order), casts them to
bfloat16 on device, and writes each sample's first n (real-token) positions with its tokens and loss mask
through `data.shards.ShardWriter` (atomicity and resume rules: its docstring; the record format:
`data.records.encode_record`).

    examples (tokens int32[S], loss_mask float32[S], n)      `data.examples.build_examples` makes them
      -> shard i = samples [i*P, (i+1)*P)                      P = samples_per_shard; finished shards skipped
      -> windows of 8 batches' rows, sorted by length          longest first; samples keep their order on disk
      -> batches of `batch_size` rows, cut to `length_bucket`   the batch's longest n rounded up (<= S); the
         multiples                                              last batch padded with copies of a pad row
      -> jit(online_features(...).astype(bfloat16))             params traced, not baked in; one compile per
                                                                batch length (S / length_bucket at most)
      -> host: rows[:n] -> one record per sample, in order      one batch in flight while the last is written

Feature rows do not depend on which other rows share their batch (the target has no cross-row op), and
positions < n do not depend on the padding after them (causal attention), so the stored features equal
the online features of the same row in any training batch, up to the floating-point effects of a
different batch shape (none for SmolLM2 on the CPU backend; rare 1-2 bf16 ulps on the tiny test model when
its batches are cut shorter). That is also why a batch need not run at the full seq_len: rows of similar
length batched together and cut to the batch's longest (rounded up to `length_bucket`) skip the padding's
compute, nearly half of it on the default recipe's answers (245 of 448 tokens on average; docs/benchmarks.md
`capture_bucketed`).

With `target_labels` the same forward also runs the LM head, and each record stores the target's greedy
token after every position (`Sample.next_ids`): the labels of `data.labels: target`, which make reference
answers (not regenerated) teach the target's own choices. With `target_topk` = k it also stores the
target's k most likely next tokens and their probabilities there (`Sample.topk_ids`, `Sample.topk_probs`):
the soft labels of `data.labels: soft`.

A rerun over the same examples into the same directory resumes at the first unfinished shard; a rerun with
another target, tokenizer, layer ids, seq_len, shard size or other examples (`examples_hash`) raises a
ManifestMismatchError naming every differing field. One process captures; on a pod, give each host its
own directory and slice of the examples (the loader reads one directory).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash.data.examples import Example
from dflash.data.manifest import MANIFEST_VERSION, Manifest, Provenance
from dflash.data.progress import Progress
from dflash.data.records import FEATURE_DTYPE
from dflash.data.shards import ShardWriter, writer_options
from dflash.models.config import DecoderConfig, check_layer_ids
from dflash.models.decoder import forward
from dflash.models.drafter import concat_features, online_features


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What `capture` did: the final manifest and this run's throughput.

    shards_written / shards_kept: shards computed by this run / kept from an earlier run.
    tokens: real tokens captured by this run; seconds: wall time of this run (compile included);
    tokens_per_s = tokens / seconds; bytes_per_token: manifest's (all shards, file bytes / real tokens).
    """

    manifest: Manifest
    shards_written: int
    shards_kept: int
    tokens: int
    seconds: float
    tokens_per_s: float
    bytes_per_token: float


def examples_hash(examples: Sequence[Example]) -> str:
    """sha256 hex over every example's padded tokens (int32), loss mask (as 0/1 bytes) and n, in order."""
    digest = hashlib.sha256()
    digest.update(f"examples:{len(examples)}\x00".encode())
    for tokens_S, loss_mask_S, n in examples:
        digest.update(np.asarray(tokens_S, "<i4").tobytes())
        digest.update(np.asarray(loss_mask_S).astype(np.uint8).tobytes())
        digest.update(int(n).to_bytes(8, "little"))
    return digest.hexdigest()


def _check_examples(examples: Sequence[Example], seq_len: int) -> int | None:
    """Validate shapes, n and the 0/1 mask; return the padding id shared by all padded rows (None if none)."""
    if not examples:
        raise ValueError("examples must hold at least one example; received none (were all of them skipped?)")
    pad_ids: set[int] = set()
    for i, example in enumerate(examples):
        if len(example) != 3:
            raise ValueError(f"examples[{i}] must be (tokens[S], loss_mask[S], n); received {len(example)} items "
                             "(build them with data.examples.build_examples)")
        tokens_S, loss_mask_S, n = example
        if np.shape(tokens_S) != (seq_len,) or np.shape(loss_mask_S) != (seq_len,):
            raise ValueError(f"examples[{i}] must have tokens and loss_mask of shape [{seq_len}] (seq_len); "
                             f"received {np.shape(tokens_S)} and {np.shape(loss_mask_S)}")
        if not 1 <= int(n) <= seq_len:
            raise ValueError(f"examples[{i}] must have 1 <= n <= {seq_len} real tokens; received n={n}")
        if not np.isin(loss_mask_S, (0, 1)).all() or np.any(np.asarray(loss_mask_S)[int(n):]):
            raise ValueError(f"examples[{i}] loss_mask must be 0/1 and 0 on padding (positions >= n={n})")
        pad_ids.update(np.unique(np.asarray(tokens_S)[int(n):]).tolist())
    if len(pad_ids) > 1:
        raise ValueError(f"examples must be padded with one pad id; received {sorted(pad_ids)[:8]}")
    return pad_ids.pop() if pad_ids else None


@partial(jax.jit, static_argnames=("target_cfg", "layer_ids"))
def _features_bf16(target_params: Any, tokens_BxS: jax.Array, *, target_cfg: DecoderConfig,
                   layer_ids: tuple[int, ...]) -> jax.Array:
    """online_features cast to bfloat16 on device: [B, S, F*D] bf16 (halves the device-to-host copy)."""
    return online_features(target_params, target_cfg, tokens_BxS, layer_ids).astype(jnp.bfloat16)


@partial(jax.jit, static_argnames=("target_cfg", "layer_ids", "topk"))
def _features_and_next_ids(target_params: Any, tokens_BxS: jax.Array, *, target_cfg: DecoderConfig,
                           layer_ids: tuple[int, ...], topk: int = 0) -> tuple[jax.Array, ...]:
    """(features [B, S, F*D] bf16 as `_features_bf16`, next ids int32 [B, S]: the target's greedy token after
    each position, the argmax of its logits there) from one target forward; with `topk` = k > 0 also (ids
    int32 [B, S, k], probabilities f32 [B, S, k]): the target's k most likely next tokens there (softmax at
    temperature 1, most likely first, so ids[..., 0] is the next id)."""
    logits_BxSxV, feats_FxBxSxD = forward(jax.lax.stop_gradient(target_params), target_cfg, tokens_BxS,
                                          layer_ids=layer_ids)
    feats = concat_features(feats_FxBxSxD).astype(jnp.bfloat16)
    next_BxS = jnp.argmax(logits_BxSxV, axis=-1).astype(jnp.int32)
    if not topk:
        return feats, next_BxS
    logits_BxSxV = logits_BxSxV.astype(jnp.float32)
    top_BxSxK, ids_BxSxK = jax.lax.top_k(logits_BxSxV, topk)
    probs_BxSxK = jnp.exp(top_BxSxK - jax.nn.logsumexp(logits_BxSxV, axis=-1, keepdims=True))
    return feats, next_BxS, ids_BxSxK.astype(jnp.int32), probs_BxSxK


def capture(
    target_params: Any,
    target_cfg: DecoderConfig,
    provenance: Provenance,
    examples: Sequence[Example],
    layer_ids: Sequence[int],
    out_dir: str | Path,
    *,
    seq_len: int,
    batch_size: int,
    samples_per_shard: int,
    compression: str = "uncompressed",
    verify_existing: bool = True,
    progress: bool = True,
    target_labels: bool = False,
    target_topk: int = 0,
    length_bucket: int = 64,
) -> CaptureReport:
    """Capture target features of `examples` into `out_dir` (resuming an interrupted capture); see module.

    target_params / target_cfg: the frozen target, as `online_features` takes them (their dtype is the
      compute dtype; features are cast to bf16 after).
    provenance: `Provenance.of_target(target)` (or `.of(name, weights fingerprint, tokenizer)`).
    examples: (tokens int32[S], loss_mask float32[S], n) rows with S == seq_len (`data.examples.build_examples`).
    verify_existing: on resume, re-hash kept shards (sha256) rather than only checking their sizes.
    target_labels: also store the target's greedy next token at every position (`data.labels: target`;
      the same forward, with the LM head).
    target_topk: also store the target's k most likely next tokens and their probabilities at every position
      (`data.labels: soft`; implies target_labels).
    length_bucket: a batch runs at its longest row's length rounded up to a multiple of this (at most seq_len),
      with rows of similar length batched together; 0 = every batch at seq_len. The stored records are the
      same up to the rounding of another batch shape (docs/decisions.md D36).
    """
    if target_topk < 0:
        raise ValueError(f"target_topk must be >= 0; received {target_topk}")
    if length_bucket < 0:
        raise ValueError(f"length_bucket must be >= 0 (0 = every batch at seq_len); received {length_bucket}")
    target_labels = target_labels or target_topk > 0
    layer_ids = check_layer_ids(tuple(layer_ids), target_cfg.num_layers)
    if batch_size <= 0 or samples_per_shard <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size, samples_per_shard and seq_len must be > 0; received {batch_size}, "
                         f"{samples_per_shard}, {seq_len}")
    pad_id = _check_examples(examples, seq_len)
    header = _manifest_header(provenance, target_cfg, examples, layer_ids, seq_len=seq_len, pad_id=pad_id,
                              samples_per_shard=samples_per_shard, compression=compression,
                              target_labels=target_labels, target_topk=target_topk)
    start = time.perf_counter()
    writer = ShardWriter(out_dir, header, verify=verify_existing)
    pending = writer.pending
    shard_tokens = [sum(int(n) for _, _, n in examples[i * samples_per_shard:(i + 1) * samples_per_shard])
                    for i in range(header.num_shards)]
    todo = sum(shard_tokens[i] for i in pending)
    bar = Progress(sum(shard_tokens), initial=sum(shard_tokens) - todo, enabled=progress, unit="tok",
                   unit_scale=True, desc="capture")
    filler = np.full(seq_len, pad_id if pad_id is not None else 0, np.int32)
    featurize = (partial(_features_and_next_ids, target_params, target_cfg=target_cfg, layer_ids=layer_ids,
                         topk=target_topk) if target_labels
                 else partial(_features_bf16, target_params, target_cfg=target_cfg, layer_ids=layer_ids))
    try:
        for shard in pending:
            lo = shard * samples_per_shard
            rows = list(range(lo, min(lo + samples_per_shard, len(examples))))
            with writer.shard(shard) as out:
                _capture_shard(out, examples, rows, featurize, filler, batch_size, bar, length_bucket)
        manifest = writer.finish()
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    return CaptureReport(manifest=manifest, shards_written=len(pending), shards_kept=len(writer.kept), tokens=todo,
                         seconds=seconds, tokens_per_s=todo / seconds if seconds > 0 else 0.0,
                         bytes_per_token=manifest.bytes_per_token)


def _manifest_header(provenance: Provenance, target_cfg: DecoderConfig, examples: Sequence[Example],
                     layer_ids: tuple[int, ...], *, seq_len: int, pad_id: int | None, samples_per_shard: int,
                     compression: str, target_labels: bool = False, target_topk: int = 0) -> Manifest:
    """The manifest of this capture before any shard is written (incomplete, no shards, no totals)."""
    num_samples = len(examples)
    return Manifest(
        format_version=MANIFEST_VERSION, complete=False, target_name=provenance.target_name,
        target_fingerprint=provenance.target_fingerprint, tokenizer_fingerprint=provenance.tokenizer_fingerprint,
        chat_template_hash=provenance.chat_template_hash, layer_ids=layer_ids, hidden_size=target_cfg.hidden_size,
        feature_dim=len(layer_ids) * target_cfg.hidden_size, feature_dtype=FEATURE_DTYPE, seq_len=seq_len,
        pad_id=pad_id, examples_hash=examples_hash(examples), num_samples=num_samples,
        samples_per_shard=samples_per_shard, num_shards=-(-num_samples // samples_per_shard),
        writer_options=writer_options(compression), total_tokens=0, bytes_per_token=0.0, shards=(), created={},
        target_labels=target_labels, target_topk=target_topk)


SORT_WINDOW_BATCHES = 8  # rows are sorted by length within windows of this many batches (bounds the host buffer)


def _length_batches(examples: Sequence[Example], rows: list[int], batch_size: int, seq_len: int,
                    length_bucket: int) -> list[tuple[list[int], int]]:
    """(rows, length) of each batch of one shard: within each window of SORT_WINDOW_BATCHES batches' rows, the
    rows longest first (ties in order), cut into batches of `batch_size` that run at their longest row's n
    rounded up to a multiple of `length_bucket` (at most seq_len). length_bucket 0: the rows in order, at
    seq_len."""
    if not length_bucket:
        return [(rows[b:b + batch_size], seq_len) for b in range(0, len(rows), batch_size)]
    window = SORT_WINDOW_BATCHES * batch_size
    plan = []
    for w in range(0, len(rows), window):
        ordered = sorted(rows[w:w + window], key=lambda i: -int(examples[i][2]))
        for b in range(0, len(ordered), batch_size):
            chunk = ordered[b:b + batch_size]
            longest = max(int(examples[i][2]) for i in chunk)
            plan.append((chunk, min(seq_len, -(-longest // length_bucket) * length_bucket)))
    return plan


def _capture_shard(out: Any, examples: Sequence[Example], rows: list[int], featurize: Callable[[np.ndarray], Any],
                   filler: np.ndarray, batch_size: int, bar: Any, length_bucket: int) -> None:
    """Write the samples `rows` of one shard, in order: batches of `_length_batches` (the last padded with
    `filler`), one batch's features computed on device while the previous one is fetched; a fetched row waits
    on the host until every row before it is written."""
    ready: dict[int, tuple] = {}
    written = 0

    def fetched(chunk: list[int], feats: Any) -> None:
        nonlocal written
        ready.update(_fetch_batch(examples, chunk, feats))
        while written < len(rows) and rows[written] in ready:
            i = rows[written]
            tokens_S, loss_mask_S, n = examples[i]
            n = int(n)
            out.write(np.asarray(tokens_S[:n], np.int32), np.asarray(loss_mask_S[:n]), *ready.pop(i))
            bar.update(n)
            written += 1

    in_flight: tuple[list[int], Any] | None = None
    for chunk, length in _length_batches(examples, rows, batch_size, len(filler), length_bucket):
        tokens_BxL = np.stack([np.asarray(examples[i][0][:length], np.int32) for i in chunk]
                              + [filler[:length]] * (batch_size - len(chunk)))
        feats = featurize(tokens_BxL)
        if in_flight is not None:
            fetched(*in_flight)
        in_flight = (chunk, feats)
    if in_flight is not None:
        fetched(*in_flight)


def _fetch_batch(examples: Sequence[Example], chunk: list[int], feats: Any) -> dict[int, tuple]:
    """One batch's features (and next ids, with target labels; and the top-k) on the host: for each of its
    rows, the (features, next ids, top-k) of its first n positions, as `out.write` takes them after the
    tokens and mask."""
    feats_BxLxFD, next_BxL, *topk = feats if isinstance(feats, tuple) else (feats, None)
    host = np.asarray(feats_BxLxFD)
    next_host = None if next_BxL is None else np.asarray(next_BxL)
    ids_host, probs_host = (np.asarray(a) for a in topk) if topk else (None, None)
    rows = {}
    for row, i in enumerate(chunk):
        n = int(examples[i][2])
        rows[i] = (host[row, :n], None if next_host is None else next_host[row, :n],
                   None if ids_host is None else (ids_host[row, :n], probs_host[row, :n]))
    return rows
