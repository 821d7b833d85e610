"""Offline capture: run the frozen target over tokenized examples and store its features as shards.

`capture(...)` computes exactly what the trainer computes online (`models.drafter.online_features` on the
padded rows, docs/design.md §4.1: post-layer outputs of `layer_ids`, concatenated in id order), casts them to
bfloat16 on device, and writes each sample's first n (real-token) positions with its tokens and loss mask
through `data.shards.ShardWriter` (atomicity and resume rules: its docstring; the record format:
`data.records.encode_record`).

    examples (tokens int32[S], loss_mask float32[S], n)      `data.examples.build_examples` makes them
      -> shard i = samples [i*P, (i+1)*P)                      P = samples_per_shard, or fewer so a shard averages
                                                                about SHARD_BYTES (`shard_samples`); finished
                                                                shards skipped
      -> windows of 8 batches' rows, sorted by length          longest first; samples keep their order on disk
      -> batches of `batch_size` rows, cut to `length_bucket`   the batch's longest n rounded up (<= S); the
         multiples                                              last batch padded with copies of a pad row
      -> batch k to replica k % R                              R device groups (`devices`), 2 batches in flight each
      -> jit(online_features(...).astype(bfloat16))             params traced, not baked in; one compile per
                                                                batch length (S / length_bucket at most) and replica
      -> host: rows[:n] -> one record per sample, in order      the next batch runs while the last is fetched

Feature rows do not depend on which other rows share their batch (the target has no cross-row op), and
positions < n do not depend on the padding after them (causal attention), so the stored features equal
the online features of the same row in any training batch, up to the floating-point effects of a
different batch shape (none for SmolLM2 on the CPU backend; rare 1-2 bf16 ulps on the tiny test model when
its batches are cut shorter). That is also why a batch need not run at the full seq_len: rows of similar
length batched together and cut to the batch's longest (rounded up to `length_bucket`) skip the padding's
compute, nearly half of it on the default recipe's answers (245 of 448 tokens on average; docs/benchmarks.md
`capture_bucketed`).

At scale (docs/decisions.md D82), the same plan of batches runs on every topology:
- a host's devices: each batch runs whole on one replica of the target, on its own thread: a device holding a
  copy of the weights, or a group of devices holding them split in tensor parallel (`models.sharding`'s table on
  a tensor mesh, as the engine's `Limits.devices`) for a target larger than one chip. A batch has the shape it
  has on one device, so replicas of one device store byte-identical shards; a split replica's features differ
  by the rounding of its all-reduce (within 2 bf16 ulps, ~0.1% of values on the tiny test model; labels equal).
- hosts: process p of P captures the shards i with i % P == p into the one shared directory (its state in
  parts/, `data.shards.ShardWriter`), resumes on its own, and process 0 writes the manifest once every share is
  finished (`data.shards.merge_shares`, after a barrier: `data.stages.run_capture`).
- before it starts, the capture logs what it will write (tokens x the layout's bytes per token, records and
  shards: `write_estimate`) and refuses (OSError) when the destination's free space cannot hold it.

With `target_labels` the same forward also runs the LM head, and each record stores the target's greedy
token after every position (`Sample.next_ids`): the labels of `data.labels: target`, which make reference
answers (not regenerated) teach the target's own choices. With `target_topk` = k it also stores the
target's k most likely next tokens and their probabilities there (`Sample.topk_ids`, `Sample.topk_probs`):
the soft labels of `data.labels: soft`.

A rerun over the same examples into the same directory resumes at the first unfinished shard (of any
topology); a rerun with another target, tokenizer, layer ids, seq_len, shard size or other examples
(`examples_hash`) raises a ManifestMismatchError naming every differing field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash.data.examples import Example
from dflash.data.manifest import MANIFEST_NAME, MANIFEST_VERSION, Manifest, Provenance, read_manifest_file
from dflash.data.progress import Progress
from dflash.data.records import FEATURE_DTYPE, HEADER_SIZE, ShardError, record_size
from dflash.data.shards import ShardWriter, part_state_files, shard_index, writer_options
from dflash.models.config import DecoderConfig, check_layer_ids
from dflash.models.decoder import forward
from dflash.models.drafter import concat_features, online_features
from dflash.models.placement import log_memory_per_device
from dflash.models.sharding import TARGET_RULES, place, replicated, tensor_mesh
from dflash.models.target import Target

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 30  # about the most a shard holds on average: a bucket object of a size GCS and gcsfuse move well


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
    logits_BxSxV, feats_FxBxSxDt = forward(jax.lax.stop_gradient(target_params), target_cfg, tokens_BxS,
                                          layer_ids=layer_ids)
    feats = concat_features(feats_FxBxSxDt).astype(jnp.bfloat16)
    next_BxS = jnp.argmax(logits_BxSxV, axis=-1).astype(jnp.int32)
    if not topk:
        return feats, next_BxS
    logits_BxSxV = logits_BxSxV.astype(jnp.float32)
    top_BxSxY, ids_BxSxY = jax.lax.top_k(logits_BxSxV, topk)
    probs_BxSxY = jnp.exp(top_BxSxY - jax.nn.logsumexp(logits_BxSxV, axis=-1, keepdims=True))
    return feats, next_BxS, ids_BxSxY.astype(jnp.int32), probs_BxSxY


@dataclasses.dataclass(frozen=True)
class CaptureFormat:
    """What a capture's shards hold and how they are cut (its manifest records them; a resume must match).

    seq_len: the rows' length S (`data.seq_len`).
    samples_per_shard / shard_bytes: a shard holds at most `samples_per_shard` samples, fewer when that many would
      take more than about `shard_bytes` bytes on average (`shard_samples`; the manifest records the size used).
    compression: the ArrayRecord shards' compression.
    target_labels: also store the target's greedy next token at every position (`data.labels: target`;
      the same forward, with the LM head).
    target_topk: also store the target's k most likely next tokens and their probabilities at every position
      (`data.labels: soft`; implies target_labels).
    """

    seq_len: int
    samples_per_shard: int
    compression: str = "uncompressed"
    target_labels: bool = False
    target_topk: int = 0
    shard_bytes: int = SHARD_BYTES


@dataclasses.dataclass(frozen=True)
class CaptureRun:
    """How a capture runs; none of it changes what the shards hold.

    batch_size: rows per target forward.
    length_bucket: a batch runs at its longest row's length rounded up to a multiple of this (at most seq_len),
      with rows of similar length batched together; 0 = every batch at seq_len. The stored records are the
      same up to the rounding of another batch shape (docs/decisions.md D36).
    devices: the replicas' device groups (`data.scaleout.local_devices`): each batch runs whole on one replica, the
      target's weights on each one-device group or split over a larger group in tensor parallel; None: the default
      device.
    share: (p, P): capture only the shards i with i % P == p into the shared `out_dir` (its state under parts/);
      `merge_shares(out_dir, P)` completes the capture once every share is finished. The report's manifest is
      then this share's state.
    verify_existing: on resume, re-hash kept shards (sha256) rather than only checking their sizes.
    progress / label: the progress bar, and its and the log lines' name.
    """

    batch_size: int
    length_bucket: int = 64
    devices: Sequence[Sequence[Any]] | None = None
    share: tuple[int, int] = (0, 1)
    verify_existing: bool = True
    progress: bool = True
    label: str = "capture"


def capture(target_params: Any, target_cfg: DecoderConfig, provenance: Provenance, examples: Sequence[Example],
            layer_ids: Sequence[int], out_dir: str | Path, *, fmt: CaptureFormat, run: CaptureRun) -> CaptureReport:
    """Capture target features of `examples` into `out_dir` (resuming an interrupted capture) in `fmt`, run as
    `run` says; see module.

    target_params / target_cfg: the frozen target, as `online_features` takes them (their dtype is the
      compute dtype; features are cast to bf16 after), or a `models.target.Target` (`target_params`), whose weights
      each replica reads straight onto its devices (`Target.on_group`).
    provenance: `Provenance.of_target(target)` (or `.of(name, weights fingerprint, tokenizer)`).
    examples: (tokens int32[S], loss_mask float32[S], n) rows with S == fmt.seq_len (`data.examples.build_examples`).
    """
    seq_len, samples_per_shard, compression = fmt.seq_len, fmt.samples_per_shard, fmt.compression
    target_labels, target_topk, shard_bytes = fmt.target_labels, fmt.target_topk, fmt.shard_bytes
    batch_size, length_bucket, devices, share = run.batch_size, run.length_bucket, run.devices, run.share
    verify_existing, progress, label = run.verify_existing, run.progress, run.label
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
    per_token = record_size(1, len(layer_ids) * target_cfg.hidden_size, target_labels, target_topk) - HEADER_SIZE
    sized = shard_samples(examples, samples_per_shard, per_token, shard_bytes)
    if sized < samples_per_shard:
        log.info("%s: shards of %d samples (at most %d by samples_per_shard; about %s each at %s a sample on "
                 "average)", label, sized, samples_per_shard, _size(sized * _mean_record(examples, per_token)),
                 _size(_mean_record(examples, per_token)))
    header = _manifest_header(provenance, target_cfg, examples, layer_ids, seq_len=seq_len, pad_id=pad_id,
                              samples_per_shard=sized, compression=compression,
                              target_labels=target_labels, target_topk=target_topk)
    start = time.perf_counter()
    writer = ShardWriter(out_dir, header, verify=verify_existing, share=share)
    pending = writer.pending
    shard_rows = [range(i * sized, min((i + 1) * sized, len(examples))) for i in range(header.num_shards)]
    shard_tokens = [sum(int(examples[r][2]) for r in rows) for rows in shard_rows]
    check_free_space(writer.out_dir, write_estimate(header, examples, _unfinished(writer)),
                     label=label, share_bytes=write_estimate(header, examples, pending) if share[1] > 1 else None)
    todo = sum(shard_tokens[i] for i in pending)
    mine = sum(shard_tokens[i] for i in writer.mine)
    bar = Progress(mine, initial=mine - todo, enabled=progress, unit="tok", unit_scale=True, desc=label)
    filler = np.full(seq_len, pad_id if pad_id is not None else 0, np.int32)
    replicas = _start_replicas(target_params, target_cfg, layer_ids, target_labels, target_topk, devices, examples)
    try:
        plan = [(shard, chunk, length) for shard in pending
                for chunk, length in _length_batches(examples, list(shard_rows[shard]), batch_size, seq_len,
                                                     length_bucket)]
        try:
            _run_plan(writer, plan, shard_rows, examples, replicas, filler, batch_size, bar)
        except BaseException:
            writer.save()  # the shards finished so far, listed before the error goes up
            raise
        manifest = writer.finish()
    finally:
        for replica in replicas:
            replica.stop()
        bar.close()
    seconds = time.perf_counter() - start
    return CaptureReport(manifest=manifest, shards_written=len(pending), shards_kept=len(writer.kept), tokens=todo,
                         seconds=seconds, tokens_per_s=todo / seconds if seconds > 0 else 0.0,
                         bytes_per_token=manifest.bytes_per_token)


def _mean_record(examples: Sequence[Example], per_token: int) -> float:
    return sum(int(e[2]) for e in examples) / len(examples) * per_token + HEADER_SIZE + RECORD_OVERHEAD


def shard_samples(examples: Sequence[Example], samples_per_shard: int, per_token: int,
                  shard_bytes: int = SHARD_BYTES) -> int:
    """Samples per shard: `samples_per_shard`, or fewer so that a shard of average samples holds about `shard_bytes`
    (at least one). A function of the examples and the layout only, so every process and every resume of the
    capture shards it alike (a Qwen3-8B layout, 41 KB a token: about 25 samples of 1,000 tokens, not 256 (10 GB))."""
    return max(1, min(samples_per_shard, int(shard_bytes // _mean_record(examples, per_token))))


def _unfinished(writer: ShardWriter) -> list[int]:
    """Every shard of the capture not finished yet as far as this writer can tell: its own pending shards, and the
    other shares' shards that no state file lists (their files are theirs to check)."""
    listed = set(writer.entries)
    for path in [writer.out_dir / MANIFEST_NAME, *part_state_files(writer.out_dir)]:
        if path.is_file() and path.suffix == ".json":
            try:
                listed |= {shard_index(e.file) for e in read_manifest_file(path).shards}
            except (ShardError, ValueError):
                continue  # another process replacing its state: counted as unfinished, an overestimate
    mine, pending = set(writer.mine), set(writer.pending)
    return [i for i in range(writer.manifest().num_shards) if i in pending or (i not in mine and i not in listed)]


# ----------------------------------------------------------------------------- disk space

RECORD_OVERHEAD = 64  # bytes a record costs in an ArrayRecord file beyond its own (chunk header, index entry)
SHARD_OVERHEAD = 128 << 10  # bytes a shard file costs beyond its records (Riegeli's 64 KiB blocks, footer)
FREE_MARGIN = 0.02  # refuse unless free space holds the estimate plus this fraction ...
FREE_RESERVE = 16 << 20  # ... plus this many bytes (manifests, the shard being written)


def bytes_per_token(manifest: Manifest) -> int:
    """Bytes one token takes in a record of `manifest`'s layout: bf16 features, int32 token, uint8 mask, and the
    int32 next id and the top-k's int32 ids and float16 probabilities when stored (`data.records.record_size`)."""
    return record_size(1, manifest.feature_dim, manifest.target_labels, manifest.target_topk) - HEADER_SIZE


@dataclasses.dataclass(frozen=True)
class WriteEstimate:
    """What a capture will write: `tokens` in `samples` records over `shards` files, `bytes` at most (uncompressed:
    tokens x per_token + samples x (32-byte header + RECORD_OVERHEAD) + shards x SHARD_OVERHEAD)."""

    shards: int
    samples: int
    tokens: int
    per_token: int
    bytes: int


def write_estimate(manifest: Manifest, examples: Sequence[Example], shards: Sequence[int]) -> WriteEstimate:
    """The bytes the records of `shards` take on disk at most (`WriteEstimate`)."""
    rows = [r for i in shards for r in range(i * manifest.samples_per_shard,
                                             i * manifest.samples_per_shard + manifest.shard_samples(i))]
    tokens = sum(int(examples[r][2]) for r in rows)
    per_token = bytes_per_token(manifest)
    total = tokens * per_token + len(rows) * (HEADER_SIZE + RECORD_OVERHEAD) + len(shards) * SHARD_OVERHEAD
    return WriteEstimate(shards=len(shards), samples=len(rows), tokens=tokens, per_token=per_token, bytes=total)


def check_free_space(out_dir: Path, estimate: WriteEstimate, *, label: str = "capture",
                     share_bytes: WriteEstimate | None = None) -> None:
    """Log what the capture will write into `out_dir` and raise OSError, naming the numbers, when the free space
    there (`shutil.disk_usage`) cannot hold it with a margin (FREE_MARGIN, FREE_RESERVE)."""
    free = shutil.disk_usage(out_dir).free
    need = int(estimate.bytes * (1 + FREE_MARGIN)) + FREE_RESERVE
    mine = (f"; this process's share: {share_bytes.shards} shards, {_size(share_bytes.bytes)}"
            if share_bytes is not None else "")
    log.info("%s: writes %d shards, %d samples, %s tokens x %d bytes/token (+ %d bytes a record, %d KiB a shard) = "
             "%s at most into %s, which has %s free%s", label, estimate.shards, estimate.samples,
             f"{estimate.tokens:,}", estimate.per_token, HEADER_SIZE + RECORD_OVERHEAD, SHARD_OVERHEAD >> 10,
             _size(estimate.bytes), out_dir, _size(free), mine)
    if estimate.shards and free < need:
        raise OSError(f"{out_dir}: free space must hold the capture's {_size(estimate.bytes)} ({estimate.tokens:,} "
                      f"tokens x {estimate.per_token} bytes/token, {estimate.samples} records in {estimate.shards} "
                      f"shards) with a {FREE_MARGIN:.0%} + {FREE_RESERVE >> 20} MiB margin ({_size(need)}); received "
                      f"{_size(free)} free (free space, capture fewer rows or a narrower layout, or point data.dir "
                      "elsewhere)")


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"


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


class _Replica(threading.Thread):
    """The target on one device group, computing the batches put in its inbox on its own thread (JAX releases the
    GIL while devices run, and compiles in parallel): a batch is dispatched before the previous one is fetched to the
    host, then `(key, rows)` (`_fetch_batch`) goes to `results`; an error goes there as `(None, error)`."""

    def __init__(self, index: int, featurize: Callable[[np.ndarray], Any], examples: Sequence[Example],
                 results: queue.Queue):
        super().__init__(name=f"capture-replica-{index}", daemon=True)
        self.featurize, self.examples, self.results = featurize, examples, results
        self.inbox: queue.Queue = queue.Queue()

    def run(self) -> None:
        in_flight = None
        try:
            while True:
                try:
                    item = self.inbox.get(block=in_flight is None)
                except queue.Empty:  # nothing more queued: fetch what runs now
                    self._fetch(in_flight)
                    in_flight = None
                    continue
                if item is None:
                    return
                key, chunk, tokens_BxS = item
                feats = self.featurize(tokens_BxS)
                if in_flight is not None:
                    self._fetch(in_flight)
                in_flight = (key, chunk, feats)
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, which stops the capture
            self.results.put((None, err))

    def _fetch(self, in_flight: tuple) -> None:
        key, chunk, feats = in_flight
        self.results.put((key, _fetch_batch(self.examples, chunk, feats)))

    def stop(self) -> None:
        self.inbox.put(None)
        self.join(timeout=60)


def _start_replicas(target_params: Any, target_cfg: DecoderConfig, layer_ids: tuple[int, ...], target_labels: bool,
                    target_topk: int, devices: Sequence[Sequence[Any]] | None,
                    examples: Sequence[Example]) -> list[_Replica]:
    """One `_Replica` per device group (one on the default device for None), sharing one results queue: the
    target's weights on a one-device group, or placed over a larger group by the models' sharding table
    (`models.sharding.TARGET_RULES` on a tensor mesh, as the engine's `Limits.devices`) with the batch replicated.
    A `Target` is read straight onto each group (`Target.on_group`: no device holds more than its group's share);
    params are copied there. The memory each device then holds is logged."""
    results: queue.Queue = queue.Queue()
    replicas = []
    loaded = isinstance(target_params, Target)
    for index, group in enumerate([None] if devices is None else [tuple(g) for g in devices]):
        if group is None:
            params, put = target_params.params if loaded else target_params, (lambda x: x)
        elif len(group) == 1:
            params = target_params.on_group(group) if loaded else jax.device_put(target_params, group[0])
            put = partial(jax.device_put, device=group[0])
        else:
            mesh = tensor_mesh(group)
            params = target_params.on_group(group) if loaded else place(target_params, TARGET_RULES, mesh)
            put = partial(jax.device_put, device=replicated(mesh))
        step = (partial(_features_and_next_ids, params, target_cfg=target_cfg, layer_ids=layer_ids, topk=target_topk)
                if target_labels else partial(_features_bf16, params, target_cfg=target_cfg, layer_ids=layer_ids))
        replicas.append(_Replica(index, lambda tokens, step=step, put=put: step(put(tokens)), examples, results))
    if not replicas:
        raise ValueError("devices must name at least one device group; received none")
    log_memory_per_device("capture")  # every replica's target, before the first batch
    for replica in replicas:
        replica.start()
    return replicas


def _run_plan(writer: ShardWriter, plan: list[tuple[int, list[int], int]], shard_rows: list[range],
              examples: Sequence[Example], replicas: list[_Replica], filler: np.ndarray, batch_size: int,
              bar: Any) -> None:
    """Write the shards of `plan` ((shard, rows, length) batches, shard by shard, `_length_batches`'s order) in
    order: batch k goes to replica k % R (the last batch of a shard padded with `filler`), at most 2 per replica
    in flight; each shard's samples are written in their order as their batches come back, and the shard is
    committed once its last sample is written."""
    results = replicas[0].results
    window = 2 * len(replicas)
    done: dict[int, dict[int, tuple]] = {}
    ready: dict[int, tuple] = {}
    sent = written = 0
    out = None
    try:
        for taken, (shard, _, _) in enumerate(plan):
            while sent < len(plan) and sent - taken < window:
                _, chunk, length = plan[sent]
                tokens_BxS = np.stack([np.asarray(examples[i][0][:length], np.int32) for i in chunk]
                                      + [filler[:length]] * (batch_size - len(chunk)))
                replicas[sent % len(replicas)].inbox.put((sent, chunk, tokens_BxS))
                sent += 1
            while taken not in done:
                key, value = results.get()
                if key is None:
                    raise value
                done[key] = value
            if out is None:
                out, ready, written = writer.shard(shard).__enter__(), {}, 0
            ready.update(done.pop(taken))
            rows = shard_rows[shard]
            while written < len(rows) and rows[written] in ready:
                i = rows[written]
                tokens_S, loss_mask_S, n = examples[i]
                n = int(n)
                out.write(np.asarray(tokens_S[:n], np.int32), np.asarray(loss_mask_S[:n]), *ready.pop(i))
                bar.update(n)
                written += 1
            if written == len(rows):
                closing, out = out, None
                closing.__exit__(None, None, None)  # commits the shard
    except BaseException as err:
        if out is not None:
            out.__exit__(type(err), err, err.__traceback__)  # drops the shard in progress
        raise


def _fetch_batch(examples: Sequence[Example], chunk: list[int], feats: Any) -> dict[int, tuple]:
    """One batch's features (and next ids, with target labels; and the top-k) on the host: for each of its
    rows, the (features, next ids, top-k) of its first n positions, as `out.write` takes them after the
    tokens and mask."""
    feats_BxSxDf, next_BxS, *topk = feats if isinstance(feats, tuple) else (feats, None)
    host = np.asarray(feats_BxSxDf)
    next_host = None if next_BxS is None else np.asarray(next_BxS)
    ids_host, probs_host = (np.asarray(a) for a in topk) if topk else (None, None)
    rows = {}
    for row, i in enumerate(chunk):
        n = int(examples[i][2])
        rows[i] = (host[row, :n], None if next_host is None else next_host[row, :n],
                   None if ids_host is None else (ids_host[row, :n], probs_host[row, :n]))
    return rows
