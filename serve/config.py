"""The `sampling` section of a recipe (how the next token is chosen; greedy when temperature == 0) and the `serve`
section (what the engine drafts and verifies: `serve.plan.plan_from` turns it into the engine's decode plan)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from dflash.configs.schema import require

DRAFT_RULES = ("argmax", "sample")  # how a sampled request's drafts are chosen (`ServeConfig.draft_rule`)


def lookup_fits(nodes: int) -> bool:
    """Whether a tree of `nodes` nodes has room for a prompt-lookup path beside the drafter's nodes."""
    return nodes >= 3


MAX_TEMPERATURE = 100.0
TEMPERATURE_RULE = f"be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"


def temperature_ok(value: float) -> bool:
    """The one rule for a temperature (a recipe's, a request's, an engine caller's): finite, in [0, 100]."""
    return 0.0 <= value <= MAX_TEMPERATURE  # NaN and infinity fail the comparison


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        require(temperature_ok(self.temperature), "sampling.temperature", self.temperature, TEMPERATURE_RULE)
        require(0.0 < self.top_p <= 1.0, "sampling.top_p", self.top_p, "lie in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "be >= 0 (0 disables top-k)")
        require(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens, "be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What the engine drafts and verifies (`dflash serve`, `dflash eval`'s servers, the demo's evaluation, the
    in-loop real τ's draft rule); `serve.plan.plan_from` makes the engine's plan of it. `dflash serve`'s flags
    --block-size, --tree-nodes, --tree-ngram and --draft-rule set these fields.

    block_size: K at inference, 0 for the drafter's training K, or "auto": the K with the most expected tokens per
    second from the drafter's acceptance and step costs measured at start-up (`serve.acceptance`). tree_nodes: 0
    (or 1) verifies the drafter's chain of K - 1 drafts; N >= 2 a best-first tree of N nodes (depth <= K - 1) built
    from the block's distributions (`serve.tree`); "auto": the N (chain included) with the most tokens per second
    measured at start-up. tree_ngram: merge a prompt-lookup path into the tree (needs tree_nodes >= 3 or auto).
    draft_rule: how a sampled request's drafts are chosen, "argmax" (the drafter's top-ranked tokens, one-hot drafts)
    or "sample" (drawn from the drafter's distribution: speculative sampling on the chain, multi-draft speculative
    sampling without replacement on a tree), all lossless (D64, D84)."""

    block_size: int | Literal["auto"] = 0
    tree_nodes: int | Literal["auto"] = 0
    tree_ngram: bool = False
    draft_rule: Literal["argmax", "sample"] = "argmax"

    def __post_init__(self) -> None:
        require(self.block_size == "auto" or self.block_size == 0 or self.block_size >= 2, "serve.block_size",
                self.block_size, "be an integer >= 2, 0 (the drafter's training K) or 'auto'")
        require(self.tree_nodes == "auto" or self.tree_nodes >= 0, "serve.tree_nodes", self.tree_nodes,
                "be an integer >= 0 (0: the chain) or 'auto'")
        require(not self.tree_ngram or self.tree_nodes == "auto" or lookup_fits(self.tree_nodes), "serve.tree_ngram",
                self.tree_ngram, "be false unless serve.tree_nodes >= 3 or 'auto' (the lookup path takes nodes)")
        require(self.draft_rule in DRAFT_RULES, "serve.draft_rule", self.draft_rule, f"be one of {DRAFT_RULES}")


__all__ = ["DRAFT_RULES", "SamplingConfig", "ServeConfig", "lookup_fits"]
