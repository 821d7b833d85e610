"""The serving walk (`dflash data walk`, issue 33): where greedy DFlash decoding of the training conversations'
prompts puts its blocks, and how many drafts each block got accepted.

The packaged and regenerated training sets hold the target's own greedy answers, so a greedy decode of a row's
prompt reproduces its answer tokens, and every block the engine verifies starts at a position of the stored row:

    row:   prompt x_0 .. x_{P-1} | answer x_P .. x_E (loss_mask 1) | padding
    walk:  a_0 = P (x_P is the prefill's token); block j verifies [x_{a_j}, d_1 .. d_{K-1}], accepts n_j drafts
           (the longest prefix equal to the target's greedy tokens), emits n_j + 1 tokens; a_{j+1} = a_j + n_j + 1;
           the last block is cut at E (a stop token or the budget ends the request: n_j <= E - a_j - 1).

Two ways to compute it, the same chain rule (`chain`), tested equal on the tiny models in fp32:

- `engine`: the prompts are decoded through `serve.engine.Engine` (greedy, the drafter's K); the decoded answer
  is compared with the stored one and only its matching prefix is used (a mismatch, e.g. a near-tie that the
  engine's chunked verify breaks otherwise, is counted per conversation).
- `teacher` (the default: one target forward and one drafter forward per conversation instead of one per block,
  `teacher_hits`): the target's features and greedy next tokens over the stored row, the drafter's argmax block
  at EVERY position at once (block-local attention, as in training), hits against the target's greedy tokens;
  the walk is then a pointer chase over the leading-hit counts. The stored answer is checked against the
  target's greedy tokens the same way.

Files (beside the data, `<data.dir>/walk/`): `<fingerprint>.jsonl`, one line per training row (`WalkRecord`:
block starts and accepted drafts, in row positions), written in fsynced chunks so a crash loses at most a partial
last line and a rerun skips the rows done; `<fingerprint>.meta.json`, the settings (drafter fingerprint, mode, K,
the rows' examples hash, the target's fingerprint; `complete` once every row is walked). Training reads a complete
walk through `data.walk` (`walk_weights`: per-position anchor weights, `train.walk_anchors`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from dflash.data.files import fsync_path, write_atomic
from dflash.data.progress import Progress
from dflash.data.regen_store import repair_jsonl
from dflash.models.drafter import DFlashDrafter
from dflash.serve.acceptance import answer_spans, chain, matched_prefix, teacher_leads
from dflash.serve.engine import Engine
from dflash.serve.plan import Chain, Limits
from dflash.serve.speculative import Models

log = logging.getLogger(__name__)

WALK_DIR = "walk"
FORMAT = "dflash-walk/1"
MODES = ("teacher", "engine", "stored")


@dataclasses.dataclass(frozen=True)
class WalkRecord:
    """One training row's walk: `starts[j]` the row position of block j's first token, `accepted[j]` the drafts
    of that block the target accepted (0 .. K-1; K-1-accepted is the slot that rejected, none when K-1);
    `answer` the row's answer tokens, `matched` those the greedy decode reproduced (its matching prefix per turn;
    blocks are kept only inside it), `digest` the row's identity (`row_digest`)."""

    index: int
    digest: str
    starts: tuple[int, ...]
    accepted: tuple[int, ...]
    answer: int
    matched: int

    @property
    def mismatch(self) -> bool:
        return self.matched < self.answer

    def to_json(self) -> dict[str, Any]:
        return {"id": str(self.index), "index": self.index, "digest": self.digest, "starts": list(self.starts),
                "accepted": list(self.accepted), "answer": self.answer, "matched": self.matched}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> WalkRecord:
        return cls(int(record["index"]), str(record["digest"]), tuple(int(a) for a in record["starts"]),
                   tuple(int(n) for n in record["accepted"]), int(record["answer"]), int(record["matched"]))


def row_digest(tokens_S: np.ndarray, loss_mask_S: np.ndarray, n: int) -> str:
    """sha256 (16 hex digits) of a row's n real tokens and their loss mask."""
    digest = hashlib.sha256(np.asarray(tokens_S[:n], "<i4").tobytes())
    digest.update(np.asarray(loss_mask_S[:n]).astype(np.uint8).tobytes())
    return digest.hexdigest()[:16]


def drafter_fingerprint(drafter: DFlashDrafter) -> str:
    """sha256 (16 hex digits) of the drafter's architecture, weights and draft vocabulary."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(drafter.arch), sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(drafter, nnx.Param)):
        array = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    if drafter.draft_vocab is not None:
        digest.update(np.asarray(drafter.draft_vocab.ids, "<i4").tobytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- teacher-forced (serve.acceptance)


def walk_teacher(models: Models, tokens_S: np.ndarray, loss_mask_S: np.ndarray, n: int, block_size: int,
                 index: int = 0, stored: tuple[np.ndarray, np.ndarray | None] | None = None) -> WalkRecord:
    """The walk of one row from its stored tokens (`teacher_hits`): per answer span (P, E), the prefix the
    target's greedy tokens reproduce (x_p == next_ids[p-1] for P <= p < M) and the chain over it (last = M-1).
    `stored`: the row's stored features and next ids (`teacher_leads`) instead of the target's forward."""
    next_S, lead = teacher_leads(models, tokens_S, n, block_size, stored)
    starts, accepted, answer, matched = [], [], 0, 0
    for p0, e in answer_spans(loss_mask_S, n):
        m = matched_prefix(tokens_S, next_S, p0, e)
        answer, matched = answer + e + 1 - p0, matched + m
        for a, acc in chain(lead.__getitem__, p0, p0 + m - 1):
            starts.append(a)
            accepted.append(acc)
    return WalkRecord(index, row_digest(tokens_S, loss_mask_S, n), tuple(starts), tuple(accepted), answer, matched)


# ----------------------------------------------------------------------------- through the engine


def walk_engine(engine: Engine, rows: Sequence[tuple[int, np.ndarray, np.ndarray, int]],
                stop_ids: Sequence[int]) -> list[WalkRecord]:
    """The walks of `rows` ((index, tokens, loss_mask, n) each) decoded through `engine` (greedy DFlash): every
    answer span (P, E) is a request of prompt tokens[:P] and budget E - P + 1; its steps' accepted counts give the
    block starts (a_0 = P, a_{j+1} = a_j + n_j + 1) over the prefix of the answer the decode reproduced."""
    requests = []
    for index, tokens, mask, n in rows:
        for p0, e in answer_spans(mask, n):
            if p0 == 0:
                continue
            rid = engine.submit(list(tokens[:p0]), e + 1 - p0, stop_ids)
            requests.append((index, p0, e, rid))
    done = engine.run()
    out = []
    for index, tokens, mask, n in rows:
        starts, accepted, answer, matched = [], [], 0, 0
        for p0, e in answer_spans(mask, n):
            answer += e + 1 - p0
            rid = next((r for i, p, _, r in requests if i == index and p == p0), None)
            if rid is None:
                continue
            c = done.pop(rid)
            got, want = np.asarray(c.token_ids[:e + 1 - p0]), np.asarray(tokens[p0:e + 1])
            same = np.zeros(e + 1 - p0, bool)
            same[:got.size] = got == want[:got.size]
            m = int(np.argmin(same)) if not same.all() else e + 1 - p0
            matched += m
            for a, acc in chain(partial(_next_step, iter(c.accepted)), p0, p0 + m - 1):
                starts.append(a)
                accepted.append(acc)
        out.append(WalkRecord(index, row_digest(tokens, mask, n), tuple(starts), tuple(accepted), answer, matched))
    return out


def _next_step(steps: Any, _: int) -> int:
    return next(steps)


# ----------------------------------------------------------------------------- the stage


@dataclasses.dataclass(frozen=True)
class WalkSummary:
    """What a walk run did: rows walked this run and before, mismatched rows, accept-length counts (index n =
    blocks with n drafts accepted), τ over all blocks (mean accepted + 1), seconds per row this run."""

    path: Path
    walked: int
    kept: int
    mismatched: int
    accept_counts: tuple[int, ...]
    seconds_per_row: float
    last_token_only: int = 0  # mismatched rows whose decode left only the answer's last token (e.g. a reply cut
    # at the regeneration budget, to which the chat template appended its end token)

    @property
    def tau(self) -> float:
        blocks = sum(self.accept_counts)
        return sum((n + 1) * c for n, c in enumerate(self.accept_counts)) / blocks if blocks else 0.0

    def summary(self) -> str:
        blocks = sum(self.accept_counts)
        dist = ", ".join(f"{n}: {c / max(blocks, 1):.3f}" for n, c in enumerate(self.accept_counts))
        return (f"walked {self.walked} rows ({self.kept} from an earlier run), {self.mismatched} with a decode that "
                f"left the stored answer ({self.last_token_only} only at its last token); {blocks} blocks, "
                f"τ {self.tau:.3f}; accepted drafts per block {{{dist}}}; "
                f"{self.seconds_per_row:.2f} s per row this run\nwritten to {self.path}")


def walk_paths(data_dir: str | Path, fingerprint: str) -> tuple[Path, Path]:
    """(records, meta) of the walk of drafter `fingerprint` under `data_dir`."""
    root = Path(data_dir).expanduser() / WALK_DIR
    return root / f"{fingerprint}.jsonl", root / f"{fingerprint}.meta.json"


@dataclasses.dataclass(frozen=True)
class WalkMode:
    """How a walk follows each row, with what that way needs: `name` `teacher` (`walk_teacher`), `engine`
    (`walk_engine`, `slots` rows at a time) or `stored` (`walk_teacher` over `stored(i)`: row i's stored features
    and next ids, e.g. a capture's, instead of the target's forward)."""

    name: str = "teacher"
    slots: int = 8
    stored: Callable[[int], tuple[np.ndarray, np.ndarray | None]] | None = None


def run_walk(examples: Sequence[tuple[np.ndarray, np.ndarray, int]], drafter: DFlashDrafter, target: Any,
             data_dir: str | Path, *, examples_hash: str, mode: WalkMode = WalkMode(), chunk: int = 16,
             drafter_source: str = "", limit: int = 0, progress: bool = True) -> WalkSummary:
    """Walk the training rows `examples` (`build_examples` order) with `drafter` at its K by `mode`, in chunks of
    `chunk` rows appended to `<data_dir>/walk/<fingerprint>.jsonl` (flush + fsync each), skipping rows a previous
    run wrote; the meta is written first (a rerun with other settings is refused) and marked complete at the end.
    `limit` > 0 walks only the first `limit` rows (a measurement; the walk is then not complete)."""
    mode, slots, stored = mode.name, mode.slots, mode.stored
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; received {mode!r}")
    if (mode == "stored") != (stored is not None):
        raise ValueError(f"stored must be given exactly with mode 'stored'; received mode {mode!r}")
    k = drafter.arch.block_size
    fingerprint = drafter_fingerprint(drafter)
    out, meta_path = walk_paths(data_dir, fingerprint)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(examples)[:limit or None]
    meta = {"format": FORMAT, "drafter": fingerprint, "drafter_source": drafter_source, "block_size": k,
            "mode": mode, "examples_hash": examples_hash, "num_examples": len(examples),
            "target": target.fingerprint}
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        differ = [f"{key}: {old.get(key)!r} there vs {v!r} now" for key, v in meta.items()
                  if key != "drafter_source" and old.get(key) != v]
        if differ:
            raise ValueError(f"{meta_path} was written with other settings ({'; '.join(differ)}); delete "
                             f"{out.parent} or walk into another data.dir")
    write_atomic(meta_path, json.dumps({**meta, "complete": False}, indent=2) + "\n")
    records, _ = repair_jsonl(out)
    done = {int(r["index"]) for r in records}
    todo = [(i, t, m, n) for i, (t, m, n) in enumerate(rows) if i not in done]
    models = Models.of(target.params, target.cfg, drafter)
    engine = None
    if mode == "engine":
        max_len = -(-(max(n for _, _, n in rows) + k + 1) // 16) * 16
        engine = Engine(target.params, target.cfg, drafter, Chain(k), Limits(slots=slots, max_len=max_len))
    bar = Progress(len(rows), initial=len(rows) - len(todo), enabled=progress, unit="row", desc="walk")
    t0 = time.perf_counter()
    with open(out, "a", encoding="utf-8") as fh:
        for first in range(0, len(todo), chunk):
            part = todo[first:first + chunk]
            if engine is not None:
                new = walk_engine(engine, part, target.tokenizer.stop_token_ids)
            else:
                new = [walk_teacher(models, t, m, n, k, i, stored(i) if stored else None) for i, t, m, n in part]
            fh.write("".join(json.dumps(r.to_json()) + "\n" for r in new))
            fh.flush()
            os.fsync(fh.fileno())
            records.extend(r.to_json() for r in new)
            bar.update(len(part))
    bar.close()
    fsync_path(out.parent)
    seconds = time.perf_counter() - t0
    if not limit and len({int(r["index"]) for r in records}) == len(examples):
        write_atomic(meta_path, json.dumps({**meta, "complete": True}, indent=2) + "\n")
    walked = [WalkRecord.from_json(r) for r in records]
    counts = np.bincount([n for r in walked for n in r.accepted], minlength=k)[:k]
    return WalkSummary(out, len(walked), len(walked) - len(todo), sum(r.mismatch for r in walked),
                       tuple(int(c) for c in counts), seconds / max(len(todo), 1),
                       sum(r.answer - r.matched == 1 for r in walked))


# ----------------------------------------------------------------------------- what training reads


def find_walk(data_dir: str | Path, spec: str, examples_hash: str) -> Path:
    """The meta file of the walk `data.walk` names: a `.meta.json` / `.jsonl` path or, for `auto`, the newest
    complete walk under `<data_dir>/walk/` of these rows (`examples_hash`). Raises naming what is missing."""
    if spec != "auto":
        path = Path(spec).expanduser()
        path = path.with_name(path.name.removesuffix(".jsonl") + ".meta.json") if path.suffix == ".jsonl" else path
        if not path.is_file():
            raise FileNotFoundError(f"data.walk={spec!r}: {path} does not exist; run `dflash data walk` first")
        return path
    root = Path(data_dir).expanduser() / WALK_DIR
    metas = sorted(root.glob("*.meta.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in metas:
        meta = json.loads(path.read_text())
        if meta.get("complete") and meta.get("examples_hash") == examples_hash:
            return path
    raise FileNotFoundError(f"data.walk=auto: no complete walk of these training rows under {root} ({len(metas)} "
                            "walks there); run `dflash data walk` with this config first")


def load_walk(meta_path: Path, examples_hash: str, num_examples: int) -> dict[int, WalkRecord]:
    """The records of a complete walk of these rows (its examples hash and row count checked), by row index."""
    meta = json.loads(meta_path.read_text())
    for key, want in (("format", FORMAT), ("examples_hash", examples_hash), ("num_examples", num_examples),
                      ("complete", True)):
        if meta.get(key) != want:
            raise ValueError(f"{meta_path}: {key} must be {want!r} for this run's training rows; received "
                             f"{meta.get(key)!r} (walk again with `dflash data walk`)")
    records, _ = repair_jsonl(meta_path.with_name(meta_path.name.removesuffix(".meta.json") + ".jsonl"))
    return {int(r["index"]): WalkRecord.from_json(r) for r in records}


def walk_weights(record: WalkRecord | None, seq_len: int, block_size: int, power: float) -> np.ndarray:
    """f32 [seq_len]: the anchor weight of each position of a row: (K - accepted)^power at the walk's block starts
    (a block that rejected at slot 1 weighs K^power, one that accepted every draft 1), 0 elsewhere."""
    out = np.zeros(seq_len, np.float32)
    if record is None:
        return out
    for a, n in zip(record.starts, record.accepted, strict=True):
        if a < seq_len:
            out[a] = float(block_size - n) ** power
    return out


__all__ = ["MODES", "WALK_DIR", "WalkMode", "WalkRecord", "WalkSummary", "drafter_fingerprint", "find_walk",
           "load_walk", "row_digest", "run_walk", "walk_engine", "walk_paths", "walk_teacher", "walk_weights"]
