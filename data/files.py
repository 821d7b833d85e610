"""Durable files, shared by every package: fsync of files and directories, atomic writes, content hashes, and
records written in whole chunks.

Pure stdlib and the lowest layer (docs/architecture.md): imported by data/, train/ and export/, it imports
nothing of the project.

A bucket is not a disk (docs/design.md §6): Cloud Storage takes about one write per second to the same object, and
through gcsfuse an object appears whole when its file is closed (with streaming writes an fsync does not make it
durable). So what a stage writes record by record goes out in chunks of many records, each written whole to a
temporary name and renamed into place (`ChunkWriter`, `write_whole`): no file is rewritten or fsynced per record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"  # `write_atomic` writes `<name>.tmp` beside its target first
_HASH_BLOCK = 1 << 22


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


def write_atomic(path: Path, text: str | bytes, *, sync_dir: bool = True) -> None:
    """Write `text` to `path` so that a crash leaves the old file or the new one, never a mix: the text goes
    to `<path>.tmp` (TMP_SUFFIX) in one write, is fsynced, replaces `path`, and the directory is fsynced (unless
    `sync_dir` is False: a caller that syncs the directory later, once for many files)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("wb") as fh:
        fh.write(text.encode("utf-8") if isinstance(text, str) else text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_path(path.parent)


FLUSH_SECONDS_ENV = "DFLASH_FLUSH_SECONDS"  # overrides FlushPolicy.seconds (0: a chunk per record, for tests)


@dataclasses.dataclass(frozen=True)
class FlushPolicy:
    """When a `ChunkWriter` writes the chunk it holds: once it holds `records` records or `bytes` bytes, or
    `seconds` after the chunk's first record arrived (so a slow stage still shows its progress on disk; checked as
    records arrive and at `ChunkWriter.tick`), whichever comes first. A kill loses at most that chunk."""

    records: int = 1000
    bytes: int = 64 << 20
    seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.records < 1 or self.bytes < 1 or self.seconds < 0:
            raise ValueError(f"a flush policy must have records >= 1, bytes >= 1 and seconds >= 0; received "
                             f"{self.records}, {self.bytes}, {self.seconds}")

    @staticmethod
    def from_env() -> FlushPolicy:
        """The default policy, its time bound from DFLASH_FLUSH_SECONDS when set."""
        raw = os.environ.get(FLUSH_SECONDS_ENV, "")
        if not raw:
            return FlushPolicy()
        try:
            return FlushPolicy(seconds=float(raw))
        except ValueError as err:
            raise ValueError(f"{FLUSH_SECONDS_ENV} must be a number of seconds >= 0; received {raw!r}") from err


class ChunkWriter:
    """JSON records (one per line) kept in memory and written in whole chunks: chunk n goes to `path_of(n)` (n from
    `first` up) through `write_atomic` without the directory sync (a rename needs none to survive a killed process;
    `close` syncs the directory once). `add` writes the chunk held when `policy` says so; `tick` checks the time
    bound between records; `close` (also on an error) writes what is held. Counts what it wrote (`chunks`,
    `records`)."""

    def __init__(self, path_of: Callable[[int], Path], first: int = 0, policy: FlushPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.path_of, self.next, self.policy, self.clock = path_of, first, policy or FlushPolicy.from_env(), clock
        self._lines: list[bytes] = []
        self._bytes = 0
        self._since: float | None = None
        self.chunks = self.records = 0
        self._dirs: set[Path] = set()

    def add(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        self._lines.append(line)
        self._bytes += len(line)
        if self._since is None:
            self._since = self.clock()
        if len(self._lines) >= self.policy.records or self._bytes >= self.policy.bytes:
            self.flush()
        else:
            self.tick()

    def tick(self) -> None:
        """Write the chunk held if its first record is `policy.seconds` old."""
        if self._since is not None and self.clock() - self._since >= self.policy.seconds:
            self.flush()

    def flush(self) -> Path | None:
        """Write the records held as the next chunk (nothing when none); returns its path."""
        if not self._lines:
            return None
        path = self.path_of(self.next)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, b"".join(self._lines), sync_dir=False)
        self._dirs.add(path.parent)
        self.next += 1
        self.chunks += 1
        self.records += len(self._lines)
        self._lines, self._bytes, self._since = [], 0, None
        return path

    def close(self) -> None:
        """Write what is held, then sync the directories written into (power-loss durability of the renames)."""
        self.flush()
        for folder in sorted(self._dirs):
            fsync_path(folder)
        self._dirs.clear()


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
