"""The serving choices acceptance drives (serve/acceptance.py: `serve.block_size: auto`, `serve.tree_nodes: auto`):
expected tokens from acceptance, the picks, and costs measured with the engine; and the pooled statistics."""

from __future__ import annotations

import pytest
from flax import nnx

from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.serve.acceptance import (
    accept_per_position,
    candidate_ks,
    candidate_nodes,
    expected_tokens,
    pick_block_size,
    pick_tree_nodes,
    pooled_tau,
    step_costs,
    tree_costs,
)

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


def test_candidates_and_expected_tokens():
    assert candidate_ks(8) == [1, 2, 3, 4, 6, 8]
    assert candidate_ks(10) == [1, 2, 3, 4, 6, 8, 10]
    accept = [0.8, 0.5, 0.2, 0.1, 0.05, 0.0, 0.0]
    assert expected_tokens(accept, 1) == 1.0
    assert expected_tokens(accept, 3) == pytest.approx(2.3)
    assert expected_tokens(accept, 8) == pytest.approx(2.65)
    with pytest.raises(ValueError):
        expected_tokens(accept, 9)


def test_pick_maximises_expected_tokens_per_second():
    accept = [0.8, 0.5, 0.2, 0.1, 0.05, 0.0, 0.0]
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}  # an accelerator: verify cost flat in K -> the widest K
    assert pick_block_size(accept, flat)[0] == 8
    steep = {1: 1.0, 2: 1.1, 4: 1.5, 8: 3.0}  # cost grows fast with K -> a narrow K wins
    k, table = pick_block_size(accept, steep)
    assert k == 4 and [c.k for c in table] == [1, 2, 4, 8]  # 2.5 / 1.5 = 1.67 > 1.8 / 1.1 = 1.64 > 2.65 / 3
    rates = {c.k: c.tokens_per_s for c in table}
    assert rates[4] == max(rates[j] for j in (2, 4, 8))


def test_step_costs_measure_each_k_with_the_engine(golden_dir):
    cfg, params = load_hf_dir(golden_dir / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=4), cfg,
                           mask_token_id=255)
    costs = step_costs(params, cfg, DFlashDrafter(arch, nnx.Rngs(0)), [1, 2, 4], list(range(3, 19)), max_len=64,
                       new_tokens=6, repeats=1)
    assert sorted(costs) == [1, 2, 4] and all(c > 0 for c in costs.values())


def test_pooled_statistics_count_every_step_once():
    accepted = [[3, 0, 1], [2], []]  # three requests' accepted drafts per step
    assert pooled_tau(accepted) == pytest.approx((4 + 1 + 2 + 3) / 4) and pooled_tau([[], []]) == 0.0
    assert accept_per_position(accepted, 4) == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert accept_per_position([], 3) == [0.0, 0.0]


def test_tree_budget_pick_maximises_measured_tokens_per_second():
    assert candidate_nodes(4) == [0, 4, 8, 16, 32, 64] and candidate_nodes(16) == [0, 4, 16, 32, 64]
    # (tau, seconds per step): a CPU whose verify cost grows with N -> a middle budget wins
    steep = {0: (1.6, 0.030), 8: (2.1, 0.034), 16: (2.3, 0.045), 32: (2.4, 0.080)}
    n, table = pick_tree_nodes(steep)
    assert n == 8 and [c.k for c in table] == [0, 8, 16, 32]  # 61.8 tokens/s > 53.3 > 51.1 > 30
    flat = {0: (1.6, 0.030), 8: (2.1, 0.030), 16: (2.3, 0.031), 32: (2.4, 0.031)}  # an accelerator: widest
    assert pick_tree_nodes(flat)[0] == 32
    with pytest.raises(ValueError, match="at least one"):
        pick_tree_nodes({})


def test_tree_costs_measure_each_budget_with_the_engine(golden_dir):
    cfg, params = load_hf_dir(golden_dir / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=4), cfg,
                           mask_token_id=255)
    costs = tree_costs(params, cfg, DFlashDrafter(arch, nnx.Rngs(0)), 4, [0, 6], [list(range(3, 19))], max_len=64,
                       new_tokens=6)
    assert sorted(costs) == [0, 6] and all(1.0 <= tau <= 4.0 and s > 0 for tau, s in costs.values())
