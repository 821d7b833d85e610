"""Sampled requests under each decode plan on the same held-out prompts: real τ of the engine per prompt kind, the
chain and the tree, each with its drafts chosen by either draft rule (`serve.draft_rule`).

    .venv/bin/python benchmarks/sampled_tree.py [--config smollm2] [--drafter data/assets/drafters/smollm2-dflash]
        [--sets gsm8k,mtbench,...] [--per-set 6] [--skip 0] [--tokens 96] [--temperature 1] [--seed 0]
        [--plans chain:0:0:argmax,chain+sample:0:0:sample,tree8+lookup:8:1:argmax,tree8+lookup+sample:8:1:sample]
        [--json F] [--write [--page P]]

A plan is NAME:TREE_NODES:LOOKUP:RULE (0 nodes: the chain of K - 1 drafts; LOOKUP 1 merges a prompt-lookup path
into the tree; RULE argmax: a sampled request's drafts are the drafter's top-ranked tokens, one-hot drafts; sample:
drawn from the drafter's law, speculative sampling on the chain, multi-draft speculative sampling without
replacement on the tree, D84). Every plan decodes the same prompts (items `--skip` .. of each set, first turn) at
the same temperature and seeds (prompt i seeded `--seed` + i) in one batch through the serving engine, as
`benchmarks/drafter_tau.py` does (its chain rows are reproduced exactly: the same prompts, batch and seeds), so
only the plan differs. τ = (accepted + 1) per verify step, pooled; it varies with the seed at T > 0, so compare
plans at the same seed and enough prompts. Also printed: seconds per plan (the whole batch, compiles included: a
rough cost, not a speed measurement). `--write` records the table in a study page (`--page`, default a new dated
page in docs/studies/).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETS = ("gsm8k,mtbench,humaneval,math500,mbpp,benchmarks/prompts/writing.jsonl,benchmarks/prompts/explanation.jsonl,"
        "benchmarks/prompts/sql.jsonl")
PLANS = "chain:0:0:argmax,chain+sample:0:0:sample,tree8+lookup:8:1:argmax,tree8+lookup+sample:8:1:sample"


def parse_plans(text: str) -> list[tuple[str, int, bool, str]]:
    out = []
    for spec in text.split(","):
        parts = spec.split(":")
        if len(parts) != 4 or not parts[1].isdigit() or parts[2] not in ("0", "1") or parts[3] not in ("argmax",
                                                                                                        "sample"):
            raise argparse.ArgumentTypeError(f"a plan is NAME:TREE_NODES:LOOKUP(0|1):RULE(argmax|sample); "
                                             f"received {spec!r}")
        out.append((parts[0], int(parts[1]), parts[2] == "1", parts[3]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="recipe whose target decodes (default smollm2)")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--sets", default=SETS)
    parser.add_argument("--per-set", type=int, default=6)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 decodes greedily (the rule is then moot)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plans", type=parse_plans, default=parse_plans(PLANS), help=f"default {PLANS}")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--page", type=Path)
    args = parser.parse_args()
    if args.per_set < 1 or args.tokens < 1 or args.skip < 0 or args.temperature < 0:
        parser.error("--per-set and --tokens must be >= 1, --skip and --temperature >= 0")

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe
    from dflash.data.eval_sets import eval_prompts
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import accept_per_position, decode_max_len, pooled_tau
    from dflash.serve.config import SamplingConfig
    from dflash.serve.engine import decode
    from dflash.serve.plan import Chain, Tree

    target = load_target(load_recipe(args.config).target)
    drafter = load_drafter(args.drafter, target.cfg)
    k = drafter.arch.block_size
    sets = [s for s in args.sets.split(",") if s]
    prompts = eval_prompts(target.tokenizer, sets, args.per_set, skip=args.skip)
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed) if args.temperature > 0 else None
    rows = []
    for name, nodes, lookup, rule in args.plans:
        plan = Tree(k, nodes, lookup, rule) if nodes > 1 else Chain(k, rule)
        t0 = time.perf_counter()
        done = decode(target.params, target.cfg, [list(p.ids) for p in prompts], args.tokens,
                      max_len=decode_max_len(prompts, args.tokens, plan.width), drafter=drafter, plan=plan,
                      stop_ids=target.tokenizer.stop_token_ids, sampling=sampling)
        row = {"name": name, "plan": plan.describe(), "nodes": nodes, "lookup": lookup, "rule": rule,
               "tau": pooled_tau([c.accepted for c in done]),
               "accept_per_position": accept_per_position([c.accepted for c in done], k),
               "steps": sum(len(c.accepted) for c in done), "tokens": sum(len(c.token_ids) for c in done),
               "seconds": time.perf_counter() - t0}
        for s in sets:
            row[f"tau/{s}"] = pooled_tau([c.accepted for c, p in zip(done, prompts, strict=True) if p.set == s])
        rows.append(row)
        print(json.dumps(row), flush=True)

    settings = {"drafter": args.drafter, "sets": sets, "per_set": args.per_set, "skip": args.skip,
                "tokens": args.tokens, "temperature": args.temperature, "seed": args.seed}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**settings, "rows": rows}, indent=1) + "\n")
    base = rows[0]["tau"]
    lines = ["| plan | draft rule | real τ | vs " + rows[0]["name"] + " | " + " | ".join(
        f"τ {Path(s).stem}" for s in sets) + " | acceptance by position | verify steps | seconds |",
             "|---|---|---|---|" + "---|" * len(sets) + "---|---|---|"]
    for r in rows:
        accept = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        lines.append(f"| {r['name']} ({r['plan']}) | {r['rule']} | {r['tau']:.3f} | {r['tau'] / base - 1:+.1%} | "
                     + " | ".join(f"{r[f'tau/{s}']:.2f}" for s in sets)
                     + f" | {accept} | {r['steps']} | {r['seconds']:.0f} |")
    command = shlex.join([".venv/bin/python", "benchmarks/sampled_tree.py", *sys.argv[1:]])
    how = "greedy" if sampling is None else f"sampled at temperature {args.temperature:g}, prompt i seeded " \
                                            f"{args.seed} + i"
    body = "\n".join([f"## Sampled requests by plan: {', '.join(r['name'] for r in rows)} "
                      f"(T={args.temperature:g}, seed {args.seed}, items {args.skip}-{args.skip + args.per_set - 1})",
                      "", f"`{command}` on {machine()}; target of recipe `{args.config}`, drafter `{args.drafter}` "
                      f"(K={k}); items {args.skip}-{args.skip + args.per_set - 1} of each set (first turn), {how}, "
                      f"{args.tokens} new tokens, one batch through the serving engine; τ = (accepted + 1) per "
                      "verify step, pooled.", "", *lines])
    print(body)
    if args.write:
        key = f"sampled_tree_t{args.temperature:g}_seed{args.seed}_skip{args.skip}"
        print(f"written to {write_study(key, body, args.page)}")


if __name__ == "__main__":
    main()
