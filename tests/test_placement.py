"""Targets read straight into a mesh (docs/design.md §6; decisions.md, pods-mesh): a leaf's region is the whole
array's slice in every stored layout (safetensors per-expert, fused and MXFP4 experts; GGUF), a process reads only its
devices' regions, and every stage that spreads the target over devices (training's mesh, regeneration and capture
replicas, the engine over a host's devices) leaves each device within 1/N of the target plus its largest unsharded
leaf plus SLACK. The same placement on 2 processes x 2 devices: tests/test_multihost.py."""

from __future__ import annotations

import math
import shutil

import jax
import numpy as np
import pytest
from conftest import GOLDEN

from dflash.models.config import TargetConfig
from dflash.models.loading import load_hf_dir, open_hf_dir, open_weights
from dflash.models.placement import memory_line, put, resident_bytes
from dflash.models.regions import Lazy, SafetensorsFile
from dflash.models.sharding import TARGET_RULES, path_str, spec_for, tensor_mesh, tree_shardings
from dflash.models.target import load_target
from dflash.train.config import MeshConfig
from dflash.train.sharding import make_mesh

SLACK = 64 << 10  # bytes a device may hold beyond its share: small arrays of a stage (page tables, RNG keys, ...)
FAMILIES = ("qwen3_untied", "llama_tied", "gemma3_text", "qwen3_moe", "gpt_oss", "qwen2_bias_untied")


def _regions(shape: tuple[int, ...], rng: np.random.Generator, count: int = 4) -> list[tuple[slice, ...]]:
    out = []
    for _ in range(count):
        index = []
        for n in shape:
            a = int(rng.integers(0, n))
            index.append(slice(a, int(rng.integers(a + 1, n + 1))))
        out.append(tuple(index))
    return out


def _check_regions(lazy: dict, whole: dict, seed: int = 0) -> int:
    """Every Lazy leaf of `lazy`: random regions equal the same slices of `whole`'s array; returns the leaves seen."""
    rng = np.random.default_rng(seed)
    flat_lazy = jax.tree_util.tree_flatten_with_path(lazy, is_leaf=lambda x: isinstance(x, Lazy))[0]
    flat_whole = dict(jax.tree_util.tree_flatten_with_path(whole)[0])
    for path, leaf in flat_lazy:
        want = flat_whole[path]
        assert tuple(leaf.shape) == want.shape, jax.tree_util.keystr(path)
        if not isinstance(leaf, Lazy):
            continue
        for index in _regions(leaf.shape, rng):
            np.testing.assert_array_equal(leaf.region(index), want[index], err_msg=jax.tree_util.keystr(path))
    return len(flat_lazy)


@pytest.mark.parametrize("case", FAMILIES)
def test_a_region_is_the_whole_arrays_slice(case):
    cfg, lazy = open_hf_dir(GOLDEN / "tiny" / case)
    _, whole = load_hf_dir(GOLDEN / "tiny" / case)
    assert _check_regions(lazy, whole) >= 8


def test_fused_and_mxfp4_experts_read_by_region(tmp_path):
    """transformers 5's fused Qwen3-MoE experts (`experts.gate_up_proj` [E, 2*Ie, D], `experts.down_proj`) and the
    released gpt-oss's MXFP4 `_blocks`/`_scales`: each region equals the slice of the whole load, and the fused
    layout loads the same params as the per-expert one."""
    from safetensors.numpy import load_file, save_file

    src = GOLDEN / "tiny" / "qwen3_moe"
    fused_dir = tmp_path / "fused"
    shutil.copytree(src, fused_dir, ignore=shutil.ignore_patterns("reference.npz"))
    tensors = load_file(str(src / "model.safetensors"))
    cfg, per_expert = load_hf_dir(src)
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for i in range(cfg.num_layers):
        e = f"model.layers.{i}.mlp.experts"
        gate = np.stack([tensors[f"{e}.{x}.gate_proj.weight"] for x in range(cfg.num_experts)])
        up = np.stack([tensors[f"{e}.{x}.up_proj.weight"] for x in range(cfg.num_experts)])
        out[f"{e}.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[f"{e}.down_proj"] = np.stack([tensors[f"{e}.{x}.down_proj.weight"] for x in range(cfg.num_experts)])
    save_file(out, str(fused_dir / "model.safetensors"))
    _, fused = load_hf_dir(fused_dir)
    for key in ("we_gate", "we_up", "we_down"):
        np.testing.assert_array_equal(fused["layers"][key], per_expert["layers"][key])
    _check_regions(open_hf_dir(fused_dir)[1], fused, seed=1)

    oss = GOLDEN / "tiny" / "gpt_oss"
    packed = load_file(str(oss / "mxfp4" / "experts.safetensors"))
    mxfp4 = tmp_path / "gpt_oss_mxfp4"
    shutil.copytree(oss, mxfp4, ignore=shutil.ignore_patterns("mxfp4", "reference.npz"))
    plain = {k: v for k, v in load_file(str(mxfp4 / "model.safetensors")).items()
             if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**plain, **packed}, str(mxfp4 / "model.safetensors"))
    _, whole = load_hf_dir(mxfp4)
    _check_regions(open_hf_dir(mxfp4)[1], whole, seed=2)


def _counting(monkeypatch) -> list[int]:
    """Count the values every safetensors read returns (a region's, not the file's)."""
    counts: list[int] = []
    original = SafetensorsFile.read

    def read(self, name, index, raw=False):
        out = original(self, name, index, raw)
        counts.append(out.size)
        return out

    monkeypatch.setattr(SafetensorsFile, "read", read)
    return counts


def _bound(weights: dict, mesh, itemsize: int) -> tuple[int, int]:
    """(a device's share of the target, its largest unsharded leaf) in bytes, for `weights` on `mesh`."""
    n = mesh.devices.size
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, Lazy)))
    flat = jax.tree_util.tree_flatten_with_path(weights, is_leaf=lambda x: isinstance(x, Lazy))[0]
    unsharded = [math.prod(x.shape) for p, x in flat
                 if not any(spec_for(path_str(p), tuple(x.shape), TARGET_RULES, mesh))]
    return total * itemsize // n, max(unsharded, default=0) * itemsize


def _delta(before: dict, devices) -> dict:
    after = resident_bytes(devices)
    return {d: after[d] - before[d] for d in devices}


@pytest.mark.parametrize("shape", [(1, 4, 1), (1, 2, 2)])
def test_each_device_reads_and_holds_only_its_share(shape, monkeypatch):
    """A safetensors target placed on 4 devices by the models' table: each device holds at most 1/4 of the target
    plus its largest unsharded leaf plus SLACK; the values read from the file are the placed shards' (each region
    once), not a whole copy per device; the placed arrays equal the whole load. The negative control, the target
    put whole on one device first and then placed (what the trainer did), breaks the bound on that device."""
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), ("data", "fsdp", "tensor"))
    _, weights = open_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    _, whole = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    share, largest = _bound(weights, mesh, 4)
    counts = _counting(monkeypatch)
    before = resident_bytes(devices)
    placed = put(weights, tree_shardings(whole, TARGET_RULES, mesh), [np.float32])
    held = _delta(before, devices)
    assert max(held.values()) <= share + largest + SLACK, (held, share, largest)
    distinct = sum(math.prod(s.data.shape) for x in jax.tree.leaves(placed)
                   for s in x.addressable_shards if s.replica_id == 0)
    assert sum(counts) == distinct  # each region read once: the target's values exactly once here
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    del placed

    before = resident_bytes(devices)
    first = jax.device_put(whole, devices[0])  # the old way: whole on the first device, then placed
    old = jax.device_put(first, tree_shardings(whole, TARGET_RULES, mesh))
    held = _delta(before, devices)
    assert held[devices[0]] > share + largest + SLACK, (held, share, largest)
    del first, old


def test_a_gguf_target_is_decoded_per_leaf_and_placed_in_shares():
    """The default target (a GGUF: its quantised tensors decode whole) read onto a 4-device fsdp mesh: each device
    within its bound, the values those of the whole load, and `Target.params` never made."""
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=256))
    devices = jax.devices()[:4]
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(1, 4, 1), ("data", "fsdp", "tensor"))
    share, largest = _bound(target.weights, mesh, 4)
    before = resident_bytes(devices)
    placed = target.on(mesh)
    held = _delta(before, devices)
    assert max(held.values()) <= share + largest + SLACK, (held, share, largest)
    assert max(held.values()) <= 1.1 * min(held.values())
    assert "params" not in target.__dict__
    np.testing.assert_array_equal(np.asarray(placed["layers"]["wq"][3]), np.asarray(target.weights["layers"]["wq"])[3])


def test_training_holds_each_devices_share_and_logs_it(caplog):
    """`build_run` on the 8 test devices (fsdp 8): the target's share, the head and nothing beside them on each
    device (the trainer used to keep the whole target on device 0 too), max within 1.5x min; the stage's log line."""
    import logging

    from dflash.configs.recipe import load_recipe
    from dflash.models.placement import log_memory_per_device
    from dflash.train.loop import build_run

    recipe = load_recipe("tiny", ["train.batch_size=8", "train.mesh.data=1", "train.mesh.fsdp=-1"])
    target = load_target(recipe.target)
    devices = jax.devices()
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1))
    share, largest = _bound(target.weights, mesh, 4)
    before = resident_bytes(devices)
    run = build_run(recipe.train, recipe.data, target, target.drafter_arch(recipe.drafter))
    held = _delta(before, devices)
    assert max(held.values()) <= share + largest + SLACK, (held, share, largest)
    assert max(held.values()) <= 1.5 * min(held.values()), held
    assert "params" not in target.__dict__
    with caplog.at_level(logging.INFO, logger="dflash.models.placement"):
        log_memory_per_device("train")
    assert "train: memory per device: max " in caplog.text and " GiB (device " in caplog.text
    del run


def test_regeneration_and_capture_replicas_hold_their_groups_share():
    """Two replicas of two devices each (regeneration's engines, capture's forwards): each device holds half the
    target (plus its largest unsharded leaf, its engine's pages and SLACK), never a whole copy."""
    from dflash.data.capture import _start_replicas
    from dflash.data.config import RegenConfig
    from dflash.data.scaleout import replica_engines

    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=256))
    groups = [tuple(jax.devices()[:2]), tuple(jax.devices()[2:4])]
    devices = [d for g in groups for d in g]
    share, largest = _bound(target.weights, tensor_mesh(groups[0]), 4)
    cfg = RegenConfig(slots=2, max_len=64)
    before = resident_bytes(devices)
    engines = replica_engines(target, cfg, groups)
    held = _delta(before, devices)
    pages = max(sum(s.data.nbytes for x in jax.tree.leaves(e.state) for s in x.addressable_shards
                    if s.device == d) for e in engines for d in e.mesh.devices.flat)  # its K/V pages and slots
    assert max(held.values()) <= share + largest + pages + SLACK, (held, share, largest, pages)
    assert min(held.values()) >= share // 2
    del engines

    before = resident_bytes(devices)
    replicas = _start_replicas(target, target.cfg, (1, 3), False, 0, groups, [])
    try:
        held = _delta(before, devices)
        assert max(held.values()) <= share + largest + SLACK, (held, share, largest)
    finally:
        for replica in replicas:
            replica.stop()
    assert "params" not in target.__dict__


def test_memory_line_names_the_extremes():
    devices = jax.devices()[:3]
    line = memory_line({devices[0]: 3 << 30, devices[1]: 1 << 30, devices[2]: 2 << 30})
    assert line == "memory per device: max 3.000 GiB (device 0), min 1.000 GiB (device 1)"
    small = memory_line({devices[0]: 3 << 20, devices[1]: 1 << 19})  # under 0.1 GiB: MiB, not 0.003 and 0.000 GiB
    assert small == "memory per device: max 3.000 MiB (device 0), min 0.500 MiB (device 1)"


def test_open_weights_reads_no_weight(monkeypatch):
    counts = _counting(monkeypatch)
    cfg, weights = open_weights(GOLDEN / "tiny" / "qwen3_moe")
    assert counts == [] and cfg.num_experts == 8
    assert isinstance(weights["layers"]["we_gate"], Lazy)
