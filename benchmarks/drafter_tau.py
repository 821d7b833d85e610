"""Drafters side by side on the same held-out prompts: real τ of the engine per set, per drafter, greedy or sampled.

    .venv/bin/python benchmarks/drafter_tau.py --config smollm2 \
        --drafter shipped=data/assets/drafters/smollm2-dflash --drafter mix2=runs/mix2 \
        [--sets gsm8k,mtbench,humaneval,math500,mbpp] [--skip 8] [--per-set 6] [--tokens 128] \\
        [--temperature T [--top-p P] [--seed S] [--draft-rules argmax,sample]] [--write] [--json F] [--plot PNG]

A drafter is NAME=PATH[@STEP]: an exported directory, or a run dir (latest checkpoint, a step, or `best`).
Every drafter decodes the same prompts (items `--skip` .. `--skip + --per-set - 1` of each set, first turn,
greedy, in one batch) with the serving engine and the recipe's target, so the comparison holds the prompts,
the target and the engine fixed. The default `--skip 8` leaves out the items that training's in-loop
evaluation (`train.eval_prompts`, the first 2) and `dflash eval` (`--limit`, default 8) look at, so a
drafter picked by either is not measured on the prompts it was picked on. τ is deterministic for greedy
decoding, so unlike a speed ratio it can be compared across runs and machines. With `--temperature` T > 0 the
prompts are sampled (lossless speculative sampling: the output has the target's sampling distribution), prompt i
seeded `--seed` + i, so a drafter's τ at T is reproducible on one machine; it varies with the seed, so compare
drafters at the same seed and enough prompts. `--write` records the table
in a study page under a section named after the drafters (`--page`, default a new dated page in docs/studies/).
`--plot` draws τ per set, one bar per drafter (the table as a picture).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETS = "gsm8k,mtbench,humaneval,math500,mbpp"


def parse_drafter(text: str) -> tuple[str, str, str | None]:
    name, sep, where = text.partition("=")
    if not sep or not name or not where or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"a drafter is NAME=PATH[@STEP]; received {text!r}")
    path, _, step = where.partition("@")
    return name, path, step or None


def plot_bars(rows: list[dict], sets: list[str], png: Path, how: str) -> None:
    """Pooled τ and τ per set as grouped bars, one colour per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = ["pooled", *(Path(s).stem for s in sets)]
    keys = ["tau", *(f"tau/{s}" for s in sets)]
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(1.1 * len(labels) + 2, 3.8))
    for i, r in enumerate(rows):
        ax.bar(np.arange(len(labels)) + (i - (len(rows) - 1) / 2) * width, [r[k] for k in keys], width, label=r["name"])
    ax.set_xticks(np.arange(len(labels)), labels, rotation=20)
    ax.set_ylabel(f"real τ (engine, {how})")
    ax.set_ylim(1.0, None)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=min(len(rows), 4))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"plot written to {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="recipe whose target decodes (default smollm2)")
    parser.add_argument("--drafter", type=parse_drafter, action="append", required=True)
    parser.add_argument("--sets", default=SETS, help=f"comma-separated evaluation sets (default {SETS})")
    parser.add_argument("--skip", type=int, default=8, help="items left out at the start of each set")
    parser.add_argument("--per-set", type=int, default=6, help="prompts per set")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature (default 1: off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (default 0)")
    parser.add_argument("--draft-rules", default="argmax",
                        help="with --temperature: comma-separated draft rules, each drafter measured under each "
                        "(argmax: one-hot drafts; sample: drafts drawn from the drafter, speculative sampling; "
                        "a row per drafter and rule, named NAME+RULE past the first; default argmax)")
    parser.add_argument("--write", action="store_true", help="record the table in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None,
                        help="with --write: the study page to add the section to (default: a new dated page "
                        "docs/studies/<today>-<section>.md, listed in docs/studies/README.md)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON (benchmarks/tau_vs_compute.py "
                        "--held-out plots those of run-dir steps)")
    parser.add_argument("--baseline", type=Path, help="an earlier `--json` file with the same prompts, tokens and "
                        "sampling settings: its rows come first in the table and plot, without decoding again")
    parser.add_argument("--plot", type=Path, help="also draw τ per set, one bar per drafter, into this PNG")
    args = parser.parse_args()
    if args.skip < 0 or args.per_set < 1 or args.tokens < 1:
        parser.error("--skip must be >= 0, --per-set and --tokens >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p lie in (0, 1]")
    rules = [r for r in args.draft_rules.split(",") if r]
    from dflash.serve.config import DRAFT_RULES

    if not rules or any(r not in DRAFT_RULES for r in rules) or len(set(rules)) != len(rules):
        parser.error(f"--draft-rules must list argmax and/or sample once each; received {args.draft_rules!r}")
    if rules != ["argmax"] and args.temperature == 0:
        parser.error("--draft-rules applies to sampled decoding: give --temperature > 0 (greedy drafts are argmax)")

    sets = [s for s in args.sets.split(",") if s]
    rows = []
    settings = {"sets": sets, "skip": args.skip, "per_set": args.per_set, "tokens": args.tokens,
                "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    if args.baseline:  # checked before the target loads: a mismatching file fails at once
        earlier = json.loads(args.baseline.read_text())
        differs = {k: (earlier.get(k), v) for k, v in settings.items() if earlier.get(k) != v}
        if differs:
            parser.error(f"--baseline {args.baseline} was measured with other settings: {differs}")
        rows.extend(earlier["rows"])

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe
    from dflash.data.eval_sets import eval_prompts
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import real_tau
    from dflash.serve.config import SamplingConfig

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    prompts = eval_prompts(target.tokenizer, sets, args.per_set, skip=args.skip)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=args.seed) \
        if args.temperature > 0 else None
    for name, path, step in args.drafter:
        drafter = load_drafter(path, target.cfg, step=step)
        for i, rule in enumerate(rules):
            found = real_tau(target, drafter, prompts, args.tokens, sampling, draft_rule=rule)
            rows.append({"name": name if i == 0 else f"{name}+{rule}", "path": path, "step": step,
                         "block_size": drafter.arch.block_size, "draft_rule": rule, **found})
            print(json.dumps(rows[-1]), flush=True)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**settings, "rows": rows}, indent=1) + "\n")
    lines = ["| drafter | K | real τ | " + " | ".join(f"τ {s}" for s in sets) + " | acceptance by position |",
             "|---|---|---|" + "---|" * len(sets) + "---|"]
    for r in rows:
        where = r["path"] + (f"@{r['step']}" if r["step"] else "")
        accept = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        lines.append(f"| {r['name']} (`{where}`) | {r['block_size']} | {r['tau']:.2f} | "
                     + " | ".join(f"{r[f'tau/{s}']:.2f}" for s in sets) + f" | {accept} |")
    command = shlex.join([".venv/bin/python", "benchmarks/drafter_tau.py", *sys.argv[1:]])
    how = "greedy" if sampling is None else (f"sampled at temperature {args.temperature:g}"
                                             + (f", top-p {args.top_p:g}" if args.top_p < 1 else "")
                                             + f", draft rule {' / '.join(rules)}"
                                             + f", prompt i seeded {args.seed} + i")
    at = "" if sampling is None else f" at temperature {args.temperature:g}"
    body = "\n".join([f"## Drafters on held-out prompts{at}: {' vs '.join(r['name'] for r in rows)}", "",
                      f"`{command}` on {machine()}; target of recipe `{args.config}`; items {args.skip}-"
                      f"{args.skip + args.per_set - 1} of each set (first turn), {how}, {args.tokens} new tokens, "
                      "one batch through the serving engine; τ = (accepted + 1) per verify step, pooled.", "",
                      *lines])
    print(body)
    if args.plot:
        plot_bars(rows, sets, args.plot, "greedy" if sampling is None else f"T={args.temperature:g}")
    if args.write:
        key = "drafter_tau_" + "_".join(r["name"] for r in rows) + ("" if sampling is None else
                                                                    f"_t{args.temperature:g}")
        print(f"written to {write_study(key, body, args.page)}")


if __name__ == "__main__":
    main()
