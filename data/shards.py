"""The shard writer and reader of a capture directory (offline mode): records in ArrayRecord shard files.

A capture directory holds `manifest.json` (`data.manifest.Manifest`) and `shard-00000.array_record`,
`shard-00001…` (shard i = samples [i*S, (i+1)*S), S = samples_per_shard), one ArrayRecord record per sample
(`data.records.encode_record`); while the shares of a multi-process capture run, `parts/part-<p>-of-<P>.json`
records each one's finished shards until process 0 merges them into `manifest.json` (`merge_shares`).

    writer = ShardWriter(out_dir, header)          # capture (data.capture): whole shards renamed in place, resumes
    writer = ShardWriter(out_dir, header, share=(p, P)); ...; merge_shares(out_dir, P)   # P processes, one dir
    with writer.shard(i) as shard: shard.write(tokens_S, loss_mask_S, features_SxDf[, next_ids_S[, topk]])
    source = RecordSource(out_dir, load_manifest(out_dir))     # training (data.offline): random access

Storage choices and ArrayRecord's quirks: docs/decisions.md D15.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflash.data.files import TMP_SUFFIX, file_sha256, fsync_path, write_atomic
from dflash.data.manifest import (
    IDENTITY_FIELDS,
    MANIFEST_NAME,
    PART_NAME,
    PARTS_DIR,
    SHARD_NAME,
    Manifest,
    ManifestMismatchError,
    ShardEntry,
    check_shard_file,
    created_info,
    describe_differences,
    read_manifest_file,
    shard_name,
)
from dflash.data.records import Sample, ShardError, decode_record, encode_record, record_tokens

READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"  # random access (ArrayRecord's advice)
STATE_SECONDS = 60.0  # a writer rewrites its state (manifest.json, a share's part) at most this often, and at the end
_COMPRESSIONS = re.compile(r"uncompressed|(zstd|brotli)(:-?\d+)?|snappy")


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
    - holding a manifest (or the shares' state under `parts/`, below): its identity fields must equal
      `header`'s (else ManifestMismatchError naming each differing field, manifest vs this run); listed shards
      whose size (and sha256 if `verify`) match are kept; an unlisted shard file that reads back whole is kept too
      (finished after the state was last written), the rest and `.tmp` leftovers are deleted;
    - holding shard files without a manifest, or any other file: ShardError (not a capture directory).

    Then `pending` lists the shard indices still to write; `with writer.shard(i) as shard:
    shard.write(tokens, loss_mask, features)` writes shard i (its exact sample count, or ShardError), and
    `finish()` marks the capture complete.

    Crash safety, and a bucket's rules (docs/design.md §6): a shard is written to `shard-XXXXX.array_record.tmp`,
    closed, fsynced once and renamed into place with `os.replace`, so it is visible under its final name only when
    complete, and nothing is rewritten or fsynced per record. The manifest (or a share's state) lists the finished
    shards; it is one object rewritten in place, so it is rewritten at most every STATE_SECONDS (and when the
    writer finishes, and on an error, `save`), not after every shard: a shard finished since is found again on
    resume by reading it (the right name and record count, every record's header; its entry recomputed), so a kill
    (even -9) loses at most the shard in progress. Samples are assigned to shards by index (shard i = samples
    [i*S, (i+1)*S)), so a shard rewritten on resume is byte-identical to the one an uninterrupted capture would
    have written.

    Shares (`share=(p, P)`, P > 1: process p of a P-process capture into one shared directory): the writer owns
    the shards i with i % P == p and touches no other file: its state is `parts/part-<p>-of-<P>.json` (a manifest
    listing its finished shards) instead of `manifest.json`, it keeps and deletes only its own shards' files, and
    `finish()` leaves the merge to `merge_shares` (process 0, once every share is finished). Any process of any
    topology counts as finished a shard that `manifest.json` or any part lists and that checks out on disk, so a
    capture may resume on another topology; a single process (P = 1) folds the parts into `manifest.json`.
    """

    def __init__(self, out_dir: str | Path, header: Manifest, *, verify: bool = True,
                 share: tuple[int, int] = (0, 1)) -> None:
        if header.shards or header.complete:
            raise ValueError("header must be a manifest with no shards and complete=False")
        index, count = share
        if not 0 <= index < count:
            raise ValueError(f"share must be (index, count) with 0 <= index < count; received {share}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.share = (index, count)
        self._entries: dict[int, ShardEntry] = {}
        self.kept: list[int] = []
        self._header = header
        self._saved = 0.0
        self._open(verify)

    # -- directory state

    @property
    def mine(self) -> list[int]:
        """The shard indices this writer owns (all of them for one process)."""
        index, count = self.share
        return list(range(index, self._header.num_shards, count))

    @property
    def state_path(self) -> Path:
        """Where this writer records its finished shards: manifest.json, or its part under parts/."""
        index, count = self.share
        return self.out_dir / MANIFEST_NAME if count == 1 else self.out_dir / PARTS_DIR / part_name(index, count)

    def _open(self, verify: bool) -> None:
        names = sorted(p.name for p in self.out_dir.iterdir())
        ours = {MANIFEST_NAME, MANIFEST_NAME + TMP_SUFFIX, PARTS_DIR}
        shard_files = [n for n in names if SHARD_NAME.fullmatch(n.removesuffix(TMP_SUFFIX))]
        foreign = [n for n in names if n not in ours and n not in shard_files]
        parts = part_state_files(self.out_dir)
        foreign += [f"{PARTS_DIR}/{p.name}" for p in parts if not PART_NAME.fullmatch(p.name.removesuffix(TMP_SUFFIX))]
        if foreign:
            raise ShardError(f"{self.out_dir}: capture directory must hold only {MANIFEST_NAME} and shard files (and "
                             f"{PARTS_DIR}/part-*.json while shares run); received {foreign[:5]} (use an empty or new "
                             "directory)")
        single = self.share[1] == 1
        states = [p for p in [self.out_dir / MANIFEST_NAME, *parts]
                  if p.is_file() and (p.name == MANIFEST_NAME or PART_NAME.fullmatch(p.name))]
        self._created: dict[str, Any] = {}
        if not states and single:
            finished = [n for n in shard_files if not n.endswith(TMP_SUFFIX)]
            if finished:
                raise ShardError(f"{self.out_dir}: shard files without a {MANIFEST_NAME} must not be resumed; "
                                 f"received {finished[:3]} (not written by this capture: use an empty directory)")
        # candidates per shard: this writer's own state first, then manifest.json, then the other parts
        states.sort(key=lambda p: (p != self.state_path, p.name != MANIFEST_NAME, p.name))
        candidates: dict[int, list[ShardEntry]] = {}
        for path in states:
            previous = read_manifest_file(path)
            differences = [(name, getattr(previous, name), getattr(self._header, name)) for name in IDENTITY_FIELDS
                           if getattr(previous, name) != getattr(self._header, name)]
            if differences:
                raise ManifestMismatchError(
                    f"{self.out_dir} holds a capture of other data and must not be resumed by this run ({path.name}); "
                    f"{len(differences)} field(s) differ: {describe_differences(differences, 'manifest', 'run')} "
                    "(use a new directory, or rerun with the original settings)")
            self._created = self._created or previous.created
            for entry in previous.shards:
                candidates.setdefault(shard_index(entry.file), []).append(entry)
        self._created = self._created or created_info()
        mine = set(self.mine)
        for index in sorted(mine & set(candidates)):
            for entry in candidates[index]:
                try:
                    check_shard_file(self.out_dir, entry, verify)
                except ShardError:
                    continue  # rewritten below, like an unfinished shard
                self._entries[index] = entry
                break
        for name in shard_files:  # finished after the state was last written: found by reading them back
            index = shard_index(name.removesuffix(TMP_SUFFIX))
            if not name.endswith(TMP_SUFFIX) and index in mine and index not in self._entries:
                entry = self._adopt(index)
                if entry is not None:
                    self._entries[index] = entry
        keep = {entry.file for entry in self._entries.values()}
        for name in shard_files:  # one process owns every file; a share only its own shards'
            index = shard_index(name.removesuffix(TMP_SUFFIX))
            if name not in keep and (single or index in mine) and (self.out_dir / name).exists():
                (self.out_dir / name).unlink()
        if single and (self.out_dir / (MANIFEST_NAME + TMP_SUFFIX)).exists():
            (self.out_dir / (MANIFEST_NAME + TMP_SUFFIX)).unlink()
        own_tmp = self.state_path.with_name(self.state_path.name + TMP_SUFFIX)
        if not single and own_tmp.exists():
            own_tmp.unlink()
        self.kept = sorted(self._entries)
        self.save()
        if single:
            _remove_parts(self.out_dir)  # manifest.json now lists every shard they held

    def _adopt(self, index: int) -> ShardEntry | None:
        """The entry of shard `index`'s file when it reads back as that shard (its record count, and every record
        decoding as this capture's sample of its index: it was renamed into place whole), else None (it is deleted
        and written again)."""
        from array_record.python.array_record_module import ArrayRecordReader

        path, header = self.out_dir / shard_name(index), self._header
        first = index * header.samples_per_shard
        try:
            reader = ArrayRecordReader(str(path), READER_OPTIONS)
            try:
                if reader.num_records() != header.shard_samples(index):
                    return None
                tokens = sum(len(decode_record(raw, feature_dim=header.feature_dim, sample_index=first + r,
                                               where=f"{path}: record {r}", next_ids=header.target_labels,
                                               topk=header.target_topk).tokens)
                             for r, raw in enumerate(reader.read_all()))
            finally:
                reader.close()
        except Exception:  # noqa: BLE001 - unreadable (the C++ reader raises several types): not a finished shard
            return None
        return ShardEntry(file=path.name, samples=self._header.shard_samples(index), tokens=tokens,
                          bytes=path.stat().st_size, sha256=file_sha256(path))

    @property
    def pending(self) -> list[int]:
        """Indices of this writer's shards still to write, in order."""
        return [i for i in self.mine if i not in self._entries]

    @property
    def entries(self) -> dict[int, ShardEntry]:
        return dict(self._entries)

    def manifest(self) -> Manifest:
        """The manifest as it stands: the finished shards by index, totals over them, complete when all are (a
        share's state is never complete: `merge_shares` completes the capture)."""
        shards = tuple(self._entries[i] for i in sorted(self._entries))
        tokens = sum(entry.tokens for entry in shards)
        size = sum(entry.bytes for entry in shards)
        return dataclasses.replace(
            self._header, shards=shards, total_tokens=tokens, bytes_per_token=size / tokens if tokens else 0.0,
            complete=self.share[1] == 1 and len(shards) == self._header.num_shards, created=self._created)

    def save(self) -> None:
        """Write the state (manifest.json, or this share's part) listing every finished shard. A listed shard whose
        rename a power loss undid is found missing on resume and written again (`check_shard_file`)."""
        self.state_path.parent.mkdir(exist_ok=True)
        write_atomic(self.state_path, self.manifest().to_json())
        self._saved = time.monotonic()

    # -- writing

    def shard(self, index: int) -> _OpenShard:
        """Open shard `index` for writing (a context manager); it is committed when the block exits cleanly."""
        if index in self._entries:
            raise ValueError(f"shard {index} is already finished in {self.out_dir}")
        if not 0 <= index < self._header.num_shards or index % self.share[1] != self.share[0]:
            raise ValueError(f"shard index must be one of this writer's shards ({self.mine[:5]}...) in "
                             f"[0, {self._header.num_shards}); received {index}")
        if self.pending[0] != index:
            raise ValueError(f"shards must be written in order; shard {self.pending[0]} is next, received {index}")
        return _OpenShard(self, index)

    def _commit(self, index: int, tmp: Path, samples: int, tokens: int) -> None:
        expected = self._header.shard_samples(index)
        if samples != expected:
            tmp.unlink(missing_ok=True)
            raise ShardError(f"{self.out_dir / shard_name(index)}: shard must hold {expected} samples; "
                             f"received {samples}")
        fsync_path(tmp)
        entry = ShardEntry(file=shard_name(index), samples=samples, tokens=tokens, bytes=tmp.stat().st_size,
                           sha256=file_sha256(tmp))
        os.replace(tmp, self.out_dir / entry.file)
        self._entries[index] = entry
        if time.monotonic() - self._saved >= STATE_SECONDS:
            self.save()

    def finish(self) -> Manifest:
        """Mark the capture complete (every shard must be finished) and return the final manifest; a share
        returns its state, every shard of its own finished (the capture is complete after `merge_shares`)."""
        if self.pending:
            raise ShardError(f"{self.out_dir}: every shard must be finished before finish(); "
                             f"pending {self.pending[:5]}")
        self.save()
        return self.manifest()


def part_name(index: int, count: int) -> str:
    """File name of share `index` of `count`'s state under parts/: `part-00000-of-00002.json`."""
    return f"part-{index:05d}-of-{count:05d}.json"


def shard_index(name: str) -> int:
    """The index in a shard file's name (`shard-00007.array_record` -> 7)."""
    match = SHARD_NAME.fullmatch(name)
    if not match:
        raise ShardError(f"shard file name must be shard-NNNNN.array_record; received {name!r}")
    return int(match.group(1))


def part_state_files(out_dir: Path) -> list[Path]:
    """Every file under `out_dir`/parts/ (the shares' states and their .tmp leftovers)."""
    folder = out_dir / PARTS_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _remove_parts(out_dir: Path) -> None:
    folder = out_dir / PARTS_DIR
    if folder.is_dir():
        for path in part_state_files(out_dir):
            path.unlink()
        folder.rmdir()
        fsync_path(out_dir)


def merge_shares(out_dir: str | Path, count: int, *, verify: bool = False) -> Manifest:
    """Complete a capture written by `count` shares (`ShardWriter(..., share=(p, count))`, every one finished):
    check that each part agrees on the identity and lists every shard it owns, that each shard file exists with
    its size (and sha256 if `verify`), then write `manifest.json` complete (atomically) and remove parts/. Run by
    one process (0) after all shares are finished; returns the manifest."""
    out_dir = Path(out_dir)
    folder = out_dir / PARTS_DIR
    paths = [folder / part_name(i, count) for i in range(count)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ShardError(f"{folder}: every share's state must exist to merge the capture; missing {missing[:5]} "
                         "(rerun `dflash data capture` on every process)")
    parts = [read_manifest_file(p) for p in paths]
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:], strict=True):
        differences = [(name, getattr(first, name), getattr(part, name)) for name in IDENTITY_FIELDS
                       if getattr(first, name) != getattr(part, name)]
        if differences:
            raise ManifestMismatchError(f"{path}: the shares must capture the same data; {len(differences)} field(s) "
                                        f"differ: {describe_differences(differences, paths[0].name, path.name)}")
    listed = {shard_index(entry.file): (p, entry) for p, part in enumerate(parts) for entry in part.shards}
    entries = []
    for index in range(first.num_shards):
        owner = index % count
        found = listed.get(index)
        if found is None or found[0] != owner:
            raise ShardError(f"{folder / part_name(owner, count)}: must list shard {index} (share {owner} of {count} "
                             "owns it) to merge the capture; received no entry (that share is not finished: rerun it)")
        check_shard_file(out_dir, found[1], verify)
        entries.append(found[1])
    tokens = sum(entry.tokens for entry in entries)
    size = sum(entry.bytes for entry in entries)
    manifest = dataclasses.replace(first, shards=tuple(entries), total_tokens=tokens,
                                   bytes_per_token=size / tokens if tokens else 0.0, complete=True)
    write_atomic(out_dir / MANIFEST_NAME, manifest.to_json())
    _remove_parts(out_dir)
    return manifest


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

    def write(self, tokens_S: np.ndarray, loss_mask_S: np.ndarray, features_SxDf: np.ndarray,
              next_ids_S: np.ndarray | None = None, topk: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Append the next sample of this shard (its global index is implied by the order of writes);
        `next_ids_S` exactly when the manifest has `target_labels`, `topk` (ids, probs [n, k]) exactly when it
        has `target_topk` = k > 0."""
        header = self._writer._header
        if (next_ids_S is not None) != header.target_labels:
            raise ValueError(f"next_ids must be given {'with' if header.target_labels else 'only with'} "
                             "target_labels in the manifest")
        width = 0 if topk is None else np.shape(topk[0])[-1]
        if width != header.target_topk:
            raise ValueError(f"topk must have the manifest's width target_topk={header.target_topk} (0 = none); "
                             f"received {width}")
        if features_SxDf.shape[-1] != header.feature_dim:
            raise ValueError(f"features must have width {header.feature_dim}; received {features_SxDf.shape}")
        if len(tokens_S) > header.seq_len:
            raise ValueError(f"a sample must have at most seq_len={header.seq_len} tokens; received {len(tokens_S)}")
        self._file.write(encode_record(self._first + self.samples, tokens_S, loss_mask_S, features_SxDf, next_ids_S,
                                       topk))
        self.samples += 1
        self.tokens += len(tokens_S)

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
            file = str(self.shard_dir / self.manifest.shards[shard].file)
            for record, raw in enumerate(self._reader(shard).read_all()):
                out[first + record] = record_tokens(raw, where=f"{file}: record {record}")
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
