"""Real τ against training compute, from the in-loop evaluations of one or more `dflash train` runs.

    .venv/bin/python benchmarks/tau_vs_compute.py runs/smollm2 [runs/smollm2-l1 ...] [--out docs/images] [--write]
        [--held-out drafter_tau.json ...] [--name tau_vs_compute] [--title "Real τ against training compute"]

For each run dir: the recipe from its newest checkpoint's meta (drafter layers, K, batch, anchors) and every
`eval/tau*` record of metrics.jsonl (real greedy τ of the engine on held-out prompts, `train.eval_every`).
Compute is counted in block tokens (step x batch x anchors x K, padded anchors included) and in wall time
(the step's position in the run's timeline is not recorded, so block tokens are the x axis). Writes
NAME.png (pooled τ and τ per prompt set, one line per run) and prints a markdown table; `--write` records it
as section NAME of a study page (`--page`, default a new dated page in docs/studies/; another --name keeps an
earlier study's plot and table beside it).
The in-loop τ is a few prompts (`train.eval_prompts` per set, ±0.05 between neighbouring evaluations);
`--held-out` (repeatable) adds the same runs measured on more prompts by `benchmarks/drafter_tau.py --json`,
greedy or sampled (every file with the same prompts, tokens and sampling): a row NAME=RUN_DIR@STEP is that
step, NAME=RUN_DIR its newest step, and a row of the drafter a run started from (`train.init_from`) its step 0,
one line per run and draft rule (dashed: argmax drafts; dotted: `sample`). A run trained with
`train.eval_every=0` is drawn from these alone.
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
    """{label, dir, per_step, newest, init_from, points: [(step, {set: tau})], held_out: []} of one run dir."""
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
    init_from = Path(train["init_from"]).resolve() if train.get("init_from") else None
    return {"label": label, "dir": run_dir, "per_step": per_step, "newest": steps[0], "init_from": init_from,
            "points": points, "held_out": []}


HELD_OUT_SETTINGS = ("sets", "skip", "per_set", "tokens", "temperature", "top_p", "seed")


def read_held_out(paths: list[Path], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Attach the rows of `benchmarks/drafter_tau.py --json` files to the runs they measure: a step of a run
    (NAME=RUN_DIR@STEP, or NAME=RUN_DIR for its newest step), or the drafter a run started from (its step 0).
    Each entry is (step, {set: tau}, acceptance by position, draft rule). Returns the files' common settings."""
    settings: dict[str, Any] | None = None
    for path in paths:
        found = json.loads(path.read_text())
        these = {k: found.get(k) for k in HELD_OUT_SETTINGS}
        if settings is None:
            settings = these
        elif differs := {k: (settings[k], v) for k, v in these.items() if settings[k] != v}:
            raise SystemExit(f"--held-out {path} was measured with other settings than {paths[0]}: {differs}")
        for row in found["rows"]:
            where = Path(row["path"]).resolve()
            point = ({"all": row["tau"], **{s: row[f"tau/{s}"] for s in found["sets"]}}, row["accept_per_position"],
                     row.get("draft_rule", "argmax"))
            for run in runs:
                if where == run["dir"].resolve() and (row["step"] is None or row["step"].isdigit()):
                    run["held_out"].append((run["newest"] if row["step"] is None else int(row["step"]), *point))
                elif where == run["init_from"] and row["step"] is None:
                    run["held_out"].append((0, *point))
    if not any(run["held_out"] for run in runs):
        raise SystemExit(f"{', '.join(map(str, paths))} measure no step of the runs given (NAME=RUN_DIR[@STEP]) "
                         "nor the drafter one started from")
    for run in runs:  # a row found in several files (a shared baseline) counts once
        once = {(rule, step): (step, taus, accept, rule) for step, taus, accept, rule in reversed(run["held_out"])}
        run["held_out"] = [once[key] for key in sorted(once)]
    return settings


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
    parser.add_argument("--held-out", type=Path, action="append",
                        help="a `benchmarks/drafter_tau.py --json` file (repeatable, all with the same settings) "
                        "whose drafters are steps of these runs or the drafter one started from: plotted dashed")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._report import write_study

    runs = [read_run(r) for r in args.runs]
    held = read_held_out(args.held_out, runs) if args.held_out else None
    if held is None and not any(run["points"] for run in runs):
        raise SystemExit("these runs have no in-loop evaluations (train.eval_every=0): pass --held-out")
    in_loop = sorted({s for run in runs for _, taus in run["points"] for s in taus if s != "all"})
    sets = [*(held["sets"] if held else []), *(s for s in in_loop if not held or s not in held["sets"])]
    how = "greedy" if held is None or not held["temperature"] else \
        f"T={held['temperature']:g}" + (f", top-p {held['top_p']:g}" if held["top_p"] < 1 else "")
    fig, axes = plt.subplots(1, 1 + len(sets), figsize=(4.2 * (1 + len(sets)), 3.6), sharey=True)
    axes = axes if hasattr(axes, "__len__") else [axes]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, name in zip(axes, ["all", *sets], strict=True):
        for i, run in enumerate(runs):
            colour = colours[i % len(colours)]
            xs = [step * run["per_step"] / 1e6 for step, taus in run["points"] if name in taus]
            ys = [taus[name] for _, taus in run["points"] if name in taus]
            if xs:
                ax.plot(xs, ys, marker="o", color=colour, label=f"{run['label']}: in-loop, greedy")
            rules = sorted({rule for *_, rule in run["held_out"]})
            for rule in rules:
                held_points = [(step, taus[name]) for step, taus, _, r in run["held_out"] if r == rule and name in taus]
                ax.plot([step * run["per_step"] / 1e6 for step, _ in held_points],
                        [tau for _, tau in held_points], marker="s", linestyle="--" if rule == "argmax" else ":",
                        color=colour, label=f"{run['label']}: held-out, {held['per_set']} per set"
                        + (f", {rule} drafts" if held["temperature"] else ""))
        ax.set_title("pooled" if name == "all" else Path(name).stem)
        ax.set_xlabel("training block tokens (millions)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"real τ (engine){'' if held is None else ', held-out ' + how}")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.tight_layout()  # the legend below the panels, so that it hides no line
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(4, len(labels)), fontsize=8)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / f"{args.name}.png"
    fig.savefig(png, dpi=110, bbox_inches="tight")

    def table(points_of: str, accept: bool = False) -> list[str]:
        """Markdown rows of each run's `points` or `held_out`; `accept` adds the draft rule and held-out acceptance
        by position."""
        rows = ["| run | step | block tokens (M) | " + ("draft rule | " if accept else "") + "τ pooled | "
                + " | ".join(f"τ {Path(s).stem}" for s in sets) + " |"
                + (" acceptance by position |" if accept else ""),
                "|---|---|---|---|" + "---|" * (len(sets) + 2 * accept)]
        for run in runs:
            for step, taus, *rest in run[points_of]:
                rows.append(f"| {run['label']} | {step} | {step * run['per_step'] / 1e6:.2f} | "
                            + (f"{rest[1]} | " if accept else "") + f"{taus['all']:.2f} | "
                            + " | ".join(f"{taus[s]:.2f}" if s in taus else "-" for s in sets) + " |"
                            + (" " + " ".join(f"{a:.2f}" for a in rest[0]) + " |" if accept else ""))
        return rows

    options = [a for path in args.held_out or [] for a in ("--held-out", str(path))]
    options += ["--name", args.name] if args.name != parser.get_default("name") else []
    options += ["--title", args.title] if args.title != parser.get_default("title") else []
    command = shlex.join([".venv/bin/python", "benchmarks/tau_vs_compute.py", *(str(r) for r in args.runs), *options])
    body = [f"## {args.title}", "", f"`{command}`. Plot: `{png}`."]
    if any(run["points"] for run in runs):
        body += ["", "In-loop real τ (greedy engine decode of held-out prompts, `train.eval_every`) against block "
                 "tokens trained.", "", *table("points")]
    if held:
        body += ["", "Held-out (dashed in the plot; dotted for drafts sampled from the drafter): checkpoints of "
                 "these runs, and the drafter a run started from as its step 0, through `benchmarks/drafter_tau.py`, "
                 f"items {held['skip']}-{held['skip'] + held['per_set'] - 1} of each set (first turn), {how}"
                 + (f" (seed {held['seed']})" if held["temperature"] else "")
                 + f", {held['tokens']} new tokens, one batch through the serving engine.", "",
                 *table("held_out", accept=True)]
    text = "\n".join(body)
    print(text)
    if args.write:
        print(f"written to {write_study(args.name, text, args.page)}")


if __name__ == "__main__":
    main()
