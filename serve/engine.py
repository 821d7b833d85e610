"""The decode driver (docs/design.md §4.4): continuous batching over fixed slots, the only decode loop there is.

    engine = Engine(target_params, target_cfg, drafter, Chain(8), Limits(slots=8, max_len=2048))
    rid = engine.submit(prompt_ids, max_new_tokens=128, stop_ids=(2,), seed=0,
                        sampling=SamplingConfig(temperature=0.7, top_p=0.9), stop_strings=("\\n\\n",))
    while engine.busy: engine.step()                  # or engine.run() -> {request id: Completion}
    [done] = decode(target_params, target_cfg, [prompt_ids], 64, max_len=512)   # one-shot: AR (no drafter)

What a step drafts and how it verifies is the engine's decode plan (`serve.plan`: AR, a chain of K, a tree of N
nodes, prompt lookup); what it holds is its `Limits`. Each step admits queued requests into free slots (those
joining together prefilled in one call, straight into their slots' pages; with `prefill_chunk`, a long prompt one
chunk per step), runs the plan's step over the running requests (or up to R of them in one device loop), and emits
each request's tokens; a request that hits a stop token, a stop string or its budget leaves at once and frees its
slot and pages. Requests carry their own sampling rule and seed, so neighbours never change an output.

Cost: a step computes only the running requests: a view of their slots (`speculative.take_rows`) padded to the
smallest power-of-two bucket that holds them, so one request on a 64-slot engine costs what it costs on a 1-slot
one; idle slots hold memory (their pages' share of the pool, their draft-cache rows), never compute (D99).

Isolation: `submit` refuses (`RequestRejected`, naming the field) anything the device could not take
(`requests.RequestRules`); a request whose host-side work fails (detokenizing, stop strings, log-probabilities)
ends alone with finish_reason "error"; only a failure of a batched device call propagates (the caller resets the
engine).

Text: with `detokenize`, each request's `text` and `stable_text` are kept up to date after every step
(`serve.text`), so a stream of `stable_text` deltas equals the final text.

Compiles: `compiles` counts the programs the engine's calls compiled (or loaded from the persistent compilation
cache, `serve.compile_cache`; `loaded`); `precompile()` compiles every shape the engine can use ahead of time,
after which no request compiles. Compiled shapes are also logged once each (`compiled_shapes`). Design and
measurements: docs/decisions.md D13, D16, D68, D78, D99.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params
from dflash.models.drafter import DFlashDrafter
from dflash.models.sharding import CACHE_RULES, TARGET_RULES, place, replicated, tensor_mesh
from dflash.serve.compile_cache import compile_totals
from dflash.serve.config import SamplingConfig
from dflash.serve.lookup import history_rows, lookup_rows
from dflash.serve.paged import OutOfPagesError, PagePool, PageTable
from dflash.serve.plan import DecodePlan, Limits, default_plan
from dflash.serve.requests import INT32_MAX, Completion, RequestRejected, RequestRules, request_keys
from dflash.serve.sampling import SamplingRows
from dflash.serve.speculative import (
    Admission,
    Models,
    SpecState,
    TokenLogprobs,
    bucket,
    decode_steps,
    empty_state,
    gather_rows,
    prefill,
    prefill_chunk,
    prefill_logprobs,
    prompt_bucket,
    propose,
    put_rows,
    scatter_rows,
    span_pages,
    step_leaves,
    sync_page_table,
    take_rows,
    verify,
    verify_logprobs,
)
from dflash.serve.text import Detokenize, cut_at_stop_string, settle_text, update_text
from dflash.serve.tree import build_tree, decode_tree_steps, propose_topk, verify_tree, verify_tree_logprobs

log = logging.getLogger(__name__)

_PROGRAMS = (prefill, prefill_chunk, prefill_logprobs, decode_steps, propose, verify, verify_logprobs, propose_topk,
             build_tree, verify_tree, verify_tree_logprobs, decode_tree_steps, gather_rows, scatter_rows)


def _compile_count() -> tuple[int, int]:
    """Programs of the engine's kernels this thread has obtained (a miss of jit's in-memory caches: an ahead-of-time
    compile counts, the first call after it does not), and those of them loaded from the persistent cache."""
    return compile_totals(_PROGRAM_NAMES)


_PROGRAM_NAMES = frozenset(f"jit({program.__name__})" for program in _PROGRAMS)


def _engine_mesh(count: int, devices: Sequence[Any] | None) -> Mesh | None:
    """The mesh of an engine on `devices` (default: the first `count` local devices; None: one device, no mesh)."""
    if devices is None:
        local = jax.local_devices()
        if count > len(local):
            raise ValueError(f"devices must be at most the {len(local)} local devices; received {count}")
        devices = local[:count]
    elif len(devices) != count:
        raise ValueError(f"devices must name limits.devices ({count}) devices; received {len(devices)}")
    return None if count == 1 else tensor_mesh(devices)


def _home(models: Models, devices: Sequence[Any] | None) -> Any:
    """The device of a one-device engine: the one its models are committed to (a checkpoint's restored drafter is),
    else the first of `devices`, else the first local device."""
    for leaf in jax.tree.leaves(models):
        if getattr(leaf, "committed", False):
            return next(iter(leaf.devices()))
    return (list(devices) if devices else jax.local_devices())[0]


def _placed(models: Models, mesh: Mesh | None, home: Any) -> Models:
    """`models` on `mesh`: the target by `models.sharding.TARGET_RULES` (tensor parallel over heads and MLP), the
    drafter and its draft-vocabulary rows replicated. Without a mesh, every array committed to `home` (aliased, not
    copied): a program's arguments are then committed alike at precompile and in every later call, whatever mix of
    committed and uncommitted arrays the caller brought (jit compiles a program again when that mix changes; a
    drafter restored from a checkpoint, committed, beside an uncommitted target made the engine compile inside
    requests after its first step)."""
    if mesh is None:  # an array already committed to `home` is kept as it is (`--ar-port`'s engine shares them)
        return jax.tree.map(lambda x: x if getattr(x, "committed", False) and x.devices() == {home}
                            else jax.device_put(x, home), models)
    everywhere = replicated(mesh)
    return dataclasses.replace(
        models, target_params=place(models.target_params, TARGET_RULES, mesh),
        drafter_params=jax.device_put(models.drafter_params, everywhere),
        draft_head=None if models.draft_head is None else jax.device_put(models.draft_head, everywhere),
        draft_ids=None if models.draft_ids is None else jax.device_put(models.draft_ids, everywhere))


# ----------------------------------------------------------------------------- the engine


class Engine:
    """Decoding of many requests over `limits.slots` sequence slots by a decode plan (`serve.plan`)."""

    def __init__(self, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter | None,
                 plan: DecodePlan, limits: Limits, *, sampling: SamplingConfig | None = None,
                 detokenize: Detokenize | None = None, devices: Sequence[Any] | None = None,
                 oracle: Mapping[tuple[int, ...], Sequence[int]] | None = None):
        """drafter: what the plan drafts with (unused by AR and prompt lookup alone); plan: checked against the
        drafter here (`Plan.check`); sampling: the default rule of requests that bring none (None: greedy);
        detokenize: ids -> text, needed for stop strings; devices: the `limits.devices` devices the engine holds
        (default: the first local ones; e.g. one group of a host's chips per regeneration replica); oracle: the
        oracle-ceiling benchmark only (`benchmarks/oracle_ceiling.py`, D99): prompt ids -> their greedy
        continuation, which the drafter's drafts are replaced by for greedy requests with these prompts (every
        draft accepted, each step still paying the drafter's forward)."""
        plan.check(drafter)
        self.plan, self.limits, self.oracle = plan, limits, oracle
        drafter = drafter if plan.drafts_with_drafter else None
        self.mesh = _engine_mesh(limits.devices, devices)
        models = Models.of(target_params, target_cfg, drafter)
        self.home = _home(models, devices) if self.mesh is None else None
        self.models = _placed(models, self.mesh, self.home)
        self.arch = None if drafter is None else drafter.arch
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.rules = RequestRules(target_cfg.vocab_size, limits.max_len, plan.width, plan.k, limits.page_size,
                                  limits.pages - 1, self.sampling, False)
        self.detokenize = detokenize
        self.compiled_shapes: set[tuple[Any, ...]] = set()
        self.compiles = 0  # programs compiled by this engine's calls (jit cache misses)
        self.loaded = 0  # of those, loaded from the persistent compilation cache (`serve.compile_cache`)
        self._ids = iter(range(1 << 62))
        self.queue: deque[Completion] = deque()
        self.running: dict[int, Completion] = {}  # slot -> request
        self.prefilling: dict[int, tuple[Completion, int]] = {}  # slot -> (request, prompt tokens prefilled)
        self.done: dict[int, Completion] = {}
        self.steps = 0
        self._fresh_state()

    @property
    def detokenize(self) -> Detokenize | None:
        """ids -> text, needed for stop strings (the server sets its tokenizer's)."""
        return self._detokenize

    @detokenize.setter
    def detokenize(self, detokenize: Detokenize | None) -> None:
        self._detokenize = detokenize
        self.rules = dataclasses.replace(self.rules, text=detokenize is not None)

    @property
    def k(self) -> int:
        """The block verified per step (1: AR)."""
        return self.plan.k

    @property
    def ar(self) -> bool:
        return self.plan.ar

    @property
    def width(self) -> int:
        """Tokens written into the target cache per step past the committed ones: the chain's K, the tree's N."""
        return self.plan.width

    @property
    def slots(self) -> int:
        return self.limits.slots

    @property
    def max_len(self) -> int:
        return self.limits.max_len

    @functools.cached_property
    def drafter_fingerprint(self) -> str | None:
        """sha256 (16 hex digits) of the drafter's weights and draft vocabulary; None without one (AR, prompt lookup
        alone). What a client that keeps results across runs (`dflash eval`'s records) checks it is still talking to
        the same drafter."""
        if self.arch is None:
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
        limits = self.limits
        self.pool = PagePool(limits.pages, limits.page_size)
        self.table = PageTable(self.pool, limits.slots, limits.max_pages)
        self.lengths = np.zeros(limits.slots, np.int64)  # committed tokens per slot, mirrored on the host
        state = empty_state(self.models.target_cfg, self.arch, limits.slots, limits.max_len, limits.pages,
                            limits.page_size, self.models.target_params["embed"].dtype, self.oracle is not None)
        self.state: SpecState = (jax.device_put(state, self.home) if self.mesh is None
                                 else place(state, CACHE_RULES, self.mesh))
        self._table_version = 0  # the table version on the device
        self._oracle_rows = None if self.oracle is None else np.full((limits.slots, limits.max_len), -1, np.int32)
        self._oracle_stale = False  # the oracle rows changed since their upload

    def reset(self) -> None:
        """Drop every queued, running and unread finished request and start from empty slots (e.g. after a
        failed step, whose donated state may be gone). Compiled programs are kept."""
        self.queue.clear()
        self.running.clear()
        self.prefilling.clear()
        self.done.clear()
        self._fresh_state()

    def _prefill_len(self, n: int) -> int:
        """The padded length a prompt of n tokens is prefilled at (`prompt_bucket`), at most max_len."""
        return min(prompt_bucket(n), self.max_len)

    def _sync_table(self) -> None:
        self.state, self._table_version = sync_page_table(self.state, self.table, self._table_version)
        if self._oracle_stale:  # placed like the table it replaces, as the page table is
            rows = jnp.asarray(self._oracle_rows)
            if getattr(self.state.oracle, "committed", False):
                rows = jax.device_put(rows, self.state.oracle.sharding)
            self.state, self._oracle_stale = dataclasses.replace(self.state, oracle=rows), False

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running or self.prefilling)

    @property
    def vocab_size(self) -> int:
        return self.models.target_cfg.vocab_size

    def check(self, prompt_ids: Sequence[int], max_new_tokens: int | None, stop_ids: Sequence[int] = (),
              seed: int = 0, *, sampling: SamplingConfig | None = None, stop_strings: Sequence[str] = (),
              logprobs: int | None = None, prompt_logprobs: int | None = None) -> Completion:
        """The request `submit` would queue, validated but not queued (safe from any thread: it reads only
        the engine's fixed settings, `self.rules`). Raises `RequestRejected` naming the field, the value and the
        rule."""
        return self.rules.check(next(self._ids), prompt_ids, max_new_tokens, stop_ids, seed, sampling=sampling,
                                stop_strings=stop_strings, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def enqueue(self, request: Completion) -> int:
        """Queue a request made by `check`; returns its id."""
        self.queue.append(request)
        return request.request_id

    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int | None, stop_ids: Sequence[int] = (),
               seed: int = 0, *, sampling: SamplingConfig | None = None, stop_strings: Sequence[str] = (),
               logprobs: int | None = None, prompt_logprobs: int | None = None) -> int:
        """Queue a request; returns its id. `max_new_tokens` None: until a stop or the context (max_len) is
        full. `sampling` defaults to the engine's rule (its `max_new_tokens` and `seed` are not used: the
        arguments are). logprobs / prompt_logprobs: None, or n in [0, 20] alternatives per generated / prompt
        token. Raises `RequestRejected` naming the field, the value and the rule."""
        return self.enqueue(self.check(prompt_ids, max_new_tokens, stop_ids, seed, sampling=sampling,
                                       stop_strings=stop_strings, logprobs=logprobs,
                                       prompt_logprobs=prompt_logprobs))

    def cancel(self, request_id: int) -> bool:
        """End a queued or running request now (finish_reason "cancelled"), freeing its slot and pages; it
        moves to `done` with the tokens it has. Returns False when the request is not queued, being prefilled
        or running."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                self._cancelled(request)
                self.done[request_id] = request
                return True
        for slot, request in self.running.items():
            if request.request_id == request_id:
                self._cancelled(request)
                self._finish(slot)
                return True
        for slot, (request, _) in self.prefilling.items():
            if request.request_id == request_id:
                del self.prefilling[slot]
                self._cancelled(request)
                self.done[request_id] = request
                self.table.release(slot)
                return True
        return False

    def _cancelled(self, request: Completion) -> None:
        request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
        settle_text(request, self.detokenize)

    def _finish(self, slot: int) -> None:
        request = self.running.pop(slot)
        self.done[request.request_id] = request
        self.table.release(slot)  # uploaded before the next jitted step (`_sync_table`)
        self.lengths[slot] = 0

    def _fail(self, request: Completion, slot: int | None, err: Exception) -> None:
        """End `request` alone after its host-side work raised: finish_reason "error", its slot freed."""
        log.warning("request %d failed alone (%s: %s); the others continue", request.request_id,
                    type(err).__name__, err, exc_info=err)
        request.error = f"{type(err).__name__}: {err}"
        request.finish_reason, request.finished_s = "error", time.perf_counter()
        request.stable_text, request.stable_tokens = request.text, len(request.token_ids)
        if slot is not None and self.running.get(slot) is request:
            self._finish(slot)
        else:
            self.done[request.request_id] = request

    def _counted(self, program: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a jitted program (or a plan's step or loop), counting the programs it compiled (`compiles`)."""
        before = _compile_count()
        try:
            return program(*args, **kwargs)
        finally:
            after = _compile_count()
            self.compiles += after[0] - before[0]
            self.loaded += after[1] - before[1]

    # ------------------------------------------------------------------------- admission and prefill

    def _prefill_rows(self, n: int) -> int:
        """The padded row count of a prefill admitting n requests: a power of two, at most `slots`."""
        return min(bucket(n, minimum=1), self.slots)

    def _prefill(self, admitted: Sequence[tuple[int, Completion]]) -> tuple[list[int], TokenLogprobs | None]:
        """Prefill requests into their slots (pages already given) in one call, padded to a bucket of rows and
        of tokens; returns their first tokens and, for a single request asking for log-probabilities, the
        prompt's scores (a scored request is always prefilled alone: its logits cover every position)."""
        new, scored = self._admission(admitted)
        self._sync_table()
        scores = None
        if scored:
            self.state, scores = self._counted(prefill_logprobs, self.models, self.state, new)
            scores = jax.device_get(scores)
        else:
            self.state = self._counted(prefill, self.models, self.state, new)
        pending = np.asarray(self.state.pending)  # waits for the prefill
        return [int(pending[slot]) for slot, _ in admitted], scores

    def _admission(self, admitted: Sequence[tuple[int, Completion]]) -> tuple[Admission, bool]:
        """The prefill call's input for these requests, padded to a bucket of rows and of tokens, and whether it
        is scored (the log-probability program)."""
        n_max = max(len(request.prompt_ids) for _, request in admitted)
        rows = self._prefill_rows(len(admitted))
        tokens = np.zeros((rows, self._prefill_len(n_max)), np.int32)
        slots = np.full(rows, self.slots, np.int32)  # padding rows: slot B writes nothing
        lengths = np.ones(rows, np.int32)
        seeds = [0] * rows
        rules: list[SamplingConfig | None] = [None] * rows
        for i, (slot, request) in enumerate(admitted):
            tokens[i, :len(request.prompt_ids)] = request.prompt_ids
            slots[i], lengths[i], seeds[i], rules[i] = slot, len(request.prompt_ids), request.seed, request.sampling
        scored = any(r.scored for _, r in admitted)
        if scored and len(admitted) > 1:
            raise AssertionError("a scored request is prefilled alone")  # pragma: no cover - _admit's rule
        self._note_shape("prefill", tokens.shape)
        new = Admission(jnp.asarray(slots), jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(request_keys(seeds)),
                        SamplingRows.of(rules))
        return new, scored

    def _admit(self) -> None:
        """Admit queued requests in order while a slot is free and the pool holds the head's worst case: all
        of them in one prefill call, except that a request asking for log-probabilities is prefilled alone."""
        free = [s for s in range(self.slots) if s not in self.running and s not in self.prefilling]
        chunk = self.limits.prefill_chunk
        while self.queue and free:
            batch: list[tuple[int, Completion]] = []
            while self.queue and free:
                slot, request = free[0], self.queue[0]
                alone = request.scored
                chunked = not alone and chunk is not None and len(request.prompt_ids) > chunk
                if alone and batch:
                    break  # prefilled in the next call
                try:
                    self.table.ensure(slot, self.rules.worst_case_tokens(request))
                except OutOfPagesError:
                    break  # stays queued until finished requests release pages
                free.pop(0)
                self.queue.popleft()
                if chunked:  # prefilled chunk by chunk in the coming steps (`_prefill_next_chunk`)
                    self.prefilling[slot] = (request, 0)
                    continue
                batch.append((slot, request))
                if alone:
                    break
            if not batch:
                return
            firsts, scores = self._prefill(batch)  # a device failure propagates: the engine fails
            for (slot, request), first in zip(batch, firsts, strict=True):
                self._start(slot, request, first, scores)

    def _start(self, slot: int, request: Completion, first: int, scores: TokenLogprobs | None) -> None:
        """A prefilled request starts running: its first token is emitted (and its prompt's scores kept)."""
        n = len(request.prompt_ids)
        if self.oracle is not None:  # the benchmark's oracle: the slot's known sequence, uploaded before its steps
            known = [*request.prompt_ids, *self.oracle.get(tuple(request.prompt_ids), ())][:self.max_len]
            self._oracle_rows[slot] = -1
            self._oracle_rows[slot, :len(known)] = known
            self._oracle_stale = True
        self.lengths[slot] = n
        request.first_token_s = time.perf_counter()
        self.running[slot] = request
        try:
            if scores is not None and request.prompt_top_n is not None:
                request.prompt_logprobs = [None, *(float(v) for v in scores.chosen[0, :n - 1])]
                request.prompt_top_logprobs = [[], *(self._top(scores, 0, i, request.prompt_top_n)
                                                     for i in range(n - 1))]
            self._emit(slot, [first], scores, [n - 1])
        except Exception as err:  # noqa: BLE001 - one request's host-side failure ends it alone
            self._fail(request, slot, err)

    def _chunk_spans(self) -> list[tuple[int, int]]:
        """(start, attention span in pages) of every chunk a prompt of up to the longest admissible length has."""
        longest, chunk = self.max_len - self.width - 1, self.limits.prefill_chunk
        return [(start, span_pages(start + chunk, self.limits.page_size, self.limits.max_pages))
                for start in range(0, longest, chunk)]

    def _prefill_chunk(self, slot: int, request: Completion, start: int) -> int:
        """Prefill the prompt's next chunk (from token `start`) into `slot`; returns the tokens prefilled now."""
        args, n = self._chunk_args(slot, request, start)
        self._sync_table()
        self.state = self._counted(prefill_chunk, self.models, self.state, *args)
        return n

    def _chunk_args(self, slot: int, request: Completion, start: int) -> tuple[tuple[Any, ...], int]:
        """`prefill_chunk`'s arguments after the models and state for the chunk of `request` from token `start`,
        and the number of its tokens in that chunk."""
        chunk = self.limits.prefill_chunk
        n = min(chunk, len(request.prompt_ids) - start)
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = request.prompt_ids[start:start + n]
        pages = span_pages(start + chunk, self.limits.page_size, self.limits.max_pages)
        self._note_shape("prefill_chunk", (1, chunk, pages))
        new = Admission(jnp.asarray([slot], jnp.int32), jnp.asarray(tokens), jnp.asarray([n], jnp.int32),
                        jnp.asarray(request_keys([request.seed])), SamplingRows.of([request.sampling]))
        return (new, jnp.asarray([start], jnp.int32), pages), n

    def _prefill_next_chunk(self) -> None:
        """One chunk of the longest-waiting chunked prompt; after its last chunk the request starts running."""
        if not self.prefilling:
            return
        slot, (request, done) = next(iter(self.prefilling.items()))
        done += self._prefill_chunk(slot, request, done)  # a device failure propagates: the engine fails
        if done < len(request.prompt_ids):
            self.prefilling[slot] = (request, done)
            return
        del self.prefilling[slot]
        self._start(slot, request, int(np.asarray(self.state.pending)[slot]), None)

    # ------------------------------------------------------------------------- emitting tokens

    @staticmethod
    def _top(scores: TokenLogprobs, row: int, i: int, n: int) -> list[tuple[int, float]]:
        return [(int(t), float(v)) for t, v in zip(scores.top_ids[row, i, :n], scores.top_values[row, i, :n],
                                                   strict=True)]

    def _note_shape(self, program: str, shape: tuple[int, ...]) -> None:
        key = (program, *shape)
        if key not in self.compiled_shapes:
            self.compiled_shapes.add(key)
            log.info("engine: first %s of shape %s (%d compiled shapes so far)", program, shape,
                     len(self.compiled_shapes))

    def _emit(self, slot: int, tokens: Sequence[int], scores: TokenLogprobs | None = None,
              positions: Sequence[int] = (), row: int = 0) -> None:
        """Append a step's tokens to the slot's request (scores[row, positions[i]] scores tokens[i]), ending it at a
        stop token, its budget or a stop string; then update its text."""
        request = self.running[slot]
        start = len(request.token_ids)
        reason = None
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            if request.top_n is not None and scores is not None:
                request.token_logprobs.append(float(scores.chosen[row, positions[i]]))
                request.top_logprobs.append(self._top(scores, row, positions[i], request.top_n))
            if token in request.stop_ids or len(request.token_ids) >= request.max_new_tokens:
                reason = "stop" if token in request.stop_ids else "length"
                break
        if request.stop_strings and cut_at_stop_string(request, start, self.detokenize):
            reason = "stop"
        if reason is not None:
            request.finish_reason = reason
            request.finished_s = time.perf_counter()
        update_text(request, self.detokenize)
        if reason is not None:
            self._finish(slot)

    def _emit_steps(self, slots: Sequence[int], out_IxBxK: np.ndarray, n_IxB: np.ndarray,
                    scores: TokenLogprobs | None = None) -> None:
        """Each step's tokens (out[i, j, :n[i, j] + 1]) emitted in order to the request in `slots[j]` (row j of the
        step's view; rows past `slots` pad the bucket), with the accepted counts; a request that finishes (stop,
        budget, stop string) or fails alone leaves the later steps. scores: the one step's log-probabilities
        (position p of row j scores out[0, j, p])."""
        live = list(enumerate(slots))
        for i in range(out_IxBxK.shape[0]):
            self.steps += 1
            for row, slot in live:
                self.lengths[slot] += int(n_IxB[i, row]) + 1
                request = self.running[slot]
                try:
                    before, n = len(request.token_ids), int(n_IxB[i, row])
                    self._emit(slot, [int(t) for t in out_IxBxK[i, row, :n + 1]], scores, range(n + 1), row)
                    if not self.ar:  # what was emitted: a stop or the budget may cut the step short of n + 1 tokens
                        request.accepted.append(len(request.token_ids) - before - 1)
                except Exception as err:  # noqa: BLE001 - one request's host-side failure ends it alone
                    self._fail(request, slot, err)
            live = [(row, slot) for row, slot in live if slot in self.running]

    def _histories(self, slots: Sequence[int]) -> dict[int, list[int]]:
        """The prompt and output so far of the request in each of `slots`, by row (what prompt lookup searches)."""
        return {row: self.running[slot].prompt_ids + self.running[slot].token_ids for row, slot in enumerate(slots)}

    # ------------------------------------------------------------------------- decode steps

    @property
    def buckets(self) -> list[int]:
        """Every bucket of rows a decode step can run at (`bucket`)."""
        return sorted({self.bucket(n) for n in range(1, self.slots + 1)})

    def bucket(self, n: int) -> int:
        """The rows a decode step over n running requests computes: a power of two, at most `slots` (the
        precompiled buckets; D99)."""
        return min(bucket(n, minimum=1), self.slots)

    def _rows(self, slots: Sequence[int]) -> np.ndarray:
        """The step view's rows for these slots: the slots, then B (a missing row) up to the bucket."""
        rows = np.full(self.bucket(len(slots)), self.slots, np.int32)
        rows[:len(slots)] = slots
        return rows

    def step(self) -> None:
        """Admit what fits (one chunk of a long prompt at most), then the plan's decode step (`decode`)."""
        self.admit()
        self.decode()

    def admit(self) -> bool:
        """Admit queued requests into free slots and prefill them (one chunk of a long prompt at most); returns
        whether a request started (its first token is out: a server publishes it before the next decode)."""
        started = len(self.running)
        self._admit()
        self._prefill_next_chunk()
        return len(self.running) > started

    def decode(self) -> None:
        """The plan's step over the running requests (or up to R of them in one device loop), computed at the
        smallest bucket of rows that holds them (`take_rows`: the step costs what the running requests cost, not
        what `slots` would). A request whose host-side work raises ends alone (finish_reason "error"); a failing
        device call raises (reset the engine)."""
        if not self.running:
            return
        slots = sorted(self.running)
        rows = self._rows(slots)
        # A step appends `width` tokens per running slot; admission already reserved them, so this only raises on a
        # bookkeeping bug.
        self.table.ensure_batch([self.lengths[s] + self.width if s in self.running else 0 for s in range(self.slots)])
        self._sync_table()
        scored = any(r.top_n is not None for r in self.running.values())
        lengths = self.lengths[slots]
        if self._loop_steps(scored) > 1:
            self._loop(slots, rows, lengths)
            return
        pages = self._step_pages(lengths)
        kernel, *shape = self.plan.shape(len(rows), pages)
        self._note_shape(kernel, tuple(shape))
        lookup = functools.partial(self._lookup_rows, slots, len(rows))
        view, out, n, scores = self._counted(self.plan.step, self.models, take_rows(self.state, rows), pages, scored,
                                             lookup)
        self.state = put_rows(self.state, view, rows)
        self._emit_steps(slots, np.asarray(out)[None], np.asarray(n)[None],
                         None if scores is None else jax.device_get(scores))

    def _lookup_rows(self, slots: Sequence[int], b: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return lookup_rows(self._histories(slots), b, length)

    def _loop_steps(self, scored: bool) -> int:
        """Decode steps the next dispatch may run: 1 unless the plan loops on the device, no request asks for
        log-probabilities and no prompt is part way through its chunked prefill (which then takes a chunk per
        step, not per R steps)."""
        r = self.limits.steps_per_dispatch
        return r if self.plan.loops and not scored and not self.prefilling else 1

    @property
    def _loops(self) -> bool:
        """Whether the plan runs up to R > 1 steps in one device loop (`_loop_steps`)."""
        return self.plan.loops and self.limits.steps_per_dispatch > 1

    def _step_pages(self, lengths_b: np.ndarray) -> int:
        """The attention span of a single step over slots holding lengths_b tokens: the pages in use after it,
        bucketed to a power of two (a bounded number of shapes); when the plan also loops on the device, the
        loop's span (at most one bucket more), so that single steps compile at the loops' spans only."""
        if self._loops:
            return self._loop_pages(lengths_b)
        return span_pages(int(lengths_b.max()) + self.width, self.limits.page_size, self.limits.max_pages)

    def _loop_pages(self, lengths_b: np.ndarray) -> int:
        """The attention span of a device loop over slots holding lengths_b tokens."""
        most = int(lengths_b.max()) + self.limits.steps_per_dispatch * self.width
        return span_pages(min(most, self.max_len), self.limits.page_size, self.limits.max_pages)

    def _loop_call(self, view: SpecState, stop_ids: jax.Array, budget: jax.Array, pages: int,
                   slots: Sequence[int]) -> tuple[Any, tuple[Any, ...]]:
        """The device loop's program and arguments over `view` (rows: `slots`, then padding)."""
        b, r = view.lengths.shape[0], self.limits.steps_per_dispatch
        kernel, *shape = self.plan.loop_shape(b, stop_ids.shape[1], r, pages)
        self._note_shape(kernel, tuple(shape))
        return self.plan.loop_call(self.models, view, stop_ids, budget, r, pages,
                                   lambda: history_rows(self._histories(slots), b, self.max_len))

    def _loop(self, slots: Sequence[int], rows: np.ndarray, lengths: np.ndarray) -> None:
        """Up to R decode steps in one dispatch, then each step's tokens emitted in order."""
        requests = [self.running[s] for s in slots]
        stops = bucket(max(len(r.stop_ids) for r in requests), minimum=8)  # few shapes
        stop_ids = np.full((len(rows), stops), -1, np.int32)
        budget = np.full(len(rows), INT32_MAX, np.int32)
        for row, request in enumerate(requests):
            stop_ids[row, :len(request.stop_ids)] = request.stop_ids
            budget[row] = request.max_new_tokens - len(request.token_ids)
        program, args = self._loop_call(take_rows(self.state, rows), jnp.asarray(stop_ids), jnp.asarray(budget),
                                        self._loop_pages(lengths), slots)
        view, out, n, ran = self._counted(program, *args)
        self.state = put_rows(self.state, view, rows)
        ran = int(ran)
        out, n = (np.asarray(a[:ran]) for a in jax.device_get((out, n)))
        self._emit_steps(slots, out, n)

    def _compile_only(self, program: Any, *args: Any) -> None:
        """Compile `program` for these arguments without running it (jit's ahead-of-time path, which a later call
        with arguments of the same shapes reuses); counted in `compiles`."""
        self._counted(self._compile_call, program, *args)

    @staticmethod
    def _compile_call(program: Any, *args: Any, **kwargs: Any) -> Any:
        """The `call` of a plan's step in precompile: compile the program ahead of time and return the shapes of its
        outputs, for the next program of the step to be compiled against. The engine's models are committed to its
        devices (`_placed`), so every output is too (jit's rule), and a later call reuses the program only if its
        arguments' placement matches: the shapes carry their shardings."""
        compiled = program.lower(*args, **kwargs).compile()
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type,
                                                           sharding=s.sharding), compiled.out_info)

    def precompile(self, *, logprobs: bool = True) -> tuple[int, float]:
        """Compile every program the engine can use (each prefill length up to max_len and each attention span,
        with and without log-probabilities) ahead of time, without running any; afterwards no request compiles.
        Programs in the persistent compilation cache (`serve.compile_cache`) load from it instead. logprobs=False
        leaves out the log-probability variants, for a server whose only client never asks for them (`dflash
        eval`'s in-process servers). Needs an idle engine; returns (programs compiled, seconds)."""
        if self.busy:
            raise RuntimeError("precompile needs an idle engine; requests are queued or running")
        t0, before, loaded = time.perf_counter(), self.compiles, self.loaded
        longest = self.max_len - self.width - 1  # the longest prompt that leaves room for one token
        lengths = sorted({self._prefill_len(n) for n in range(1, longest + 1)})
        spans = sorted({self._step_pages(np.array([n])) for n in range(1, self.max_len - self.width + 1)})
        variants = (False, True) if logprobs else (False,)
        rows = sorted({self._prefill_rows(r) for r in range(1, self.slots + 1)})
        chunk = self.limits.prefill_chunk
        whole = lengths if chunk is None else [n for n in lengths if n <= chunk]
        for length in lengths:
            for scored in variants:
                if not scored and length not in whole:
                    continue  # a longer unscored prompt is prefilled in chunks
                for r in rows if not scored else (1,):  # a scored request is prefilled alone
                    probes = [(slot, Completion(-1, [0] * min(length, longest), 1, (), 0, top_n=0 if scored else None))
                              for slot in range(r)]
                    new, _ = self._admission(probes)
                    self._compile_only(prefill_logprobs if scored else prefill, self.models, self.state, new)
        # A prompt is chunked only when it is longer than the chunk (with a chunk >= max_len, none is).
        chunks = [] if chunk is None or longest <= chunk else sorted({span for _, span in self._chunk_spans()})
        for span in chunks:
            start = max(s for s, p in self._chunk_spans() if p == span)
            args, _ = self._chunk_args(0, Completion(-1, [0] * (start + 1), 1, (), 0), start)
            self._compile_only(prefill_chunk, self.models, self.state, *args)
        # Single steps: scored ones always; unscored ones only where the plan does not loop on the device or a
        # chunked prefill can be under way (`_loop_steps`). Device loops: at the same spans (`_step_pages`). Each
        # at every bucket of rows (`bucket`), with the row gather and scatter around it.
        singles = variants if not self._loops or chunks else tuple(v for v in variants if v)
        loop_spans = spans if self._loops else []
        buckets = self.buckets
        for b in buckets:
            rows = np.full(b, self.slots, np.int32)
            view = self._counted(take_rows, self.state, rows)  # runs the gather (a few per-slot values), no step
            outs = []
            for pages in spans:  # compiled, not run
                for scored in singles:
                    kernel, *shape = self.plan.shape(b, pages)
                    self._note_shape(kernel, tuple(shape))
                    lookup = functools.partial(lookup_rows, {}, b)
                    outs.append(self._counted(self.plan.step, self.models, view, pages, scored, lookup,
                                              self._compile_call)[0])
            for pages in loop_spans:  # compiled, not run
                stop_ids, budget = jnp.full((b, 8), -1, jnp.int32), jnp.ones(b, jnp.int32)
                program, args = self._loop_call(view, stop_ids, budget, pages, [])
                outs.append(self._counted(self._compile_call, program, *args)[0])
            for out in outs[:1]:  # every step returns the view alike
                self._compile_only(scatter_rows, step_leaves(self.state), step_leaves(out), jnp.asarray(rows))
        self._fresh_state()
        seconds = time.perf_counter() - t0
        log.info("engine: precompiled %d programs (%d prefill lengths x %d row counts, %d prefill chunk spans, %d "
                 "attention spans of single steps and %d of device loops x %d buckets of running requests; %d loaded "
                 "from the compilation cache) in %.1f s", self.compiles - before, len(lengths), len(rows), len(chunks),
                 len(spans) if singles else 0, len(loop_spans), len(buckets), self.loaded - loaded, seconds)
        return self.compiles - before, seconds

    def run(self) -> dict[int, Completion]:
        """Step until every submitted request is done; returns all finished requests by id."""
        while self.busy:
            self.step()
        return self.done


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """How `decode` feeds its prompts through the engine: `slots`: at most this many prompts decode at once
    (default: all; the rest wait in the queue, as a server's requests do); `prefill_chunk`: as `Limits`; `seeds`: one
    per prompt (default: sampling.seed + index); `on_token`: called with each new token of a single prompt as the
    engine emits it (streaming)."""

    slots: int | None = None
    prefill_chunk: int | None = None
    seeds: Sequence[int] | None = None
    on_token: Callable[[int], None] | None = None


def decode(target_params: Params, target_cfg: DecoderConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           *, max_len: int, drafter: DFlashDrafter | None = None, plan: DecodePlan | None = None,
           stop_ids: Sequence[int] = (), sampling: SamplingConfig | None = None,
           run: DecodeRun = DecodeRun()) -> list[Completion]:
    """Decode `prompts` together, one slot each, through the engine by `plan` (default: AR without a drafter,
    else the drafter's chain at its training K), fed as `run` says (`DecodeRun`: slots at once, prefill chunk, seeds,
    streaming). Greedy DFlash equals AR token for token; sampled DFlash has AR sampling's distribution."""
    seeds, on_token, prefill_chunk, slots = run.seeds, run.on_token, run.prefill_chunk, run.slots
    if not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token lists; received none")
    if on_token is not None and len(prompts) != 1:
        raise ValueError(f"on_token streams one prompt; received {len(prompts)}")
    plan = default_plan(drafter) if plan is None else plan
    seeds = [(sampling.seed if sampling else 0) + i for i in range(len(prompts))] if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds must hold one seed per prompt ({len(prompts)}); received {len(seeds)}")
    engine = Engine(target_params, target_cfg, drafter, plan,
                    Limits(slots=min(len(prompts), slots or len(prompts)), max_len=max_len,
                           prefill_chunk=prefill_chunk), sampling=sampling)
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


__all__ = ["Completion", "DecodeRun", "Engine", "RequestRejected", "decode"]
