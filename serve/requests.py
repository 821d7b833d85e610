"""Requests to the engine: what one is (`Completion`: its tokens, text, timings, acceptance), the rules a request
must meet before it runs (`RequestRules.check`, refusing with `RequestRejected` naming the field), and the
sampling key of its seed (`request_keys`).

Isolation: `check` refuses anything the device could not take (token ids outside [0, vocab), int32 overflows, a
prompt + budget over the context `max_len` or the page pool); it reads only the engine's fixed settings, so it is
safe from any thread (the HTTP handlers call it before queueing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dflash.serve.config import SamplingConfig

INT32_MAX = (1 << 31) - 1
SEED_LIMIT = 1 << 63
MAX_TOP_LOGPROBS = 20  # alternatives computed per token when log-probabilities are asked (OpenAI's maximum)


class RequestRejected(ValueError):
    """A request the engine refuses before it runs: `field` names the request's field in engine terms
    ("prompt_ids", "max_new_tokens", "seed", "sampling.top_k", "logprobs", "stop_strings", ...); the message
    names the value and the rule."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def request_keys(seeds: Sequence[int]) -> np.ndarray:
    """The sampling keys [R, 2] uint32 of requests seeded `seeds` (each in [0, 2**63)): JAX's threefry key of the
    64-bit seed, (seed >> 32, seed & 0xFFFFFFFF), built on the host. `jax.random.PRNGKey(seed)` would keep only
    the low 32 bits (without jax_enable_x64), so that seeds 9 and 2**32 + 9 sampled alike, and an engine step
    would dispatch one op per request and compile a stack of R keys per row count (20 s for R = 4096)."""
    return np.asarray([((seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF) for seed in seeds], np.uint32).reshape(-1, 2)


@dataclasses.dataclass
class Completion:
    """A finished (or running) request: its tokens, timings and acceptance statistics.

    accepted: drafts accepted per verify step, counting only what was emitted (a stop token, a stop string or
    the budget can cut a step short), DFlash only; tau: mean tokens per step (accepted + 1, bonus included),
    in [1, K], so sum(accepted + 1) = len(token_ids) - 1 (the first token comes from the prefill);
    accept_per_position[i]: share of steps whose draft i+1 was accepted.

    With `top_n` (the request's `logprobs`): token_logprobs[i] is the target's log-probability of token_ids[i]
    and top_logprobs[i] its `top_n` most likely (id, log-probability), most likely first. With `prompt_top_n`:
    the same for every prompt token (prompt_logprobs[0] None, prompt_top_logprobs[0] []). text: the visible
    tokens' text, cut before the earliest stop string; stable_text: its prefix that can no longer change, of
    the first `stable_tokens` tokens (all of them, and the whole text, once finished; `serve.text`); anchor_text:
    the text of the first `text_anchor` tokens, settled, which later steps do not detokenise again (`serve.text`).
    error: why the request failed alone (finish_reason "error")."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    sampling: SamplingConfig | None = None  # None: greedy
    stop_strings: tuple[str, ...] = ()
    block_size: int = 1
    token_ids: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    stop_string: str | None = None  # the stop string that ended the request, if one did
    submitted_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None
    top_n: int | None = None  # log-probabilities asked per generated token (None: none)
    prompt_top_n: int | None = None  # the same per prompt token
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    text: str = ""
    stable_text: str = ""
    stable_tokens: int = 0
    text_anchor: int = 0
    anchor_text: str = ""
    error: str | None = None

    @property
    def tau(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        acc = np.asarray(self.accepted)
        return [float(np.mean(acc > i)) if acc.size else 0.0 for i in range(self.block_size - 1)]

    @property
    def scored(self) -> bool:
        """Whether the request asks for log-probabilities (prefilled alone; its steps score every token)."""
        return self.top_n is not None or self.prompt_top_n is not None

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"

    @property
    def prefill_s(self) -> float:
        return (self.first_token_s or self.submitted_s) - self.submitted_s

    @property
    def decode_s(self) -> float:
        return (self.finished_s or self.first_token_s or 0.0) - (self.first_token_s or 0.0)

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


def _reject_unless(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise RequestRejected(field, message)


def is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RequestRules:
    """What an engine can take, fixed when it is built: the vocabulary, the context per slot (max_len), the tokens a
    step writes past the committed ones (width, reserved at the end of the context), K (a request's block size),
    the page pool (page_size, usable pages), the default sampling rule and whether text (stop strings) is
    available."""

    vocab: int
    max_len: int
    width: int
    block_size: int
    page_size: int
    usable_pages: int
    sampling: SamplingConfig | None
    text: bool

    def worst_case_tokens(self, request: Completion) -> int:
        """Most tokens the request's slot ever holds: the prompt, its budget, and the last step's width."""
        return len(request.prompt_ids) + request.max_new_tokens + self.width

    def check(self, request_id: int, prompt_ids: Sequence[int], max_new_tokens: int | None,
              stop_ids: Sequence[int] = (), seed: int = 0, *, sampling: SamplingConfig | None = None,
              stop_strings: Sequence[str] = (), logprobs: int | None = None,
              prompt_logprobs: int | None = None) -> Completion:
        """The request, validated (not queued). Raises `RequestRejected` naming the field, the value and the
        rule."""
        prompt_ids = list(prompt_ids) if isinstance(prompt_ids, Sequence | np.ndarray) else prompt_ids
        _reject_unless(isinstance(prompt_ids, list) and len(prompt_ids) > 0, "prompt_ids",
                       f"prompt_ids must hold at least one token id; received {prompt_ids!r}")
        vocab = self.vocab
        for i, token in enumerate(prompt_ids):
            _reject_unless(is_int(token) and 0 <= token < vocab, "prompt_ids",
                           f"prompt_ids[{i}] must be a token id in [0, {vocab}) (the model's vocabulary); "
                           f"received {token!r}")
        for i, token in enumerate(stop_ids):
            _reject_unless(is_int(token) and 0 <= token < vocab, "stop_ids",
                           f"stop_ids[{i}] must be a token id in [0, {vocab}); received {token!r}")
        _reject_unless(is_int(seed) and 0 <= seed < SEED_LIMIT, "seed",
                       f"seed must be an integer in [0, 2**63); received {seed!r}")
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            _reject_unless(n is None or (is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS), name,
                           f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}]; received {n!r}")
        sampling = self.sampling if sampling is None else sampling
        if sampling is not None:
            _reject_unless(is_int(sampling.top_k) and 0 <= sampling.top_k <= INT32_MAX, "sampling.top_k",
                           f"sampling.top_k must be an integer in [0, {INT32_MAX}]; received {sampling.top_k!r}")
        stop_strings = tuple(stop_strings)
        _reject_unless(all(isinstance(text, str) and text for text in stop_strings), "stop_strings",
                       f"stop_strings must be non-empty strings; received {stop_strings!r}")
        if stop_strings and not self.text:
            raise RequestRejected("stop_strings", "stop_strings need an engine built with detokenize=...; "
                                  "received none")
        n = len(prompt_ids)
        room = self.max_len - n - self.width  # new tokens the context leaves (the last step's width reserved)
        if max_new_tokens is None:
            _reject_unless(room >= 1, "prompt_ids",
                           f"the prompt ({n} tokens) must leave room to generate in the context length max_len "
                           f"({self.max_len} tokens); received a prompt of {n} tokens, at most "
                           f"{self.max_len - self.width - 1} fit")
            max_new_tokens = room
        else:
            _reject_unless(is_int(max_new_tokens) and max_new_tokens >= 1, "max_new_tokens",
                           f"max_new_tokens must be an integer >= 1 or None; received {max_new_tokens!r}")
            _reject_unless(max_new_tokens <= room, "max_new_tokens",
                           f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) must fit the context "
                           f"length max_len ({self.max_len} tokens); at most {max(room, 0)} new tokens fit after "
                           "this prompt")
        request = Completion(request_id, [int(t) for t in prompt_ids], int(max_new_tokens),
                             tuple(int(t) for t in stop_ids), int(seed),
                             None if sampling is None or sampling.greedy else sampling, stop_strings, self.block_size,
                             submitted_s=time.perf_counter(), top_n=logprobs, prompt_top_n=prompt_logprobs)
        pages = -(-self.worst_case_tokens(request) // self.page_size)
        _reject_unless(pages <= self.usable_pages, "max_new_tokens",
                       f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) needs {pages} pages of "
                       f"{self.page_size} tokens, more than the whole pool ({self.usable_pages} usable); "
                       "lower max_new_tokens")
        return request


__all__ = ["INT32_MAX", "MAX_TOP_LOGPROBS", "SEED_LIMIT", "Completion", "RequestRejected", "RequestRules",
           "is_int", "request_keys"]
