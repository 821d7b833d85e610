"""`--block-size auto` (dflash/serve/autoblock.py): expected tokens from acceptance, the pick, and measured costs."""

from __future__ import annotations

import argparse

import pytest
from flax import nnx

from dflash.launch.cli import _block_size
from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.serve.autoblock import candidate_ks, expected_tokens, pick_block_size, step_costs

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


def test_cli_block_size_values():
    assert _block_size("auto") == "auto" and _block_size("0") == 0 and _block_size("16") == 16
    for bad in ("1", "-2", "wide"):
        with pytest.raises(argparse.ArgumentTypeError):
            _block_size(bad)
