"""A request's text as it grows (docs/serving.md): `text`, the visible tokens' text cut before the earliest stop
string, and `stable_text`, its prefix that can no longer change (no incomplete UTF-8 character, no suffix that
could still grow into a stop string), so that a stream of `stable_text` deltas equals the final text.

Incremental (issue 54 item 6): the text of a request's first `text_anchor` tokens is kept (`anchor_text`, a part
of its stable text), and each step detokenises only the tokens after the anchor, with up to `CONTEXT` tokens before
it as context: text = anchor_text + (decode(context + tail) minus decode(context)), where the context's text ends
the anchor's and starts the window's. The context makes decoders that treat a text's first token apart
(SentencePiece's leading space) or join bytes across tokens (byte-level BPE, byte fallback) give what the whole
text's decode gives, so a step costs O(tail), not O(text). Where no context fits (a decoder that is not local),
the whole text is decoded instead. The anchor moves to
`stable_tokens` after each step: tokens whose text is settled. `visible_text` is the whole-text reference.

Each function takes the request (`requests.Completion`) and the engine's `detokenize` (ids -> text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dflash.serve.requests import Completion

Detokenize = Callable[[Sequence[int]], str]
CONTEXT = 4  # tokens before the anchor decoded with the tail (a multi-byte character spans at most 4 tokens)


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
    """The text of the request's first `end` tokens (all by default), stop tokens left out, decoded whole (the
    reference `text_of` equals)."""
    ids = request.token_ids if end is None else request.token_ids[:end]
    return detokenize([t for t in ids if t not in request.stop_ids])


def text_of(request: Completion, detokenize: Detokenize, end: int | None = None) -> str:
    """`visible_text(request, detokenize, end)` at the cost of the tokens past the anchor (`end` >= `text_anchor`):
    the anchor's text plus the window's, decoded after up to `CONTEXT` tokens of context. A context is used only if
    its text is the end of the anchor's text and the start of the window's (a context that begins inside a
    character decodes to U+FFFD, and some decoders replace a whole run of bytes around one); a shorter one is tried
    next, and the whole text is decoded when none fits."""
    end = len(request.token_ids) if end is None else end
    anchor = request.text_anchor
    assert end >= anchor, f"end must be >= the text anchor {anchor}; received {end}"
    if anchor == 0:
        return visible_text(request, detokenize, end)
    tail = [t for t in request.token_ids[anchor:end] if t not in request.stop_ids]
    for start in range(max(0, anchor - CONTEXT), anchor):
        context = [t for t in request.token_ids[start:anchor] if t not in request.stop_ids]
        head = detokenize(context)
        if head and request.anchor_text.endswith(head):
            window = detokenize(context + tail)
            if window.startswith(head):
                return request.anchor_text + window[len(head):]
    return visible_text(request, detokenize, end)  # no context fits: the whole text


def cut_at_stop_string(request: Completion, start: int, detokenize: Detokenize) -> bool:
    """If the text now holds a stop string, keep the tokens up to the first one whose text completes it (searching
    only from the tokens added at `start`); returns whether one matched. A match ends past the anchor's text (the
    text before this step held none), so only the text from there back by the longest stop string is searched."""
    text = text_of(request, detokenize)
    since = max(0, len(request.anchor_text) - max(len(s) for s in request.stop_strings) + 1)
    if not any(s in text[since:] for s in request.stop_strings):
        return False
    for end in range(max(start, request.text_anchor) + 1, len(request.token_ids) + 1):
        text = text_of(request, detokenize, end)
        hits = [s for s in request.stop_strings if s in text[since:]]
        if hits:
            request.stop_string = min(hits, key=text.index)
            del request.token_ids[end:]
            del request.token_logprobs[end:]
            del request.top_logprobs[end:]
            return True
    raise AssertionError("unreachable: the full text holds a stop string")  # pragma: no cover


def update_text(request: Completion, detokenize: Detokenize | None) -> None:
    """`text` and `stable_text` (see `Completion`) after new tokens; the text is cut at a stop string; the anchor
    moves to the tokens whose text is now stable."""
    if detokenize is None:
        request.stable_tokens = len(request.token_ids)
        return
    text = text_of(request, detokenize)
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
    m, prefix = len(request.token_ids), text
    if stable != text:  # the tokens whose text is all stable
        while m > request.stable_tokens:
            prefix = text_of(request, detokenize, m)
            if not prefix.endswith("\ufffd") and stable.startswith(prefix):
                break
            m -= 1
        else:
            prefix = None
    request.stable_text, request.stable_tokens = stable, m
    if prefix is not None and m > request.text_anchor:  # settled: later steps decode after it
        request.text_anchor, request.anchor_text = m, prefix


def settle_text(request: Completion, detokenize: Detokenize | None) -> None:
    """Finished by the caller (cancelled): what was generated is final."""
    if detokenize is not None:
        request.text = text_of(request, detokenize) if request.stop_string is None else request.text
    request.stable_text, request.stable_tokens = request.text, len(request.token_ids)


__all__ = ["CONTEXT", "Detokenize", "cut_at_stop_string", "held_back", "settle_text", "text_of", "update_text",
           "visible_text"]
