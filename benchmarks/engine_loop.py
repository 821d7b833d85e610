"""Host round trips of the engine's decode loop, side by side in one run: R decode steps per dispatch
(`Engine(steps_per_dispatch=R)`, `serve --steps-per-dispatch`) against R = 1.

    .venv/bin/python benchmarks/engine_loop.py [--target smollm2|tiny] [--rs 1 4] [--concurrency 1 4 16]
        [--new-tokens 32] [--drafter PATH] [--tree-nodes N [--tree-ngram]] [--write]

Workload: the target in fp32 (the embedded SmolLM2-135M, or the tests' tiny qwen3), a random-init 2-layer K=4
drafter (seed 0; tau ~ 1, so every step costs a full verify and emits ~1 token: the worst case for the host
share) or the K=4 drafter at `--drafter` (SmolLM2 only, e.g. the shipped one), the chain or a tree of
`--tree-nodes` nodes (`tree.decode_tree_steps` in the device loop), C requests of 64-token prompts submitted at
once into C slots, exactly `--new-tokens` tokens each (no stop ids). Per (C, R): one warm-up run (compiles), then
a timed run:

- tok/s: decode tokens per second (the tokens after the first engine step, over the time of the rest: prefill
  and compile excluded);
- wall/step: that time over the decode steps run (`Engine.steps`);
- tau: tokens per step (bonus included);
- device/step: `speculative.decode_steps` (or `decode_tree_steps`) calls of 8 steps on C fresh slots
  (jax.block_until_ready), best of 3 after a warm-up, over the 8 steps: the device's own time per step (one
  dispatch per 8 steps), the same for every R;
- host share: (wall/step - device/step) / wall/step, the part of a step the host loop adds.

`--write` records the table in docs/benchmarks.md (one section per target, drafter and tree setting).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_LEN = 256
PROMPT_LEN = 64


def models(target: str, drafter_path: str | None = None) -> tuple[Any, Any, Any]:
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter, DrafterConfig, default_mask_token_id, resolve_drafter

    if target == "tiny":
        from dflash.models.loading import load_hf_dir

        cfg, params = load_hf_dir(ROOT / "tests" / "golden" / "tiny" / "qwen3_untied")
        arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=4), cfg,
                               mask_token_id=255)
        return cfg, params, DFlashDrafter(arch, nnx.Rngs(0))
    from dflash.models.config import TargetConfig
    from dflash.models.target import load_target

    loaded = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=1024))
    if drafter_path:
        from dflash.models.drafter_io import load_drafter

        drafter = load_drafter(drafter_path, loaded.cfg)
        if drafter.arch.block_size != 4:
            raise SystemExit(f"--drafter must be a K=4 drafter; {drafter_path} has block_size "
                             f"{drafter.arch.block_size}")
        return loaded.cfg, loaded.params, drafter
    mask = default_mask_token_id(loaded.tokenizer, loaded.cfg)
    arch = resolve_drafter(DrafterConfig(num_layers=2, block_size=4), loaded.cfg, mask)
    return loaded.cfg, loaded.params, DFlashDrafter(arch, nnx.Rngs(0))


def engine_of(cfg: Any, params: Any, drafter: Any, c: int, r: int, tree: tuple[int, bool]) -> Any:
    from dflash.serve.engine import Engine
    from dflash.serve.plan import Chain, Limits, Tree

    nodes, lookup = tree
    plan = Tree(4, nodes, lookup) if nodes > 1 else Chain(4)
    return Engine(params, cfg, drafter, plan, Limits(slots=c, max_len=MAX_LEN, steps_per_dispatch=r))


def run(cfg: Any, params: Any, drafter: Any, c: int, r: int, new_tokens: int,
        tree: tuple[int, bool] = (0, False)) -> dict[str, float]:
    """One engine run of C requests at R steps per dispatch: tok/s, wall/step (seconds), tau."""
    engine = engine_of(cfg, params, drafter, c, r, tree)
    vocab = cfg.vocab_size
    for i in range(c):
        engine.submit([int(t) % vocab for t in range(100 + i, 100 + i + PROMPT_LEN)], new_tokens)
    engine.step()
    first, steps0 = sum(len(q.token_ids) for q in engine.running.values()), engine.steps
    t0 = time.perf_counter()
    done = engine.run()
    seconds = time.perf_counter() - t0
    tokens = sum(len(q.token_ids) for q in done.values()) - first
    accepted = [a for q in done.values() for a in q.accepted]
    return {"tok_s": tokens / seconds, "wall": seconds / max(1, engine.steps - steps0),
            "tau": sum(a + 1 for a in accepted) / max(1, len(accepted))}


def device_step_s(cfg: Any, params: Any, drafter: Any, c: int, new_tokens: int,
                  tree: tuple[int, bool] = (0, False)) -> float:
    """The device alone: seconds per step of `decode_steps` (8 steps per call) on c slots, best of 3 calls after
    a warm-up call, at the attention span the engine runs use (prompt + new tokens)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash.serve.speculative import span_pages

    vocab = cfg.vocab_size
    probe = engine_of(cfg, params, drafter, c, 1, tree)
    for i in range(c):
        probe.submit([int(t) % vocab for t in range(100 + i, 100 + i + PROMPT_LEN)], 64)
    probe._admit()
    probe.table.ensure_batch(np.full(c, min(MAX_LEN, PROMPT_LEN + 4 * 8 * 4 + probe.width)))  # 4 calls of 8 steps
    probe._sync_table()
    pages = span_pages(PROMPT_LEN + new_tokens + 8 + probe.width, probe.limits.page_size, probe.limits.max_pages)
    stops, budget = jnp.full((c, 8), -1, jnp.int32), jnp.full((c,), 1 << 30, jnp.int32)
    times = []
    for _ in range(4):
        t1 = time.perf_counter()
        probe.state, out, n, ran = probe.plan.loop(probe.models, probe.state, stops, budget, 8, pages,
                                                   probe._history)  # `decode_steps` or `decode_tree_steps`
        jax.block_until_ready((out, n))
        times.append((time.perf_counter() - t1) / int(ran))
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--rs", type=int, nargs="+", default=[1, 4], help="steps per dispatch compared")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--drafter", default=None, help="a K=4 drafter directory (SmolLM2; default: random init)")
    parser.add_argument("--tree-nodes", type=int, default=0, help="verify a tree of N nodes (0: the chain)")
    parser.add_argument("--tree-ngram", action="store_true", help="merge the prompt-lookup path into the tree")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    from benchmarks._report import machine, write_section

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    if args.drafter and args.target != "smollm2":
        raise SystemExit(f"--drafter needs --target smollm2; received --target {args.target}")
    tree = (args.tree_nodes, args.tree_ngram)
    cfg, params, drafter = models(args.target, args.drafter)
    lines = ["| concurrency | R | tau | tok/s | wall/step (ms) | device/step (ms) | host share | tok/s vs R=1 |",
             "|---|---|---|---|---|---|---|---|"]
    for c in args.concurrency:
        base, device = None, device_step_s(cfg, params, drafter, c, args.new_tokens, tree)
        for r in args.rs:
            run(cfg, params, drafter, c, r, args.new_tokens, tree)  # warm-up: compiles
            m = run(cfg, params, drafter, c, r, args.new_tokens, tree)
            base = m["tok_s"] if base is None else base
            share = max(0.0, (m["wall"] - device) / m["wall"])
            lines.append(f"| {c} | {r} | {m['tau']:.2f} | {m['tok_s']:.1f} | {m['wall'] * 1e3:.2f} | "
                         f"{device * 1e3:.2f} | {share:.0%} | {m['tok_s'] / base:.2f}x |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.write:
        command = shlex.join([".venv/bin/python", "benchmarks/engine_loop.py", *sys.argv[1:]])
        setting = [args.target] if args.target != "tiny" or args.drafter or tree[0] else []
        setting += (["shipped drafter" if "assets/drafters" in args.drafter else args.drafter] if args.drafter
                    else []) + ([f"tree N={tree[0]}{' + n-gram' if tree[1] else ''}"] if tree[0] else [])
        name = "Engine host loop: steps per dispatch" + (f" ({', '.join(setting)})" if setting else "")
        drafter_text = f"the K=4 drafter at `{args.drafter}`" if args.drafter else "random-init 2-layer K=4 drafter"
        verify_text = (f"a tree of {tree[0]} nodes{' with the prompt-lookup path' if tree[1] else ''} per step"
                       if tree[0] else "the chain")
        write_section(name, "\n".join([
            f"## {name}",
            "",
            f"`{command}` on {machine()}, {(time.perf_counter() - t_start) / 60:.0f} min, load average "
            f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. Target "
            f"{args.target} fp32, {drafter_text} ({verify_text}; tau = tokens per step), C requests of "
            f"{PROMPT_LEN}-token prompts (consecutive token ids), {args.new_tokens} new tokens each. Device/step: "
            "`decode_steps` (or `decode_tree_steps`) calls of 8 steps on C fresh "
            "slots, over 8 (best of 3, the same for every R); host share = (wall/step - device/step) / wall/step. "
            "One timed run per row after a warm-up run: with a load average above the core count, rows vary "
            "several-fold between runs (compare rows of one concurrency only, and rerun).",
            "",
            *lines,
            "",
        ]))


if __name__ == "__main__":
    main()
