"""The engine over several devices (`dflash serve --devices`, `Limits.devices`: the target's weights and paged K/V
split over them in tensor parallel): decode tokens/s against the device count, side by side in one run.

    .venv/bin/python benchmarks/engine_devices.py [--devices 1 2 4] [--slots 1 4] [--new-tokens 48] [--write]

Workload: the embedded SmolLM2-135M in fp32 with the shipped drafter (data/assets/drafters/smollm2-dflash, the
chain at its K) and AR, `--slots` requests of 64-token prompts at once, `--new-tokens` new tokens each, greedy. The
devices are the CPU's simulated devices (XLA_FLAGS --xla_force_host_platform_device_count, set here before JAX
starts), which share the same cores: on a CPU, splitting a step over them adds the collectives' cost and no
compute, so this measures the overhead of the split and checks the outputs equal the one-device engine's. Per
(mode, slots, devices): one warm-up run (compiles), then a timed run; tok/s = decode tokens (after the first
engine step) over the time of the rest.

The TPU projection beside it (labelled as such) is bandwidth arithmetic, not a measurement: at batch 1 a decode
step reads every target weight once, so its time is about weight bytes / (devices x HBM bandwidth), plus two
all-reduces per layer over ICI that it leaves out (small at batch 1: a [1, K, hidden] activation each).
`--write` records both tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT_LEN = 64
V5P_HBM_BYTES_PER_S = 2.765e12  # v5p: 2,765 GB/s of HBM bandwidth per chip (Cloud TPU docs)
PROJECTED = {"Qwen/Qwen3-8B": 8.19e9, "Qwen/Qwen3-32B": 32.76e9}  # target params (dflash launch compile's count)


def run(target, drafter, plan, slots: int, devices: int, new_tokens: int) -> tuple[float, list[list[int]]]:
    from dflash.serve.engine import Engine
    from dflash.serve.plan import Limits

    engine = Engine(target.params, target.cfg, drafter, plan, Limits(slots=slots, max_len=256, devices=devices))
    ids = [engine.submit([100 + (i * 7 + j) % 2000 for j in range(PROMPT_LEN)], new_tokens) for i in range(slots)]
    engine.step()
    first = sum(len(c.token_ids) for c in engine.running.values())
    t0 = time.perf_counter()
    done = engine.run()
    seconds = time.perf_counter() - t0
    outputs = [done[i].token_ids for i in ids]
    return (sum(len(o) for o in outputs) - first) / seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--write", action="store_true", help="record the tables in docs/benchmarks.md")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={max(args.devices)}").strip()
    from benchmarks._report import machine, write_section
    from dflash.models.config import TargetConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.registry import shipped_drafter_path
    from dflash.models.target import load_target
    from dflash.serve.plan import AR, Chain

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=1024))
    drafter = load_drafter(shipped_drafter_path("smollm2"), target.cfg)
    lines = ["| mode | slots | devices | tok/s | vs 1 device | output equals 1 device |", "|---|---|---|---|---|---|"]
    for name, plan in (("AR", AR()), (f"DFlash K={drafter.arch.block_size}", Chain(drafter.arch.block_size))):
        for slots in args.slots:
            base = reference = None
            for devices in args.devices:
                run(target, drafter, plan, slots, devices, args.new_tokens)  # warm-up: compiles
                rate, outputs = run(target, drafter, plan, slots, devices, args.new_tokens)
                base = rate if base is None else base
                reference = outputs if reference is None else reference
                lines.append(f"| {name} | {slots} | {devices} | {rate:.1f} | {rate / base:.2f}x | "
                             f"{'yes' if outputs == reference else 'NO'} |")
                print(lines[-1], flush=True)
    projection = ["| target (bf16) | devices | weight bytes per chip | projected decode step at batch 1 |",
                  "|---|---|---|---|"]
    for source, params in PROJECTED.items():
        for devices in (1, 2, 4):
            per_chip = 2 * params / devices
            projection.append(f"| {source} | {devices} | {per_chip / 2**30:.1f} GiB | "
                              f"{per_chip / V5P_HBM_BYTES_PER_S * 1e3:.2f} ms |")
    print("\n".join(lines + [""] + projection))
    if args.write:
        command = shlex.join([".venv/bin/python", "benchmarks/engine_devices.py", *sys.argv[1:]])
        name = "Engine over several devices: tensor parallel"
        write_section(name, "\n".join([
            f"## {name}",
            "",
            f"`{command}` on {machine()}, {(time.perf_counter() - t_start) / 60:.0f} min, load average "
            f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. SmolLM2-135M fp32 with the "
            f"shipped drafter, {PROMPT_LEN}-token prompts, {args.new_tokens} new tokens each, greedy; the devices "
            "are simulated CPU devices sharing the machine's cores, so the split can only add cost here (the "
            "collectives) while the outputs must not change.",
            "",
            *lines,
            "",
            "A projection for TPU v5p, not a measurement: a batch-1 decode step reads every target weight once, so "
            f"it takes about weight bytes per chip / {V5P_HBM_BYTES_PER_S / 1e12:.3f} TB/s of HBM bandwidth; the "
            "per-layer all-reduces over ICI are left out.",
            "",
            *projection,
            "",
        ]))


if __name__ == "__main__":
    main()
