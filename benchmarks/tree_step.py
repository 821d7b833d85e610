"""Where one tree step of the demo recipe's serving spends its time on the CPU, piece by piece, and (with `--base`) the
same measurement at another commit side by side.

    .venv/bin/python benchmarks/tree_step.py [--base REV] [--rounds 3] [--slots 1,8] [--reps 7] [--write]

Workload: the demo recipe's serving (`configs/demo.yaml`: the embedded SmolLM2-135M target in fp32, the shipped
K=4 drafter `data/assets/drafters/smollm2-dflash`, a tree of 8 nodes with the prompt-lookup path merged in,
max_len 512) on S slots (`--slots`: 1, the demo's evaluation servers, and 8, `dflash serve`'s default), each
running a request of a 64-token prompt, 24 tokens into its reply, greedy or sampled at T=1 with either draft rule
(a base before D84 has only the argmax rule's tree). Per case the fastest of `--reps` calls after a warm-up (other
work on a shared machine only adds time) of:

- step: the plan's whole step (`Tree.step`: one dispatch of each program below, as the engine runs R = 1),
  with the state donated and fed back;
- propose: `propose_topk` (the drafter's forward over the block and its top-M ranked lists);
- build: `build_tree` (best-first over the lists, the lookup path merged);
- forward: the target's forward over the tree's N tokens (`forward_cached` through `TreeChunkCache`), the
  state donated;
- walk: `_walk`, choosing the accepted path from the logits;
- keep: keeping the accepted path (its K/V copied onto consecutive slots, `PagedKVCache.copy_tokens`; its
  features fused into the draft cache; the rollback), the state donated.

The pieces run as separate programs (each pays a dispatch), so they add up to a little more than `step`.
`--base REV` checks REV out in a temporary git worktree and runs this workload there and here alternately
(`--rounds`), each side importing its own tree's code; `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIECES = ("step", "propose", "build", "forward", "walk", "keep")

WORKLOAD = r'''
import json, sys, tempfile, time
from pathlib import Path
root = Path(sys.argv[1])
view = Path(tempfile.mkdtemp()) / "dflash"  # this tree's folders as the dflash namespace
view.mkdir()
for folder in ("configs", "models", "serve", "data", "train", "eval", "export", "launch"):
    (view / folder).symlink_to(root / folder)
sys.path.insert(0, str(view.parent))
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
from dflash.configs.recipe import load_recipe
from dflash.models.decoder import forward_cached
from dflash.models.drafter_io import load_drafter
from dflash.models.target import load_target
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import Engine
from dflash.serve.paged import TreeChunkCache
from dflash.serve.plan import Limits, Tree
from dflash.serve.speculative import _add_context, _layer_ids, span_pages
from dflash.serve import tree as tree_mod

slot_counts, reps = [int(a) for a in sys.argv[2].split(",")], int(sys.argv[3])
recipe = load_recipe("demo")
target = load_target(recipe.target)
drafter = load_drafter(root / "data/assets/drafters/smollm2-dflash", target.cfg)
K, NODES = 4, recipe.serve.tree_nodes
MAX_LEN = recipe.target.max_seq_len


def best_ms(fn, reps):
    """The fastest of `reps` timed calls after a warm-up (other work on the machine only ever adds time)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def case(slots, sampled, rule):
    try:
        plan = Tree(K, NODES, True, rule=rule)
    except TypeError:  # before D84: no rule (sampled requests took the argmax tree)
        if rule != "argmax":
            return None
        plan = Tree(K, NODES, True)
    engine = Engine(target.params, target.cfg, drafter, plan, Limits(slots=slots, max_len=MAX_LEN))
    sampling = SamplingConfig(temperature=1.0) if sampled else None
    for i in range(slots):
        engine.submit([(100 + 7 * i + t) % 4000 for t in range(64)], 400, seed=i, sampling=sampling)
    while min((len(r.token_ids) for r in engine.running.values()), default=0) < 24:
        engine.step()
    models, lookup = engine.models, engine._lookup
    # the span the engine's step would use, with room for every timed call (L moves by at most K a step)
    pages = span_pages(int(engine.lengths.max()) + engine.width + 4 * K * reps, engine.limits.page_size,
                       engine.limits.max_pages)
    span = pages * engine.state.target.page_size
    m = NODES - 1 - plan.lookup_nodes
    out = {}
    holder = {"state": engine.state}

    def step():
        holder["state"], toks, n, _ = plan.step(models, holder["state"], pages, False, lookup)
        return toks
    # every step moves L by at most K: the reps stay far inside the pages the requests reserved
    out["step"] = best_ms(step, reps)
    state = holder["state"]
    sample = plan.rule == "sample" if hasattr(plan, "rule") else None
    propose = (lambda: tree_mod.propose_topk(models, state, K, m, span)) if sample is None else \
        (lambda: tree_mod.propose_topk(models, state, K, m, span, sample))
    out["propose"] = best_ms(propose, reps)
    ranked = propose()
    extra, extra_len = (jnp.asarray(a) for a in lookup(plan.lookup_nodes))
    build = lambda: tree_mod.build_tree(*ranked[:2], state.pending, NODES, extra, extra_len, *ranked[2:])
    out["build"] = best_ms(build, reps)
    tree = build()

    def _forward(models, state, tree):
        seen = state.target.view(pages)
        chunk = TreeChunkCache(seen, tree.ancestors(K - 1))
        logits, feats, chunk = forward_cached(models.target_params, models.target_cfg, tree.token,
                                              state.lengths[:, None] + tree.depth, chunk,
                                              layer_ids=_layer_ids(models.drafter()))
        return logits, feats, dataclasses.replace(state, target=chunk.paged.with_full_table(state.target).rollback(
            state.lengths))
    forward = jax.jit(_forward, donate_argnums=1)

    def run_forward():
        logits, feats, holder["state"] = forward(models, holder["state"], tree)
        return logits
    holder["state"] = state
    out["forward"] = best_ms(run_forward, reps)
    logits, feats, holder["state"] = forward(models, holder["state"], tree)
    state = holder["state"]
    try:
        walk = jax.jit(lambda tree, logits, state: tree_mod._walk(tree, logits, state, K - 1, models.draft_ids))
        walk(tree, logits, state)
    except TypeError:  # before D84: no draft_ids
        walk = jax.jit(lambda tree, logits, state: tree_mod._walk(tree, logits, state, K - 1))
    out["walk"] = best_ms(lambda: walk(tree, logits, state), reps)
    path, n, bonus, rng = walk(tree, logits, state)

    def _keep(models, state, path, n, feats):
        idx = jnp.arange(K)[None, :]
        dst = state.lengths[:, None] + idx[:, 1:]
        src = jnp.where(idx[:, 1:] <= n[:, None], state.lengths[:, None] + path[:, 1:], dst)
        cache = state.target.copy_tokens(src, dst)
        path_feats = jnp.take_along_axis(feats, path[None, :, :, None], axis=2)
        draft = _add_context(models.drafter(), state.draft, path_feats, state.lengths)
        return dataclasses.replace(state, target=cache.rollback(state.lengths), draft=draft)
    keep = jax.jit(_keep, donate_argnums=1)

    def run_keep():
        holder["state"] = keep(models, holder["state"], path, n, feats)
        return holder["state"].lengths
    out["keep"] = best_ms(run_keep, reps)
    return out


results = {}
for slots in slot_counts:
    for name, sampled, rule in (("greedy", False, "argmax"), ("T=1, argmax rule", True, "argmax"),
                                ("T=1, sample rule", True, "sample")):
        found = case(slots, sampled, rule)
        if found is not None:
            results[f"{slots} slot{'s' if slots > 1 else ''}, {name}"] = found
print(json.dumps(results))
'''


def run_side(tree: Path, slots: str, reps: int) -> dict[str, dict[str, float]]:
    done = subprocess.run([sys.executable, "-c", WORKLOAD, str(tree), slots, str(reps)], cwd=tree,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the workload failed in {tree} (exit status {done.returncode}):\n{done.stderr[-4000:]}\n"
                         f"{done.stdout[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="a commit to compare against, side by side (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3, help="with --base: alternating rounds (default 3)")
    parser.add_argument("--slots", default="1,8", help="slots (each running a request) per case (default 1,8)")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per piece (default 7)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks._report import machine, write_section

    t_start = time.perf_counter()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    sides: dict[str, list[dict]] = {"new": []}
    if args.base:
        base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout.strip()
        sides = {"base": [], "new": []}
        with tempfile.TemporaryDirectory() as tmp:
            base_tree = Path(tmp) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base_rev], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                for i in range(args.rounds):
                    sides["base"].append(run_side(base_tree, args.slots, args.reps))
                    sides["new"].append(run_side(ROOT, args.slots, args.reps))
                    print(f"round {i + 1}: base {json.dumps(sides['base'][-1])}", flush=True)
                    print(f"         new {json.dumps(sides['new'][-1])}", flush=True)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    else:
        sides["new"].append(run_side(ROOT, args.slots, args.reps))
        print(json.dumps(sides["new"][-1]), flush=True)

    def best(side: str, case: str, piece: str) -> float:  # the best round: load only ever adds time
        return min(r[case][piece] for r in sides[side])

    cases = list(sides["new"][0])
    lines = ["| case | " + " | ".join(f"{p} ms" for p in PIECES) + " |", "|---|" + "---|" * len(PIECES)]
    for case in cases:
        if args.base and case in sides["base"][0]:
            lines.append(f"| {case} | " + " | ".join(
                f"{best('base', case, p):.1f} → {best('new', case, p):.1f}" for p in PIECES) + " |")
        elif args.base:  # a case the base cannot run
            lines.append(f"| {case} | " + " | ".join(f"— → {best('new', case, p):.1f}" for p in PIECES) + " |")
        else:
            lines.append(f"| {case} | " + " | ".join(f"{best('new', case, p):.1f}" for p in PIECES) + " |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        command = shlex.join([".venv/bin/python", "benchmarks/tree_step.py", *sys.argv[1:]])
        what = (f"base {base_rev} → new {rev}, {args.rounds} alternating rounds (the best of each)" if args.base
                else f"at {rev}")
        write_section("The tree step's CPU cost", "\n".join([
            "## The tree step's CPU cost", "",
            f"`{command}` on {machine()}, {what}, {(time.perf_counter() - t_start) / 60:.0f} min: the demo recipe's "
            "serving (SmolLM2-135M fp32, the shipped K=4 drafter, a tree of 8 nodes + prompt lookup, max_len 512) on "
            "S slots, each running a 64-token prompt 24 tokens into its reply; milliseconds per call, the fastest of "
            f"{args.reps} after a warm-up; the pieces run as separate programs (module docstring).", "", table, ""]))


if __name__ == "__main__":
    main()
