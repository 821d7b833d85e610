"""Sampled decoding through the engine, side by side: AR, DFlash with one-hot drafts, DFlash with drafts drawn from
the drafter (the two `serve.draft_rule`s), at one temperature, batch 1.

    .venv/bin/python benchmarks/sampled_speed.py [--drafter data/assets/drafters/smollm2-dflash] \
        [--temperature 1] [--sets gsm8k,mtbench,...] [--per-set 2] [--skip 8] [--tokens 96] [--write]

Each prompt is decoded alone (one slot, as `dflash eval` at concurrency 1) by the three decoders in turn, so that
the machine's drifts hit all three alike; every decoder samples prompt i with seed i. Decode tokens/s counts the
tokens after the first engine step over the time of the rest (prefill and compilation excluded: a warm-up prompt
per decoder first). τ is pooled over steps (accepted + 1). Ratios are against AR measured in the same run.
`--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SETS = ("gsm8k,mtbench,humaneval,math500,mbpp,benchmarks/prompts/writing.jsonl,benchmarks/prompts/explanation.jsonl,"
        "benchmarks/prompts/sql.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="recipe whose target decodes (default smollm2)")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sets", default=SETS)
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--skip", type=int, default=8, help="items left out at the start of each set")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.temperature <= 0 or args.per_set < 1 or args.tokens < 2:
        parser.error("--temperature must be > 0 (greedy has one draft rule), --per-set >= 1, --tokens >= 2")

    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.data.eval_sets import eval_prompts
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import decode_max_len
    from dflash.serve.config import SamplingConfig
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits

    t_start = time.perf_counter()
    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    drafter = load_drafter(args.drafter, target.cfg)
    prompts = eval_prompts(target.tokenizer, [s for s in args.sets.split(",") if s], args.per_set, skip=args.skip)
    k = drafter.arch.block_size
    max_len = decode_max_len(prompts, args.tokens, k)
    sampling = SamplingConfig(temperature=args.temperature, seed=0)
    stops = target.tokenizer.stop_token_ids
    engines = {"AR": Engine(target.params, target.cfg, None, AR(), Limits(slots=1, max_len=max_len)),
               "DFlash argmax": Engine(target.params, target.cfg, drafter, Chain(k), Limits(slots=1, max_len=max_len)),
               "DFlash sample": Engine(target.params, target.cfg, drafter, Chain(k, "sample"),
                                       Limits(slots=1, max_len=max_len))}

    def one(engine: Engine, ids: list[int], seed: int) -> tuple[int, float, list[int]]:
        engine.submit(ids, args.tokens, stops, seed=seed, sampling=sampling)
        request = engine.queue[-1]
        engine.step()  # prefill and the first step
        before, t0 = len(request.token_ids), time.perf_counter()
        engine.run()
        return len(request.token_ids) - before, time.perf_counter() - t0, request.accepted

    for engine in engines.values():  # compile every shape the prompts use
        for p in prompts:
            one(engine, list(p.ids), 0)
    totals = {name: [0, 0.0, []] for name in engines}
    for i, p in enumerate(prompts):
        for name, engine in engines.items():
            n, s, accepted = one(engine, list(p.ids), i)
            totals[name][0] += n
            totals[name][1] += s
            totals[name][2] += accepted
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{name} {t[0] / t[1]:.1f} tok/s" for name, t in
                                                             totals.items()), flush=True)
    ar = totals["AR"][0] / totals["AR"][1]
    lines = ["| decoder | τ | decode tok/s | vs AR |", "|---|---|---|---|"]
    for name, (n, s, accepted) in totals.items():
        tau = f"{sum(a + 1 for a in accepted) / len(accepted):.2f}" if accepted else "1 (AR)"
        lines.append(f"| {name} | {tau} | {n / s:.1f} | {n / s / ar:.2f}x |")
    command = shlex.join([".venv/bin/python", "benchmarks/sampled_speed.py", *sys.argv[1:]])
    title = f"Sampled decoding speed by draft rule (SmolLM2-135M target, fp32, T={args.temperature:g}, batch 1)"
    body = "\n".join([f"## {title}", "",
                      f"`{command}` on {machine()}; drafter `{args.drafter}` (K={k}); {len(prompts)} prompts (items "
                      f"{args.skip}-{args.skip + args.per_set - 1} of each of {args.sets}), {args.tokens} new tokens, "
                      "each decoded alone by the three decoders in turn, prompt i seeded i; decode tokens/s after "
                      "the first step (prefill and compilation excluded); the run took "
                      f"{(time.perf_counter() - t_start) / 60:.0f} min.", "", *lines])
    print(body)
    if args.write:
        print(f"written to {write_section(title.split(' (')[0], body)}")


if __name__ == "__main__":
    main()
