"""What the layer scan's weight slicing costs on CPU: SmolLM2-135M's layer matmuls (30 layers of q, k, v, o and a
gated MLP at its sizes, fp32; no attention) over T tokens, four ways, interleaved in one run.

    .venv/bin/python benchmarks/layer_copies.py [--tokens 1 4 128] [--repeats 15] [--write]

- scan: `lax.scan` over the stacked [L, ...] weights (how `models.decoder.forward_cached` runs every layer);
- scan unroll: the same with `unroll=True`;
- static index: a Python loop taking layer i of the stacked weights by a constant index;
- list: a Python loop over one array per layer (the weights never sliced inside the program).

XLA's CPU backend materialises each layer's slice of a stacked weight before its dot (a `dynamic-slice` fusion
per weight per layer: the whole model's weights copied once per forward; with constant indices, `slice` copies
too), so a forward over few tokens, which reads each weight once, pays that copy on top. Per variant: the median
wall time and the median process CPU time of `--repeats` calls (CPU time stays comparable on a shared machine),
the compile seconds, and each against scan. A measurement for a later change of the engine's layer loop on CPU;
on TPU the slices fuse into their dots.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS, HIDDEN, FFN, KV = 30, 576, 1536, 192  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 128])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks._report import machine, write_section

    rng = np.random.default_rng(0)

    def weight(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

    stacked = {"wq": weight(LAYERS, HIDDEN, HIDDEN), "wk": weight(LAYERS, HIDDEN, KV), "wv": weight(LAYERS, HIDDEN, KV),
               "wo": weight(LAYERS, HIDDEN, HIDDEN), "wg": weight(LAYERS, HIDDEN, FFN),
               "wu": weight(LAYERS, HIDDEN, FFN), "wd": weight(LAYERS, FFN, HIDDEN)}
    listed = [{k: jnp.array(v[i]) for k, v in stacked.items()} for i in range(LAYERS)]

    def layer(x, p):
        q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
        x = x + (q + jnp.tile(k + v, (1, HIDDEN // KV))) @ p["wo"]
        return x + (jax.nn.silu(x @ p["wg"]) * (x @ p["wu"])) @ p["wd"]

    def scan(x, ps):
        return jax.lax.scan(lambda h, p: (layer(h, p), None), x, ps)[0]

    def scan_unroll(x, ps):
        return jax.lax.scan(lambda h, p: (layer(h, p), None), x, ps, unroll=True)[0]

    def static_index(x, ps):
        for i in range(LAYERS):
            x = layer(x, {k: v[i] for k, v in ps.items()})
        return x

    def per_layer(x, ps):
        for p in ps:
            x = layer(x, p)
        return x

    variants = {"scan": (scan, stacked), "scan unroll": (scan_unroll, stacked),
                "static index": (static_index, stacked), "list": (per_layer, listed)}
    lines = ["| tokens | variant | wall ms | CPU ms | CPU vs scan | compile s |", "|---|---|---|---|---|---|"]
    t_start = time.perf_counter()
    for t in args.tokens:
        x = weight(t, HIDDEN)
        compiled, compile_s = {}, {}
        for name, (fn, params) in variants.items():
            t0 = time.perf_counter()
            compiled[name] = jax.jit(fn).lower(x, params).compile()
            compile_s[name] = time.perf_counter() - t0
            compiled[name](x, params).block_until_ready()
        wall: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (_, params) in variants.items():
                t0, c0 = time.perf_counter(), time.process_time()
                compiled[name](x, params).block_until_ready()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
        base = statistics.median(cpu["scan"])
        for name in variants:
            c = statistics.median(cpu[name])
            lines.append(f"| {t} | {name} | {statistics.median(wall[name]) * 1e3:.1f} | {c * 1e3:.1f} | "
                         f"{c / base:.2f}x | {compile_s[name]:.1f} |")
        print("\n".join(lines[-len(variants):]), flush=True)
    body = "\n".join([
        "## The layer scan's weight copies on CPU",
        "",
        f"`.venv/bin/python benchmarks/layer_copies.py {' '.join(sys.argv[1:])}` on {machine()}, "
        f"{(time.perf_counter() - t_start) / 60:.1f} min. SmolLM2-135M's 30 layers of matmuls (fp32, no attention) "
        "over T tokens; median of the repeats, interleaved; CPU ms is the process's CPU time (both cores). XLA's CPU "
        "backend copies each layer's slice of a stacked weight before its dot; only weights held one array per layer "
        "avoid it.",
        "",
        *lines,
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('layer_copies', body)}")


if __name__ == "__main__":
    main()
