"""Serving load: requests/s and latency of `dflash serve` at several concurrencies, in one run.

    .venv/bin/python benchmarks/serve_load.py [--config demo] [--drafter DIR | --ar] [--concurrency 1 4 16]
        [--requests 16] [--max-tokens 64] [--slots 8] [--save RUN.json] [--baseline BEFORE.json] [--write]

Starts the server in-process as `dflash serve --config CONFIG --drafter DIR` builds it
(`launch.serving.build_server`: the recipe's target, the drafter, the engine, the bound server), and prints its
start-up time (from the call until GET /health answers: loading, engine build, and precompiling where the engine
does it). Then for each concurrency C: C client threads send streaming chat completions (greedy, `max_tokens`
fixed, `stream_options.include_usage`) over a fixed list of prompts until `--requests` (at least C) are done.
Each C first runs one untimed round of C requests, so that shapes compiled on first use are not timed (the
engine's compile counter, where it has one, is read around the timed region and reported).

Per C: requests/s (requests / wall seconds of the timed region), output tokens/s (usage.completion_tokens /
wall), end-to-end latency p50/p95 (request sent to `[DONE]`), time to first token p50/p95 (request sent to the
first chunk with content). `--save` writes the numbers as JSON; `--baseline` (a file `--save` wrote on the code
before a change) adds its numbers and the ratio beside them. `--write` records the table in docs/benchmarks.md.
`--config tiny --ar` is a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse.",
    "What are three uses of a paperclip?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr? Answer briefly.",
    "List five countries in Europe and their capitals.",
    "How does a bicycle stay upright while moving?",
]


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation (statistics.quantiles' 'inclusive' method)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def one_request(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streaming chat completion: seconds to the first content chunk and to `[DONE]`, and its token count."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = None, 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"the server answered {resp.status_code}: {resp.read()[:500]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event}")
            if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter() - start
    return {"ttft": first if first is not None else end, "e2e": end, "tokens": tokens}


def run_load(url: str, model: str, concurrency: int, n_requests: int, max_tokens: int) -> tuple[list[dict], float]:
    """`n_requests` requests from `concurrency` threads; (each request's numbers, wall seconds)."""
    import httpx

    results: list[dict[str, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    counter = iter(range(n_requests))

    def worker() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    out = one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                except BaseException as err:  # noqa: BLE001 - reported after the threads end
                    with lock:
                        errors.append(err)
                    return
                with lock:
                    results.append(out)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, wall


def summarize(results: list[dict[str, float]], wall: float) -> dict[str, float]:
    e2e, ttft = [r["e2e"] for r in results], [r["ttft"] for r in results]
    return {"requests": len(results), "wall_s": wall, "req_per_s": len(results) / wall,
            "tok_per_s": sum(r["tokens"] for r in results) / wall, "mean_tokens": statistics.mean(
                r["tokens"] for r in results), "e2e_p50": percentile(e2e, 0.5), "e2e_p95": percentile(e2e, 0.95),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95)}


def table(rows: dict[int, dict[str, Any]], baseline: dict[str, Any] | None) -> list[str]:
    def cell(c: int, key: str, fmt: str) -> str:
        now = fmt.format(rows[c][key])
        before = (baseline or {}).get("rows", {}).get(str(c), {}).get(key)
        if before is None:
            return now
        return f"{fmt.format(before)} → {now} ({rows[c][key] / before:.2f}x)" if before else now

    head = ("| concurrency | requests | req/s | output tok/s | mean tokens | e2e p50 (s) | e2e p95 (s) | TTFT p50 (s) "
            "| TTFT p95 (s) | compiles in timed region |")
    lines = [head, "|" + "---|" * 10]
    for c, r in rows.items():
        lines.append(f"| {c} | {r['requests']} | {cell(c, 'req_per_s', '{:.2f}')} | {cell(c, 'tok_per_s', '{:.1f}')} "
                     f"| {r['mean_tokens']:.1f} | {cell(c, 'e2e_p50', '{:.2f}')} | {cell(c, 'e2e_p95', '{:.2f}')} "
                     f"| {cell(c, 'ttft_p50', '{:.3f}')} | {cell(c, 'ttft_p95', '{:.3f}')} "
                     f"| {'n/a' if r['compiles'] is None else r['compiles']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo", help="the recipe, as `dflash serve --config` (default demo)")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash",
                        help="the drafter dir (default: the one shipped for SmolLM2)")
    parser.add_argument("--ar", action="store_true", help="serve the target alone (no drafter)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="timed requests per concurrency (at least C)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8, help="the engine's concurrent sequences (dflash serve's)")
    parser.add_argument("--save", help="write the numbers to this JSON file")
    parser.add_argument("--baseline", help="a JSON file --save wrote before a change: shown beside, with ratios")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.requests < 1 or args.max_tokens < 1 or args.slots < 1:
        parser.error(f"--concurrency, --requests, --max-tokens and --slots must be >= 1; received "
                     f"{args.concurrency}, {args.requests}, {args.max_tokens}, {args.slots}")
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None

    import httpx

    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.launch.serving import ServeOptions, build_server

    load = os.getloadavg()[0]  # other work on the machine moves these numbers: it is recorded with them
    recipe = load_recipe(args.config)
    options = ServeOptions(drafter=None if args.ar else args.drafter, ar=args.ar, slots=args.slots, port=0)
    start = time.perf_counter()
    server = build_server(recipe, options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    httpx.get(f"{url}/health", timeout=600).raise_for_status()
    startup = time.perf_counter() - start
    engine = server.worker.engine
    mode = "AR" if args.ar else f"DFlash K={engine.k} ({args.drafter})"
    print(f"server up in {startup:.1f} s: {server.model_name}, {mode}, {args.slots} slots, max_len {engine.max_len}",
          flush=True)

    rows: dict[int, dict[str, Any]] = {}
    try:
        for c in args.concurrency:
            run_load(url, server.model_name, c, c, args.max_tokens)  # untimed: first-use shapes compile here
            compiles = getattr(engine, "compiles", None)
            results, wall = run_load(url, server.model_name, c, max(args.requests, c), args.max_tokens)
            rows[c] = {**summarize(results, wall),
                       "compiles": None if compiles is None else engine.compiles - compiles}
            r = rows[c]
            print(f"C={c}: {r['req_per_s']:.2f} req/s, {r['tok_per_s']:.1f} tok/s, e2e p50 {r['e2e_p50']:.2f} s "
                  f"p95 {r['e2e_p95']:.2f} s, TTFT p50 {r['ttft_p50']:.3f} s p95 {r['ttft_p95']:.3f} s", flush=True)
    finally:
        server.close()
        thread.join(60)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    run = {"commit": commit, "load_avg": load, "startup_s": startup, "mode": mode, "config": args.config,
           "slots": args.slots, "max_tokens": args.max_tokens, "rows": {str(c): r for c, r in rows.items()}}
    if args.save:
        Path(args.save).write_text(json.dumps(run, indent=1) + "\n")
    before = ""
    if baseline:
        before = (f" Cells read before → after (×ratio); before: commit {baseline['commit']}, start-up "
                  f"{baseline['startup_s']:.1f} s.")
    command = "benchmarks/serve_load.py " + shlex.join(sys.argv[1:])
    body = "\n".join([
        f"## Serving load (`{args.config}` recipe, {mode}, greedy, streaming chat)",
        "",
        f"`.venv/bin/python {command}` on {machine()}, commit {commit}. The server is built in-process as "
        f"`dflash serve` builds it ({args.slots} slots), start-up {startup:.1f} s (to the first GET /health). "
        f"C client threads send streaming chat completions over {len(PROMPTS)} fixed prompts, max_tokens "
        f"{args.max_tokens}, greedy (answers may stop early at the end-of-turn token: see mean tokens); one untimed "
        f"round of C requests first. Latencies are per request, from sending it to `[DONE]` (e2e) and to the "
        f"first chunk with content (TTFT). Load average at the start: {load:.1f} on {os.cpu_count()} cores.{before}",
        "",
        *table(rows, baseline),
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('serve_load', body)}")


if __name__ == "__main__":
    main()
