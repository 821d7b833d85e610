"""The decode plan (serve/plan.py): each plan checks its own fields when built and its drafter when an engine takes
it; `plan_from` is the only place a recipe's `serve` section becomes a plan; `Limits` checks what an engine is
sized for; `dflash serve`'s plan flags are overrides of the `serve` section."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_engine_models
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.configs.schema import ConfigError
from dflash.launch.cli import _recipe, build_parser
from dflash.models.drafter import DFlashDrafter
from dflash.serve.config import ServeConfig
from dflash.serve.plan import AR, Chain, Limits, Lookup, Tree, default_plan, plan_from


@pytest.fixture(scope="module")
def drafter():
    return tiny_engine_models(block_size=8)[2]


class Chooser:
    """A stand-in for `serve.acceptance.Measured`: records what it was asked."""

    def __init__(self):
        self.asked = []

    def block_size(self, drafter):
        self.asked.append(("block_size", drafter.arch.block_size))
        return 4

    def tree_nodes(self, drafter, k, lookup):
        self.asked.append(("tree_nodes", k, lookup))
        return 6


def test_plans_check_their_own_fields():
    assert (AR().k, AR().width, Chain(4).width, Tree(4, 10).width, Tree(8, 5).width) == (1, 1, 4, 10, 8)
    assert (Tree(4, 10, lookup=True).lookup_nodes, Tree(8, 16, lookup=True).lookup_nodes, Tree(8, 16).lookup_nodes) \
        == (3, 7, 0)
    assert Chain(4).loops and Tree(4, 6).loops and AR().loops and not Lookup(4).loops
    assert not Chain(4, drafts=lambda state, k: None).loops and not Tree(4, 6, ranked=lambda s, k, m: None).loops
    assert not Tree(4, 6, rule="sample", logits=lambda s, k: None).loops and Tree(4, 6, rule="sample").loops
    assert Tree(4, 8, True, "sample").describe() == "DFlash K=4, tree of 8 nodes + prompt lookup, sampled drafts"
    for bad, match in ((lambda: Chain(1), "block_size must be an integer >= 2"),
                       (lambda: Chain(4, "top1"), "draft_rule must be one of"),
                       (lambda: Chain(4, "sample", drafts=lambda state, k: None), "with given drafts"),
                       (lambda: Tree(4, 1), "tree_nodes must be an integer >= 2"),
                       (lambda: Tree(4, 2, lookup=True), "tree_nodes must be >= 3 with prompt lookup"),
                       (lambda: Tree(4, 6, rule="top1"), "draft_rule must be one of"),
                       (lambda: Tree(4, 6, rule="sample", ranked=lambda s, k, m: None), "with given ranked lists"),
                       (lambda: Tree(4, 6, ranked=lambda s, k, m: None, logits=lambda s, k: None),
                        "ranked must be None when logits are given"),
                       (lambda: Lookup(True), "block_size must be an integer >= 2")):
        with pytest.raises(ValueError, match=match):
            bad()


def test_plans_check_the_drafter(drafter):
    Chain(8).check(drafter)
    AR().check(None) or Lookup(4).check(None)  # neither drafts with a drafter
    with pytest.raises(ValueError, match=r"block_size must lie in \[2, 8\] \(the drafter's training K\); received 9"):
        Chain(9).check(drafter)
    with pytest.raises(ValueError, match="drafter must be given for DFlash K=4, tree of 6 nodes"):
        Tree(4, 6).check(None)
    # DFlash2's path selector drafts each slot from the one before: no tree, no sampled drafts; argmax chains only
    selector = DFlashDrafter(dataclasses.replace(drafter.arch, selector_rank=4, selector_top_k=4), nnx.Rngs(0))
    Chain(8).check(selector)
    with pytest.raises(ValueError, match="tree_nodes must be 0 .* for a drafter with DFlash2's path selector"):
        Tree(8, 6).check(selector)
    with pytest.raises(ValueError, match="draft_rule must be argmax for a drafter with DFlash2's path selector"):
        Chain(8, "sample").check(selector)


def test_plan_from_builds_every_plan_of_a_serve_section(drafter):
    assert plan_from(ServeConfig(), None) == AR() == default_plan(None)
    assert plan_from(ServeConfig(), drafter) == Chain(8) == default_plan(drafter)
    assert plan_from(ServeConfig(block_size=4, draft_rule="sample"), drafter) == Chain(4, "sample")
    assert plan_from(ServeConfig(tree_nodes=1), drafter) == Chain(8)
    assert plan_from(ServeConfig(tree_nodes=8, tree_ngram=True), drafter) == Tree(8, 8, lookup=True)
    assert plan_from(ServeConfig(tree_nodes=8, tree_ngram=True, draft_rule="sample"), drafter) \
        == Tree(8, 8, lookup=True, rule="sample")
    chooser = Chooser()
    assert plan_from(ServeConfig(block_size="auto", tree_nodes="auto", tree_ngram=True), drafter, chooser) \
        == Tree(4, 6, lookup=True)
    assert chooser.asked == [("block_size", 8), ("tree_nodes", 4, True)]
    with pytest.raises(ValueError, match="serve.tree_nodes must be a number here"):
        plan_from(ServeConfig(tree_nodes="auto"), drafter)
    with pytest.raises(ValueError, match=r"block_size must lie in \[2, 8\]"):
        plan_from(ServeConfig(block_size=12), drafter)


def test_limits_check_what_an_engine_is_sized_for():
    limits = Limits(slots=3, max_len=100, page_size=16)
    assert (limits.max_pages, limits.pages) == (7, 3 * 7 + 1)
    assert Limits(slots=1, max_len=64, num_pages=5).pages == 5
    for kwargs, match in (({"slots": 0}, "slots must be an integer >= 1"),
                          ({"prefill_chunk": 24}, "prefill_chunk must be None or a power of two >= 16"),
                          ({"steps_per_dispatch": 0}, "steps_per_dispatch must be an integer >= 1"),
                          ({"num_pages": 1}, "num_pages must be None or an integer >= 2"),
                          ({"page_size": 0}, "page_size must be an integer >= 1")):
        with pytest.raises(ValueError, match=match):
            Limits(**{"slots": 1, "max_len": 64, **kwargs})


def test_serve_flags_are_overrides_of_the_serve_section():
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", "tiny", "--block-size", "auto", "--tree-nodes", "8",
                              "--tree-ngram", "train.steps=3"])
    recipe = _recipe(args)
    assert recipe.serve == ServeConfig(block_size="auto", tree_nodes=8, tree_ngram=True) and recipe.train.steps == 3
    assert _recipe(parser.parse_args(["serve", "--config", "tiny"])).serve == load_recipe("tiny").serve
    with pytest.raises(ConfigError, match=r"serve.block_size must be an integer >= 2, 0 .* received 1"):
        _recipe(parser.parse_args(["serve", "--config", "tiny", "--block-size", "1"]))
    sampled_tree = _recipe(parser.parse_args(["eval", "--config", "tiny", "--tree-nodes", "4", "--draft-rule",
                                              "sample"]))  # a tree with drafts drawn from the drafter (D84)
    assert sampled_tree.serve == ServeConfig(tree_nodes=4, draft_rule="sample")
    with pytest.raises(ConfigError, match="serve.draft_rule must be one of"):
        _recipe(parser.parse_args(["serve", "--config", "tiny", "serve.draft_rule=top1"]))
