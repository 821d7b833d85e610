"""Numeric parity of exported drafters with the reference implementations (docs/design.md §7), fp32, no torch here.

tests/golden/export/ holds a tiny drafter exported by `dflash-export` (tools/export_fixture.py: a 2-layer
drafter of the tiny Llama target with llama3 RoPE scaling, K=4) and the outputs of the reference torch code
on it: z-lab's own `DFlashDraftModel` (tools/golden_zlab.py: one uncached draft step and a second one through
its draft cache, as `dflash_generate` runs them) and speculators' `DFlashDraftModel` (tools/golden_speculators.py:
its anchored-block training forward). Our drafter, loaded from the same directories, must match within 1e-4.

The newer layouts (issue 34), each a 2-layer drafter exported by `dflash-export --format zlab`
(tools/export_fixture.py --kind ...) and run through z-lab's DFlash2-era model.py (MANIFEST.json names it):
`zlab_dflash2/` (`DFlash2DraftModel`, convolutions on with random nonzero kernels, the zero candidate selector:
hidden states and the reference's own selector walk) and `zlab_sliding/` (layer_types [full, sliding], W = 8,
context 37 and 70 > W); the same drafters in the speculators layout through speculators 0.9.0's own `dflash2` and
sliding-window model code (`speculators_dflash2/`, `speculators_sliding/`: configs; tensors the z-lab ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from flax import nnx
from safetensors.numpy import load_file

from dflash.models.drafter import BlockVisibility, DFlashDrafter, drafter_logits, hf_tensor_names
from dflash.models.drafter_io import load_drafter
from dflash.models.loading import load_hf_dir
from dflash.models.speculators import speculators_config
from dflash.models.zlab import hf_tensors, zlab_config

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


FIXTURE = GOLDEN / "export"
TOL = 1e-4
VERIFIER = "golden/tiny/llama3_scaled_untied"


@pytest.fixture(scope="module")
def target():
    return load_hf_dir(GOLDEN / "tiny" / "llama3_scaled_untied")


@pytest.fixture(scope="module")
def target_cfg(target):
    return target[0]


def tensors_sha256(tensors: dict[str, np.ndarray]) -> str:
    """tools/golden_zlab.py's hash of an export's tensors: sorted names, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        digest.update(f"{name}|{value.dtype.str}|{list(value.shape)}|".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


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


@pytest.mark.parametrize("kind", ["", "_dflash2", "_sliding"])
def test_speculators_export_matches_speculators_reference_model(target_cfg, tmp_path, kind):
    """speculators' DFlashDraftModel / DFlash2DraftModel (anchored-block training forward) on our speculators export
    (v1; DFlash2 with its convolutions on; sliding layers with W = 8 at anchors past W) equals our drafter's
    training forward with the same anchors within 1e-4. speculators' window is block-level like ours (context
    s >= anchor - W), so the sliding layers compare exactly; without the window ours would miss."""
    ref = np.load(FIXTURE / f"speculators{kind}_reference.npz")
    directory = tmp_path / "speculators"
    directory.mkdir()
    shutil.copyfile(FIXTURE / f"speculators{kind}" / "config.json", directory / "config.json")
    shutil.copyfile(FIXTURE / f"zlab{kind}" / "model.safetensors", directory / "model.safetensors")
    drafter = load_drafter(directory, target_cfg)
    assert drafter.arch.layer_ids == (1, 2)  # aux_hidden_state_layer_ids [2, 3] - 1
    assert drafter.arch.variant == ("dflash2" if kind == "_dflash2" else "dflash")
    anchors = jnp.asarray(ref["anchors"])[None, :]
    k, w = drafter.arch.block_size, drafter.arch.sliding_window
    feats = jnp.asarray(ref["feats"])
    t = feats.shape[1]
    embeds = jnp.asarray(ref["embed"])[jnp.asarray(ref["block_ids"])][None]
    block_pos = (anchors[:, :, None] + jnp.arange(k)).reshape(1, -1)

    def forward(window: int) -> np.ndarray:
        vis = BlockVisibility.from_anchors(anchors, jnp.ones((1, t), jnp.int32), window=window)
        return np.asarray(drafter(embeds, block_pos, feats, jnp.arange(t)[None], vis))

    ours = forward(w)
    assert ours.shape == ref["hidden"].shape
    err = np.abs(ours - ref["hidden"]).max()
    assert err < TOL, err
    if kind == "_sliding":
        assert int(ref["anchors"].max()) > w + k
        assert np.abs(forward(t) - ref["hidden"]).max() > 100 * TOL


def test_zlab_dflash2_export_matches_the_reference_dflash2_model(target):
    """z-lab's DFlash2DraftModel on our DFlash2 export (convolutions on, kernels random and nonzero): both draft
    steps equal our drafter's within 1e-4, and the reference's own proposal (its candidate selector's walk; the
    export's selector is zero) drafts the tokens our engine drafts, the argmax of the target head's logits."""
    target_cfg, target_params = target
    ref = np.load(FIXTURE / "zlab_dflash2_reference.npz")
    drafter = load_drafter(FIXTURE / "zlab_dflash2", target_cfg)
    assert (drafter.arch.variant, drafter.arch.conv_kernel_size, drafter.arch.conv_group_size) == ("dflash2", 2, 16)
    s1, s2, k = (int(x) for x in ref["positions"])
    ctx = ref["ctx_feats"]
    for start, block, hidden, tokens in ((s1, "block1", "hidden1", "tokens1"), (s2, "block2", "hidden2", "tokens2")):
        ours = _draft(drafter, ctx[:, :start], ref[block], start)
        err = np.abs(ours - ref[hidden]).max()
        assert err < TOL, (hidden, err)
        drafts = np.asarray(jnp.argmax(drafter_logits(target_params, target_cfg, jnp.asarray(ours[:, 1:])), -1))
        np.testing.assert_array_equal(drafts, ref[tokens])
    # The convolutions carry weight here: the same drafter with identity convolutions misses by far.
    for layer in drafter.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.set_value(jnp.zeros_like(conv.base_kernel.get_value()).at[:, 0].set(1.0))
            conv.kernel_projection.kernel.set_value(jnp.zeros_like(conv.kernel_projection.kernel.get_value()))
    assert np.abs(_draft(drafter, ctx[:, :s2], ref["block2"], s2) - ref["hidden2"]).max() > 100 * TOL


def test_zlab_sliding_window_export_matches_the_reference_row_by_row(target_cfg):
    """z-lab's DFlashDraftModel on our export with layer_types [full, sliding], W = 8, at contexts of 37 and 70
    positions (the second step through its draft cache).

    The two window rules differ by design (docs/decisions.md D49): ours is block-level, the block anchored at a
    sees context [a-W, a) (speculators' training mask); z-lab's windows each query from its own position
    (key visible iff query_pos - key_pos < W), so block row i sees [a+i-W+1, a): i+1 fewer of the oldest
    positions. The last layer is the only sliding one here, so z-lab's row i is exactly our drafter's row i under
    a block-level window of W-1-i: that holds within 1e-4 for every row; under our own W every row differs (by
    the i+1 positions), and the reference's own full-attention run shows the window matters at this length."""
    ref = np.load(FIXTURE / "zlab_sliding_reference.npz")
    drafter = load_drafter(FIXTURE / "zlab_sliding", target_cfg)
    arch = drafter.arch
    assert arch.layer_types == ("full_attention", "sliding_attention") and arch.sliding_window == 8
    w, (s1, s2, k) = arch.sliding_window, (int(x) for x in ref["positions"])
    feats = jnp.asarray(ref["ctx_feats"])

    def forward(start: int, block: str, window: int) -> np.ndarray:
        b = feats.shape[0]
        anchors = jnp.full((b, 1), start)
        vis = BlockVisibility.from_anchors(anchors, jnp.ones((b, start), jnp.int32), window=window)
        pos = jnp.broadcast_to(start + jnp.arange(k), (b, k))
        ctx_pos = jnp.broadcast_to(jnp.arange(start), (b, start))
        return np.asarray(drafter(jnp.asarray(ref[block]), pos, feats[:, :start], ctx_pos, vis))

    for start, block, hidden in ((s1, "block1", "hidden1"), (s2, "block2", "hidden2")):
        assert start > w + k
        for i in range(k):
            err = np.abs(forward(start, block, w - 1 - i)[:, i] - ref[hidden][:, i]).max()
            assert err < TOL, (hidden, i, err)
        ours = forward(start, block, w)
        assert (np.abs(ours - ref[hidden]).max(axis=(0, 2)) > 100 * TOL).all()
        assert np.abs(ref[hidden] - ref[f"{hidden}_full"]).max() > 100 * TOL


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


@pytest.mark.parametrize("kind", ["dflash2", "sliding"])
def test_the_newer_layouts_goldens_were_recorded_from_what_the_exporter_writes_now(target_cfg, kind):
    """The DFlash2 and sliding-window goldens: the reference loaded exactly the committed directory (config and
    tensor hash), and our exporter writes that directory's config and tensors again from the imported drafter."""
    directory = FIXTURE / f"zlab_{kind}"
    config = json.loads((directory / "config.json").read_text())
    stored = load_file(str(directory / "model.safetensors"))
    meta = json.loads(str(np.load(FIXTURE / f"zlab_{kind}_reference.npz")["meta_json"]))
    assert meta["config"] == config and meta["tensors_sha256"] == tensors_sha256(stored)
    drafter = load_drafter(directory, target_cfg)
    assert zlab_config(drafter.arch) == config
    assert tensors_sha256(hf_tensors(drafter)) == meta["tensors_sha256"]
