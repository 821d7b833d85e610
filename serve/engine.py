"""Continuous batching over a fixed number of slots (DESIGN §4.4): requests join and leave between steps.

    engine = Engine(target_params, target_cfg, drafter, slots=8, max_len=2048, block_size=8)
    rid = engine.submit(prompt_ids, max_new_tokens=128, stop_ids=(2,), seed=0)
    while engine.busy: engine.step()                  # or engine.run() -> {request id: Completion}

Every step: queued requests are admitted into free slots (each prefilled alone, then written into its slot
of the batch state), then one propose + verify runs over all slots; inactive slots are carried along and
ignored (their `active` flag is False, so verify leaves them untouched). A request that hits a stop token
or its token budget leaves at once and frees its slot. The batch state keeps one shape, so propose and
verify compile once per (slots, K). `block_size=None` runs AR mode through the same loop (the target
alone: no drafter, one token per step), the baseline the benchmark and regeneration use.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import DecoderConfig
from models.decoder import DenseKVCache, check_capacity
from models.drafter import DFlashDrafter
from serve.generate import bucket
from serve.sampling import SamplingConfig
from serve.speculative import DraftCache, SpecState, prefill, propose, verify

Params = dict[str, Any]


@dataclasses.dataclass
class Completion:
    """A finished (or running) request: its tokens and acceptance statistics."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: tuple[int, ...]
    seed: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    accepted: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    submitted_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def tau(self) -> float:
        return float(np.mean([a + 1 for a in self.accepted])) if self.accepted else 0.0


@functools.partial(jax.jit, donate_argnames=("state",))
def _insert(state: SpecState, one: SpecState, slot: jax.Array) -> SpecState:
    """`state` with slot `slot` replaced by the single-sequence state `one` (same capacity)."""
    target = dataclasses.replace(
        state.target, k=state.target.k.at[:, slot].set(one.target.k[:, 0]),
        v=state.target.v.at[:, slot].set(one.target.v[:, 0]),
        lengths=state.target.lengths.at[slot].set(one.target.lengths[0]))
    draft = DraftCache(state.draft.k.at[:, slot].set(one.draft.k[:, 0]),
                       state.draft.v.at[:, slot].set(one.draft.v[:, 0]))
    return SpecState(target, draft, state.lengths.at[slot].set(one.lengths[0]),
                     state.pending.at[slot].set(one.pending[0]), state.active.at[slot].set(True),
                     state.rng.at[slot].set(one.rng[0]))


class Engine:
    """DFlash (or AR) decoding of many requests over `slots` sequence slots."""

    def __init__(self, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter, *, slots: int,
                 max_len: int, block_size: int | None = None, sampling: SamplingConfig | None = None):
        if slots < 1:
            raise ValueError(f"slots must be >= 1; received {slots}")
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
        self._ids = iter(range(1 << 62))
        self.queue: collections.deque[Completion] = collections.deque()
        self.running: dict[int, Completion] = {}  # slot -> request
        self.done: dict[int, Completion] = {}
        self.steps = 0
        self.state = self._empty_state()

    def _empty_state(self) -> SpecState:
        dtype = self.target_params["embed"].dtype
        arch = nnx.merge(self.graphdef, self.drafter_params).arch
        b = self.slots
        return SpecState(DenseKVCache.create(self.target_cfg, b, self.max_len, dtype),
                         DraftCache.create(arch, b, self.max_len), jnp.zeros((b,), jnp.int32),
                         jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), jnp.zeros((b, 2), jnp.uint32))

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = (),
               seed: int = 0) -> int:
        """Queue a request; returns its id. Errors name what is wrong with it."""
        if not prompt_ids:
            raise ValueError("prompt_ids must hold at least one token; received an empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; received {max_new_tokens}")
        need = max(bucket(len(prompt_ids)), len(prompt_ids) + max_new_tokens + self.k)
        if need > self.max_len:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_new_tokens}) must "
                             f"fit the context ({self.max_len} tokens, {self.k} of them reserved for a block); "
                             f"needs {need}")
        request = Completion(next(self._ids), [int(t) for t in prompt_ids], max_new_tokens, tuple(stop_ids), seed,
                             submitted_s=time.perf_counter())
        self.queue.append(request)
        return request.request_id

    def _admit(self) -> None:
        free = [s for s in range(self.slots) if s not in self.running]
        while self.queue and free:
            slot, request = free.pop(0), self.queue.popleft()
            n = len(request.prompt_ids)
            tokens = np.zeros((1, bucket(n)), np.int32)
            tokens[0, :n] = request.prompt_ids
            check_capacity(np.zeros(1, np.int64), tokens.shape[1], self.max_len)
            one = prefill(self.target_params, self.target_cfg, self.graphdef, self.drafter_params, jnp.asarray(tokens),
                          jnp.asarray([n], jnp.int32), self.max_len, jax.random.PRNGKey(request.seed)[None],
                          self.sampling)
            self.state = _insert(self.state, one, jnp.int32(slot))
            request.first_token_s = time.perf_counter()
            self.running[slot] = request
            self._emit(slot, [int(one.pending[0])])

    def _emit(self, slot: int, tokens: Sequence[int]) -> None:
        request = self.running[slot]
        for token in tokens:
            request.token_ids.append(token)
            if token in request.stop_ids or len(request.token_ids) >= request.max_new_tokens:
                request.finish_reason = "stop" if token in request.stop_ids else "length"
                request.finished_s = time.perf_counter()
                self.done[request.request_id] = self.running.pop(slot)
                return

    def step(self) -> None:
        """Admit what fits, then one decoding step over every running request."""
        self._admit()
        if not self.running:
            return
        active = np.zeros(self.slots, bool)
        active[list(self.running)] = True
        self.state = dataclasses.replace(self.state, active=jnp.asarray(active))
        if self.ar:
            drafts = jnp.zeros((self.slots, 0), jnp.int32)
        else:
            drafts = propose(self.target_params, self.target_cfg, self.graphdef, self.drafter_params, self.state,
                             self.k)
        self.state, out, n = verify(self.target_params, self.target_cfg, self.graphdef, self.drafter_params,
                                    self.state, drafts, self.sampling)
        out, n = np.asarray(out), np.asarray(n)
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
