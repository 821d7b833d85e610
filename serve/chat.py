"""Chat with the target from prompts (AR mode): the first user-visible job of the pipeline."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from dflash.models.target import Target
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import Completion, Engine
from dflash.serve.plan import AR, Limits


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    """One answered prompt. steady_tokens / steady_s: the tokens and seconds of the decode steps that compiled
    nothing (the prefill step, which emits the first token, and any step that compiled a program left out), so
    their ratio is the decode speed without compilation."""

    prompt: str
    reply: str
    result: Completion
    steady_tokens: int
    steady_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else 0.0


def chat(target: Target, sampling: SamplingConfig, max_len: int, prompts: Sequence[str], system: str | None = None,
         out: TextIO | None = None) -> list[ChatTurn]:
    """Answer each prompt (a fresh conversation each, AR decoding through one engine), streaming the reply to
    `out` (default stdout); `sampling.max_new_tokens` tokens at most, contexts of `max_len`. The decode speed
    printed counts only the steps that compiled nothing."""
    out = out or sys.stdout
    tok = target.tokenizer
    engine = Engine(target.params, target.cfg, None, AR(), Limits(slots=1, max_len=max_len), sampling=sampling)
    turns = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = tok.encode_chat(messages, add_generation_prompt=True)
        out.write(f"\n>>> {prompt}\n")
        stream = _Streamer(tok, out)
        engine.submit(prompt_ids, sampling.max_new_tokens, tok.stop_token_ids, seed=sampling.seed)
        result = engine.queue[-1]
        steady_tokens, steady_s = 0, 0.0
        while engine.busy:
            emitted, compiles, t0 = len(result.token_ids), engine.compiles, time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t0
            if emitted and engine.compiles == compiles:  # a decode step that compiled nothing
                steady_tokens, steady_s = steady_tokens + len(result.token_ids) - emitted, steady_s + seconds
            for token in result.token_ids[emitted:]:
                stream(token)
        engine.done.clear()
        reply = tok.decode([t for t in result.token_ids if t not in tok.stop_token_ids])
        out.write(reply[stream.printed:] + "\n")
        turn = ChatTurn(prompt, reply, result, steady_tokens, steady_s)
        out.write(
            f"[{len(result.prompt_ids)} prompt tokens, prefill {result.prefill_s:.2f}s; "
            f"{len(result.token_ids)} new tokens, decode {turn.tokens_per_s:.1f} tokens/s without compilation"
            f"{'' if result.stopped else ', stopped at max_new_tokens'}]\n"
        )
        turns.append(turn)
    return turns


class _Streamer:
    """Prints a reply as tokens arrive, holding back incomplete UTF-8 characters and stop tokens."""

    def __init__(self, tok, out: TextIO):
        self.tok, self.out, self.ids, self.printed = tok, out, [], 0

    def __call__(self, token: int) -> None:
        if token in self.tok.stop_token_ids:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)
