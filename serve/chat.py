"""Chat with the target from prompts (AR mode): the first user-visible job of the pipeline."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from configs.recipe import Recipe
from models.target import Target, load_target
from serve.generate import GenerationResult, generate


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    prompt: str
    reply: str
    result: GenerationResult


def chat(target: Target, recipe: Recipe, prompts: Sequence[str], system: str | None = None,
         out: TextIO = sys.stdout) -> list[ChatTurn]:
    """Answer each prompt (a fresh conversation each), streaming the reply to `out`."""
    tok = target.tokenizer
    turns = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = tok.encode_chat(messages, add_generation_prompt=True)
        out.write(f"\n>>> {prompt}\n")
        shown: list[int] = []
        printed = 0

        def stream(token: int) -> None:
            nonlocal printed
            if token in tok.stop_token_ids:
                return
            shown.append(token)
            text = tok.decode(shown)
            if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
                out.write(text[printed:])
                out.flush()
                printed = len(text)

        result = generate(target.params, target.cfg, prompt_ids, recipe.sampling, recipe.target.max_seq_len,
                          stop_ids=tok.stop_token_ids, on_token=stream)
        reply = tok.decode([t for t in result.token_ids if t not in tok.stop_token_ids])
        out.write(reply[printed:] + "\n")
        out.write(
            f"[{len(result.prompt_ids)} prompt tokens, prefill {result.prefill_s:.2f}s; "
            f"{len(result.token_ids)} new tokens, decode {result.decode_tokens_per_s:.1f} tokens/s"
            f"{'' if result.stopped else ', stopped at max_new_tokens'}]\n"
        )
        turns.append(ChatTurn(prompt, reply, result))
    return turns


DEMO_PROMPTS = (
    "What is speculative decoding, in two sentences?",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def run_demo(recipe: Recipe, prompts: Sequence[str] = DEMO_PROMPTS, out: TextIO = sys.stdout) -> list[ChatTurn]:
    """The README's main job, as far as the pipeline exists: load the default target and chat with it."""
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    out.write(f"loaded {target.path.name} ({target.cfg.family}, {target.cfg.num_layers} layers, "
              f"hidden {target.cfg.hidden_size}) in {time.perf_counter() - t0:.1f}s\n")
    turns = chat(target, recipe, prompts, out=out)
    total = sum(len(t.result.token_ids) for t in turns)
    decode_s = sum(t.result.decode_s for t in turns)
    out.write(f"\ndemo done: {len(turns)} prompts, {total} tokens generated, "
              f"{(total - len(turns)) / max(decode_s, 1e-9):.1f} decode tokens/s overall (first call includes compile)\n")
    return turns
