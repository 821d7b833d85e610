"""Cost per token of the Qwen3-MoE block's dispatch (`models.decoder.moe_mlp`: tokens sorted by expert, one grouped
matmul per projection with `jax.lax.ragged_dot`) against the dense equivalents, side by side in one run on this CPU.

    .venv/bin/python benchmarks/moe_dispatch.py [--tokens 1 16 128 512] [--scale 4] [--repeats 20]

Shapes: Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts of width 768, top-8) divided by `--scale` in hidden,
expert width and expert count (top-k kept at 8), fp32, one layer, jitted. Rows, per token count T:
- `sorted` (what the decoder runs): router, top-k, argsort by expert, ragged_dot x3, weighted scatter-add;
- `all experts`: every expert on every token, combined with the router's weights (`moe_mlp_dense`): E/k x FLOPs;
- `dense, active width`: a dense SwiGLU MLP of width k x moe_intermediate (the same FLOPs per token as the experts a
  token uses): the floor a dispatch could reach;
- `dense, total width`: a dense SwiGLU of width E x moe_intermediate (the parameters of the whole layer).
Each is the median of `--repeats` timed calls after one warm-up (compile). The CPU has no grouped-matmul kernel (XLA
lowers ragged_dot to a loop over groups), so the ratios here bound what a TPU (megablox-style grouped matmul) does;
the numbers are recorded in docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--scale", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import jax

    from dflash.models import decoder
    from dflash.models.config import DecoderConfig

    d, e, fe, k = 2048 // args.scale, 128 // args.scale, 768 // args.scale, 8
    cfg = DecoderConfig(family="qwen3_moe", vocab_size=256, hidden_size=d, intermediate_size=fe, num_layers=1,
                        num_heads=4, num_kv_heads=4, head_dim=16, num_experts=e, num_experts_per_tok=k,
                        moe_intermediate_size=fe, norm_topk_prob=True)
    keys = jax.random.split(jax.random.key(0), 8)
    lp = {"router": jax.random.normal(keys[0], (d, e)) * 0.05,
          "we_gate": jax.random.normal(keys[1], (e, d, fe)) * 0.02,
          "we_up": jax.random.normal(keys[2], (e, d, fe)) * 0.02,
          "we_down": jax.random.normal(keys[3], (e, fe, d)) * 0.02}

    def dense(width: int):
        w = {"w_gate": jax.random.normal(keys[4], (d, width)) * 0.02,
             "w_up": jax.random.normal(keys[5], (d, width)) * 0.02,
             "w_down": jax.random.normal(keys[6], (width, d)) * 0.02}
        dcfg = dataclasses.replace(cfg, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
        return jax.jit(lambda h: decoder._mlp(dcfg, w, h))

    variants = {
        "sorted (ragged_dot)": jax.jit(lambda h: decoder.moe_mlp(cfg, lp, h)),
        "all experts (dense einsum)": jax.jit(lambda h: decoder.moe_mlp_dense(cfg, lp, h)),
        f"dense, active width {k * fe}": dense(k * fe),
        f"dense, total width {e * fe}": dense(e * fe),
    }
    print(f"hidden {d}, {e} experts of {fe}, top-{k}, fp32, {jax.devices()[0].platform}; us per token (median of "
          f"{args.repeats})")
    print("| tokens | " + " | ".join(variants) + " | sorted / dense active |")
    print("|---|" + "---|" * (len(variants) + 1))
    for t in args.tokens:
        h = jax.random.normal(keys[7], (1, t, d))
        per = {}
        for name, fn in variants.items():
            fn(h).block_until_ready()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn(h).block_until_ready()
                times.append(time.perf_counter() - start)
            per[name] = statistics.median(times) / t * 1e6
        sorted_us, active_us = per["sorted (ragged_dot)"], per[f"dense, active width {k * fe}"]
        print(f"| {t} | " + " | ".join(f"{v:.1f}" for v in per.values()) + f" | {sorted_us / active_us:.2f}x |")


if __name__ == "__main__":
    main()
