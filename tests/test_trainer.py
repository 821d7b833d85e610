"""The sharded trainer: mesh rules, 8 devices == 1 device, golden one-step loss, checkpoints (fp32, CPU)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from dflash.configs.schema import ConfigError
from dflash.data.batch import TrainBatch
from dflash.models.drafter import DFlashDrafter, DrafterConfig, default_mask_token_id, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.train.checkpoint import Checkpointer, CheckpointError
from dflash.train.metrics import NonFiniteMetricError, check_finite, flatten
from dflash.train.objective import Objective, default_gamma
from dflash.train.sharding import (
    DRAFTER_RULES,
    TARGET_RULES,
    MeshConfig,
    make_mesh,
    mesh_shape,
    place,
    shard_batch,
    spec_for,
    tree_shardings,
)
from dflash.train.step import FrozenTarget, StepSpec, init_state, make_optimizer, make_train_step, train_head

K, N, S, B = 4, 4, 32, 4

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


LAYER_IDS = (1, 3)
MASK_ID = 255
GOLDEN_STEP = Path(__file__).parent / "golden" / "train_one_step.json"


@pytest.fixture(scope="module")
def tiny():
    target_cfg, target_params = load_hf_dir(Path(__file__).parent / "golden" / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=LAYER_IDS, block_size=K),
                           target_cfg, mask_token_id=MASK_ID)
    return target_cfg, target_params, arch


def _batches(steps: int) -> list[TrainBatch]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, MASK_ID, size=(B, S)).astype(np.int32)
        mask = np.ones((B, S), np.float32)
        mask[:, :5] = 0.0
        mask[1, 20:] = 0.0  # a padded tail
        out.append(TrainBatch(tokens=tokens, loss_mask=mask))
    return out


def _train(tiny, mesh, steps: int, seed: int = 0):
    """`steps` updates on a mesh; returns (host params, list of host metrics)."""
    target_cfg, target_params, arch = tiny
    optimizer = make_optimizer(3e-3, total_steps=10)

    def fresh():
        params = nnx.state(DFlashDrafter(arch, nnx.Rngs(params=seed)), nnx.Param)
        return init_state(params, optimizer, jax.random.PRNGKey(seed + 1))

    shardings = tree_shardings(jax.eval_shape(fresh), DRAFTER_RULES, mesh)
    state = jax.jit(fresh, out_shardings=shardings)()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))), nnx.Param)
    placed = place(target_params, TARGET_RULES, mesh)
    spec = StepSpec(graphdef=graphdef, target_cfg=target_cfg, arch=arch, num_anchors=N,
                    objective=Objective(gamma=default_gamma(K)), optimizer=optimizer)
    step = make_train_step(spec, FrozenTarget(params=placed, head=train_head(placed, target_cfg)),
                           state_shardings=shardings)
    history = []
    for batch in _batches(steps):
        state, metrics = step(state, shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    return state, jax.device_get(state.params), history


# ----------------------------------------------------------------------------- sharding rules


def test_mesh_shape_fills_the_free_axis_and_rejects_bad_products():
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="train.mesh"):
        mesh_shape(MeshConfig(data=3, fsdp=1, tensor=1), 8)
    with pytest.raises(ConfigError, match="at most one -1"):
        MeshConfig(data=-1, fsdp=-1)


def test_rules_shard_matmuls_and_replicate_what_does_not_divide():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert spec_for("layers/0/self_attn/q_proj/kernel", (64, 64), DRAFTER_RULES, mesh) == \
        PartitionSpec("fsdp", "tensor")
    assert spec_for("layers/1/mlp/down_proj/kernel", (128, 64), DRAFTER_RULES, mesh) == \
        PartitionSpec("tensor", "fsdp")
    assert spec_for("norm/weight", (64,), DRAFTER_RULES, mesh) == PartitionSpec()
    # 9 heads * 64 = 576 divides 2; a width of 3 does not, so that dim is replicated.
    assert spec_for("layers/0/self_attn/k_proj/kernel", (64, 3), DRAFTER_RULES, mesh) == PartitionSpec("fsdp", None)
    assert spec_for("layers/wq", (4, 64, 64), TARGET_RULES, mesh) == PartitionSpec(None, "fsdp", "tensor")
    # Optimizer moments follow their parameter's rule; scalars (count) are replicated.
    assert spec_for("opt_state/1/inner_state/0/mu/layers/0/mlp/up_proj/kernel", (64, 128), DRAFTER_RULES, mesh) == \
        PartitionSpec("fsdp", "tensor")
    # fc's output stays off 'tensor' (an XLA SPMD miscompile of its gradient, docs/decisions.md D11).
    assert spec_for("fc/kernel", (128, 64), DRAFTER_RULES, mesh) == PartitionSpec("fsdp", None)
    assert spec_for("opt_state/1/inner_state/0/count", (), DRAFTER_RULES, mesh) == PartitionSpec()


def test_state_is_born_sharded(tiny):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    state, _, _ = _train(tiny, mesh, steps=1)
    kernel = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert kernel.sharding.spec == PartitionSpec("fsdp", "tensor")
    assert len(kernel.addressable_shards) == 8 and kernel.addressable_shards[0].data.shape == (32, 32)


# ----------------------------------------------------------------------------- 8 devices == 1 device


def test_eight_devices_match_one_device(tiny):
    assert len(jax.devices()) == 8
    one = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    eight = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, params_1, hist_1 = _train(tiny, one, steps=3)
    _, params_8, hist_8 = _train(tiny, eight, steps=3)
    for m1, m8 in zip(hist_1, hist_8, strict=True):
        np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(m8["accuracy_per_position"], m1["accuracy_per_position"], atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5),
                 params_8, params_1)


# ----------------------------------------------------------------------------- golden one-step loss


def test_golden_one_step_loss(tiny):
    """Loss, acceptance and gradient norm of the first update on fixed inputs, against a committed file.

    If the objective or the drafter changed ON PURPOSE, regenerate the file with
        DFLASH_UPDATE_GOLDEN=1 bin/test tests/test_trainer.py -k golden
    and say why in the commit message.
    """
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    _, _, hist = _train(tiny, mesh, steps=1)
    got = {k: float(hist[0][k]) for k in ("loss", "acceptance_length", "grad_norm", "num_labels")}
    if os.environ.get("DFLASH_UPDATE_GOLDEN") == "1":
        GOLDEN_STEP.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN_STEP.read_text())
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), (
            f"{name} changed: {got[name]} vs golden {value}. If the objective or drafter changed on purpose, "
            "regenerate with DFLASH_UPDATE_GOLDEN=1 bin/test tests/test_trainer.py -k golden")


# ----------------------------------------------------------------------------- checkpoints


def _saved(tiny, tmp_path: Path, arch_tag: str = "a") -> tuple[Checkpointer, object, object]:
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    state, _, _ = _train(tiny, mesh, steps=1)
    ckpt = Checkpointer(tmp_path / "ck", {"arch": {"tag": arch_tag, "layers": 2}})
    ckpt.save(1, state, {"iterator": {"next_index": 1}})
    ckpt.wait()
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return ckpt, state, shardings


def test_checkpoint_round_trip_is_exact(tiny, tmp_path):
    ckpt, state, shardings = _saved(tiny, tmp_path)
    restored, data_state = ckpt.restore(1, state, shardings)
    assert data_state == {"iterator": {"next_index": 1}}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, state)


def test_checkpoint_of_another_architecture_is_refused(tiny, tmp_path):
    ckpt, state, shardings = _saved(tiny, tmp_path)
    other = Checkpointer(tmp_path / "ck", {"arch": {"tag": "a", "layers": 5}})
    with pytest.raises(CheckpointError, match=r"another architecture \(layers: checkpoint 2 vs run 5\)"):
        other.restore(1, state, shardings)
    # a field added since the checkpoint was written (its meta lacks it) compares at its default ...
    same = Checkpointer(tmp_path / "ck", {"arch": {"tag": "a", "layers": 2, "selector_rank": 0}})
    same.restore(1, state, shardings)
    # ... so a run that sets it otherwise is refused naming it
    headed = Checkpointer(tmp_path / "ck", {"arch": {"tag": "a", "layers": 2, "selector_rank": 8}})
    with pytest.raises(CheckpointError, match=r"selector_rank: checkpoint 0 vs run 8"):
        headed.restore(1, state, shardings)
    # a field retired since (docs/retired.md) resumes at its off value and is refused, named, when it was on
    for rank in (0, 8):  # the same checkpoint as if written then, its meta holding the field
        shutil.copytree(tmp_path / "ck", tmp_path / f"retired{rank}")
        meta_file = tmp_path / f"retired{rank}" / "1" / "meta" / "metadata"
        meta = json.loads(meta_file.read_text())
        meta_file.write_text(json.dumps({**meta, "arch": {**meta["arch"], "markov_rank": rank}}))
    resumed, refused = (Checkpointer(tmp_path / f"retired{r}", {"arch": {"tag": "a", "layers": 2}}) for r in (0, 8))
    resumed.restore(1, state, shardings)
    with pytest.raises(CheckpointError, match=r"markov_rank: checkpoint 8 vs run 0 \(retired"):
        refused.check_compatible(1)
    resumed.close()
    refused.close()


def test_corrupt_checkpoint_gives_a_clear_error(tiny, tmp_path):
    ckpt, state, shardings = _saved(tiny, tmp_path)
    for path in (tmp_path / "ck" / "1" / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 0 and "ocdbt" in str(path.parent.name + path.name):
            path.write_bytes(b"\x00garbage" * 4)
    with pytest.raises(CheckpointError, match=r"could not be restored .* corrupt"):
        ckpt.restore(1, state, shardings)
    shutil.rmtree(tmp_path / "ck" / "1" / "meta")
    with pytest.raises(CheckpointError, match="has no meta/ entry"):
        ckpt.restore(1, state, shardings)


# ----------------------------------------------------------------------------- metrics and presets


def test_non_finite_metrics_stop_naming_the_step():
    check_finite({"loss": np.float32(1.0), "accuracy_per_position": np.ones(4)}, step=3)
    with pytest.raises(NonFiniteMetricError, match=r"at step 17: loss=nan"):
        check_finite({"loss": np.float32("nan"), "grad_norm": np.float32(2.0)}, step=17)
    with pytest.raises(NonFiniteMetricError, match=r"grad_norm=inf"):
        check_finite({"loss": np.float32(1.0), "grad_norm": np.float32("inf")}, step=2)


def test_vector_metrics_flatten_per_position():
    flat = flatten({"loss": 1.5, "accuracy_per_position": np.array([1.0, 0.5, 0.25])})
    assert flat == {"loss": 1.5, "accuracy_per_position/pos_00": 1.0, "accuracy_per_position/pos_01": 0.5,
                    "accuracy_per_position/pos_02": 0.25}


def test_smollm2_mask_token_is_an_unused_special_and_not_a_stop(smollm2_target):
    mask = default_mask_token_id(smollm2_target.tokenizer, smollm2_target.cfg)
    assert mask == 16 and smollm2_target.tokenizer.backend.id_to_token(mask) == "<empty_output>"
    assert mask not in smollm2_target.tokenizer.stop_token_ids


def test_bf16_compute_keeps_fp32_master_params(tiny):
    target_cfg, target_params, arch = tiny
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    optimizer = make_optimizer(3e-3, total_steps=10)
    params = nnx.state(DFlashDrafter(arch, nnx.Rngs(params=0)), nnx.Param)
    state = init_state(params, optimizer, jax.random.PRNGKey(1))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))), nnx.Param)
    bf16_target = jax.tree.map(lambda x: x.astype(jnp.bfloat16), target_params)
    spec = StepSpec(graphdef=graphdef, target_cfg=target_cfg, arch=arch, num_anchors=N,
                    objective=Objective(gamma=default_gamma(K)), optimizer=optimizer, compute_dtype=jnp.bfloat16)
    step = make_train_step(spec, FrozenTarget(params=bf16_target, head=train_head(bf16_target, target_cfg)))
    state, metrics = step(state, shard_batch(_batches(1)[0], mesh))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.e2e
def test_a_nan_stops_the_run_naming_the_step_and_saves_nothing(smollm2_target, tmp_path):
    import dataclasses

    from dflash.configs.recipe import load_recipe
    from dflash.train.loop import run_training

    poisoned = dict(smollm2_target.params)
    poisoned["layers"] = dict(poisoned["layers"], w_up=jnp.full_like(poisoned["layers"]["w_up"], jnp.nan))
    target = dataclasses.replace(smollm2_target, weights=poisoned)
    recipe = load_recipe("tiny", [f"train.run_dir={tmp_path}", "train.save_every=1", "train.steps=3",
                                  "train.batch_size=8"])
    with pytest.raises(NonFiniteMetricError, match=r"at step 1: .*loss=nan"):
        run_training(recipe, target=target, progress=False)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]


def test_the_loop_refuses_an_implicit_transfer_inside_the_step(monkeypatch):
    """`train_loop` runs each step under `jax.transfer_guard("disallow")` (issue 60): a step that reads a host array
    fails at once instead of paying a silent copy every step; the batch it is given is already on the devices."""
    from types import SimpleNamespace

    import dflash.train.loop as loop
    from dflash.train.config import TrainConfig
    from dflash.train.sharding import make_mesh

    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    host_ones = np.ones(4, np.float32)
    seen = []

    def placed_step(state, batch):  # device arrays only: allowed
        seen.append(isinstance(batch["x"], jax.Array) and batch["x"].is_fully_addressable)
        return state + jnp.sum(batch["x"]), {}

    def leaking_step(state, batch):  # a host array reaches the devices implicitly
        return state + jnp.sum(batch["x"] + host_ones), {}

    metrics = SimpleNamespace(push=lambda *a: None, flush=lambda: None)
    ckpt = SimpleNamespace(save=lambda *a, **k: None)  # the last step is saved: nothing to save here
    monkeypatch.setattr(loop, "_iterator_state", lambda batches: {})
    cfg = TrainConfig(steps=1, save_every=100)
    for step_fn in (placed_step, leaking_step):
        monkeypatch.setattr(loop, "make_train_step", lambda *a, _f=step_fn, **k: _f)
        run = SimpleNamespace(spec=None, frozen=None, mesh=mesh, data_fingerprint="",
                              batches=iter([{"x": np.arange(4, dtype=np.float32)}]))
        state = jax.device_put(jnp.zeros(()), jax.devices()[0])
        if step_fn is placed_step:
            assert float(loop.train_loop(cfg, run, state, None, 0, ckpt, metrics)) == 6.0 and seen == [True]
        else:
            with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
                loop.train_loop(cfg, run, state, None, 0, ckpt, metrics)


@pytest.mark.slow
def test_init_from_starts_a_fresh_run_from_another_drafter(tmp_path):
    """train.init_from: the new run's step-0 params are the given drafter's (a run dir here); another
    architecture is refused naming the field."""
    from dflash.configs.recipe import load_recipe
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.train.loop import run_training

    common = ["train.batch_size=8", "train.wandb=disabled", "train.eval_every=0"]
    first = load_recipe("tiny", [f"train.run_dir={tmp_path / 'a'}", "train.steps=2", *common])
    target = load_target(first.target)
    run_training(first, target=target, progress=False)
    source = load_drafter(tmp_path / "a", target.cfg)
    second = load_recipe("tiny", [f"train.run_dir={tmp_path / 'b'}", "train.steps=1", "train.lr=1e-12",
                                  f"train.init_from={tmp_path / 'a'}", *common])
    run_training(second, target=target, progress=False)
    continued = load_drafter(tmp_path / "b", target.cfg)
    for a, b in zip(jax.tree.leaves(nnx.state(source, nnx.Param)), jax.tree.leaves(nnx.state(continued, nnx.Param)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)  # lr ~ 0: one step moves nothing
    other = load_recipe("tiny", [f"train.run_dir={tmp_path / 'c'}", "drafter.num_layers=2",
                                 f"train.init_from={tmp_path / 'a'}", *common])
    with pytest.raises(ConfigError, match="num_layers"):
        run_training(other, target=target, progress=False)
