"""A request's text as it grows (docs/serving.md): `text`, the visible tokens' text cut before the earliest stop
string, and `stable_text`, its prefix that can no longer change (no incomplete UTF-8 character, no suffix that
could still grow into a stop string), so that a stream of `stable_text` deltas equals the final text.

Each function takes the request (`requests.Completion`) and the engine's `detokenize` (ids -> text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash.serve.requests import Completion

Detokenize = Callable[[Sequence[int]], str]


def held_back(text: str, stop_strings: Sequence[str]) -> int:
    """How many characters at the end of `text` could still grow into a stop string (the longest suffix that is a
    proper prefix of one)."""
    longest = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def visible_text(request: Completion, detokenize: Detokenize, end: int | None = None) -> str:
    """The text of the request's first `end` tokens (all by default), stop tokens left out."""
    ids = request.token_ids if end is None else request.token_ids[:end]
    return detokenize([t for t in ids if t not in request.stop_ids])


def cut_at_stop_string(request: Completion, start: int, detokenize: Detokenize) -> bool:
    """If the text now holds a stop string, keep the tokens up to the first one whose text completes it (searching
    only from the tokens added at `start`); returns whether one matched."""
    text = visible_text(request, detokenize)
    if not any(s in text for s in request.stop_strings):
        return False
    for end in range(start + 1, len(request.token_ids) + 1):
        text = visible_text(request, detokenize, end)
        hits = [s for s in request.stop_strings if s in text]
        if hits:
            request.stop_string = min(hits, key=text.index)
            del request.token_ids[end:]
            del request.token_logprobs[end:]
            del request.top_logprobs[end:]
            return True
    raise AssertionError("unreachable: the full text holds a stop string")  # pragma: no cover


def update_text(request: Completion, detokenize: Detokenize | None) -> None:
    """`text` and `stable_text` (see `Completion`) after new tokens; the text is cut at a stop string."""
    if detokenize is None:
        request.stable_tokens = len(request.token_ids)
        return
    text = visible_text(request, detokenize)
    if request.stop_string is not None:
        text = text[:min(text.index(s) for s in request.stop_strings if s in text)]
    request.text = text
    if request.finish_reason is not None:
        request.stable_text, request.stable_tokens = text, len(request.token_ids)
        return
    stable = text
    while stable.endswith("\ufffd"):  # an incomplete UTF-8 character (its bytes are still coming)
        stable = stable[:-1]
    stable = stable[:len(stable) - held_back(stable, request.stop_strings)]
    if len(stable) <= len(request.stable_text) or not stable.startswith(request.stable_text):
        return  # stable text only grows
    m = len(request.token_ids)
    if stable != text:  # the tokens whose text is all stable
        while m > request.stable_tokens:
            prefix = visible_text(request, detokenize, m)
            if not prefix.endswith("\ufffd") and stable.startswith(prefix):
                break
            m -= 1
    request.stable_text, request.stable_tokens = stable, m


def settle_text(request: Completion, detokenize: Detokenize | None) -> None:
    """Finished by the caller (cancelled): what was generated is final."""
    if detokenize is not None:
        request.text = visible_text(request, detokenize) if request.stop_string is None else request.text
    request.stable_text, request.stable_tokens = request.text, len(request.token_ids)


__all__ = ["Detokenize", "cut_at_stop_string", "held_back", "settle_text", "update_text", "visible_text"]
