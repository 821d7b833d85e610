"""The engine over the paged target cache: no page leaks, waiting for pages, one compile while tables change."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GOLDEN, ar_alone
from flax import nnx

from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.serve import speculative
from dflash.serve.engine import Engine
from dflash.serve.plan import Chain, Limits

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


MAX_LEN = 32
K = 4
# the engines' slots and pool wherever a test needs no other: 4 slots but 10 usable pages of 4 tokens, so at most
# one or two worst cases (<= 6 pages each) at once; one shape, so the tests share their compiled programs
SLOTS, PAGES = 4, 11


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=K),
                           target_cfg, mask_token_id=255)
    return target_cfg, target_params, DFlashDrafter(arch, nnx.Rngs(0))


def _requests(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(0, 255, size=rng.integers(1, 13))], int(rng.integers(1, 7)))
            for _ in range(n)]


def _all_pages_free(engine: Engine) -> bool:
    return (engine.pool.num_free == engine.pool.num_usable
            and all(not engine.table.pages(s) for s in range(engine.slots)))


@pytest.mark.slow
def test_a_thousand_requests_leak_no_pages(setup):
    target_cfg, target_params, drafter = setup
    # 3 slots, page_size 4: a worst case of 12 + 6 + 4 = 22 tokens takes 6 pages; 14 usable pages.
    engine = Engine(target_params, target_cfg, drafter, Chain(K),
                    Limits(slots=3, max_len=MAX_LEN, page_size=4, num_pages=15))
    requests = _requests(1000, seed=0)
    ids = [engine.submit(p, budget) for p, budget in requests]
    done = engine.run()
    assert sorted(done) == ids and not engine.running and not engine.queue
    assert _all_pages_free(engine), (engine.pool.num_free, engine.pool.num_usable)
    assert np.all(engine.lengths == 0)
    for i in np.random.default_rng(1).choice(len(requests), size=20, replace=False):
        prompt, budget = requests[i]
        assert done[ids[i]].token_ids == ar_alone(target_params, target_cfg, prompt, budget), i


def test_requests_wait_for_pages_and_all_finish(setup):
    target_cfg, target_params, drafter = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(K),
                    Limits(slots=SLOTS, max_len=MAX_LEN, page_size=4, num_pages=PAGES))
    requests = _requests(24, seed=2)
    ids = [engine.submit(p, budget) for p, budget in requests]
    waited = False
    while engine.busy:
        engine.step()
        free_slots = engine.slots - len(engine.running)
        waited |= bool(engine.queue) and free_slots > 0  # a slot was free, but not the pages
        assert engine.pool.num_free >= 0
    assert waited
    assert _all_pages_free(engine)
    for rid, (prompt, budget) in zip(ids, requests, strict=True):
        assert engine.done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget), rid
    small = Engine(target_params, target_cfg, drafter, Chain(K),
                   Limits(slots=1, max_len=MAX_LEN, page_size=4, num_pages=4))
    with pytest.raises(ValueError, match="more than the whole pool"):
        small.submit([1] * 8, 4)  # 16 tokens: 4 pages, the pool has 3


def test_propose_and_verify_compile_once_while_page_tables_change(setup):
    target_cfg, target_params, drafter = setup
    before = {f: getattr(speculative, f)._cache_size() for f in ("propose", "verify")}
    engine = Engine(target_params, target_cfg, drafter, Chain(K),
                    Limits(slots=SLOTS, max_len=MAX_LEN, page_size=4, num_pages=PAGES))
    for p, budget in _requests(40, seed=3):
        engine.submit(p, budget)
    versions = set()
    while engine.busy:
        engine.step()
        versions.add(engine.table.version)
    grown = {f: getattr(speculative, f)._cache_size() - before[f] for f in before}
    assert len(versions) > 10, "the page table must change many times"
    # Table contents never recompile; only the attention span (a power of two of pages) may.
    bound = int(np.log2(-(-MAX_LEN // 4))) + 1
    assert grown["propose"] <= bound and grown["verify"] <= bound, grown
    spans = {s[3] for s in engine.compiled_shapes if s[0] == "verify"}
    assert grown["verify"] <= len(spans), (grown, spans)


def test_reset_frees_every_page_and_the_engine_serves_again(setup):
    target_cfg, target_params, drafter = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(K),
                    Limits(slots=SLOTS, max_len=MAX_LEN, page_size=4, num_pages=PAGES))
    for p, budget in _requests(5, seed=4):
        engine.submit(p, budget)
    engine.step()
    assert engine.running and engine.pool.num_free < engine.pool.num_usable
    engine.reset()
    assert not engine.busy and not engine.done and _all_pages_free(engine)
    [(prompt, budget)] = _requests(1, seed=5)
    rid = engine.submit(prompt, budget)
    assert engine.run()[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget)
