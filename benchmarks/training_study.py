"""Training choices measured by real τ at equal compute: one short `dflash train` run per variant of a recipe.

    .venv/bin/python benchmarks/training_study.py --recipe smollm2 --block-tokens 600000 \
        --variant decay: --variant dpace:train.weighting=dpace [--eval-tokens 64] [--eval-prompts 2] [--write]
    .venv/bin/python benchmarks/training_study.py --recipe smollm2 --block-tokens 600000 \
        --variant K8:drafter.block_size=8 --variant K16:drafter.block_size=16 --variant K32:drafter.block_size=32

Each variant is `NAME:override,override,...` on top of the recipe (its offline features are shared: K, the
loss and the drafter depth do not change what is captured). Every variant trains the same number of block
tokens (steps = block_tokens / (batch x anchors x K), so a wider K gets fewer anchors' worth of steps at the
same compute), into runs/study/<NAME>, with the recipe's real-τ evaluation at the end (`train.eval_every` =
the last step, or every `--eval-every` steps as well). Reported per variant: real τ pooled and per set,
acceptance by draft position, wall time.
A rerun resumes finished variants (their runs are complete). `--write` records the table in a study page
under a section named after the variants (`--page`, default a new dated page in docs/studies/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"a variant is NAME:override,...; received {text!r}")
    return name, [o for o in overrides.split(",") if o]


def last_eval(run_dir: Path, step: int) -> dict:
    """The real-τ evaluation at `step` (the run's last) from its metrics.jsonl: {tau, tau_per_set,
    accept_per_position} (equal compute: the last step, not the run's best)."""
    from dflash.train.real_eval import eval_from_record

    for line in reversed((run_dir / "metrics.jsonl").read_text().splitlines()):
        record = json.loads(line)
        if record.get("step") == step and (found := eval_from_record(record)) is not None:
            return found
    raise SystemExit(f"{run_dir}: no real-τ evaluation at step {step} in metrics.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="smollm2")
    parser.add_argument("--block-tokens", type=int, required=True, help="training compute per variant")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--eval-prompts", type=int, default=2)
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also evaluate every N steps (a τ-vs-compute curve per variant: "
                             "benchmarks/tau_vs_compute.py runs/study/*); default: the last step only")
    parser.add_argument("--out", type=Path, default=Path("runs/study"))
    parser.add_argument("--write", action="store_true", help="record the table in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None,
                        help="with --write: the study page to add the section to (default: a new dated page "
                        "docs/studies/<today>-<section>.md, listed in docs/studies/README.md)")
    args = parser.parse_args()

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe
    from dflash.models.target import load_target
    from dflash.train.loop import run_training

    base = load_recipe(args.recipe)
    target = load_target(base.target)
    rows = []
    for name, overrides in args.variant:
        probe = load_recipe(args.recipe, overrides)
        per_step = probe.train.batch_size * probe.train.num_anchors * probe.drafter.block_size
        steps = max(1, args.block_tokens // per_step)
        every = args.eval_every if 0 < args.eval_every < steps else steps
        recipe = load_recipe(args.recipe, [*overrides, f"train.steps={steps}", f"train.eval_every={every}",
                                           f"train.save_every={steps}", f"train.run_dir={args.out / name}",
                                           f"train.eval_prompts={args.eval_prompts}",
                                           f"train.eval_tokens={args.eval_tokens}"])
        t0 = time.perf_counter()
        run_training(recipe, target=target, progress=True)
        rows.append({"name": name, "overrides": overrides, "steps": steps, "block_tokens": steps * per_step,
                     "seconds": time.perf_counter() - t0, **last_eval(args.out / name, steps)})
        print(json.dumps(rows[-1]), flush=True)
    sets = sorted({s for r in rows for s in r["tau_per_set"]})
    head = "| variant | overrides | steps | block tokens | wall (min) | real τ | "
    lines = [head + " | ".join(f"τ {s}" for s in sets) + " | acceptance by position |",
             "|---|---|---|---|---|---|" + "---|" * len(sets) + "---|"]
    for r in rows:
        accept = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        lines.append(f"| {r['name']} | {' '.join(r['overrides']) or '-'} | {r['steps']} | {r['block_tokens']} | "
                     f"{r['seconds'] / 60:.1f} | {r['tau']:.2f} | "
                     + " | ".join(f"{r['tau_per_set'].get(s, 0):.2f}" for s in sets) + f" | {accept} |")
    command = shlex.join([".venv/bin/python", "benchmarks/training_study.py", *sys.argv[1:]])
    title = "Training study: " + " vs ".join(n for n, _ in args.variant)
    body = "\n".join([f"## {title}", "", f"`{command}` on {machine()}; recipe `{args.recipe}`, equal block tokens "
                      f"per variant; real τ = greedy engine decode of {args.eval_prompts} held-out prompts per set, "
                      f"{args.eval_tokens} new tokens, at the last step.", "", *lines])
    print(body)
    if args.write:
        key = "training_study_" + "_".join(n for n, _ in args.variant)
        print(f"written to {write_study(key, body, args.page)}")


if __name__ == "__main__":
    main()
