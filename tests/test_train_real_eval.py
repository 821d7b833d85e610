"""Real τ inside training (train.eval_every): engine-decoded τ logged at its steps, the best drafter kept in
<run_dir>/best and loadable as step="best", and training results unchanged by it (tiny recipe, fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.data.eval_sets import eval_prompts
from dflash.models.drafter_io import load_drafter
from dflash.serve.acceptance import real_tau
from dflash.train.checkpoint import Checkpointer
from dflash.train.loop import drafter_graphdef, run_training
from dflash.train.metrics import read_metrics
from dflash.train.real_eval import RealTauEval
from dflash.train.sharding import path_str

STEPS, EVERY, TOKENS = 8, 4, 8

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


COMMON = [f"train.steps={STEPS}", "train.batch_size=8", f"train.eval_tokens={TOKENS}", "train.eval_prompts=1"]


def _recipe(run_dir, every: int):
    return load_recipe("tiny", [*COMMON, f"train.eval_every={every}", f"train.run_dir={run_dir}"])


@pytest.fixture(scope="module")
def runs(smollm2_target, tmp_path_factory):
    """(with real τ every EVERY steps, without it): the same tiny run twice."""
    with_eval, without = tmp_path_factory.mktemp("with_eval"), tmp_path_factory.mktemp("without")
    result = run_training(_recipe(with_eval, EVERY), target=smollm2_target, progress=False)
    plain = run_training(_recipe(without, 0), target=smollm2_target, progress=False)
    return result, plain


def _checkpoint_params(run_dir, step: int):
    ckpt = Checkpointer(run_dir / "checkpoints", {})
    state, _, _ = ckpt.restore_raw(step)
    ckpt.close()
    return state["params"]


def _flat(tree) -> dict[str, np.ndarray]:
    """Leaves by path ('value' steps of nnx Variables and of saved params dropped), on the host."""
    return {path_str(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(
        jax.device_get(tree))[0]}


def _assert_trees_equal(got, want, what: str) -> None:
    got, want = _flat(got), _flat(want)
    assert sorted(got) == sorted(want), what
    for path, value in got.items():
        assert np.array_equal(value, want[path]), f"{path} differs ({what})"


@pytest.mark.slow
@pytest.mark.e2e
def test_real_tau_is_logged_at_its_steps_and_the_best_drafter_is_kept(runs, smollm2_target):
    result, _ = runs
    k = result.arch.block_size
    logged = {r["step"]: r for r in read_metrics(result.run_dir) if "eval/tau" in r}
    assert sorted(logged) == [4, 8]
    for record in logged.values():
        assert 1.0 <= record["eval/tau"] <= k
        assert {f"eval/tau/{s}" for s in ("gsm8k", "mtbench", "humaneval")} <= set(record)
        assert [f"eval/accept_pos_{i}" in record for i in range(k - 1)] == [True] * (k - 1)
        assert 1.0 <= record["eval/tf_tau_walk"] <= k and 1.0 <= record["eval/tf_tau_uniform"] <= k
    best = json.loads((result.run_dir / "best" / "best.json").read_text())
    assert best == result.best
    assert best["step"] == max(logged, key=lambda s: (logged[s]["eval/tau"], -s))  # the first highest τ
    assert best["tau"] == logged[best["step"]]["eval/tau"]
    assert set(best["tau_per_set"]) == {"gsm8k", "mtbench", "humaneval"} and len(best["accept_per_position"]) == k - 1
    assert not [p.name for p in result.run_dir.iterdir() if p.name.startswith("best.")]  # no temporary left

    # The kept drafter is the one decoded at that step: its params equal that step's checkpoint, and a fresh
    # decode gives the logged τ.
    drafter = load_drafter(result.run_dir, smollm2_target.cfg, step="best")
    _assert_trees_equal(nnx.state(drafter, nnx.Param), _checkpoint_params(result.run_dir, best["step"]),
                        "best vs its checkpoint")
    prompts = eval_prompts(smollm2_target.tokenizer, ("gsm8k", "mtbench", "humaneval"), 1)
    again = real_tau(smollm2_target, drafter, prompts, TOKENS)
    assert again["tau"] == best["tau"] and again["accept_per_position"] == best["accept_per_position"]
    assert again["tf_tau_walk"] == pytest.approx(again["tau"], abs=1e-9)  # the walk from the decoded tokens
    bare = real_tau(smollm2_target, drafter, prompts, TOKENS, teacher=False)  # the decode alone
    assert bare["tau"] == again["tau"] and not {"tf_tau_walk", "tf_tau_uniform"} & set(bare)


@pytest.mark.slow
@pytest.mark.e2e
def test_real_tau_does_not_change_training(runs):
    result, plain = runs
    assert result.final_step == plain.final_step == STEPS and plain.best is None
    _assert_trees_equal(_checkpoint_params(result.run_dir, STEPS), _checkpoint_params(plain.run_dir, STEPS),
                        "eval_every=4 vs 0")
    losses = {r["step"]: r["loss"] for r in read_metrics(plain.run_dir) if "loss" in r}
    assert {r["step"]: r["loss"] for r in read_metrics(result.run_dir) if "loss" in r} == losses


@pytest.mark.slow
@pytest.mark.e2e
def test_a_resumed_run_compares_with_the_recorded_best_and_replaces_it_whole(runs, smollm2_target, tmp_path):
    run_dir = shutil.copytree(runs[0].run_dir, tmp_path / "run")
    recipe = _recipe(run_dir, EVERY)
    graphdef = drafter_graphdef(smollm2_target.drafter_arch(recipe.drafter))
    path = run_dir / "best" / "best.json"
    recorded = json.loads(path.read_text())
    path.write_text(json.dumps({**recorded, "tau": 99.0}))
    evaluator = RealTauEval(recipe.train, smollm2_target, graphdef, run_dir)
    assert evaluator.best["tau"] == 99.0  # read back, as on resume
    params = nnx.state(load_drafter(run_dir, smollm2_target.cfg, step=STEPS), nnx.Param)
    evaluator(STEPS, params)
    assert json.loads(path.read_text())["tau"] == 99.0  # not beaten: best/ untouched

    path.write_text(json.dumps({**recorded, "tau": 0.5}))
    metrics = RealTauEval(recipe.train, smollm2_target, graphdef, run_dir)(STEPS, params)
    assert json.loads(path.read_text())["step"] == STEPS
    assert json.loads(path.read_text())["tau"] == metrics["eval/tau"]
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith("best.")]  # no temporary left
    _assert_trees_equal(nnx.state(load_drafter(run_dir / "best", smollm2_target.cfg), nnx.Param),
                        _checkpoint_params(run_dir, STEPS), "new best")


@pytest.mark.slow
@pytest.mark.e2e
def test_eval_temperature_logs_sampled_tau_beside_the_greedy_one(runs, smollm2_target, tmp_path):
    """train.eval_temperature > 0: the same prompts also decoded sampled at that temperature (seeded from
    train.seed), logged as eval/real_tau_t[/<set>] and equal to `real_tau` with that rule (and with
    train.eval_draft_rule=sample, to `real_tau` drafting by that rule); the greedy metrics and the best drafter's
    criterion are unchanged."""
    from dflash.serve.config import SamplingConfig

    run_dir = shutil.copytree(runs[0].run_dir, tmp_path / "run")
    recipe = load_recipe("tiny", [*COMMON, f"train.eval_every={EVERY}", f"train.run_dir={run_dir}",
                                  "train.eval_temperature=0.8"])
    graphdef = drafter_graphdef(smollm2_target.drafter_arch(recipe.drafter))
    params = nnx.state(load_drafter(run_dir, smollm2_target.cfg, step=STEPS), nnx.Param)
    greedy = RealTauEval(_recipe(run_dir, EVERY).train, smollm2_target, graphdef, run_dir)(STEPS, params)
    both = RealTauEval(recipe.train, smollm2_target, graphdef, run_dir)(STEPS, params)
    assert {k: v for k, v in both.items() if not k.startswith("eval/real_tau_t") and k != "eval/seconds"} == \
        {k: v for k, v in greedy.items() if k != "eval/seconds"}
    prompts = eval_prompts(smollm2_target.tokenizer, recipe.train.eval_sets, 1)
    drafter = load_drafter(run_dir, smollm2_target.cfg, step=STEPS)
    rule = SamplingConfig(temperature=0.8, seed=recipe.train.seed)
    sampled = real_tau(smollm2_target, drafter, prompts, TOKENS, rule)
    assert both["eval/real_tau_t"] == sampled["tau"] and both["eval/real_tau_t/temperature"] == 0.8
    assert {k.removeprefix("eval/real_tau_t/") for k in both if k.startswith("eval/real_tau_t/")} == \
        {"gsm8k", "mtbench", "humaneval", "temperature"}
    assert json.loads((run_dir / "best" / "best.json").read_text())["tau"] >= both["eval/tau"]  # greedy criterion
    drawn = RealTauEval(dataclasses.replace(recipe.train, eval_draft_rule="sample"), smollm2_target, graphdef,
                        run_dir)(STEPS, params)  # train.eval_draft_rule: the sampled decode drafts by that rule
    assert drawn["eval/real_tau_t"] == real_tau(smollm2_target, drafter, prompts, TOKENS, rule,
                                                draft_rule="sample")["tau"]


def test_a_missing_best_drafter_says_to_set_eval_every(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "best")) + r".*train\.eval_every"):
        load_drafter(tmp_path, None, step="best")
    with pytest.raises(FileNotFoundError, match=r"train\.eval_every"):
        load_drafter(tmp_path / "checkpoints", None, step="best")
    with pytest.raises(ValueError, match="'latest'"):
        load_drafter(tmp_path, None, step="latest")


def test_eval_prompts_skip_takes_the_items_after_the_first_ones():
    """`skip` (benchmarks/drafter_tau.py's held-out items) offsets into each set, set by set, in order."""
    from dflash.models.registry import default_gguf_path
    from dflash.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_gguf_path())
    sets = ("gsm8k", "mtbench")
    first = eval_prompts(tokenizer, sets, 3)
    later = eval_prompts(tokenizer, sets, 2, skip=1)
    assert [p.set for p in later] == ["gsm8k", "gsm8k", "mtbench", "mtbench"]
    assert later == first[1:3] + first[4:6]
    assert first[0] not in later and first[3] not in later
