"""DFlash2's path selector (`drafter.selector`, issue 34 item 2): the walk equals a loop-by-loop reference, its
training loss (the per-slot edge cross-entropy) equals a brute-force reference in value and gradient, greedy
serving with it equals AR, and a trained
selector round-trips bit-exactly through both DFlash2 layouts (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, assert_greedy_equals_ar, assert_same_params, export_round_trip
from flax import nnx
from safetensors.numpy import load_file

from dflash.configs.schema import ConfigError
from dflash.data.batch import TrainBatch
from dflash.models.config import DrafterConfig
from dflash.models.drafter import DFlashDrafter, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.models.zlab import load_zlab, save_zlab
from dflash.serve.engine import decode
from dflash.serve.plan import Chain, Limits
from dflash.train.objective import Objective, build_blocks_batch
from dflash.train.selector import selector_loss
from dflash.train.step import train_head

pytestmark = pytest.mark.heavy  # compiles a model's engine: not in `bin/test --fast`

K = 4
RANK = 8
TOP_K = 3


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                         variant="dflash2", selector=True, selector_rank=RANK,
                                         selector_top_k=TOP_K), target_cfg, mask_token_id=255)
    return target_cfg, target_params, arch


def _live(arch, seed: int, scale: float = 1.0) -> DFlashDrafter:
    """A selector drafter whose edge scores are far from zero (all three selector tensors drawn at random)."""
    drafter = DFlashDrafter(arch, nnx.Rngs(seed))
    sel = drafter.candidate_selector
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    for key, var in zip(keys, (sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.kernel),
                        strict=True):
        var.set_value(scale * jax.random.normal(key, var.get_value().shape))
    return drafter


def test_selector_fields_are_validated(setup):
    with pytest.raises(ValueError, match="drafter.selector"):
        DrafterConfig(selector=True)  # DFlash v1
    for field in ("selector_rank", "selector_top_k"):
        with pytest.raises(ValueError, match=f"drafter.{field}"):
            DrafterConfig(variant="dflash2", selector=True, **{field: 0})
    target_cfg, _, arch = setup
    assert (arch.selector_rank, arch.selector_top_k) == (RANK, TOP_K)
    off = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                        variant="dflash2"), target_cfg, mask_token_id=255)
    assert off.selector_rank == 0 and DFlashDrafter(off, nnx.Rngs(0)).candidate_selector is None


def test_the_walk_equals_a_loop_reference(setup):
    """Top-k candidates of each slot re-ranked by u + <P[prev] * W h, S[c]>, the previous slot's choice (the
    anchor first) feeding the next; the random selector makes the walk leave the argmax somewhere."""
    _, _, arch = setup
    sel = _live(arch, 0).candidate_selector
    rng = np.random.default_rng(0)
    b, t, v, d = 3, 5, 256, 64
    logits = rng.standard_normal((b, t, v)).astype(np.float32)
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    anchor = rng.integers(0, v, size=b)
    unary, cand = jax.lax.top_k(jnp.asarray(logits), TOP_K)
    got = np.asarray(jax.jit(sel.walk)(cand.astype(jnp.int32), unary, jnp.asarray(hidden), jnp.asarray(anchor)))
    pred = np.asarray(sel.predecessor_codebook[...], np.float64)
    succ = np.asarray(sel.successor_codebook[...], np.float64)
    w = np.asarray(sel.hidden_projection.kernel[...], np.float64)  # [D, r]
    want = np.zeros((b, t), np.int64)
    for i in range(b):
        prev = anchor[i]
        for j in range(t):
            order = np.argsort(-logits[i, j], kind="stable")[:TOP_K]
            proj = hidden[i, j].astype(np.float64) @ w
            scores = [logits[i, j, c] + np.sum(pred[prev] * proj * succ[c]) for c in order]
            prev = order[int(np.argmax(scores))]
            want[i, j] = prev
    np.testing.assert_array_equal(got, want)
    assert np.any(want != np.argmax(logits, axis=-1))


def _selector_inputs(setup, seed: int):
    """Hidden states, head, blocks (two rows; one block cut by the row's end) for the selector loss."""
    target_cfg, target_params, arch = setup
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 255, size=(2, 20)), jnp.int32)
    batch = TrainBatch(tokens=tokens, loss_mask=jnp.ones(tokens.shape, jnp.float32))
    blocks = build_blocks_batch(batch, jnp.asarray([[2, 9, 17], [0, 6, 11]]), jnp.ones((2, 3), bool), K, 255)
    hidden = jnp.asarray(rng.standard_normal((2, 3 * K, 64)), jnp.float32)
    return hidden, train_head(target_params, target_cfg), blocks


def _reference_loss(params, hidden, head, blocks):
    """The selector loss by brute force in jnp: candidates from the full logits, the label put in
    place of the last one when missing, a decay-weighted cross-entropy per labelled slot."""
    pred, succ, w = params
    logits = np.einsum("bqd,vd->bqv" if head.vocab_major else "bqd,dv->bqv", np.asarray(hidden),
                       np.asarray(head.matrix))  # constants: the candidates do not depend on the selector
    labels, mask, ids = np.asarray(blocks.labels), np.asarray(blocks.label_mask), np.asarray(blocks.block_ids)
    total, count = 0.0, 0.0
    decay = np.exp(-(np.arange(K) - 1.0) / 4.0)  # the paper's per-slot weights (slot 0, the anchor, is never used)
    for b in range(hidden.shape[0]):
        for n in range(hidden.shape[1] // K):
            slots = [n * K + k for k in range(1, K)]
            cands, unaries, golds = [], [], []
            for q in slots:
                top = [int(c) for c in np.argsort(-logits[b, q], kind="stable")[:TOP_K]]
                if labels[b, q] not in top:
                    top[-1] = int(labels[b, q])
                cands.append(top)
                unaries.append(jnp.asarray(logits[b, q, top]))
                golds.append(top.index(int(labels[b, q])) if mask[b, q] else 0)

            def score(j, prev, c, q=None, cands=cands, unaries=unaries, slots=slots, b=b):
                proj = hidden[b, slots[j]] @ w
                return unaries[j][c] + jnp.sum(pred[prev] * proj * succ[cands[j][c]])

            anchor = int(ids[b, n * K])
            for j, q in enumerate(slots):
                if not mask[b, q]:
                    continue
                prev = anchor if j == 0 else int(labels[b, q - 1])
                s = jnp.stack([score(j, prev, c) for c in range(TOP_K)])
                total += decay[j + 1] * (jax.nn.logsumexp(s) - s[golds[j]])
                count += decay[j + 1]
    return total / count


def test_selector_loss_and_gradient_equal_a_brute_force_reference(setup):
    _, _, arch = setup
    sel = _live(arch, 1, scale=0.5).candidate_selector
    hidden, head, blocks = _selector_inputs(setup, 2)
    assert not np.all(np.asarray(blocks.label_mask)[0, -K + 1:])  # the last block of row 0 is cut by the row's end
    objective = Objective(gamma=4.0)
    graphdef, state = nnx.split(sel, nnx.Param)

    def ours(state, hidden):
        return selector_loss(nnx.merge(graphdef, state), hidden, head, blocks, K, objective)[0]

    def ref(state):
        flat = {".".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(state)}
        params = (flat["predecessor_codebook"], flat["successor_codebook"], flat["hidden_projection.kernel"])
        return _reference_loss(params, hidden, head, blocks)

    got_loss, got_grad = jax.jit(jax.value_and_grad(ours))(state, hidden)
    want_loss, want_grad = jax.value_and_grad(ref)(state)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for (path, g), (_, w) in zip(nnx.to_flat_state(got_grad), nnx.to_flat_state(want_grad), strict=True):
        assert np.abs(np.asarray(w[...])).max() > 0, path
        np.testing.assert_allclose(g[...], w[...], rtol=1e-4, atol=1e-6, err_msg=str(path))


def test_greedy_with_the_selector_equals_ar(setup):
    target_cfg, target_params, arch = setup
    drafter = _live(arch, 3)
    prompts = [list(np.random.default_rng(4).integers(0, 255, size=n)) for n in (7, 19)]
    assert_greedy_equals_ar(target_params, target_cfg, drafter, prompts, 20, block_size=K)


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_a_trained_selector_round_trips_bit_exact(setup, tmp_path, layout):
    target_cfg, _, arch = setup
    drafter = _live(arch, 5)
    loaded, _ = export_round_trip(drafter, layout, tmp_path, target_cfg, arch)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["candidate_selector.predecessor_codebook"].shape == (256, RANK)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (RANK, 64)
    assert loaded.arch == arch
    assert_same_params(drafter, loaded)


def test_init_from_a_drafter_without_a_selector_adds_one_that_drafts_its_argmax(setup, tmp_path):
    """`train.init_from` a DFlash2 drafter without a selector (a z-lab export) into a recipe with one: every
    tensor of the source is loaded as it was, the new selector has the recipe's rank and top-k, and its
    successor codebook is zero, so step 0 drafts each slot's argmax, what the source drafts."""
    from types import SimpleNamespace

    from dflash.train.loop import init_from_params

    target_cfg, _, arch = setup
    plain_arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                               variant="dflash2"), target_cfg, mask_token_id=255)
    source = DFlashDrafter(plain_arch, nnx.Rngs(9))
    save_zlab(source, tmp_path)
    grown = DFlashDrafter(arch, nnx.Rngs(0))
    nnx.update(grown, jax.tree.map(jnp.asarray, init_from_params(str(tmp_path), arch, SimpleNamespace(cfg=target_cfg))))
    theirs = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    added = set()
    for keys, value in nnx.to_flat_state(nnx.state(grown, nnx.Param)):
        if keys in theirs:
            np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(theirs[keys][...]), err_msg=str(keys))
        else:
            added.add(keys[:2])
    assert added == {("candidate_selector", n) for n in ("predecessor_codebook", "successor_codebook",
                                                         "hidden_projection")}
    sel = grown.candidate_selector
    assert sel.predecessor_codebook[...].shape == (target_cfg.vocab_size, RANK) and sel.top_k == TOP_K
    assert not np.any(np.asarray(sel.successor_codebook[...]))
    rng = np.random.default_rng(1)
    unary, cand = jax.lax.top_k(jnp.asarray(rng.standard_normal((3, K - 1, 256)), jnp.float32), TOP_K)
    hidden = jnp.asarray(rng.standard_normal((3, K - 1, 64)), jnp.float32)
    walked = sel.walk(cand.astype(jnp.int32), unary, hidden, jnp.asarray([1, 2, 3]))
    np.testing.assert_array_equal(np.asarray(walked), np.asarray(cand[..., 0]))
    with pytest.raises(ConfigError, match="num_layers"):
        init_from_params(str(tmp_path), dataclasses.replace(arch, num_layers=3), SimpleNamespace(cfg=target_cfg))


@pytest.mark.slow  # an engine walk and two teacher walks: ~1 min on a loaded 2-core CPU
def test_the_teacher_walk_with_the_selector_is_the_engine_walk(setup):
    """`data.walk`'s teacher-forced walk (slot k's walk step from the target's token at a + k - 1) equals greedy
    serving block for block with a selector drafter over a 4-token draft vocabulary (so blocks get drafts
    accepted), and the selector changes the walk against the same drafter's argmax."""
    from dflash.data.walk import walk_engine, walk_teacher
    from dflash.models.drafter import DraftVocab
    from dflash.serve.engine import Engine
    from dflash.serve.speculative import Models

    target_cfg, target_params, arch = setup
    s = 96
    rng = np.random.default_rng(6)
    prompts = [rng.integers(8, target_cfg.vocab_size, size=8).tolist() for _ in range(3)]
    done = decode(target_params, target_cfg, prompts, 60, max_len=s + 16)
    rows = []
    for i, (prompt, c) in enumerate(zip(prompts, done, strict=True)):
        tokens, mask = np.zeros(s, np.int32), np.zeros(s, np.float32)
        n = len(prompt) + len(c.token_ids)
        tokens[:n], mask[len(prompt):n] = prompt + list(c.token_ids), 1
        rows.append((i, tokens, mask, n))
    counts = np.bincount(np.concatenate([t[m > 0] for _, t, m, _ in rows]), minlength=target_cfg.vocab_size)
    vocab = DraftVocab(np.sort(np.argsort(-counts, kind="stable")[:4]))
    drafter = _live(arch, 7, scale=0.3)
    drafter.draft_vocab = vocab
    plain = DFlashDrafter(resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                                        variant="dflash2"), target_cfg, mask_token_id=255), nnx.Rngs(0))
    nnx.update(plain, {k: v for k, v in nnx.state(drafter, nnx.Param).items() if k != "candidate_selector"})
    plain.draft_vocab = vocab
    walks = {name: [walk_teacher(Models.of(target_params, target_cfg, d), t, m, n, K, i) for i, t, m, n in rows]
             for name, d in (("selector", drafter), ("argmax", plain))}
    engine = Engine(target_params, target_cfg, drafter, Chain(K), Limits(slots=3, max_len=s + 16))
    assert walk_engine(engine, rows, ()) == walks["selector"]
    assert np.concatenate([r.accepted for r in walks["selector"]]).max() >= 1
    assert [r.accepted for r in walks["selector"]] != [r.accepted for r in walks["argmax"]]


def test_a_trained_selector_beside_a_logit_multiplier_is_skipped(setup, tmp_path, caplog):
    """A z-lab DFlash2 config whose output_multiplier rescales the unary logits: the trained selector is not used
    (warned; the drafter proposes each slot's argmax)."""
    import json

    target_cfg, _, arch = setup
    save_zlab(_live(arch, 8), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["output_multiplier"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_zlab(tmp_path, target_cfg)
    assert loaded.arch.selector_rank == 0 and loaded.candidate_selector is None
    assert "output_multiplier 0.5" in caplog.text


def test_the_drafter_loss_adds_the_selector_loss_and_only_the_selector_learns_from_it(setup):
    """`train.step.drafter_loss` with a selector drafter: the unary loss plus selector_weight x the selector's,
    whose gradient reaches the selector's three tensors and nothing else (the backbone's gradient is the one
    without it)."""
    from reference import split_drafter

    from dflash.models.decoder import embed
    from dflash.models.drafter import online_features
    from dflash.train.step import StepInputs, StepSpec, drafter_loss

    target_cfg, target_params, arch = setup
    graphdef, params = split_drafter(_live(arch, 9, scale=0.5))
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 255, size=(1, 24)), jnp.int32)
    batch = TrainBatch(tokens=tokens, loss_mask=jnp.ones(tokens.shape, jnp.float32))
    blocks = build_blocks_batch(batch, jnp.asarray([[3, 9, 16]]), jnp.ones((1, 3), bool), K, 255)
    inputs = StepInputs(blocks=blocks, embeds_BxQxD=embed(target_params, blocks.block_ids),
                        feats_BxSxDf=online_features(target_params, target_cfg, tokens, (1, 3)))
    head = train_head(target_params, target_cfg)

    def run(weight):
        spec = StepSpec(graphdef=graphdef, target_cfg=target_cfg, arch=arch, num_anchors=3,
                        objective=Objective(selector_weight=weight))
        fn = lambda p: drafter_loss(p, inputs, head, spec)  # noqa: E731
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)

    (with_loss, metrics), with_grad = run(0.5)
    (without_loss, _), without_grad = run(0.0)
    np.testing.assert_allclose(with_loss, without_loss + 0.5 * metrics["loss/selector"], rtol=1e-6)
    for (path, g), (_, h) in zip(nnx.to_flat_state(with_grad), nnx.to_flat_state(without_grad), strict=True):
        if "candidate_selector" in map(str, path):
            assert np.abs(np.asarray(g[...])).max() > 0 and not np.any(np.asarray(h[...])), path
        else:
            np.testing.assert_array_equal(g[...], h[...], err_msg=str(path))
