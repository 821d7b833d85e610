"""Data pipeline costs on this machine, in one run: regeneration through the engine's AR mode, offline
feature capture against computing the same features online, the offline loader, and the storage features
need.

    .venv/bin/python benchmarks/data_throughput.py [--prompts 16] [--new-tokens 64] [--slots 1 8]
        [--max-len 2048] [--rows 96] [--seq-len 256] [--batch-size 8] [--batches 50] [--skip 2]
        [--workers 0 2] [--quick] [--write]

Target: the embedded SmolLM2-135M-Instruct of `load_recipe("default")`, fp32, on the host's devices.

1. Regeneration: `data.regenerate.regenerate` over a `make_regen_engine` engine (AR mode, continuous
   batching, paged cache of `--max-len` tokens per slot, greedy) on `--prompts` GSM8K train prompts
   (`data.sources.mix` of the `gsm8k` preset, seed 0), `--new-tokens` tokens at most per reply (the stop
   token ends a reply earlier), once per `--slots` value. Each engine first regenerates the same prompts
   with 2 new tokens (compiles every prefill bucket and the step; reported apart, never timed), then the
   timed run. tokens/s = generated tokens / wall time (prefills included). Greedy replies do not depend on
   the slot count; the table says whether they matched.
2. Capture: `data.capture.capture` of the first `--rows` GSM8K train rows as `train.loop.build_examples`
   makes them at `--seq-len`, the default drafter's 5 layer ids (`resolve_drafter`), batch `--batch-size`,
   into ArrayRecord shards; a one-batch capture into another directory compiles first (its time reported
   apart). Beside it, the jitted `models.drafter.online_features` (what online mode computes in every train
   step) on the same padded batches, each blocked on: capture overhead = capture time / that time.
   Bytes/token: the manifest's (shard file bytes / real tokens) against the record payload 2*F*D + 5
   (bf16 features, int32 token, uint8 mask) and with the 32-byte record header.
3. Loader: `data.offline.make_offline_batches` over that capture (batch `--batch-size`, `--seq-len`) with
   each `--workers` count; the first `--skip` batches are taken untimed (worker start-up, reported as time
   to first batch), then `--batches` batches are timed; examples/s = batches * B / seconds.
4. Storage, computed: 2*F*D + 5 bytes per token for this target and for a Qwen3-8B layout (hidden 4096,
   36 layers, the DFlash preset's 5 captured layers), and the TB (10^12 bytes) for 100M and 1B tokens.

Outputs go to a temporary directory removed at the end. `--quick` is a smoke run (few prompts, rows and
batches); explicit flags override it. `--write` records the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FULL = {"prompts": 16, "new_tokens": 64, "slots": [1, 8], "max_len": 2048, "rows": 96, "seq_len": 256,
        "batch_size": 8, "batches": 50, "skip": 2, "workers": [0, 2]}
QUICK = {"prompts": 4, "new_tokens": 8, "slots": [1, 4], "max_len": 512, "rows": 16, "seq_len": 128,
         "batch_size": 4, "batches": 6, "skip": 1, "workers": [0, 2]}
QWEN3_8B = {"name": "Qwen3-8B layout", "hidden": 4096, "layers": 36, "features": 5}
TOKEN_COUNTS = {"100M": 100e6, "1B": 1e9}
TB = 1e12


def record_bytes_per_token(features: int, hidden: int) -> int:
    """Record payload per real token: bf16 features (2 * F*D), int32 token (4), uint8 loss mask (1)."""
    return 2 * features * hidden + 5


# ----------------------------------------------------------------------------- 1. regeneration


def regen_rates(target: Any, slots: list[int], n_prompts: int, new_tokens: int, max_len: int,
                tmp: Path) -> list[dict[str, Any]]:
    """Per slot count: warm-up (compile) seconds, then the timed regeneration's stats and replies."""
    from dflash.data.config import RegenConfig
    from dflash.data.regenerate import make_regen_engine, regenerate
    from dflash.data.sources import MixSpec, SourceSpec, mix

    items, _ = mix(MixSpec(sources=(SourceSpec(name="gsm8k"),), max_prompts=n_prompts, seed=0))
    rows = []
    for s in slots:
        cfg = RegenConfig(max_new_tokens=new_tokens, max_len=max_len, slots=s)
        engine = make_regen_engine(target, slots=s, max_len=max_len, sampling=cfg.sampling)
        t0 = time.perf_counter()
        regenerate(engine, target.tokenizer, items, tmp / f"warm-{s}.jsonl",
                   dataclasses.replace(cfg, max_new_tokens=2), progress=False)
        warm_s = time.perf_counter() - t0
        out = tmp / f"regen-{s}.jsonl"
        stats = regenerate(engine, target.tokenizer, items, out, cfg)
        replies = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
        rows.append({"slots": s, "warm_s": warm_s, "stats": stats, "replies": replies})
        print(f"regenerate slots={s}: {stats.generated_tokens} tokens in {stats.wall_s:.1f} s = "
              f"{stats.tokens_per_s:.1f} tok/s (warm-up {warm_s:.1f} s)")
    return rows


# ----------------------------------------------------------------------------- 2. capture


def capture_costs(target: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Capture `--rows` rows (after a one-batch compile run) and time online_features on the same batches."""
    import jax
    import numpy as np

    from dflash.configs.recipe import load_recipe
    from dflash.data.capture import CaptureFormat, CaptureRun, capture
    from dflash.data.examples import build_examples
    from dflash.data.manifest import Provenance
    from dflash.data.records import record_size
    from dflash.models.drafter import online_features

    recipe = load_recipe("default", [f"data.seq_len={args.seq_len}"])
    arch = target.drafter_arch(recipe.drafter)
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=args.rows)
    b, s = args.batch_size, args.seq_len
    provenance = Provenance.of_target(target)
    fmt = CaptureFormat(seq_len=s, samples_per_shard=max(b, 4 * b))

    t0 = time.perf_counter()
    capture(target.params, target.cfg, provenance, examples[:b], arch.layer_ids, tmp / "warm-shards",
            fmt=fmt, run=CaptureRun(batch_size=b, progress=False))
    warm_s = time.perf_counter() - t0
    shard_dir = tmp / "shards"
    report = capture(target.params, target.cfg, provenance, examples, arch.layer_ids, shard_dir, fmt=fmt,
                     run=CaptureRun(batch_size=b))

    # The same padded batches, in the same order, through the jitted online feature forward.
    pad = report.manifest.pad_id if report.manifest.pad_id is not None else 0
    filler = np.full(s, pad, np.int32)
    batches = []
    for lo in range(0, len(examples), b):
        chunk = [np.asarray(t, np.int32) for t, _, _ in examples[lo:lo + b]]
        batches.append(jax.device_put(np.stack(chunk + [filler] * (b - len(chunk)))))
    features = jax.jit(lambda p, t: online_features(p, target.cfg, t, arch.layer_ids))
    jax.block_until_ready(features(target.params, batches[0]))
    t0 = time.perf_counter()
    for tokens_BxS in batches:
        jax.block_until_ready(features(target.params, tokens_BxS))
    online_s = time.perf_counter() - t0

    m = report.manifest
    payload = record_bytes_per_token(len(arch.layer_ids), target.cfg.hidden_size)
    with_header = sum(record_size(int(n), m.feature_dim) for _, _, n in examples) / m.total_tokens
    print(f"capture: {report.tokens} tokens in {report.seconds:.1f} s = {report.tokens_per_s:.0f} tok/s "
          f"(warm-up {warm_s:.1f} s); online_features on the same batches {online_s:.1f} s; "
          f"{m.bytes_per_token:.0f} bytes/token on disk")
    return {"report": report, "warm_s": warm_s, "online_s": online_s, "batches": len(batches),
            "examples": len(examples), "layer_ids": arch.layer_ids, "payload": payload, "with_header": with_header,
            "shard_dir": shard_dir}


# ----------------------------------------------------------------------------- 3. loader


def loader_rates(shard_dir: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    """Per worker count: seconds to the first batch, and the timed batches after `--skip` untimed ones."""
    import jax

    from dflash.data.batch import BatchLayout
    from dflash.data.offline import make_offline_batches
    from dflash.data.shards import load_manifest

    feature_dim = load_manifest(shard_dir).feature_dim
    rows = []
    for w in args.workers:
        t0 = time.perf_counter()
        layout = BatchLayout(batch_size=args.batch_size, seq_len=args.seq_len, feature_dim=feature_dim)
        with make_offline_batches(shard_dir, layout, 0, worker_count=w) as batches:
            next(batches)
            first_s = time.perf_counter() - t0
            for _ in range(args.skip - 1):
                next(batches)
            t0 = time.perf_counter()
            for _ in range(args.batches):
                batch = next(batches)
            seconds = time.perf_counter() - t0
        rows.append({"workers": w, "first_s": first_s, "seconds": seconds,
                     "batch_bytes": sum(a.nbytes for a in jax.tree.leaves(batch))})
        print(f"loader workers={w}: {args.batches * args.batch_size / seconds:.1f} examples/s "
              f"(first batch after {first_s:.2f} s)")
    return rows


# ----------------------------------------------------------------------------- tables


def regen_table(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]
    out = [f"| slots | generated tokens | prompt tokens | wall (s) | generated tok/s | vs slots={base['slots']} "
           "| warm-up (compile) s | replies equal to slots=" + f"{base['slots']} |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stats"]
        same = sum(r["replies"].get(k) == v for k, v in base["replies"].items())
        out.append(f"| {r['slots']} | {st.generated_tokens} | {st.prompt_tokens} | {st.wall_s:.1f} | "
                   f"{st.tokens_per_s:.1f} | {st.tokens_per_s / base['stats'].tokens_per_s:.2f}x | "
                   f"{r['warm_s']:.1f} | {same}/{len(base['replies'])} |")
    return out


def capture_table(c: dict[str, Any]) -> list[str]:
    r, m = c["report"], c["report"].manifest
    online_tps = r.tokens / c["online_s"]
    return ["| measure | value |", "|---|---|",
            f"| rows captured (real tokens), shards | {c['examples']} ({r.tokens}), {len(m.shards)} |",
            f"| capture wall (s), compile excluded | {r.seconds:.1f} |",
            f"| capture real tok/s | {r.tokens_per_s:.0f} |",
            f"| `online_features` on the same {c['batches']} batches (s) | {c['online_s']:.1f} |",
            f"| online feature real tok/s | {online_tps:.0f} |",
            f"| capture overhead = capture time / feature-compute time | {r.seconds / c['online_s']:.2f}x |",
            f"| capture compile (one-batch warm-up run, s) | {c['warm_s']:.1f} |",
            f"| bytes/token on disk (manifest) | {m.bytes_per_token:.0f} |",
            f"| record payload bytes/token, 2*F*D + 5 (F={len(m.layer_ids)}, D={m.hidden_size}) | {c['payload']} |",
            f"| record bytes/token incl. the 32-byte header | {c['with_header']:.1f} |",
            f"| container overhead (disk / payload) | {m.bytes_per_token / c['payload']:.3f}x |"]


def loader_table(rows: list[dict[str, float]], args: argparse.Namespace) -> list[str]:
    base = rows[0]
    rate = lambda r: args.batches * args.batch_size / r["seconds"]  # noqa: E731
    out = [f"| workers | examples/s | batches/s | padded batch MB/s | vs workers={base['workers']} "
           "| time to first batch (s) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['workers']} | {rate(r):.1f} | {args.batches / r['seconds']:.1f} | "
                   f"{args.batches * r['batch_bytes'] / r['seconds'] / 1e6:.0f} | {rate(r) / rate(base):.2f}x | "
                   f"{r['first_s']:.2f} |")
    return out


def storage_table(target_cfg: Any, features: int) -> list[str]:
    layouts = [("SmolLM2-135M (this target)", target_cfg.hidden_size, target_cfg.num_layers, features),
               (QWEN3_8B["name"], QWEN3_8B["hidden"], QWEN3_8B["layers"], QWEN3_8B["features"])]
    out = ["| target | D | layers | F | bytes/token (2*F*D + 5) | " + " | ".join(
        f"TB for {k} tokens" for k in TOKEN_COUNTS) + " |", "|---|---|---|---|---|" + "---|" * len(TOKEN_COUNTS)]
    for name, d, layers, f in layouts:
        per = record_bytes_per_token(f, d)
        out.append(f"| {name} | {d} | {layers} | {f} | {per} | "
                   + " | ".join(f"{per * n / TB:.2f}" for n in TOKEN_COUNTS.values()) + " |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, help=f"GSM8K prompts to regenerate (default {FULL['prompts']})")
    parser.add_argument("--new-tokens", type=int, help=f"max new tokens per reply (default {FULL['new_tokens']})")
    parser.add_argument("--slots", type=int, nargs="+", help=f"engine slots to compare (default {FULL['slots']})")
    parser.add_argument("--max-len", type=int, help=f"engine context per slot (default {FULL['max_len']}, "
                        "RegenConfig's)")
    parser.add_argument("--rows", type=int, help=f"GSM8K rows to capture (default {FULL['rows']})")
    parser.add_argument("--seq-len", type=int, help=f"capture and loader row length (default {FULL['seq_len']})")
    parser.add_argument("--batch-size", type=int, help=f"capture and loader batch (default {FULL['batch_size']})")
    parser.add_argument("--batches", type=int, help=f"timed loader batches (default {FULL['batches']})")
    parser.add_argument("--skip", type=int, help=f"untimed loader batches first (default {FULL['skip']})")
    parser.add_argument("--workers", type=int, nargs="+", help=f"loader worker counts (default {FULL['workers']})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--write", action="store_true", help="record the tables in docs/benchmarks.md")
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("prompts", "new_tokens", "rows", "seq_len", "batch_size", "batches", "skip"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if min(args.slots) < 1 or min(args.workers) < 0:
        parser.error(f"--slots must be >= 1 and --workers >= 0; received {args.slots} and {args.workers}")

    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.models.target import load_target

    load_before = os.getloadavg()[0]
    t_start = time.perf_counter()
    target = load_target(load_recipe("default").target)
    with tempfile.TemporaryDirectory(prefix="dflash-data-bench-") as name:
        tmp = Path(name)
        regen = regen_rates(target, args.slots, args.prompts, args.new_tokens, args.max_len, tmp)
        cap = capture_costs(target, args, tmp)
        loader = loader_rates(cap["shard_dir"], args)
    total_min = (time.perf_counter() - t_start) / 60
    load_after = os.getloadavg()[0]

    r_lo, r_hi = regen[0], regen[-1]
    rep, m = cap["report"], cap["report"].manifest
    l_lo, l_hi = loader[0], loader[-1]
    loader_rate = lambda r: args.batches * args.batch_size / r["seconds"]  # noqa: E731
    overhead = rep.seconds / cap["online_s"]
    reading = (
        f"Reading: regeneration at slots={r_hi['slots']} makes "
        f"{r_hi['stats'].tokens_per_s / r_lo['stats'].tokens_per_s:.2f}x the tokens/s of slots={r_lo['slots']} "
        f"({r_hi['stats'].tokens_per_s:.1f} vs {r_lo['stats'].tokens_per_s:.1f}). Capture costs "
        f"{overhead:.2f}x the feature forward it stores: "
        + ("the bf16 cast, device-to-host copy, record encoding, ArrayRecord writes, sha256 and fsync of each "
           "shard hide behind the next batch's forward (one batch is in flight while the last is written)"
           if overhead < 1.05 else "the rest is the bf16 cast, device-to-host copy, record encoding, ArrayRecord "
           "writes, sha256 and fsync of each shard, partly overlapped with the next batch's forward")
        + ", so the capture pays for itself in target compute once the drafter trains more than "
        f"{max(overhead, 1.0):.2f} epochs over the captured rows; "
        f"{m.bytes_per_token:.0f} bytes/token on disk is {m.bytes_per_token / cap['payload']:.3f}x the "
        f"2*F*D + 5 payload. The loader reads {loader_rate(l_hi):.1f} examples/s with {l_hi['workers']} "
        f"workers against {loader_rate(l_lo):.1f} in-process ({loader_rate(l_hi) / loader_rate(l_lo):.2f}x), i.e. "
        f"{loader_rate(l_lo) * rep.tokens / cap['examples']:.0f} real tokens/s in-process, "
        f"{loader_rate(l_lo) * rep.tokens / cap['examples'] / (rep.tokens / cap['online_s']):.0f}x what the "
        "online feature forward delivers on this CPU"
        + (". Workers lose here, probably because the in-process loader is mostly copying the padded features "
           "and each worker's batch must be copied again to reach the trainer process, with workers and trainer "
           "sharing the same cores (not profiled); they should pay only where reading and decoding a batch costs "
           "more than that copy."
           if loader_rate(l_hi) < loader_rate(l_lo) else "."))
    command = shlex.join([".venv/bin/python", "benchmarks/data_throughput.py", *sys.argv[1:]])
    quick = " QUICK SMOKE RUN (small sizes; not representative)." if args.quick else ""
    body = "\n".join([
        "## Data pipeline throughput (SmolLM2-135M target, fp32)",
        "",
        f"`{command}` on {machine()}; the run took {total_min:.1f} min; 1-minute load average "
        f"{load_before:.2f} before, {load_after:.2f} after (this run's own load included).{quick}",
        "",
        f"Regeneration (`data.regenerate.regenerate` through `make_regen_engine`: AR mode, greedy, paged cache of "
        f"{args.max_len} tokens per slot) of {args.prompts} GSM8K train prompts, at most {args.new_tokens} new "
        "tokens each (the stop token ends a reply earlier); wall time includes the prefills; each engine first "
        "regenerated the same prompts with 2 new tokens (compiles every prefill bucket and the step; not timed):",
        "",
        *regen_table(regen),
        "",
        f"Capture (`data.capture.capture`) of {cap['examples']} GSM8K train rows (`build_examples`, seq_len "
        f"{args.seq_len}), layer ids {list(cap['layer_ids'])} (the default 5-layer drafter), batch "
        f"{args.batch_size}, uncompressed ArrayRecord shards of {max(args.batch_size, 4 * args.batch_size)} "
        "samples; compile excluded (a one-batch capture ran first). Feature compute = the jitted "
        "`models.drafter.online_features` on the same padded batches, each blocked on (what online mode runs in "
        "every train step):",
        "",
        *capture_table(cap),
        "",
        f"Offline loader (`data.offline.make_offline_batches`, batch {args.batch_size}, seq_len {args.seq_len}, "
        f"bf16 features of width {m.feature_dim}) over that capture: {args.batches} batches timed after "
        f"{args.skip} untimed ones (the first one includes starting the workers):",
        "",
        *loader_table(loader, args),
        "",
        reading,
        "",
        "Storage, computed: bytes per real token = 2*F*D + 5 (bf16 features of F captured layers of width D, int32 "
        "token, uint8 mask; record headers and container padding add a little, see the measured row above); "
        f"TB = 10^12 bytes. The Qwen3-8B layout captures layers {list(_qwen_layer_ids())}.",
        "",
        *storage_table(target.cfg, len(cap["layer_ids"])),
        "",
        "Online mode (`data.features=online`, the default) stores nothing: the frozen target recomputes "
        "the features inside every train step, which is why it is the default for large targets, where a "
        "billion-token capture would need tens of TB.",
    ])
    print(body)
    if args.write:
        write_section("data_throughput", body)
        print("written to docs/benchmarks.md")


def _qwen_layer_ids() -> tuple[int, ...]:
    from dflash.models.config import default_layer_ids

    return default_layer_ids(QWEN3_8B["layers"], QWEN3_8B["features"])


if __name__ == "__main__":
    main()
