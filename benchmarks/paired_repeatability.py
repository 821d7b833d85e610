"""How far the demo's speed ratio moves from run to run: the evaluation timed in two phases (every DFlash reply,
then every AR reply: before issue 54) against paired (each request on both modes back to back, alternating which
goes first: `eval.run.collect`), side by side in one run.

    .venv/bin/python benchmarks/paired_repeatability.py [--runs 3] [--limit 3] [--write]

The demo's evaluation (`launch.demo.short_eval`): the demo recipe's target and the shipped drafter behind two
in-process servers (the decode plan of `configs/demo.yaml`, AR beside it over the same weights), greedy, `--limit`
conversations of each of GSM8K, MT-Bench, HumanEval and MATH-500. The servers start (and compile) once; each run
sends the same requests twice, phased and paired, the method that goes first alternating from run to run. Phased:
the ratio of mean TPOTs (what `dflash eval` reported before). Paired: the headline of `eval.report` (the median of
per-request ratios, with its timing noise). Per method: each run's ratio and the runs' spread (max / min - 1).
`--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import machine, write_section  # noqa: E402
from dflash.configs.recipe import load_recipe  # noqa: E402
from dflash.eval.client import Client  # noqa: E402
from dflash.eval.report import summarize  # noqa: E402
from dflash.eval.run import EvalSettings, collect, eval_items  # noqa: E402
from dflash.eval.servers import serve_in_process  # noqa: E402
from dflash.launch.demo import EVAL_SETS  # noqa: E402
from dflash.models.drafter_io import load_drafter  # noqa: E402
from dflash.models.registry import shipped_drafter_path  # noqa: E402
from dflash.models.target import load_target  # noqa: E402
from dflash.serve.plan import plan_from  # noqa: E402

SECTION = "Paired speed ratio: run to run"


def phased_ratio(records: list[dict]) -> float:
    """Mean AR TPOT / mean DFlash TPOT (the pre-issue-54 speedup)."""
    tpot = {mode: statistics.mean(r["tpot_s"] for r in records
                                  if r["kind"] == "reply" and r["mode"] == mode and r["tpot_s"])
            for mode in ("dflash", "ar")}
    return tpot["ar"] / tpot["dflash"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=int, default=3, help="conversations per set (the demo's EVAL_LIMIT)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args(argv)

    recipe = load_recipe("demo")
    target = load_target(recipe.target)
    source = shipped_drafter_path(recipe.target.source)
    drafter = load_drafter(source, target.cfg)
    plan = plan_from(recipe.serve, drafter, None)
    settings = EvalSettings(sets=EVAL_SETS, limit=args.limit, max_new_tokens=recipe.sampling.max_new_tokens)
    items = eval_items(settings)
    max_len = recipe.target.max_seq_len
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rows: list[tuple[int, str, float, dict]] = []
    with serve_in_process(target, drafter, plan, slots=1, max_len=max_len) as url, \
            serve_in_process(target, None, slots=1, max_len=max_len) as ar_url, \
            tempfile.TemporaryDirectory() as tmp:
        clients = {"dflash": Client(url), "ar": Client(ar_url)}
        for run in range(args.runs):
            for method in (("phased", "paired") if run % 2 == 0 else ("paired", "phased")):
                out = Path(tmp) / f"{run}-{method}"
                if method == "phased":
                    collect({"dflash": clients["dflash"]}, settings, out, items, progress=False)
                    records = collect({"ar": clients["ar"]}, settings, out, items, progress=False)
                    rows.append((run, method, phased_ratio(records), {}))
                else:
                    records = collect(clients, settings, out, items, progress=False)
                    meta = {"environment": {}, "target": {"model": "demo"}, "drafter": {},
                            "settings": {"block_size": plan.k}}
                    paired = summarize(records, settings.sets, [1], plan.k, {}, meta)["headline"]["paired"]
                    rows.append((run, method, paired["median"], paired))
                print(f"run {run + 1} {method}: {rows[-1][2]:.3f}x", flush=True)
    minutes = (time.perf_counter() - started) / 60
    lines = [f"## {SECTION}", "",
             f"`.venv/bin/python benchmarks/paired_repeatability.py --runs {args.runs} --limit {args.limit}` on "
             f"{machine()}, {minutes:.0f} min, load average {load:.1f} at the start. The demo's evaluation "
             f"({plan.describe()}, shipped drafter, greedy, {len(items)} conversations of {', '.join(EVAL_SETS)}); "
             "the same requests timed phased (all DFlash replies, then all AR replies; ratio of mean TPOTs) and "
             "paired (each request on both back to back; median of per-request ratios), the first method "
             "alternating.", "",
             "| run | phased: mean TPOT ratio | paired: median ratio | paired: timing noise | paired: cost ratio |",
             "|---|---|---|---|---|"]
    by = {(run, method): (ratio, extra) for run, method, ratio, extra in rows}
    for run in range(args.runs):
        paired = by[run, "paired"][1]
        lines.append(f"| {run + 1} | {by[run, 'phased'][0]:.2f}x | {by[run, 'paired'][0]:.2f}x | "
                     f"+-{paired['noise'] / 2:.1%} | {paired['cost_ratio']:.3f} |")
    spreads = {}
    for method in ("phased", "paired"):
        ratios = [by[run, method][0] for run in range(args.runs)]
        spreads[method] = max(ratios) / min(ratios) - 1
    lines += ["", f"Run-to-run spread (max / min - 1): phased {spreads['phased']:.1%}, paired "
                  f"{spreads['paired']:.1%}."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        print(f"written to {write_section(SECTION, body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
