"""The decode driver (docs/design.md §4.4): continuous batching over fixed slots, the only decode loop there is.

    engine = Engine(target_params, target_cfg, drafter, slots=8, max_len=2048, block_size=8)
    rid = engine.submit(prompt_ids, max_new_tokens=128, stop_ids=(2,), seed=0,
                        sampling=SamplingConfig(temperature=0.7, top_p=0.9), stop_strings=("\\n\\n",))
    while engine.busy: engine.step()                  # or engine.run() -> {request id: Completion}
    [done] = decode(target_params, target_cfg, [prompt_ids], 64, max_len=512)   # one-shot: AR (no drafter)

Each step admits queued requests into free slots (those joining together prefilled in one call, straight
into their slots' pages; with `prefill_chunk`, a long prompt one chunk per step), asks the proposer for
drafts, and verifies them over all slots; a request that hits a stop token, a stop string or its budget
leaves at once and frees its slot and pages. AR mode is the proposer that proposes nothing (K = 1).
Requests carry their own sampling rule and seed, so neighbours never change an output.

Isolation: `submit` refuses (`RequestRejected`, naming the field) anything the device could not take (token
ids outside [0, vocab), int32 overflows, a prompt + budget over the context `max_len`); a request whose
host-side work fails (detokenizing, stop strings, log-probabilities) ends alone with finish_reason "error";
only a failure of a batched device call propagates (the caller resets the engine).

Text: with `detokenize`, each request's `text` (stop strings cut, only here) and `stable_text` (the prefix
that can no longer change: no incomplete UTF-8 character, no suffix that could still become a stop string)
are kept up to date after every step, so a stream of `stable_text` deltas equals the final text.

Compiles: `compiles` counts the jit cache misses of the engine's programs; `precompile()` runs every shape
the engine can use once, after which no request compiles. Compiled shapes are also logged once each
(`compiled_shapes`). Design and measurements: docs/decisions.md D13, D16.
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
from dflash.serve.config import DRAFT_RULES, SamplingConfig
from dflash.serve.paged import OutOfPagesError, PagePool, PageTable
from dflash.serve.sampling import SamplingRows
from dflash.serve.speculative import (
    MAX_TOP_LOGPROBS,
    Admission,
    DraftLaw,
    Models,
    SpecState,
    TokenLogprobs,
    bucket,
    decode_steps,
    empty_state,
    prefill,
    prefill_chunk,
    prefill_logprobs,
    propose,
    span_pages,
    sync_page_table,
    verify,
    verify_logprobs,
)
from dflash.serve.tree import (
    Tree,
    build_tree,
    decode_tree_steps,
    ngram_continuation,
    propose_topk,
    verify_tree,
    verify_tree_logprobs,
)

log = logging.getLogger(__name__)

INT32_MAX = (1 << 31) - 1
SEED_LIMIT = 1 << 63
_PROGRAMS = (prefill, prefill_chunk, prefill_logprobs, decode_steps, propose, verify, verify_logprobs, propose_topk,
             build_tree, verify_tree, verify_tree_logprobs, decode_tree_steps)


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


def _reject_unless(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise RequestRejected(field, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """How many characters at the end of `text` could still grow into a stop string (the longest suffix
    that is a proper prefix of one)."""
    longest = 0
    for stop in stop_strings:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def _compile_count() -> int:
    return sum(program._cache_size() for program in _PROGRAMS) + _set_active._cache_size()


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
    """DFlash: the drafter's argmax block of K - 1 drafts from one forward (`speculative.propose`); with `sample`,
    sampled requests' drafts drawn from its distributions, returned with their law (`DraftLaw`)."""

    block_size: int
    sample: bool = False

    def __call__(self, models: Models, state: SpecState, span: int) -> jax.Array | tuple[jax.Array, DraftLaw]:
        if self.sample:
            return propose(models, state, self.block_size, span, sample=True)
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
    accept_per_position[i]: share of steps whose draft i+1 was accepted.

    With `top_n` (the request's `logprobs`): token_logprobs[i] is the target's log-probability of token_ids[i]
    and top_logprobs[i] its `top_n` most likely (id, log-probability), most likely first. With `prompt_top_n`:
    the same for every prompt token (prompt_logprobs[0] None, prompt_top_logprobs[0] []). text: the visible
    tokens' text, cut before the earliest stop string; stable_text: its prefix that can no longer change, of
    the first `stable_tokens` tokens (all of them, and the whole text, once finished). error: why the request
    failed alone (finish_reason "error")."""

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
    error: str | None = None

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
    """`state` with these slots active; inactive slots' lengths are parked at the cache capacity, so that a
    decode step writes none of their target or draft cache slots (a slot part way through a chunked prefill
    keeps its prompt's K/V; a free slot has no pages anyway)."""
    park = state.target.capacity  # >= max_len: writes there are dropped in both caches
    target = dataclasses.replace(state.target, lengths=jnp.where(active_B, state.target.lengths, park))
    return dataclasses.replace(state, target=target, lengths=jnp.where(active_B, state.lengths, park), active=active_B)


# ----------------------------------------------------------------------------- the engine


class Engine:
    """DFlash (or AR) decoding of many requests over `slots` sequence slots."""

    def __init__(self, target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter | None = None, *,
                 slots: int, max_len: int, block_size: int | None = None,
                 draft_fn: Callable[[SpecState, int], Any] | None = None, sampling: SamplingConfig | None = None,
                 page_size: int = 16, num_pages: int | None = None,
                 detokenize: Callable[[Sequence[int]], str] | None = None, tree_nodes: int | None = None,
                 ngram: bool = False, tree_fn: Callable[[SpecState, int, int], Any] | None = None,
                 prefill_chunk: int | None = None, steps_per_dispatch: int = 1, draft_rule: str = "argmax"):
        """block_size: K per step with `drafter` (None: AR mode, the drafter unused); draft_fn: replaces the
        drafter's proposals (tests); sampling: the default rule of requests that bring none (None: greedy);
        page_size / num_pages: the target cache's pages (default: every slot at max_len, plus the null
        page); detokenize: ids -> text, needed for stop strings.

        tree_nodes: N > 1 verifies a tree of N nodes per step (depth <= K - 1) built from the block's
        distributions (`serve.tree`) instead of the chain (None, 0 or 1); tree_fn: (state, K, M) -> the
        ranked lists (ids, logp) [B, K-1, M] in place of the drafter's (tests). ngram: add prompt lookup (the
        continuation of the recent tokens' latest earlier match in the prompt + output) as an extra tree path;
        without a drafter (and with block_size), prompt lookup alone drafts the chain.

        prefill_chunk: a prompt longer than this many tokens (a power of two >= 16) is prefilled one chunk per
        engine step, between the running requests' decode steps, so that it stalls them by at most one chunk's
        prefill per step (None: every prompt in one call; a request asking for log-probabilities always is).

        steps_per_dispatch: R > 1 runs up to R decode steps (propose + verify) in one jitted device loop
        (`speculative.decode_steps`; with a tree `tree.decode_tree_steps`, prompt lookup found on the device) and
        returns to the host after R steps, or after the first step in which a request hits a stop id or its
        budget; stop strings are checked on the host afterwards (tokens past one are discarded). Steps that score
        log-probabilities and `draft_fn` / `tree_fn` / prompt-lookup-alone proposals run one step per dispatch.
        R = 1: one propose and one verify call per step (with a tree: propose, build, verify).

        draft_rule: how a sampled request's chain drafts are chosen: "argmax" (one-hot drafts, accepted with
        probability p(d): `accept_sampled`) or "sample" (drawn from the drafter's distribution under the request's
        rule and accepted with min(1, p(d) / q(d)): `accept_drafted`); both lossless, greedy requests unaffected.
        "sample" needs the drafter's own chain proposals (no tree, `draft_fn`, prompt lookup alone, Markov head
        or path selector)."""
        if draft_rule not in DRAFT_RULES:
            raise ValueError(f"draft_rule must be one of {DRAFT_RULES}; received {draft_rule!r}")
        if draft_rule == "sample":
            fixed = "a tree (tree_nodes > 1)" if tree_nodes and tree_nodes > 1 else "draft_fn" if draft_fn else \
                "no drafter" if drafter is None else "a Markov head" if drafter.markov is not None else \
                "a path selector" if drafter.candidate_selector is not None else None
            if fixed:
                raise ValueError(f"draft_rule 'sample' draws the drafter's chain drafts from its per-slot "
                                 f"distributions; received it with {fixed} (use draft_rule 'argmax')")
        self.draft_rule = draft_rule
        if tree_nodes is not None and (not _is_int(tree_nodes) or tree_nodes < 0):
            raise ValueError(f"tree_nodes must be an integer >= 0 (0 or 1: the chain); received {tree_nodes!r}")
        self.tree_nodes = tree_nodes if tree_nodes is not None and tree_nodes > 1 else 0
        self.ngram = ngram
        self.ngram_only = ngram and drafter is None and block_size is not None
        if self.ngram_only:
            if self.tree_nodes:
                raise ValueError(f"tree_nodes needs a drafter; received tree_nodes={tree_nodes} with prompt "
                                 "lookup alone (ngram=True, drafter=None)")
            if block_size < 2:
                raise ValueError(f"block_size must be >= 2 for prompt lookup; received {block_size}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1; received {slots}")
        if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 16
                                          or prefill_chunk & (prefill_chunk - 1)):
            raise ValueError(f"prefill_chunk must be None or a power of two >= 16; received {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        if not _is_int(steps_per_dispatch) or steps_per_dispatch < 1:
            raise ValueError(f"steps_per_dispatch must be an integer >= 1; received {steps_per_dispatch!r}")
        self.steps_per_dispatch = steps_per_dispatch
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1; received {page_size}")
        self.proposer: Proposer
        if self.ngram_only:
            self.proposer = GivenProposals(block_size, self._ngram_drafts)
        elif block_size is None:
            drafter, self.proposer = None, NoDrafts()
        elif drafter is None:
            raise ValueError(f"a drafter is needed for block_size={block_size}; received None (None is for AR "
                             "mode, block_size=None)")
        elif not 2 <= block_size <= drafter.arch.block_size:
            raise ValueError(f"block_size must lie in [2, {drafter.arch.block_size}] (the drafter's training K) or "
                             f"be None for AR mode; received {block_size}")
        else:
            self.proposer = GivenProposals(block_size, draft_fn) if draft_fn else \
                DrafterProposals(block_size, draft_rule == "sample")
        self.models = Models.of(target_params, target_cfg, drafter)
        self.arch = None if drafter is None else drafter.arch
        self.k = self.proposer.block_size
        if self.tree_nodes and self.k < 2:
            raise ValueError(f"tree_nodes needs a drafter and block_size >= 2; received tree_nodes={tree_nodes}, "
                             f"block_size={block_size}")
        if self.tree_nodes and self.ngram and self.tree_nodes < 3:
            raise ValueError(f"tree_nodes must be >= 3 with ngram (nodes for the drafter and for the lookup path); "
                             f"received {tree_nodes}")
        self.tree_fn = tree_fn
        # tokens written into the target cache per step: the chain's K, or the tree's N nodes
        self.width = max(self.k, self.tree_nodes)
        self.ngram_nodes = min(self.k - 1, self.tree_nodes // 2) if self.tree_nodes and self.ngram else 0
        self.slots, self.max_len = slots, max_len
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.detokenize = detokenize
        self.compiled_shapes: set[tuple[Any, ...]] = set()
        self.compiles = 0  # programs compiled by this engine's calls (jit cache misses)
        self._ids = iter(range(1 << 62))
        self.queue: collections.deque[Completion] = collections.deque()
        self.running: dict[int, Completion] = {}  # slot -> request
        self.prefilling: dict[int, tuple[Completion, int]] = {}  # slot -> (request, prompt tokens prefilled)
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
        self.prefilling.clear()
        self.done.clear()
        self._fresh_state()

    def _worst_case_tokens(self, request: Completion) -> int:
        """Most tokens the request's slot ever holds: the prompt, its budget, and the last block's K."""
        return len(request.prompt_ids) + request.max_new_tokens + self.width

    def _prefill_len(self, n: int) -> int:
        """The padded length a prompt of n tokens is prefilled at: a power of two, at most max_len."""
        return min(bucket(n), self.max_len)

    def _sync_table(self) -> None:
        self.state, self._table_version = sync_page_table(self.state, self.table, self._table_version)

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
        the engine's fixed settings). Raises `RequestRejected` naming the field, the value and the rule."""
        prompt_ids = list(prompt_ids) if isinstance(prompt_ids, Sequence | np.ndarray) else prompt_ids
        _reject_unless(isinstance(prompt_ids, list) and len(prompt_ids) > 0, "prompt_ids",
                       f"prompt_ids must hold at least one token id; received {prompt_ids!r}")
        vocab = self.vocab_size
        for i, token in enumerate(prompt_ids):
            _reject_unless(_is_int(token) and 0 <= token < vocab, "prompt_ids",
                           f"prompt_ids[{i}] must be a token id in [0, {vocab}) (the model's vocabulary); "
                           f"received {token!r}")
        for i, token in enumerate(stop_ids):
            _reject_unless(_is_int(token) and 0 <= token < vocab, "stop_ids",
                           f"stop_ids[{i}] must be a token id in [0, {vocab}); received {token!r}")
        _reject_unless(_is_int(seed) and 0 <= seed < SEED_LIMIT, "seed",
                       f"seed must be an integer in [0, 2**63); received {seed!r}")
        for name, n in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            _reject_unless(n is None or (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS), name,
                           f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}]; received {n!r}")
        sampling = self.sampling if sampling is None else sampling
        if sampling is not None:
            _reject_unless(_is_int(sampling.top_k) and 0 <= sampling.top_k <= INT32_MAX, "sampling.top_k",
                           f"sampling.top_k must be an integer in [0, {INT32_MAX}]; received {sampling.top_k!r}")
            _reject_unless(bool(np.isfinite(sampling.temperature)), "sampling.temperature",
                           f"sampling.temperature must be a finite number >= 0; received {sampling.temperature!r}")
        stop_strings = tuple(stop_strings)
        _reject_unless(all(isinstance(text, str) and text for text in stop_strings), "stop_strings",
                       f"stop_strings must be non-empty strings; received {stop_strings!r}")
        if stop_strings and self.detokenize is None:
            raise RequestRejected("stop_strings", "stop_strings need an engine built with detokenize=...; "
                                  "received none")
        n = len(prompt_ids)
        room = self.max_len - n - self.width  # new tokens the context leaves (the last block's width reserved)
        if max_new_tokens is None:
            _reject_unless(room >= 1, "prompt_ids",
                           f"the prompt ({n} tokens) must leave room to generate in the context length max_len "
                           f"({self.max_len} tokens); received a prompt of {n} tokens, at most "
                           f"{self.max_len - self.width - 1} fit")
            max_new_tokens = room
        else:
            _reject_unless(_is_int(max_new_tokens) and max_new_tokens >= 1, "max_new_tokens",
                           f"max_new_tokens must be an integer >= 1 or None; received {max_new_tokens!r}")
            _reject_unless(max_new_tokens <= room, "max_new_tokens",
                           f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) must fit the context "
                           f"length max_len ({self.max_len} tokens); at most {max(room, 0)} new tokens fit after "
                           "this prompt")
        request = Completion(next(self._ids), [int(t) for t in prompt_ids], int(max_new_tokens),
                             tuple(int(t) for t in stop_ids), int(seed),
                             None if sampling is None or sampling.greedy else sampling, stop_strings, self.k,
                             submitted_s=time.perf_counter(), top_n=logprobs, prompt_top_n=prompt_logprobs)
        pages = self.pool.pages_for(self._worst_case_tokens(request))
        _reject_unless(pages <= self.pool.num_usable, "max_new_tokens",
                       f"the prompt ({n} tokens) plus max_new_tokens ({max_new_tokens}) needs {pages} pages of "
                       f"{self.pool.page_size} tokens, more than the whole pool ({self.pool.num_usable} usable); "
                       "lower max_new_tokens")
        return request

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
                request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
                self._settle_text(request)
                self.done[request_id] = request
                return True
        for slot, request in self.running.items():
            if request.request_id == request_id:
                request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
                self._settle_text(request)
                self._finish(slot)
                return True
        for slot, (request, _) in self.prefilling.items():
            if request.request_id == request_id:
                del self.prefilling[slot]
                request.finish_reason, request.finished_s = "cancelled", time.perf_counter()
                self._settle_text(request)
                self.done[request_id] = request
                self.table.release(slot)
                return True
        return False

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
        """Call a jitted program, counting the programs it compiled (`compiles`)."""
        before = _compile_count()
        try:
            return program(*args, **kwargs)
        finally:
            self.compiles += _compile_count() - before

    def _prefill_rows(self, n: int) -> int:
        """The padded row count of a prefill admitting n requests: a power of two, at most `slots`."""
        return min(bucket(n, minimum=1), self.slots)

    def _prefill(self, admitted: Sequence[tuple[int, Completion]]) -> tuple[list[int], TokenLogprobs | None]:
        """Prefill requests into their slots (pages already given) in one call, padded to a bucket of rows and
        of tokens; returns their first tokens and, for a single request asking for log-probabilities, the
        prompt's scores (a scored request is always prefilled alone: its logits cover every position)."""
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
        self._sync_table()
        scored = any(r.top_n is not None or r.prompt_top_n is not None for _, r in admitted)
        if scored and len(admitted) > 1:
            raise AssertionError("a scored request is prefilled alone")  # pragma: no cover - _admit's rule
        self._note_shape("prefill", tokens.shape)
        new = Admission(jnp.asarray(slots), jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(request_keys(seeds)),
                        SamplingRows.of(rules))
        scores = None
        if scored:
            self.state, scores = self._counted(prefill_logprobs, self.models, self.state, new)
            scores = jax.device_get(scores)
        else:
            self.state = self._counted(prefill, self.models, self.state, new)
        pending = np.asarray(self.state.pending)  # waits for the prefill
        return [int(pending[slot]) for slot, _ in admitted], scores

    def _admit(self) -> None:
        """Admit queued requests in order while a slot is free and the pool holds the head's worst case: all
        of them in one prefill call, except that a request asking for log-probabilities is prefilled alone."""
        free = [s for s in range(self.slots) if s not in self.running and s not in self.prefilling]
        while self.queue and free:
            batch: list[tuple[int, Completion]] = []
            while self.queue and free:
                slot, request = free[0], self.queue[0]
                alone = request.top_n is not None or request.prompt_top_n is not None
                chunked = not alone and self.prefill_chunk is not None and len(request.prompt_ids) > self.prefill_chunk
                if alone and batch:
                    break  # prefilled in the next call
                try:
                    self.table.ensure(slot, self._worst_case_tokens(request))
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
        longest = self.max_len - self.width - 1
        return [(start, span_pages(start + self.prefill_chunk, self.page_size, self.max_pages))
                for start in range(0, longest, self.prefill_chunk)]

    def _prefill_chunk(self, slot: int, request: Completion, start: int) -> int:
        """Prefill the prompt's next chunk (from token `start`) into `slot`; returns the tokens prefilled now."""
        chunk = self.prefill_chunk
        n = min(chunk, len(request.prompt_ids) - start)
        tokens = np.zeros((1, chunk), np.int32)
        tokens[0, :n] = request.prompt_ids[start:start + n]
        pages = span_pages(start + chunk, self.page_size, self.max_pages)
        self._sync_table()
        self._note_shape("prefill_chunk", (1, chunk, pages))
        new = Admission(jnp.asarray([slot], jnp.int32), jnp.asarray(tokens), jnp.asarray([n], jnp.int32),
                        jnp.asarray(request_keys([request.seed])), SamplingRows.of([request.sampling]))
        self.state = self._counted(prefill_chunk, self.models, self.state, new, jnp.asarray([start], jnp.int32),
                                   pages)
        return n

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
              positions: Sequence[int] = ()) -> None:
        """Append a step's tokens to the slot's request (scores[slot or 0, positions[i]] scores tokens[i]),
        ending it at a stop token, its budget or a stop string; then update its text."""
        request = self.running[slot]
        start = len(request.token_ids)
        reason = None
        row = 0 if scores is not None and scores.chosen.shape[0] == 1 else slot
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            if request.top_n is not None and scores is not None:
                request.token_logprobs.append(float(scores.chosen[row, positions[i]]))
                request.top_logprobs.append(self._top(scores, row, positions[i], request.top_n))
            if token in request.stop_ids or len(request.token_ids) >= request.max_new_tokens:
                reason = "stop" if token in request.stop_ids else "length"
                break
        if request.stop_strings and self._cut_at_stop_string(request, start):
            reason = "stop"
        if reason is not None:
            request.finish_reason = reason
            request.finished_s = time.perf_counter()
        self._update_text(request)
        if reason is not None:
            self._finish(slot)

    def _visible_text(self, request: Completion, end: int | None = None) -> str:
        ids = request.token_ids if end is None else request.token_ids[:end]
        return self.detokenize([t for t in ids if t not in request.stop_ids])

    def _update_text(self, request: Completion) -> None:
        """`text` and `stable_text` (see `Completion`) after new tokens; the text is cut at a stop string."""
        if self.detokenize is None:
            request.stable_tokens = len(request.token_ids)
            return
        text = self._visible_text(request)
        if request.stop_string is not None:
            text = text[:min(text.index(s) for s in request.stop_strings if s in text)]
        request.text = text
        if request.finish_reason is not None:
            request.stable_text, request.stable_tokens = text, len(request.token_ids)
            return
        stable = text
        while stable.endswith("\ufffd"):  # an incomplete UTF-8 character (its bytes are still coming)
            stable = stable[:-1]
        stable = stable[:len(stable) - _held_back(stable, request.stop_strings)]
        if len(stable) <= len(request.stable_text) or not stable.startswith(request.stable_text):
            return  # stable text only grows
        m = len(request.token_ids)
        if stable != text:  # the tokens whose text is all stable
            while m > request.stable_tokens:
                prefix = self._visible_text(request, m)
                if not prefix.endswith("\ufffd") and stable.startswith(prefix):
                    break
                m -= 1
        request.stable_text, request.stable_tokens = stable, m

    def _settle_text(self, request: Completion) -> None:
        """Finished by the caller (cancelled): what was generated is final."""
        if self.detokenize is not None:
            request.text = self._visible_text(request) if request.stop_string is None else request.text
        request.stable_text, request.stable_tokens = request.text, len(request.token_ids)

    def _cut_at_stop_string(self, request: Completion, start: int) -> bool:
        """If the text now holds a stop string, keep the tokens up to the first one whose text completes it
        (searching only from the tokens added at `start`); returns whether one matched."""
        text = self._visible_text(request)
        if not any(s in text for s in request.stop_strings):
            return False
        for end in range(start + 1, len(request.token_ids) + 1):
            text = self._visible_text(request, end)
            hits = [s for s in request.stop_strings if s in text]
            if hits:
                request.stop_string = min(hits, key=text.index)
                del request.token_ids[end:]
                del request.token_logprobs[end:]
                del request.top_logprobs[end:]
                return True
        raise AssertionError("unreachable: the full text holds a stop string")  # pragma: no cover

    def _lookup(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Prompt lookup for every running slot: (continuations [B, length] int32, their lengths [B])."""
        paths = np.zeros((self.slots, length), np.int32)
        lengths = np.zeros(self.slots, np.int32)
        for slot, request in self.running.items():
            found = ngram_continuation(request.prompt_ids + request.token_ids, length)
            paths[slot, :len(found)] = found
            lengths[slot] = len(found)
        return paths, lengths

    def _ngram_drafts(self, state: SpecState, k: int) -> np.ndarray:
        """Prompt lookup alone: the chain's K - 1 drafts (a short or missing match padded with token 0)."""
        return self._lookup(k - 1)[0]

    def _tree(self, span: int) -> Tree:
        """This step's trees: the drafter's (or `tree_fn`'s) ranked lists, best-first, plus the lookup path."""
        m = self.tree_nodes - 1 - self.ngram_nodes
        if self.tree_fn is not None:
            ids, logp = (jnp.asarray(a) for a in self.tree_fn(self.state, self.k, m))
        else:
            ids, logp = self._counted(propose_topk, self.models, self.state, self.k, m, span)
        extra = extra_len = None
        if self.ngram_nodes:
            extra, extra_len = (jnp.asarray(a) for a in self._lookup(self.ngram_nodes))
        return self._counted(build_tree, ids, logp, self.state.pending, self.tree_nodes, extra, extra_len)

    def _device_step(self, pages: int, scored: bool) -> tuple[jax.Array, jax.Array, TokenLogprobs | None]:
        """One propose + verify over every slot at an attention span of `pages` pages; (tokens, n, scores)."""
        if self.tree_nodes:
            self._note_shape("verify_tree", (self.slots, self.k, self.tree_nodes, pages))
            tree = self._tree(pages * self.page_size)
            if scored:
                self.state, out, n, scores = self._counted(verify_tree_logprobs, self.models, self.state, tree,
                                                           self.k, pages)
                return out, n, scores
            self.state, out, n = self._counted(verify_tree, self.models, self.state, tree, self.k, pages)
            return out, n, None
        self._note_shape("verify", (self.slots, self.k, pages))
        drafts, law = self._counted(self.proposer, self.models, self.state, pages * self.page_size), None
        if isinstance(drafts, tuple):
            drafts, law = drafts
        if scored:
            self.state, out, n, scores = self._counted(verify_logprobs, self.models, self.state, drafts, pages, law)
            return out, n, scores
        self.state, out, n = self._counted(verify, self.models, self.state, drafts, pages, law)
        return out, n, None

    def step(self) -> None:
        """Admit what fits (one chunk of a long prompt at most), then one propose + verify over every running
        request. A request whose host-side
        work raises ends alone (finish_reason "error"); a failing device call raises (reset the engine)."""
        self._admit()
        self._prefill_next_chunk()
        if not self.running:
            return
        active = np.zeros(self.slots, bool)
        active[list(self.running)] = True
        self.state = self._counted(_set_active, self.state, jnp.asarray(active))
        # Verify appends K tokens per active slot; admission already reserved them, so this only raises on a
        # bookkeeping bug.
        self.table.ensure_batch(np.where(active, self.lengths + self.width, 0))
        self._sync_table()
        # Attention sees only the pages in use, bucketed to a power of two (a bounded number of shapes).
        pages = span_pages(int(self.lengths[active].max()) + self.width, self.page_size, self.max_pages)
        scored = any(r.top_n is not None for r in self.running.values())
        if self._loop_steps(scored) > 1:
            self._loop(active)
            return
        out, n, scores = self._device_step(pages, scored)
        out, n = np.asarray(out), np.asarray(n)
        scores = None if scores is None else jax.device_get(scores)
        self.lengths = np.where(active, self.lengths + n + 1, self.lengths)
        self.steps += 1
        for slot, request in list(self.running.items()):
            try:
                before = len(request.token_ids)
                self._emit(slot, [int(t) for t in out[slot, : n[slot] + 1]], scores, range(n[slot] + 1))
                if not self.ar:  # what was emitted: a stop or the budget may cut the step short of n + 1 tokens
                    request.accepted.append(len(request.token_ids) - before - 1)
            except Exception as err:  # noqa: BLE001 - one request's host-side failure ends it alone
                self._fail(request, slot, err)

    def _loop_steps(self, scored: bool) -> int:
        """Decode steps the next dispatch may run: 1 unless the device loop applies and no prompt is part way
        through its chunked prefill (which then takes a chunk per step, not per R steps)."""
        looped = isinstance(self.proposer, DrafterProposals | NoDrafts) and self.tree_fn is None
        return self.steps_per_dispatch if looped and not scored and not self.prefilling else 1

    def _loop_pages(self, lengths_B: np.ndarray) -> int:
        """The attention span of a device loop over slots holding lengths_B tokens (0: inactive)."""
        most = int(lengths_B.max()) + self.steps_per_dispatch * self.width
        return span_pages(min(most, self.max_len), self.page_size, self.max_pages)

    def _history(self) -> tuple[np.ndarray, np.ndarray]:
        """Each running slot's prompt and output so far (the tokens prompt lookup searches): ([slots, max_len]
        int32, lengths [slots])."""
        history = np.zeros((self.slots, self.max_len), np.int32)
        sizes = np.zeros(self.slots, np.int32)
        for slot, request in self.running.items():
            tokens = (request.prompt_ids + request.token_ids)[:self.max_len]
            history[slot, :len(tokens)] = tokens
            sizes[slot] = len(tokens)
        return history, sizes

    def _dispatch(self, stop_ids: jax.Array, budget: jax.Array, pages: int) -> tuple[Any, ...]:
        """One device loop of up to R steps (the chain's or the tree's); (state, tokens, n, steps run)."""
        r = self.steps_per_dispatch
        if not self.tree_nodes:
            self._note_shape("decode_steps", (self.slots, self.k, stop_ids.shape[1], r, pages))
            return self._counted(decode_steps, self.models, self.state, stop_ids, budget, self.k, r, pages,
                                 self.draft_rule == "sample")
        self._note_shape("decode_tree_steps", (self.slots, self.k, self.tree_nodes, stop_ids.shape[1], r, pages))
        history = sizes = None
        if self.ngram_nodes:
            history, sizes = (jnp.asarray(a) for a in self._history())
        return self._counted(decode_tree_steps, self.models, self.state, stop_ids, budget, history, sizes, self.k,
                             self.tree_nodes, self.ngram_nodes, r, pages)

    def _loop(self, active: np.ndarray) -> None:
        """Up to R decode steps in one dispatch (`decode_steps`), then each step's tokens emitted in order."""
        stops = bucket(max(len(r.stop_ids) for r in self.running.values()), minimum=8)  # few shapes
        stop_ids = np.full((self.slots, stops), -1, np.int32)
        budget = np.full(self.slots, INT32_MAX, np.int32)
        for slot, request in self.running.items():
            stop_ids[slot, :len(request.stop_ids)] = request.stop_ids
            budget[slot] = request.max_new_tokens - len(request.token_ids)
        pages = self._loop_pages(np.where(active, self.lengths, 0))
        self.state, out, n, ran = self._dispatch(jnp.asarray(stop_ids), jnp.asarray(budget), pages)
        ran = int(ran)
        out, n = (np.asarray(a[:ran]) for a in jax.device_get((out, n)))
        for i in range(ran):
            self.lengths = np.where(active, self.lengths + n[i] + 1, self.lengths)
            self.steps += 1
            for slot, request in list(self.running.items()):
                if not active[slot]:
                    continue
                try:
                    before = len(request.token_ids)
                    self._emit(slot, [int(t) for t in out[i, slot, : n[i, slot] + 1]])
                    if not self.ar:
                        request.accepted.append(len(request.token_ids) - before - 1)
                except Exception as err:  # noqa: BLE001 - one request's host-side failure ends it alone
                    self._fail(request, slot, err)
            active = active & np.isin(np.arange(self.slots), list(self.running))  # a stop string ends one early

    def precompile(self, *, logprobs: bool = True) -> tuple[int, float]:
        """Compile every program the engine can use (each prefill length up to max_len and each attention span,
        with and without log-probabilities) by running each once on empty slots; afterwards no request
        compiles. logprobs=False leaves out the log-probability variants (half the programs), for a server
        whose only client never asks for them (`dflash eval`'s in-process servers). Needs an idle engine;
        returns (programs compiled, seconds)."""
        if self.busy:
            raise RuntimeError("precompile needs an idle engine; requests are queued or running")
        t0, before = time.perf_counter(), self.compiles
        longest = self.max_len - self.width - 1  # the longest prompt that leaves room for one token
        lengths = sorted({self._prefill_len(n) for n in range(1, longest + 1)})
        spans = sorted({span_pages(t, self.page_size, self.max_pages) for t in range(1 + self.width, self.max_len + 1)})
        variants = (False, True) if logprobs else (False,)
        rows = sorted({self._prefill_rows(r) for r in range(1, self.slots + 1)})
        whole = lengths if self.prefill_chunk is None else [n for n in lengths if n <= self.prefill_chunk]
        for length in lengths:
            for scored in variants:
                if not scored and length not in whole:
                    continue  # a longer unscored prompt is prefilled in chunks
                for r in rows if not scored else (1,):  # a scored request is prefilled alone
                    probes = [(slot, Completion(-1, [0] * min(length, longest), 1, (), 0, top_n=0 if scored else None))
                              for slot in range(r)]
                    for slot, probe in probes:
                        self.table.ensure(slot, len(probe.prompt_ids) + 1 + self.width)
                    self._prefill(probes)
                    for slot, _ in probes:
                        self.table.release(slot)
        chunks = [] if self.prefill_chunk is None else sorted({span for _, span in self._chunk_spans()})
        for span in chunks:
            start = max(s for s, p in self._chunk_spans() if p == span)
            probe = Completion(-1, [0] * (start + 1), 1, (), 0)
            self.table.ensure(0, start + 1 + self.width)
            self._prefill_chunk(0, probe, start)
            self.table.release(0)
        self.state = self._counted(_set_active, self.state, jnp.zeros(self.slots, bool))
        self._sync_table()
        for pages in spans:
            for scored in variants:
                jax.block_until_ready(self._device_step(pages, scored))
            if self._loop_steps(False) > 1:
                self.state, *outputs = self._dispatch(jnp.full((self.slots, 8), -1, jnp.int32),
                                                      jnp.ones(self.slots, jnp.int32), pages)
                jax.block_until_ready(outputs)
        self._fresh_state()
        seconds = time.perf_counter() - t0
        log.info("engine: precompiled %d programs (%d prefill lengths x %d row counts, %d prefill chunk spans, %d "
                 "attention spans) in %.1f s", self.compiles - before, len(lengths), len(rows), len(chunks), len(spans),
                 seconds)
        return self.compiles - before, seconds

    def run(self) -> dict[int, Completion]:
        """Step until every submitted request is done; returns all finished requests by id."""
        while self.busy:
            self.step()
        return self.done


def decode(target_params: Params, target_cfg: DecoderConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           *, max_len: int, drafter: DFlashDrafter | None = None, block_size: int | None = None,
           stop_ids: Sequence[int] = (), sampling: SamplingConfig | None = None, seeds: Sequence[int] | None = None,
           draft_fn: Callable[[SpecState, int], Any] | None = None,
           on_token: Callable[[int], None] | None = None, tree_nodes: int | None = None, ngram: bool = False,
           tree_fn: Callable[[SpecState, int, int], Any] | None = None,
           prefill_chunk: int | None = None, draft_rule: str = "argmax") -> list[Completion]:
    """Decode `prompts` together, one slot each, through the engine: AR without a drafter, else DFlash at
    `block_size` (default: the drafter's training K). Greedy DFlash equals AR token for token; sampled
    DFlash has AR sampling's distribution.

    seeds: one per prompt (default: sampling.seed + index); on_token: called with each new token of a
    single prompt as the engine emits it (streaming); tree_nodes, ngram, tree_fn, prefill_chunk, draft_rule: as
    `Engine` (prompt lookup alone: ngram with block_size and no drafter)."""
    if not prompts:
        raise ValueError("prompts must be a non-empty list of non-empty token lists; received none")
    if on_token is not None and len(prompts) != 1:
        raise ValueError(f"on_token streams one prompt; received {len(prompts)}")
    k = None if drafter is None else (block_size or drafter.arch.block_size)
    k = block_size if drafter is None and ngram else k
    seeds = [(sampling.seed if sampling else 0) + i for i in range(len(prompts))] if seeds is None else seeds
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds must hold one seed per prompt ({len(prompts)}); received {len(seeds)}")
    engine = Engine(target_params, target_cfg, drafter, slots=len(prompts), max_len=max_len, block_size=k,
                    draft_fn=draft_fn, sampling=sampling, tree_nodes=tree_nodes, ngram=ngram, tree_fn=tree_fn,
                    prefill_chunk=prefill_chunk, draft_rule=draft_rule)
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


__all__ = ["Completion", "DrafterProposals", "Engine", "GivenProposals", "NoDrafts", "Proposer", "RequestRejected",
           "decode", "request_keys"]
