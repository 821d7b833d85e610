"""The typed training batch (data/batch.py): one layout, written once (`TrainBatch.spec`), that the loaders
fill, the train step checks while tracing, and AOT compile builds."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from dflash.data.batch import BatchLayout, SoftLabels, TargetLabels, TrainBatch, batch_layout
from dflash.data.offline import PackAndStack, PadAndStack
from dflash.data.records import BF16, Sample

LAYOUTS = [
    BatchLayout(batch_size=2, seq_len=16),
    BatchLayout(batch_size=2, seq_len=16, feature_dim=8),
    BatchLayout(batch_size=2, seq_len=16, feature_dim=8, labels="target"),
    BatchLayout(batch_size=2, seq_len=16, feature_dim=8, labels="soft", soft_topk=3, packed=True),
]


def _host(spec: TrainBatch) -> TrainBatch:
    """Zeros of every array of `spec` (host numpy, as the loaders make them)."""
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), spec)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.labels}-f{lay.feature_dim}-p{int(lay.packed)}")
def test_spec_layout_and_check_agree(layout: BatchLayout) -> None:
    spec = TrainBatch.spec(layout)
    assert spec.layout() == layout
    batch = _host(spec)
    assert batch.check(layout) is batch and batch.layout() == layout
    assert batch.label_kind == layout.labels
    assert (batch.next_ids is None) == (layout.labels == "text")
    # a batch of one layout is refused under another, naming what differs
    other = dataclasses.replace(layout, seq_len=8)
    with pytest.raises(ValueError, match=r"batch.tokens must be int32 \[2, 8\]; received int32 \[2, 16\]"):
        batch.check(other)


def test_check_names_the_field_the_shape_and_the_dtype() -> None:
    layout = BatchLayout(batch_size=2, seq_len=16, feature_dim=8, labels="soft", soft_topk=3)
    good = _host(TrainBatch.spec(layout))
    wrong_dtype = dataclasses.replace(good, features=np.zeros((2, 16, 8), np.float32))
    with pytest.raises(ValueError, match=r"batch.features must be bfloat16 \[2, 16, 8\]; received float32"):
        wrong_dtype.check(layout)
    wrong_k = dataclasses.replace(good, labels=dataclasses.replace(good.labels, probs=np.zeros((2, 16, 4), np.float32)))
    with pytest.raises(ValueError, match=r"labels.probs must be float32 \[2, 16, 3\]; received float32 \[2, 16, 4\]"):
        wrong_k.check(layout)
    with pytest.raises(ValueError, match="batch.labels must be soft labels; received target labels"):
        dataclasses.replace(good, labels=TargetLabels(next_ids=good.next_ids)).check(layout)
    with pytest.raises(ValueError, match="batch.segment_ids must be None for this layout"):
        dataclasses.replace(good, segment_ids=np.zeros((2, 16), np.int32)).check(layout)
    # without a layout, the batch is checked against its own shapes: every [B, S] field agrees
    with pytest.raises(ValueError, match=r"batch.loss_mask must be float32 \[2, 16\]; received float32 \[2, 15\]"):
        dataclasses.replace(good, loss_mask=np.zeros((2, 15), np.float32)).check()


def test_layout_rules() -> None:
    with pytest.raises(ValueError, match="labels must be one of"):
        BatchLayout(batch_size=1, seq_len=4, labels="hard")
    with pytest.raises(ValueError, match="soft_topk must be > 0 exactly when labels is 'soft'"):
        BatchLayout(batch_size=1, seq_len=4, labels="soft")
    with pytest.raises(ValueError, match="soft_topk must be > 0 exactly when labels is 'soft'"):
        BatchLayout(batch_size=1, seq_len=4, soft_topk=2)


def test_a_recipe_has_one_layout() -> None:
    from dflash.configs.recipe import load_recipe

    data = load_recipe("smollm2").data  # packed rows, offline features
    layout = batch_layout(data, 8, 2880)
    assert layout == BatchLayout(batch_size=8, seq_len=data.pack, feature_dim=2880, packed=True)
    online = load_recipe("tiny").data
    assert batch_layout(online, 4, 2880) == BatchLayout(batch_size=4, seq_len=online.seq_len)


def test_the_loaders_fill_the_layouts_spec() -> None:
    """The offline transforms allocate exactly `TrainBatch.spec(layout)`, padded and packed."""
    rng = np.random.default_rng(0)

    def sample(n: int) -> Sample:
        return Sample(tokens=rng.integers(1, 9, n).astype(np.int32), loss_mask=np.ones(n, np.uint8),
                      features=rng.normal(size=(n, 8)).astype(BF16), next_ids=np.arange(n, dtype=np.int32),
                      topk_ids=np.zeros((n, 3), np.int32), topk_probs=np.full((n, 3), 1 / 3, np.float16))

    padded = BatchLayout(batch_size=2, seq_len=16, feature_dim=8, labels="soft", soft_topk=3)
    batch, bad = PadAndStack(seq_len=16, pad_id=0, layout=padded).map([sample(5), None])
    assert bad == 1 and batch.check(padded) is batch
    assert isinstance(batch.labels, SoftLabels) and (batch.next_ids[0, 5:] == -1).all() and not batch.tokens[1].any()
    packed = dataclasses.replace(padded, seq_len=32, packed=True)
    batch, bad = PackAndStack(seq_len=16, pad_id=0, layout=packed).map([[sample(5), sample(9)], [sample(16)]])
    assert bad == 0 and batch.check(packed) is batch
    assert batch.segment_ids[0, :14].tolist() == [1] * 5 + [2] * 9 and not batch.segment_ids[0, 14:].any()


def test_the_train_step_refuses_a_batch_of_another_width_while_tracing(golden_dir) -> None:
    from dflash.models.drafter import DrafterConfig, resolve_drafter
    from dflash.models.loading import load_hf_dir
    from dflash.train.loop import drafter_graphdef, fresh_state
    from dflash.train.objective import Objective
    from dflash.train.step import FrozenTarget, StepSpec, make_optimizer, train_head, train_step

    cfg, params = load_hf_dir(golden_dir / "tiny" / "qwen3_untied")
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=4), cfg,
                           mask_token_id=255)
    optimizer = make_optimizer(1e-3, total_steps=4)
    state = jax.eval_shape(functools.partial(fresh_state, 0, arch, optimizer))
    step = functools.partial(train_step, spec=StepSpec(graphdef=drafter_graphdef(arch), target_cfg=cfg, arch=arch,
                                                       num_anchors=4, objective=Objective(), optimizer=optimizer))
    frozen = FrozenTarget(params=params, head=train_head(params, cfg))
    width = arch.num_features * arch.hidden_size
    good = TrainBatch.spec(BatchLayout(batch_size=2, seq_len=16, feature_dim=width))
    _, metrics = jax.eval_shape(step, state, good, frozen)
    assert metrics["loss"].shape == ()
    bad = TrainBatch.spec(BatchLayout(batch_size=2, seq_len=16, feature_dim=width // 2))
    with pytest.raises(ValueError, match=rf"batch.features must be bfloat16 \[2, 16, {width}\]"):
        jax.eval_shape(step, state, bad, frozen)
