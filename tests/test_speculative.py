"""Greedy DFlash speculative decoding equals AR decoding token for token (fp32, CPU; docs/design.md §7, pitfalls 5, 6).

The tiny random target (qwen3_untied, vocab 256) and an untrained drafter: its proposals are mostly
rejected, so the tests also drive the engine with an oracle proposer (every draft right: full
acceptance) and a wrong one (every draft wrong: full rejection).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ar_alone, tiny_engine_models
from flax import nnx

from dflash.models.drafter import DFlashDrafter, DraftVocab
from dflash.serve.engine import DecodeRun, Engine, decode
from dflash.serve.plan import Chain, Limits, Tree
from dflash.serve.sampling import SamplingConfig
from dflash.serve.speculative import view_slots

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


TRAIN_K = 16
MAX_LEN = 256
NEW = 24


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params, drafter = tiny_engine_models(TRAIN_K)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 255, size=n)) for n in (5, 17, 9, 30)]
    ar = [ar_alone(target_params, target_cfg, p, NEW) for p in prompts]
    return target_cfg, target_params, drafter, prompts, ar


def _oracle(prompts, ar, wrong: bool):
    """Drafts read from the AR reference (right, or each shifted by one: always wrong)."""
    def draft(state, k):
        lengths, slots = np.asarray(state.lengths), view_slots(state)  # the step's rows: decode's slot i, prompt i
        out = np.zeros((len(slots), k - 1), np.int32)
        for b, slot in enumerate(slots):
            if slot >= len(prompts):
                continue  # a row padding the step's bucket
            p, ref = prompts[slot], ar[slot]
            done = int(lengths[b]) - len(p)  # tokens of ref already committed; ref[done] is pending
            if done < 0:
                continue  # a finished (inactive) slot: its drafts are ignored
            nxt = [ref[done + i] if done + i < len(ref) else 0 for i in range(1, k)]
            out[b] = (np.asarray(nxt) + 1) % 256 if wrong else nxt
        return jnp.asarray(out)
    return draft


# every K: `bin/test --all`; slow (2, 8, 16): [4] keeps greedy DFlash == AR at batch 4, and
# test_full_acceptance_commits_k_tokens_per_step equals AR at K = 2, 8 and 16 (oracle drafts)
@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow),
                               pytest.param(16, marks=pytest.mark.slow)])
def test_greedy_dflash_equals_ar_batch_4(setup, k):
    target_cfg, target_params, drafter, prompts, ar = setup
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, drafter=drafter, plan=Chain(k))
    for res, ref in zip(results, ar, strict=True):
        assert res.token_ids == ref
        assert 1.0 <= res.tau <= k and len(res.accept_per_position) == k - 1


@pytest.mark.slow  # ~20 s of batch-1 shapes: nightly; the batch-4 equalities above stay
def test_greedy_dflash_equals_ar_batch_1(setup):
    target_cfg, target_params, drafter, prompts, ar = setup
    for p, ref in zip(prompts, ar, strict=True):
        [res] = decode(target_params, target_cfg, [p], NEW, max_len=MAX_LEN, plan=Chain(8), drafter=drafter)
        assert res.token_ids == ref


@pytest.mark.parametrize("k", [2, 8, 16])
def test_full_acceptance_commits_k_tokens_per_step(setup, k):
    target_cfg, target_params, drafter, prompts, ar = setup
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, drafter=drafter,
                     plan=Chain(k, drafts=_oracle(prompts, ar, wrong=False)))
    for res, ref in zip(results, ar, strict=True):
        assert res.token_ids == ref
        # Every step but possibly the last accepts all K-1 drafts (the last may stop at max tokens).
        assert all(a == k - 1 for a in res.accepted[:-1]) and res.accepted
        assert len(res.accepted) == -(-(NEW - 1) // k)


def test_full_rejection_still_equals_ar(setup):
    target_cfg, target_params, drafter, prompts, ar = setup
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN,
                     plan=Chain(8, drafts=_oracle(prompts, ar, wrong=True)), drafter=drafter)
    for res, ref in zip(results, ar, strict=True):
        assert res.token_ids == ref
        assert set(res.accepted) == {0} and res.tau == 1.0


# slow: test_acceptance_counts_only_what_was_emitted makes the same decode and asserts the same tokens
@pytest.mark.slow
def test_stop_tokens_end_each_sequence(setup):
    target_cfg, target_params, drafter, prompts, ar = setup
    stop = ar[1][6]
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN,
                     plan=Chain(4, drafts=_oracle(prompts, ar, wrong=False)), drafter=drafter, stop_ids=[stop])
    for res, ref in zip(results, ar, strict=True):
        want = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert res.token_ids == want


def test_acceptance_counts_only_what_was_emitted(setup):
    """Oracle drafts (every draft right) with a stop token inside a block and budgets that end mid-block:
    each step counts the tokens it emitted, so sum(accepted + 1) is the tokens after the first one and a
    cut step counts fewer than K."""
    target_cfg, target_params, drafter, prompts, ar = setup
    stop = ar[1][6]  # inside the second block of prompt 1 at K=4
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN,
                     plan=Chain(4, drafts=_oracle(prompts, ar, wrong=False)), drafter=drafter, stop_ids=[stop])
    for res, ref in zip(results, ar, strict=True):
        want = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert res.token_ids == want
        assert sum(a + 1 for a in res.accepted) == len(res.token_ids) - 1
        assert all(a == 3 for a in res.accepted[:-1])
    cut = results[1]  # 7 tokens: 1 from the prefill, then 4 + 2: the stop cuts the second step at 2 tokens
    assert cut.accepted == [3, 1] and cut.tau == 3.0
    budget = decode(target_params, target_cfg, prompts[:1], 7, max_len=MAX_LEN,
                    plan=Chain(4, drafts=_oracle(prompts[:1], ar[:1], wrong=False)), drafter=drafter)[0]
    assert len(budget.token_ids) == 7 and budget.accepted == [3, 1]


def test_bad_block_size_is_refused(setup):
    target_cfg, target_params, drafter, prompts, _ = setup
    with pytest.raises(ValueError, match=r"block_size must lie in \[2, 16\]"):
        decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(32), drafter=drafter)


@pytest.mark.slow
def test_a_trained_checkpoint_loads_into_the_engine(setup, tmp_path):
    """A drafter saved by the trainer's Checkpointer loads back exactly and decodes exactly alike."""
    import jax

    from dflash.models.drafter_io import load_drafter
    from dflash.train.checkpoint import Checkpointer, CheckpointError
    from dflash.train.loop import arch_dict
    from dflash.train.step import init_state, make_optimizer

    target_cfg, target_params, drafter, prompts, ar = setup
    trained = DFlashDrafter(drafter.arch, nnx.Rngs(7))
    state = init_state(nnx.state(trained, nnx.Param), make_optimizer(1e-3, 10), jax.random.PRNGKey(0))
    ckpt = Checkpointer(tmp_path / "checkpoints", {"arch": arch_dict(drafter.arch)})
    ckpt.save(5, state, {"iterator": {"next_index": 5}})
    ckpt.close()
    loaded = load_drafter(tmp_path, target_cfg)
    want = nnx.to_flat_state(nnx.state(trained, nnx.Param))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
    for keys, variable in want:
        np.testing.assert_array_equal(np.asarray(got[keys][...]), np.asarray(variable[...]))
    a = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=trained)
    b = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=loaded)
    assert [r.accepted for r in a] == [r.accepted for r in b] and [r.token_ids for r in b] == ar
    other = dataclasses.replace(target_cfg, vocab_size=target_cfg.vocab_size + 1)
    with pytest.raises(CheckpointError, match=r"trained for another target \(vocab_size: drafter 256 vs target 257\)"):
        load_drafter(tmp_path, other)


def test_sampled_dflash_has_the_target_distribution(setup):
    """T=1, top-k 4: the joint law of the first two tokens under DFlash (one-hot rejection sampling) equals
    the target's exact law (chi-square over the 16 cells, 4000 draws). The proposer drafts the target's
    most likely second token, so drafts are accepted and rejected often and both branches are exercised."""
    from scipy.stats import chisquare

    from dflash.models.decoder import forward
    from dflash.serve.sampling import filtered_logprobs

    target_cfg, target_params, drafter, _, _ = setup
    sampling = SamplingConfig(temperature=1.0, top_k=4)
    prompt = [11, 42, 7, 99, 3, 150]

    def law(tokens):
        logits, _ = forward(target_params, target_cfg, jnp.asarray([tokens]))
        return np.exp(np.asarray(filtered_logprobs(logits[0, -1], sampling), np.float64))

    p1 = law(prompt)
    firsts = np.flatnonzero(p1 > 0)
    p2 = {int(t): law(prompt + [int(t)]) for t in firsts}
    best2 = np.zeros(256, np.int32)
    for t, p in p2.items():
        best2[t] = int(np.argmax(p))
    cells = [(int(a), int(b)) for a in firsts for b in np.flatnonzero(p2[int(a)] > 0)]
    expected = np.array([p1[a] * p2[a][b] for a, b in cells])

    def draft(state, k):
        first = best2[np.asarray(state.pending)]
        return jnp.asarray(np.stack([first, np.full_like(first, 7)], axis=1)[:, : k - 1])

    n = 4000  # a budget of 3: the first step can emit 2 tokens, so its acceptance of d_1 shows in the statistics
    results = decode(target_params, target_cfg, [prompt] * n, 3, max_len=32, plan=Chain(3, drafts=draft),
                     drafter=drafter, sampling=sampling, run=DecodeRun(seeds=list(range(n))))
    pairs = [tuple(r.token_ids[:2]) for r in results]
    observed = np.array([sum(1 for p in pairs if p == c) for c in cells])
    assert observed.sum() == n, "a pair outside the target's support was sampled"
    stat = chisquare(observed, expected / expected.sum() * n)
    assert stat.pvalue > 1e-3, (stat, list(zip(cells, observed, (expected * n).round(1), strict=True)))
    accepted = [r.accepted[0] for r in results]
    assert 0.1 < np.mean(accepted) < 0.95, "both acceptance and rejection must be exercised"


def test_drafts_drawn_from_the_drafter_keep_the_target_distribution(setup):
    """draft_rule "sample", T=1 (no filter, where this untrained drafter's distribution overlaps the target's): the
    joint law of the first two tokens equals the target's exact law (chi-square over (t1 mod 8, t2 mod 8), 4000
    draws; the law from one forward per first token). Drafts come from the drafter itself and are accepted by
    speculative sampling; the first draft is accepted in a share of steps far above what one-hot drafts get here,
    and rejected in many."""
    from scipy.stats import chisquare

    from dflash.models.decoder import forward

    target_cfg, target_params, drafter, _, _ = setup
    sampling = SamplingConfig(temperature=1.0)
    prompt = [11, 42, 7, 99, 3, 150]
    vocab = target_cfg.vocab_size
    logits, _ = forward(target_params, target_cfg, jnp.asarray([prompt + [t] for t in range(vocab)]))
    p2 = np.exp(np.asarray(jax.nn.log_softmax(logits[:, -1].astype(jnp.float32)), np.float64))  # [first, second]
    p1 = np.exp(np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1].astype(jnp.float32)), np.float64))
    joint = p1[:, None] * p2
    cells = np.zeros((8, 8))
    np.add.at(cells, (np.arange(vocab)[:, None] % 8, np.arange(vocab)[None, :] % 8), joint)

    n = 4000
    results = {rule: decode(target_params, target_cfg, [prompt] * n, 3, max_len=32, plan=Chain(3, rule),
                            drafter=drafter, sampling=sampling, run=DecodeRun(seeds=list(range(n))))
               for rule in ("sample", "argmax")}
    pairs = np.array([r.token_ids[:2] for r in results["sample"]])
    observed = np.zeros((8, 8))
    np.add.at(observed, (pairs[:, 0] % 8, pairs[:, 1] % 8), 1)
    stat = chisquare(observed.ravel(), cells.ravel() / cells.sum() * n)
    assert stat.pvalue > 1e-3, stat
    first = {rule: np.mean([r.accepted[0] > 0 for r in done]) for rule, done in results.items()}
    assert 0.2 < first["sample"] < 0.9, first  # both branches exercised
    assert first["sample"] > first["argmax"] + 0.1, first


def test_the_sample_rule_leaves_greedy_requests_alone_and_is_checked(setup):
    """Greedy requests of an engine whose draft rule is "sample" decode exactly as AR, with the same acceptance
    as under "argmax"; a rule the engine cannot apply is refused by name."""
    from dflash.serve.engine import Engine

    target_cfg, target_params, drafter, prompts, ar = setup
    trained = DFlashDrafter(drafter.arch, nnx.Rngs(5))
    argmax = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=trained)
    sample = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8, "sample"), drafter=trained)
    assert [r.token_ids for r in sample] == ar
    assert [r.accepted for r in sample] == [r.accepted for r in argmax]
    with pytest.raises(ValueError, match="draft_rule must be one of"):
        Engine(target_params, target_cfg, drafter, Chain(4, "topk"), Limits(slots=1, max_len=MAX_LEN))
    with pytest.raises(ValueError, match="with given drafts"):
        Chain(4, "sample", drafts=lambda state, k: None)
    with pytest.raises(ValueError, match="drafter must be given"):
        Engine(target_params, target_cfg, None, Chain(4, "sample"), Limits(slots=1, max_len=MAX_LEN))


def test_zlab_directory_round_trip_decodes_identically(setup, tmp_path):
    """The same weights through the z-lab HF layout give the same drafter and the same outputs."""
    import json

    from dflash.models.loading import WeightsError
    from dflash.models.zlab import load_zlab, save_zlab

    target_cfg, target_params, drafter, prompts, ar = setup
    trained = DFlashDrafter(drafter.arch, nnx.Rngs(3))
    save_zlab(trained, tmp_path / "zlab")
    config = json.loads((tmp_path / "zlab" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == TRAIN_K
    assert config["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [1, 3]}
    assert config["model_type"] == target_cfg.family and config["num_target_layers"] == target_cfg.num_layers
    loaded = load_zlab(tmp_path / "zlab", target_cfg)
    assert loaded.arch == trained.arch
    a = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=trained)
    b = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=loaded)
    assert [r.accepted for r in a] == [r.accepted for r in b] and [r.token_ids for r in b] == ar
    # A tensor set that does not match the config is refused, naming the tensor.
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "zlab" / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "zlab" / "model.safetensors"))
    with pytest.raises(WeightsError, match="'layers.1.mlp.up_proj.weight' is missing"):
        load_zlab(tmp_path / "zlab", target_cfg)
    with pytest.raises(ValueError, match="trained for another target"):
        load_zlab(tmp_path / "zlab", dataclasses.replace(target_cfg, hidden_size=target_cfg.hidden_size * 2))


@pytest.mark.slow  # test_engine_pages checks the same bound on page-table changes in the default tier
def test_compiled_shapes_stay_bounded_over_a_long_generation(setup):
    """Prompts of many lengths compile one prefill per power-of-two bucket; a long generation compiles
    propose and verify once per power-of-two attention span for a fixed (batch, K): at most
    log2(MAX_LEN / 16) + 1 of them, however long it runs."""
    from dflash.serve import speculative

    target_cfg, target_params, drafter, _, _ = setup
    before = {f: getattr(speculative, f)._cache_size() for f in ("prefill", "propose", "verify")}
    rng = np.random.default_rng(1)
    lengths = [3, 9, 16, 17, 31, 33, 40]  # buckets 16, 32, 64
    for n in lengths:
        decode(target_params, target_cfg, [list(rng.integers(0, 255, size=n))], 96, max_len=MAX_LEN, plan=Chain(4),
               drafter=drafter)
    grown = {f: getattr(speculative, f)._cache_size() - before[f] for f in before}
    assert grown["prefill"] <= 3, grown
    bound = int(np.log2(MAX_LEN // 16)) + 1  # spans of 1, 2, 4, ... 16 pages
    assert 1 <= grown["propose"] <= bound and 1 <= grown["verify"] <= bound, grown


def test_draft_vocabulary_proposes_inside_it_and_stays_lossless(setup, tmp_path):
    """A drafter with a draft vocabulary (`train.head_vocab`) proposes the argmax over those rows of the head
    only: with every id in it (any order) the proposals equal the full head's; with half of the ids every
    proposal lies inside it; greedy decoding equals AR either way; the vocabulary travels through the z-lab
    layout."""
    from dflash.models.zlab import load_zlab, save_zlab
    from dflash.serve.engine import Engine
    from dflash.serve.speculative import propose

    target_cfg, target_params, drafter, prompts, ar = setup
    trained = DFlashDrafter(drafter.arch, nnx.Rngs(5))
    full = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=trained)
    every = nnx.clone(trained)
    every.draft_vocab = DraftVocab(np.random.default_rng(0).permutation(target_cfg.vocab_size))
    same = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=every)
    assert [r.accepted for r in same] == [r.accepted for r in full] and [r.token_ids for r in same] == ar

    half = nnx.clone(trained)
    keep = np.arange(0, target_cfg.vocab_size, 2)
    half.draft_vocab = DraftVocab(keep)
    engine = Engine(target_params, target_cfg, half, Chain(8), Limits(slots=len(prompts), max_len=MAX_LEN))
    for p in prompts:
        engine.submit(p, NEW)
    engine.step()  # admit and prefill, one step
    drafts = np.asarray(propose(engine.models, engine.state, 8))
    assert np.isin(drafts, keep).all()
    full_drafts = np.asarray(propose(Engine(target_params, target_cfg, trained, Chain(8),
                                            Limits(slots=len(prompts), max_len=MAX_LEN)).models, engine.state, 8))
    assert not np.isin(full_drafts, keep).all()  # the full head would have proposed odd ids
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(8), drafter=half)
    assert [r.token_ids for r in results] == ar

    save_zlab(half, tmp_path / "zlab")
    loaded = load_zlab(tmp_path / "zlab", target_cfg)
    np.testing.assert_array_equal(loaded.draft_vocab.ids, keep)
    small = dataclasses.replace(target_cfg, vocab_size=int(keep.max()))
    with pytest.raises(ValueError, match="draft_vocab"):  # an id outside the target's vocab is refused
        Engine(target_params, small, loaded, Chain(8), Limits(slots=1, max_len=MAX_LEN))
    with pytest.raises(ValueError, match="draft_vocab"):
        DraftVocab(np.array([3, 3]))


def test_first_argmax_and_categorical_are_jax_s_own():
    """`speculative.first_argmax` (the engine's argmax: a max, then the first index holding it) returns what
    `jnp.argmax` returns, ties (the first), NaN (the first NaN) and -inf included; `speculative.categorical` draws
    exactly `jax.random.categorical`'s tokens from the same keys, masked (-inf) logits included."""
    from dflash.serve.speculative import categorical, first_argmax

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 3, size=(64, 7, 50)).astype(np.float32)  # many ties
    x[0, 0, 5] = x[0, 1, 9] = np.nan
    x[1, 0] = -np.inf
    x[2, 0, :] = np.nan
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.asarray(jnp.argmax(jnp.asarray(x), -1)))
    logits = jnp.asarray(np.where(rng.random((200, 50)) < 0.3, -np.inf, rng.normal(size=(200, 50))), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(3), 200)
    ours = jax.jit(jax.vmap(categorical))(keys, logits)
    theirs = jax.jit(jax.vmap(jax.random.categorical))(keys, logits)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert ours.dtype == jnp.int32 and np.isfinite(np.asarray(logits)[np.arange(200), np.asarray(ours)]).all()


# slow (tree, ~1 min): [chain] keeps the oracle in the device loop, test_tree's
# test_tree_steps_per_dispatch_change_no_output[argmax] the tree's device loop equal to AR
@pytest.mark.parametrize("plan", [Chain(8), pytest.param(Tree(8, 10), marks=pytest.mark.slow)], ids=["chain", "tree"])
def test_oracle_drafts_the_greedy_continuation_in_the_device_loop(setup, plan):
    """The oracle-ceiling benchmark's engine (D99): greedy requests whose prompts it knows draft their AR
    continuation inside the device loop, so every step of the chain or the tree accepts all K-1 drafts (the last may
    stop at the budget); the output is AR's. Control: the untrained drafter's own drafts are mostly rejected."""
    target_cfg, target_params, drafter, prompts, ar = setup
    known = {tuple(int(t) for t in p): ref for p, ref in zip(prompts[:3], ar, strict=False)}  # not prompt 3's

    def run(oracle):
        engine = Engine(target_params, target_cfg, drafter, plan,
                        Limits(slots=len(prompts), max_len=MAX_LEN, steps_per_dispatch=4), oracle=oracle)
        ids = [engine.submit(p, NEW) for p in prompts]
        done = engine.run()
        return [done[i] for i in ids]

    oracle_runs, plain = run(known), run(None)
    for res, ref in zip(oracle_runs, ar, strict=True):
        assert res.token_ids == ref
    for res in oracle_runs[:3]:
        assert all(a == 7 for a in res.accepted[:-1]) and len(res.accepted) == -(-(NEW - 1) // 8)
    assert np.mean([a for r in [*plain, oracle_runs[3]] for a in r.accepted]) < 1  # its drafter's own: rejected
