"""Real τ and draft step cost against context length, for drafters served with full-attention draft layers and
with sliding-window ones (`drafter.layer_types`, `drafter.sliding_window`), side by side in one run.

    .venv/bin/python benchmarks/window_tau.py [--drafter [NAME=]PATH[@STEP] ...] [--contexts 1024 2048 4096 8192] \
        [--window 512] [--prompts 4] [--tokens 96] [--repeats 10] [--json F] [--write [--section S]]

The long-prompt set: for each context length L, `--prompts` many-shot GSM8K prompts of about L tokens (chat
template included): worked GSM8K *train* examples (question and reference solution), different ones per prompt,
then a held-out GSM8K test question (items 8.., as benchmarks/drafter_tau.py) with the math suffix. The
embedded SmolLM2-135M target (fp32) answers greedily. Each `--drafter` (default: the shipped one) drafts every
block as trained, and a drafter whose layers all attend to the whole context drafts again with every layer
`sliding_attention` at `--window` (the same weights, "post hoc": a windowed layer only stops seeing context keys
older than W, so this measures what a window costs or saves in acceptance for a drafter trained on short rows;
the shipped one saw rows of at most 448 tokens). A drafter trained with its window (`drafter.layer_types`) is
served as it was trained. Per L and drafter: real τ of the batch (`train.real_eval.real_tau`, pooled),
acceptance by draft position, and the median ms of one `propose` at batch 1 with L committed positions
(benchmarks/draft_window.py's timing, these weights). Every output is greedy, so every drafter's outputs equal
the target's own: only τ and cost can differ. `--json` is rewritten after every context length; `--write`
records the table in docs/benchmarks.md (section `--section`).
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

SHIPPED = "data/assets/drafters/smollm2-dflash"


def long_prompts(tokenizer, context: int, n: int, skip: int = 8) -> list:
    """`n` many-shot GSM8K prompts of at most `context` - 8 tokens each (so the engine's prefill bucket is
    `context`): prompt i = train examples from offset 300 i on, as many as fit, then test question skip + i."""
    from dflash.data.eval_sets import MATH_SUFFIX, EvalPrompt, load_eval_set
    from dflash.data.packaged import _read_jsonl, gsm8k_path

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


def layers_of(drafter) -> str:
    """The drafter's attention layout in a few words: `full`, `sliding W=512`, or per layer."""
    arch = drafter.arch
    kinds = {arch.sliding(i) for i in range(arch.num_layers)}
    if kinds == {False}:
        return "full"
    if kinds == {True}:
        return f"sliding W={arch.sliding_window}"
    return " ".join("S" if arch.sliding(i) else "F" for i in range(arch.num_layers)) + f" W={arch.sliding_window}"


def drafter_arg(text: str) -> tuple[str, str, str | None]:
    """A `--drafter`: `NAME=PATH[@STEP]` as benchmarks/drafter_tau.py reads it, or a bare PATH, named `shipped`
    when it is the shipped drafter, else by its last folder."""
    from benchmarks.drafter_tau import parse_drafter

    if "=" in text:
        return parse_drafter(text)
    return "shipped" if text == SHIPPED else Path(text).name, text, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=drafter_arg, action="append", metavar="[NAME=]PATH[@STEP]",
                        help=f"an exported drafter or run dir, served as trained; repeat to compare (default "
                        f"{SHIPPED})")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=512,
                        help="also serve every all-full-attention drafter with every layer sliding at this window "
                             "(the same weights); 0: do not")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per context length")
    parser.add_argument("--tokens", type=int, default=96, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=10, help="timed propose calls per case")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--section", default="window-tau", help="docs/benchmarks.md section --write replaces")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.window < 0 or (args.window and min(args.contexts) <= args.window) or args.prompts < 1 or args.tokens < 1:
        parser.error("--window must be 0 or below every context; --prompts and --tokens >= 1")

    from benchmarks._report import machine, write_section
    from benchmarks.draft_window import prepared, propose_ms
    from dflash.models.config import TargetConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import real_tau

    started = time.time()
    target = load_target(TargetConfig(source="smollm2", dtype="float32",
                                      max_seq_len=max(args.contexts) + args.tokens + 64))
    drafters = args.drafter or [drafter_arg(SHIPPED)]
    sources, variants = {name: path for name, path, _ in drafters}, {}
    for name, path, step in drafters:
        drafter = load_drafter(Path(path), target.cfg, step=step)
        variants[name] = drafter
        if args.window and not drafter.arch.num_sliding:
            variants[f"{name}, W={args.window} post hoc"] = windowed(drafter, args.window)
    ks = {d.arch.block_size for d in variants.values()}
    if len(ks) > 1:
        parser.error(f"the drafters have different block sizes {sorted(ks)}: compare one K at a time")
    k = ks.pop()
    command = shlex.join([".venv/bin/python", "benchmarks/window_tau.py", *sys.argv[1:]])
    described = "; ".join(f"`{name}` = `{path}` ({variants[name].arch.num_layers} layers, "
                          f"{layers_of(variants[name])})" for name, path in sources.items())
    lines = [f"`{command}` on {machine()}. SmolLM2-135M target (fp32), K={k}. Drafters: {described}"
             + (f"; `..., W={args.window} post hoc` = the same weights with every layer `sliding_attention` at "
                f"W={args.window}" if args.window else "")
             + f". {args.prompts} many-shot GSM8K prompts per context length (train examples, then a held-out test "
             f"question), {args.tokens} new tokens, greedy, one batch per drafter; `propose` at batch 1 with L "
             f"committed positions, median of {args.repeats} calls (all drafters' calls interleaved).", "",
             "| context L | prompt tokens | drafter | draft layers | τ | accepted by position | propose ms |",
             "|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    rows = []
    for context in args.contexts:
        prompts = long_prompts(target.tokenizer, context, args.prompts)
        lengths = [len(p.ids) for p in prompts]
        found = {name: real_tau(target, drafter, prompts, args.tokens, teacher=False, prefill_chunk=1024)
                 for name, drafter in variants.items()}
        cases = [prepared(target, drafter, k, context) for drafter in variants.values()]
        cost = dict(zip(variants, propose_ms(cases, k, args.repeats), strict=True))
        for name, drafter in variants.items():
            rows.append({"context": context, "prompt_tokens": lengths, "drafter": name,
                         "layers": layers_of(drafter), "tau": found[name]["tau"],
                         "accept_per_position": found[name]["accept_per_position"], "propose_ms": cost[name]})
            acc = " ".join(f"{a:.2f}" for a in found[name]["accept_per_position"])
            lines.append(f"| {context} | {min(lengths)}-{max(lengths)} | {name} | {layers_of(drafter)} | "
                         f"{found[name]['tau']:.2f} | {acc} | {cost[name]:.1f} |")
            print(lines[-1], flush=True)
        if args.json:  # after every context length: a long run stopped early keeps what it measured
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    lines += ["", f"The run took {(time.time() - started) / 60:.1f} min."]
    print("\n".join(lines))
    if args.write:
        write_section(args.section, "## Draft window against context length: real τ and propose cost\n\n"
                      + "\n".join(lines))


if __name__ == "__main__":
    main()
