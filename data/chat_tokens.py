"""Conversation -> training token ids with an assistant-only loss mask (docs/design.md §4.2), for any chat template.

`tokenize_conversation` holds the contract (which tokens are in the loss); `tokenize_rows` makes the padded
rows that both training modes read. Template caveats (Qwen3's reasoning, thinking on or off):
docs/decisions.md D15; gpt-oss's harmony conversations make one row per assistant turn (D85).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dflash.data import harmony
from dflash.models.tokenizer import ChatTokenizer

ASSISTANT = "assistant"


def tokenize_conversation(
    tok: ChatTokenizer, messages: Sequence[Mapping[str, Any]], max_len: int, *, last_turn_only: bool = False,
    **template_kwargs: Any
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[n], loss_mask float32[n]) with n <= max_len.

    - `ids` = `tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs))`,
      cut to the first `max_len` tokens. `template_kwargs` (e.g. `enable_thinking=False` for Qwen3) go to
      every rendering, the full one and the prefixes alike; match what the target was served (and
      regenerated) with.
    - `loss_mask[p] = 1` exactly on the tokens the model writes in each assistant turn: the message content
      (plus anything the template writes between the assistant header and the content, e.g. an empty
      `<think></think>`) and the turn's end-of-turn token (ChatML `<|im_end|>`, Llama 3 `<|eot_id|>`).
    - `loss_mask[p] = 0` on system and user turns (SmolLM2's template inserts a default system prompt when
      none is given: it is masked 0 like any system turn), on role headers (`<|im_start|>assistant\\n`)
      and on template text after the end-of-turn token (ChatML's trailing `\\n`).

    How, generically: for assistant message i, the turn starts after the tokens of
    `render(messages[:i], add_generation_prompt=True)` (the prompt ending in the assistant header) and ends
    with the tokens of `render(messages[:i + 1], add_generation_prompt=False)`. Within that span the mask
    runs up to and including the LAST stop token (`tok.stop_token_ids`); a span without one is masked
    whole. Every rendered prefix must be a text prefix of the full rendering and must tokenize to a token
    prefix of its ids; templates that rewrite earlier turns (e.g. strip past reasoning) raise a ValueError.

    `last_turn_only`: the mask covers the LAST assistant message only; earlier ones are history (loss 0) and only
    the last is checked for prefixes, so a template that rewrites earlier turns is fine (harmony's rows, D85).
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0; received {max_len}")
    if not messages:
        raise ValueError("messages must hold at least one message; received an empty conversation")
    for index, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(f"messages[{index}] must have 'role' and 'content'; received keys {sorted(message)}")

    full_text = tok.apply_chat_template(messages, add_generation_prompt=False, **template_kwargs)
    ids = tok.encode(full_text, add_special_tokens=False)
    mask = np.zeros(len(ids), np.float32)
    stop_ids = set(tok.stop_token_ids)
    previous_end = 0
    turns = [i for i, m in enumerate(messages) if m["role"] == ASSISTANT]
    for index in turns[-1:] if last_turn_only else turns:
        start = _prefix_length(tok, messages[:index], True, full_text, ids, template_kwargs)
        end = _prefix_length(tok, messages[: index + 1], False, full_text, ids, template_kwargs)
        if not previous_end <= start <= end:
            raise ValueError(
                f"assistant message {index} must render after the previous turn; its tokens span [{start}, "
                f"{end}) after a turn ending at {previous_end} with {_template_name(tok)}"
            )
        stops = [p for p in range(start, end) if ids[p] in stop_ids]
        mask[start : (stops[-1] + 1 if stops else end)] = 1.0
        previous_end = end
    ids_n = np.asarray(ids[:max_len], np.int32)
    return ids_n, mask[:max_len]


def tokenize_rows(
    tok: ChatTokenizer,
    conversations: Iterable[Sequence[Mapping[str, Any]]],
    seq_len: int,
    *,
    pad_id: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], int]:
    """(rows, num_skipped): each conversation tokenized, truncated to `seq_len` and padded to it, as
    (tokens int32[S], loss_mask float32[S], n real tokens). The one tokenisation of training rows: online
    batches (`data.online`) and offline capture (`data.capture`) both use it.

    A conversation whose loss mask is all zero after truncation (no assistant token left) is skipped and
    counted in `num_skipped`. A harmony (gpt-oss) conversation makes one row per assistant turn
    (`harmony_rows`), each the prompt that turn was answered from, its history rewritten as harmony says, then the
    reply, masked; `num_skipped` counts rows. `pad_id` defaults to the first stop token (ChatML `<|im_end|>`);
    padding has loss mask 0, so its id only matters to what the target sees after the text. `template_kwargs` are the
    chat-template variables the prompts are served with (`data.regen.template_kwargs`, e.g. Qwen3's
    `enable_thinking=False`, whose empty think block is then prompt, not loss).
    """
    if pad_id is None:
        if not tok.stop_token_ids:
            raise ValueError("pad_id must be given for a tokenizer without stop tokens; received None")
        pad_id = tok.stop_token_ids[0]
    rows: list[tuple[np.ndarray, np.ndarray, int]] = []
    num_skipped = 0
    kwargs = dict(template_kwargs or {})
    is_harmony = harmony.is_harmony(tok)
    for messages in conversations:
        for row in harmony_rows(messages) if is_harmony else [messages]:
            ids, mask = tokenize_conversation(tok, row, seq_len, last_turn_only=is_harmony, **kwargs)
            if not mask.any():
                num_skipped += 1
                continue
            rows.append(pad_batch_example(ids, mask, seq_len, pad_id))
    return rows, num_skipped


def harmony_rows(messages: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """A harmony conversation's rows, one per assistant turn: the messages up to and including that turn, earlier
    turns as the next prompt holds them (`harmony.history`: their analysis dropped), so that each row is exactly the
    prompt the target answered that turn from, then its reply (analysis and final, as generated)."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == ASSISTANT]
    return [[*harmony.history(messages[:i]), dict(messages[i])] for i in turns] or [list(messages)]


def pad_batch_example(
    ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens int32[seq_len], loss_mask float32[seq_len], valid): `ids`/`mask` then `pad_id`/0 padding.

    `valid` = len(ids), the number of real tokens. Truncate first (`tokenize_conversation(max_len=...)`).
    """
    if len(ids) != len(mask):
        raise ValueError(f"ids and mask must have the same length; received {len(ids)} and {len(mask)}")
    if len(ids) > seq_len:
        raise ValueError(
            f"ids must fit in seq_len={seq_len}; received {len(ids)} tokens (tokenize with max_len=seq_len)"
        )
    valid = len(ids)
    tokens_S = np.full(seq_len, pad_id, np.int32)
    tokens_S[:valid] = ids
    loss_mask_S = np.zeros(seq_len, np.float32)
    loss_mask_S[:valid] = mask
    return tokens_S, loss_mask_S, valid


def _prefix_length(
    tok: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    full_text: str,
    full_ids: Sequence[int],
    template_kwargs: Mapping[str, Any],
) -> int:
    """Number of tokens of the rendered `messages`, checked to be a text and token prefix of the full chat."""
    if messages or add_generation_prompt:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
    else:
        text = ""  # no messages, no header: templates may not render an empty list
    if not full_text.startswith(text):
        raise ValueError(
            f"the chat template must render each conversation prefix as a text prefix of the whole "
            f"conversation; the first {len(messages)} messages (add_generation_prompt={add_generation_prompt}) "
            f"do not with {_template_name(tok)}; assistant-only masks need a prefix-stable template"
        )
    ids = tok.encode(text, add_special_tokens=False)
    if list(full_ids[: len(ids)]) != ids:
        raise ValueError(
            f"the rendered prefix of {len(messages)} messages (add_generation_prompt={add_generation_prompt}) "
            f"must tokenize as a token prefix of the whole conversation; it does not with {_template_name(tok)} "
            "(a token merges across the turn boundary)"
        )
    return len(ids)


def _template_name(tok: ChatTokenizer) -> str:
    template = tok.chat_template or ""
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()[:12]
    return f"the chat template sha256:{digest} starting {template[:60]!r}"
