"""`dflash-export` (issue 13): a `dflash train` run dir (Orbax, written by the trainer's Checkpointer) -> the
z-lab and speculators layouts and back, bit-exact in fp32 and within bf16 rounding in bf16; the engine decodes
identically from the export; config fields, tensor names and shapes of Qwen3-8B- and Llama-3.1-8B-sized
drafters (built abstractly); the model card; atomic writes; refusals with messages that name the problem.
The Hub upload is tested in test_export_hub.py, numeric parity with the reference models in
test_export_parity.py."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import GOLDEN, drafter_params
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.configs.schema import to_dict
from dflash.export.cli import main as export_main
from dflash.export.run import ExportFor, ExportLayout, export_run
from dflash.models.config import DecoderConfig, DrafterConfig, RopeScaling
from dflash.models.drafter import DFlashDrafter, hf_tensor_names, resolve_drafter
from dflash.models.drafter_io import CheckpointError, load_drafter
from dflash.models.loading import WeightsError, load_hf_dir
from dflash.models.speculators import speculators_config
from dflash.models.zlab import zlab_config
from dflash.serve.engine import decode
from dflash.serve.plan import Chain

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


TARGET_DIR = GOLDEN / "tiny" / "llama3_scaled_untied"
STEP = 3


def _make_run(run_dir: Path, drafter: DFlashDrafter, results: bool = True) -> Path:
    from dflash.train.checkpoint import Checkpointer
    from dflash.train.loop import arch_dict
    from dflash.train.step import init_state, make_optimizer

    recipe = load_recipe("tiny", [f"target.source={TARGET_DIR}", f"train.run_dir={run_dir}"])
    state = init_state(nnx.state(drafter, nnx.Param), make_optimizer(1e-3, 10), jax.random.PRNGKey(0))
    ckpt = Checkpointer(run_dir / "checkpoints", {"arch": arch_dict(drafter.arch), "recipe": to_dict(recipe),
                                                  "target_fingerprint": "0" * 64})
    ckpt.save(STEP, state, {"iterator": {"next_index": STEP}})
    ckpt.close()
    if results:
        (run_dir / "eval").mkdir()
        (run_dir / "eval" / "results.json").write_text(json.dumps({
            "schema": "dflash-eval/1", "environment": {"machine": "test box"}, "target": {"model": "t"},
            "drafter": {"path": str(run_dir)}, "settings": {"sets": ["gsm8k"], "limit": 2, "max_new_tokens": 8,
                                                             "concurrency": [1], "block_size": 4},
            "sets": {"gsm8k": {"tau": 2.5, "speedup": 1.7, "mismatches": 0, "dflash": {"tok_s": 30.0},
                               "ar": {"tok_s": 20.0}}},
            "headline": {"tau": 2.5, "speedup": 1.7, "mismatches": 0}}))
    return run_dir


REPEATED = 123  # the tiny target's greedy continuation of the second test prompt repeats this token


def _drafter_that_drafts(arch, target_params, token: int) -> DFlashDrafter:
    """A random drafter whose attention and MLP outputs are scaled down (o_proj, down_proj x 0.01) and whose
    final norm is set so that the MASK positions (input: the MASK embedding) draft `token` through the target's
    head: its drafts are accepted wherever the target repeats `token`, so τ > 1 and acceptance is exercised."""
    drafter = DFlashDrafter(arch, nnx.Rngs(5))
    x = np.asarray(target_params["embed"][arch.mask_token_id], np.float64)
    x_hat = x / np.sqrt(np.mean(x * x) + arch.rms_norm_eps)
    head_row = np.asarray(target_params["lm_head"][:, token], np.float64)
    for layer in drafter.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.kernel.value = proj.kernel.value * 0.01
    drafter.norm.weight.value = jax.numpy.asarray(head_row / x_hat, jax.numpy.float32)
    return drafter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target_cfg, target_params = load_hf_dir(TARGET_DIR)
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 2), block_size=4,
                                         mask_token_id=255), target_cfg)
    drafter = _drafter_that_drafts(arch, target_params, REPEATED)
    run_dir = _make_run(tmp_path_factory.mktemp("runs") / "tiny_run", drafter)
    return target_cfg, target_params, drafter, run_dir


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_export_then_import_is_bit_exact_in_fp32(setup, tmp_path, fmt):
    target_cfg, _, drafter, run_dir = setup
    result = export_run(run_dir, ExportLayout(fmt), out=tmp_path / "out", say=lambda _: None)
    assert result.step == STEP and [n for n, _ in result.files] == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left beside it
    loaded = load_drafter(tmp_path / "out", target_cfg)
    assert loaded.arch == drafter.arch
    want, got = drafter_params(drafter), drafter_params(loaded)
    assert want.keys() == got.keys()
    for keys in want:
        np.testing.assert_array_equal(got[keys], want[keys])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if fmt == "zlab":
        assert config["model_type"] == "qwen3" and target_cfg.family == "llama"
        assert config["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [1, 2]}
        assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_parameters"]["rope_theta"] == 500000.0
    else:
        assert config["aux_hidden_state_layer_ids"] == [2, 3] and config["architectures"] == ["DFlashSpeculator"]
        assert config["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]


def test_loading_builds_the_drafter_abstractly_and_fills_every_parameter(setup, tmp_path, monkeypatch):
    """The loaders build the module under `nnx.eval_shape` (no random init to overwrite, nothing compiled: ~2 s of
    a `dflash serve` start) and fill every parameter with a concrete array equal to the stored one."""
    target_cfg, _, drafter, run_dir = setup
    export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "out", say=lambda _: None)
    built = []
    init = DFlashDrafter.__init__

    def spy(self, *args, **kwargs):
        built.append(isinstance(jax.numpy.zeros(()), jax.core.Tracer))  # True: built inside a trace, abstractly
        init(self, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "__init__", spy)
    for source in (tmp_path / "out", run_dir):  # an exported directory, a run dir's Orbax checkpoint
        loaded = load_drafter(source, target_cfg)
        want, got = drafter_params(drafter), drafter_params(loaded)
        assert want.keys() == got.keys()
        for keys, value in nnx.to_flat_state(nnx.state(loaded)):
            assert isinstance(value.get_value(), jax.Array), keys
            np.testing.assert_array_equal(got[keys], want[keys])
    assert built == [True, True]


def test_bf16_export_is_the_fp32_weights_rounded_to_bf16(setup, tmp_path):
    target_cfg, _, drafter, run_dir = setup
    export_run(run_dir, ExportLayout("zlab", "bfloat16"), out=tmp_path / "bf16", say=lambda _: None)
    header = (tmp_path / "bf16" / "model.safetensors").read_bytes()
    header = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    want, got = drafter_params(drafter), drafter_params(load_drafter(tmp_path / "bf16", target_cfg))
    for keys, value in want.items():
        rounded = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got[keys], rounded)
        assert np.all(np.abs(got[keys] - value) <= 2.0 ** -8 * np.abs(value))
    assert any(not np.array_equal(got[k], want[k]) for k in want)  # bf16 really rounded something


@pytest.mark.slow  # ~20 s: nightly; the bit-exact fp32 round trips of both layouts stay (same weights, same decode)
def test_the_engine_decodes_identically_from_the_export(setup, tmp_path):
    """The same accepted counts per step, the same τ (> 1: this drafter's drafts are often right) and the same
    tokens from the Orbax checkpoint and from both exported layouts."""
    target_cfg, target_params, _, run_dir = setup
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 255, size=n)) for n in (6, 13)]
    runs = {}
    for name, path in (("orbax", run_dir), ("zlab", tmp_path / "z"), ("speculators", tmp_path / "s")):
        if name != "orbax":
            export_run(run_dir, ExportLayout(name), out=path, say=lambda _: None)
        drafter = load_drafter(path, target_cfg)
        runs[name] = decode(target_params, target_cfg, prompts, 20, max_len=128, plan=Chain(4), drafter=drafter)
    assert REPEATED in runs["orbax"][1].token_ids and runs["orbax"][1].tau > 1.5  # drafts are accepted
    for name, results in runs.items():
        assert [r.token_ids for r in results] == [r.token_ids for r in runs["orbax"]], name
        assert [r.accepted for r in results] == [r.accepted for r in runs["orbax"]], name
        assert [r.tau for r in results] == [r.tau for r in runs["orbax"]], name


QWEN3_8B = DecoderConfig(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                         num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                         max_position_embeddings=40960, qk_norm=True)
LLAMA31_8B = DecoderConfig(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                           rope_theta=5e5, max_position_embeddings=131072,
                           rope_scaling=RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=8192))


@pytest.mark.parametrize("target, mask, ids", [(QWEN3_8B, 151669, [1, 9, 17, 25, 33]),
                                               (LLAMA31_8B, 128002, [1, 8, 15, 22, 29])])
def test_8b_sized_drafters_have_the_released_fields_names_and_shapes(target, mask, ids):
    """Built abstractly (nnx.eval_shape: no weight is allocated): 58 tensors with the z-lab names and
    PyTorch [out, in] shapes, and the config fields of z-lab's released 8B b16 drafters."""
    arch = resolve_drafter(DrafterConfig(num_layers=5, num_features=5, block_size=16, mask_token_id=mask), target)
    abstract = nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    shapes = hf_tensor_names(abstract)
    assert len(shapes) == 58
    h, f = 4096, target.intermediate_size
    assert shapes["fc.weight"] == (h, 5 * h) and shapes["hidden_norm.weight"] == (h,) and shapes["norm.weight"] == (h,)
    for i in range(5):
        p = f"layers.{i}."
        assert shapes[p + "self_attn.q_proj.weight"] == (32 * 128, h)
        assert shapes[p + "self_attn.k_proj.weight"] == shapes[p + "self_attn.v_proj.weight"] == (8 * 128, h)
        assert shapes[p + "self_attn.o_proj.weight"] == (h, 32 * 128)
        assert shapes[p + "self_attn.q_norm.weight"] == shapes[p + "self_attn.k_norm.weight"] == (128,)
        assert shapes[p + "mlp.gate_proj.weight"] == shapes[p + "mlp.up_proj.weight"] == (f, h)
        assert shapes[p + "mlp.down_proj.weight"] == (h, f)
        assert shapes[p + "input_layernorm.weight"] == shapes[p + "post_attention_layernorm.weight"] == (h,)
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in shapes)
    config = zlab_config(arch, "bfloat16")
    expected = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
                "num_target_layers": target.num_layers,
                "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids}, "hidden_size": h,
                "intermediate_size": f, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
                "max_position_embeddings": target.max_position_embeddings, "vocab_size": target.vocab_size,
                "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
                "layer_types": ["full_attention"] * 5, "torch_dtype": "bfloat16",
                "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}}
    assert {k: config[k] for k in expected} == expected
    if target is LLAMA31_8B:
        want = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
        assert config["rope_scaling"] == want and config["rope_parameters"] == {**want, "rope_theta": 5e5}
    else:
        assert config["rope_scaling"] is None and config["rope_parameters"] == {"rope_type": "default",
                                                                                "rope_theta": 1e6}
    spec = speculators_config(arch, "org/target")
    assert spec["aux_hidden_state_layer_ids"] == [j + 1 for j in ids] and spec["target_hidden_size"] == h
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 5 and spec["draft_vocab_size"] == target.vocab_size
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 15


def test_eps_is_written_as_the_number_it_was_meant_to_be():
    """A GGUF stores eps as float32: 1e-5 arrives as 9.999999747378752e-06 and must be written 1e-05 (the
    same float32, so the drafter computes the same); a float64 eps is kept as it is."""
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=1, block_size=4, mask_token_id=3),
                           dataclasses.replace(QWEN3_8B, rms_norm_eps=float(np.float32(1e-5))))
    assert arch.rms_norm_eps == 9.999999747378752e-06
    assert zlab_config(arch)["rms_norm_eps"] == 1e-05
    assert zlab_config(dataclasses.replace(arch, rms_norm_eps=1e-6))["rms_norm_eps"] == 1e-6


def test_model_card_names_target_training_eval_and_serving_lines(setup, tmp_path):
    _, _, _, run_dir = setup
    export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "card", export_for=ExportFor(target="org/tiny-llama"),
               say=lambda _: None)
    card = (tmp_path / "card" / "README.md").read_text()
    assert "base_model: org/tiny-llama" in card and "step 3 of `train.steps=" in card
    assert "| gsm8k | 2.50 | 1.70x | 30.0 | 20.0 | 0 |" in card  # the eval table of <run_dir>/eval/results.json
    assert "DFlash vs AR: 1.70x tokens/s (tau 2.50, K=4)" in card
    assert ("vllm serve org/tiny-llama --speculative-config '{\"method\": \"dflash\", \"model\": \""
            + str(tmp_path / "card") + "\", \"num_speculative_tokens\": 3}'") in card
    assert "--speculative-algorithm DFLASH" in card and "--speculative-num-draft-tokens 4" in card
    assert "Data: `gsm8k`" in card and "[1, 2] of 4" in card


def test_an_interrupted_export_leaves_nothing_that_looks_complete(setup, tmp_path, monkeypatch):
    _, _, _, run_dir = setup
    import dflash.export.run as export_run_module

    def boom(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(export_run_module, "render_card", boom)
    with pytest.raises(KeyboardInterrupt):
        export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "out", say=lambda _: None)
    assert list(tmp_path.iterdir()) == []  # neither out nor its temporary directory
    monkeypatch.undo()
    # A temporary directory left by a killed export (its pid gone) is removed by the next export there.
    stale = tmp_path / ".out.tmp-999999999"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "out", say=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_existing_out_dir_is_refused_unless_overwrite(setup, tmp_path, capsys):
    _, _, _, run_dir = setup
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export_main([str(run_dir), "--format", "zlab", "--out", str(out)]) == 2
    assert "--out " + str(out) + " exists; pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert export_main([str(run_dir), "--format", "speculators", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_dry_run_lists_the_files_and_the_upload_and_writes_nothing(setup, tmp_path, capsys):
    _, _, _, run_dir = setup
    code = export_main([str(run_dir), "--format", "zlab", "--out", str(tmp_path / "o"), "--push-to-hub",
                        "someone/tiny-dflash", "--private", "--revision", "v1", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    for name in ("README.md", "config.json", "model.safetensors"):
        assert name in out
    assert " kB" in out  # sizes listed
    assert "would upload 3 files" in out and "someone/tiny-dflash (revision v1, private)" in out
    assert "nothing was written or sent" in out
    assert list(tmp_path.iterdir()) == []


def test_refusals_name_the_problem(setup, tmp_path, capsys):
    target_cfg, _, drafter, run_dir = setup
    # No checkpoint: a directory that is no run dir, and a run dir whose checkpoints/ is empty.
    (tmp_path / "empty").mkdir()
    assert export_main([str(tmp_path / "empty"), "--format", "zlab", "--out", str(tmp_path / "x")]) == 2
    assert "has no checkpoints/ directory" in capsys.readouterr().err
    (tmp_path / "norun" / "checkpoints").mkdir(parents=True)
    assert export_main([str(tmp_path / "norun"), "--format", "zlab", "--out", str(tmp_path / "x")]) == 2
    assert "holds no finished checkpoint" in capsys.readouterr().err
    assert export_main([str(run_dir), "--step", "9", "--format", "zlab", "--out", str(tmp_path / "x")]) == 2
    assert "has no checkpoint step 9; its steps are [3]" in capsys.readouterr().err
    # A corrupt checkpoint.
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    for path in (broken / "checkpoints" / str(STEP) / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 1000:
            path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="is corrupt"):
        export_run(broken, ExportLayout("zlab"), out=tmp_path / "x", say=lambda _: None)
    # A drafter reading the target's last layer cannot be exported.
    last = dataclasses.replace(drafter.arch, layer_ids=(1, 3))
    lastrun = _make_run(tmp_path / "lastrun", DFlashDrafter(last, nnx.Rngs(0)), results=False)
    assert export_main([str(lastrun), "--format", "zlab", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "layer_ids must not include 3, the target's last layer" in err and "hidden_states[4]" in err
    assert not (tmp_path / "x").exists()
    # --step best of a run that kept no best drafter: its newest checkpoint, said so (issue 51); of a directory with
    # neither, refused; a bad --results file.
    assert export_main([str(run_dir), "--step", "best", "--format", "zlab", "--out", str(tmp_path / "xb")]) == 0
    out = capsys.readouterr().out
    assert "has no best/ (" in out and f"using its newest checkpoint, step {STEP}, instead of --step best" in out
    assert f"checkpoints/{STEP} (step {STEP}) -> zlab layout" in out
    assert export_main([str(tmp_path / "norun"), "--step", "best", "--format", "zlab", "--out",
                        str(tmp_path / "x")]) == 2
    assert "holds no best drafter" in capsys.readouterr().err
    (tmp_path / "r.json").write_text('{"schema": "other"}')
    assert export_main([str(run_dir), "--format", "zlab", "--out", str(tmp_path / "x"), "--results",
                        str(tmp_path / "r.json")]) == 2
    assert "schema 'dflash-eval/1'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_mismatched_import_names_every_mismatch(setup, tmp_path):
    target_cfg, _, drafter, run_dir = setup
    export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "z", say=lambda _: None)
    export_run(run_dir, ExportLayout("speculators"), out=tmp_path / "s", say=lambda _: None)
    other = dataclasses.replace(target_cfg, hidden_size=128, vocab_size=300, num_layers=6)
    for layout in ("z", "s"):
        with pytest.raises(ValueError) as err:
            load_drafter(tmp_path / layout, other)
        assert "hidden_size: drafter 64 vs target 128" in str(err.value)
        assert "vocab_size: drafter 256 vs target 300" in str(err.value)
    with pytest.raises(ValueError, match="num_layers: drafter 4 vs target 6"):
        load_drafter(tmp_path / "z", other)
    expect = dataclasses.replace(drafter.arch, layer_ids=(0, 2), mask_token_id=7, block_size=8)
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path / "s", target_cfg, expect=expect)
    for part in ("layer_ids: drafter (1, 2) vs expected (0, 2)", "mask_token_id: drafter 255 vs expected 7",
                 "block_size: drafter 4 vs expected 8"):
        assert part in str(err.value)
    small = dataclasses.replace(target_cfg, vocab_size=200)
    with pytest.raises(ValueError, match=r"mask_token_id 255 lies outside the target's vocab \[0, 200\)"):
        load_drafter(tmp_path / "z", small)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    config.update(draft_vocab_size=128, sample_from_anchor=True)
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError) as err:
        load_drafter(tmp_path / "s", target_cfg)
    assert "draft_vocab_size must equal" in str(err.value) and "sample_from_anchor must be false" in str(err.value)


def test_an_export_of_a_retired_markov_head_is_refused_by_name(setup, tmp_path):
    """An export written with the Markov head that left the code (docs/retired.md: its `markov_head/` side
    directory) is refused in both layouts rather than loaded without the head it was trained with."""
    target_cfg, _, _, run_dir = setup
    for fmt in ("zlab", "speculators"):
        export_run(run_dir, ExportLayout(fmt), out=tmp_path / fmt, say=lambda _: None)
        (tmp_path / fmt / "markov_head").mkdir()
        with pytest.raises(WeightsError, match=r"Markov head \(markov_head/\), an option retired"):
            load_drafter(tmp_path / fmt, target_cfg)


def test_released_configs_import_block_size_and_speculators_defaults(setup, tmp_path):
    """A newer z-lab config keeps block_size inside dflash_config; a speculators config written by speculators
    itself lists only the fields that differ from Qwen3Config(); both load."""
    target_cfg, _, drafter, run_dir = setup
    export_run(run_dir, ExportLayout("zlab"), out=tmp_path / "z", say=lambda _: None)
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    config["dflash_config"]["block_size"] = config.pop("block_size")
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    assert load_drafter(tmp_path / "z", target_cfg).arch.block_size == 4
    export_run(run_dir, ExportLayout("speculators"), out=tmp_path / "s", say=lambda _: None)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    layer = config["transformer_layer_config"]
    for key in ("rms_norm_eps", "hidden_act", "attention_bias", "tie_word_embeddings"):
        layer.pop(key)  # equal to Qwen3Config's defaults: speculators' to_diff_dict leaves them out
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    loaded = load_drafter(tmp_path / "s", target_cfg)
    assert loaded.arch == drafter.arch


def test_the_console_script_is_installed():
    script = Path(sys.executable).parent / "dflash-export"
    assert script.is_file(), "reinstall the project (pip install -e .) so that dflash-export exists"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0 and "--push-to-hub REPO" in done.stdout and "zlab,speculators" in done.stdout


def test_the_best_drafter_exports_with_its_step(setup, tmp_path):
    """--step best exports <run_dir>/best (written by training's real-τ evaluation) with best.json's step and
    the run's recipe in the card."""
    from dflash.train.real_eval import save_best

    target_cfg, _, drafter, run_dir = setup
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    best = DFlashDrafter(drafter.arch, nnx.Rngs(9))
    save_best(copy, best, 2, {"tau": 1.5, "tau/gsm8k": 1.5, "accept_per_position": [0.5, 0.0, 0.0]})
    result = export_run(copy, ExportLayout("speculators"), step="best", out=tmp_path / "out", say=lambda _: None)
    assert result.step == 2
    card = (tmp_path / "out" / "README.md").read_text()
    assert "step 2 (the best drafter by real τ during training)" in card and "Data: `gsm8k`" in card
    want, got = drafter_params(best), drafter_params(load_drafter(tmp_path / "out", target_cfg))
    for keys in want:
        np.testing.assert_array_equal(got[keys], want[keys])


def test_dflash_export_subcommand_exports_like_dflash_export(setup, tmp_path, capsys):
    """`dflash export` is `dflash-export`: a real export through the subcommand loads back bit-exact; the target
    it is made for comes from the run's recorded recipe, `target.*` overrides of it, or `--config`."""
    from dflash.launch.cli import main as dflash_main

    target_cfg, _, drafter, run_dir = setup
    out = tmp_path / "zlab"
    assert dflash_main(["export", str(run_dir), "--format", "zlab", "--out", str(out), "--dtype", "float32"]) == 0
    said = capsys.readouterr().out
    assert f"checked against target {TARGET_DIR} (the run's recorded recipe): llama, 4 layers" in said
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    loaded = load_drafter(out, target_cfg)
    assert loaded.arch == drafter.arch
    want, got = drafter_params(drafter), drafter_params(loaded)
    for keys in want:
        np.testing.assert_array_equal(got[keys], want[keys])
    # --config (+ overrides) names the target: the speculators verifier is it, the drafter is checked against it.
    spec = tmp_path / "spec"
    assert dflash_main(["export", str(run_dir), "--format", "speculators", "--out", str(spec), "--config", "tiny",
                        f"target.source={TARGET_DIR}"]) == 0
    assert f"(--config tiny with target.source={TARGET_DIR})" in capsys.readouterr().out
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(TARGET_DIR)
    # A target the drafter was not trained for is refused, naming each mismatch; nothing is written.
    assert dflash_main(["export", str(run_dir), "--format", "zlab", "--out", str(tmp_path / "x"),
                        "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash export: error:") and "hidden_size: drafter 64 vs target 576" in err
    assert "target smollm2 (--config tiny)" in err and not (tmp_path / "x").exists()
    # Without --config only target.* overrides apply (to the recorded recipe), in either spelling of the command.
    assert export_main([str(run_dir), "--format", "zlab", "--out", str(tmp_path / "y"), "train.lr=1"]) == 2
    assert "must start with 'target.'; received ['train.lr=1']" in capsys.readouterr().err
    assert export_main([str(run_dir), "--format", "zlab", "--out", str(tmp_path / "y"), "target.source=smollm2"]) == 2
    assert "hidden_size: drafter 64 vs target 576" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_a_best_drafter_without_its_checkpoints_exports_for_the_configs_target(setup, tmp_path, capsys):
    """`<run_dir>/best` copied alone (its run's checkpoints left elsewhere) records no target: `--config` names it,
    which also gives the speculators verifier its family."""
    from dflash.launch.cli import main as dflash_main
    from dflash.train.real_eval import save_best

    _, _, drafter, _ = setup
    save_best(tmp_path / "run", DFlashDrafter(drafter.arch, nnx.Rngs(3)), 2, {"tau": 1.5, "tau/gsm8k": 1.5,
                                                                               "accept_per_position": [0.5, 0.0, 0.0]})
    assert dflash_main(["export", str(tmp_path / "run"), "--step", "best", "--format", "speculators", "--out",
                        str(tmp_path / "out"), "--config", "tiny", f"target.source={TARGET_DIR}"]) == 0
    assert "checked against target" in capsys.readouterr().out
    verifier = json.loads((tmp_path / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["LlamaForCausalLM"] and verifier["name_or_path"] == str(TARGET_DIR)


def test_best_copied_alone_keeps_its_card_and_is_never_rotated_out(setup, tmp_path):
    """best/ is not a checkpoint: rotating checkpoints (train.keep_checkpoints=1) never removes it, and it carries what
    its model card needs: the run's recipe (run.json, saved with it), how it was chosen (best.json: its τ, prompts and
    chat template variables) and `dflash eval`'s results of it (results.json, kept there by the eval of --step best).
    Copied alone, as docs/pods.md copies it off the bucket, it exports with the same card."""
    from dflash.eval.run import BEST_RESULTS, keep_with_best
    from dflash.models.drafter_io import best_dir_of, read_run
    from dflash.train.checkpoint import Checkpointer
    from dflash.train.real_eval import save_best
    from dflash.train.step import init_state, make_optimizer

    _, _, drafter, run_dir = setup
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    meta = read_run(run).meta
    setup_record = {"sets": ["gsm8k"], "per_set": 8, "new_tokens": 128, "template_kwargs": {"enable_thinking": False}}
    save_best(run, DFlashDrafter(drafter.arch, nnx.Rngs(4)), 2, {"tau": 1.5, "tau/gsm8k": 1.5,
                                                                  "accept_per_position": [0.5, 0.0, 0.0]},
              setup_record, meta)
    before = {p.name: p.read_bytes() for p in (run / "best").iterdir()}
    ckpt = Checkpointer(run / "checkpoints", meta, keep=1)
    state = init_state(nnx.state(drafter, nnx.Param), make_optimizer(1e-3, 10), jax.random.PRNGKey(0))
    for step in (4, 5, 6):
        ckpt.save(step, state, {"iterator": {"next_index": step}})
    ckpt.close()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["6"]  # 2 and 3 rotated out
    assert {p.name: p.read_bytes() for p in (run / "best").iterdir()} == before  # best/ untouched

    results = json.loads((run_dir / "eval" / "results.json").read_text())
    results["settings"]["chat_template_kwargs"] = {"enable_thinking": False}
    results["drafter"] = {"path": str(run), "step": "best", "best_step": 2}
    assert best_dir_of(run, "best") == run / "best" == best_dir_of(run / "best", None)
    assert best_dir_of(run, None) is None and best_dir_of(run, 6) is None
    assert not keep_with_best(results, run / "best", 5)  # best/ holds another step now: not kept there
    assert not (run / "best" / BEST_RESULTS).exists()
    assert keep_with_best(results, run / "best", 2)

    alone = tmp_path / "alone"
    shutil.copytree(run / "best", alone / "best")  # no checkpoints/, no eval/
    export_run(alone, ExportLayout("zlab"), step="best", out=tmp_path / "out", say=lambda _: None)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "step 2 (the best drafter by real τ during training)" in card and "Data: `gsm8k`" in card
    assert "| gsm8k | 2.50 | 1.70x | 30.0 | 20.0 | 0 |" in card  # the eval table, from best/results.json
    assert 'chat template variables `{"enable_thinking": false}`.' in card  # the variables the eval table used
    assert ("Chosen: real τ 1.50 (gsm8k 1.50) decoded by the bundled engine during training on 8 prompts of each of "
            'gsm8k (first turns, greedy, 128 new tokens), chat template variables `{"enable_thinking": false}`') in card
    assert "Chat template variables of the training answers (`data.regen.template_kwargs`): none" in card
    # without results.json in best/ (an older best/), the card says no results were found
    (alone / "best" / BEST_RESULTS).unlink()
    export_run(alone, ExportLayout("zlab"), step="best", out=tmp_path / "bare", say=lambda _: None)
    assert "No `dflash eval` results were given or found" in (tmp_path / "bare" / "README.md").read_text()


def test_the_card_names_the_engine_the_results_came_from():
    """Results of `dflash eval --url` against vLLM say so on the card; ours (or results before engines were
    recorded) name the bundled engine."""
    from dflash.export.card import _eval_section

    results = {"schema": "dflash-eval/1", "headline": {"tau": 2.5, "speedup": 1.7, "mismatches": None},
               "settings": {"block_size": 4, "sets": ["gsm8k"], "limit": 1, "max_new_tokens": 8}, "sets": {}}
    ours = "\n".join(_eval_section(results, "runs/x"))
    vllm = "\n".join(_eval_section({**results, "engine": {"dflash": "vllm", "ar": "vllm"}}, "runs/x"))
    assert "against the bundled JAX engine (runs/x)" in ours
    assert "against vllm serving this drafter (runs/x)" in vllm and "bundled" not in vllm.split("\n")[2]
