"""The draft vocabulary at serving time: proposals over the training vocabulary's rows of the LM head
(`train.head_vocab`, `models.drafter.DraftVocab`) against the full head, side by side in one run.

    .venv/bin/python benchmarks/draft_vocab.py --drafter runs/smollm2 [--step best] [--ks 4 8]
        [--sets gsm8k mtbench humaneval math500] [--prompts 2] [--new-tokens 64] [--rounds 3] [--write]

The embedded SmolLM2-135M target (fp32), batch 1, greedy, through the engine (`serve.engine.decode`).
1. `propose` alone (one drafter forward + the head over the K-1 draft slots) on a prefilled state: full
   head vs draft vocabulary, median of 20 calls after a warm-up, per K.
2. End to end: AR, DFlash with the full head and DFlash with the draft vocabulary at each K decode the same
   chat-templated prompts (`--prompts` per set), `--new-tokens` each with stop ids, alternating the three
   decoders `--rounds` times (the machine's drift hits all alike; each prompt compiles once untimed first).
   TPOT = decode seconds / (tokens - 1) (prefill excluded); tau = tokens per verify step. Both DFlash rows
   must emit AR's tokens (greedy is lossless whatever the drafter proposes): the script checks it.
`--write` records the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_LEN = 1024


def propose_ms(target, drafter, k: int, repeats: int = 20) -> float:
    import jax
    import numpy as np

    from dflash.serve.engine import Engine
    from dflash.serve.plan import Chain, Limits
    from dflash.serve.speculative import propose

    engine = Engine(target.params, target.cfg, drafter, Chain(k), Limits(slots=1, max_len=MAX_LEN))
    engine.submit(list(np.random.default_rng(0).integers(0, 10000, 96)), 8)
    engine.step()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(propose(engine.models, engine.state, k))
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="a run dir or export whose drafter has a draft vocabulary")
    parser.add_argument("--step", default=None)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "mtbench", "humaneval", "math500"])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()


    from benchmarks._report import machine, write_section
    from dflash.data.eval_sets import eval_prompts
    from dflash.models.config import TargetConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.engine import decode
    from dflash.serve.plan import AR, Chain

    started = time.time()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=MAX_LEN))
    step = int(args.step) if args.step and args.step.isdigit() else args.step
    with_vocab = load_drafter(Path(args.drafter), target.cfg, step=step)
    if with_vocab.draft_vocab is None:
        raise SystemExit(f"{args.drafter}: this drafter has no draft vocabulary (train it with train.head_vocab)")
    from flax import nnx

    full = nnx.clone(with_vocab)
    full.draft_vocab = None
    vocab_size = with_vocab.draft_vocab.ids.size
    ks = [k for k in args.ks if 2 <= k <= with_vocab.arch.block_size]

    lines = [f"`{' '.join(['.venv/bin/python benchmarks/draft_vocab.py', *map(shlex.quote, sys.argv[1:])])}` on "
             f"{machine()}. Drafter `{args.drafter}` ({with_vocab.arch.num_layers} layers, trained at "
             f"K={with_vocab.arch.block_size}), draft vocabulary {vocab_size} of {target.cfg.vocab_size} tokens.", "",
             "`propose` alone (batch 1, median of 20 calls):", "",
             "| K | full head ms | draft vocabulary ms | ratio |", "|---|---|---|---|"]
    for k in ks:
        a, b = propose_ms(target, full, k), propose_ms(target, with_vocab, k)
        lines.append(f"| {k} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
        print(lines[-1], flush=True)

    tok = target.tokenizer
    prompts = [(p.set, list(p.ids)) for p in eval_prompts(tok, args.sets, args.prompts)]
    stops = tuple(tok.stop_token_ids)
    decoders = [("AR", None, None)] + [(f"DFlash K={k} {label}", d, k) for k in ks
                                         for label, d in (("full head", full), ("draft vocab", with_vocab))]
    tpot: dict[str, list[float]] = {name: [] for name, _, _ in decoders}
    steps: dict[str, list[int]] = {name: [] for name, _, _ in decoders}
    tokens: dict[str, list[int]] = {name: [] for name, _, _ in decoders}
    for _, ids in prompts:  # compile every prompt's shapes once, untimed
        for _, drafter, k in decoders:
            decode(target.params, target.cfg, [ids], args.new_tokens, max_len=MAX_LEN, drafter=drafter,
                   plan=Chain(k) if k else AR(), stop_ids=stops)
    for r in range(args.rounds):
        for _, ids in prompts:
            outputs = {}
            for name, drafter, k in decoders:
                [c] = decode(target.params, target.cfg, [ids], args.new_tokens, max_len=MAX_LEN, drafter=drafter,
                             plan=Chain(k) if k else AR(), stop_ids=stops)
                outputs[name] = c.token_ids
                if len(c.token_ids) > 1:
                    tpot[name].append(c.decode_s / (len(c.token_ids) - 1))
                if r == 0:
                    steps[name].append(len(c.accepted) if drafter is not None else len(c.token_ids))
                    tokens[name].append(len(c.token_ids))
            bad = [n for n, out in outputs.items() if out != outputs["AR"]]
            if bad:
                raise SystemExit(f"greedy DFlash differs from AR for {bad}: a bug")
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    ar = statistics.mean(tpot["AR"])
    lines += ["", f"End to end, batch 1, {args.prompts} prompt(s) of each of {', '.join(args.sets)} "
              f"({len(prompts)} prompts), up to {args.new_tokens} new tokens each, {args.rounds} alternating rounds; "
              "every DFlash row emitted AR's tokens:", "",
              "| decoder | TPOT (ms) | tau | vs AR |", "|---|---|---|---|"]
    for name, drafter, _ in decoders:
        t = statistics.mean(tpot[name])
        tau = sum(tokens[name]) / max(sum(steps[name]), 1) if drafter is not None else 1.0
        lines.append(f"| {name} | {1e3 * t:.1f} | {tau:.2f} | {ar / t:.2f}x |")
    lines += ["", f"The run took {(time.time() - started) / 60:.1f} min."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        write_section("draft-vocab", "## Draft vocabulary at serving time (SmolLM2-135M target, fp32, batch 1)\n\n"
                      + body)


if __name__ == "__main__":
    main()
