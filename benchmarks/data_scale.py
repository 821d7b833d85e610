"""Data at scale (issue 53): regeneration tokens/s against slots and devices, through an OpenAI-compatible server
against in process at equal concurrency, capture against replicas, and a projection for Qwen3-8B on v5p-8 and
v5p-64, side by side in one run.

    .venv/bin/python benchmarks/data_scale.py [--prompts 8] [--new-tokens 16] [--slots 1 4 16 64]
        [--device-prompts 16] [--device-slots 8] [--devices 1 2 4] [--split 2 4] [--concurrency 8]
        [--capture-rows 32] [--answer-tokens 500 2048] [--write]

Workload: the embedded SmolLM2-135M-Instruct in fp32, greedy, on GSM8K train prompts (`data.sources.mix` of the
`gsm8k` preset, seed 0), at most `--new-tokens` new tokens per reply (the stop token ends one earlier), a paged
cache of 512 tokens per slot. Every configuration first regenerates the same prompts the same way into another
file (compiles every program the run uses; replicas run 2 new tokens first; not timed), then the timed run; tok/s =
generated tokens / the run's wall time (`RegenStats`, prefills included). Greedy replies do not depend on slots,
replicas or the server: each table says whether they equal its first row's, and how many programs compiled during
the timed runs (0 = nothing timed compiled).

1. Slots: one engine (`make_regen_engine`) at each `--slots` value S, over the first max(`--prompts`, S) prompts
   (every slot busy at the start; the replies compared are the first row's prompts).
2. Devices: `--device-prompts` prompts on engine replicas of `--device-slots` slots (`data.scaleout`'s
   `ReplicaBackend`, one thread each): 1, 2, 4 replicas of one CPU device, and one replica split over 2 and 4
   devices in tensor parallel (`Limits.devices`). The devices are simulated CPU devices (XLA_FLAGS
   --xla_force_host_platform_device_count, set here before JAX starts) sharing this machine's cores, so replicas
   cannot add compute here and a split can only add its collectives; the table shows that cost and that the
   outputs do not change, not the scaling a TPU host's chips give.
3. Server vs in process: the same prompts through `data.regen.endpoint` (`data.endpoint`: HTTP, re-tokenised and
   checked) against a real `dflash serve` HTTP server in this process (`eval.servers.serve_in_process`, AR, an
   engine of `--concurrency` slots), and in process on an engine of `--concurrency` slots: equal concurrency.
   Client and server share this process's cores and GIL.
4. Capture: `data.capture.capture` of `--capture-rows` rows of the default recipe (seq_len 128, batch 4, the
   default drafter's 5 layer ids) on 1, 2, 4 one-device replicas and one replica split over 2 devices; a capture
   of the same rows into another directory compiles first (not timed); shards byte-identical to one device's
   (replicas) or not (the split's all-reduce rounds differently, D82).

A projection, not a measurement: Qwen3-8B regeneration on v5p-8 (4 chips, 1 host) and v5p-64 (32 chips, 8
hosts), one engine replica per chip (the 8B target fits a chip), replicas independent (no collectives between
them), so a slice's rate is chips x one chip's. A decode step of S slots reads the bf16 weights once and each slot's
K/V once: time = max((weights + S x context x K/V bytes per token) / HBM bandwidth, S x 2 x params / peak FLOP/s);
prefill is compute-bound at 40% MFU. Inputs are printed with the table (`PROJECTION`); mean prompt tokens are
measured on the Qwen3-8B recipe's prompt mix with this target's tokenizer (a proxy), mean answer tokens are
`--answer-tokens` (assumed: 500, and 2048 = every answer at the recipe's max_new_tokens). Host work (tokenising,
sampling, writing JSONL) and the step's dispatch are left out.

Outputs go to a temporary directory removed at the end. `--write` records the tables in docs/benchmarks.md.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_LEN = 512
CAPTURE_SEQ_LEN, CAPTURE_BATCH = 128, 4
GIB = 1 << 30

# Inputs of the projection; each names its source.
PROJECTION = {
    "params": 8.19e9,  # Qwen3-8B parameters (`dflash launch compile`'s count, benchmarks/engine_devices.py)
    "layers": 36, "kv_heads": 8, "head_dim": 128,  # Qwen3-8B config.json
    "bytes": 2,  # bf16 weights and K/V (configs/qwen3_8b.yaml target.dtype)
    "hbm_bytes": 95.73 * GIB,  # v5p HBM per chip as XLA's TPU compiler reports it (launch/tpus.py)
    "hbm_bw": 2.765e12,  # v5p HBM bandwidth per chip, bytes/s (Cloud TPU docs; benchmarks/engine_devices.py)
    "peak_flops": 459e12,  # v5p peak dense bf16 FLOP/s per chip (launch/tpus.py)
    "prefill_mfu": 0.40,  # prefill at 40% MFU (docs/pods.md's training assumption)
    "verify_gib": 22.0,  # `dflash launch compile --config qwen3_8b` verify peak per chip, 8 slots x 4096 (docs/pods.md)
    "verify_slots": 8, "verify_len": 4096,
    "slots": 64, "max_len": 3072, "max_new_tokens": 2048,  # configs/qwen3_8b.yaml data.regen
    "conversations": 800_000,  # the DFlash paper's ~800K (issue 53)
}
SLICES = {"v5p-8": (4, 1), "v5p-64": (32, 8)}  # chips, hosts


# ----------------------------------------------------------------------------- regeneration


def _items(n: int) -> list[dict[str, Any]]:
    from dflash.data.sources import MixSpec, SourceSpec, mix

    items, _ = mix(MixSpec(sources=(SourceSpec(name="gsm8k"),), max_prompts=n, seed=0))
    return items


def _replies(path: Path) -> dict[str, Any]:
    return {r["id"]: r["messages"] for r in map(json.loads, path.read_text().splitlines())}


def timed(make_backend: Any, engines: list[Any], target: Any, items: list[dict[str, Any]], cfg: Any, tmp: Path,
          name: str, *, prewarm: bool = False) -> dict[str, Any]:
    """Warm-up regeneration (the same run into another file: compiles; with `prewarm` a 2-token run before it),
    then the timed one, each through a fresh backend (`regenerate` closes it); the stats, replies, warm-up seconds
    and programs compiled during the timed run (None where the engine is a server's)."""
    from dflash.data.regenerate import regenerate

    t0 = time.perf_counter()
    if prewarm:  # replica threads: an engine's first prefills see its initial page table, later ones an uploaded
        # one, which jit keys apart there (one compile more per prefill shape); a short run takes the first ones
        regenerate(make_backend(), target.tokenizer, items, tmp / f"warm2-{name}.jsonl",
                   dataclasses.replace(cfg, max_new_tokens=2), progress=False)
    regenerate(make_backend(), target.tokenizer, items, tmp / f"warm-{name}.jsonl", cfg, progress=False)
    warm_s = time.perf_counter() - t0
    before = sum(e.compiles for e in engines)
    out = tmp / f"{name}.jsonl"
    stats = regenerate(make_backend(), target.tokenizer, items, out, cfg, progress=False)
    compiled = sum(e.compiles for e in engines) - before if engines else None  # a server's engine: not visible
    print(f"{name}: {stats.generated_tokens} tokens in {stats.wall_s:.1f} s = {stats.tokens_per_s:.1f} tok/s "
          f"(warm-up {warm_s:.1f} s, {compiled} compiled while timed)", flush=True)
    return {"name": name, "stats": stats, "replies": _replies(out), "warm_s": warm_s, "compiled": compiled}


def by_slots(target: Any, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from dflash.data.config import RegenConfig
    from dflash.data.regenerate import make_regen_engine

    items = _items(max(args.prompts, *args.slots))
    rows = []
    for slots in args.slots:
        cfg = RegenConfig(max_new_tokens=args.new_tokens, max_len=MAX_LEN, slots=slots)
        engine = make_regen_engine(target, slots=slots, max_len=MAX_LEN)
        mine = items[:max(args.prompts, slots)]
        rows.append({"slots": slots, "prompts": len(mine),
                     **timed(lambda e=engine: e, [engine], target, mine, cfg, tmp, f"slots-{slots}")})
    return rows


def by_devices(target: Any, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    import jax

    from dflash.data.config import RegenConfig
    from dflash.data.scaleout import ReplicaBackend, replica_engines

    items = _items(args.device_prompts)
    cfg = RegenConfig(max_new_tokens=args.new_tokens, max_len=MAX_LEN, slots=args.device_slots)
    devices = jax.local_devices()
    layouts = [(f"{n} replica(s) x 1 device", [(d,) for d in devices[:n]]) for n in args.devices]
    layouts += [(f"1 replica over {n} devices", [tuple(devices[:n])]) for n in args.split]
    rows = []
    for label, groups in layouts:
        engines = replica_engines(target, cfg, groups)
        make = lambda engines=engines, groups=groups: ReplicaBackend(engines, groups, target.tokenizer, cfg)  # noqa: E731
        rows.append({"layout": label, "replicas": len(groups), "devices": sum(len(g) for g in groups),
                     **timed(make, engines, target, items, cfg, tmp, label.replace(" ", "_"), prewarm=True)})
    return rows


def server_vs_process(target: Any, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    from dflash.data.config import EndpointConfig, RegenConfig
    from dflash.data.endpoint import connect
    from dflash.data.regenerate import make_regen_engine
    from dflash.eval.servers import serve_in_process
    from dflash.serve.plan import AR

    items = _items(args.device_prompts)
    s = args.concurrency
    cfg = RegenConfig(max_new_tokens=args.new_tokens, max_len=MAX_LEN, slots=s)
    engine = make_regen_engine(target, slots=s, max_len=MAX_LEN)
    rows = [{"how": f"in process, an engine of {s} slots",
             **timed(lambda: engine, [engine], target, items, cfg, tmp, "in-process")}]
    with serve_in_process(target, None, AR(), slots=s, max_len=MAX_LEN, precompile=False) as url:
        over = dataclasses.replace(cfg, endpoint=EndpointConfig(url=f"{url}/v1", model="dflash", concurrency=s))
        rows.append({"how": f"`dflash serve` over HTTP, {s} slots, endpoint.concurrency {s}",
                     **timed(lambda: connect(over, target.tokenizer, target_source="smollm2"), [], target, items,
                             over, tmp, "endpoint")})
    return rows


# ----------------------------------------------------------------------------- capture


def capture_by_replicas(target: Any, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    import jax

    from dflash.configs.recipe import load_recipe
    from dflash.data.capture import CaptureFormat, CaptureRun, capture
    from dflash.data.examples import build_examples
    from dflash.data.manifest import Provenance, load_manifest

    recipe = load_recipe("default", [f"data.seq_len={CAPTURE_SEQ_LEN}"])
    arch = target.drafter_arch(recipe.drafter)
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=args.capture_rows)
    devices = jax.local_devices()
    layouts = [(f"{n} replica(s) x 1 device", [(d,) for d in devices[:n]]) for n in args.devices]
    layouts += [(f"1 replica over {n} devices", [tuple(devices[:n])]) for n in args.split[:1]]
    fmt = CaptureFormat(seq_len=CAPTURE_SEQ_LEN, samples_per_shard=4 * CAPTURE_BATCH)
    rows, first = [], None
    for label, groups in layouts:
        name = label.replace(" ", "_")
        t0 = time.perf_counter()
        capture(target.params, target.cfg, Provenance.of_target(target), examples, arch.layer_ids,
                tmp / f"warm-{name}", fmt=fmt, run=CaptureRun(CAPTURE_BATCH, devices=groups, progress=False))
        warm_s = time.perf_counter() - t0
        out = tmp / f"capture-{name}"
        report = capture(target.params, target.cfg, Provenance.of_target(target), examples, arch.layer_ids, out,
                         fmt=fmt, run=CaptureRun(CAPTURE_BATCH, devices=groups, progress=False))
        manifest = load_manifest(out)
        first = first or out
        same = all((out / e.file).read_bytes() == (first / e.file).read_bytes() for e in manifest.shards)
        print(f"capture {label}: {report.tokens} tokens in {report.seconds:.1f} s = {report.tokens_per_s:.0f} tok/s "
              f"(warm-up {warm_s:.1f} s); shards equal to the first row's: {same}", flush=True)
        rows.append({"layout": label, "report": report, "warm_s": warm_s, "same": same})
    return rows


# ----------------------------------------------------------------------------- projection


def mean_prompt_tokens(target: Any) -> float:
    """Mean chat-templated prompt tokens of configs/qwen3_8b.yaml's prompt mix (first user turn), by this target's
    tokenizer: a proxy for Qwen3's."""
    from dflash.configs.recipe import load_recipe
    from dflash.data.sources import mix, mix_spec

    recipe = load_recipe("qwen3_8b")
    items, _ = mix(dataclasses.replace(mix_spec(recipe.data), max_prompts=2000))
    tok = target.tokenizer
    counts = []
    for item in items:
        first = next(m for m in item["messages"] if m["role"] == "user")
        counts.append(len(tok.encode(tok.apply_chat_template([first], add_generation_prompt=True))))
    return sum(counts) / len(counts)


def kv_bytes_per_token(p: dict[str, Any]) -> int:
    return 2 * p["layers"] * p["kv_heads"] * p["head_dim"] * p["bytes"]


def max_slots(p: dict[str, Any]) -> int:
    """Slots of max_len tokens one chip holds: the compiled verify peak less its own K/V, the rest for K/V."""
    kv = kv_bytes_per_token(p)
    fixed = p["verify_gib"] * GIB - p["verify_slots"] * p["verify_len"] * kv
    return int((p["hbm_bytes"] - fixed) // (p["max_len"] * kv))


def project(p: dict[str, Any], prompt_tokens: float, answers: list[int]) -> list[dict[str, Any]]:
    kv = kv_bytes_per_token(p)
    weights = p["bytes"] * p["params"]
    flops_per_token = 2 * p["params"]
    rows = []
    for answer in answers:
        context = prompt_tokens + answer / 2  # mean context over a reply's decode steps
        for slots in (p["slots"], max_slots(p)):
            memory_s = (weights + slots * context * kv) / p["hbm_bw"]
            compute_s = slots * flops_per_token / p["peak_flops"]
            chip_tps = slots / max(memory_s, compute_s)
            prefill_chip_s = prompt_tokens * flops_per_token / (p["peak_flops"] * p["prefill_mfu"])
            for slice_name, (chips, hosts) in SLICES.items():
                decode_h = p["conversations"] * answer / (chips * chip_tps) / 3600
                prefill_h = p["conversations"] * prefill_chip_s / chips / 3600
                rows.append({"slice": slice_name, "chips": chips, "hosts": hosts, "answer": answer, "slots": slots,
                             "step_ms": max(memory_s, compute_s) * 1e3,
                             "bound": "HBM" if memory_s >= compute_s else "FLOPs", "chip_tps": chip_tps,
                             "slice_tps": chips * chip_tps, "hours": decode_h + prefill_h, "prefill_h": prefill_h})
    return rows


# ----------------------------------------------------------------------------- tables


def _equal(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["replies"]
    return [f"{sum(r['replies'].get(k) == v for k, v in base.items())}/{len(base)}" for r in rows]


def regen_table(rows: list[dict[str, Any]], key: str, head: str, extra: str = "") -> list[str]:
    base = rows[0]["stats"].tokens_per_s
    more = f" {extra} |" if extra else ""
    out = [f"| {head} |{more} generated tokens | wall (s) | generated tok/s | vs first row | warm-up s | compiled "
           "while timed | replies equal to the first row's |", "|---" * (8 + bool(extra)) + "|"]
    for r, same in zip(rows, _equal(rows), strict=True):
        st = r["stats"]
        cell = f" {r[extra]} |" if extra else ""
        out.append(f"| {r[key]} |{cell} {st.generated_tokens} | {st.wall_s:.1f} | {st.tokens_per_s:.1f} | "
                   f"{st.tokens_per_s / base:.2f}x | {r['warm_s']:.1f} | "
                   f"{'-' if r['compiled'] is None else r['compiled']} | {same} |")
    return out


def capture_table(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["report"].tokens_per_s
    out = ["| layout | tokens | wall (s) | tok/s | vs first row | warm-up s | shards byte-identical to the first "
           "row's |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rep = r["report"]
        out.append(f"| {r['layout']} | {rep.tokens} | {rep.seconds:.1f} | {rep.tokens_per_s:.0f} | "
                   f"{rep.tokens_per_s / base:.2f}x | {r['warm_s']:.1f} | {'yes' if r['same'] else 'no'} |")
    return out


def projection_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| slice | chips (hosts) | mean answer tokens | slots per chip | decode step | bound | tok/s per chip | "
           "tok/s per slice | hours for 800K answers (prefill) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['slice']} | {r['chips']} ({r['hosts']}) | {r['answer']} | {r['slots']} | "
                   f"{r['step_ms']:.1f} ms | {r['bound']} | {r['chip_tps']:,.0f} | {r['slice_tps']:,.0f} | "
                   f"{r['hours']:.1f} ({r['prefill_h']:.1f}) |")
    return out


def reading(slots: list[dict[str, Any]], devices: list[dict[str, Any]], served: list[dict[str, Any]],
            captured: list[dict[str, Any]], projected: list[dict[str, Any]]) -> str:
    """The section's closing paragraph, from its numbers."""
    def rate(r: dict[str, Any]) -> float:
        return r["stats"].tokens_per_s

    same = all(x.split("/")[0] == x.split("/")[1] for rows in (slots, devices, served) for x in _equal(rows))
    best = max(slots, key=rate)
    ratios = ", ".join(f"{rate(r) / rate(slots[0]):.2f}x at {r['slots']}" for r in slots[1:])
    parts = [f"Reading: one engine makes up to {rate(best) / rate(slots[0]):.2f}x slots=1's tokens/s, at "
             f"slots={best['slots']} ({ratios}); on this 2-core machine a larger batch stops paying once the cores "
             "are busy, which beside other jobs comes early."]
    parts.append("On simulated devices " + ", ".join(f"{r['layout']} run at {rate(r) / rate(devices[0]):.2f}x"
                                                    for r in devices[1:])
                 + " of one device: the replicas and the splits share the same 2 cores, so this is their overhead "
                 "(threads, collectives), which a host's chips, each with its own compute and HBM, do not share.")
    parts.append(f"Through `dflash serve` over HTTP regeneration makes {rate(served[1]) / rate(served[0]):.2f}x the "
                 "in-process tokens/s at equal concurrency (HTTP, JSON and re-tokenising every reply, on the same "
                 "cores as the engine).")
    parts.append("Greedy replies are identical in every row of the three tables." if same else
                 "Some replies differ between rows (see the tables).")
    if captured:
        identical = [r["layout"] for r in captured[1:] if r["same"]]
        parts.append(f"Capture stores byte-identical shards on {', '.join(identical) or 'no other layout'}; a "
                     "replica split over devices rounds its all-reduce differently (D82).")
    pick = {(r["slice"], r["answer"], r["slots"]): r["hours"] for r in projected}
    answers = sorted({r["answer"] for r in projected})
    recipe_slots = PROJECTION["slots"]
    parts.append("Projected at the roofline for 800K one-turn answers of Qwen3-8B at the recipe's "
                 f"{recipe_slots} slots: " + "; ".join(
                     f"{a} tokens each, {pick[('v5p-8', a, recipe_slots)]:.1f} h on a v5p-8 and "
                     f"{pick[('v5p-64', a, recipe_slots)]:.1f} h on a v5p-64" for a in answers)
                 + "; more slots per chip shorten it, since decode is bound by reading the weights.")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--device-prompts", type=int, default=16)
    parser.add_argument("--device-slots", type=int, default=8)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--split", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--capture-rows", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, nargs="+", default=[500, 2048])
    parser.add_argument("--write", action="store_true", help="record the tables in docs/benchmarks.md")
    args = parser.parse_args()
    count = max([*args.devices, *args.split])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={count}").strip()
    from benchmarks._report import machine, write_section
    from dflash.models.config import TargetConfig
    from dflash.models.target import load_target

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=1024))
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp_name:
        tmp = Path(tmp_name)
        slots = by_slots(target, args, tmp)
        devices = by_devices(target, args, tmp)
        served = server_vs_process(target, args, tmp)
        captured = capture_by_replicas(target, args, tmp) if args.capture_rows else []
    prompt_tokens = mean_prompt_tokens(target)
    projected = project(PROJECTION, prompt_tokens, args.answer_tokens)
    tables = {"slots": regen_table(slots, "slots", "slots", "prompts"),
              "devices": regen_table(devices, "layout", "layout"),
              "served": regen_table(served, "how", "answered by"),
              "capture": capture_table(captured) if captured else [],
              "projection": projection_table(projected)}
    for lines in tables.values():
        print("\n".join(lines) + "\n")
    minutes = (time.perf_counter() - t_start) / 60
    if not args.write:
        return
    p = PROJECTION
    command = shlex.join([".venv/bin/python", "benchmarks/data_scale.py", *sys.argv[1:]])
    name = "Data at scale"
    write_section(name, "\n".join([
        f"## {name}",
        "",
        f"`{command}` on {machine()}, {minutes:.0f} min, load average {load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end. SmolLM2-135M fp32, greedy, GSM8K train prompts, at most "
        f"{args.new_tokens} new tokens a reply, {MAX_LEN} tokens a slot; each row after the same run into another "
        "file (compiles; replicas run 2 new tokens before it; not timed). tok/s = generated tokens / wall time, "
        "prefills included.",
        "",
        f"Regeneration against slots (one engine, the first max({args.prompts}, slots) prompts):",
        "",
        *tables["slots"],
        "",
        f"Regeneration against devices ({args.device_prompts} prompts, replicas of {args.device_slots} slots each; "
        "simulated CPU devices sharing this machine's cores: replicas add no compute here and a split adds its "
        "collectives, so this shows the overhead and that the replies do not change, not a TPU host's scaling):",
        "",
        *tables["devices"],
        "",
        f"Through a server against in process, at equal concurrency ({args.device_prompts} prompts; the server is "
        "`dflash serve`'s HTTP server in this process, sharing its cores and GIL with the client):",
        "",
        *tables["served"],
        "",
        *([f"Capture against replicas ({args.capture_rows} rows of the default recipe, seq_len {CAPTURE_SEQ_LEN}, "
           f"batch {CAPTURE_BATCH}, 5 layers; after a capture of the same rows that compiles):", "",
           *tables["capture"], ""] if captured else []),
        "**A projection, not a measurement**: Qwen3-8B regeneration on TPU v5p, one engine replica per chip, "
        "replicas independent (a slice's rate = chips x one chip's). Decode step of S slots = max((bf16 weights + "
        "S x mean context x K/V bytes per token) / HBM bandwidth, S x 2 x params / peak FLOP/s); prefill at "
        f"{p['prefill_mfu']:.0%} MFU; host work and dispatch left out. Inputs: {p['params'] / 1e9:.2f}B params, "
        f"{kv_bytes_per_token(p):,} K/V bytes per token ({p['layers']} layers x {p['kv_heads']} kv heads x "
        f"{p['head_dim']} x 2 x bf16), {p['hbm_bw'] / 1e12:.3f} TB/s and {p['peak_flops'] / 1e12:.0f} TFLOP/s per "
        f"chip; slots {p['slots']} (configs/qwen3_8b.yaml `data.regen.slots`) and {max_slots(p)}, the most slots of "
        f"{p['max_len']} tokens a chip's {p['hbm_bytes'] / GIB:.1f} GiB holds beside `dflash launch compile`'s "
        f"verify peak ({p['verify_gib']} GiB for {p['verify_slots']} slots x {p['verify_len']}, docs/pods.md); mean "
        f"prompt {prompt_tokens:.0f} tokens (the recipe's prompt mix, counted with SmolLM2's tokenizer as a proxy); "
        "mean answer tokens assumed (2048: every answer at max_new_tokens); "
        f"{p['conversations']:,} conversations of one turn. At the roofline: an engine reaches a fraction of it, "
        "and the measured tables above are where this one's host costs show.",
        "",
        *tables["projection"],
        "",
        reading(slots, devices, served, captured, projected),
        "",
    ]))


if __name__ == "__main__":
    main()
