"""Real τ against training compute, from the in-loop evaluations of one or more `dflash train` runs.

    .venv/bin/python benchmarks/tau_vs_compute.py runs/smollm2 [runs/smollm2-l1 ...] [--out docs/images] [--write]
        [--held-out drafter_tau.json] [--name tau_vs_compute] [--title "Real τ against training compute"]

For each run dir: the recipe from its newest checkpoint's meta (drafter layers, K, batch, anchors) and every
`eval/tau*` record of metrics.jsonl (real greedy τ of the engine on held-out prompts, `train.eval_every`).
Compute is counted in block tokens (step x batch x anchors x K, padded anchors included) and in wall time
(the step's position in the run's timeline is not recorded, so block tokens are the x axis). Writes
NAME.png (pooled τ and τ per prompt set, one line per run) and prints a markdown table; `--write` records it
as section NAME of a study page (`--page`, default a new dated page in docs/studies/; another --name keeps an
earlier study's plot and table beside it).
The in-loop τ is a few prompts (`train.eval_prompts` per set, ±0.05 between neighbouring evaluations);
`--held-out` adds the same run's checkpoints measured on more prompts by `benchmarks/drafter_tau.py --json`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def read_run(run_dir: Path) -> dict[str, Any]:
    """{label, block_tokens_per_step, points: [(step, {set: tau})]} of one run dir."""
    steps = sorted((int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()), reverse=True)
    if not steps:
        raise SystemExit(f"{run_dir} has no checkpoints; pass a `dflash train` run dir")
    meta = json.loads((run_dir / "checkpoints" / str(steps[0]) / "meta" / "metadata").read_text())
    train, drafter = meta["recipe"]["train"], meta["recipe"]["drafter"]
    per_step = train["batch_size"] * train["num_anchors"] * drafter["block_size"]
    from dflash.train.real_eval import eval_from_record

    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if (found := eval_from_record(record)) is not None:
            points.append((record["step"], {"all": found["tau"], **found["tau_per_set"]}))
    label = f"{run_dir.name}: {drafter['num_layers']} layers, K={drafter['block_size']}, {train['loss']}" \
        if "loss" in train else f"{run_dir.name}: {drafter['num_layers']} layers, K={drafter['block_size']}"
    return {"label": label, "dir": run_dir, "per_step": per_step, "points": points, "held_out": []}


def read_held_out(path: Path, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Attach the rows of a `benchmarks/drafter_tau.py --json` file that name a step of one of `runs` to it."""
    found = json.loads(path.read_text())
    for row in found["rows"]:
        if row["step"] is None or not row["step"].isdigit():
            continue
        for run in runs:
            if Path(row["path"]).resolve() == run["dir"].resolve():
                run["held_out"].append((int(row["step"]), {"all": row["tau"], **{
                    s: row[f"tau/{s}"] for s in found["sets"]}}, row["accept_per_position"]))
    if not any(run["held_out"] for run in runs):
        raise SystemExit(f"{path} has no drafter of the form NAME=RUN_DIR@STEP for the runs given")
    for run in runs:
        run["held_out"].sort(key=lambda point: point[0])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--write", action="store_true", help="record the table in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None,
                        help="with --write: the study page to add the section to (default: a new dated page "
                        "docs/studies/<today>-<section>.md, listed in docs/studies/README.md)")
    parser.add_argument("--name", default="tau_vs_compute", help="the plot's file stem and the section's name")
    parser.add_argument("--title", default="Real τ against training compute", help="the section's heading")
    parser.add_argument("--held-out", type=Path, help="a `benchmarks/drafter_tau.py --json` file whose drafters "
                        "are steps of these runs (NAME=RUN_DIR@STEP): plotted dashed beside the in-loop τ")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._report import write_study

    runs = [read_run(r) for r in args.runs]
    held = read_held_out(args.held_out, runs) if args.held_out else None
    sets = sorted({s for run in runs for _, taus in run["points"] for s in taus if s != "all"}
                  | set(held["sets"] if held else []))
    fig, axes = plt.subplots(1, 1 + len(sets), figsize=(4.2 * (1 + len(sets)), 3.6), sharey=True)
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, name in zip(axes, ["all", *sets], strict=True):
        for run in runs:
            xs = [step * run["per_step"] / 1e6 for step, taus in run["points"] if name in taus]
            ys = [taus[name] for _, taus in run["points"] if name in taus]
            line, = ax.plot(xs, ys, marker="o", label=f"{run['label']}: in-loop")
            held_points = [(step, taus[name]) for step, taus, _ in run["held_out"] if name in taus]
            if held_points:
                ax.plot([step * run["per_step"] / 1e6 for step, _ in held_points],
                        [tau for _, tau in held_points], marker="s", linestyle="--",
                        color=line.get_color(), label=f"{run['label']}: held-out, {held['per_set']} per set")
        ax.set_title("pooled" if name == "all" else name)
        ax.set_xlabel("training block tokens (millions)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("real greedy τ (engine)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.name}.png"
    fig.savefig(png, dpi=110)

    def table(points_of: str, accept: bool = False) -> list[str]:
        """Markdown rows of each run's `points` or `held_out`; `accept` adds held-out acceptance by position."""
        rows = ["| run | step | block tokens (M) | τ pooled | " + " | ".join(f"τ {s}" for s in sets) + " |"
                + (" acceptance by position |" if accept else ""),
                "|---|---|---|---|" + "---|" * (len(sets) + accept)]
        for run in runs:
            for step, taus, *by_position in run[points_of]:
                rows.append(f"| {run['label']} | {step} | {step * run['per_step'] / 1e6:.2f} | {taus['all']:.2f} | "
                            + " | ".join(f"{taus[s]:.2f}" if s in taus else "-" for s in sets) + " |"
                            + (" " + " ".join(f"{a:.2f}" for a in by_position[0]) + " |" if accept else ""))
        return rows

    options = ["--held-out", str(args.held_out)] if args.held_out else []
    options += ["--name", args.name] if args.name != parser.get_default("name") else []
    options += ["--title", args.title] if args.title != parser.get_default("title") else []
    command = shlex.join([".venv/bin/python", "benchmarks/tau_vs_compute.py", *(str(r) for r in args.runs), *options])
    body = [f"## {args.title}", "", f"`{command}`: in-loop real τ (greedy engine decode of held-out prompts, "
            f"`train.eval_every`) against block tokens trained. Plot: `{png}`.", "", *table("points")]
    if held:
        body += ["", f"Held-out (dashed in the plot): the same steps' checkpoints through `benchmarks/drafter_tau.py`, "
                 f"items {held['skip']}-{held['skip'] + held['per_set'] - 1} of each set (first turn), greedy, "
                 f"{held['tokens']} new tokens, one batch through the serving engine.", "",
                 *table("held_out", accept=True)]
    text = "\n".join(body)
    print(text)
    if args.write:
        print(f"written to {write_study(args.name, text, args.page)}")


if __name__ == "__main__":
    main()
