"""The engine's cost per draft step for each drafter variant: DFlash, DFlash2's convolution, and the convolution with
the path selector, at several K, side by side in one run.

    .venv/bin/python benchmarks/draft_variants.py [--ks 4 8] [--context 512] [--batches 1 8] [--layers 2]
        [--repeats 20] [--write]

The embedded SmolLM2-135M target (fp32) and randomly initialised drafters of `--layers` layers at its width (the
shipped drafter's shape at the default), identical but for the variant: `dflash`; `dflash2` with its convolution
(kernel 2, group 16); `dflash2` with the convolution and the path selector (rank 256, top-k 16). One `propose`
(`serve.speculative.propose`: the drafter's forward over the block, the target's head over the K-1 draft slots,
and for the selector its top-k and left-to-right walk) per case, `--context` committed positions per slot,
median of `--repeats` calls after a warm-up, every case's calls interleaved (load changes hit all alike); the
ratio is against DFlash at the same K and batch. The cost of a whole speculative step adds the target's verify
of K tokens, the same for every variant. `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {"dflash": {}, "dflash2 conv": {"variant": "dflash2"},
            "dflash2 conv + selector": {"variant": "dflash2", "selector": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if min(args.ks) < 2 or min(args.batches) < 1 or args.context < 1 or args.repeats < 1:
        parser.error("--ks must be >= 2, --batches, --context and --repeats >= 1")

    from flax import nnx

    from benchmarks._report import machine, write_section
    from benchmarks.draft_window import prepared, propose_ms
    from dflash.models.config import DrafterConfig, TargetConfig
    from dflash.models.drafter import DFlashDrafter, default_mask_token_id, resolve_drafter
    from dflash.models.target import load_target

    started = time.time()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=args.context + 64))
    mask = default_mask_token_id(target.tokenizer, target.cfg)
    command = shlex.join([".venv/bin/python", "benchmarks/draft_variants.py", *sys.argv[1:]])
    lines = [f"`{command}` on {machine()}. SmolLM2-135M target (fp32), {args.layers}-layer drafters at its width "
             f"(random weights), {args.context} committed positions per slot; `propose` median of {args.repeats} "
             "calls, all cases interleaved.", "",
             "| K | batch | " + " | ".join(f"{v} ms" for v in VARIANTS) + " | " +
             " | ".join(f"{v} / dflash" for v in list(VARIANTS)[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(VARIANTS) - 1)]
    print(lines[0], flush=True)
    for k in args.ks:
        drafters = [DFlashDrafter(resolve_drafter(DrafterConfig(num_layers=args.layers, block_size=k, **extra),
                                                  target.cfg, mask), nnx.Rngs(0)) for extra in VARIANTS.values()]
        for batch in args.batches:
            cases = [prepared(target, drafter, k, args.context, batch) for drafter in drafters]
            ms = propose_ms(cases, k, args.repeats)
            lines.append(f"| {k} | {batch} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
                         + " | ".join(f"{m / ms[0]:.2f}x" for m in ms[1:]) + " |")
            print(lines[-1], flush=True)
    lines += ["", f"The run took {(time.time() - started) / 60:.1f} min."]
    print("\n".join(lines))
    if args.write:
        write_section("draft-variants", "## Draft step cost by drafter variant: DFlash, DFlash2's convolution, "
                      "the path selector\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
