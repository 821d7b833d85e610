"""Continuous batching: requests join and leave between steps; each one's output is what it would be alone."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GOLDEN
from flax import nnx

from models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
from models.loading import load_hf_dir
from serve.engine import Engine
from serve.generate import generate
from serve.sampling import SamplingConfig
from serve.speculative import speculative_generate

MAX_LEN = 128


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=8),
                           target_cfg, mask_token_id=255)
    drafter = DFlashDrafter(arch, nnx.Rngs(0))
    rng = np.random.default_rng(2)
    requests = [(list(rng.integers(0, 255, size=n)), budget) for n, budget in
                [(5, 12), (20, 30), (9, 4), (33, 17), (2, 25), (14, 9), (7, 21)]]
    return target_cfg, target_params, drafter, requests


def _ar(target_cfg, target_params, prompt, budget, stop_ids=()):
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=budget)
    return generate(target_params, target_cfg, prompt, sampling, MAX_LEN, stop_ids=stop_ids).token_ids


@pytest.mark.parametrize("block_size", [None, 4, 8])
def test_requests_joining_and_leaving_equal_ar_alone(setup, block_size):
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, slots=3, max_len=MAX_LEN, block_size=block_size)
    ids = [engine.submit(p, budget) for p, budget in requests[:4]]
    engine.step()
    assert len(engine.running) == 3 and len(engine.queue) == 1  # 3 slots, 1 waiting
    ids += [engine.submit(p, budget) for p, budget in requests[4:]]  # join while others run
    done = engine.run()
    assert sorted(done) == ids and not engine.running and not engine.queue
    for rid, (prompt, budget) in zip(ids, requests, strict=True):
        assert done[rid].token_ids == _ar(target_cfg, target_params, prompt, budget), rid
        assert done[rid].finish_reason == "length"
        if block_size is not None:
            assert 1.0 <= done[rid].tau <= block_size


def test_stop_tokens_free_the_slot_early(setup):
    target_cfg, target_params, drafter, requests = setup
    prompt, budget = requests[1]
    stop = _ar(target_cfg, target_params, prompt, budget)[5]
    engine = Engine(target_params, target_cfg, drafter, slots=2, max_len=MAX_LEN, block_size=4)
    rid = engine.submit(prompt, budget, stop_ids=[stop])
    done = engine.run()
    assert done[rid].token_ids == _ar(target_cfg, target_params, prompt, budget, stop_ids=[stop])
    assert done[rid].finish_reason == "stop"


def test_sampled_output_does_not_depend_on_the_batch(setup):
    """At T > 0 a request's tokens depend on its seed only, not on which requests share its steps."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    engine = Engine(target_params, target_cfg, drafter, slots=3, max_len=MAX_LEN, block_size=4, sampling=sampling)
    ids = [engine.submit(p, budget, seed=100 + i) for i, (p, budget) in enumerate(requests)]
    done = engine.run()
    for i, (rid, (prompt, budget)) in enumerate(zip(ids, requests, strict=True)):
        [alone] = speculative_generate(target_params, target_cfg, drafter, [prompt], budget, MAX_LEN, block_size=4,
                                       sampling=sampling, seeds=[100 + i])
        assert done[rid].token_ids == alone.token_ids, rid


def test_bad_requests_are_refused(setup):
    target_cfg, target_params, drafter, _ = setup
    engine = Engine(target_params, target_cfg, drafter, slots=1, max_len=MAX_LEN, block_size=4)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.submit([], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.submit([1, 2], 0)
    with pytest.raises(ValueError, match="must fit the context"):
        engine.submit([1] * 100, 40)
