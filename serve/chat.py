"""Chat with the target from prompts (AR mode): the first user-visible job of the pipeline."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import TextIO

from dflash.models.target import Target
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import Completion, decode


@dataclasses.dataclass(frozen=True)
class ChatTurn:
    prompt: str
    reply: str
    result: Completion


def chat(target: Target, sampling: SamplingConfig, max_len: int, prompts: Sequence[str], system: str | None = None,
         out: TextIO | None = None) -> list[ChatTurn]:
    """Answer each prompt (a fresh conversation each, AR decoding through the engine), streaming the reply to
    `out` (default stdout); `sampling.max_new_tokens` tokens at most, contexts of `max_len`."""
    out = out or sys.stdout
    tok = target.tokenizer
    turns = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = tok.encode_chat(messages, add_generation_prompt=True)
        out.write(f"\n>>> {prompt}\n")
        stream = _Streamer(tok, out)
        [result] = decode(target.params, target.cfg, [prompt_ids], sampling.max_new_tokens, max_len=max_len,
                          stop_ids=tok.stop_token_ids, sampling=sampling, on_token=stream)
        reply = tok.decode([t for t in result.token_ids if t not in tok.stop_token_ids])
        out.write(reply[stream.printed:] + "\n")
        out.write(
            f"[{len(result.prompt_ids)} prompt tokens, prefill {result.prefill_s:.2f}s; "
            f"{len(result.token_ids)} new tokens, decode {result.decode_tokens_per_s:.1f} tokens/s"
            f"{'' if result.stopped else ', stopped at max_new_tokens'}]\n"
        )
        turns.append(ChatTurn(prompt, reply, result))
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
