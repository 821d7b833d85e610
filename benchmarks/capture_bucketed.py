"""Offline capture with length buckets against full-length batches, side by side in one run.

    .venv/bin/python benchmarks/capture_bucketed.py [--config smollm2] [--rows 128] [--rounds 2]
        [--bucket 64] [--write]

Rows: the first `--rows` training rows of the recipe (`data.examples.build_examples` of its `data.source`, at
its `data.seq_len`), the recipe's layer ids, `data.capture_batch_size` and target, captured by
`data.capture.capture` into temporary shard directories twice: with `length_bucket=0` (every batch at
seq_len, the trainer's online shape) and with `length_bucket=--bucket` (rows of similar length batched
together, each batch cut to its longest row rounded up). The rows are split into `--rounds` slices and the
two settings alternate slice by slice (full, bucketed, full, ...), so a machine whose speed drifts (another
job beside it) weighs on both alike. Before the timed slices, each setting captures the first slice once
untimed into a scratch directory, which compiles the batch lengths it meets (that warm-up's time is reported
apart: one compile per length; a length first met in a later slice compiles inside the timed run).

Printed: real tokens/s of each and their ratio; the positions each computed (real + padding) and the padding
share; how many bf16 feature values differ between the two captures and by how many ulps at most, and
whether the target's next-token labels agree (they are captured with `data.labels: target`'s LM head, so
both forwards are checked). `--write` records the table in docs/benchmarks.md (section `capture_bucketed`).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="recipe whose rows and target are used")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.rows < 1 or args.rounds < 1 or args.bucket < 1 or args.rows < args.rounds:
        parser.error("--rows, --rounds and --bucket must be >= 1, and --rows >= --rounds")

    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.data.capture import CaptureFormat, CaptureRun, _length_batches, capture
    from dflash.data.examples import build_examples
    from dflash.data.manifest import Provenance, load_manifest
    from dflash.data.shards import iter_shard
    from dflash.models.target import load_target

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    arch = target.drafter_arch(recipe.drafter)
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=args.rows)
    seq_len, batch = recipe.data.seq_len, recipe.data.capture_batch_size
    provenance = Provenance.of_target(target)
    settings = {"full": 0, "bucketed": args.bucket}
    slices = [examples[i * len(examples) // args.rounds:(i + 1) * len(examples) // args.rounds]
              for i in range(args.rounds)]

    def run(rows: list, out: Path, bucket: int) -> float:
        t0 = time.perf_counter()
        capture(target.params, target.cfg, provenance, rows, arch.layer_ids, out,
                fmt=CaptureFormat(seq_len=seq_len, samples_per_shard=len(rows), target_labels=True),
                run=CaptureRun(batch_size=batch, progress=False, length_bucket=bucket))
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        warm = {name: run(slices[0], Path(tmp) / f"warm-{name}", bucket) for name, bucket in settings.items()}
        seconds = dict.fromkeys(settings, 0.0)
        for i, rows in enumerate(slices):
            for name, bucket in settings.items():
                seconds[name] += run(rows, Path(tmp) / f"{name}-{i}", bucket)
            print(f"slice {i + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()),
                  flush=True)
        differ, ulps, values, labels_equal = 0, 0, 0, True
        for i in range(args.rounds):
            stored = {}
            for name in settings:
                out = Path(tmp) / f"{name}-{i}"
                manifest = load_manifest(out)
                stored[name] = [s for k in range(manifest.num_shards) for s in iter_shard(out, manifest, k)]
            for a, b in zip(stored["full"], stored["bucketed"], strict=True):
                gap = np.abs(a.features.view(np.uint16).astype(np.int32) - b.features.view(np.uint16).astype(np.int32))
                differ += int((gap > 0).sum())
                ulps = max(ulps, int(gap.max()))
                values += gap.size
                labels_equal &= bool(np.array_equal(a.next_ids, b.next_ids))

    tokens = sum(int(n) for _, _, n in examples)
    positions = {name: sum(len(chunk) * length for s in slices
                           for chunk, length in _length_batches(s, list(range(len(s))), batch, seq_len, bucket))
                 for name, bucket in settings.items()}
    full_tps, bucketed_tps = tokens / seconds["full"], tokens / seconds["bucketed"]
    lines = ["| capture | real tok/s | wall (s) | positions computed | padding share | compile warm-up (s) |",
             "|---|---|---|---|---|---|"]
    for name, bucket in settings.items():
        label = "full length (`length_bucket=0`)" if not bucket else f"length buckets of {bucket}"
        lines.append(f"| {label} | {tokens / seconds[name]:.0f} | {seconds[name]:.1f} | {positions[name]:,} | "
                     f"{1 - tokens / positions[name]:.0%} | {warm[name]:.1f} |")
    command = shlex.join([".venv/bin/python", "benchmarks/capture_bucketed.py", *sys.argv[1:]])
    body = "\n".join([
        "## Offline capture: length buckets against full-length batches", "",
        f"`{command}` on {machine()}; recipe `{args.config}`: its first {len(examples)} rows ({tokens:,} real tokens, "
        f"seq_len {seq_len}, batch {batch}), with the target's next-token labels; the two settings alternate over "
        f"{args.rounds} slices of the rows, each compiled beforehand by an untimed capture of the first slice.", "",
        *lines, "",
        f"**Bucketed / full: {bucketed_tps / full_tps:.2f}x real tokens/s.** Feature values that differ between "
        f"the two captures: {differ:,} of {values:,} ({differ / values:.1e}), by at most {ulps} bf16 ulp(s); "
        f"next-token labels {'all equal' if labels_equal else 'NOT all equal'}."])
    print(body)
    if args.write:
        print(f"written to {write_section('capture_bucketed', body)}")


if __name__ == "__main__":
    main()
