"""The drafter's loss + gradient on this machine: dense vs chunked LM head, fp32 vs bf16 compute, side by side.

    .venv/bin/python benchmarks/train_step_variants.py [--layers 2] [--block-size 8] [--anchors 64]
        [--batch-size 4] [--seq-len 448] [--rounds 7] [--write]

What is timed is the differentiated part of a train step with offline features (what configs/smollm2.yaml
runs): block embeddings + drafter forward + frozen LM head + loss, and the gradient w.r.t. the drafter's
fp32 master params, on the embedded SmolLM2 target's head (V = 49,152). Variants:
  dense fp32    the previous path: [B, N*K, V] fp32 logits materialised, then `dense_loss`;
  chunked fp32  `head_loss` (anchor slot skipped, chunks of rows, gradient formed in the forward);
  chunked bf16  the same with the drafter graph and head in bf16 (fp32 accumulation and softmax).
Each is compiled once (XLA temp memory read from the compiled program), then the variants are timed in
round-robin for `--rounds` rounds (so a load change on the machine hits all of them alike); the median per
variant is reported, with ratios against dense fp32 from the same run. `--write` records the table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 2**20


def build(args: argparse.Namespace) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The compiled variants and their common inputs (params, batch, target)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash.configs.recipe import load_recipe
    from dflash.data.batch import TrainBatch
    from dflash.models.drafter import BlockVisibility, DFlashDrafter, drafter_logits
    from dflash.models.target import load_target
    from dflash.train.loop import drafter_graphdef, step_spec
    from dflash.train.objective import dense_loss
    from dflash.train.step import block_inputs, cast_floats, drafter_loss, train_head

    recipe = load_recipe("smollm2", [f"drafter.num_layers={args.layers}", f"drafter.block_size={args.block_size}",
                                     f"train.num_anchors={args.anchors}"])
    target = load_target(recipe.target)
    arch = target.drafter_arch(recipe.drafter)
    spec = step_spec(recipe.train, arch, target.cfg)
    objective = spec.objective
    params = nnx.state(DFlashDrafter(arch, nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    b, s, fd = args.batch_size, args.seq_len, arch.num_features * arch.hidden_size
    mask = np.zeros((b, s), np.float32)
    mask[:, s // 4:] = 1.0  # a prompt, then an answer to the end
    batch = TrainBatch(tokens=jnp.asarray(rng.integers(0, target.cfg.vocab_size, (b, s)), jnp.int32),
                       loss_mask=jnp.asarray(mask),
                       features=jnp.asarray(rng.normal(size=(b, s, fd)).astype(np.float32) * 0.5, jnp.bfloat16))

    def dense(p: Any, batch: Any, target_params: Any, dtype: Any) -> Any:
        inputs = block_inputs(batch, target_params, spec, jax.random.key(1))
        blocks, embeds, feats = inputs.blocks, inputs.embeds_BxQxD, inputs.feats_BxSxDf

        def loss(p: Any) -> Any:
            drafter = nnx.merge(drafter_graphdef(arch, dtype), cast_floats(p, dtype))
            ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            anchor = blocks.anchor_of_query.reshape(b, -1, arch.block_size)[:, :, 0]
            hidden = drafter(embeds, blocks.block_pos, feats, ctx_pos,
                             BlockVisibility.from_anchors(anchor, jnp.ones((b, s), bool)))
            logits = drafter_logits(jax.lax.stop_gradient(target_params), target.cfg, hidden)
            return dense_loss(logits, blocks.labels, blocks.label_mask, blocks.block_index_in_block,
                               arch.block_size, objective.gamma)[0]

        return jax.value_and_grad(loss)(p)

    def chunked(p: Any, batch: Any, target_params: Any, dtype: Any) -> Any:
        inputs = block_inputs(batch, target_params, spec, jax.random.key(1))
        head = train_head(target_params, target.cfg)
        at = dataclasses.replace(spec, graphdef=drafter_graphdef(arch, dtype), compute_dtype=dtype)
        return jax.value_and_grad(lambda p: drafter_loss(cast_floats(p, dtype), inputs, head, at)[0])(p)

    variants = {}
    for name, fn, dtype in (("dense fp32", dense, jnp.float32), ("chunked fp32", chunked, jnp.float32),
                            ("chunked bf16", chunked, jnp.bfloat16)):
        target_params = cast_floats(target.params, dtype)
        jitted = jax.jit(lambda p, bt, tp, fn=fn, dtype=dtype: fn(p, bt, tp, dtype))
        t0 = time.perf_counter()
        compiled = jitted.lower(params, batch, target_params).compile()
        variants[name] = {"run": compiled, "target": target_params, "compile_s": time.perf_counter() - t0,
                          "temp": compiled.memory_analysis().temp_size_in_bytes, "times": []}
    return variants, (params, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    for name in ("layers", "anchors", "batch_size", "seq_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if args.block_size < 2:
        parser.error(f"--block-size must be >= 2; received {args.block_size}")

    import jax

    from benchmarks._report import machine, write_section

    t_start = time.perf_counter()
    variants, (params, batch) = build(args)
    for _ in range(2):  # warm-up
        for v in variants.values():
            jax.block_until_ready(v["run"](params, batch, v["target"]))
    for _ in range(args.rounds):
        for v in variants.values():
            t0 = time.perf_counter()
            jax.block_until_ready(v["run"](params, batch, v["target"]))
            v["times"].append(time.perf_counter() - t0)
    base = variants["dense fp32"]
    base_s = statistics.median(base["times"])
    block_tokens = args.batch_size * args.anchors * args.block_size
    lines = ["| variant | loss + grad (s) | block tok/s | vs dense fp32 | XLA temp (MiB) | vs dense fp32 temp |",
             "|---|---|---|---|---|---|"]
    for name, v in variants.items():
        med = statistics.median(v["times"])
        lines.append(f"| {name} | {med:.3f} | {block_tokens / med:.0f} | {base_s / med:.2f}x faster "
                     f"| {v['temp'] / MIB:.0f} | {v['temp'] / base['temp']:.2f}x |")
    command = shlex.join([".venv/bin/python", "benchmarks/train_step_variants.py", *sys.argv[1:]])
    body = "\n".join([
        "## Train step: dense vs chunked LM head, fp32 vs bf16",
        "",
        f"`{command}` on {machine()}; {args.layers}-layer drafter, K={args.block_size}, N={args.anchors} anchors, "
        f"B={args.batch_size} sequences of S={args.seq_len} with offline features, SmolLM2 head (V=49,152); "
        f"loss + gradient w.r.t. the drafter params, median of {args.rounds} round-robin rounds after 2 warm-up "
        f"rounds; compile excluded; the run took {(time.perf_counter() - t_start) / 60:.1f} min.",
        "",
        *lines,
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('train_step_variants', body)}")


if __name__ == "__main__":
    main()
