"""A request's text kept up to date step by step: whole-text re-detokenisation (before) against the incremental
rule of `serve.text` (after, issue 54 item 6), side by side in one run.

    .venv/bin/python benchmarks/detokenize.py [--tokens 4096] [--rounds 3] [--write]

The reply: the SmolLM2 target's own regenerated answers (`data/assets/regenerated/smollm2-mix.jsonl.xz`) joined and
tokenised by its tokenizer, cut to `--tokens` tokens. It is emitted the way the engine emits it, a step of 1-4
tokens at a time (tau ~ 2.5; the same steps for both rules), calling `cut_at_stop_string` (with stop strings) and
`update_text` after each step, with no stop string, and with two that never match (the request still searches for
them every step). Per rule and case: milliseconds for the whole reply, and per step over its last 256 tokens (what a
step costs at the end of a 4K-token reply), the best of `--rounds` rounds, the rules alternating within each round.
Both rules must end with the same text. `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import machine, write_section  # noqa: E402
from dflash.models.registry import default_gguf_path  # noqa: E402
from dflash.models.tokenizer import load_tokenizer  # noqa: E402
from dflash.serve import text as after  # noqa: E402
from dflash.serve.requests import Completion  # noqa: E402

REPLIES = ROOT / "data" / "assets" / "regenerated" / "smollm2-mix.jsonl.xz"


class Before:
    """The rule before (serve/text.py at caced32): every step decodes the whole text, and the stable-token search
    decodes whole prefixes."""

    @staticmethod
    def visible_text(request: Completion, detokenize, end: int | None = None) -> str:
        ids = request.token_ids if end is None else request.token_ids[:end]
        return detokenize([t for t in ids if t not in request.stop_ids])

    @classmethod
    def cut_at_stop_string(cls, request: Completion, start: int, detokenize) -> bool:
        text = cls.visible_text(request, detokenize)
        if not any(s in text for s in request.stop_strings):
            return False
        for end in range(start + 1, len(request.token_ids) + 1):  # pragma: no cover - the stops never match here
            text = cls.visible_text(request, detokenize, end)
            hits = [s for s in request.stop_strings if s in text]
            if hits:
                request.stop_string = min(hits, key=text.index)
                del request.token_ids[end:]
                return True
        raise AssertionError("unreachable")

    @classmethod
    def update_text(cls, request: Completion, detokenize) -> None:
        text = cls.visible_text(request, detokenize)
        if request.stop_string is not None:
            text = text[:min(text.index(s) for s in request.stop_strings if s in text)]
        request.text = text
        if request.finish_reason is not None:
            request.stable_text, request.stable_tokens = text, len(request.token_ids)
            return
        stable = text
        while stable.endswith("\ufffd"):
            stable = stable[:-1]
        stable = stable[:len(stable) - after.held_back(stable, request.stop_strings)]
        if len(stable) <= len(request.stable_text) or not stable.startswith(request.stable_text):
            return
        m = len(request.token_ids)
        if stable != text:
            while m > request.stable_tokens:
                prefix = cls.visible_text(request, detokenize, m)
                if not prefix.endswith("\ufffd") and stable.startswith(prefix):
                    break
                m -= 1
        request.stable_text, request.stable_tokens = stable, m


def reply_tokens(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    with lzma.open(REPLIES, "rt") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                if message["role"] == "assistant":
                    ids += tokenizer.encode(message["content"] + "\n\n")
            if len(ids) >= n:
                return ids[:n]
    raise ValueError(f"--tokens must be at most the {len(ids)} tokens of {REPLIES.name}; received {n}")


def run(rule, ids: Sequence[int], steps: np.ndarray, stops: tuple[str, ...], detokenize) -> tuple[float, float, str]:
    """(seconds for the whole reply, seconds per step over its last 256 tokens, final text)."""
    request = Completion(0, [1], len(ids), (), 0, stop_strings=stops)
    pos, tail_s, tail_steps = 0, 0.0, 0
    t0 = time.perf_counter()
    while pos < len(ids):
        s0 = time.perf_counter()
        start = len(request.token_ids)
        request.token_ids += ids[pos: pos + int(steps[pos])]
        pos = len(request.token_ids)
        if pos == len(ids):
            request.finish_reason = "length"
        if stops:
            rule.cut_at_stop_string(request, start, detokenize)
        rule.update_text(request, detokenize)
        if pos > len(ids) - 256:
            tail_s += time.perf_counter() - s0
            tail_steps += 1
    return time.perf_counter() - t0, tail_s / tail_steps, request.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="reply length in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (best of)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    tokenizer = load_tokenizer(default_gguf_path())
    ids = reply_tokens(tokenizer, args.tokens)
    steps = np.random.default_rng(0).integers(1, 5, size=len(ids))
    cases = {"no stop strings": (), "two stop strings (never matched)": ("<|im_end|>x", "\n\nUser:")}
    rows = []
    for case, stops in cases.items():
        best = {"before": (np.inf, np.inf), "after": (np.inf, np.inf)}
        texts = {}
        for r in range(args.rounds):
            for name, rule in (("before", Before), ("after", after)) if r % 2 == 0 else (("after", after),
                                                                                          ("before", Before)):
                whole, per_step, texts[name] = run(rule, ids, steps, stops, tokenizer.decode)
                best[name] = (min(best[name][0], whole), min(best[name][1], per_step))
                print(f"{case}, round {r + 1}: {name} {whole * 1e3:.0f} ms", flush=True)
        assert texts["before"] == texts["after"] == tokenizer.decode(ids), "the rules must end with the same text"
        rows.append((case, best))
    lines = ["| case | before: ms per reply | after: ms per reply | speed-up | before: ms per step at the end | "
             "after: ms per step at the end |", "|---|---|---|---|---|---|"]
    for case, best in rows:
        b, a = best["before"], best["after"]
        lines.append(f"| {case} | {b[0] * 1e3:.0f} | {a[0] * 1e3:.0f} | {b[0] / a[0]:.1f}x | {b[1] * 1e3:.2f} | "
                     f"{a[1] * 1e3:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        command = "benchmarks/detokenize.py" + (f" --tokens {args.tokens}" if args.tokens != 4096 else "") + \
            (f" --rounds {args.rounds}" if args.rounds != 3 else "") + " --write"
        body = (f"## Detokenising a reply as it grows: whole text against incremental\n\n"
                f"`.venv/bin/python {command}` on {machine()}, {time.perf_counter() - t_start:.0f} s, load average "
                f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. One {len(ids)}-token reply "
                "of the SmolLM2 target (its regenerated answers, its tokenizer), emitted 1-4 tokens a step (the "
                "same steps for both rules); each step updates the request's text and stable text (and searches "
                "the stop strings). Before: every step decodes the whole text (the rule at caced32); after: "
                "`serve.text` decodes the tokens past the settled anchor with 4 tokens of context. Best of "
                f"{args.rounds} rounds, the rules alternating; both end with the same text.\n\n{table}\n")
        print(f"wrote {write_section('Detokenising a reply as it grows', body)}")


if __name__ == "__main__":
    main()
