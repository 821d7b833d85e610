"""The Markov head (`drafter.markov_rank`): a new head is plain DFlash, greedy decoding with a trained-looking
head stays lossless, and training reads the head exactly as the engine drafts with it (fp32, CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, export_round_trip
from flax import nnx
from reference import split_drafter

from dflash.data.batch import TrainBatch
from dflash.models.decoder import embed
from dflash.models.drafter import DFlashDrafter, DrafterConfig, drafter_logits, online_features, resolve_drafter
from dflash.models.loading import load_hf_dir
from dflash.serve.engine import Engine, decode
from dflash.serve.plan import Chain, Limits
from dflash.serve.speculative import propose
from dflash.train.objective import Objective, build_blocks_batch
from dflash.train.step import StepInputs, drafter_loss, previous_ids, train_head

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


K = 4
MAX_LEN = 128
NEW = 20


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params = load_hf_dir(GOLDEN / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K,
                                         markov_rank=16), target_cfg, mask_token_id=255)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 255, size=n)) for n in (5, 17, 9)]
    return target_cfg, target_params, arch, prompts


def _plain(target_cfg, seed: int) -> DFlashDrafter:
    """The fixture's drafter architecture without a Markov head."""
    return DFlashDrafter(resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 3), block_size=K),
                                         target_cfg, mask_token_id=255), nnx.Rngs(seed))


def _live(arch, seed: int) -> DFlashDrafter:
    """A drafter whose Markov head is not the identity (its down projection drawn at random)."""
    drafter = DFlashDrafter(arch, nnx.Rngs(seed))
    kernel = drafter.markov.down_proj.kernel
    kernel.set_value(jax.random.normal(jax.random.PRNGKey(seed), kernel.get_value().shape) * 0.5)
    return drafter


@pytest.mark.slow
def test_a_new_markov_head_is_plain_dflash(setup):
    """down_proj starts at zero: the same weights without the head propose the same tokens."""
    target_cfg, target_params, arch, prompts = setup
    drafter = DFlashDrafter(arch, nnx.Rngs(3))
    plain = _plain(target_cfg, 3)
    assert drafter.markov is not None and plain.markov is None
    with_head = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(K), drafter=drafter)
    without = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(K), drafter=plain)
    assert [r.accepted for r in with_head] == [r.accepted for r in without]


def test_greedy_dflash_with_a_markov_head_equals_ar(setup):
    target_cfg, target_params, arch, prompts = setup
    ar = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN)
    drafter = _live(arch, 1)
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(K), drafter=drafter)
    assert [r.token_ids for r in results] == [r.token_ids for r in ar]


def test_each_draft_reads_the_one_before_it(setup):
    """propose's slot k depends on the token drafted at slot k-1: changing the head's view of the previous
    token (the anchor) changes later drafts, and the drafts equal a slot-by-slot recomputation."""
    target_cfg, target_params, arch, prompts = setup
    drafter = _live(arch, 2)
    engine = Engine(target_params, target_cfg, drafter, Chain(K), Limits(slots=1, max_len=MAX_LEN))
    engine.submit(prompts[1], NEW)
    engine.step()
    drafts = np.asarray(propose(engine.models, engine.state, K))[0]
    state = engine.state
    ids = jnp.concatenate([state.pending[:, None], jnp.full((1, K - 1), arch.mask_token_id, jnp.int32)], 1)
    positions = state.lengths[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]
    ctx_valid = jnp.arange(state.draft.k.shape[2])[None, :] < state.lengths[:, None]
    hidden = drafter.draft_block(embed(target_params, ids), positions, state.draft.kv(), ctx_valid)
    prev, want = int(state.pending[0]), []
    for slot in range(1, K):
        h = drafter.markov(hidden[:, slot], embed(target_params, jnp.asarray([prev])))
        prev = int(jnp.argmax(drafter_logits(target_params, target_cfg, h), axis=-1)[0])
        want.append(prev)
    assert drafts.tolist() == want


def test_training_reads_the_markov_head_as_the_engine_drafts(setup):
    """Teacher-forced on the engine's own drafts (labels = drafts), the training loss's argmax at every slot is
    the draft: the training forward + `previous_ids` and `propose` are the same function of the same inputs."""
    target_cfg, target_params, arch, prompts = setup
    drafter = _live(arch, 4)
    engine = Engine(target_params, target_cfg, drafter, Chain(K), Limits(slots=1, max_len=MAX_LEN))
    engine.submit(prompts[2], NEW)
    engine.step()
    [request] = engine.running.values()
    drafts = np.asarray(propose(engine.models, engine.state, K))[0]
    committed = request.prompt_ids + request.token_ids  # the last one is pending, at position L
    anchor = len(committed) - 1
    assert anchor == int(engine.state.lengths[0])
    tokens = jnp.asarray([committed + drafts.tolist()], jnp.int32)
    loss_mask = jnp.zeros(tokens.shape, jnp.float32).at[:, anchor:].set(1.0)
    blocks = build_blocks_batch(TrainBatch(tokens=tokens, loss_mask=loss_mask), jnp.asarray([[anchor]]),
                                jnp.asarray([[True]]), K, arch.mask_token_id)
    np.testing.assert_array_equal(previous_ids(blocks, K)[0, 1:], [committed[-1], *drafts[:-1]])
    feats = online_features(target_params, target_cfg, tokens, arch.layer_ids)
    graphdef, params = split_drafter(drafter)
    inputs = StepInputs(blocks=blocks, embeds_BxQxD=embed(target_params, blocks.block_ids), feats_BxSxFD=feats)
    head = train_head(target_params, target_cfg)
    _, metrics = drafter_loss(params, graphdef, inputs, head, target_params, K, Objective())
    np.testing.assert_array_equal(np.asarray(metrics["accuracy_per_position"])[1:], np.ones(K - 1))
    # and without the head's input (a zeroed head) the same drafts are not all reproduced
    zeroed = nnx.clone(drafter)
    zeroed.markov.down_proj.kernel.set_value(jnp.zeros_like(zeroed.markov.down_proj.kernel.get_value()))
    graphdef0, params0 = split_drafter(zeroed)
    _, plain = drafter_loss(params0, graphdef0, inputs, head, target_params, K, Objective())
    assert np.asarray(plain["accuracy_per_position"])[1:].min() < 1.0


def test_markov_rank_is_validated():
    with pytest.raises(ValueError, match="markov_rank"):
        DrafterConfig(markov_rank=-1)


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_the_markov_head_travels_beside_the_layout(setup, tmp_path, layout):
    """Exports keep `markov.*` out of the layout's own weights (loaders that glob `*.safetensors` see a plain
    drafter) in markov_head/model.safetensors; our loaders read it back and decode the same steps."""
    from dflash.models.loading import _safetensors_files
    from dflash.models.speculators import save_speculators
    from dflash.models.zlab import MARKOV_DIR, read_tensors, save_zlab

    target_cfg, target_params, arch, prompts = setup
    drafter = _live(arch, 6)
    directory = tmp_path / layout
    loaded, _ = export_round_trip(drafter, layout, directory, target_cfg, arch)
    assert [p.name for p in _safetensors_files(directory)] == ["model.safetensors"]
    assert not any(name.startswith("markov.") for name in read_tensors(directory))
    assert (directory / MARKOV_DIR / "model.safetensors").is_file() and loaded.arch.markov_rank == arch.markov_rank
    want = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(K), drafter=drafter)
    got = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Chain(K), drafter=loaded)
    assert [r.accepted for r in got] == [r.accepted for r in want]
    # exporting a plain drafter into the same directory removes the stale head
    plain = _plain(target_cfg, 0)
    (save_zlab if layout == "zlab" else lambda d, p: save_speculators(d, p, verifier="tiny"))(plain, directory)
    assert not (directory / MARKOV_DIR / "model.safetensors").exists()
