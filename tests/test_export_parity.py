"""Numeric parity of exported drafters with the reference implementations (docs/design.md §7), fp32, no torch here.

tests/golden/export/ holds a tiny drafter exported by `dflash-export` (tools/export_fixture.py: a 2-layer
drafter of the tiny Llama target with llama3 RoPE scaling, K=4) and the outputs of the reference torch code
on it: z-lab's own `DFlashDraftModel` (tools/golden_zlab.py: one uncached draft step and a second one through
its draft cache, as `dflash_generate` runs them) and speculators' `DFlashDraftModel` (tools/golden_speculators.py:
its anchored-block training forward). Our drafter, loaded from the same directories, must match within 1e-4.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from flax import nnx
from safetensors.numpy import load_file

from dflash.models.drafter import BlockVisibility, DFlashDrafter, hf_tensor_names
from dflash.models.drafter_io import load_drafter
from dflash.models.loading import load_hf_dir
from dflash.models.speculators import speculators_config
from dflash.models.zlab import hf_tensors, zlab_config

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


FIXTURE = GOLDEN / "export"
TOL = 1e-4
VERIFIER = "golden/tiny/llama3_scaled_untied"


@pytest.fixture(scope="module")
def target_cfg():
    return load_hf_dir(GOLDEN / "tiny" / "llama3_scaled_untied")[0]


@pytest.fixture(scope="module")
def zlab_drafter(target_cfg):
    return load_drafter(FIXTURE / "zlab", target_cfg)


def _draft(drafter: DFlashDrafter, ctx_feats, block, start: int) -> np.ndarray:
    """Our inference path (what the engine runs): context K/V of positions 0..start-1, one block at start."""
    b, s, _ = ctx_feats.shape
    k = block.shape[1]
    ctx_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    ctx_kv = drafter.context_kv(drafter.fuse(jnp.asarray(ctx_feats)), ctx_pos)
    block_pos = jnp.broadcast_to(start + jnp.arange(k), (b, k))
    return np.asarray(drafter.draft_block(jnp.asarray(block), block_pos, ctx_kv, jnp.ones((b, s), bool)))


def test_zlab_export_matches_zlab_reference_model(zlab_drafter):
    """z-lab's DFlashDraftModel on our export: step 1 (no cache) and step 2 (through its draft cache, cropped
    to the committed length) equal our drafter's drafts within 1e-4."""
    ref = np.load(FIXTURE / "zlab_reference.npz")
    s1, s2, k = (int(x) for x in ref["positions"])
    ctx = ref["ctx_feats"]
    step1 = _draft(zlab_drafter, ctx[:, :s1], ref["block1"], s1)
    step2 = _draft(zlab_drafter, ctx[:, :s2], ref["block2"], s2)
    assert step1.shape == ref["hidden1"].shape == (2, k, 64)
    err1, err2 = np.abs(step1 - ref["hidden1"]).max(), np.abs(step2 - ref["hidden2"]).max()
    assert err1 < TOL and err2 < TOL, (err1, err2)
    # The comparison has teeth: the same weights with the RoPE scaling dropped (a wrong rope export) miss it.
    arch = dataclasses.replace(zlab_drafter.arch, rope_scaling=None)
    unscaled = DFlashDrafter(arch, nnx.Rngs(0))
    nnx.update(unscaled, nnx.state(zlab_drafter))
    assert np.abs(_draft(unscaled, ctx[:, :s2], ref["block2"], s2) - ref["hidden2"]).max() > 100 * TOL


def test_speculators_export_matches_speculators_reference_model(target_cfg, tmp_path):
    """speculators' DFlashDraftModel (anchored-block training forward) on our speculators export equals our
    drafter's training forward with the same anchors within 1e-4."""
    ref = np.load(FIXTURE / "speculators_reference.npz")
    directory = tmp_path / "speculators"
    directory.mkdir()
    shutil.copyfile(FIXTURE / "speculators" / "config.json", directory / "config.json")
    shutil.copyfile(FIXTURE / "zlab" / "model.safetensors", directory / "model.safetensors")
    drafter = load_drafter(directory, target_cfg)
    assert drafter.arch.layer_ids == (1, 2)  # aux_hidden_state_layer_ids [2, 3] - 1
    anchors = jnp.asarray(ref["anchors"])[None, :]
    k = drafter.arch.block_size
    feats = jnp.asarray(ref["feats"])
    t = feats.shape[1]
    embeds = jnp.asarray(ref["embed"])[jnp.asarray(ref["block_ids"])][None]
    block_pos = (anchors[:, :, None] + jnp.arange(k)).reshape(1, -1)
    vis = BlockVisibility.from_anchors(anchors, jnp.ones((1, t), jnp.int32))
    ours = np.asarray(drafter(embeds, block_pos, feats, jnp.arange(t)[None], vis))
    assert ours.shape == ref["hidden"].shape
    err = np.abs(ours - ref["hidden"]).max()
    assert err < TOL, err


def test_committed_fixture_is_what_the_exporter_writes_now(zlab_drafter):
    """The goldens were recorded from the exporter's current output: the same config.json files (z-lab and
    speculators, also as the reference scripts saw them) and the same tensors, bit for bit."""
    zlab = json.loads((FIXTURE / "zlab" / "config.json").read_text())
    spec = json.loads((FIXTURE / "speculators" / "config.json").read_text())
    assert zlab_config(zlab_drafter.arch) == zlab
    assert speculators_config(zlab_drafter.arch, VERIFIER) == spec
    for name in ("zlab_reference.npz", "speculators_reference.npz"):
        meta = json.loads(str(np.load(FIXTURE / name)["meta_json"]))
        assert meta["config"] == (zlab if name.startswith("zlab") else spec)
    stored = load_file(str(FIXTURE / "zlab" / "model.safetensors"))
    written = hf_tensors(zlab_drafter)
    assert sorted(stored) == sorted(written) == sorted(hf_tensor_names(zlab_drafter))
    for name, value in written.items():
        np.testing.assert_array_equal(stored[name], value)
