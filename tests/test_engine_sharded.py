"""The engine over several devices (`Limits.devices`): the target's weights and paged K/V split over a host's devices
in tensor parallel (`models.sharding`), the drafter replicated; greedy output equals the one-device engine's token
for token, for every plan, on the simulated CPU devices (tests/conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import tiny_engine_models

from dflash.serve.engine import Engine
from dflash.serve.plan import AR, Chain, Limits, Tree

pytestmark = pytest.mark.heavy  # compiles a model's engine: not in `bin/test --fast`

MAX_LEN = 96


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params, drafter = tiny_engine_models(block_size=4)
    rng = np.random.default_rng(11)
    requests = [(list(rng.integers(0, 255, size=n)), budget) for n, budget in [(5, 20), (19, 14), (9, 25)]]
    return target_cfg, target_params, drafter, requests


def _run(setup, plan, devices):
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, plan, Limits(slots=2, max_len=MAX_LEN, devices=devices,
                                                                     steps_per_dispatch=2))
    ids = [engine.submit(p, budget) for p, budget in requests]
    done = engine.run()
    return engine, [done[i].token_ids for i in ids]


# The chain over 2 devices runs in the default tier (its 2-device programs are the split test's below, so it adds
# only the one-device run); the AR layout and the tree over 4 devices (with prompt lookup: the target's verify, the
# drafter's ranked lists, the lookup merge; ~2.5 min) on demand (`bin/test -m slow`).
# slow (ar-4, tree-4): chain-2 here keeps "the tensor-parallel engine equals the one-device engine token for token"
@pytest.mark.parametrize(("plan", "devices"), [pytest.param(AR(), 4, id="ar-4", marks=pytest.mark.slow),
                                               pytest.param(Chain(4), 2, id="chain-2"),
                                               pytest.param(Tree(4, 6, lookup=True), 4, id="tree-4",
                                                            marks=pytest.mark.slow)])
def test_greedy_output_equals_the_one_device_engine(setup, plan, devices):
    _, one = _run(setup, plan, 1)
    engine, many = _run(setup, plan, devices)
    assert many == one
    assert engine.mesh.devices.size == devices


def test_the_target_and_its_pages_are_split_the_drafter_replicated(setup):
    engine, _ = _run(setup, Chain(4), 2)  # the programs of chain-2 above
    target = engine.models.target_params
    spec = lambda x: tuple(x.sharding.spec)  # noqa: E731
    assert spec(target["layers"]["wq"])[2] == "tensor" and spec(target["layers"]["wo"])[1] == "tensor"
    assert target["layers"]["wk"].addressable_shards[0].data.shape[2] == target["layers"]["wk"].shape[2] // 2
    assert spec(engine.state.target.k_pages)[3] == "tensor"  # 2 kv heads over 2 devices
    assert engine.state.draft.k.sharding.is_fully_replicated
    leaves = jax.tree.leaves(engine.models.drafter_params)
    assert leaves and all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 2 for x in leaves)
    with pytest.raises(ValueError, match="devices must be at most the 8 local devices; received 9"):
        Engine(setup[1], setup[0], setup[2], Chain(4), Limits(slots=1, max_len=MAX_LEN, devices=9))


@pytest.mark.slow  # ~1 min of compiles; test_engine's and test_tree's precompile tests keep the property on one device
def test_after_precompile_on_several_devices_no_request_compiles(setup):
    """Precompile compiles every program ahead of time against the engine's placed state (a step's later programs
    against their inputs' shapes, committed to the mesh as the real outputs are; the page table uploaded after an
    admission placed like the one it replaces): the requests after it, log-probabilities included, compile nothing."""
    from dflash.serve.config import SamplingConfig

    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Tree(4, 6, lookup=True),
                    Limits(slots=2, max_len=MAX_LEN, devices=2, steps_per_dispatch=2))
    count, _ = engine.precompile()
    assert count == engine.compiles > 0
    for i, (prompt, budget) in enumerate(requests):
        engine.submit(prompt, budget, seed=i, logprobs=2 if i == 1 else None,
                      sampling=SamplingConfig(temperature=0.8) if i == 2 else None)
    done = engine.run()
    assert len(done) == len(requests) and engine.compiles == count
