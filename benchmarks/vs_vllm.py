"""Our engine against vLLM on this CPU: the same target (the embedded SmolLM2, float32), the same drafter (the one
shipped for it, K = 4), the same prompts, at each concurrency, on servers of each size; one engine's servers up at a
time (ours: its DFlash and AR pair, one process; vLLM: its AR server, then its DFlash server), as two servers up
together on 2 cores slow each other (vLLM's compute threads spin between requests).

    .venv/bin/python benchmarks/vs_vllm.py [--slots 1,4] [--concurrency 1,4] [--sets gsm8k,mtbench,humaneval,math500]
        [--limit 3] [--max-new-tokens 128] [--config smollm2] [--out DIR] [--vllm-eager] [--write] [KEY=VALUE ...]

Needs the engines environment (.venv-engines: `bin/setup-engines`, docs/development.md). Per server size S (each of
`--slots`): our `dflash serve --config CONFIG --drafter <shipped> --slots S --ar-port ...` (one process serving the
drafter and the target alone, as `dflash eval --drafter` starts it; KEY=VALUE overrides go to it, e.g.
`serve.tree_nodes=8 serve.tree_ngram=true` for the demo's tree) and two unmodified vLLM servers from .venv-engines,
AR and `{"method": "dflash", "num_speculative_tokens": K-1}`, each `--max-num-seqs S`, torch.compile on (vLLM's
default; `--vllm-eager` turns it off: quicker to start, for a smoke run, not a measurement), float32, a KV cache of
`--vllm-kv-gib` GiB, the compute threads bound to every core (`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`, as ours uses every
core; vLLM's own default keeps one core of two for its scheduler: `--vllm-threads-bind auto`). vLLM's target is the
same GGUF dequantised into a Hugging Face directory (tools/engines/hf_target.py).

The requests are `dflash eval`'s (`eval.run.collect`: its client, records, warm-ups and counters): the sets' prompts
(MT-Bench's second turn follows each server's own first answer), greedy, `--max-new-tokens` per turn, at each
concurrency C of `--concurrency` not above S. At C = 1 each conversation goes to our two servers one after the
other, the order reversed from one conversation to the next (paired), and to each vLLM server in its turn; above 1
each server runs its own timed segment of C requests in flight. Per (S, C) and engine: AR and DFlash tokens/s
(tokens over the segment's wall time), TPOT and TTFT (means over the replies, client-side, streamed), τ (ours: each
reply's accepted drafts; vLLM: its `vllm:spec_decode_*` counters per request at C = 1, pooled over the segment
above), the DFlash/AR speedup (median of the per-request TPOT ratios), and ours / vLLM for DFlash tokens/s. Greedy
replies of each engine's DFlash are compared with its own AR's (`differ`: must be 0 for ours; for vLLM a note). The
records stay in `--out` (default: a fresh temporary directory; a rerun into the same directory resumes). `--write`
records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTION = "Ours against vLLM on this CPU"
ENGINES = ("ours", "vllm")
MODES = tuple(f"{engine}-{mode}" for engine in ENGINES for mode in ("dflash", "ar"))
# the servers up at once: our pair is one process; each vLLM server alone (two vLLM servers up together on 2 cores
# ran each ~2.5x slower than alone: their compute threads spin between requests)
GROUPS = ("ours", "vllm-ar", "vllm-dflash")


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1; received {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=_ints, default=(1, 4), help="server sizes (each server's slots; default 1,4)")
    parser.add_argument("--concurrency", type=_ints, default=(1, 4),
                        help="client concurrencies, each run on the servers at least that large (default 1,4)")
    parser.add_argument("--sets", default="gsm8k,mtbench,humaneval,math500", help="prompt sets (as dflash eval)")
    parser.add_argument("--limit", type=int, default=3, help="conversations per set (default 3: 15 requests)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="new tokens per turn (default: the recipe's sampling.max_new_tokens)")
    parser.add_argument("--config", default="smollm2", help="our servers' recipe (default smollm2: float32, chain)")
    parser.add_argument("--out", type=Path, default=None, help="where the records go (default: a temporary dir)")
    parser.add_argument("--vllm-eager", action="store_true",
                        help="vLLM without torch.compile (a smoke run's quicker start; not a measurement)")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="vLLM's KV cache, GiB (default 2)")
    parser.add_argument("--vllm-threads-bind", default="all",
                        help="VLLM_CPU_OMP_THREADS_BIND: all (every core, default), auto (vLLM's), or a core list")
    parser.add_argument("--vllm-executor", choices=("mp", "uni"), default="mp",
                        help="vLLM's model worker: its own process (mp, vLLM's default on CPU) or in the engine core")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of our servers' recipe")
    return parser.parse_args(argv)


@contextlib.contextmanager
def _servers(args: argparse.Namespace, group: str, slots: int, out: Path, hf_target: Path, drafter: Path, k: int,
             max_len: int):
    """(mode -> URL) of one group's servers of `slots` slots (GROUPS), up; stopped on exit."""
    from dflash.eval.servers import serve_pair_subprocess
    from tools.engines import harness

    bind = {"all": f"0-{os.cpu_count() - 1}", "auto": None}.get(args.vllm_threads_bind, args.vllm_threads_bind)
    vllm = {"eager": args.vllm_eager, "in_process_worker": args.vllm_executor == "uni", "slots": slots,
            "max_len": max_len, "kv_cache_gib": args.vllm_kv_gib, "threads_bind": bind}
    if group == "ours":
        with serve_pair_subprocess(["--config", args.config, "--drafter", str(drafter), *args.overrides],
                                   out / "ours.log", slots,
                                   timeout=harness.START_TIMEOUT_S * 2) as (dflash, ar):  # precompiles every shape
            yield {"ours-dflash": dflash, "ours-ar": ar}
    else:
        spec = None if group == "vllm-ar" else {"method": "dflash", "model": str(drafter),
                                                "num_speculative_tokens": k - 1}
        with harness.vllm_server(hf_target, log=out / f"{group}.log", **vllm, speculative=spec) as url:
            yield {group: url}


def measure(args: argparse.Namespace, slots: int, out: Path, settings: Any, items: list, hf_target: Path,
            drafter: Path, k: int, max_len: int) -> list[dict[str, Any]]:
    """Every request of `items` on each group's servers of `slots` slots, one group up at a time, at each
    concurrency <= slots: the records of all four modes."""
    from dflash.eval.client import Client
    from dflash.eval.engines import engine_for
    from dflash.eval.run import RecordStore, collect

    for group in GROUPS:
        store = RecordStore(out / "records.jsonl")
        modes = [m for m in MODES if m == group or m.startswith(f"{group}-")]
        if all(store.has_conversation(m, c, item) for m in modes for c in settings.concurrency for item in items):
            print(f"{group}, {slots} slots: every request is in {out} already (a resumed run); not started", flush=True)
            continue
        with _servers(args, group, slots, out, hf_target, drafter, k, max_len) as urls:
            clients = {mode: Client(url) for mode, url in urls.items()}
            engines = {mode: engine_for(client, mode.split("-")[0].replace("ours", "dflash"))
                       for mode, client in clients.items()}
            collect(clients, settings, out, items, progress=True, engines=engines,
                    speculative=("ours-dflash", "vllm-dflash"))
    return RecordStore(out / "records.jsonl").select(settings, items)


def engine_results(records: list[dict[str, Any]], engine: str, concurrency: int, sets: tuple[str, ...],
                   k: int) -> dict[str, Any]:
    """`eval.report.summarize` of one engine's DFlash and AR records at one concurrency (its modes renamed to
    "dflash" and "ar"): τ, TPOT, TTFT, throughput, the paired speedup, replies differing from AR."""
    from dflash.eval.report import summarize

    mine = [{**r, "mode": r["mode"].split("-", 1)[1]} for r in records
            if r.get("mode", "").startswith(f"{engine}-") and r["concurrency"] == concurrency]
    meta = {"environment": {}, "target": {}, "drafter": {}, "settings": {"block_size": k}}
    return summarize(mine, list(sets), [concurrency], k, {}, meta)


# -------------------------------------------------------------------------------------------------------- report
def _f(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (server slots, concurrency, engine)."""
    head = ["slots", "C", "engine", "AR tok/s", "DFlash tok/s", "DFlash/AR", "AR TPOT ms", "DFlash TPOT ms",
            "AR TTFT ms", "DFlash TTFT ms", "τ", "differ", "ours/vLLM DFlash tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r["slots"]), str(r["concurrency"]), r["engine"], _f(r["ar_tok_s"]), _f(r["dflash_tok_s"]),
            _f(r["speedup"], ".2f") + ("x" if r["speedup"] else ""), _f(r["ar_tpot_ms"]), _f(r["dflash_tpot_ms"]),
            _f(r["ar_ttft_ms"], ".0f"), _f(r["dflash_ttft_ms"], ".0f"),
            _f(r["tau"], ".2f") + (" pooled" if r["tau_source"] == "pooled" else ""), _f(r["differ"], "d"),
            _f(r["vs_vllm"], ".2f") + ("x" if r["vs_vllm"] else "")]) + " |")
    return lines


def rows_of(records: list[dict[str, Any]], slots: int, concurrency: int, sets: tuple[str, ...],
            k: int) -> list[dict[str, Any]]:
    out = []
    for engine in ENGINES:
        res = engine_results(records, engine, concurrency, sets, k)
        head, level = res["headline"], res["concurrency"][str(concurrency)]
        out.append({"slots": slots, "concurrency": concurrency, "engine": engine,
                    "ar_tok_s": level["ar"]["throughput_tok_s"], "dflash_tok_s": level["dflash"]["throughput_tok_s"],
                    "speedup": head["speedup"], "ar_tpot_ms": head["ar"]["tpot_ms"],
                    "dflash_tpot_ms": head["dflash"]["tpot_ms"], "ar_ttft_ms": head["ar"]["ttft_ms"],
                    "dflash_ttft_ms": head["dflash"]["ttft_ms"], "tau": head["tau"], "tau_source": head["tau_source"],
                    "differ": head["mismatches"]})
    ours, vllm = out
    ratio = ours["dflash_tok_s"] / vllm["dflash_tok_s"] if ours["dflash_tok_s"] and vllm["dflash_tok_s"] else None
    ours["vs_vllm"], vllm["vs_vllm"] = ratio, None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.eval.run import EvalSettings, eval_items
    from dflash.models.registry import shipped_drafter_path
    from tools.engines import harness

    recipe = load_recipe(args.config, args.overrides)
    drafter = shipped_drafter_path(recipe.target.source)
    if drafter is None:
        raise SystemExit(f"--config {args.config}: target.source {recipe.target.source!r} has no shipped drafter; "
                         "this benchmark serves the embedded target's (smollm2)")
    k = recipe.drafter.block_size
    max_len = recipe.target.max_seq_len
    sets = tuple(s for s in args.sets.split(",") if s)
    budget = args.max_new_tokens or recipe.sampling.max_new_tokens
    settings = EvalSettings(sets=sets, limit=args.limit, max_new_tokens=budget, concurrency=(1,))
    items = eval_items(settings)
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_vllm-"))
    hf_target = harness.smollm2_hf()
    versions = harness.run_script("versions.py").stdout.strip()
    load, started = os.getloadavg()[0], time.perf_counter()
    rows = []
    for slots in args.slots:
        levels = tuple(c for c in args.concurrency if c <= slots)
        if not levels:
            continue
        run = EvalSettings(sets=sets, limit=args.limit, max_new_tokens=budget, concurrency=levels)
        records = measure(args, slots, out / f"slots{slots}", run, items, hf_target, drafter, k, max_len)
        for c in levels:
            rows += rows_of(records, slots, c, sets, k)
            print("\n".join(table(rows[-2:])), flush=True)
    minutes = (time.perf_counter() - started) / 60
    given = list(sys.argv[1:] if argv is None else argv)
    if "--out" in given:  # a machine's path: not in the docs (the records' folder is a run's own)
        given[given.index("--out"):given.index("--out") + 2] = ["--out", "DIR"]
    cmd = " ".join(["benchmarks/vs_vllm.py", *given])
    body = "\n".join([
        f"## {SECTION}", "",
        f"`.venv/bin/python {cmd}` on {machine()}, {minutes:.0f} min, load average {load:.1f} at the start; "
        f"{versions}. Target: the embedded SmolLM2-135M-Instruct, float32 on both (vLLM's: the same GGUF dequantised "
        f"by transformers); drafter: the shipped one (K = {k}); {len(items)} conversations of {', '.join(sets)}, "
        f"greedy, {budget} new tokens per turn; ours `--config {args.config}`"
        f"{' ' + ' '.join(args.overrides) if args.overrides else ''}; vLLM "
        f"{'eager (--vllm-eager: not a measurement)' if args.vllm_eager else 'with torch.compile'}, threads bound "
        f"{args.vllm_threads_bind}, executor {args.vllm_executor}, KV cache {args.vllm_kv_gib} GiB. Each row: one "
        "engine's AR and DFlash servers of `slots` slots at client concurrency C, one engine's servers up at a time "
        "(ours: the pair, requests alternating between them at C = 1; vLLM: AR, then DFlash), each server's requests "
        "a segment of C in flight. tok/s: tokens "
        "over the segment's wall time; TPOT, TTFT: client-side means; τ: ours per reply, vLLM's counters (pooled "
        "above C = 1); DFlash/AR: median per-request TPOT ratio; differ: DFlash replies unequal to the same engine's "
        "AR. Our engine with perfect drafts on this machine: benchmarks/oracle_ceiling.py's section, once recorded.",
        "", *table(rows)])
    print(body)
    if args.write:
        print(f"written to {write_section(SECTION, body)}")
    print(f"records: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
