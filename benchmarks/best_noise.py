"""How many prompts real τ needs to tell two nearby checkpoints apart (the prompt set `best/` is chosen on).

    .venv/bin/python benchmarks/best_noise.py --config smollm2 \
        --drafter a=runs/noise@15 --drafter b=runs/noise@20 [--drafter c=runs/noise@10] \
        [--sets gsm8k,mtbench,humaneval] [--pool 16] [--tokens 128] [--sizes 1,2,4,8,16,32] [--draws 4000] \
        [--json F] [--from-json F] [--write]

Every drafter decodes the same pool of prompts once (items 0 .. pool-1 of each set, first turn, greedy, one batch
through the serving engine, as training's real-τ evaluation does; `serve.acceptance.real_tau`), and each prompt's
(accepted + 1, verify steps) is kept (`--json`; `--from-json` redoes the statistics from such a file without
decoding). Then, for each prompt-set size n (prompts per set), `--draws` bootstrap prompt sets (n prompts of each
set drawn with replacement from its pool: a fresh set of n prompts as the population the pool samples; the same
draw for every drafter) give each drafter's pooled τ on that set: the table shows the spread of τ across prompt sets
(std), the spread of the paired difference between the first drafter and each other (std of Δτ: what choosing
between two checkpoints on one prompt set sees), and how often a prompt set orders the pair as the whole pool does.
A size whose Δτ spread is well under a Δτ worth telling apart separates the checkpoints; the decode cost grows with n
(tokens decoded: sets x n x tokens, in one batch). `--write` records the section in a study page (`--page`, default
a new dated page in docs/studies/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETS = "gsm8k,mtbench,humaneval"


def parse_drafter(text: str) -> tuple[str, str, str | None]:
    name, sep, where = text.partition("=")
    if not sep or not name or not where:
        raise argparse.ArgumentTypeError(f"a drafter is NAME=PATH[@STEP]; received {text!r}")
    path, _, step = where.partition("@")
    return name, path, step or None


def per_prompt(target, drafter, prompts, tokens: int) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Each prompt's (sum of accepted + 1, verify steps) from one greedy batch decode, its seconds and tokens."""
    from dflash.serve.acceptance import decode_max_len
    from dflash.serve.engine import decode
    from dflash.serve.plan import Chain

    k = drafter.arch.block_size
    t0 = time.perf_counter()
    done = decode(target.params, target.cfg, [list(p.ids) for p in prompts], tokens,
                  max_len=decode_max_len(prompts, tokens, k), drafter=drafter, plan=Chain(k),
                  stop_ids=target.tokenizer.stop_token_ids)
    seconds = time.perf_counter() - t0
    gained = np.array([sum(a + 1 for a in c.accepted) for c in done], np.float64)
    steps = np.array([len(c.accepted) for c in done], np.float64)
    return gained, steps, seconds, sum(len(c.token_ids) for c in done)


def subset_taus(gained: np.ndarray, steps: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Pooled τ of each draw: picks [draws, m] prompt indices."""
    return gained[picks].sum(axis=1) / steps[picks].sum(axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="recipe whose target decodes (default smollm2)")
    parser.add_argument("--drafter", type=parse_drafter, action="append", required=True,
                        help="NAME=PATH[@STEP], at least two; the first is the reference of each pair")
    parser.add_argument("--sets", default=SETS, help=f"comma-separated evaluation sets (default {SETS})")
    parser.add_argument("--pool", type=int, default=16, help="prompts per set decoded once (default 16)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--sizes", default="1,2,4,8,16,32",
                        help="prompt-set sizes per set to draw (default 1,2,4,8,16,32)")
    parser.add_argument("--draws", type=int, default=4000, help="bootstrap prompt sets per size (default 4000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--json", type=Path, help="also write the per-prompt counts as JSON")
    parser.add_argument("--from-json", type=Path, help="the per-prompt counts of an earlier --json: no decoding")
    parser.add_argument("--write", action="store_true", help="record the section in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None, help="with --write: the study page (default: a new one)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if len(args.drafter) < 2 or args.pool < 1 or args.tokens < 1 or not sizes or min(sizes) < 1:
        parser.error("give at least two --drafter, --pool and --tokens >= 1, and --sizes >= 1")

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe

    recipe = load_recipe(args.config)
    sets = [s for s in args.sets.split(",") if s]
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        if (earlier["sets"], earlier["pool"], earlier["tokens"]) != (sets, args.pool, args.tokens):
            parser.error(f"--from-json {args.from_json} holds sets {earlier['sets']}, pool {earlier['pool']}, tokens "
                         f"{earlier['tokens']}: pass the same --sets, --pool and --tokens")
        counts = {name: earlier["drafters"][name] for name, _, _ in args.drafter}
        set_of = earlier["prompt_sets"]
    else:
        from dflash.data.eval_sets import eval_prompts
        from dflash.models.drafter_io import load_drafter
        from dflash.models.target import load_target

        target = load_target(recipe.target)
        prompts = eval_prompts(target.tokenizer, sets, args.pool, template_kwargs=recipe.data.regen.template_kwargs)
        set_of = [p.set for p in prompts]
        counts = {}
        for name, path, step in args.drafter:
            drafter = load_drafter(path, target.cfg, step=step)
            gained, steps, seconds, tokens = per_prompt(target, drafter, prompts, args.tokens)
            counts[name] = {"path": path, "step": step, "gained": gained.tolist(), "steps": steps.tolist(),
                            "seconds": seconds, "tokens": tokens, "tau": float(gained.sum() / steps.sum())}
            print(f"{name}: τ {counts[name]['tau']:.4f} over {len(prompts)} prompts ({tokens} tokens in "
                  f"{seconds:.0f} s)", flush=True)
    by_set = [np.array([i for i, s in enumerate(set_of) if s == name]) for name in sets]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sets": sets, "pool": args.pool, "tokens": args.tokens,
                                         "prompt_sets": set_of, "drafters": counts}, indent=1) + "\n")

    rng = np.random.default_rng(args.seed)
    names = [d[0] for d in args.drafter]
    ref = names[0]
    arrays = {n: (np.array(counts[n]["gained"]), np.array(counts[n]["steps"])) for n in names}
    pool_tau = {n: counts[n]["tau"] for n in names}
    rows = []
    for n in sizes:
        picks = np.concatenate([rng.choice(idx, (args.draws, n), replace=True) for idx in by_set],
                               axis=1)  # [draws, sets * n]: bootstrap prompt sets
        taus = {name: subset_taus(*arrays[name], picks) for name in names}
        row = {"n": n, "prompts": n * len(sets), "tokens": n * len(sets) * args.tokens,
               "std": {name: float(taus[name].std()) for name in names}, "pairs": {}}
        for other in names[1:]:
            delta = taus[other] - taus[ref]
            pool_delta = pool_tau[other] - pool_tau[ref]
            row["pairs"][other] = {"delta_std": float(delta.std()), "pool_delta": pool_delta,
                                   "same_order": float(np.mean(np.sign(delta) == np.sign(pool_delta)))}
        rows.append(row)

    seconds_per_token = np.mean([counts[n]["seconds"] / counts[n]["tokens"] for n in names])
    pairs = names[1:]
    head = ("| prompts per set (total) | tokens decoded | " + " | ".join(f"std τ {n}" for n in names) + " | "
            + " | ".join(f"std Δτ {p}-{ref} (pool Δ {pool_tau[p] - pool_tau[ref]:+.3f}) | same order as pool {p}"
                         for p in pairs) + " |")
    lines = [head, "|---|---|" + "---|" * len(names) + "---|---|" * len(pairs)]
    for r in rows:
        lines.append(f"| {r['n']} ({r['prompts']}) | {r['tokens']} | "
                     + " | ".join(f"{r['std'][n]:.3f}" for n in names) + " | "
                     + " | ".join(f"{r['pairs'][p]['delta_std']:.3f} | {r['pairs'][p]['same_order']:.0%}"
                                  for p in pairs) + " |")
    command = shlex.join([".venv/bin/python", "benchmarks/best_noise.py", *sys.argv[1:]])
    pool_line = ", ".join(f"{n} (`{counts[n]['path']}`@{counts[n]['step']}) {pool_tau[n]:.3f}" for n in names)
    body = "\n".join([
        f"## Real τ noise against the prompt-set size: {' vs '.join(names)}", "",
        f"`{command}` on {machine()}; target of recipe `{args.config}`; a pool of items 0-{args.pool - 1} of each of "
        f"{', '.join(sets)} (first turn, greedy, {args.tokens} new tokens, one batch through the serving engine, "
        f"chat template variables {json.dumps(dict(recipe.data.regen.template_kwargs))}), decoded once per drafter; "
        f"{args.draws} bootstrap prompt sets per size (n prompts of each set drawn with replacement from its pool), "
        "the same for every drafter; τ pooled over the prompt set; Δτ paired (both drafters on the same set).", "",
        f"Real τ over the whole pool: {pool_line}. Decoding took {seconds_per_token * 1000:.1f} ms per token on "
        "this CPU (one batch of the whole pool).", "",
        *lines])
    print(body)
    if args.write:
        print(f"written to {write_study('best_noise_' + '_'.join(names), body, args.page)}")


if __name__ == "__main__":
    main()
