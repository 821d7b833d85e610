"""The README's main job (`bin/demo` = `dflash demo --config demo`), as far as the pipeline exists.

1. load the embedded default target;
2. distill a drafter for it: a short `dflash train` run (online target features over packaged GSM8K),
   checkpointed under `train.run_dir` (a rerun resumes there; it trains nothing once the run is complete)
   and evaluated teacher-forced on held-out GSM8K test conversations;
3. chat with the target (AR decoding) and report decode tokens/s;
4. decode the same prompts with greedy DFlash speculative decoding and the drafter just trained (loaded
   back from its checkpoint), reporting τ, acceptance by position and whether the output equals AR.
The server (`dflash serve`) and the data stages (`dflash data`) are separate commands.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from configs.recipe import Recipe
from models.target import load_target
from serve.chat import ChatTurn, chat

DEMO_PROMPTS = (
    "What is speculative decoding, in two sentences?",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def run_demo(recipe: Recipe, prompts: Sequence[str] = DEMO_PROMPTS, out: TextIO | None = None,
             train: bool = True, progress: bool = True) -> list[ChatTurn]:
    """Load the target, train the drafter of `recipe.train` (unless `train` is False), then chat."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    out.write(f"loaded {target.path.name} ({target.cfg.family}, {target.cfg.num_layers} layers, "
              f"hidden {target.cfg.hidden_size}) in {time.perf_counter() - t0:.1f}s\n")
    if train:
        from train.loop import run_training

        drafter = recipe.drafter
        out.write(f"\n== training a DFlash drafter: {drafter.num_layers} layers, block {drafter.block_size}, "
                  f"{recipe.train.steps} steps -> {recipe.train.run_dir}\n")
        out.flush()
        result = run_training(recipe, target=target, progress=progress)
        out.write(f"trained steps {result.start_step}..{result.final_step} in {result.seconds:.0f}s\n")
        if result.eval:
            ev = result.eval
            per_pos = " ".join(f"{a:.2f}" for a in ev["accuracy_per_position"][1:])
            out.write(f"held-out teacher-forced acceptance length {ev['acceptance_length']:.2f} "
                      f"(1.00 = nothing accepted; block {result.arch.block_size}), loss {ev['loss']:.3f}\n"
                      f"accuracy by draft position: {per_pos}\n")
    out.write("\n== chat with the target (AR decoding)\n")
    turns = chat(target, recipe.sampling, recipe.target.max_seq_len, prompts, out=out)
    total = sum(len(t.result.token_ids) for t in turns)
    decode_s = sum(t.result.decode_s for t in turns)
    rate = (total - len(turns)) / max(decode_s, 1e-9)
    out.write(f"\nAR: {len(turns)} prompts, {total} tokens generated, "
              f"{rate:.1f} decode tokens/s overall (first call includes compile)\n")
    if train:
        speculative_rerun(recipe, target, turns, out)
    out.write("\ndemo done\n")
    return turns


def speculative_rerun(recipe: Recipe, target, turns: Sequence[ChatTurn], out: TextIO) -> None:
    """Decode the same prompts again with DFlash speculative decoding and the drafter just trained."""
    from models.drafter_io import load_drafter
    from serve.engine import decode

    drafter = load_drafter(recipe.train.run_dir, target.cfg)
    k = drafter.arch.block_size
    out.write(f"\n== the same prompts with DFlash speculative decoding (greedy, block {k}, drafter from "
              f"{recipe.train.run_dir})\n")
    for turn in turns:
        [res] = decode(target.params, target.cfg, [turn.result.prompt_ids], recipe.sampling.max_new_tokens,
                       max_len=recipe.target.max_seq_len, drafter=drafter, block_size=k,
                       stop_ids=target.tokenizer.stop_token_ids)
        same = res.token_ids == turn.result.token_ids
        per_pos = " ".join(f"{a:.2f}" for a in res.accept_per_position)
        out.write(f">>> {turn.prompt}\n[{len(res.token_ids)} tokens in {len(res.accepted)} verify steps: "
                  f"tau {res.tau:.2f}; identical to AR: {'yes' if same else 'NO'}; acceptance by position: "
                  f"{per_pos}]\n")
