"""The engine at two commits, side by side: did a change slow decoding down?

    .venv/bin/python benchmarks/engine_before_after.py --base REV [--rounds 4] [--new-tokens 128]
        [--slots 1] [--steps-per-dispatch 1] [--write]

Checks out REV in a temporary git worktree and runs the same workload in it and in this tree, alternating (base,
new, base, new, ...) so that drifts of the machine hit both alike. The workload builds the engine the way its side
does (`serve.engine.Engine(target_params, target_cfg, drafter, plan, limits)` since D68, before it `Engine(...,
slots=, max_len=, block_size=)`) and uses `submit`, `step`, `run`; it imports each side's code from its own tree
(the card's folders as `dflash.<folder>` since D67, a `dflash/` folder before): the embedded SmolLM2 target in fp32,
a random-init 2-layer K=8 drafter (seed 0; tau ~ 1, the cost of a DFlash step), one 64-token prompt, batch 1. Per
side and round: decode tokens/s (the tokens after the first step over the time of the rest, so prefill and
compilation are excluded), median of 5 timed runs after a warm-up, for AR (`block_size=None`) and DFlash K=8.
`--slots N` runs N requests (distinct 64-token prompts) on an engine of N slots instead: the throughput of a full
server (the tokens of all N after the first step, over the time of the rest); `--steps-per-dispatch R` sizes the
device loop (`dflash serve`'s default is 4). `--write` records the table in docs/benchmarks.md (a section per slot
count).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOAD = textwrap.dedent("""
    import json, statistics, sys, tempfile, time
    from pathlib import Path
    root = Path(sys.argv[1])
    if (root / "dflash").is_dir():  # before D67: one dflash/ folder
        sys.path.insert(0, str(root))
    else:  # the card's folders, installed as dflash.<folder>: a view of this tree under that name
        view = Path(tempfile.mkdtemp()) / "dflash"
        view.mkdir()
        for folder in ("configs", "models", "serve", "data", "train", "eval", "export", "launch"):
            (view / folder).symlink_to(root / folder)
        sys.path.insert(0, str(view.parent))
    from flax import nnx
    from dflash.models.config import TargetConfig
    from dflash.models.drafter import DFlashDrafter, DrafterConfig, default_mask_token_id, resolve_drafter
    from dflash.models.target import load_target
    from dflash.serve.engine import Engine
    def engine_at(k):
        try:
            from dflash.serve.plan import AR, Chain, Limits
        except ImportError:  # before D68
            return Engine(target.params, target.cfg, drafter, slots=slots, max_len=1024, block_size=k)
        plan = AR() if k is None else Chain(k)
        return Engine(target.params, target.cfg, drafter, plan,
                      Limits(slots=slots, max_len=1024, steps_per_dispatch=dispatch))
    new_tokens, slots, dispatch = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=1024))
    mask = default_mask_token_id(target.tokenizer, target.cfg)
    drafter = DFlashDrafter(resolve_drafter(DrafterConfig(num_layers=2, block_size=8), target.cfg, mask), nnx.Rngs(0))
    out = {}
    for name, k in (("AR", None), ("DFlash K=8", 8)):
        rates = []
        for rep in range(6):
            engine = engine_at(k)
            for i in range(slots):
                engine.submit(list(range(100 + i, 164 + i)), new_tokens)
            engine.step()
            first = sum(len(c.token_ids) for c in engine.running.values())
            t0 = time.perf_counter()
            done = engine.run()
            seconds = time.perf_counter() - t0
            if rep:
                rates.append((sum(len(c.token_ids) for c in done.values()) - first) / seconds)
        out[name] = statistics.median(rates)
    print(json.dumps(out))
""")


def run_side(tree: Path, new_tokens: int, slots: int, dispatch: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", WORKLOAD, str(tree), str(new_tokens), str(slots), str(dispatch)],
                          cwd=tree, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the workload failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare against (e.g. HEAD~3, a hash)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating base/new rounds (default 4)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--slots", type=int, default=1, help="requests at once on an engine of this many slots")
    parser.add_argument("--steps-per-dispatch", type=int, default=1, help="the engine's device loop (default 1)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    from benchmarks._report import machine, write_section

    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), base_rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            rounds = []
            for i in range(args.rounds):
                base = run_side(base_tree, args.new_tokens, args.slots, args.steps_per_dispatch)
                new = run_side(ROOT, args.new_tokens, args.slots, args.steps_per_dispatch)
                rounds.append((base, new))
                print(f"round {i + 1}: base {base}  new {new}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, capture_output=True)
    names = list(rounds[0][0])
    lines = ["| decoder | " + " | ".join(f"round {i + 1} base / new" for i in range(len(rounds)))
             + " | mean base | mean new | new / base |",
             "|---|" + "---|" * (len(rounds) + 3)]
    for name in names:
        base_mean = statistics.mean(b[name] for b, _ in rounds)
        new_mean = statistics.mean(n[name] for _, n in rounds)
        lines.append(f"| {name} | " + " | ".join(f"{b[name]:.1f} / {n[name]:.1f}" for b, n in rounds)
                     + f" | {base_mean:.1f} | {new_mean:.1f} | {new_mean / base_mean:.2f}x |")
    print("\n".join(lines))
    if args.write:
        command = shlex.join([".venv/bin/python", "benchmarks/engine_before_after.py", *sys.argv[1:]])
        full = args.slots > 1
        title = "Engine before / after a change" + (f", a full server of {args.slots} slots" if full else "")
        workload = (f"{args.slots} requests at once on an engine of {args.slots} slots (distinct 64-token prompts), "
                    f"{args.steps_per_dispatch} steps per dispatch: decode tokens/s of all of them" if full else
                    "Decode tokens/s at batch 1 (prefill and compile excluded), one 64-token prompt")
        write_section(title, "\n".join([
            f"## {title}",
            "",
            f"`{command}` on {machine()}: base {base_rev} vs new {new_rev}, {args.rounds} alternating rounds, "
            f"{(time.perf_counter() - t_start) / 60:.0f} min. {workload}, {args.new_tokens} new tokens each, median "
            "of 5 runs per side and round (prefill and compile excluded); DFlash with a random-init 2-layer K=8 "
            "drafter (tau ~ 1: the cost of a step, not a speedup).",
            "",
            *lines,
            "",
        ]))


if __name__ == "__main__":
    main()
