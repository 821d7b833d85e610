"""Durable files, shared by every package: fsync of files and directories, atomic text writes, content hashes.

Pure stdlib and the lowest layer (docs/architecture.md): imported by data/, train/ and export/, it imports
nothing of the project.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a crash leaves the old file or the new one, never a mix: the text goes
    to `<path>.tmp` (TMP_SUFFIX), is fsynced, replaces `path`, and the directory is fsynced."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
