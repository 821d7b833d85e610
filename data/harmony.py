"""gpt-oss's harmony chat format, for regeneration and training rows (docs/decisions.md D85).

After the prompt's `<|start|>assistant` a gpt-oss target writes its reasoning on the analysis channel, then its answer
on the final channel, and stops on `<|return|>`:

    <|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant<|channel|>final<|message|>{content}<|return|>

Its published chat template renders a conversation's LAST assistant message `{"role": "assistant", "thinking": ...,
"content": ...}` back to exactly that (analysis, then final closed by `<|return|>`: what a trainer feeds it), and every
earlier assistant message as its final answer alone, closed by `<|end|>`: harmony drops past reasoning from the
history the next prompt holds. So:

- `split_reply`: a reply's generated ids -> that assistant message (its `thinking` left out when the target wrote
  no analysis); any other shape (a tool call, a commentary message, two analysis messages, another stop token) is
  a `FormatError`, since no template renders it back as generated;
- `round_trip`: the template renders prompt + message to exactly the prompt's ids and the generated ones, or a
  `FormatError` names the first token that differs;
- `history`: a conversation as harmony's next prompt holds it (earlier turns' `thinking` dropped, their answers
  kept), which regeneration renders each later turn's prompt from and training renders each turn's row from.

A tokenizer is harmony's when its vocabulary holds `HARMONY_TOKENS` (`harmony_ids`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>")
REASONING_EFFORTS = ("low", "medium", "high")
ASSISTANT = "assistant"
_HEADER = re.compile(r"^\s*(assistant)?\s*<\|channel\|>\s*(\S+)\s*$")


class FormatError(ValueError):
    """A reply the harmony template cannot render back to the ids the target generated."""


@dataclasses.dataclass(frozen=True)
class HarmonyIds:
    """The ids of harmony's structural tokens in one tokenizer; `stops`: every id that ends a message."""

    start: int
    end: int
    message: int
    channel: int
    return_: int
    stops: frozenset[int]


def harmony_ids(tok: Any) -> HarmonyIds | None:
    """The harmony token ids of `tok`, or None when its vocabulary lacks any of `HARMONY_TOKENS` (not gpt-oss)."""
    ids = [tok.backend.token_to_id(name) for name in HARMONY_TOKENS]
    if any(i is None for i in ids):
        return None
    start, end, message, channel, return_ = ids
    return HarmonyIds(start, end, message, channel, return_,
                      frozenset({end, return_, *tok.stop_token_ids}))


def is_harmony(tok: Any) -> bool:
    return harmony_ids(tok) is not None


def check_reasoning_effort(template_kwargs: Mapping[str, Any],
                           field: str = "data.regen.template_kwargs.reasoning_effort") -> None:
    """A reasoning effort, where the recipe sets one, must be a level harmony's system message knows."""
    effort = template_kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ValueError(f"{field} must be one of {list(REASONING_EFFORTS)} (harmony's `Reasoning:` levels; unset: the "
                         f"template's default, medium); received {effort!r}")


def history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as harmony's next prompt holds them: each assistant message without its `thinking` (the analysis
    of a turn that ended in a final answer is dropped), everything else as it is."""
    return [{k: v for k, v in m.items() if k != "thinking"} if m.get("role") == ASSISTANT else dict(m)
            for m in messages]


def split_reply(tok: Any, ids: Sequence[int]) -> dict[str, str]:
    """The assistant message of a reply: `{"role": "assistant", "thinking": A, "content": F}`, `thinking` absent when
    the reply has no analysis message.

    `ids`: what the target generated after the prompt's `<|start|>assistant`, up to and including its stop token, or
    cut short inside its final channel (a reply that hit max_new_tokens; the template then closes it with
    `<|return|>`). Raises FormatError unless the reply is [an analysis message, `<|end|>`, `<|start|>`] then a final
    message ending in `<|return|>` or cut: the only shapes the template renders back.
    """
    h = harmony_ids(tok)
    if h is None:
        raise ValueError(f"tok must be a harmony tokenizer (with {list(HARMONY_TOKENS)}); received one without")
    ids = [int(i) for i in ids]
    messages: list[tuple[str, list[int], int | None]] = []  # (channel, content ids, the id that ended it)
    pos = 0
    while True:
        if h.message not in ids[pos:]:
            raise FormatError(f"message {len(messages)} of the reply must have a <|message|> after its header; the "
                              f"reply ends in its header ({len(ids)} tokens)")
        body = ids.index(h.message, pos) + 1
        channel = _channel(tok, ids[pos:body - 1], first=not messages)
        stop = next((i for i in range(body, len(ids)) if ids[i] in h.stops), len(ids))
        inner = sorted({tok.decode([i], skip_special_tokens=False) for i in ids[body:stop]
                        if i in (h.start, h.message, h.channel)})
        if inner:
            raise FormatError(f"message {len(messages)} of the reply must hold no harmony token in its content; "
                              f"received {inner}")
        messages.append((channel, ids[body:stop], ids[stop] if stop < len(ids) else None))
        if stop == len(ids) or ids[stop] != h.end:
            break
        if stop + 1 >= len(ids) or ids[stop + 1] != h.start:
            raise FormatError(f"<|end|> must be followed by <|start|> (the next message) at token {stop + 1}; the "
                              "reply ends there or goes on otherwise")
        pos = stop + 2
    channels = [c for c, _, _ in messages]
    if channels not in (["final"], ["analysis", "final"]):
        raise FormatError(f"the reply's channels must be [analysis, final] or [final] (the shapes the harmony template "
                          f"renders); received {channels}")
    ended = messages[-1][2]
    if ended is not None and ended != h.return_:
        raise FormatError(f"the final message must end with <|return|>; received "
                          f"{tok.decode([ended], skip_special_tokens=False)!r}")
    out = {"role": ASSISTANT}
    if len(messages) == 2:
        out["thinking"] = tok.decode(messages[0][1], skip_special_tokens=False)
    out["content"] = tok.decode(messages[-1][1], skip_special_tokens=False)
    return out


def round_trip(tok: Any, prompt: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int], message: Mapping[str, Any],
               generated: Sequence[int], template_kwargs: Mapping[str, Any]) -> None:
    """Check that the template renders `history(prompt) + [message]` to exactly `prompt_ids + generated` (plus the
    `<|return|>` the template closes a cut reply with); a FormatError names the first token that differs."""
    h = harmony_ids(tok)
    expected = [*map(int, prompt_ids), *map(int, generated)]
    if h is not None and (not expected or expected[-1] not in h.stops):
        expected.append(h.return_)
    try:
        text = tok.apply_chat_template([*history(prompt), dict(message)], add_generation_prompt=False,
                                       **template_kwargs)
    except Exception as err:  # noqa: BLE001 - a template that refuses the message refuses the reply
        raise FormatError(f"the chat template must render the reply; it failed: {type(err).__name__}: {err}") from err
    rendered = tok.encode(text, add_special_tokens=False)
    if rendered != expected:
        i = next((i for i, (a, b) in enumerate(zip(rendered, expected, strict=False)) if a != b),
                 min(len(rendered), len(expected)))
        raise FormatError(f"the chat template must render the reply back to the ids the target generated; they differ "
                          f"at token {i} of {len(expected)} ({_show(tok, rendered[i:i + 4])} rendered, "
                          f"{_show(tok, expected[i:i + 4])} generated)")


def _channel(tok: Any, header: Sequence[int], first: bool) -> str:
    """The channel a message header names: `<|channel|>NAME` for the reply's first message (the prompt wrote its
    `<|start|>assistant`), `assistant<|channel|>NAME` after; a recipient (`to=...`) or a content type is no channel
    the template renders, and is refused."""
    text = tok.decode(list(header), skip_special_tokens=False)
    match = _HEADER.match(text)
    if match is None or bool(match.group(1)) == first:
        want = "<|channel|>NAME" if first else "assistant<|channel|>NAME"
        raise FormatError(f"the reply's message headers must be {want!r}; received {text!r}")
    return match.group(2)


def _show(tok: Any, ids: Sequence[int]) -> str:
    return repr(tok.decode(list(ids), skip_special_tokens=False)) if ids else "the end"


__all__ = ["HARMONY_TOKENS", "REASONING_EFFORTS", "FormatError", "HarmonyIds", "check_reasoning_effort", "harmony_ids",
           "history", "is_harmony", "round_trip", "split_reply"]
