"""The pod recipes fit their slices (docs/design.md §6; docs/decisions.md D22), built abstractly (nothing allocated):

- the sharding rules leave no large array replicated: every target and drafter parameter and optimizer state of
  a million elements or more is split across the fsdp axis at least, and the embedding and LM head [V, D] across
  every chip (on an `AbstractMesh` of the recipe's topology, so no devices are needed);
- params, optimizer state and a batch fit the chip's HBM (fast), and so do the train step's temporaries, from
  XLA's memory analysis of the step compiled for a simulated CPU mesh of the slice's shape (slow);
- `dflash launch compile` end to end on the tiny recipe, the FLOP count of a jaxpr, an out-of-memory compile
  reported as not fitting.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from dflash.configs.recipe import load_recipe
from dflash.launch.cli import main
from dflash.launch.compile import (
    CompileReport,
    ProgramMemory,
    _compile,
    abstract_train_inputs,
    jaxpr_flops,
    run_compile,
    train_step_flops,
)
from dflash.launch.tpus import parse_tpu_type
from dflash.train.sharding import AXES, mesh_shape

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


POD_RECIPES = ("qwen3_8b", "qwen3_4b", "llama31_8b", "llama31_8b_widek", "qwen3_8b_dflash2", "qwen3_30b_a3b",
               "qwen3_32b", "gpt_oss_20b")
LARGE = 1 << 20  # elements


def _abstract(name: str):
    recipe = load_recipe(name)
    tpu = parse_tpu_type(load_recipe(name).launch.tpu_type)
    mesh = AbstractMesh(mesh_shape(recipe.train.mesh, tpu.chips), AXES)
    return recipe, tpu, mesh, abstract_train_inputs(recipe, mesh)


def _split(x) -> int:
    """How many ways an abstract array is split (1 = replicated)."""
    return math.prod(x.shape) // math.prod(x.sharding.shard_shape(x.shape))


def _per_chip(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", POD_RECIPES)
def test_no_large_array_is_replicated(name):
    recipe, tpu, mesh, ins = _abstract(name)
    arrays = {f"target{jax.tree_util.keystr(p)}": x for p, x in jax.tree_util.tree_flatten_with_path(ins["target"])[0]}
    arrays |= {f"state{jax.tree_util.keystr(p)}": x for p, x in jax.tree_util.tree_flatten_with_path(ins["state"])[0]}
    large = {k: x for k, x in arrays.items() if math.prod(x.shape) >= LARGE}
    assert len(large) > 20  # target layers, drafter kernels, and their two Adam moments
    under = {k: (x.shape, x.sharding.spec) for k, x in large.items() if _split(x) < mesh.shape["fsdp"]}
    assert not under, f"large arrays not split across fsdp={mesh.shape['fsdp']}: {under}"
    vocab = ins["known"].cfg.vocab_size
    heads = {k: x for k, x in large.items() if vocab in x.shape}
    assert heads and all(_split(x) == tpu.chips for x in heads.values()), {k: x.sharding.spec for k, x in heads.items()}
    # What each chip holds of the params, optimizer state and one batch: a small part of its HBM.
    resident = _per_chip(ins["target"]) + _per_chip(ins["state"]) + _per_chip(ins["batch"])
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((ins["target"], ins["state"])))
    assert resident < total / mesh.shape["fsdp"] * 1.05 and resident < 0.05 * tpu.hbm_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", POD_RECIPES)
def test_the_train_step_fits_hbm_on_a_simulated_mesh_of_the_slice(name):
    tpu_type = load_recipe(name).launch.tpu_type
    report = run_compile(name, [], tpu_type, backend="cpu", engine=False)
    step = report.train
    assert report.backend.startswith("XLA's CPU compiler on a simulated mesh of")
    assert step.devices == parse_tpu_type(tpu_type).chips
    assert step.temp_bytes > 1 << 30  # the step's activations are there (GiBs of them at 3072 tokens)
    assert report.fits(step), report.format()


@pytest.mark.slow
def test_compile_report_end_to_end_on_the_tiny_recipe(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["launch", "compile", "--recipe", "tiny", "--topology", "v5p-8", "--backend", "cpu",
                 "--json", str(out), "train.batch_size=4", "train.mesh.data=1", "train.mesh.fsdp=4"])
    text = capsys.readouterr().out
    assert code == 0, text
    report = CompileReport.from_json(json.loads(out.read_text()))
    assert [p.name for p in report.programs] == ["train_step", "propose", "verify", "propose x4", "verify x4",
                                                 "regen_step", "capture"]
    assert [n.stage.name for n in report.stage_needs()] == ["train", "regenerate", "capture", "serve", "serve x4",
                                                            "eval"]
    assert all(n.fits and n.program is not None for n in report.stage_needs()) and not report.refusals()
    assert report.mesh == {"data": 1, "fsdp": 4, "tensor": 1} and report.train.devices == 4
    for p in report.programs:
        assert p.argument_bytes > 0 and p.temp_bytes > 0 and not p.error and report.fits(p)
    assert report.params["target params"] == 134_515_008  # SmolLM2-135M, tied head
    assert report.step_flops > report.train.flops > 0
    assert "train_step" in text and "yes" in text and "simulated mesh of 4 devices" in text
    assert "memory per chip by stage in GiB" in text and "regen_step" in text
    assert main(["launch", "compile", "--recipe", "tiny"]) == 2  # no topology given, none in the recipe
    assert "--topology must name a TPU slice" in capsys.readouterr().err


def test_jaxpr_flops_counts_matmuls_and_every_scan_iteration():
    def f(x, w):
        def body(h, _):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(body, x, None, length=7)
        return (h @ w.T).sum()

    x, w = jax.ShapeDtypeStruct((3, 5), jnp.float32), jax.ShapeDtypeStruct((5, 5), jnp.float32)
    assert jaxpr_flops(jax.make_jaxpr(f)(x, w).jaxpr) == 8 * 2 * 3 * 5 * 5
    grad = jax.make_jaxpr(jax.grad(f, argnums=1))(x, w).jaxpr
    assert jaxpr_flops(grad) == 3 * 8 * 2 * 3 * 5 * 5  # forward, and two matmuls per matmul backward
    # A MoE's grouped matmul: each of the 6 rows meets one [5, 4] expert matrix.
    rows, experts = jax.ShapeDtypeStruct((6, 5), jnp.float32), jax.ShapeDtypeStruct((3, 5, 4), jnp.float32)
    ragged = jax.make_jaxpr(lambda a, b: jax.lax.ragged_dot(a, b, jnp.array([1, 2, 3], jnp.int32)))(rows, experts)
    assert jaxpr_flops(ragged.jaxpr) == 2 * 6 * 5 * 4


def test_an_out_of_memory_compile_is_reported_as_not_fitting():
    class Lowered:
        def compile(self):
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
                "for HLO temporaries (186.41G) exceeds available HBM (95.73G). HLO module: jit_train_step.")

    args = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    program = _compile("train_step", Lowered(), 64, args)
    assert program.error.startswith("RESOURCE_EXHAUSTED") and program.temp_bytes == round(186.41 * (1 << 30))
    assert program.argument_bytes == 4 << 20
    report = CompileReport(recipe="r", tpu_type="v5p-128", num_slices=1, backend="b", mesh={}, hbm_bytes=1 << 40,
                           peak_flops=1.0, batch_size=1, seq_len=1, steps=1, params={}, programs=[program])
    assert not report.fits(program)  # even under the HBM figure: the compiler refused it
    ok = ProgramMemory("verify", 1, 10, 5, 5, 20, 1, 0.0)
    assert ok.peak_bytes == 31 and report.fits(ok)


def test_known_targets_match_what_the_loaders_build(smollm2_target, golden_dir):
    from dflash.models.loading import load_hf_dir
    from dflash.models.registry import KNOWN_TARGETS, known_target, target_param_shapes

    known = known_target("smollm2")
    assert known.cfg == dataclasses.replace(smollm2_target.cfg, rms_norm_eps=known.cfg.rms_norm_eps)
    assert known.cfg.rms_norm_eps == pytest.approx(smollm2_target.cfg.rms_norm_eps, rel=1e-6)  # GGUF stores fp32
    assert target_param_shapes(known.cfg) == jax.tree.map(lambda a: tuple(a.shape), smollm2_target.params)
    assert known.mask_token_id == smollm2_target.drafter_arch(load_recipe("tiny").drafter).mask_token_id
    for case in ("qwen3_untied", "llama3_scaled_untied", "qwen2_bias_untied"):
        cfg, params = load_hf_dir(golden_dir / "tiny" / case)
        assert known_target(str(golden_dir / "tiny" / case)).cfg == cfg
        assert target_param_shapes(cfg) == jax.tree.map(lambda a: tuple(a.shape), params)
    qwen8, llama = known_target("Qwen/Qwen3-8B").cfg, known_target("meta-llama/Llama-3.1-8B-Instruct").cfg
    assert (qwen8.num_layers, qwen8.hidden_size, qwen8.qk_norm, qwen8.tie_word_embeddings) == (36, 4096, True, False)
    assert llama.rope_scaling.kind == "llama3" and llama.rope_scaling.factor == 8.0
    assert sum(math.prod(s) for s in jax.tree.leaves(target_param_shapes(qwen8), is_leaf=lambda x: isinstance(x, tuple))
               ) == 8_190_735_360  # Qwen3-8B's published parameter count
    assert set(KNOWN_TARGETS) >= {load_recipe(n).target.source for n in POD_RECIPES}
    with pytest.raises(ValueError, match="must be one of"):
        known_target("nowhere/none")


def test_a_hub_repo_id_that_cannot_be_fetched_is_named(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from dflash.models.registry import resolve_source

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the cache only, never the network
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"'dflash-test/no-such-model' \(a Hugging Face repo id\) could not be "
                                                r"fetched or found in the Hugging Face cache.*hf download"):
        resolve_source("dflash-test/no-such-model")


def test_the_compiled_batch_holds_what_the_labels_need():
    """`dflash compile` builds the batch the loader hands out: the target's next ids with `data.labels=target`,
    and its top-k ids and probabilities too with `soft`; the step traces on them, and soft labels cost the
    head no extra matmul."""
    mesh = AbstractMesh(mesh_shape(load_recipe("smollm2").train.mesh, 1), AXES)
    flops = {}
    for labels in ("text", "target", "soft"):
        recipe = load_recipe("smollm2", [f"data.labels={labels}", "data.soft_topk=8"])
        ins = abstract_train_inputs(recipe, mesh)
        b, s = recipe.train.batch_size, recipe.data.pack
        batch = ins["batch"]
        assert batch.label_kind == labels and batch.tokens.shape == batch.segment_ids.shape == (b, s)
        assert (batch.next_ids is None) == (labels == "text")
        if labels == "soft":
            assert batch.labels.ids.shape == batch.labels.probs.shape == (b, s, 8)
        flops[labels] = train_step_flops(recipe, ins)
    assert flops["text"] == flops["target"] == flops["soft"] > 0
