"""The decode plan: what each engine step drafts and how it verifies (docs/decisions.md D68).

    plan = plan_from(recipe.serve, drafter)                 # a recipe's serve section, validated here once
    engine = Engine(target.params, target.cfg, drafter, plan, Limits(slots=8, max_len=2048))

    AR()                      the target alone: each step verifies the pending token (K = 1)
    Chain(k, rule)            the drafter's K - 1 drafts from one forward, verified as a chain; sampled requests
                              take the argmax drafts (rule "argmax") or drafts drawn from the drafter ("sample")
    Tree(k, nodes, lookup, rule)
                              a best-first tree of N nodes (depth <= K - 1) from the block's distributions,
                              optionally with a prompt-lookup path merged in (`serve.tree`); sampled requests
                              take the top-ranked tokens as children (rule "argmax") or children drawn from the
                              drafter ("sample"), verified by recursive rejection sampling
    Lookup(k)                 prompt lookup alone, no drafter: K - 1 drafts continuing the latest earlier match of
                              the last tokens in the prompt and output (`serve.lookup`)

A plan is a small frozen value that validates its own fields when built and owns its device work: `step` (one
propose + verify over every slot, optionally scoring log-probabilities) and, where a whole step can run on the
device, `loop` (up to R steps in one dispatch). The engine (`serve.engine`) owns slots, pages and requests and
never asks which plan it runs. `Limits` holds what the engine is sized for.

Tests replace the drafter's proposals through `Chain.drafts` ((state, K) -> [B, K - 1]), the tree's ranked lists
through `Tree.ranked` ((state, K, m) -> (ids, logp) [B, J, C]) and the drafter's logits under a tree through
`Tree.logits` ((state, K) -> [B, K - 1, V]); such plans run one step per dispatch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.drafter import DFlashDrafter
from dflash.serve.config import DRAFT_RULES, ServeConfig, lookup_fits
from dflash.serve.requests import is_int
from dflash.serve.speculative import Models, SpecState, TokenLogprobs, decode_steps, propose, verify, verify_logprobs
from dflash.serve.tree import (
    TreeLoop,
    build_tree,
    decode_tree_steps,
    propose_topk,
    rank_drafts,
    verify_tree,
    verify_tree_logprobs,
)

# Host-side prompt lookup of the running slots: length -> (continuations [B, length] int32, their lengths [B]).
LookupFn = Callable[[int], tuple[np.ndarray, np.ndarray]]
# The running slots' token histories for lookup on the device: () -> (tokens [B, H] int32, sizes [B]).
HistoryFn = Callable[[], tuple[np.ndarray, np.ndarray]]
StepOut = tuple[SpecState, jax.Array, jax.Array, TokenLogprobs | None]  # (state, tokens [B, K], accepted [B], scores)
LoopOut = tuple[SpecState, jax.Array, jax.Array, jax.Array]  # (state, tokens [I, B, K], accepted [I, B], steps run)
# How a step calls each jitted program: `run` calls it; the engine's precompile passes one that compiles it ahead of
# time and returns the shapes of its outputs instead (`Engine.precompile`).
Call = Callable[..., Any]


def run(program: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return program(*args, **kwargs)


def _require(ok: bool, field: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{field} must {rule}; received {value!r}")


class Plan:
    """What every plan has: `k` (the block verified per step: the chain's length, the tree's depth bound + 1),
    `width` (tokens a step writes into the target cache past the committed ones), whether it `drafts` with the
    drafter, `check(drafter)` (what it needs of the drafter), `step`, and `loop` where `loops`."""

    k: int
    drafts_with_drafter: ClassVar[bool] = True
    kernel: ClassVar[str] = "verify"  # the name its step's shapes are logged under (`Engine.compiled_shapes`)

    @property
    def ar(self) -> bool:
        return self.k == 1

    @property
    def width(self) -> int:
        return self.k

    @property
    def loops(self) -> bool:
        """Whether up to R steps can run in one device loop (`loop`); else one step per dispatch."""
        return True

    def check(self, drafter: DFlashDrafter | None) -> None:
        """Refuse a drafter this plan cannot draft with (ValueError naming the field)."""
        if not self.drafts_with_drafter:
            return
        _require(drafter is not None, "drafter", drafter, f"be given for {self.describe()}")
        _require(self.k <= drafter.arch.block_size, "block_size", self.k,
                 f"lie in [2, {drafter.arch.block_size}] (the drafter's training K)")

    def shape(self, slots: int, pages: int) -> tuple[Any, ...]:
        """The key its step's program is logged under: (kernel, slots, K, attention span in pages)."""
        return (self.kernel, slots, self.k, pages)

    def loop_shape(self, slots: int, stops: int, steps: int, pages: int) -> tuple[Any, ...]:
        return ("decode_steps", slots, self.k, stops, steps, pages)

    def step(self, models: Models, state: SpecState, pages: int, scored: bool, lookup: LookupFn,
             call: Call = run) -> StepOut:
        """One propose + verify over every slot at an attention span of `pages` pages (scored: also the target's
        log-probabilities of the output); each jitted program is called through `call`."""
        raise NotImplementedError

    def loop(self, models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, steps: int,
             pages: int, history: HistoryFn) -> LoopOut:
        """Up to `steps` steps in one device loop (`speculative.run_steps`'s exit rules)."""
        program, args = self.loop_call(models, state, stop_ids_BxZ, budget_B, steps, pages, history)
        return program(*args)

    def loop_call(self, models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, steps: int,
                  pages: int, history: HistoryFn) -> tuple[Any, tuple[Any, ...]]:
        """The one jitted program `loop` runs and its arguments (the engine compiles it ahead of time)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def _verify_chain(models: Models, state: SpecState, drafts: Any, pages: int, scored: bool, call: Call) -> StepOut:
    """Verify a chain of drafts: [B, K-1], or (drafts, law) when they were drawn from the drafter."""
    drafts, law = drafts if isinstance(drafts, tuple) else (drafts, None)
    if scored:
        return call(verify_logprobs, models, state, drafts, pages, law)
    return (*call(verify, models, state, drafts, pages, law), None)


@dataclasses.dataclass(frozen=True)
class AR(Plan):
    """The target alone: each step verifies the pending token (K = 1). A drafter given to the engine is unused."""

    k: int = dataclasses.field(default=1, init=False)
    drafts_with_drafter: ClassVar[bool] = False

    def step(self, models: Models, state: SpecState, pages: int, scored: bool, lookup: LookupFn,
             call: Call = run) -> StepOut:
        return _verify_chain(models, state, jnp.zeros((state.pending.shape[0], 0), jnp.int32), pages, scored, call)

    def loop_call(self, models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, steps: int,
                  pages: int, history: HistoryFn) -> tuple[Any, tuple[Any, ...]]:
        return decode_steps, (models, state, stop_ids_BxZ, budget_B, 1, steps, pages)

    def describe(self) -> str:
        return "AR"


@dataclasses.dataclass(frozen=True)
class Chain(Plan):
    """The drafter's K - 1 drafts from one forward over the block, verified as a chain (`speculative.propose`,
    `verify`). rule: how a sampled request's drafts are chosen, "argmax" (one-hot drafts, accepted with probability
    p(d)) or "sample" (drawn from the drafter's distribution under the request's rule, accepted with
    min(1, p(d) / q(d))); both lossless, greedy requests unaffected (D64). drafts: (state, K) -> [B, K - 1] in place
    of the drafter's (tests)."""

    k: int
    rule: str = "argmax"
    drafts: Callable[[SpecState, int], Any] | None = None

    def __post_init__(self) -> None:
        _require(is_int(self.k) and self.k >= 2, "block_size", self.k, "be an integer >= 2 for a chain of drafts")
        _require(self.rule in DRAFT_RULES, "draft_rule", self.rule, f"be one of {DRAFT_RULES}")
        _require(self.rule == "argmax" or self.drafts is None, "draft_rule", self.rule,
                 "be argmax with given drafts (sampled drafts are drawn from the drafter's distributions)")

    @property
    def loops(self) -> bool:
        return self.drafts is None

    def check(self, drafter: DFlashDrafter | None) -> None:
        super().check(drafter)
        _require(self.rule == "argmax" or drafter.candidate_selector is None, "draft_rule", self.rule,
                 "be argmax for a drafter with DFlash2's path selector (sample draws each slot from the drafter's "
                 "independent per-slot distributions)")

    def step(self, models: Models, state: SpecState, pages: int, scored: bool, lookup: LookupFn,
             call: Call = run) -> StepOut:
        if self.drafts is not None:
            drafts = jnp.asarray(self.drafts(state, self.k), jnp.int32)
        else:
            drafts = call(propose, models, state, self.k, pages * state.target.page_size, sample=self.rule == "sample")
        return _verify_chain(models, state, drafts, pages, scored, call)

    def loop_call(self, models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, steps: int,
                  pages: int, history: HistoryFn) -> tuple[Any, tuple[Any, ...]]:
        return decode_steps, (models, state, stop_ids_BxZ, budget_B, self.k, steps, pages, self.rule == "sample")

    def describe(self) -> str:
        return f"DFlash K={self.k}" + (", sampled drafts" if self.rule == "sample" else "")


@dataclasses.dataclass(frozen=True)
class Tree(Plan):
    """A best-first tree of `nodes` nodes (depth <= K - 1) built from the block's per-position distributions and
    verified in one target pass (`serve.tree`); with `lookup`, a prompt-lookup path of `lookup_nodes` nodes is
    merged in. rule: a sampled request's children, "argmax" (the drafter's top-ranked tokens, point-mass drafts) or
    "sample" (drawn from the drafter's law without replacement, in the shape the argmax tree would have); both
    verified by recursive rejection sampling, lossless; greedy requests unaffected (D84). ranked: (state, K, m) ->
    the ranked lists (ids, logp) [B, J, C] in place of the drafter's (tests, rule argmax); logits: (state, K)
    -> the drafter's logits [B, K - 1, V'] over its rows (its draft vocabulary's, if any) in place of its forward,
    ranked or drawn from by the rule (tests)."""

    k: int
    nodes: int
    lookup: bool = False
    rule: str = "argmax"
    ranked: Callable[[SpecState, int, int], Any] | None = None
    logits: Callable[[SpecState, int], Any] | None = None
    kernel: ClassVar[str] = "verify_tree"

    def __post_init__(self) -> None:
        _require(is_int(self.k) and self.k >= 2, "block_size", self.k, "be an integer >= 2 for a tree of drafts")
        _require(is_int(self.nodes) and self.nodes >= 2, "tree_nodes", self.nodes,
                 "be an integer >= 2 (a chain is `Chain`)")
        _require(not self.lookup or lookup_fits(self.nodes), "tree_nodes", self.nodes,
                 "be >= 3 with prompt lookup (nodes for the drafter and for the lookup path)")
        _require(self.rule in DRAFT_RULES, "draft_rule", self.rule, f"be one of {DRAFT_RULES}")
        _require(self.rule == "argmax" or self.ranked is None, "draft_rule", self.rule,
                 "be argmax with given ranked lists (sampled children are drawn from the drafter's law: give logits)")
        _require(self.ranked is None or self.logits is None, "ranked", self.ranked,
                 "be None when logits are given (the lists are ranked from them)")

    @property
    def width(self) -> int:
        return max(self.k, self.nodes)

    @property
    def lookup_nodes(self) -> int:
        """Nodes of the prompt-lookup path (0 without lookup)."""
        return min(self.k - 1, self.nodes // 2) if self.lookup else 0

    @property
    def loops(self) -> bool:
        return self.ranked is None and self.logits is None

    def check(self, drafter: DFlashDrafter | None) -> None:
        super().check(drafter)
        _require(drafter.candidate_selector is None, "tree_nodes", self.nodes,
                 "be 0 (the chain) for a drafter with DFlash2's path selector: its drafts depend on the token chosen "
                 "before them, so the block's positions cannot branch independently")

    def shape(self, slots: int, pages: int) -> tuple[Any, ...]:
        return (self.kernel, slots, self.k, self.nodes, pages)

    def loop_shape(self, slots: int, stops: int, steps: int, pages: int) -> tuple[Any, ...]:
        return ("decode_tree_steps", slots, self.k, self.nodes, stops, steps, pages)

    def step(self, models: Models, state: SpecState, pages: int, scored: bool, lookup: LookupFn,
             call: Call = run) -> StepOut:
        m = self.nodes - 1 - self.lookup_nodes
        sample = self.rule == "sample"
        if self.ranked is not None:
            ranked = tuple(jnp.asarray(a) for a in self.ranked(state, self.k, m))
        elif self.logits is not None:
            ranked = _rank_drafts(jnp.asarray(self.logits(state, self.k), jnp.float32), state, m, models.draft_ids,
                                  sample=sample)
        else:
            ranked = call(propose_topk, models, state, self.k, m, pages * state.target.page_size, sample=sample)
        extra = extra_len = None
        if self.lookup_nodes:
            extra, extra_len = (jnp.asarray(a) for a in lookup(self.lookup_nodes))
        tree = call(build_tree, *ranked[:2], state.pending, self.nodes, extra, extra_len, *ranked[2:])
        if scored:
            return call(verify_tree_logprobs, models, state, tree, self.k, pages)
        return (*call(verify_tree, models, state, tree, self.k, pages), None)

    def loop_call(self, models: Models, state: SpecState, stop_ids_BxZ: jax.Array, budget_B: jax.Array, steps: int,
                  pages: int, history: HistoryFn) -> tuple[Any, tuple[Any, ...]]:
        tokens = sizes = None
        if self.lookup_nodes:
            tokens, sizes = (jnp.asarray(a) for a in history())
        return decode_tree_steps, (models, state, stop_ids_BxZ, budget_B, tokens, sizes,
                                   TreeLoop(self.k, self.nodes, self.lookup_nodes, steps, pages, self.rule == "sample"))

    def describe(self) -> str:
        return (f"DFlash K={self.k}, tree of {self.nodes} nodes" + (" + prompt lookup" if self.lookup else "")
                + (", sampled drafts" if self.rule == "sample" else ""))


@dataclasses.dataclass(frozen=True)
class Lookup(Plan):
    """Prompt lookup alone, no drafter: each step's K - 1 drafts continue the latest earlier match of the last
    tokens in the request's prompt and output (a short or missing match padded with token 0); verified as a
    chain. A drafter given to the engine is unused."""

    k: int
    drafts_with_drafter: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _require(is_int(self.k) and self.k >= 2, "block_size", self.k, "be an integer >= 2 for prompt lookup")

    @property
    def loops(self) -> bool:
        return False

    def step(self, models: Models, state: SpecState, pages: int, scored: bool, lookup: LookupFn,
             call: Call = run) -> StepOut:
        return _verify_chain(models, state, jnp.asarray(lookup(self.k - 1)[0]), pages, scored, call)

    def describe(self) -> str:
        return f"prompt lookup K={self.k}"


_rank_drafts = jax.jit(rank_drafts, static_argnames=("m", "sample"))

DecodePlan = AR | Chain | Tree | Lookup


class Chooser(Protocol):
    """Picks what a recipe leaves to measurement (`serve.block_size: auto`, `serve.tree_nodes: auto`):
    `serve.acceptance.Measured`."""

    def block_size(self, drafter: DFlashDrafter) -> int: ...

    def tree_nodes(self, drafter: DFlashDrafter, k: int, lookup: bool) -> int: ...


def default_plan(drafter: DFlashDrafter | None) -> DecodePlan:
    """AR without a drafter, else its chain at its training K (what `decode` and the in-process servers run when
    given no plan)."""
    return AR() if drafter is None else Chain(drafter.arch.block_size)


def plan_from(serve: ServeConfig, drafter: DFlashDrafter | None, chooser: Chooser | None = None) -> DecodePlan:
    """The plan a recipe's `serve` section asks for, with `drafter` (None: AR): K is serve.block_size (0: the
    drafter's training K); serve.tree_nodes N > 1 makes a tree (with serve.tree_ngram, prompt lookup merged in),
    0 or 1 the chain, either with serve.draft_rule; "auto" values are measured by `chooser`. The plan is checked against
    the drafter here; this is the only place a recipe becomes a plan."""
    if drafter is None:
        return AR()
    k = serve.block_size or drafter.arch.block_size
    if k == "auto":
        _require(chooser is not None, "serve.block_size", k, "be a number here (auto needs measurements)")
        k = chooser.block_size(drafter)
    nodes = serve.tree_nodes
    if nodes == "auto":
        _require(chooser is not None, "serve.tree_nodes", nodes, "be a number here (auto needs measurements)")
        nodes = chooser.tree_nodes(drafter, k, serve.tree_ngram)
    plan: DecodePlan = Tree(k, nodes, serve.tree_ngram and lookup_fits(nodes), serve.draft_rule) if nodes > 1 \
        else Chain(k, serve.draft_rule)
    plan.check(drafter)
    return plan


@dataclasses.dataclass(frozen=True)
class Limits:
    """What an engine is sized for: `slots` sequences decoded together, `max_len` tokens of context per slot, the
    target cache's pages (`page_size` tokens each; `num_pages` default: every slot at max_len, plus the null page),
    `prefill_chunk` (a prompt longer than this many tokens, a power of two >= 16, is prefilled one chunk per engine
    step between the running requests' decode steps; None: every prompt in one call; a request asking for
    log-probabilities always is), `steps_per_dispatch` (R > 1: up to R decode steps in one device loop, back to
    the host after R steps or the first step in which a request hits a stop id or its budget; plans that do not
    `loop`, and steps that score log-probabilities, run one step per dispatch) and `devices` (the first this many
    of the host's devices hold the engine: the target's weights and paged K/V split over them in tensor parallel,
    the drafter replicated; `models.sharding`)."""

    slots: int
    max_len: int
    page_size: int = 16
    num_pages: int | None = None
    prefill_chunk: int | None = None
    steps_per_dispatch: int = 1
    devices: int = 1

    def __post_init__(self) -> None:
        _require(is_int(self.slots) and self.slots >= 1, "slots", self.slots, "be an integer >= 1")
        _require(is_int(self.max_len) and self.max_len >= 2, "max_len", self.max_len, "be an integer >= 2")
        _require(is_int(self.page_size) and self.page_size >= 1, "page_size", self.page_size, "be an integer >= 1")
        _require(self.num_pages is None or (is_int(self.num_pages) and self.num_pages >= 2), "num_pages",
                 self.num_pages, "be None or an integer >= 2 (page 0 is the reserved null page)")
        c = self.prefill_chunk
        _require(c is None or (is_int(c) and c >= 16 and c & (c - 1) == 0), "prefill_chunk", c,
                 "be None or a power of two >= 16")
        _require(is_int(self.steps_per_dispatch) and self.steps_per_dispatch >= 1, "steps_per_dispatch",
                 self.steps_per_dispatch, "be an integer >= 1")
        _require(is_int(self.devices) and self.devices >= 1, "devices", self.devices, "be an integer >= 1")

    @property
    def max_pages(self) -> int:
        """Page-table entries per slot."""
        return -(-self.max_len // self.page_size)

    @property
    def pages(self) -> int:
        """Pages in the pool, the null page included."""
        return self.slots * self.max_pages + 1 if self.num_pages is None else self.num_pages


__all__ = ["AR", "Chain", "Chooser", "DecodePlan", "Limits", "Lookup", "Plan", "Tree", "default_plan", "plan_from"]
