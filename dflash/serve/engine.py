"""The decode driver (docs/design.md §4.4): continuous batching over fixed slots, the only decode loop there is.

    engine = Engine(target_params, target_cfg, drafter, slots=8, max_len=2048, block_size=8)
    rid = engine.submit(prompt_ids, max_new_tokens=128, stop_ids=(2,), seed=0,
                        sampling=SamplingConfig(temperature=0.7, top_p=0.9), stop_strings=("\\n\\n",))
    while engine.busy: engine.step()                  # or engine.run() -> {request id: Completion}
    [done] = decode(target_params, target_cfg, [prompt_ids], 64, max_len=512)   # one-shot: AR (no drafter)

Each step admits queued requests into free slots (each prefilled alone, straight into its slot's pages),
asks the proposer for drafts, and verifies them over all slots; a request that hits a stop token, a stop
string or its budget leaves at once and frees its slot and pages. AR mode is the proposer that proposes
nothing (K = 1). Requests carry their own sampling rule and seed, so neighbours never change an output.
Compiled shapes are logged once each (`compiled_shapes`). Design and measurements: docs/decisions.md D13, D16.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params
from dflash.models.drafter import DFlashDrafter
from dflash.serve.config import SamplingConfig
from dflash.serve.paged import OutOfPagesError, PagePool, PageTable
from dflash.serve.sampling import SamplingRows
from dflash.serve.speculative import (
    Admission,
    Models,
    SpecState,
    bucket,
    empty_state,
    prefill,
    propose,
    span_pages,
    sync_page_table,
    verify,
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Drafts for one step: K - 1 tokens per slot ([B, K-1] int32) given the state and the attention span
    (context slots) of this step. K = `block_size` tokens are verified per step."""

    block_size: int

    def __call__(self, models: Models, state: SpecState, span: int) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class NoDrafts:
    """AR decoding: proposes nothing, so each step verifies the pending token alone (K = 1)."""

    block_size: int = 1

    def __call__(self, models: Models, state: SpecState, span: int) -> jax.Array:
        return jnp.zeros((state.pending.shape[0], 0), jnp.int32)


@dataclasses.dataclass(frozen=True)
class DrafterProposals:
    """DFlash: the drafter's argmax block of K - 1 drafts from one forward (`speculative.propose`)."""

    block_size: int

    def __call__(self, models: Models, state: SpecState, span: int) -> jax.Array:
        return propose(models, state, self.block_size, span)


@dataclasses.dataclass(frozen=True)
class GivenProposals:
    """Drafts from a function of (state, K) -> [B, K-1] (tests: an oracle or a deliberately wrong proposer)."""

    block_size: int
    fn: Callable[[SpecState, int], Any]

    def __call__(self, models: Models, state: SpecState, span: int) -> jax.Array:
        return jnp.asarray(self.fn(state, self.block_size), jnp.int32)


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Completion:
    """A finished (or running) request: its tokens, timings and acceptance statistics.

    accepted: drafts accepted per verify step, counting only what was emitted (a stop token, a stop string or
    the budget can cut a step short), DFlash only; tau: mean tokens per step (accepted + 1, bonus included),
    in [1, K], so sum(accepted + 1) = len(token_ids) - 1 (the first token comes from the prefill);
    accept_per_position[i]: share of steps whose draft i+1 was accepted."""

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
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    stop_string: str | None = None  # the stop string that ended the request, if one did
    submitted_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def tau(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0

    @property
    def accept_per_position(self) -> list[float]:
        acc = np.asarray(self.accepted)
        return [float(np.mean(acc > i)) if acc.size else 0.0 for i in range(self.block_size - 1)]

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


@functools.partial(jax.jit, donate_argnames=("state",))
def _set_active(state: SpecState, active_B: jax.Array) -> SpecState:
    """`state` with these slots active; inactive slots' lengths return to 0 (their pages are released)."""
    target = dataclasses.replace(state.target, lengths=jnp.where(active_B, state.target.lengths, 0))
    return dataclasses.replace(state, target=target, lengths=jnp.where(active_B, state.lengths, 0), active=active_B)


# ----------------------------------------------------------------------------- the engine


class Engine:
    """DFlash (or AR) decoding of many requests over `slots` sequence slots."""

    def __init__(self, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter | None = None, *,
                 slots: int, max_len: int, block_size: int | None = None,
                 draft_fn: Callable[[SpecState, int], Any] | None = None, sampling: SamplingConfig | None = None,
                 page_size: int = 16, num_pages: int | None = None,
                 detokenize: Callable[[Sequence[int]], str] | None = None):
        """block_size: K per step with `drafter` (None: AR mode, the drafter unused); draft_fn: replaces the
        drafter's proposals (tests); sampling: the default rule of requests that bring none (None: greedy);
        page_size / num_pages: the target cache's pages (default: every slot at max_len, plus the null
        page); detokenize: ids -> text, needed for stop strings."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1; received {slots}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; received {page_size}")
        self.proposer: Proposer
        if block_size is None:
            drafter, self.proposer = None, NoDrafts()
        elif drafter is None:
            raise ValueError(f"a drafter is needed for block_size={block_size}; received None (None is for AR "
                             "mode, block_size=None)")
        elif not 2 <= block_size <= drafter.arch.block_size:
            raise ValueError(f"block_size must lie in [2, {drafter.arch.block_size}] (the drafter's training K) or "
                             f"be None for AR mode; received {block_size}")
        else:
            self.proposer = GivenProposals(block_size, draft_fn) if draft_fn else DrafterProposals(block_size)
        self.models = Models.of(target_params, target_cfg, drafter)
        self.arch = None if drafter is None else drafter.arch
        self.k = self.proposer.block_size
        self.slots, self.max_len = slots, max_len
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.detokenize = detokenize
        self.compiled_shapes: set[tuple[Any, ...]] = set()
        self._ids = iter(range(1 << 62))
        self.queue: collections.deque[Completion] = collections.deque()
        self.running: dict[int, Completion] = {}  # slot -> request
        self.done: dict[int, Completion] = {}
        self.steps = 0
        self.page_size = page_size
        self.num_pages = slots * -(-max_len // page_size) + 1 if num_pages is None else num_pages
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the reserved null page); received {num_pages}")
        self._fresh_state()

    @property
    def ar(self) -> bool:
        return self.k == 1

    @functools.cached_property
    def drafter_fingerprint(self) -> str | None:
        """sha256 (16 hex digits) of the drafter's weights and draft vocabulary; None in AR mode. What a client
        that keeps results across runs (`dflash eval`'s records) checks it is still talking to the same drafter."""
        if self.ar:
            return None
        digest = hashlib.sha256()
        named = [(jax.tree_util.keystr(path), leaf)
                 for path, leaf in jax.tree_util.tree_leaves_with_path(self.models.drafter_params)]
        for name, leaf in [*named, ("draft_ids", self.models.draft_ids)]:
            if leaf is None:
                continue
            array = np.asarray(jax.device_get(leaf))
            digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]

    def _fresh_state(self) -> None:
        """Empty slots: all pages free, a zeroed batch state, lengths 0."""
        self.pool = PagePool(self.num_pages, self.page_size)
        self.max_pages = -(-self.max_len // self.page_size)  # page-table entries per slot
        self.table = PageTable(self.pool, self.slots, self.max_pages)
        self.lengths = np.zeros(self.slots, np.int64)  # committed tokens per slot, mirrored on the host
        self.state: SpecState = empty_state(self.models.target_cfg, self.arch, self.slots, self.max_len,
                                            self.num_pages, self.page_size, self.models.target_params["embed"].dtype)
        self._table_version = 0  # the table version on the device

    def reset(self) -> None:
        """Drop every queued, running and unread finished request and start from empty slots (e.g. after a
        failed step, whose donated state may be gone). Compiled programs are kept."""
        self.queue.clear()
        self.running.clear()
        self.done.clear()
        self._fresh_state()

    def _worst_case_tokens(self, request: Completion) -> int:
        """Most tokens the request's slot ever holds: the prompt, its budget, and the last block's K."""
        return len(request.prompt_ids) + request.max_new_tokens + self.k

    def _sync_table(self) -> None:
        self.state, self._table_version = sync_page_table(self.state, self.table, self._table_version)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
               seed: int = 0, *, sampling: SamplingConfig | None = None, stop_strings: Sequence[str] = ()) -> int:
        """Queue a request; returns its id. `sampling` defaults to the engine's rule (its `max_new_tokens`
        and `seed` are not used: the arguments are). Errors name what is wrong with the request."""
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token; received an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; received {max_new_tokens}")
        need = max(bucket(len(prompt_ids)), len(prompt_ids) + max_new_tokens + self.k)
        if need > self.max_len:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) must "
                             f"fit the context ({self.max_len} tokens, {self.k} of them reserved for a block); "
                             f"needs {need}")
        stop_strings = tuple(stop_strings)
        if stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need an engine built with detokenize=...; received none")
        if not all(isinstance(text, str) and text for text in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings; received {stop_strings!r}")
        sampling = self.sampling if sampling is None else sampling
        request = Completion(next(self._ids), [int(t) for t in prompt_ids], max_new_tokens, tuple(stop_ids), seed,
                             None if sampling is None or sampling.greedy else sampling, stop_strings, self.k,
                             submitted_s=time.perf_counter())
        pages = self.pool.pages_for(self._worst_case_tokens(request))
        if pages > self.pool.num_usable:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) needs "
                             f"{pages} pages of {self.pool.page_size} tokens, more than the whole pool "
                             f"({self.pool.num_usable} usable); raise num_pages or lower max_new_tokens")
        self.queue.append(request)
        return request.request_id

    def cancel(self, request_id: int) -> bool:
        """End a queued or running request now (finish_reason "cancelled"), freeing its slot and pages; it
        moves to `done` with the tokens it has. Returns False when the request is not queued or running."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
                self.done[request_id] = request
                return True
        for slot, request in self.running.items():
            if request.request_id == request_id:
                request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
                self._finish(slot)
                return True
        return False

    def _finish(self, slot: int) -> None:
        request = self.running.pop(slot)
        self.done[request.request_id] = request
        self.table.release(slot)  # uploaded before the next jitted step (`_sync_table`)
        self.lengths[slot] = 0

    def _admit(self) -> None:
        """Admit queued requests in order while a slot is free and the pool holds the head's worst case."""
        free = [s for s in range(self.slots) if s not in self.running]
        while self.queue and free:
            slot, request = free[0], self.queue[0]
            try:
                self.table.ensure(slot, self._worst_case_tokens(request))
            except OutOfPagesError:
                return  # stays queued until finished requests release pages
            free.pop(0)
            self.queue.popleft()
            n = len(request.prompt_ids)
            tokens = np.zeros((1, bucket(n)), np.int32)
            tokens[0, :n] = request.prompt_ids
            self._sync_table()
            self._note_shape("prefill", tokens.shape)
            new = Admission(jnp.asarray([slot], jnp.int32), jnp.asarray(tokens), jnp.asarray([n], jnp.int32),
                            jax.random.PRNGKey(request.seed)[None], SamplingRows.of([request.sampling]))
            self.state = prefill(self.models, self.state, new)
            self.lengths[slot] = n
            first = int(self.state.pending[slot])  # waits for the prefill
            request.first_token_s = time.perf_counter()
            self.running[slot] = request
            self._emit(slot, [first])

    def _note_shape(self, program: str, shape: tuple[int, ...]) -> None:
        key = (program, *shape)
        if key not in self.compiled_shapes:
            self.compiled_shapes.add(key)
            log.info("engine: first %s of shape %s (%d compiled shapes so far)", program, shape,
                     len(self.compiled_shapes))

    def _emit(self, slot: int, tokens: Sequence[int]) -> None:
        request = self.running[slot]
        start = len(request.token_ids)
        reason = None
        for token in tokens:
            request.token_ids.append(token)
            if token in request.stop_ids or len(request.token_ids) >= request.max_new_tokens:
                reason = "stop" if token in request.stop_ids else "length"
                break
        if request.stop_strings and self._cut_at_stop_string(request, start):
            reason = "stop"
        if reason is not None:
            request.finish_reason = reason
            request.finished_s = time.perf_counter()
            self._finish(slot)

    def _cut_at_stop_string(self, request: Completion, start: int) -> bool:
        """If the text now holds a stop string, keep the tokens up to the first one whose text completes it
        (searching only from the tokens added at `start`); returns whether one matched."""
        ids = [t for t in request.token_ids if t not in request.stop_ids]
        text = self.detokenize(ids)
        if not any(s in text for s in request.stop_strings):
            return False
        for end in range(start + 1, len(request.token_ids) + 1):
            text = self.detokenize([t for t in request.token_ids[:end] if t not in request.stop_ids])
            hits = [s for s in request.stop_strings if s in text]
            if hits:
                request.stop_string = min(hits, key=text.index)
                del request.token_ids[end:]
                return True
        raise AssertionError("unreachable: the full text holds a stop string")  # pragma: no cover

    def step(self) -> None:
        """Admit what fits, then one propose + verify over every running request."""
        self._admit()
        if not self.running:
            return
        active = np.zeros(self.slots, bool)
        active[list(self.running)] = True
        self.state = _set_active(self.state, jnp.asarray(active))
        # Verify appends K tokens per active slot; admission already reserved them, so this only raises on a
        # bookkeeping bug.
        self.table.ensure_batch(np.where(active, self.lengths + self.k, 0))
        self._sync_table()
        # Attention sees only the pages in use, bucketed to a power of two (a bounded number of shapes).
        pages = span_pages(int(self.lengths[active].max()) + self.k, self.page_size, self.max_pages)
        self._note_shape("verify", (self.slots, self.k, pages))
        drafts = self.proposer(self.models, self.state, pages * self.page_size)
        self.state, out, n = verify(self.models, self.state, drafts, pages)
        out, n = np.asarray(out), np.asarray(n)
        self.lengths = np.where(active, self.lengths + n + 1, self.lengths)
        self.steps += 1
        for slot, request in list(self.running.items()):
            before = len(request.token_ids)
            self._emit(slot, [int(t) for t in out[slot, : n[slot] + 1]])
            if not self.ar:  # what was emitted: a stop or the budget may cut the step short of n + 1 tokens
                request.accepted.append(len(request.token_ids) - before - 1)

    def run(self) -> dict[int, Completion]:
        """Step until every submitted request is done; returns all finished requests by id."""
        while self.busy:
            self.step()
        return self.done


def decode(target_params: Params, target_cfg: DecoderConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           *, max_len: int, drafter: DFlashDrafter | None = None, block_size: int | None = None,
           stop_ids: Sequence[int] = (), sampling: SamplingConfig | None = None, seeds: Sequence[int] | None = None,
           draft_fn: Callable[[SpecState, int], Any] | None = None,
           on_token: Callable[[int], None] | None = None) -> list[Completion]:
    """Decode `prompts` together, one slot each, through the engine: AR without a drafter, else DFlash at
    `block_size` (default: the drafter's training K). Greedy DFlash equals AR token for token; sampled
    DFlash has AR sampling's distribution.

    seeds: one per prompt (default: sampling.seed + index); on_token: called with each new token of a
    single prompt as the engine emits it (streaming)."""
    if not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token lists; received none")
    if on_token is not None and len(prompts) != 1:
        raise ValueError(f"on_token streams one prompt; received {len(prompts)}")
    k = None if drafter is None else (block_size or drafter.arch.block_size)
    seeds = [(sampling.seed if sampling else 0) + i for i in range(len(prompts))] if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds must hold one seed per prompt ({len(prompts)}); received {len(seeds)}")
    engine = Engine(target_params, target_cfg, drafter, slots=len(prompts), max_len=max_len, block_size=k,
                    draft_fn=draft_fn, sampling=sampling)
    for prompt, seed in zip(prompts, seeds, strict=True):
        engine.submit(prompt, max_new_tokens, stop_ids, seed=int(seed))
    requests = list(engine.queue)
    streamed = 0
    while engine.busy:
        engine.step()
        if on_token is not None:
            for token in requests[0].token_ids[streamed:]:
                on_token(token)
            streamed = len(requests[0].token_ids)
    return requests


__all__ = ["Completion", "DrafterProposals", "Engine", "GivenProposals", "NoDrafts", "Proposer", "decode"]
