"""A regeneration without a model, for the tests of what it writes (tests/test_data_writes.py; not a test module).

`FakeTokenizer` renders a chat as text and encodes it one id per character; `InstantBackend` answers every turn at
once with a reply that depends only on the prompt and the turn's seed (as the engine's: not on its batch, its
order or a resume), `delay_s` after it was submitted. Run as a script, `python tests/regen_worker.py OUT N
[DELAY_S [RECORDS_PER_CHUNK [SIGTERM_AFTER]]]` regenerates N items into OUT (one process), which the kill -9 test
stops mid-run; with SIGTERM_AFTER the backend sends its own process SIGTERM once it has answered that many turns
(a preemption notice arriving mid-chunk), and the script prints STOPPED and exits 42 when regeneration stops on it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class _Vocab:
    def token_to_id(self, name: str) -> None:
        return None  # no harmony tokens: not a gpt-oss tokenizer


class FakeTokenizer:
    stop_token_ids = (0,)
    chat_template = "fake"
    backend = _Vocab()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                             else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 1000 + 1 for c in text]

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + i % 26) for i in ids)

    def fingerprint(self) -> str:
        return "fake-tokenizer"


class InstantBackend:
    """Answers each turn `delay_s` after it was submitted: a reply of 3-12 characters from the prompt and the seed."""

    def __init__(self, capacity: int = 8, delay_s: float = 0.0, sigterm_after: int = 0):
        self.capacity, self.delay_s, self.sigterm_after = capacity, delay_s, sigterm_after
        self.pending: list[tuple[float, int, str]] = []
        self._next = 0
        self.answered = 0

    def submit(self, messages: list[dict[str, str]], prompt_ids: list[int], seed: int, turn: int) -> int:
        handle = self._next
        self._next += 1
        text = "".join(chr(97 + (seed >> (2 * i)) % 26) for i in range(3 + seed % 10)) + f" ({len(prompt_ids)})"
        self.pending.append((time.monotonic() + self.delay_s, handle, text))
        return handle

    def poll(self) -> list[tuple[int, Any]]:
        from dflash.data.regenerate import Reply

        if not self.pending:
            return []
        first = min(due for due, _, _ in self.pending)
        time.sleep(max(0.0, first - time.monotonic()))
        now = time.monotonic()
        ready = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        before, self.answered = self.answered, self.answered + len(ready)
        if before < self.sigterm_after <= self.answered:
            os.kill(os.getpid(), signal.SIGTERM)
        return [(handle, Reply(text, len(text) + 1, "stop")) for _, handle, text in ready]


def items(n: int) -> list[dict[str, Any]]:
    """n conversations: one or two user turns, and an invalid one (an empty user turn) every 50th."""
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"question {i}"}]
        if i % 3 == 0:
            turns += [{"role": "assistant", "content": "old"}, {"role": "user", "content": f"and then {i}?"}]
        if i % 50 == 49:
            turns = [{"role": "user", "content": "  "}]
        out.append({"id": f"set:{i:05d}", "source": "set", "messages": turns})
    return out


def main(argv: list[str]) -> None:
    from dflash.data.config import RegenConfig
    from dflash.data.files import FlushPolicy
    from dflash.data.regenerate import RegenerationStopped, regenerate

    out, n = Path(argv[0]), int(argv[1])
    delay = float(argv[2]) if len(argv) > 2 else 0.0
    policy = FlushPolicy(records=int(argv[3])) if len(argv) > 3 else None
    backend = InstantBackend(delay_s=delay, sigterm_after=int(argv[4]) if len(argv) > 4 else 0)
    try:
        regenerate(backend, FakeTokenizer(), items(n), out, RegenConfig(seed=5), progress=False, policy=policy)
    except RegenerationStopped:
        print("STOPPED", flush=True)
        sys.exit(42)
    print("OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
