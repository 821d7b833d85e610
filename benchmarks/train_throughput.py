"""DFlash train-step throughput and memory on this machine, over block size K and anchors N, in one run.

    .venv/bin/python benchmarks/train_throughput.py [--ks 16 32 64] [--ns 8 16 32] [--batch-size 2]
        [--seq-len 256] [--steps 5] [--dtype float32|bfloat16] [--layers 5] [--quick] [--write]

The default drafter (5 layers over 5 captured target layers) on the embedded SmolLM2 target, GSM8K
sequences as `dflash train` builds them, one device. The target is loaded once; for every (K, N) the
state is created sharded by `train.loop.create_state` (as a fresh `dflash train` run creates it) and the
step is `train.step.make_train_step`'s own program (state donated), compiled ahead of time (compile
time reported, never timed), warmed up, then timed for `--steps` steps with `jax.block_until_ready` on
each; the median step is reported.

block tokens/s = B*N*K / step seconds (every block slot, padded anchors included); context tokens/s =
B*S / step seconds. Memory: XLA's analysis of the compiled step (temp + argument + output bytes) and
the process peak RSS so far (process-wide: it includes the target, earlier configs and the runtime).
The split estimate times the frozen target's feature forward (`online_features`, once) and the LM head
+ loss forward and backward w.r.t. the drafter output (per config) as separate jitted programs; the
remainder is the drafter forward/backward and the optimizer. Ratios are against K=16, N=16, measured
in the same run (added to the sweep when missing). `--quick` is a smoke run (tiny sizes, 1 drafter
layer); explicit flags override its values. `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARMUP = 2
BASELINE = (16, 16)  # (K, N)
FULL = {"batch_size": 2, "seq_len": 256, "steps": 5, "ks": [16, 32, 64], "ns": [8, 16, 32], "layers": 5}
QUICK = {"batch_size": 1, "seq_len": 128, "steps": 2, "ks": [16, 32], "ns": [8, 16], "layers": 1}
MIB = 2**20


@dataclasses.dataclass
class Row:
    """One (K, N) configuration's measurements (seconds, bytes)."""

    k: int
    n: int
    compile_s: float
    step_s: float
    head_s: float
    kept_blocks: float
    temp_bytes: int
    arg_bytes: int
    out_bytes: int
    alias_bytes: int
    peak_rss_bytes: int


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def timed(fn: Any, *args: Any, repeats: int) -> float:
    """Median seconds of `fn(*args)` over `repeats` calls after WARMUP calls (each blocked on)."""
    import jax

    times = []
    for i in range(WARMUP + repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(k: int, n: int, args: argparse.Namespace, target: Any, target_params: Any, mesh: Any,
            batch: Any) -> Row:
    """Build the state and the step for (K, N), compile, warm up, time; see the module docstring."""
    import jax

    from dflash.configs.recipe import load_recipe
    from dflash.train.loop import create_state, step_spec
    from dflash.train.objective import build_blocks_batch, head_loss, sample_anchors_batch
    from dflash.train.step import FrozenTarget, make_train_step, train_head

    recipe = load_recipe("default", [f"drafter.num_layers={args.layers}", f"drafter.block_size={k}",
                                     f"train.num_anchors={n}", f"train.batch_size={args.batch_size}",
                                     f"data.seq_len={args.seq_len}", f"train.compute_dtype={args.dtype}"])
    cfg = recipe.train
    arch = target.drafter_arch(recipe.drafter)
    spec = step_spec(cfg, arch, target.cfg)
    objective, compute_dtype = spec.objective, spec.compute_dtype
    state, shardings = create_state(cfg.seed, arch, spec.optimizer, mesh)  # what `dflash train` does on a fresh run

    # make_train_step's own jitted program, compiled once ahead of time so that the executable that is
    # timed is the one whose memory is analysed.
    frozen_head = train_head(target_params, target.cfg)
    frozen = FrozenTarget(params=target_params, head=frozen_head)
    step = make_train_step(spec, frozen, state_shardings=shardings)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()

    times, kept = [], 0.0
    for i in range(WARMUP + args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch, frozen)
        jax.block_until_ready((state, metrics))
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
        kept = float(metrics["num_blocks"]) / (args.batch_size * n)

    def head(hidden_BxQxD: jax.Array, batch: Any, frozen_head: Any, rng: jax.Array) -> Any:
        """LM head + DFlash loss forward and backward w.r.t. the drafter output, blocks as in the step
        (the head is an argument, not a closure constant, as in the step)."""
        anchors_BxN, keep_BxN = sample_anchors_batch(batch.loss_mask, n, k, rng)
        blocks = build_blocks_batch(batch, anchors_BxN, keep_BxN, k, arch.mask_token_id)
        return jax.value_and_grad(lambda h: head_loss(h, frozen_head, blocks, k, objective)[0])(hidden_BxQxD)

    hidden_BxQxD = jax.random.normal(jax.random.PRNGKey(0), (args.batch_size, n * k, arch.hidden_size), compute_dtype)
    head_s = timed(jax.jit(head), hidden_BxQxD, batch, frozen_head, jax.random.PRNGKey(1), repeats=args.steps)
    return Row(k=k, n=n, compile_s=compile_s, step_s=statistics.median(times), head_s=head_s, kept_blocks=kept,
               temp_bytes=mem.temp_size_in_bytes, arg_bytes=mem.argument_size_in_bytes,
               out_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
               peak_rss_bytes=peak_rss_bytes())


def xla_total(r: Row) -> int:
    return r.temp_bytes + r.arg_bytes + r.out_bytes


def table(rows: list[Row], base: Row, args: argparse.Namespace, features_s: float) -> list[str]:
    b, s = args.batch_size, args.seq_len
    out = ["| K | N | step (s) | block tok/s | context tok/s | vs K16 N16 tok/s | target fwd / LM head+loss / rest "
           "| XLA temp (MiB) | vs K16 N16 temp | XLA temp+arg+out (MiB) | peak RSS so far (MiB) | kept blocks |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tok = b * r.n * r.k / r.step_s
        base_tok = b * base.n * base.k / base.step_s
        rest = max(r.step_s - features_s - r.head_s, 0.0)
        split = " / ".join(f"{100 * x / r.step_s:.0f}%" for x in (features_s, r.head_s, rest))
        out.append(f"| {r.k} | {r.n} | {r.step_s:.3f} | {tok:.0f} | {b * s / r.step_s:.0f} | {tok / base_tok:.2f}x "
                   f"| {split} | {r.temp_bytes / MIB:.0f} | {r.temp_bytes / base.temp_bytes:.2f}x "
                   f"| {xla_total(r) / MIB:.0f} | {r.peak_rss_bytes / MIB:.0f} | {100 * r.kept_blocks:.0f}% |")
    return out


def reading(rows: list[Row], base: Row, features_s: float) -> str:
    """One paragraph on how cost scales with K and N, from this run's numbers."""
    by = {(r.k, r.n): r for r in rows}
    ks, ns = sorted({r.k for r in rows}), sorted({r.n for r in rows})
    parts = []
    if len(ks) > 1 and (ks[-1], base.n) in by and (ks[0], base.n) in by:
        lo, hi = by[(ks[0], base.n)], by[(ks[-1], base.n)]
        parts.append(f"at N={base.n}, going from K={ks[0]} to K={ks[-1]} ({ks[-1] / ks[0]:.0f}x the block tokens) "
                     f"multiplies the step time by {hi.step_s / lo.step_s:.2f}x and XLA's temp memory by "
                     f"{hi.temp_bytes / lo.temp_bytes:.2f}x")
    if len(ns) > 1 and (base.k, ns[-1]) in by and (base.k, ns[0]) in by:
        lo, hi = by[(base.k, ns[0])], by[(base.k, ns[-1])]
        parts.append(f"at K={base.k}, going from N={ns[0]} to N={ns[-1]} multiplies them by "
                     f"{hi.step_s / lo.step_s:.2f}x and {hi.temp_bytes / lo.temp_bytes:.2f}x")
    same_q = [(a, c) for a in rows for c in rows if a.k * a.n == c.k * c.n and a.k < c.k]
    if same_q:
        a, c = same_q[0]
        close = abs(a.step_s / c.step_s - 1) < 0.15
        parts.append(f"at equal N*K (K={a.k},N={a.n} vs K={c.k},N={c.n}) the steps take {a.step_s:.3f} s and "
                     f"{c.step_s:.3f} s" + (", so the cost follows the block tokens N*K, not K or N alone" if close
                                            else ", so K and N are not interchangeable at equal N*K"))
    small, large = min(rows, key=lambda r: r.k * r.n), max(rows, key=lambda r: r.k * r.n)
    if small is large:
        parts.append(f"the frozen target's feature forward takes {features_s:.3f} s of the {small.step_s:.3f} s step "
                     f"({100 * features_s / small.step_s:.0f}%) and the full-vocab LM head + loss "
                     f"{100 * small.head_s / small.step_s:.0f}%, the rest being the drafter and the optimizer")
    else:
        parts.append(f"the frozen target's feature forward is a fixed {features_s:.3f} s per step (it sees B*S "
                     f"context tokens whatever K and N are): {100 * features_s / small.step_s:.0f}% of the smallest "
                     f"step (K={small.k},N={small.n}) and {100 * features_s / large.step_s:.0f}% of the largest "
                     f"(K={large.k},N={large.n}), while the full-vocab LM head + loss (forward and backward over "
                     f"B*N*K rows) goes from {100 * small.head_s / small.step_s:.0f}% to "
                     f"{100 * large.head_s / large.step_s:.0f}%, the rest being the drafter and the optimizer")
    shares = {"the target forward": features_s, "the LM head + loss": base.head_s,
              "the drafter + optimizer": max(base.step_s - features_s - base.head_s, 0.0)}
    parts.append(f"at K={base.k}, N={base.n} the largest share is {max(shares, key=shares.get)}")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, help=f"sequences per step B (default {FULL['batch_size']})")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence S (default {FULL['seq_len']})")
    parser.add_argument("--steps", type=int, help=f"timed steps per config after {WARMUP} warm-up steps "
                        f"(default {FULL['steps']})")
    parser.add_argument("--ks", type=int, nargs="+", help=f"block sizes K (default {FULL['ks']})")
    parser.add_argument("--ns", type=int, nargs="+", help=f"anchors per sequence N (default {FULL['ns']})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype (master weights stay fp32); bfloat16 on CPU is fast only with native "
                        "bf16 instructions (AVX512-BF16 / AMX), else converted and often slower")
    parser.add_argument("--layers", type=int, help=f"drafter layers (default {FULL['layers']}, the default drafter)")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("batch_size", "seq_len", "steps", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if min(args.ks) < 2 or min(args.ns) < 1:
        parser.error(f"--ks must be >= 2 and --ns >= 1; received {args.ks} and {args.ns}")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from benchmarks._report import machine, write_section
    from dflash.configs.recipe import load_recipe
    from dflash.data.batch import TrainBatch
    from dflash.data.examples import build_examples
    from dflash.models.drafter import online_features
    from dflash.models.target import load_target
    from dflash.train.sharding import TARGET_RULES, MeshConfig, make_mesh, place, shard_batch
    from dflash.train.step import cast_floats

    recipe = load_recipe("default", [f"data.seq_len={args.seq_len}", f"drafter.num_layers={args.layers}"])
    target = load_target(recipe.target)
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    target_params = place(cast_floats(target.params, jnp.dtype(args.dtype)), TARGET_RULES, mesh)
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=max(64, 8 * args.batch_size))
    if len(examples) < args.batch_size:
        raise SystemExit(f"--batch-size must be at most the {len(examples)} GSM8K examples that fit; "
                         f"received {args.batch_size}")
    rows_np = examples[:args.batch_size]
    batch = shard_batch(TrainBatch(tokens=np.stack([t for t, _, _ in rows_np]),
                                   loss_mask=np.stack([m for _, m, _ in rows_np])), mesh)

    arch = target.drafter_arch(recipe.drafter)
    features = jax.jit(lambda p, t: online_features(p, target.cfg, t, arch.layer_ids))
    features_s = timed(features, target_params, batch.tokens, repeats=args.steps)

    configs = [(k, n) for k in args.ks for n in args.ns]
    if BASELINE not in configs:
        configs.insert(0, BASELINE)
    rows = []
    t_start = time.perf_counter()
    for k, n in tqdm(configs, desc="configs", unit="cfg", dynamic_ncols=True):
        rows.append(measure(k, n, args, target, target_params, mesh, batch))
        r = rows[-1]
        tqdm.write(f"K={k:3d} N={n:3d}: step {r.step_s:.3f} s, {args.batch_size * n * k / r.step_s:.0f} block "
                   f"tok/s, compile {r.compile_s:.1f} s, XLA temp+arg+out {xla_total(r) / MIB:.0f} MiB")
    total_s = time.perf_counter() - t_start
    base = next(r for r in rows if (r.k, r.n) == BASELINE)

    command = shlex.join([".venv/bin/python", "benchmarks/train_throughput.py", *sys.argv[1:]])
    alias = max(r.alias_bytes for r in rows)
    body = "\n".join([
        f"## Train-step throughput (SmolLM2-135M target, {args.layers}-layer drafter, {args.dtype})",
        "",
        f"`{command}` on {machine()}; B={args.batch_size} GSM8K sequences of S={args.seq_len} tokens, one "
        f"device; median of {args.steps} steps after {WARMUP} warm-up steps, compile excluded (compile times "
        f"{min(r.compile_s for r in rows):.0f} to {max(r.compile_s for r in rows):.0f} s per config); the sweep "
        f"took {total_s / 60:.1f} min.",
        "block tok/s = B*N*K / step (every block slot, padded anchors included; `kept blocks` = share of the "
        "B*N anchors that found a valid position); context tok/s = B*S / step. Split (an estimate from separately "
        "compiled programs, so XLA's fusion across them is not seen): the target's feature "
        f"forward ({features_s:.3f} s, timed alone once) and the LM head + loss forward/backward (timed alone per "
        "config) as shares of the step; rest = drafter forward/backward + AdamW. Memory: XLA's analysis of the "
        "compiled step: temp (activations and gradients; the ratio column), and temp + argument + output bytes "
        "(the frozen target's weights among the arguments"
        f"{f'; up to {alias / MIB:.0f} MiB of the outputs alias the donated state' if alias else ''}). Peak RSS is "
        "process-wide and cumulative (target, earlier configs, runtime). Ratios are against K=16, N=16 in the "
        "same run." + (" bfloat16 on CPU: XLA uses native bf16 dot instructions where the CPU has them "
                       "(AVX512-BF16 / AMX), otherwise it converts, so compare it with a float32 run on the same "
                       "machine rather than assuming either way." if args.dtype == "bfloat16" else ""),
        "",
        *table(rows, base, args, features_s),
        "",
        reading(rows, base, features_s),
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('train_throughput', body)}")


if __name__ == "__main__":
    main()
