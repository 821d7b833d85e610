"""`dflash serve`'s library call (launch/serving.py): the options are checked at construction, and
`build_server` wires the recipe's target, drafter, K and sampling into a bound server. Serving itself, with
its printed line and signals, runs in tests/test_eval.py through `dflash serve` subprocesses."""

from __future__ import annotations

import pytest
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.launch.serving import ServeOptions, build_server
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import load_target
from dflash.models.zlab import save_zlab

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


def test_block_size_is_checked_at_construction():
    for k in (0, 2, 8, "auto"):
        assert ServeOptions(block_size=k).block_size == k
    for k in (1, -1, "4", True, 2.0):
        with pytest.raises(ValueError, match=r"block_size must be an integer >= 2, 0 \(the drafter's training K\) "
                                             rf"or 'auto'; received {k!r}"):
            ServeOptions(block_size=k)


def test_prefill_chunk_and_steps_per_dispatch_are_checked_at_construction():
    assert (ServeOptions().prefill_chunk, ServeOptions().steps_per_dispatch) == (512, 4)
    assert ServeOptions(prefill_chunk=0, steps_per_dispatch=1).prefill_chunk == 0
    for c in (8, 100, -16, True, 64.0):
        with pytest.raises(ValueError, match=rf"prefill_chunk must be 0 \(off\) or a power of two >= 16; "
                                             rf"received {c!r}"):
            ServeOptions(prefill_chunk=c)
    for r in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"steps_per_dispatch must be an integer >= 1; received {r!r}"):
            ServeOptions(steps_per_dispatch=r)


def _built(recipe, options):
    server = build_server(recipe, options)
    try:
        return server.worker.engine.k, server.model_name, server.protocol, server.api_key
    finally:
        server.worker.shutdown()
        server.server_close()


@pytest.mark.slow
def test_build_server_wires_the_recipe_and_the_options(tmp_path):
    recipe = load_recipe("tiny")
    drafter = DFlashDrafter(load_target(recipe.target).drafter_arch(recipe.drafter), nnx.Rngs(0))
    save_zlab(drafter, tmp_path)
    k, name, protocol, key = _built(recipe, ServeOptions(drafter=tmp_path, block_size=4, port=0, api_key="k"))
    assert (k, name, key) == (4, recipe.target.source, "k")
    assert (protocol.max_tokens, protocol.unknown_fields) == (recipe.sampling.max_new_tokens, "ignore")
    k, *_ = _built(recipe, ServeOptions(drafter=tmp_path, port=0))
    assert k == recipe.drafter.block_size  # block_size 0: the drafter's training K
    k, name, protocol, key = _built(recipe, ServeOptions(ar=True, port=0, model_name="x", unknown_fields="reject"))
    assert (k, name, protocol.unknown_fields, key) == (1, "x", "reject", None)


def test_draft_rule_is_checked_and_reaches_the_engine(tmp_path):
    """serve.draft_rule (the recipe) and --draft-rule (ServeOptions, which wins) set the engine's rule for sampled
    requests; an unknown rule, or "sample" with a tree, is refused by name; AR serves with argmax whatever is set."""
    from dflash.configs.schema import ConfigError
    from dflash.serve.config import ServeConfig

    with pytest.raises(ValueError, match="draft_rule must be argmax, sample or None"):
        ServeOptions(draft_rule="greedy")
    with pytest.raises(ConfigError, match="serve.draft_rule"):
        ServeConfig(tree_nodes=4, draft_rule="sample")
    with pytest.raises(ConfigError, match="serve.draft_rule"):
        ServeConfig(draft_rule="top1")
    recipe = load_recipe("tiny", ["serve.draft_rule=sample"])
    drafter = DFlashDrafter(load_target(recipe.target).drafter_arch(recipe.drafter), nnx.Rngs(0))
    save_zlab(drafter, tmp_path)

    def rule(options):
        server = build_server(recipe, options)
        try:
            return server.worker.engine.draft_rule
        finally:
            server.worker.shutdown()
            server.server_close()

    assert rule(ServeOptions(drafter=tmp_path, port=0, precompile=False)) == "sample"
    assert rule(ServeOptions(drafter=tmp_path, port=0, precompile=False, draft_rule="argmax")) == "argmax"
    assert rule(ServeOptions(ar=True, port=0, precompile=False)) == "argmax"
