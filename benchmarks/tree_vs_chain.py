"""Chain vs tree verification side by side in one run: τ, verify width, step cost and tokens/s per prompt kind.

    .venv/bin/python benchmarks/tree_vs_chain.py [--config smollm2]
        [--drafter data/assets/drafters/smollm2-dflash] [--per-kind 2] [--tokens 64]
        [--batches 1,4] [--nodes 4,8,16] [--modes ar,chain,tree,ngram,tree+ngram] [--steps-per-dispatch R]
        [--write] [--json F]

The recipe's target (default: the embedded SmolLM2, fp32) and the shipped drafter decode the same greedy prompts
of four kinds (GSM8K, MT-Bench, HumanEval: items 8.. of each set, so not the ones training or `dflash eval` look
at; and "copy", prompts that ask to repeat and edit a given SQL query or text, where prompt lookup should shine)
with the serving engine, in these modes: AR; the DFlash chain at the drafter's K; the tree at N nodes (depth <= K -
1) for each `--nodes`; prompt lookup alone (an n-gram chain of K - 1 drafts); the tree at the middle N with the
lookup path merged (`--tree-ngram`); `--modes` keeps a subset (AR always runs: the reference);
`--steps-per-dispatch R` runs every mode with R steps per dispatch (the device loop). Each mode runs at each batch
(`--batches`: slots; every prompt submitted at once) twice, the first run compiling; the second is reported: τ
(tokens per verify step, bonus included, pooled), verify width (tokens the target scores per step: K, or N), ms
per step, tokens/s (new tokens over the wall time of the run, prefill included, the same prompts in every mode)
and the speed-up over AR. Greedy outputs are
checked equal to AR's. `--write` records the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

COPY_TEXTS = [
    "Here is a SQL query:\n\nSELECT customers.name, customers.email, orders.order_id, orders.total\nFROM customers\n"
    "JOIN orders ON orders.customer_id = customers.id\nWHERE orders.total > 100 AND customers.country = 'France'\n"
    "ORDER BY orders.total DESC;\n\nRewrite the query exactly, but select customers.phone instead of customers.email.",
    "Copy the following list exactly, then add one more item in the same style:\n\n"
    "- apples: 3 kg, bought on Monday at the market\n- pears: 2 kg, bought on Monday at the market\n"
    "- plums: 1 kg, bought on Tuesday at the market\n- cherries: 500 g, bought on Tuesday at the market\n",
    "Here is a Python function:\n\ndef total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n\n"
    "Repeat the function exactly, but rename subtotal to net_total.",
    "Here is a SQL query:\n\nSELECT product_id, SUM(quantity) AS units, SUM(quantity * unit_price) AS revenue\n"
    "FROM order_items\nWHERE order_date BETWEEN '2024-01-01' AND '2024-03-31'\nGROUP BY product_id\n"
    "HAVING SUM(quantity) > 10\nORDER BY revenue DESC;\n\nRewrite the query exactly, but for the second quarter.",
]


def prompts_by_kind(tokenizer, per_kind: int) -> list[tuple[str, list[int]]]:
    from dflash.data.eval_sets import eval_prompts

    out = [(p.set, list(p.ids)) for p in eval_prompts(tokenizer, ("gsm8k", "mtbench", "humaneval"), per_kind,
                                                           skip=8)]
    for text in COPY_TEXTS[:per_kind]:
        out.append(("copy", [int(t) for t in tokenizer.encode_chat([{"role": "user", "content": text}],
                                                                   add_generation_prompt=True)]))
    return out


def run_mode(target, drafter, prompts, tokens: int, batch: int, max_len: int, k: int | None, nodes: int = 0,
             ngram: bool = False, steps_per_dispatch: int = 1) -> dict:
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits, Lookup, Tree

    plan = AR() if not k else Tree(k, nodes, ngram) if nodes > 1 else Lookup(k) if ngram else Chain(k)
    result = {}
    for rep in range(2):  # the first run compiles
        engine = Engine(target.params, target.cfg, drafter, plan,
                        Limits(slots=batch, max_len=max_len, steps_per_dispatch=steps_per_dispatch))
        ids = [engine.submit(ids, tokens) for _, ids in prompts]
        t0 = time.perf_counter()
        done = engine.run()
        seconds = time.perf_counter() - t0
        reqs = [done[i] for i in ids]
        new = sum(len(r.token_ids) for r in reqs)
        steps = engine.steps
        accepted = [a for r in reqs for a in r.accepted]
        result = {"tokens_per_s": new / seconds, "ms_per_step": 1e3 * seconds / max(steps, 1),
                  "tau": (sum(a + 1 for a in accepted) / len(accepted)) if accepted else 1.0,
                  "tau_by_kind": {}, "outputs": [r.token_ids for r in reqs], "compiles": engine.compiles,
                  "rep": rep}
        for kind in dict.fromkeys(kind for kind, _ in prompts):
            acc = [a for (kd, _), r in zip(prompts, reqs, strict=True) if kd == kind for a in r.accepted]
            result["tau_by_kind"][kind] = (sum(a + 1 for a in acc) / len(acc)) if acc else 1.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--per-kind", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--nodes", default="4,8,16")
    parser.add_argument("--modes", default="ar,chain,tree,ngram,tree+ngram",
                        help="modes run (AR always): chain, tree (each --nodes), ngram (alone), tree+ngram (middle N)")
    parser.add_argument("--steps-per-dispatch", type=int, default=1, help="R decode steps per dispatch, every mode")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", default=None, help="also dump the raw numbers here (after every mode)")
    parser.add_argument("--note", default="", help="a sentence added to the recorded section (e.g. the machine's load)")
    parser.add_argument("--from-json", default=None, help="render (and --write) the numbers a run saved with --json")
    args = parser.parse_args()

    if args.from_json:  # render (and --write) a finished or partial run without decoding again
        saved = json.loads(Path(args.from_json).read_text())
        meta = saved.get("meta") or {"k": json.loads((Path(args.drafter) / "config.json").read_text())["block_size"],
                                     "minutes": None, "source": args.config}
        render(saved["results"] if "results" in saved else saved, meta, args)
        return

    from dflash.configs.recipe import load_recipe
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target

    t_start = time.perf_counter()
    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    drafter = load_drafter(args.drafter, target.cfg)
    k = drafter.arch.block_size
    prompts = prompts_by_kind(target.tokenizer, args.per_kind)
    nodes = [int(n) for n in args.nodes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    longest = max(len(ids) for _, ids in prompts)
    max_len = -(-(max(1 << (longest - 1).bit_length(), longest + args.tokens + max(nodes + [k]))) // 16) * 16
    mid = nodes[len(nodes) // 2]
    wanted = set(args.modes.split(","))
    unknown = wanted - {"ar", "chain", "tree", "ngram", "tree+ngram"}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; choose from ar, chain, tree, ngram, tree+ngram")
    modes = [("AR", None, 0, False)] + ([(f"chain K={k}", k, 0, False)] if "chain" in wanted else [])
    modes += [(f"tree N={n}", k, n, False) for n in nodes] if "tree" in wanted else []
    modes += [(f"n-gram only K={k}", k, 0, True)] if "ngram" in wanted else []
    modes += [(f"tree N={mid} + n-gram", k, mid, True)] if "tree+ngram" in wanted else []
    results: dict[str, dict[str, dict]] = {}
    meta = {"k": k, "source": recipe.target.source, "minutes": None, "steps_per_dispatch": args.steps_per_dispatch,
            "load": [round(os.getloadavg()[0], 1)],
            "command": shlex.join([".venv/bin/python", "benchmarks/tree_vs_chain.py", *sys.argv[1:]])}
    for batch in batches:
        for name, kk, n, ngram in modes:
            r = run_mode(target, drafter, prompts, args.tokens, batch, max_len, kk, n, ngram, args.steps_per_dispatch)
            r["width"] = 1 if kk is None else (n or kk)
            results.setdefault(str(batch), {})[name] = r
            print(f"batch {batch} {name}: tau {r['tau']:.2f} {r['ms_per_step']:.1f} ms/step "
                  f"{r['tokens_per_s']:.1f} tok/s {r['tau_by_kind']}", flush=True)
            meta["minutes"] = (time.perf_counter() - t_start) / 60
            meta["load"] = [meta["load"][0], round(os.getloadavg()[0], 1)]
            if args.json:  # after every mode: a long run interrupted still leaves its numbers
                Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    render(results, meta, args)


def render(results: dict[str, dict[str, dict]], meta: dict, args: argparse.Namespace) -> None:
    """Print the tables and, with --write, record them in docs/benchmarks.md."""
    from benchmarks._report import machine, write_section

    k = meta["k"]
    first = next(iter(next(iter(results.values())).values()))
    kinds = list(first["tau_by_kind"])
    lines = []
    for batch, by_mode in results.items():
        ar = by_mode["AR"]
        chain = by_mode.get(f"chain K={k}")
        lines += [f"**Batch {batch}**", "",
                  "| mode | verify width | τ | " + " | ".join(f"τ {kd}" for kd in kinds)
                  + " | τ / chain | ms/step | tokens/s | vs AR | = AR |",
                  "|---|---|---|" + "---|" * len(kinds) + "---|---|---|---|---|"]
        for name, r in by_mode.items():
            width = r.get("width") or (1 if name == "AR" else int(name.split("=")[1].split()[0]))
            same = all(a == b for a, b in zip(r["outputs"], ar["outputs"], strict=True))
            ratio = f"{r['tau'] / chain['tau']:.2f}x" if chain else "-"
            lines.append(f"| {name} | {width} | {r['tau']:.2f} | "
                         + " | ".join(f"{r['tau_by_kind'][kd]:.2f}" for kd in kinds)
                         + f" | {ratio} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / ar['tokens_per_s']:.2f}x | {'yes' if same else 'NO'} |")
        lines.append("")
    table = "\n".join(lines)
    print(table)
    if args.write:
        command = meta.get("command") or shlex.join([".venv/bin/python", "benchmarks/tree_vs_chain.py", *sys.argv[1:]])
        minutes = f", {meta['minutes']:.0f} min" if meta.get("minutes") else ""
        if meta.get("load"):
            minutes += f", load average {' -> '.join(str(x) for x in meta['load'])} (start -> end)"
        r = meta.get("steps_per_dispatch", 1)
        n_prompts = len(first["outputs"])
        write_section("Tree vs chain verification", "\n".join([
            "## Tree vs chain verification",
            "",
            f"`{command}` on {machine()}{minutes}. {meta['source']} (fp32) with the drafter at `{args.drafter}` "
            f"(K = {k}: trees reach depth {k - 1}); {n_prompts} greedy prompts ({', '.join(kinds)}), "
            f"{args.tokens} new tokens each, all submitted at once over `batch` slots, {r} step{'s' if r > 1 else ''} "
            "per dispatch; the second of two runs (the "
            "first compiles). τ = tokens per verify step (bonus included); verify width = tokens the target scores "
            "per step; ms/step and tokens/s over the whole run (prefill included); = AR: every output equals AR's "
            "token for token. The ms/step column is this machine's verify-cost curve by width (AR = width 1). "
            "Projected on TPU v5p, where verifying up to ~1024 tokens costs about what 16 do (docs/design.md "
            "§9), a step costs the same at every width here, so tree vs chain speed-up there is "
            "the τ / chain column (`benchmarks/tree_projection.py` tabulates it)." +
            (f" {args.note}" if args.note else ""),
            "",
            table,
        ]))


if __name__ == "__main__":
    main()
