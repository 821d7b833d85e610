"""The drafter layouts vLLM cannot serve on this CPU, checked against the real engines instead (the engines tier:
`bin/test --engines`, docs/development.md): DFlash2 with its candidate selector and a drafter mixing sliding-window
and full layers. vLLM's V1 model runner, the only one that runs without Triton, refuses both (`Model Runner V1 does
not support: DFlash candidate-head drafts` / `mixed sliding/full dflash drafts`). DSpark has no drafter here yet (its
issue is open): its layout joins this file when it lands.

- vLLM's own loader: the class vLLM serves each export with (`DFlash2Qwen3ForCausalLM`, `DFlashQwen3ForCausalLM`) is
  built on the CPU and takes the export through its `load_weights`, strictly: every parameter loaded and equal to the
  export's tensors (nothing missing, nothing left over, shapes equal), the target's embedding and LM head aside
  (tools/engines/vllm_loader.py); and it reads the config as we mean it (windows, bidirectional blocks, the
  convolution and the selector's rank and top-k);
- speculators 0.9.0's PyTorch model (`DFlash2DraftModel`, `DFlashDraftModel`) on our speculators export computes the
  same draft logits as ours from the same target features, and DFlash2's selector the same candidates and scores
  (fp32, |difference| <= 1e-4 * max(1, largest |value|); tools/engines/speculators_logits.py).

The drafters are 2-layer drafters of the tiny Llama target (tests/golden/tiny/llama3_scaled_untied: hidden 64, vocab
256, llama3 RoPE scaling) with every weight drawn at random (seeded), exported by the exporter's own functions into a
temporary directory; the helpers run in .venv-engines as subprocesses.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.engines import harness  # noqa: E402

pytestmark = pytest.mark.engines

TARGET = GOLDEN / "tiny" / "llama3_scaled_untied"
K, W, T, ANCHORS, SEED = 4, 8, 40, 4, 2027
TOL = 1e-4  # fp32: |ours - theirs| <= TOL * max(1, max |theirs|)
KINDS = {
    "dflash2": {"variant": "dflash2", "selector": True, "selector_rank": 16, "selector_top_k": 8},
    "sliding": {"layer_types": ("full_attention", "sliding_attention"), "sliding_window": W},
}
REFUSED = {"dflash2": "Model Runner V1 does not support: DFlash candidate-head drafts",
           "sliding": "Model Runner V1 does not support: mixed sliding/full dflash drafts"}
MODEL_CLASS = {"dflash2": "DFlash2Qwen3ForCausalLM", "sliding": "DFlashQwen3ForCausalLM"}
DROPPED = "layers.1.self_attn.o_proj.weight"  # what the tampered export leaves out


@pytest.fixture(scope="module")
def target():
    from dflash.models.loading import load_hf_dir

    return load_hf_dir(TARGET)


def _random_drafter(kind: str, target_cfg):
    """A 2-layer drafter of `kind` with every weight random: RMSNorm weights 1 + N(0, 0.1), DFlash2's base kernels
    identity + N(0, 0.3) and kernel projections N(0, 0.05), the selector's codebooks N(0, 0.3) (so that its edge
    scores re-rank candidates), the rest as initialised from the seed."""
    from flax import nnx

    from dflash.models.config import DrafterConfig
    from dflash.models.drafter import DFlashDrafter, resolve_drafter

    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 2), block_size=K,
                                         mask_token_id=255, **KINDS[kind]), target_cfg)
    drafter = DFlashDrafter(arch, nnx.Rngs(SEED))
    rng = np.random.default_rng(SEED)
    flat = []
    for keys, variable in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
        names = [str(k) for k in keys]
        value = np.asarray(variable.get_value())
        if names[-1] == "weight":
            value = 1.0 + 0.1 * rng.standard_normal(value.shape)
        elif names[-1] == "base_kernel":
            value = value + 0.3 * rng.standard_normal(value.shape)
        elif "kernel_projection" in names:
            value = 0.05 * rng.standard_normal(value.shape)
        elif names[-1] in ("predecessor_codebook", "successor_codebook"):
            value = 0.3 * rng.standard_normal(value.shape)
        flat.append((keys, variable.replace(jnp.asarray(value, jnp.float32))))
    nnx.update(drafter, nnx.from_flat_state(flat))
    return drafter


@pytest.fixture(scope="module")
def exports(target, tmp_path_factory) -> dict:
    """kind -> (drafter, z-lab export dir, speculators export dir); plus "dropped": the DFlash2 z-lab export without
    one tensor (vLLM's loader itself does not notice a missing tensor: the strict check must)."""
    from dflash.models.speculators import save_speculators
    from dflash.models.zlab import save_zlab

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind in KINDS:
        drafter = _random_drafter(kind, target[0])
        out[kind] = (drafter, save_zlab(drafter, root / f"zlab_{kind}"),
                     save_speculators(drafter, root / f"speculators_{kind}", verifier=str(TARGET)))
    from safetensors.numpy import save_file

    dropped = root / "zlab_dropped"
    shutil.copytree(out["dflash2"][1], dropped)
    tensors = load_file(str(dropped / "model.safetensors"))
    del tensors[DROPPED]
    save_file(tensors, str(dropped / "model.safetensors"), metadata={"format": "pt"})
    out["dropped"] = (None, dropped, None)
    return out


@pytest.fixture(scope="module")
def loader_reports(exports, tmp_path_factory) -> dict:
    """vLLM's loader on every z-lab export (one engines-environment process): kind -> report."""
    report = tmp_path_factory.mktemp("vllm") / "loader.json"
    kinds = [*KINDS, "dropped"]
    done = harness.run_script("vllm_loader.py", "--target", TARGET, "--out", report,
                              *[exports[k][1] for k in kinds], check=False)
    assert report.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return dict(zip(kinds, json.loads(report.read_text()), strict=True))


@pytest.mark.parametrize("kind", list(KINDS))
def test_vllm_loader_takes_every_tensor(kind, exports, loader_reports):
    """The class vLLM would serve the export with (refused by the CPU's runner, as the refusal says) takes every
    tensor: each of its parameters loaded and equal to the export's (q|k|v and gate|up packed as vLLM packs them),
    none of the export's tensors left over; it reads the windows, the blocks' causality, the convolution and the
    selector from the config as ours does."""
    drafter, zlab_dir, _ = exports[kind]
    report = loader_reports[kind]
    assert report["error"] is None, report["error"]
    assert REFUSED[kind] in report["refused"]
    assert report["model_class"] == MODEL_CLASS[kind]
    assert (report["missing"], report["left_over"], report["mismatched"]) == ([], [], [])
    assert sorted(report["shared"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert report["optional"] == ["model.mask_embedding"]  # vLLM's slot for a mask embedding shipped apart
    assert report["checked"] == report["parameters"] - 3
    assert report["tensors"] == len(load_file(str(zlab_dir / "model.safetensors")))
    print(f"{kind}: vLLM {report['model_class']} took all {report['tensors']} tensors into {report['checked']} "
          f"parameters; the CPU runner refuses it: {REFUSED[kind]}")
    arch = drafter.arch
    layers = report["reads"]["layers"]
    assert [layer["causal"] for layer in layers] == [False] * arch.num_layers  # bidirectional blocks
    windows = [W if arch.sliding(i) else None for i in range(arch.num_layers)]
    assert [layer["sliding_window"] for layer in layers] == windows
    if kind == "dflash2":
        assert report["reads"]["selector"] == {"top_k": arch.selector_top_k, "rank": arch.selector_rank}
        assert {(layer["conv_taps"], layer["conv_group_size"]) for layer in layers} == {
            (arch.conv_kernel_size, arch.conv_group_size)}


def test_the_strict_load_check_catches_a_missing_tensor(loader_reports):
    """vLLM's loader accepts an export without one tensor (the parameter keeps whatever it held); the strict check
    names it: the check has teeth."""
    report = loader_reports["dropped"]
    assert report["error"] is None, report["error"]
    assert report["missing"] == [f"model.{DROPPED}"]


def _inputs(target, drafter, path: Path) -> dict:
    """The target's features at the drafter's layers over a random sequence (our target forward, fp32), its tokens,
    embedding and LM head: what both models get."""
    from dflash.models.decoder import head_matrix
    from dflash.models.drafter import online_features

    cfg, params = target
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, cfg.vocab_size - 1, size=(1, T)).astype(np.int64)
    feats = np.asarray(online_features(params, cfg, jnp.asarray(tokens), drafter.arch.layer_ids), np.float32)
    head, vocab_major = head_matrix(params, cfg)
    head = np.asarray(head if vocab_major else head.T, np.float32)
    data = {"feats": feats, "input_ids": tokens, "embed": np.asarray(params["embed"], np.float32), "lm_head": head,
            "anchors": np.asarray(ANCHORS)}
    np.savez(path, **data)
    return data


def _close(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |ours - theirs| as a share of the tolerance's scale (<= TOL passes)."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return float(np.abs(ours - theirs).max() / max(1.0, float(np.abs(theirs).max())))


@pytest.mark.parametrize("kind", list(KINDS))
def test_speculators_model_computes_our_draft_logits(kind, target, exports, tmp_path):
    """speculators' own model of our speculators export, given the target's features, computes the block hidden
    states and draft logits ours does (its anchors, blocks `[x_a, MASK...]` seeing the context strictly before a;
    sliding layers the W positions before a, anchors past W), and for DFlash2 its selector ranks the same top-k
    candidates with the same scores after the same predecessor tokens. Without the window ours misses (teeth)."""
    from dflash.models.drafter import BlockVisibility, drafter_logits

    drafter, _, spec_dir = exports[kind]
    data = _inputs(target, drafter, tmp_path / "inputs.npz")
    harness.run_script("speculators_logits.py", "--drafter", spec_dir, "--inputs", tmp_path / "inputs.npz",
                       "--out", tmp_path / "theirs.npz", "--seed", str(SEED))
    theirs = np.load(tmp_path / "theirs.npz")
    meta = json.loads(str(theirs["meta_json"]))
    assert meta["model_class"] == ("DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel")
    assert meta["speculators"] == "0.9.0"

    anchors = jnp.asarray(theirs["anchors"])[None, :]
    block_ids = np.full(ANCHORS * K, drafter.arch.mask_token_id, np.int64)
    block_ids[::K] = data["input_ids"][0, theirs["anchors"]]
    embeds = jnp.asarray(data["embed"])[jnp.asarray(block_ids)][None]
    block_pos = (anchors[:, :, None] + jnp.arange(K)).reshape(1, -1)
    feats = jnp.asarray(data["feats"])

    def hidden(window: int) -> np.ndarray:
        vis = BlockVisibility.from_anchors(anchors, jnp.ones((1, T), jnp.int32), window=window)
        return np.asarray(drafter(embeds, block_pos, feats, jnp.arange(T)[None], vis))

    ours_hidden = hidden(drafter.arch.sliding_window)
    ours_logits = np.asarray(drafter_logits(target[1], target[0], jnp.asarray(ours_hidden)))
    errors = {"hidden": _close(ours_hidden, theirs["hidden"]), "logits": _close(ours_logits, theirs["logits"])}
    if kind == "dflash2":
        selector = drafter.candidate_selector
        cand = theirs["candidate_ids"]
        ours_cand = np.asarray(jnp.argsort(-jnp.asarray(ours_logits), axis=-1)[..., :selector.top_k])
        np.testing.assert_array_equal(ours_cand, cand)
        proj = selector.hidden_projection(jnp.asarray(ours_hidden))
        edges = selector.edges(jnp.asarray(theirs["predecessor_ids"]), proj, jnp.asarray(cand))
        scores = np.take_along_axis(ours_logits, cand, axis=-1) + np.asarray(edges)
        errors["candidate_scores"] = _close(scores, theirs["candidate_scores"])
        # the selector matters here: its scores re-rank some slot's candidates
        assert (np.argmax(theirs["candidate_scores"], -1) != 0).any()
    print(f"{kind}: speculators {meta['model_class']} vs ours, max |difference| / scale: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert max(errors.values()) <= TOL, errors
    if kind == "sliding":
        assert int(theirs["anchors"].max()) > W + K
        assert _close(hidden(T), theirs["hidden"]) > 100 * TOL
