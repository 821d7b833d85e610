"""Incremental detokenisation (serve/text.py, issue 54 item 6): after every step a request's text equals the whole
reply decoded at once (cut at the first stop string), its stable text only grows, and a step detokenises only the
tokens past the settled anchor, so a reply costs O(length), not O(length^2), in tokens decoded. Two decoders: the
SmolLM2 tokenizer (byte-level BPE: characters of several bytes span tokens) and a SentencePiece-style one (a text's
first token loses its leading space; bytes fall back to <0x..> tokens). No model: fast."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders

from dflash.models.registry import default_gguf_path
from dflash.models.tokenizer import load_tokenizer
from dflash.serve.requests import Completion
from dflash.serve.text import CONTEXT, cut_at_stop_string, update_text

TEXT = ("Ünïcödé façade — naïve café: 3 × 4 = 12 ≠ 13; emoji 🎉🚀 and 漢字かな mixed with ASCII words, numbers 1234 "
        "and punctuation!? Then `code()` {braces} [brackets] \n\n new lines\tand tabs. ") * 6


@pytest.fixture(scope="module")
def smollm2():
    tok = load_tokenizer(default_gguf_path())
    return tok.decode, tok.encode(TEXT), tuple(tok.stop_token_ids)


def sentencepiece():
    """A SentencePiece-style vocabulary (Llama 2's decoder): words with a leading ▁, single characters, and byte
    tokens for anything else; returns (decode, ids of TEXT, stop ids)."""
    words = sorted({w for w in TEXT.replace("\n", " ").replace("\t", " ").split(" ") if w})
    pieces = ["<unk>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [f"▁{w}" for w in words if w.isascii()]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    ids = []
    for i, word in enumerate(TEXT.replace("\n", " ").replace("\t", " ").split(" ")):
        if f"▁{word}" in vocab:
            ids.append(vocab[f"▁{word}"])
        else:  # the space, then the word's bytes
            ids += ([vocab["<0x20>"]] if i else []) + [vocab[f"<0x{b:02X}>"] for b in word.encode()]
    ids.append(vocab["</s>"])
    return (lambda t: backend.decode(list(t), skip_special_tokens=False).replace("</s>", "")), ids, (vocab["</s>"],)


def reference(decode, ids, stop_ids, stops) -> str:
    """The whole reply decoded at once, cut before the first stop string (the earliest token that completes one)."""
    for end in range(1, len(ids) + 1):
        text = decode([t for t in ids[:end] if t not in stop_ids])
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)]
    return decode([t for t in ids if t not in stop_ids])


def stream(decode, ids, stop_ids, stops=(), seed=0) -> tuple[Completion, int, int]:
    """Emit `ids` a few tokens per step as the engine does (stop ids and stop strings end the request); after every
    step the text equals the whole decode so far (before a stop string cuts it) and the stable text extends the last
    one and begins the final answer. Returns the request, the tokens detokenised in all, and the tokens one whole
    decode per step would take (the least the previous whole-text rule took)."""
    final = reference(decode, ids, stop_ids, stops)
    decoded = [0]

    def counting(t):
        decoded[0] += len(t)
        return decode(t)

    request = Completion(0, [1], len(ids), stop_ids, 0, stop_strings=tuple(stops))
    steps = np.random.default_rng(seed).integers(1, 5, size=len(ids))
    pos, seen, whole_cost = 0, "", 0
    while request.finish_reason is None:
        start = len(request.token_ids)
        for token in ids[pos: pos + int(steps[pos])]:
            request.token_ids.append(token)
            pos += 1
            if token in stop_ids or pos == len(ids):
                request.finish_reason = "stop" if token in stop_ids else "length"
                break
        if request.stop_strings and cut_at_stop_string(request, start, counting):
            request.finish_reason = "stop"
        update_text(request, counting)
        whole_cost += len(request.token_ids)
        whole = decode([t for t in request.token_ids if t not in stop_ids])
        assert request.text == whole if request.stop_string is None else whole.startswith(request.text)
        assert request.stable_text.startswith(seen) and final.startswith(request.stable_text)
        assert request.text_anchor <= request.stable_tokens
        seen = request.stable_text
    return request, decoded[0], whole_cost


@pytest.mark.parametrize("kind", ["smollm2", "sentencepiece"])
def test_the_text_of_every_step_equals_the_whole_decode(smollm2, kind):
    decode, ids, stop_ids = smollm2 if kind == "smollm2" else sentencepiece()
    if kind == "smollm2":
        ids = ids + [stop_ids[0]]
    whole = decode([t for t in ids if t not in stop_ids])
    assert "🎉" in whole and "漢字" in whole
    for seed in range(3):
        request, decoded, whole_cost = stream(decode, ids, stop_ids, seed=seed)
        assert request.text == request.stable_text == whole and request.finish_reason == "stop"
        if kind == "smollm2":  # linear: each step decodes its tail and a few tokens of context
            assert decoded < (2 * CONTEXT + 12) * len(ids), decoded
        else:  # a run of byte tokens that ends inside a character decodes to U+FFFD as a whole: the whole text then
            assert decoded < whole_cost / 3, (decoded, whole_cost)
    # stop strings: spanning tokens and multi-byte characters, matched late, twice, or never
    for stops in [("🚀 and",), ("façade — n",), ("tabs. Ün", "zzz"), ("(never)",), ("12 ≠", "3 × 4")]:
        request, _, _ = stream(decode, ids, stop_ids, stops)
        assert request.text == request.stable_text == reference(decode, ids, stop_ids, stops), stops


def test_decoding_cost_is_linear_in_the_reply_where_it_was_quadratic(smollm2):
    """The tokens detokenised over a reply grow linearly with its length: 4x the reply, about 4x the work (the
    whole-text decode of every step grew 16x)."""
    decode, ids, stop_ids = smollm2
    runs = [stream(decode, part, stop_ids, ("(never)",)) for part in (ids, ids * 4)]
    assert runs[1][1] < 5 * runs[0][1], [cost for _, cost, _ in runs]
    assert runs[1][2] > 14 * runs[0][2]  # one whole decode per step
    assert runs[1][0].text == decode(ids * 4)
