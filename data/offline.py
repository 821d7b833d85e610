"""The offline-mode input pipeline: captured shards (`data.shards`) -> a Grain iterator of `data.batch.TrainBatch`es
holding tokens, mask and the stored target features (and, as the capture stored them, the target's labels),
instead of running the target in the train step.

    indices -> shuffle(seed) -> repeat -> global batch -> HostRows -> ReadSamples -> PadAndStack [-> mp_prefetch]
    packed:   PackedRows(seed) -> global batch of rows -> HostRows -> ReadPacked -> PackAndStack [-> mp_prefetch]

The batches equal online mode's (`data.online.make_batches`) for the same examples, seed, batch size and
sharding (contract: `make_offline_batches`; state: `OfflineBatches`). Packed, each row holds as many whole
conversations as fit, told apart by `segment_ids` (`PackedRows`, docs/decisions.md D32). Design and the Grain
behaviour relied on: docs/decisions.md D15.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys
from pathlib import Path
from typing import Any

import grain
import numpy as np

from dflash.data.batch import BatchLayout, SoftLabels, TargetLabels, TrainBatch
from dflash.data.manifest import Manifest, load_manifest
from dflash.data.records import BF16, Sample, ShardError
from dflash.data.shards import RecordSource

_BAD = "bad_records"
Counted = tuple[TrainBatch, int]  # a batch and the number of bad records replaced by padding in it


# ----------------------------------------------------------------------------- transforms


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How one run reads stored features: `dflash train`'s flags, not the recipe's (what a machine does with the
    shards, not what the drafter trains on). workers: Grain worker processes (0: in the trainer process);
    skip_bad_records: a record that fails to read becomes a padding row, counted, instead of stopping the run;
    verify: check every shard's sha256 before the first step (slow on large captures; sizes are always checked)."""

    workers: int = 0
    skip_bad_records: bool = False
    verify: bool = False

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"--loader-workers must be >= 0 (0: read in the trainer process); received {self.workers}")


@dataclasses.dataclass(frozen=True)
class HostShare:
    """Host `index` of `count` reading one global batch: it reads rows [index*B, (index+1)*B) of every global batch
    of B * count rows (`make_offline_batches`; a multi-host run: the JAX process index and count)."""

    index: int = 0
    count: int = 1


@dataclasses.dataclass(frozen=True)
class HostRows(grain.transforms.Map):
    """Global batch of sample indices int64[B * hosts] -> this host's contiguous rows [i*B, (i+1)*B)."""

    shard_index: int
    batch_size: int

    def map(self, indices_Bg: Any) -> Any:
        """Works on an index array and on a list of packed rows alike (a plain slice)."""
        return indices_Bg[self.shard_index * self.batch_size:(self.shard_index + 1) * self.batch_size]


@dataclasses.dataclass(frozen=True)
class ReadSamples(grain.transforms.Map):
    """Sample indices [B] -> list of decoded `Sample`s (or, with `skip_bad_records`, None for a bad record).

    Without skipping, the first bad record's ShardError (shard file and record index) propagates.
    """

    source: RecordSource
    skip_bad_records: bool
    walk: dict[int, np.ndarray] | None = None  # data.walk: serving-walk anchor weights by sample index

    def map(self, indices_B: np.ndarray) -> list[Sample | None]:
        samples = self.source.read_or_errors([int(i) for i in indices_B])
        out: list[Sample | None] = []
        for index, sample in zip(indices_B, samples, strict=True):
            if isinstance(sample, ShardError):
                if not self.skip_bad_records:
                    raise sample
                out.append(None)
            elif self.walk is not None:
                out.append(dataclasses.replace(sample, walk=self.walk.get(int(index))))
            else:
                out.append(sample)
        return out


@dataclasses.dataclass(frozen=True)
class PadAndStack(grain.transforms.Map):
    """Samples -> (the `TrainBatch` of `layout`, the number of bad records in it): each sample cut to `seq_len` and
    padded after its n tokens (pad_id, mask 0, features 0, next ids -1, soft labels 0), written straight into the
    batch arrays (one copy of the features). A bad record (None) becomes a whole padding row (no anchor, no loss).

    Online mode would hold the target's features of the pad tokens there; no loss term reads them (anchors
    need loss_mask = 1, context keys are strictly before the anchor: docs/design.md §4.2), so the two modes train
    identically. A `seq_len` below the capture's cuts rows exactly as tokenizing with that max_len would
    (features are causal)."""

    seq_len: int
    pad_id: int
    layout: BatchLayout

    def map(self, samples: list[Sample | None]) -> Counted:
        batch = _empty_batch(dataclasses.replace(self.layout, batch_size=len(samples)), self.pad_id)
        for i, sample in enumerate(samples):
            if sample is not None:
                _put(batch, i, 0, sample, min(len(sample.tokens), self.seq_len))
        return batch, sum(sample is None for sample in samples)


def _empty_batch(layout: BatchLayout, pad_id: int) -> TrainBatch:
    """A batch of `layout` whose rows are all padding (pad_id, mask 0, features 0, next ids -1, soft ids and
    probabilities 0)."""
    b, length = layout.batch_size, layout.seq_len
    labels: TargetLabels | SoftLabels | None = None
    if layout.labels == "target":
        labels = TargetLabels(next_ids=np.full((b, length), -1, np.int32))
    elif layout.labels == "soft":
        labels = SoftLabels(next_ids=np.full((b, length), -1, np.int32),
                            ids=np.zeros((b, length, layout.soft_topk), np.int32),
                            probs=np.zeros((b, length, layout.soft_topk), np.float32))
    return TrainBatch(tokens=np.full((b, length), pad_id, np.int32), loss_mask=np.zeros((b, length), np.float32),
                      features=np.zeros((b, length, layout.feature_dim), BF16),
                      segment_ids=np.zeros((b, length), np.int32) if layout.packed else None, labels=labels,
                      walk=np.zeros((b, length), np.float32) if layout.walk else None)


def _put(batch: TrainBatch, row: int, at: int, sample: Sample, n: int) -> None:
    """Write the first n positions of `sample` into `row` of `batch` from position `at` (one copy of each)."""
    batch.tokens[row, at:at + n] = sample.tokens[:n]
    batch.loss_mask[row, at:at + n] = sample.loss_mask[:n]
    batch.features[row, at:at + n] = sample.features[:n]
    if batch.labels is not None:
        batch.labels.next_ids[row, at:at + n] = sample.next_ids[:n]
    if isinstance(batch.labels, SoftLabels):
        batch.labels.ids[row, at:at + n] = sample.topk_ids[:n]
        batch.labels.probs[row, at:at + n] = sample.topk_probs[:n]
    if batch.walk is not None and sample.walk is not None:  # walk positions move with the row offset `at`
        batch.walk[row, at:at + n] = sample.walk[:n]


# ----------------------------------------------------------------------------- packing


class PackedRows:
    """An endless, random-access sequence of packed rows: row r is an int64 array of the sample indices it
    holds, in order, whose lengths sum to at most `row_len` (cut the lengths to the training `seq_len` first).

    Epoch e permutes every sample with `numpy.random.default_rng([seed, e])`, packs each window of `window`
    consecutive samples of that order first-fit decreasing (longest first, each into the first open row it
    fits), and shuffles that epoch's rows with the same generator; so every sample appears once per epoch,
    a row never splits a conversation, and the rows depend only on (lengths, row_len, seed, window). Epochs
    are planned lazily when a row of theirs is first asked for (the plan of one epoch is kept at a time;
    only the row counts of earlier epochs are stored), so `rows[k:]` for resume costs one plan per epoch
    before k. Grain's worker processes each plan their own.
    """

    def __init__(self, lengths: np.ndarray, row_len: int, seed: int, window: int = 256) -> None:
        lengths = np.asarray(lengths, np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or lengths.min() < 1 or lengths.max() > row_len:
            raise ValueError(f"lengths must be a non-empty 1-D array of token counts in [1, row_len={row_len}]; "
                             f"received {lengths!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1; received {window}")
        self.lengths, self.row_len, self.seed, self.window = lengths, row_len, seed, window
        self._starts = [0]  # first row of each planned epoch, then the end of the last one
        self._plan: tuple[int, list[np.ndarray]] | None = None

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """The rows of epoch `epoch`, in the order they are read."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan[1]
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.lengths.size)
        rows: list[list[int]] = []
        for start in range(0, order.size, self.window):
            chunk = order[start:start + self.window]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            open_rows: list[list[int]] = []
            room: list[int] = []
            for i in chunk.tolist():
                n = int(self.lengths[i])
                slot = next((j for j, free in enumerate(room) if free >= n), -1)
                if slot < 0:
                    open_rows.append([i])
                    room.append(self.row_len - n)
                else:
                    open_rows[slot].append(i)
                    room[slot] -= n
            rows.extend(open_rows)
        plan = [np.asarray(rows[j], np.int64) for j in rng.permutation(len(rows))]
        self._plan = (epoch, plan)
        return plan

    def __getitem__(self, index: int) -> np.ndarray:
        if index < 0:
            raise IndexError(f"row must be >= 0; received {index}")
        while self._starts[-1] <= index:  # plan epochs until one holds the row
            self._starts.append(self._starts[-1] + len(self.epoch(len(self._starts) - 1)))
        epoch = bisect.bisect_right(self._starts, index) - 1
        return self.epoch(epoch)[index - self._starts[epoch]]

    def rows_per_epoch(self, epoch: int = 0) -> int:
        """How many rows epoch `epoch` packs its samples into."""
        return len(self.epoch(epoch))


@dataclasses.dataclass(frozen=True)
class GlobalRows(grain.transforms.Map):
    """Global batch index i -> the list of rows [i*G, (i+1)*G) of `rows` (G = rows per global batch)."""

    rows: PackedRows
    rows_per_batch: int

    def map(self, index: int) -> list[np.ndarray]:
        first = int(index) * self.rows_per_batch
        return [self.rows[first + j] for j in range(self.rows_per_batch)]


@dataclasses.dataclass(frozen=True)
class ReadPacked(grain.transforms.Map):
    """Packed rows (arrays of sample indices) -> per row the list of its decoded samples (None for a bad
    record, with `skip_bad_records`; otherwise the first bad record's ShardError propagates)."""

    source: RecordSource
    skip_bad_records: bool
    walk: dict[int, np.ndarray] | None = None

    def map(self, rows: list[np.ndarray]) -> list[list[Sample | None]]:
        flat = ReadSamples(self.source, self.skip_bad_records, self.walk).map(np.concatenate(rows))
        out, start = [], 0
        for row in rows:
            out.append(flat[start:start + len(row)])
            start += len(row)
        return out


@dataclasses.dataclass(frozen=True)
class PackAndStack(grain.transforms.Map):
    """Packed rows of samples -> (the `TrainBatch` of `layout`, rows of `layout.seq_len` tokens, the number of bad
    records): the conversations of a row laid end to end (each cut to `seq_len`; a row's lengths sum to at most
    the row length by construction), with `segment_ids` numbering them 1, 2, ... in row order, 0 on the padding
    tail. A bad record (None) leaves no trace in its row."""

    seq_len: int
    pad_id: int
    layout: BatchLayout

    def map(self, rows: list[list[Sample | None]]) -> Counted:
        batch = _empty_batch(dataclasses.replace(self.layout, batch_size=len(rows)), self.pad_id)
        row_len, bad = self.layout.seq_len, 0
        for i, samples in enumerate(rows):
            at, segment = 0, 0
            for sample in samples:
                if sample is None:
                    bad += 1
                    continue
                n = min(len(sample.tokens), self.seq_len)
                if at + n > row_len:
                    raise ValueError(f"a packed row must fit in row_len={row_len}; received {at + n} tokens")
                segment += 1
                _put(batch, i, at, sample, n)
                batch.segment_ids[i, at:at + n] = segment
                at += n
        return batch, bad


# ----------------------------------------------------------------------------- the iterator


class OfflineBatches:
    """An endless iterator of offline batches with a JSON state (`make_offline_batches` builds it).

    State: `get_state()` is `{"next_index": k, "bad_records": c}` (k batches returned; plain JSON, the same
    `next_index` key as online mode). `set_state` rebuilds the Grain iterator over the chain sliced at
    `[k:]`, so a state restores the exact batch sequence whatever `worker_count` was when it was saved
    (Grain's own multiprocess state is per worker and differs between worker counts). Like online mode's,
    it does not identify the pipeline: checkpoint the data config (and the manifest's examples_hash) beside it.

    bad_records: number of records skipped (replaced by padding rows) in the batches returned so far, on
      this host (hosts read different rows; a checkpoint keeps process 0's count, which is informational).
    manifest: the capture's manifest (check it against the run with `data.manifest.check_manifest`).
    Close it (or use it as a context manager) to stop prefetch worker processes.
    """

    def __init__(self, dataset: grain.MapDataset, manifest: Manifest, worker_count: int) -> None:
        self._dataset = dataset
        self.manifest = manifest
        self._worker_count = worker_count
        self._iter: Any = None
        self.next_index = 0
        self.bad_records = 0
        self._start(0)

    def _start(self, next_index: int) -> None:
        self.close()
        dataset = self._dataset[next_index:] if next_index else self._dataset
        iter_dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if self._worker_count > 0:
            _mark_absl_flags_parsed()
            iter_dataset = iter_dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._worker_count))
        self._iter = iter(iter_dataset)
        self.next_index = next_index

    def __iter__(self) -> OfflineBatches:
        return self

    def __next__(self) -> TrainBatch:
        batch, bad = next(self._iter)
        self.bad_records += int(bad)
        self.next_index += 1
        return batch

    def get_state(self) -> dict[str, int]:
        """`{"next_index": batches returned, "bad_records": records skipped so far}` (JSON)."""
        return {"next_index": self.next_index, _BAD: self.bad_records}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resume after `state["next_index"]` batches (restarts prefetch workers)."""
        next_index = state.get("next_index")
        if not isinstance(next_index, int) or next_index < 0:
            raise ValueError(f"state must hold a 'next_index' >= 0; received {state!r}")
        self._start(next_index)
        self.bad_records = int(state.get(_BAD, 0))

    def close(self) -> None:
        if self._iter is not None and hasattr(self._iter, "close"):
            self._iter.close()
        self._iter = None

    def __enter__(self) -> OfflineBatches:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def make_offline_batches(
    shard_dir: str | Path,
    layout: BatchLayout,
    seed: int,
    *,
    seq_len: int | None = None,
    host: HostShare = HostShare(),
    worker_count: int = 0,
    skip_bad_records: bool = False,
    pad_id: int | None = None,
    verify: bool = False,
    walk: dict[int, np.ndarray] | None = None,
) -> OfflineBatches:
    """An endless iterator of this host's `TrainBatch`es of `layout` (`layout.batch_size` rows of
    `layout.seq_len` tokens, the stored features [B, S, F*D] bf16, and the labels and packing `layout` asks for).

    `seq_len` cuts each conversation (default: `layout.seq_len`; below it only for packed rows). For the same
    examples in the same order, seed, batch size and sharding, the (tokens, loss_mask) batches are identical to
    `data.online.make_batches`', and the features are the online features of those rows (bf16) on every real
    position; padding is `PadAndStack`'s. The chain, each step a named Grain transform:
    `MapDataset.range(num_samples)` (global sample indices) -> `.shuffle(seed)` (the permutation online's
    `source(examples).shuffle(seed)` makes) -> `.repeat()` -> `.batch(B * hosts)` (the GLOBAL batch of
    indices) -> `HostRows` (`host`, a `HostShare`: host i keeps rows [i*B, (i+1)*B) and reads only those records)
    -> `ReadSamples` -> `PadAndStack`; `OfflineBatches` then slices it for resume and adds `mp_prefetch` when
    `worker_count` > 0.

    The capture must be complete; shard sizes (and sha256 when `verify`) are checked before the first
    batch, so a truncated shard is named up front. A record that fails to read or decode raises
    `ShardError` naming the shard file and record index, or with `skip_bad_records` becomes a padding row
    counted in `OfflineBatches.bad_records`; a shard that cannot be opened at all, or whose record count
    differs from the manifest, always raises. `pad_id` defaults to the capture's padding id (the
    manifest's `pad_id`). `layout.feature_dim` must be the capture's feature width. Target labels
    (`layout.labels == "target"`, `data.labels: target`) need a capture that stored the target's greedy next
    tokens (`Manifest.target_labels`); soft labels (`"soft"`) one that stored exactly its top-`layout.soft_topk`
    (`Manifest.target_topk`).

    Packed rows (`layout.packed`): rows of `layout.seq_len` tokens (the recipe's `data.pack`, >= `seq_len`), each
    holding several whole conversations (each cut to `seq_len`) end to end (`PackedRows`: first-fit decreasing
    over windows of a per-epoch permutation seeded by `seed`; the sample lengths are read from the record headers
    once, before the first batch), numbered by `segment_ids` so the trainer keeps each conversation's attention
    and labels to itself. The chain is then `MapDataset.range` (global batch indices) -> `GlobalRows` ->
    `HostRows` -> `ReadPacked` -> `PackAndStack`, resumed by slicing as above.

    `walk` (`data.walk`, with `layout.walk`): serving-walk anchor weights f32 [>= n] by sample index, attached when a
    sample is read and written at its place in the row (`TrainBatch.walk`; packed, shifted with its offset).
    """
    batch_size = layout.batch_size
    seq_len = layout.seq_len if seq_len is None else seq_len
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0; received {seq_len}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) (grain's shuffle seed); received {seed}")
    shard_index, shard_count = host.index, host.count
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count) with shard_count > 0; "
                         f"received shard_index={shard_index}, shard_count={shard_count}")
    if worker_count < 0:
        raise ValueError(f"worker_count must be >= 0; received {worker_count}")
    if layout.packed and layout.seq_len < seq_len:
        raise ValueError(f"pack must be 0 or a row length >= seq_len={seq_len}; received {layout.seq_len}")
    if not layout.packed and layout.seq_len != seq_len:
        raise ValueError(f"seq_len must be the layout's row length {layout.seq_len} for unpacked rows; "
                         f"received {seq_len}")
    manifest = load_manifest(shard_dir, verify=verify)
    if pad_id is None:
        if manifest.pad_id is None:
            raise ValueError(f"pad_id must be given: the capture in {shard_dir} has no padded row to take it from")
        pad_id = manifest.pad_id
    if layout.feature_dim != manifest.feature_dim:
        raise ValueError(f"the batch layout's feature_dim must be the capture's feature width {manifest.feature_dim} "
                         f"(in {shard_dir}); received {layout.feature_dim}")
    if layout.labels != "text" and not manifest.target_labels:
        raise ValueError(f"data.labels={layout.labels} reads the target's labels, which the capture in {shard_dir} "
                         f"does not hold: capture again with data.labels={layout.labels} (into a new data.dir)")
    if layout.labels == "soft" and manifest.target_topk != layout.soft_topk:
        k = layout.soft_topk
        raise ValueError(f"data.labels=soft with data.soft_topk={k} reads the target's top-{k}, which the capture in "
                         f"{shard_dir} does not hold (it stores the top-{manifest.target_topk}): capture again with "
                         f"data.labels=soft data.soft_topk={k} (into a new data.dir)")
    source = RecordSource(shard_dir, manifest)

    if layout.packed:
        rows = PackedRows(np.minimum(source.lengths(progress=True), seq_len), layout.seq_len, seed)
        dataset = grain.MapDataset.range(sys.maxsize // (batch_size * shard_count))
        dataset = dataset.map(GlobalRows(rows, batch_size * shard_count))
        dataset = dataset.map(HostRows(shard_index, batch_size))
        dataset = dataset.map(ReadPacked(source, skip_bad_records, walk))
        dataset = dataset.map(PackAndStack(seq_len, pad_id, layout))
        return OfflineBatches(dataset, manifest, worker_count)

    dataset = grain.MapDataset.range(manifest.num_samples)
    dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat()
    dataset = dataset.batch(batch_size * shard_count, drop_remainder=True)
    dataset = dataset.map(HostRows(shard_index, batch_size))
    dataset = dataset.map(ReadSamples(source, skip_bad_records, walk))
    dataset = dataset.map(PadAndStack(seq_len, pad_id, layout))
    return OfflineBatches(dataset, manifest, worker_count)


def _mark_absl_flags_parsed() -> None:
    """grain's profiler flag is read through absl: a program that did not run `absl.app` would fail on its
    first multiprocess batch unless the absl flags are marked parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
