"""Acceptance of two drafters trained alike on different data: GSM8K reference answers vs the target's own
regenerated answers (docs/design.md §2: the drafter should learn what the target says, not what a dataset says).

    .venv/bin/python -m benchmarks.data_effect --reference runs/demo --regenerated runs/demo-regen --write

Both drafters decode the same prompts greedily through the bundled engine (`serve.engine.decode`,
block K = the drafters' training K) against the same target; the script reports τ (tokens per verify
step, pooled over all steps), acceptance by draft position, and the τ ratio, per prompt set: GSM8K test
questions (the training domain) and MT-Bench first turns (out of domain). Greedy outputs must be equal
across the two drafters (both equal AR); the script checks it. How the two run dirs were made is the
caller's to state (see docs/studies/2026-11-29-regenerated-vs-reference.md for the recorded run). `--write`
records the table in a study page (`--page`, default a new dated page in docs/studies/).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _pooled(results) -> tuple[float, list[float], int]:
    accepted = np.concatenate([np.asarray(r.accepted) for r in results])
    k = results[0].block_size
    return float(np.mean(accepted + 1)), [float(np.mean(accepted > i)) for i in range(k - 1)], len(accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="run dir of the drafter trained on reference answers")
    parser.add_argument("--regenerated", required=True, help="run dir of the drafter trained on regenerated data")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set (default 8)")
    parser.add_argument("--new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    parser.add_argument("--config", default="demo", help="recipe giving the target (default demo)")
    parser.add_argument("--note", default="", help="how the two run dirs were made (recorded with the table)")
    parser.add_argument("--write", action="store_true", help="record the table in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None,
                        help="with --write: the study page to add the section to (default: a new dated page "
                        "docs/studies/<today>-<section>.md, listed in docs/studies/README.md)")
    args = parser.parse_args()

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe
    from dflash.data.packaged import load_gsm8k, load_mtbench
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.engine import decode

    t_start = time.perf_counter()
    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    tok = target.tokenizer
    sets = {
        "GSM8K test": [c[:1] for c in load_gsm8k("test", limit=args.prompts)],
        "MT-Bench turn 1": [c[:1] for c in load_mtbench(limit=args.prompts)],
    }
    drafters = {name: load_drafter(Path(path), target.cfg)
                for name, path in (("reference", args.reference), ("regenerated", args.regenerated))}
    rows, outputs = [], {}
    for set_name, conversations in sets.items():
        prompts = [tok.encode_chat(c, add_generation_prompt=True) for c in conversations]
        taus = {}
        for name, drafter in drafters.items():
            results = decode(target.params, target.cfg, prompts, args.new_tokens,
                             max_len=max(len(p) for p in prompts) + args.new_tokens + 64, drafter=drafter,
                             stop_ids=tok.stop_token_ids)
            outputs[set_name, name] = [r.token_ids for r in results]
            tau, per_pos, steps = _pooled(results)
            taus[name] = tau
            rows.append((set_name, name, tau, steps, per_pos))
            print(f"{set_name:16s} {name:12s} tau {tau:.3f} over {steps} steps; by position "
                  + " ".join(f"{a:.2f}" for a in per_pos), flush=True)
        if outputs[set_name, "reference"] != outputs[set_name, "regenerated"]:
            raise SystemExit(f"greedy outputs differ between the drafters on {set_name}: a lossless decoder "
                             "must give the AR output with either")
        rows.append((set_name, "ratio", taus["regenerated"] / taus["reference"], 0, []))

    k = drafters["reference"].arch.block_size
    seconds = time.perf_counter() - t_start
    lines = [f"`.venv/bin/python -m benchmarks.data_effect --reference {args.reference} --regenerated "
             f"{args.regenerated}{' --write' if args.write else ''}` on {machine()}; {seconds:.0f} s. "
             f"Greedy DFlash, block {k}, {args.prompts} prompts per set, up to {args.new_tokens} new tokens, "
             "outputs identical between the drafters (both equal AR)." + (f" {args.note}" if args.note else ""), "",
             "| prompts | drafter trained on | tau | verify steps | acceptance by draft position |",
             "|---|---|---|---|---|"]
    for set_name, name, tau, steps, per_pos in rows:
        if name == "ratio":
            lines.append(f"| {set_name} | regenerated / reference | {tau:.2f}x | | |")
        else:
            lines.append(f"| {set_name} | {name} | {tau:.3f} | {steps} | {' '.join(f'{a:.2f}' for a in per_pos)} |")
    body = "\n".join(lines)
    print(body)
    if args.write:
        print("written to", write_study("data_effect", "## Regenerated vs reference training data\n\n" + body,
                                        args.page))


if __name__ == "__main__":
    main()
