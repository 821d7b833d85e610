"""Where regeneration keeps its answers (`data.regenerate`, `data.scaleout`): chunks of many conversations written
whole, the resume state they make, their merge into the one file training reads, and that file's reader.

    out = data.dir/regenerated.jsonl                        what training reads: every conversation, sorted by id
    out.parts/part-<p>-of-<P>-<n>.jsonl                     chunk n of share p of P (P = 1 for a single process)
    out.errors.jsonl, out.meta.json                         the failed items (sorted by id); the run's settings

    writer = ChunkStore(out, share=(p, P))                  # a process's chunks: FlushPolicy decides when
    writer.add(record_or_error); ...; writer.close()
    merge_parts(out)                                        # process 0, once every share is done

A bucket is not a disk (docs/design.md §6; `data.files`): a chunk holds many conversations (`data.files.FlushPolicy`:
1000, 64 MiB, or 5 minutes after its first, whichever comes first) and is written whole to a temporary name, fsynced
once and renamed into place, so an object is never rewritten or fsynced per conversation. A chunk holds the
conversations (lines with `messages`) and the failed items (lines without) finished together, so a kill can never
keep one without the other. Resume (`done_ids`): every id in `out`, its errors file and every chunk of any topology
is done; a kill (even -9) loses at most the chunk being filled, whose items are answered again with the same seeds,
so the merged file does not depend on where the run was killed. Chunks of an older layout (`part-<p>-of-<P>.jsonl`
appended line by line, its `.errors.jsonl`) are read the same way, a partial last line ignored.
"""

from __future__ import annotations

import json
import logging
import lzma
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dflash.data.files import TMP_SUFFIX, ChunkWriter, FlushPolicy, fsync_path, write_atomic

log = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"  # the chunks of a run, before their merge
CHUNK_NAME = re.compile(r"part-(\d{5})-of-(\d{5})-(\d{6})\.jsonl")


def parts_dir(out: Path) -> Path:
    """Where a run's chunks of `out` are written until they are merged."""
    return out.with_name(out.name + PARTS_SUFFIX)


def errors_path(path: Path) -> Path:
    """The items of the regeneration output `path` that failed (`data.regenerate.regenerate`'s docstring)."""
    return path.with_name(path.name + ".errors.jsonl")


def meta_path(out: Path) -> Path:
    """The settings of the run writing `out` (`data.regenerate`: a rerun with others is refused)."""
    return out.with_name(out.name + ".meta.json")


def chunk_name(share: tuple[int, int], number: int) -> str:
    """File name of chunk `number` of share (p, P): `part-00000-of-00002-000003.jsonl`."""
    return f"part-{share[0]:05d}-of-{share[1]:05d}-{number:06d}.jsonl"


def is_record(line: Mapping[str, Any]) -> bool:
    """A conversation (it has `messages`), not a failed item's line."""
    return "messages" in line


def complete_records(path: Path, data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of the complete lines in `data` (each must have a string 'id')."""
    records = []
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number} must be one JSON object per line; received {line[:80]!r} ({err}); "
                             "only a partial LAST line is repaired automatically") from err
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            raise ValueError(f"{path}:{number} must be an object with a string 'id'; received {line[:80]!r}")
        records.append(record)
    return records


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of the complete lines of a JSONL file (a partial last line, still being written, is ignored)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    return complete_records(path, data[: data.rfind(b"\n") + 1])


def repair_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSONL file written line by line, after truncating a partial last line (a crash
    mid-write); returns (records, bytes removed). A malformed complete line is an error, not repaired."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    removed = len(data) - keep
    if removed:
        log.warning("%s: removing a partial last line (%d bytes) left by an interrupted run", path, removed)
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return complete_records(path, data[:keep]), removed


def part_files(out: Path) -> list[Path]:
    """Every chunk under `<out>.parts/` of any topology (and the parts of the older line-by-line layout), in name
    order; temporary files (a chunk being written) are not chunks."""
    folder = parts_dir(out)
    return sorted(p for p in folder.glob("part-*.jsonl") if p.is_file()) if folder.is_dir() else []


def done_ids(out: Path) -> set[str]:
    """Every id finished (written or failed) in `out`, its errors file and the chunks of any topology."""
    done = {r["id"] for path in (out, errors_path(out), *part_files(out)) for r in read_lines(path)}
    return done


def merge_parts(out: Path) -> int:
    """Merge the chunks into `out` (conversations) and its errors file (failed items): each id once, sorted by id,
    written atomically; then remove the chunks. Both files exist afterwards. With no chunks, sort `out` in place when
    it is not sorted yet. Returns the number of conversations merged in from chunks."""
    parts = part_files(out)
    lines = [line for path in parts for line in read_lines(path)]
    merged = 0
    for target, keep in ((out, is_record), (errors_path(out), lambda line: not is_record(line))):
        records = read_lines(target)
        known = {r["id"] for r in records}
        added = False
        for line in lines:
            if keep(line) and line["id"] not in known:
                known.add(line["id"])
                records.append(line)
                added = True
                merged += target == out
        ordered = sorted(records, key=lambda r: r["id"])
        if added or ordered != records or not target.exists():
            write_atomic(target, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered), sync_dir=False)
    fsync_path(out.parent)
    folder = parts_dir(out)
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            path.unlink()
        folder.rmdir()
    if parts:
        log.info("merged %d conversations from %d chunk(s) into %s", merged, len(parts), out)
    return merged


class ChunkStore:
    """The chunks share (p, P) writes under `<out>.parts/` (`chunk_name`): a `data.files.ChunkWriter` numbered on
    from the share's chunks already there, after removing the temporary files its killed predecessor left."""

    def __init__(self, out: Path, share: tuple[int, int] = (0, 1), policy: FlushPolicy | None = None):
        folder = parts_dir(out)
        prefix = chunk_name(share, 0)[: -len("000000.jsonl")]
        numbers = [-1]
        if folder.is_dir():
            for path in folder.iterdir():
                if path.name.startswith(prefix) and path.name.endswith(TMP_SUFFIX):
                    path.unlink()  # a chunk being written when its process died: its items are not done
                    continue
                match = CHUNK_NAME.fullmatch(path.name)
                if match and (int(match.group(1)), int(match.group(2))) == share:
                    numbers.append(int(match.group(3)))
        self.writer = ChunkWriter(lambda n: folder / chunk_name(share, n), max(numbers) + 1, policy)

    def add(self, line: Mapping[str, Any]) -> None:
        self.writer.add(line)

    def tick(self) -> None:
        self.writer.tick()

    def close(self) -> None:
        self.writer.close()


def read_regenerated(path: str | Path, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The regenerated conversations of `path` (a `regenerate` output), ordered by id, so the training rows
    do not depend on the order replies finished in (which varies with `slots`); at most `limit` of them.
    A partial last line is ignored, not repaired: this only reads. A `.xz` file (the packaged sets of
    `data.packaged_regenerated`) is decompressed first. Chunks not merged yet are refused (a rerun merges them)."""
    path = Path(path)
    if part_files(path):
        raise ValueError(f"{path} must be merged with its chunks in {parts_dir(path)} before training reads it (a "
                         "regeneration stopped before its merge): rerun `dflash data regenerate` with the same "
                         "config, which answers what is missing and merges")
    data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    records = complete_records(path, data[: data.rfind(b"\n") + 1])
    for record in records:
        if not isinstance(record.get("messages"), list):
            raise ValueError(f"{path}: record {record['id']!r} must have a 'messages' list")
    if not records:
        raise ValueError(f"{path} must hold at least one regenerated conversation; received none")
    records.sort(key=lambda r: r["id"])
    return [r["messages"] for r in records[:limit]]


def count_lines(paths: Iterable[Path]) -> tuple[int, dict[str, int]]:
    """(conversations, failed items by kind) in `paths` (outputs, errors files or chunks), each id once."""
    seen_records: set[str] = set()
    kinds: dict[str, dict[str, str]] = {}
    for path in paths:
        for line in read_lines(path):
            if is_record(line):
                seen_records.add(line["id"])
            else:
                kinds.setdefault(line["id"], line)
    by_kind: dict[str, int] = {}
    for line in kinds.values():
        by_kind[str(line.get("kind", "?"))] = by_kind.get(str(line.get("kind", "?")), 0) + 1
    return len(seen_records), by_kind


__all__ = ["CHUNK_NAME", "PARTS_SUFFIX", "ChunkStore", "chunk_name", "complete_records", "count_lines", "done_ids",
           "errors_path", "is_record", "merge_parts", "meta_path", "part_files", "parts_dir", "read_lines",
           "read_regenerated", "repair_jsonl"]
