"""Draft step cost against context length: full-attention draft layers against sliding-window ones
(`drafter.layer_types`, `drafter.sliding_window`), side by side in one run.

    .venv/bin/python benchmarks/draft_window.py [--contexts 1024 2048 4096 8192] [--window 2048] [--k 8]
        [--layers 5] [--repeats 20] [--write]

The embedded SmolLM2-135M target (fp32) and two randomly initialised drafters of `--layers` layers at its width,
identical but for their layer types: all `full_attention`, and all `sliding_attention` with window `--window`.
For each context length L, one engine slot holds L committed positions (the draft cache filled with random
K/V: the cost of a propose does not depend on the values) and `propose` (one drafter forward over the block of K
plus the target's head over the K-1 draft slots) is timed, batch 1, median of `--repeats` calls after a warm-up,
the two drafters' calls interleaved.
The full layers attend over the engine's span (L + K rounded up to a power of two pages of 16, as
`Engine.step` does), the windowed layers over their ring of W + K slots whatever L is. The draft cache's size
per slot is reported for both. `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PAGE = 16


def cache_bytes(draft) -> int:
    """Bytes of one slot's draft K/V (full and ring arrays)."""
    batch = draft.k.shape[1]
    return (draft.k.nbytes + draft.v.nbytes + draft.wk.nbytes + draft.wv.nbytes) // batch


def prepared(target, drafter, k: int, context: int, batch: int = 1):
    """(models, state, span, draft cache bytes per slot): `batch` active slots each holding `context` committed
    positions, the draft cache filled with random K/V."""
    import jax.numpy as jnp
    import numpy as np

    from dflash.serve.speculative import Models, empty_state, span_pages

    max_len = context + 2 * k + PAGE
    models = Models.of(target.params, target.cfg, drafter)
    state = empty_state(target.cfg, drafter.arch, batch, max_len, 2, PAGE)
    rng = np.random.default_rng(0)
    draft = state.draft
    noise = lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype)  # noqa: E731
    ring = draft.ring_pos.shape[1]
    ring_pos = jnp.asarray(context - ring + (np.arange(ring) - (context - ring)) % ring, jnp.int32)[None]
    draft = dataclasses.replace(draft, k=noise(draft.k), v=noise(draft.v), wk=noise(draft.wk), wv=noise(draft.wv),
                                ring_pos=jnp.repeat(ring_pos, batch, axis=0) if ring else draft.ring_pos)
    state = dataclasses.replace(state, draft=draft, lengths=jnp.full((batch,), context, jnp.int32),
                                pending=jnp.full((batch,), 42, jnp.int32), active=jnp.ones((batch,), bool))
    span = span_pages(context + k, PAGE, -(-max_len // PAGE)) * PAGE
    return models, state, span, cache_bytes(draft)


def propose_ms(cases: list, k: int, repeats: int) -> list[float]:
    """Median ms of `propose` for each prepared case, the cases' calls interleaved (drift hits all alike)."""
    import jax

    from dflash.serve.speculative import propose

    times: list[list[float]] = [[] for _ in cases]
    for i in range(repeats + 1):
        for j, (models, state, span, _) in enumerate(cases):
            t0 = time.perf_counter()
            jax.block_until_ready(propose(models, state, k, span))
            if i:
                times[j].append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()

    from flax import nnx

    from benchmarks._report import machine, write_section
    from dflash.models.config import DrafterConfig, TargetConfig
    from dflash.models.drafter import DFlashDrafter, default_mask_token_id, resolve_drafter
    from dflash.models.target import load_target

    started = time.time()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=max(args.contexts) + 64))
    mask = default_mask_token_id(target.tokenizer, target.cfg)
    drafters = {}
    for name, types, window in (("full", (), 0), ("windowed", ("sliding_attention",) * args.layers, args.window)):
        cfg = DrafterConfig(num_layers=args.layers, block_size=args.k, layer_types=types, sliding_window=window)
        drafters[name] = DFlashDrafter(resolve_drafter(cfg, target.cfg, mask), nnx.Rngs(0))
    lines = [f"`{' '.join(['.venv/bin/python benchmarks/draft_window.py', *map(shlex.quote, sys.argv[1:])])}` on "
             f"{machine()}. SmolLM2-135M target, {args.layers}-layer drafters at its width (random weights), "
             f"K={args.k}, batch 1; `propose` median of {args.repeats} calls. Windowed: every layer "
             f"`sliding_attention`, W={args.window} (ring of W+K={args.window + args.k} slots per layer).", "",
             "| context L | full ms | windowed ms | full / windowed | draft cache per slot: full | windowed |",
             "|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for context in args.contexts:
        cases = [prepared(target, drafters[name], args.k, context) for name in ("full", "windowed")]
        full_ms, win_ms = propose_ms(cases, args.k, args.repeats)
        full_bytes, win_bytes = cases[0][3], cases[1][3]
        lines.append(f"| {context} | {full_ms:.2f} | {win_ms:.2f} | {full_ms / win_ms:.2f}x | "
                     f"{full_bytes / 2**20:.1f} MiB | {win_bytes / 2**20:.1f} MiB |")
        print(lines[-1], flush=True)
    lines += ["", "The full cache is sized for the engine's max_len (here L + 2K + 16), so it grows with the context "
              "a slot may reach; the ring does not. Below L = W both see the same keys; past it the windowed "
              "layers' attention stays at W + K keys.", "",
              f"The run took {(time.time() - started) / 60:.1f} min."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("draft-window", "## Draft step cost against context length: full vs sliding-window draft "
                      "layers (SmolLM2-135M target, fp32)\n\n" + body)


if __name__ == "__main__":
    main()
