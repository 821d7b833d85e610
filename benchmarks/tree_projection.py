"""Projected speed-up of tree over chain verification on accelerators, from the τ measured here by node budget and a
verify-cost curve by width measured or published elsewhere. A projection, not a measurement.

    .venv/bin/python benchmarks/tree_projection.py --from-json /tmp/tree_bench.json [--batch 1] [--write]

τ by mode comes from a `benchmarks/tree_vs_chain.py --json` run (greedy decoding makes τ a property of the
drafter, prompts and budget, not of the machine). Step cost by verify width w, relative to the chain's width K:

- TPU v5p, published (docs/design.md §9, "K-flat"): at batch 1, verifying 1024 tokens costs about what 16 do, so
  cost(w) = cost(K) for every w <= 1024: the projected speed-up is the τ ratio itself;
- H200, measured (`engine_throughput_gpu` in docs/benchmarks.md: `verify` ms by K at B=1 and B=8), linearly
  interpolated between the measured widths.

Projected speed-up of a tree of N nodes over the chain = (τ_N / cost(N)) / (τ_chain / cost(K)). Left out: the
drafter's forward (the same one forward for chain and tree), the tree's top-k and best-first build (small beside
a verify on an accelerator, unmeasured there), and the host loop (the device loop takes R steps per dispatch).
`--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GPU_SECTION = "engine_throughput_gpu"


def gpu_verify_curves(doc: Path) -> dict[str, dict[int, float]]:
    """{"H200 B=1": {K: ms}, "H200 B=8": {K: ms}} from the verify table of the `engine_throughput_gpu` section."""
    text = doc.read_text()
    match = re.search(rf"<!-- begin {GPU_SECTION} -->(.*?)<!-- end {GPU_SECTION} -->", text, re.S)
    if match is None:
        raise SystemExit(f"{doc}: no section {GPU_SECTION} (the H200 verify curve); rerun "
                         "benchmarks/engine_throughput.py on a GPU")
    curves: dict[str, dict[int, float]] = {"H200 B=1": {}, "H200 B=8": {}}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].isdigit():  # | K | B=1 ms | B=1 vs K=1 | tok/s | B=8 ms | vs K=1 | tok/s |
            curves["H200 B=1"][int(cells[0])] = float(cells[1])
            curves["H200 B=8"][int(cells[0])] = float(cells[4])
    if not all(curves.values()):
        raise SystemExit(f"{doc}: section {GPU_SECTION} has no verify rows '| K | B=1 ms | ... |'")
    return curves


def cost(curve: dict[int, float], width: int) -> float:
    """The curve at `width`, linearly interpolated between measured widths (clamped at the ends)."""
    ks = sorted(curve)
    if width <= ks[0]:
        return curve[ks[0]]
    if width >= ks[-1]:
        return curve[ks[-1]]
    lo = max(k for k in ks if k <= width)
    hi = min(k for k in ks if k >= width)
    if lo == hi:
        return curve[lo]
    return curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-json", required=True, help="a benchmarks/tree_vs_chain.py --json file")
    parser.add_argument("--batch", default=None, help="which batch's τ (default: the first recorded)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from benchmarks._report import write_section

    saved = json.loads(Path(args.from_json).read_text())
    results, meta = (saved["results"], saved.get("meta", {})) if "results" in saved else (saved, {})
    batch = args.batch or next(iter(results))
    by_mode = results[batch]
    k = meta.get("k") or 4
    chain = by_mode.get(f"chain K={k}")
    if chain is None:
        raise SystemExit(f"{args.from_json}: no 'chain K={k}' mode at batch {batch}")
    curves = {"TPU v5p B=1 (published: flat to 1024)": None, **gpu_verify_curves(ROOT / "docs" / "benchmarks.md")}
    header = "| mode | verify width | τ | τ / chain | " + " | ".join(f"projected vs chain, {c}" for c in curves) + " |"
    lines = [header, "|---" * (4 + len(curves)) + "|"]
    for name, r in by_mode.items():
        if name == "AR" or name.startswith("n-gram only"):
            continue
        width = r.get("width") or int(name.split("=")[1].split()[0])  # "tree N=8 + n-gram" -> 8 (older runs)
        ratio = r["tau"] / chain["tau"]
        cells = [f"{ratio:.2f}x" if curve is None else f"{ratio * cost(curve, k) / cost(curve, width):.2f}x"
                 for curve in curves.values()]
        lines.append(f"| {name} | {width} | {r['tau']:.2f} | {ratio:.2f}x | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        command = shlex.join([".venv/bin/python", "benchmarks/tree_projection.py", *sys.argv[1:]])
        source = meta.get("command", "benchmarks/tree_vs_chain.py")
        write_section("Tree vs chain: projected accelerator speed-up", "\n".join([
            "## Tree vs chain: projected accelerator speed-up",
            "",
            f"`{command}`, {datetime.date.today().isoformat()}. **A projection, not a measurement**: τ by mode "
            f"measured on this CPU by `{source}` "
            f"(batch {batch}, greedy, the shipped K = {k} drafter on {meta.get('source', 'smollm2')}; modes "
            f"finished: {len(by_mode)}), step cost by verify width taken from elsewhere: TPU v5p flat up to "
            "1024 tokens at batch 1 (published, docs/design.md §9), H200 `verify` ms by K measured at B=1 and B=8 "
            "(section engine_throughput_gpu, interpolated between measured widths). Projected speed-up = (τ_N / "
            "cost(N)) / (τ_chain / cost(K)); the drafter's forward (one for chain and tree alike), the tree's "
            "top-k and build, and the host loop are left out. The H200 B=1 curve is not monotone (16 tokens "
            "measured slower than 32), so its column moves with that noise.",
            "",
            table,
        ]))


if __name__ == "__main__":
    main()
