"""Continuous batching over a fixed number of slots (DESIGN §4.4): requests join and leave between steps.

    engine = Engine(target_params, target_cfg, drafter, slots=8, max_len=2048, block_size=8, page_size=16)
    rid = engine.submit(prompt_ids, max_new_tokens=128, stop_ids=(2,), seed=0,
                        sampling=SamplingConfig(temperature=0.7, top_p=0.9), stop_strings=("\n\n",))
    while engine.busy: engine.step()                  # or engine.run() -> {request id: Completion}

Per-request rules: each request brings its own sampling rule (temperature, top-p, top-k; default: the
engine's) and seed; they live in the batch state as arrays (`serve.sampling.SamplingRows`), so requests
that sample differently share one step, nothing recompiles, and a request's output does not depend on
its neighbours. Stop token ids end a request at the token; stop strings (which need `detokenize`) end it
at the first token whose text completes one: the request keeps the tokens up to and including that token
and frees its slot at once (the text after the stop string, inside that last token, is the caller's to
cut: `Completion.stop_string` names the string that matched).

Compiled shapes: prefill compiles once per power-of-two prompt bucket (minimum 16, at most
log2(max_len / 16) + 1 of them); propose and verify once per (slots, K, span), where the span is the
number of page-table entries attention sees: the pages the longest running request needs, rounded up to
a power of two (at most log2(max_len / page_size) + 1 spans). Without it the reference paged attention
would gather every slot's whole capacity each step, a cost that follows max_len instead of the live
lengths (regeneration at max_len 2048 ran at half the tokens/s of max_len 512). The engine logs each new
shape at INFO the first time it dispatches it (`compiled_shapes` lists them), so a growing count shows.

Every step: queued requests are admitted into free slots, then one propose + verify runs over all slots;
inactive slots are carried along and ignored (their `active` flag is False, so verify leaves them
untouched). A request that hits a stop token or its token budget leaves at once and frees its slot. The
batch state keeps one shape, so propose and verify compile once per (slots, K). `block_size=None` runs AR
mode through the same loop (the target alone: no drafter, one token per step), the baseline the benchmark
and regeneration use.

Target cache: one `serve.paged.PagedKVCache` for all slots, made once here; the host keeps its `PagePool`
and the slots' `PageTable` (ceil(max_len / page_size) pages per slot). Before each jitted step that
appends T tokens, every active slot is made to own pages for L + T tokens (prefill: its prompt; verify:
L + K) and the table is uploaded if it changed (same shape: no recompile). A finished request releases
its slot's pages at once and the slot's length returns to 0; the released slot stays in the batch, its
table row on the null page, so the writes verify makes for it are dropped.

Prefill design: a new request is prefilled alone, straight into its slot: `speculative.prefill` runs the
prompt through a one-row view of the batch cache (that slot's page-table row, the shared page arrays) and
updates only that slot of the batch state. No separate single-sequence state, no copy into the batch,
and the prompt costs one row, not `slots` rows.

Admission on page exhaustion: a request is admitted only when a slot is free AND the pool can give it
pages for its worst case, len(prompt) + max_new_tokens + K tokens, all taken at admission. Otherwise it
stays queued (FIFO: later requests do not overtake it) until finished requests release pages. Because
every running request already owns its worst case, the per-step `ensure` never runs out mid-decode, so
there is no preemption. A request whose worst case exceeds the whole pool is refused by `submit`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import DecoderConfig
from models.drafter import DFlashDrafter
from serve.generate import bucket
from serve.paged import OutOfPagesError, PagePool, PageTable
from serve.sampling import SamplingConfig, SamplingRows
from serve.speculative import SpecState, empty_state, prefill, propose, span_pages, sync_page_table, verify

Params = dict[str, Any]
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Completion:
    """A finished (or running) request: its tokens and acceptance statistics."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    sampling: SamplingConfig | None = None  # None: greedy
    stop_strings: tuple[str, ...] = ()
    token_ids: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_string: str | None = None  # the stop string that ended the request, if one did
    submitted_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def tau(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0


def _stand_in_drafter(target_cfg: DecoderConfig) -> DFlashDrafter:
    """The smallest drafter (one layer, one feature, one kv head of width 2): in AR mode the batch state still
    holds a draft cache, but nothing ever drafts, so its weights never matter."""
    from models.drafter import DrafterConfig, resolve_drafter

    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=1, block_size=2, num_heads=1, num_kv_heads=1,
                                         head_dim=2, intermediate_size=2), target_cfg, mask_token_id=0)
    return DFlashDrafter(arch, nnx.Rngs(0))


@functools.partial(jax.jit, donate_argnames=("state",))
def _set_active(state: SpecState, active_B: jax.Array) -> SpecState:
    """`state` with these slots active; inactive slots' lengths return to 0 (their pages are released)."""
    target = dataclasses.replace(state.target, lengths=jnp.where(active_B, state.target.lengths, 0))
    return dataclasses.replace(state, target=target, lengths=jnp.where(active_B, state.lengths, 0), active=active_B)


class Engine:
    """DFlash (or AR) decoding of many requests over `slots` sequence slots."""

    def __init__(self, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter | None, *, slots: int,
                 max_len: int, block_size: int | None = None, sampling: SamplingConfig | None = None,
                 page_size: int = 16, num_pages: int | None = None,
                 detokenize: Callable[[Sequence[int]], str] | None = None):
        """sampling: the default rule of requests that bring none (None: greedy); page_size: tokens per page
        of the target cache; num_pages: pages in the pool, the null page included (default: every slot at
        max_len, plus the null page); detokenize: ids -> text, needed for stop strings."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1; received {slots}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; received {page_size}")
        if drafter is None:
            if block_size is not None:
                raise ValueError(f"a drafter is needed for block_size={block_size}; received None (None is for AR "
                                 "mode, block_size=None)")
            drafter = _stand_in_drafter(target_cfg)
        arch = drafter.arch
        self.ar = block_size is None
        self.k = 2 if self.ar else block_size
        if not self.ar and not 2 <= self.k <= arch.block_size:
            raise ValueError(f"block_size must lie in [2, {arch.block_size}] (the drafter's training K) or be None "
                             f"for AR mode; received {block_size}")
        self.target_params, self.target_cfg = target_params, target_cfg
        self.graphdef, self.drafter_params = nnx.split(drafter, nnx.Param)
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

    def _fresh_state(self) -> None:
        """Empty slots: all pages free, a zeroed batch state, lengths 0."""
        self.pool = PagePool(self.num_pages, self.page_size)
        self.max_pages = -(-self.max_len // self.page_size)  # page-table entries per slot
        self.table = PageTable(self.pool, self.slots, self.max_pages)
        self.lengths = np.zeros(self.slots, np.int64)  # committed tokens per slot, mirrored on the host
        arch = nnx.merge(self.graphdef, self.drafter_params).arch
        self.state: SpecState = empty_state(self.target_cfg, arch, self.slots, self.max_len, self.num_pages,
                                            self.page_size, self.target_params["embed"].dtype)
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
                             None if sampling is None or sampling.greedy else sampling, stop_strings,
                             submitted_s=time.perf_counter())
        pages = self.pool.pages_for(self._worst_case_tokens(request))
        if pages > self.pool.num_usable:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) needs "
                             f"{pages} pages of {self.pool.page_size} tokens, more than the whole pool "
                             f"({self.pool.num_usable} usable); raise num_pages or lower max_new_tokens")
        self.queue.append(request)
        return request.request_id

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
            self.state = prefill(self.target_params, self.target_cfg, self.graphdef, self.drafter_params, self.state,
                                 jnp.asarray([slot], jnp.int32), jnp.asarray(tokens), jnp.asarray([n], jnp.int32),
                                 jax.random.PRNGKey(request.seed)[None], SamplingRows.of([request.sampling]))
            self.lengths[slot] = n
            request.first_token_s = time.perf_counter()
            self.running[slot] = request
            self._emit(slot, [int(self.state.pending[slot])])

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
            self.done[request.request_id] = self.running.pop(slot)
            self.table.release(slot)  # uploaded before the next jitted step (`_sync_table`)
            self.lengths[slot] = 0

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
        """Admit what fits, then one decoding step over every running request."""
        self._admit()
        if not self.running:
            return
        active = np.zeros(self.slots, bool)
        active[list(self.running)] = True
        self.state = _set_active(self.state, jnp.asarray(active))
        # Verify appends K tokens (1 in AR mode) per active slot; admission already reserved them, so this
        # only raises on a bookkeeping bug.
        self.table.ensure_batch(np.where(active, self.lengths + self.k, 0))
        self._sync_table()
        # Attention sees only the pages in use, bucketed to a power of two (a bounded number of shapes).
        pages = span_pages(int(self.lengths[active].max()) + self.k, self.page_size, self.max_pages)
        self._note_shape("verify", (self.slots, self.k if not self.ar else 1, pages))
        if self.ar:
            drafts = jnp.zeros((self.slots, 0), jnp.int32)
        else:
            drafts = propose(self.target_params, self.target_cfg, self.graphdef, self.drafter_params, self.state,
                             self.k, pages * self.page_size)
        self.state, out, n = verify(self.target_params, self.target_cfg, self.graphdef, self.drafter_params,
                                    self.state, drafts, pages)
        out, n = np.asarray(out), np.asarray(n)
        self.lengths = np.where(active, self.lengths + n + 1, self.lengths)
        self.steps += 1
        for slot in list(self.running):
            if not self.ar:
                self.running[slot].accepted.append(int(n[slot]))
            self._emit(slot, [int(t) for t in out[slot, : n[slot] + 1]])

    def run(self) -> dict[int, Completion]:
        """Step until every submitted request is done; returns all finished requests by id."""
        while self.busy:
            self.step()
        return self.done


__all__ = ["Completion", "Engine"]
