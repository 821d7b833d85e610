"""`dflash serve` start-up, cold and warm, through the persistent compilation cache (serve/compile_cache.py, D78).

    .venv/bin/python benchmarks/serve_startup.py [--config demo] [--drafter data/assets/drafters/smollm2-dflash]
        [--ar] [--warm-runs 2] [--warm-nice N] [--write]

Starts `dflash serve --config CONFIG --drafter DRAFTER` (or `--ar`) as a subprocess with `DFLASH_COMPILE_CACHE` set
to a fresh, empty directory (cold: every program compiles and is written), stops it, then starts it again
`--warm-runs` times over the same directory (warm: the programs load). Per start: seconds from the process start to
the first healthy `/health`, the CPU seconds the server had used by then (user + system, all its threads; on a
shared machine the wall time moves with the other work, the CPU time much less; `--warm-nice -15` starts the warm
servers ahead of the machine's other work, which needs root, to approach an idle machine's wall time), the
precompile's own seconds, programs and programs loaded from the cache as the server prints them, and the cache's
size after the start (JAX's entries, and the converted copy of a GGUF target's weights, `models/converted.py`, kept
in the same directory). Then where a warm start's time goes, in one process over the warm cache: importing, loading
the models, building the engine, and the precompile split into JAX's tracing, lowering to StableHLO, obtaining each
executable (here: reading it from the cache) and the rest (host work between the programs). `--write` records it in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import machine, write_section  # noqa: E402
from dflash.eval.servers import free_port, stop_process  # noqa: E402

PRECOMPILED = re.compile(r"precompiled (\d+) programs .*?in ([\d.]+) s, (\d+) of them loaded")
# A warm start's phases in one process: wall and CPU seconds of each, and the precompile's JAX events summed.
SPLIT = """
import collections, json, sys, time
wall0, cpu0 = time.perf_counter(), time.process_time()
from dflash.serve.compile_cache import enable_compile_cache
enable_compile_cache()
import jax
events = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **_: events.update({name: secs}))
from dflash.configs.recipe import load_recipe
from dflash.launch.serving import ServeOptions
from dflash.models.drafter_io import load_drafter
from dflash.models.target import load_target
from dflash.serve.compile_cache import converted_dir
from dflash.serve.engine import Engine
from dflash.serve.plan import plan_from
phases = {}
def mark(name, wall, cpu):
    phases[name] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    return time.perf_counter(), time.process_time()
wall, cpu = mark("import", wall0, cpu0)
config, drafter_dir, ar = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
recipe = load_recipe(config)
options = ServeOptions(drafter=None if ar else drafter_dir, ar=ar)
target = load_target(recipe.target, converted_dir())
drafter = None if ar else load_drafter(options.drafter_dir(recipe), target.cfg)
wall, cpu = mark("load", wall, cpu)
engine = Engine(target.params, target.cfg, drafter, plan_from(recipe.serve, drafter, None),
                options.limits(recipe.target.max_seq_len), sampling=recipe.sampling)
wall, cpu = mark("engine", wall, cpu)
events.clear()
programs, _ = engine.precompile()
mark("precompile", wall, cpu)
names = {"trace": "/jax/core/compile/jaxpr_trace_duration", "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
         "obtain": "/jax/core/compile/backend_compile_duration"}
print(json.dumps({"phases": phases, "programs": programs, "loaded": engine.loaded,
                  "events": {k: events[v] for k, v in names.items()}}))
"""


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux's /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_once(args: list[str], cache: Path, log: Path, timeout: float, nice: int = 0) -> dict:
    """One server start (at `nice`): seconds to a healthy /health and the CPU seconds used by then, the precompile
    line's numbers, the cache's size after."""
    port = free_port()
    cmd = [sys.executable, "-m", "dflash.launch.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    cmd = (["nice", "-n", str(nice)] if nice else []) + cmd
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["DFLASH_COMPILE_CACHE"] = str(cache)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; its log: {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"the server was not healthy after {timeout:.0f} s; its log: {log}")
            time.sleep(0.1)
        healthy, cpu = time.perf_counter() - start, _cpu_seconds(proc.pid)
    finally:
        stop_process(proc, timeout=60)
    match = PRECOMPILED.search(log.read_text())
    files = [p for p in cache.glob("*") if p.is_file()]  # JAX's entries (converted weights: converted/)
    converted = [p for p in (cache / "converted").rglob("*") if p.is_file()]
    return {"healthy_s": healthy, "cpu_s": cpu, "load": load, "programs": int(match.group(1)) if match else None,
            "precompile_s": float(match.group(2)) if match else None,
            "loaded": int(match.group(3)) if match else None,
            "cache_entries": sum(1 for p in files if not p.name.endswith("-atime")),
            "cache_mb": sum(p.stat().st_size for p in files) / 2**20,
            "converted_mb": sum(p.stat().st_size for p in converted) / 2**20}


def split_table(split: dict) -> str:
    phases, events = split["phases"], split["events"]
    pre = phases["precompile"]["wall"]
    rest = pre - sum(events.values())
    rows = [("import (jax, flax, the package)", phases["import"]),
            ("load the target and the drafter", phases["load"]),
            ("build the engine", phases["engine"]),
            (f"precompile {split['programs']} programs ({split['loaded']} loaded from the cache)",
             phases["precompile"])]
    lines = ["| phase | wall s | CPU s |", "|---|---|---|"]
    lines += [f"| {name} | {p['wall']:.1f} | {p['cpu']:.1f} |" for name, p in rows]
    lines += [f"| - of which tracing to jaxprs | {events['trace']:.1f} | |",
              f"| - lowering to StableHLO | {events['lower']:.1f} | |",
              f"| - obtaining the executables (cache key, read, deserialise) | {events['obtain']:.1f} | |",
              f"| - the rest (host work between the programs) | {rest:.1f} | |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="demo")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--ar", action="store_true", help="serve the target alone")
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--warm-nice", type=int, default=0,
                        help="start the warm servers at this niceness (negative: ahead of other work; needs root)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds a start may take")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    serve_args = ["--config", args.config] + (["--ar"] if args.ar else ["--drafter", args.drafter])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for i in range(1 + args.warm_runs):
            kind = "cold (empty cache)" if i == 0 else f"warm {i}"
            row = start_once(serve_args, cache, Path(tmp) / f"serve-{i}.log", args.timeout, args.warm_nice if i else 0)
            rows.append((kind, row))
            print(f"{kind}: healthy after {row['healthy_s']:.1f} s ({row['cpu_s']:.1f} CPU s, load "
                  f"{row['load']:.1f}); precompiled {row['programs']} programs in {row['precompile_s']} s, "
                  f"{row['loaded']} loaded; cache {row['cache_entries']} entries, {row['cache_mb']:.0f} MiB, "
                  f"converted weights {row['converted_mb']:.0f} MiB",
                  flush=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
        env["DFLASH_COMPILE_CACHE"] = str(cache)
        split_load = os.getloadavg()[0]
        out = subprocess.run([sys.executable, "-c", SPLIT, args.config, args.drafter, "1" if args.ar else "0"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode:
            raise RuntimeError(f"the split run failed: {out.stderr[-2000:]}")
        split = json.loads(out.stdout.strip().splitlines()[-1])
    lines = ["| start | seconds to /health | CPU s by then | load average | precompile s | programs | loaded from "
             "the cache | cache entries | cache MiB | converted weights MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, row in rows:
        lines.append(f"| {kind} | {row['healthy_s']:.1f} | {row['cpu_s']:.1f} | {row['load']:.1f} | "
                     f"{row['precompile_s']} | {row['programs']} | {row['loaded']} | {row['cache_entries']} | "
                     f"{row['cache_mb']:.0f} | {row['converted_mb']:.0f} |")
    warm = [r for _, r in rows[1:]]
    cold = rows[0][1]
    summary = f"cold {cold['healthy_s']:.0f} s ({cold['cpu_s']:.0f} CPU s)"
    if warm:
        best = min(warm, key=lambda r: r["healthy_s"])
        summary += (f", warm {best['healthy_s']:.1f} s ({min(r['cpu_s'] for r in warm):.1f} CPU s), "
                    f"{cold['healthy_s'] / best['healthy_s']:.1f}x")
    table, split_md = "\n".join(lines), split_table(split)
    print(table + "\n" + summary + "\n\n" + split_md)
    if args.write:
        command = "benchmarks/serve_startup.py" + ("" if args.config == "demo" else f" --config {args.config}") + \
            (" --ar" if args.ar else "") + (f" --warm-runs {args.warm_runs}" if args.warm_runs != 2 else "") + \
            (f" --warm-nice {args.warm_nice}" if args.warm_nice else "") + " --write"
        nice = (f" The warm servers ran at niceness {args.warm_nice}, ahead of the machine's other work (as on an idle "
                "machine, but for the other work's use of the memory system and the second core)."
                if args.warm_nice else "")
        what = "AR (`--ar`)" if args.ar else f"DFlash with `--drafter {args.drafter}`"
        body = (f"## Serve start-up: cold and warm compilation cache\n\n"
                f"`.venv/bin/python {command}` on {machine()}, {(time.perf_counter() - t_start) / 60:.0f} min, load "
                f"average {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (the machine is "
                f"shared: wall seconds grow with its load, CPU seconds much less). `dflash serve --config "
                f"{args.config}`, {what}, default options (8 slots, every shape precompiled), started with "
                "`DFLASH_COMPILE_CACHE` on a fresh directory (cold), then again over the cache it left (warm); "
                "seconds from the process start to a healthy `/health`, and the CPU seconds the server had used by "
                f"then (user + system, all threads).{nice} Warm starts load every program the cold one compiled "
                f"(JAX's persistent cache; D78): {summary}.\n\n{table}\n\nWhere a warm start's time goes (one "
                f"process over the warm cache, at the default niceness, load average {split_load:.1f}; JAX's "
                "monitoring events, wall seconds): the cache removes compiling, not tracing and lowering, which JAX "
                "does for every program before it can look the program up; no program is run (`Engine.precompile` "
                "compiles each ahead of time).\n\n"
                f"{split_md}\n")
        print(f"wrote {write_section('Serve start-up: cold and warm compilation cache', body)}")


if __name__ == "__main__":
    main()
