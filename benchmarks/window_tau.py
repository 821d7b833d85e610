"""Real τ and draft step cost against context length: one drafter's weights served with full-attention draft layers
and with sliding-window ones (`drafter.layer_types`, `drafter.sliding_window`), side by side in one run.

    .venv/bin/python benchmarks/window_tau.py [--drafter dflash/data/assets/drafters/smollm2-dflash] \
        [--contexts 1024 2048 4096 8192] [--window 512] [--prompts 4] [--tokens 96] [--repeats 10] [--write]

The long-prompt set: for each context length L, `--prompts` many-shot GSM8K prompts of about L tokens (chat
template included): worked GSM8K *train* examples (question and reference solution), different ones per prompt,
then a held-out GSM8K test question (items 8.., as benchmarks/drafter_tau.py) with the math suffix. The
embedded SmolLM2-135M target (fp32) answers greedily; the drafter drafts every block twice, once as trained and
once with every layer `sliding_attention` at window `--window` (the same weights: a windowed layer only stops
seeing context keys older than W, so this measures what a window costs or saves in acceptance for a drafter
trained on short rows; the shipped one saw rows of at most 448 tokens). Per L and variant: real τ of the batch
(`train.real_eval.real_tau`, pooled), acceptance by draft position, and the median ms of one `propose` at batch 1
with L committed positions (benchmarks/draft_window.py's timing, these weights). Every output is greedy, so
both variants' outputs equal the target's own: only τ and cost can differ. `--write` records the table in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHIPPED = "dflash/data/assets/drafters/smollm2-dflash"


def long_prompts(tokenizer, context: int, n: int, skip: int = 8) -> list:
    """`n` many-shot GSM8K prompts of at most `context` - 8 tokens each (so the engine's prefill bucket is
    `context`): prompt i = train examples from offset 300 i on, as many as fit, then test question skip + i."""
    from dflash.data.eval_sets import MATH_SUFFIX, load_eval_set
    from dflash.data.packaged import _read_jsonl, gsm8k_path
    from dflash.train.real_eval import EvalPrompt

    train = _read_jsonl(gsm8k_path("train"), None)
    questions = load_eval_set("gsm8k", skip + n)[skip:]
    prompts = []
    for i, item in enumerate(questions):
        question = item.turns[0].removesuffix(MATH_SUFFIX)
        shots: list[str] = []
        head = "Here are worked examples of grade-school math problems.\n\n"
        tail = f"Now solve this one.\nQuestion: {question}{MATH_SUFFIX}"

        def encode(parts: list[str]) -> list[int]:
            text = head + "".join(parts) + tail  # noqa: B023
            return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)

        for row in train[300 * i:]:
            shot = f"Question: {row['question'].strip()}\nSolution: {row['answer'].strip()}\n\n"
            if len(encode([*shots, shot])) > context - 8:
                break
            shots.append(shot)
        prompts.append(EvalPrompt("gsm8k_long", tuple(int(t) for t in encode(shots))))
    return prompts


def windowed(drafter, window: int):
    """The same weights with every layer `sliding_attention` at `window`."""
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter

    arch = dataclasses.replace(drafter.arch, layer_types=("sliding_attention",) * drafter.arch.num_layers,
                               sliding_window=window)
    out = DFlashDrafter(arch, nnx.Rngs(0))
    nnx.update(out, nnx.state(drafter, nnx.Param))
    out.draft_vocab = drafter.draft_vocab
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=SHIPPED, help=f"an exported drafter or run dir (default {SHIPPED})")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per context length")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=10, help="timed propose calls per case")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if min(args.contexts) <= args.window or args.window < 1 or args.prompts < 1 or args.tokens < 1:
        parser.error("--window must be >= 1 and below every context; --prompts and --tokens >= 1")

    from benchmarks._report import machine, write_section
    from benchmarks.draft_window import prepared, propose_ms
    from dflash.models.config import TargetConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.train.real_eval import real_tau

    started = time.time()
    target = load_target(TargetConfig(source="smollm2", dtype="float32",
                                      max_seq_len=max(args.contexts) + args.tokens + 64))
    full = load_drafter(Path(args.drafter), target.cfg)
    variants = {"full": full, "windowed": windowed(full, args.window)}
    k = full.arch.block_size
    command = shlex.join([".venv/bin/python", "benchmarks/window_tau.py", *sys.argv[1:]])
    lines = [f"`{command}` on {machine()}. SmolLM2-135M target (fp32), drafter `{args.drafter}` "
             f"({full.arch.num_layers} layers, K={k}) as trained (full) and with every layer `sliding_attention` at "
             f"W={args.window} (windowed, same weights); {args.prompts} many-shot GSM8K prompts per context length "
             f"(train examples, then a held-out test question), {args.tokens} new tokens, greedy, one batch; "
             f"`propose` at batch 1, median of {args.repeats} calls.", "",
             "| context L | prompt tokens | τ full | τ windowed | accepted by position: full | windowed | "
             "propose ms: full | windowed |", "|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    rows = []
    for context in args.contexts:
        prompts = long_prompts(target.tokenizer, context, args.prompts)
        found = {name: real_tau(target, drafter, prompts, args.tokens, teacher=False, prefill_chunk=1024)
                 for name, drafter in variants.items()}
        cases = [prepared(target, variants[name], k, context) for name in ("full", "windowed")]
        cost = dict(zip(("full", "windowed"), propose_ms(cases, k, args.repeats), strict=True))
        lengths = [len(p.ids) for p in prompts]
        rows.append({"context": context, "prompt_tokens": lengths, **{f"{n}_{m}": found[n][m] for n in found
                                                                       for m in ("tau", "accept_per_position")},
                     "propose_ms": cost})
        acc = {n: " ".join(f"{a:.2f}" for a in found[n]["accept_per_position"]) for n in found}
        lines.append(f"| {context} | {min(lengths)}-{max(lengths)} | {found['full']['tau']:.2f} | "
                     f"{found['windowed']['tau']:.2f} | {acc['full']} | {acc['windowed']} | {cost['full']:.1f} | "
                     f"{cost['windowed']:.1f} |")
        print(lines[-1], flush=True)
    lines += ["", f"The run took {(time.time() - started) / 60:.1f} min."]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    if args.write:
        write_section("window-tau", "## Draft window against context length: real τ and propose cost (shipped "
                      "drafter)\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
