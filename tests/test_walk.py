"""The serving walk (data/walk.py, `dflash data walk`) and walk anchors in training (`TrainBatch.walk`,
`sample_anchors`): the teacher-forced walk gives the engine's block starts and accept lengths (fp32, tiny models),
the stage resumes without losing or repeating rows, and the sampler draws walk anchors at the stated rate and
weights."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_engine_models

from dflash.data.batch import BatchLayout, TrainBatch
from dflash.data.offline import PackAndStack
from dflash.data.online import make_batches
from dflash.data.records import BF16, Sample
from dflash.data.walk import (
    WalkMode,
    WalkRecord,
    find_walk,
    load_walk,
    run_walk,
    walk_engine,
    walk_paths,
    walk_teacher,
    walk_weights,
)
from dflash.models.drafter import DraftVocab
from dflash.serve.acceptance import answer_spans, chain, teacher_taus
from dflash.serve.engine import Engine, decode
from dflash.serve.plan import Chain, Limits
from dflash.serve.speculative import Models
from dflash.train.objective import sample_anchors, sample_anchors_batch, valid_anchor_positions

K = 4
S = 128
STOP = 96  # ends the 4th answer after 61 tokens; the first two are cut by their budget


@pytest.fixture(scope="module")
def tiny():
    """The tiny target and drafter, rows whose answers are the target's own greedy decodes (one stopped by a stop
    token, one cut by its budget, one whose stored answer was altered mid-way), and a 4-token draft vocabulary of
    the answers' most frequent tokens, so that blocks get 0 .. K-1 drafts accepted."""
    target_cfg, target_params, drafter = tiny_engine_models(K)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(8, target_cfg.vocab_size, size=8).tolist() for _ in range(4)]
    done = decode(target_params, target_cfg, prompts, 100, max_len=S + 16, stop_ids=(STOP,))
    rows = []
    for i, (prompt, c) in enumerate(zip(prompts, done, strict=True)):
        answer = list(c.token_ids)
        if i == 2:
            answer[40] = (answer[40] + 1) % target_cfg.vocab_size  # the stored answer leaves the greedy one here
        tokens, mask = np.zeros(S, np.int32), np.zeros(S, np.float32)
        n = len(prompt) + len(answer)
        tokens[:n], mask[len(prompt):n] = prompt + answer, 1
        rows.append((i, tokens, mask, n))
    counts = np.bincount(np.concatenate([t[m > 0] for _, t, m, _ in rows]), minlength=target_cfg.vocab_size)
    drafter.draft_vocab = DraftVocab(np.sort(np.argsort(-counts, kind="stable")[:4]))
    return SimpleNamespace(cfg=target_cfg, params=target_params, drafter=drafter, rows=rows,
                           models=Models.of(target_params, target_cfg, drafter))


def test_chain_rule():
    """a_{j+1} = a_j + n_j + 1 and the last block is cut so that nothing is emitted past `last`."""
    lead = {10: 3, 14: 0, 15: 2, 18: 3}
    assert chain(lead.__getitem__, 10, 20) == [(10, 3), (14, 0), (15, 2), (18, 1)]
    assert chain(lead.__getitem__, 10, 10) == []  # the prefill's token was the last one: no verify step
    assert answer_spans(np.array([0, 0, 1, 1, 0, 1, 0, 0]), 7) == [(2, 3), (5, 5)]


def test_teacher_walk_equals_the_engine_walk(tiny):
    """Block for block, the teacher-forced walk from the stored rows is the engine's greedy decode, including a
    row cut by its budget and one whose stored answer differs from the decode after 40 tokens (only its matching
    prefix is walked, and the mismatch is counted)."""
    teacher = [walk_teacher(tiny.models, t, m, n, K, i) for i, t, m, n in tiny.rows]
    engine = Engine(tiny.params, tiny.cfg, tiny.drafter, Chain(K), Limits(slots=4, max_len=S + 16))
    assert walk_engine(engine, tiny.rows, (STOP,)) == teacher
    accepted = np.concatenate([r.accepted for r in teacher])
    assert {0, 1, K - 1} <= set(accepted.tolist())  # first-slot and later rejections, and full blocks
    assert [r.mismatch for r in teacher] == [False, False, True, False] and teacher[2].matched == 40
    for (_, _, mask, n), r in zip(tiny.rows, teacher, strict=True):
        p0 = answer_spans(mask, n)[0][0]
        assert r.starts[0] == p0 and np.all(np.diff(r.starts) == np.asarray(r.accepted[:-1]) + 1)
        assert r.starts[-1] + r.accepted[-1] + 1 == p0 + r.matched - 1  # the walk ends on the last kept token
    taus = teacher_taus(tiny.models, [(t, m, n) for _, t, m, n in tiny.rows], K)
    assert taus["walk"] == pytest.approx(np.mean(accepted + 1))


@pytest.mark.slow  # ~25 s: nightly; the full-attention walk above and test_sliding_window's ring stay
def test_the_teacher_walk_of_a_sliding_drafter_is_the_engine_walk(tiny):
    """With sliding-window layers (W = 16, well inside the rows' 70+ positions) the teacher-forced walk, and so
    `dflash data walk` and the in-loop eval's `tf_tau_walk`, gives each block the window the engine's ring does;
    the window changes the walk against the same weights with full layers."""
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter

    arch = dataclasses.replace(tiny.drafter.arch, layer_types=("sliding_attention",) * 2, sliding_window=16)
    windowed = DFlashDrafter(arch, nnx.Rngs(0))
    nnx.update(windowed, nnx.state(tiny.drafter, nnx.Param))
    windowed.draft_vocab = tiny.drafter.draft_vocab
    models = Models.of(tiny.params, tiny.cfg, windowed)
    teacher = [walk_teacher(models, t, m, n, K, i) for i, t, m, n in tiny.rows]
    engine = Engine(tiny.params, tiny.cfg, windowed, Chain(K), Limits(slots=4, max_len=S + 16))
    assert walk_engine(engine, tiny.rows, (STOP,)) == teacher
    full = [walk_teacher(tiny.models, t, m, n, K, i) for i, t, m, n in tiny.rows]
    assert [r.accepted for r in teacher] != [r.accepted for r in full]


def test_a_walk_from_stored_features_is_the_teacher_walk(tiny):
    """Given the target's features and greedy next tokens as a capture stores them (fp32 here), the drafter alone
    walks each row as the teacher walk does; without stored next ids the stored answer is taken for the greedy
    one, so the altered row's mismatch goes unseen and it is walked to its end."""
    from dflash.models.decoder import forward
    from dflash.models.drafter import concat_features

    run = jax.jit(lambda tokens: forward(tiny.params, tiny.cfg, tokens, layer_ids=tiny.drafter.arch.layer_ids))
    for i, tokens, mask, n in tiny.rows:
        padded = np.zeros((1, 128), np.int32)  # the length the teacher walk pads these rows to
        padded[0, :n] = tokens[:n]
        logits, feats = run(jnp.asarray(padded))
        stored = np.asarray(concat_features(feats)[0, :n]), np.asarray(jnp.argmax(logits[0, :n], axis=-1))
        want = walk_teacher(tiny.models, tokens, mask, n, K, i)
        assert walk_teacher(tiny.models, tokens, mask, n, K, i, stored) == want
        texts = walk_teacher(tiny.models, tokens, mask, n, K, i, (stored[0], None))
        assert (texts == want) == (i != 2) and not texts.mismatch


def test_the_stage_resumes_after_a_crash_and_refuses_other_settings(tiny, tmp_path):
    target = SimpleNamespace(params=tiny.params, cfg=tiny.cfg, fingerprint="tiny",
                             tokenizer=SimpleNamespace(stop_token_ids=(STOP,)))
    examples = [(t, m, n) for _, t, m, n in tiny.rows]
    whole = run_walk(examples, tiny.drafter, target, tmp_path / "a", examples_hash="h", chunk=2, progress=False)
    out, meta = whole.path, walk_paths(tmp_path / "a", whole.path.stem)[1]
    assert json.loads(meta.read_text())["complete"] and whole.walked == 4 and whole.mismatched == 1
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:2]) + lines[2][:17])  # killed while writing the third row
    again = run_walk(examples, tiny.drafter, target, tmp_path / "a", examples_hash="h", chunk=2, progress=False)
    assert again.kept == 2 and out.read_text().splitlines(keepends=True) == lines
    assert find_walk(tmp_path / "a", "auto", "h") == meta
    records = load_walk(meta, "h", 4)
    assert [records[i] for i in range(4)] == [WalkRecord.from_json(json.loads(line)) for line in lines]
    with pytest.raises(ValueError, match="mode: 'teacher' there vs 'engine' now"):
        run_walk(examples, tiny.drafter, target, tmp_path / "a", examples_hash="h", mode=WalkMode("engine"),
                 progress=False)
    with pytest.raises(ValueError, match="examples_hash must be 'other'"):
        load_walk(meta, "other", 4)
    with pytest.raises(FileNotFoundError, match="no complete walk of these training rows"):
        find_walk(tmp_path / "a", "auto", "other")


def test_the_cli_stage_takes_its_options():
    from dflash.launch.cli import build_parser

    args = build_parser().parse_args(["data", "walk", "--config", "tiny", "--drafter", "D", "--mode", "engine",
                                      "--limit", "3", "--no-progress", "data.walk=auto"])
    assert (args.stage, args.drafter, args.mode, args.limit, args.no_progress) == ("walk", "D", "engine", 3, True)
    assert not hasattr(build_parser().parse_args(["data", "inspect", "--sample", "1"]), "no_progress")


def test_walk_weights_follow_the_rule():
    record = WalkRecord(0, "d", starts=(3, 5, 9, 20), accepted=(1, 3, 0, 2), answer=20, matched=20)
    w = walk_weights(record, 16, K, 2.0)
    expected = np.zeros(16, np.float32)
    expected[[3, 5, 9]] = [(K - 1) ** 2, (K - 3) ** 2, K ** 2]  # the start at 20 lies past the row
    np.testing.assert_array_equal(w, expected)
    np.testing.assert_array_equal(walk_weights(record, 16, K, 0.0) > 0, expected > 0)
    assert not walk_weights(None, 16, K, 1.0).any()


# ----------------------------------------------------------------------------- the anchor sampler


def _row(length: int = 64):
    mask = np.zeros(length, np.float32)
    mask[8:60] = 1
    walk = np.zeros(length, np.float32)
    walk[[10, 14, 15, 22, 30, 41, 50]] = [1.0, 4.0, 1.0, 9.0, 1.0, 4.0, 1.0]
    return jnp.asarray(mask), jnp.asarray(walk)


def test_walk_anchors_are_valid_and_the_fraction_is_honoured():
    mask, walk = _row()
    valid = np.asarray(valid_anchor_positions(mask))
    on_walk = np.asarray(walk) > 0
    draw = jax.jit(jax.vmap(lambda r: sample_anchors(mask, 12, K, r, walk, 4)))
    anchors, keep = map(np.asarray, draw(jax.random.split(jax.random.PRNGKey(0), 1000)))
    assert keep.all() and valid[anchors].all()
    assert all(len(set(a)) == 12 for a in anchors)  # distinct
    walk_hits = on_walk[anchors].sum(axis=1)
    # 4 of 12 drawn from the walk, the other 8 uniformly among the 51 valid positions (7 of them on the walk)
    assert walk_hits.min() >= 4
    np.testing.assert_allclose(walk_hits.mean(), 4 + 8 * 3 / 47, atol=0.1)  # 3 walk positions left of 7, 47 valid
    # off: the same draws as the plain sampler, bit for bit
    plain = jax.vmap(lambda r: sample_anchors(mask, 12, K, r))(jax.random.split(jax.random.PRNGKey(0), 50))
    off = jax.vmap(lambda r: sample_anchors(mask, 12, K, r, walk, 0))(jax.random.split(jax.random.PRNGKey(0), 50))
    np.testing.assert_array_equal(plain[0], off[0])


def test_one_walk_anchor_is_drawn_in_proportion_to_its_weight():
    mask, walk = _row()
    draw = jax.jit(jax.vmap(lambda r: sample_anchors(mask, 1, K, r, walk, 1)))
    anchors, _ = draw(jax.random.split(jax.random.PRNGKey(1), 20000))
    positions = np.flatnonzero(np.asarray(walk))
    freq = np.bincount(np.asarray(anchors).ravel(), minlength=64)[positions] / 20000
    np.testing.assert_allclose(freq, np.asarray(walk)[positions] / np.asarray(walk).sum(), atol=0.012)


def test_walk_weights_ride_with_their_conversation_through_the_loaders():
    """Online batches carry each row's weights; packed offline rows place them at the conversation's offset."""
    rng = np.random.default_rng(0)

    def sample(n: int, start: int) -> Sample:
        w = np.zeros(n, np.float32)
        w[start] = 3.0
        return Sample(tokens=rng.integers(1, 9, n).astype(np.int32), loss_mask=np.ones(n, np.uint8),
                      features=np.zeros((n, 8), BF16), walk=w)

    layout = BatchLayout(batch_size=1, seq_len=32, feature_dim=8, packed=True, walk=True)
    batch, _ = PackAndStack(seq_len=16, pad_id=0, layout=layout).map([[sample(5, 2), sample(9, 4)]])
    assert batch.check(layout) is batch and np.flatnonzero(batch.walk[0]).tolist() == [2, 5 + 4]
    examples = [(np.arange(8, dtype=np.int32), np.ones(8, np.float32)) for _ in range(3)]
    walk = [np.eye(8, dtype=np.float32)[i] for i in range(3)]
    batches = make_batches(examples, 3, 0, walk=walk)
    got = next(batches)
    assert isinstance(got, TrainBatch) and got.layout().walk
    assert sorted(np.argmax(got.walk, axis=1).tolist()) == [0, 1, 2]
    assert dataclasses.replace(got, walk=None).layout() == BatchLayout(batch_size=3, seq_len=8)


def test_the_batched_sampler_reads_each_rows_walk():
    mask, walk = _row()
    walk_b = jnp.stack([walk, jnp.zeros_like(walk)])
    draw = jax.jit(lambda m, r, w: sample_anchors_batch(m, 6, K, r, w, 6))
    anchors, _ = draw(jnp.stack([mask, mask]), jax.random.PRNGKey(3), walk_b)
    assert (np.asarray(walk)[np.asarray(anchors[0])] > 0).all()  # 6 of its 7 walk starts


# ----------------------------------------------------------------------------- end to end


@pytest.mark.heavy
@pytest.mark.slow  # ~2 min of compiles on 2 cores (the SmolLM2 walk and train step); the plumbing is also unit-tested
@pytest.mark.e2e
def test_dflash_data_walk_then_training_on_walk_anchors(smollm2_target, tmp_path):
    """`run_walk_stage` (the `dflash data walk` stage) with a fresh drafter on the tiny recipe's rows, then a run
    that reads it through data.walk=auto: its batches hold the walk's weights at the walk's block starts, and two
    steps train on walk anchors. Without data.walk, train.walk_anchors is refused."""
    from flax import nnx

    from dflash.configs.recipe import load_recipe
    from dflash.configs.schema import ConfigError
    from dflash.data.stages import run_walk_stage
    from dflash.models.drafter import DFlashDrafter
    from dflash.models.zlab import save_zlab
    from dflash.train.loop import build_batches, run_training

    overrides = [f"data.dir={tmp_path / 'data'}", f"train.run_dir={tmp_path / 'run'}", "data.max_examples=4",
                 "train.steps=2", "train.batch_size=8", "train.save_every=2", "train.walk_anchors=0.5",
                 "train.walk_oversample=1"]
    recipe = load_recipe("tiny", [*overrides, "data.walk=auto"])
    arch = smollm2_target.drafter_arch(recipe.drafter)
    save_zlab(DFlashDrafter(arch, nnx.Rngs(0)), tmp_path / "drafter")
    summary = run_walk_stage(recipe, drafter=str(tmp_path / "drafter"), target=smollm2_target, progress=False)
    assert summary.walked == 4 and sum(summary.accept_counts) > 0
    records = [WalkRecord.from_json(json.loads(line)) for line in summary.path.read_text().splitlines()]
    batches, fingerprint = build_batches(recipe.data, smollm2_target, arch, 4, walk_power=1.0)
    batch = next(batches)
    assert ":walk-" in fingerprint and batch.walk is not None
    want = sorted(tuple(walk_weights(r, recipe.data.seq_len, arch.block_size, 1.0).tolist()) for r in records)
    assert sorted(tuple(w.tolist()) for w in batch.walk) == want  # one shuffled epoch of the 4 rows
    result = run_training(recipe, target=smollm2_target, progress=False)
    assert result.final_step == 2 and np.isfinite(result.last["loss"])
    with pytest.raises(ConfigError, match="train.walk_anchors"):
        run_training(load_recipe("tiny", overrides), target=smollm2_target, progress=False)
