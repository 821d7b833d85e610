"""What each stage holds per chip (`launch.resident.stage_holdings`, from the recipe's shapes and shardings) is what
the stages hold when they run: the trainer's placed target and state and a regeneration replica's target and pages,
measured on CPU devices, equal the accounting; `dflash launch compile` refuses a recipe whose stage does not fit,
naming the stage, its bytes and the chip's HBM; the pod recipes' stages hold less than a v5p chip."""

from __future__ import annotations

import jax
import pytest

from dflash.configs.recipe import load_recipe
from dflash.launch.compile import CompileReport, ProgramMemory
from dflash.launch.resident import StageHoldings, format_stages, stage_holdings
from dflash.launch.tpus import parse_tpu_type
from dflash.models.placement import resident_bytes

GIB = 1 << 30
SLACK = 64 << 10  # arrays a stage holds that the accounting leaves out (RNG keys, step counters, page tables)


def _stage(stages: list[StageHoldings], name: str) -> StageHoldings:
    return next(s for s in stages if s.name == name)


def test_the_trainers_placed_target_and_state_are_what_the_train_stage_counts():
    from dflash.models.target import load_target
    from dflash.train.loop import build_run, create_state

    recipe = load_recipe("tiny", ["train.batch_size=8", "train.mesh.data=1", "train.mesh.fsdp=4",
                                  "train.mesh.tensor=2"])
    train = _stage(stage_holdings(recipe, parse_tpu_type("v5p-16")), "train")  # 8 chips, as the 8 test devices
    assert train.chips == 8 and [k for k, _ in train.holds] == ["target params", "drafter params",
                                                                "optimizer state", "batch"]
    target = load_target(recipe.target)
    devices = jax.devices()
    before = resident_bytes(devices)
    run = build_run(recipe.train, recipe.data, target, target.drafter_arch(recipe.drafter))
    state, _ = create_state(recipe.train.seed, run.arch, run.spec.optimizer, run.mesh)
    after = resident_bytes(devices)
    held = {d: after[d] - before[d] for d in devices}
    counted = train.held_bytes - dict(train.holds)["batch"]  # no batch is resident before the first step
    assert max(held.values()) <= counted + SLACK and max(held.values()) >= counted - SLACK, (held, counted)
    del run, state


def test_a_regeneration_replica_holds_what_the_regenerate_stage_counts():
    from dflash.data.scaleout import replica_engines
    from dflash.models.target import load_target

    recipe = load_recipe("tiny", ["data.regen.devices_per_replica=2", "data.regen.slots=2", "data.regen.max_len=64"])
    regen = _stage(stage_holdings(recipe, parse_tpu_type("v5p-8")), "regenerate")
    assert regen.chips == 2 and regen.programs == ("regen_step x2",)
    target = load_target(recipe.target)
    group = tuple(jax.devices()[:2])
    before = resident_bytes(group)
    engines = replica_engines(target, recipe.data.regen, [group])
    after = resident_bytes(group)
    held = max(after[d] - before[d] for d in group)
    assert regen.held_bytes - SLACK <= held <= regen.held_bytes + SLACK, (held, regen.holds)
    del engines


def _report(stage: StageHoldings, program: ProgramMemory) -> CompileReport:
    tpu = parse_tpu_type("v5p-8")
    step = ProgramMemory("train_step", 4, GIB, 0, 0, GIB, 0, 1e12)
    return CompileReport(recipe="r", tpu_type=tpu.name, num_slices=1, backend="b", mesh={}, hbm_bytes=tpu.hbm_bytes,
                         peak_flops=1.0, batch_size=1, seq_len=1, steps=1, params={}, programs=[step, program],
                         stages=[stage.to_json()])


def test_a_stage_that_does_not_fit_is_refused_naming_the_stage_its_bytes_and_the_hbm(monkeypatch, capsys):
    from dflash.launch import compile as compile_module
    from dflash.launch.cli import main

    program = ProgramMemory("regen_step", 1, argument_bytes=60 * GIB, output_bytes=GIB, alias_bytes=GIB,
                            temp_bytes=2 * GIB, code_bytes=0, flops=0.0)
    over = StageHoldings("regenerate", 1, (("target params", 61 * GIB), ("KV pages and slots (64 x 3072)", 48 * GIB)),
                         ("regen_step",))
    report = _report(over, program)
    assert report.fits(program)  # the program alone fits: its arguments are not what the stage holds
    [need] = report.stage_needs()
    assert need.need_bytes == 111 * GIB and not need.fits
    [reason] = report.refusals()
    assert reason.startswith("stage regenerate needs 111.00 GiB per chip (holds 109.00 GiB: target params 61.00, "
                             "KV pages and slots (64 x 3072) 48.00; regen_step's working memory 2.00), over the "
                             "v5p-8 chip's 95.7 GiB HBM"), reason
    assert "regenerate" in report.format() and " NO" in report.format()

    monkeypatch.setattr(compile_module, "run_compile", lambda *a, **k: report)
    assert main(["launch", "compile", "--config", "tiny", "--topology", "v5p-8"]) == 3
    assert "does not fit: stage regenerate needs 111.00 GiB" in capsys.readouterr().err
    fits = _report(StageHoldings("regenerate", 1, (("target params", 30 * GIB),), ("regen_step",)), program)
    monkeypatch.setattr(compile_module, "run_compile", lambda *a, **k: fits)
    assert main(["launch", "compile", "--config", "tiny", "--topology", "v5p-8"]) == 0


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "gpt_oss_20b", "qwen3_32b"])
def test_each_stage_of_the_large_pod_recipes_holds_less_than_a_chip(name):
    """What every stage of the MoE and 32B recipes holds per chip, on their slices, leaves room under a v5p chip's
    HBM for the programs (their working memory comes from `dflash launch compile`; docs/pods.md records it)."""
    recipe = load_recipe(name)
    tpu = parse_tpu_type(recipe.launch.tpu_type)
    stages = {s.name: s for s in stage_holdings(recipe, tpu)}
    assert {"train", "train real-τ eval", "regenerate", "capture", "serve", "serve x4", "eval"} <= set(stages)
    for stage in stages.values():
        assert stage.held_bytes < 0.9 * tpu.hbm_bytes, (stage.name, stage.held_bytes / GIB, stage.holds)
    train = stages["train"]
    assert dict(train.holds)["target params"] < 2 * GIB  # its share of the mesh, not a whole copy
    text = format_stages(list(stages.values()))
    assert len(text.splitlines()) == len(stages) and text.startswith("train ") and "target params" in text
