"""The training batch: one typed pytree that the loaders produce (`data.online`, `data.offline`), the train step
reads, `dflash launch compile` builds abstractly (`TrainBatch.spec`) and the tests construct.

    TrainBatch(tokens [B, S] int32, loss_mask [B, S] f32,
               features [B, S, F*D] bf16 | None,        offline: the target's stored layer features
               segment_ids [B, S] int32 | None,         packed rows: the conversation of each position (0 = padding)
               labels None | TargetLabels | SoftLabels,  what block slots are labelled with (`data.labels`)
               walk [B, S] f32 | None)                  serving-walk anchor weights (`data.walk`)

A new training option is one field here and one branch where it is read. `BatchLayout` is the static description
of a run's batches (sizes and which optional parts exist); `TrainBatch.spec(layout)` gives the abstract batch and
`TrainBatch.check(layout)` compares a batch with it at trace time, naming the field, the shape it must have and
the one it has. Inside `build_blocks` the same type holds one row (every field without its leading B).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LABEL_KINDS = ("text", "target", "soft")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetLabels:
    """`data.labels: target`: the target's own greedy next token after each position.

    next_ids int32 [B, S]: next_ids[p] is the target's pick after tokens[:p+1]; -1 where unknown (padding).
    """

    next_ids: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SoftLabels:
    """`data.labels: soft`: the target's T most likely next tokens after each position and their probabilities.

    next_ids int32 [B, S]: the argmax (as `TargetLabels`); ids int32 [B, S, T]; probs f32 [B, S, T] (0 on padding).
    """

    next_ids: Any
    ids: Any
    probs: Any


Labels = TargetLabels | SoftLabels | None


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The static shape of a run's batches: `batch_size` rows of `seq_len` tokens (`data.pack` when rows are
    packed), stored features of width `feature_dim` (0: online, the step computes them), `labels` one of
    LABEL_KINDS with `soft_topk` tokens per position for `soft`, `packed` rows carrying segment ids."""

    batch_size: int
    seq_len: int
    feature_dim: int = 0
    labels: str = "text"
    soft_topk: int = 0
    packed: bool = False
    walk: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1; received {self.batch_size} and {self.seq_len}")
        if self.labels not in LABEL_KINDS:
            raise ValueError(f"labels must be one of {LABEL_KINDS}; received {self.labels!r}")
        if (self.labels == "soft") != (self.soft_topk > 0):
            raise ValueError(f"soft_topk must be > 0 exactly when labels is 'soft'; received labels={self.labels!r}, "
                             f"soft_topk={self.soft_topk}")
        if self.feature_dim < 0:
            raise ValueError(f"feature_dim must be >= 0 (0: online features); received {self.feature_dim}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One batch of B rows of S tokens (numpy on the host, global jax.Arrays in the step); see the module doc.

    tokens       int32 [B, S]
    loss_mask    f32   [B, S]    1 on assistant tokens (the positions anchors and labels may use)
    features     bf16  [B, S, F*D] or None  the target's features at the drafter's layer ids (offline mode)
    segment_ids  int32 [B, S] or None  packed rows: 1, 2, ... per conversation in the row, 0 on the padding tail
    labels       None (the text's own tokens) | TargetLabels | SoftLabels
    walk         f32 [B, S] or None  `data.walk`: > 0 at the block starts greedy serving visits (the weight of that
                 position as a walk anchor, `data.walk.walk_weights`), 0 elsewhere; read by `sample_anchors`
    """

    tokens: Any
    loss_mask: Any
    features: Any = None
    segment_ids: Any = None
    labels: Labels = None
    walk: Any = None

    @property
    def label_kind(self) -> str:
        """'text', 'target' or 'soft'."""
        return {type(None): "text", TargetLabels: "target", SoftLabels: "soft"}[type(self.labels)]

    @property
    def next_ids(self) -> Any:
        """The target's next tokens (target or soft labels), else None."""
        return None if self.labels is None else self.labels.next_ids

    def layout(self) -> BatchLayout:
        """The layout this batch has (from its shapes and which parts it holds)."""
        b, s = np.shape(self.tokens)
        return BatchLayout(batch_size=b, seq_len=s,
                           feature_dim=0 if self.features is None else int(np.shape(self.features)[-1]),
                           labels=self.label_kind,
                           soft_topk=int(np.shape(self.labels.ids)[-1]) if isinstance(self.labels, SoftLabels) else 0,
                           packed=self.segment_ids is not None, walk=self.walk is not None)

    @classmethod
    def spec(cls, layout: BatchLayout, sharding: Any = None) -> TrainBatch:
        """The abstract batch of `layout` (`jax.ShapeDtypeStruct`s); `sharding(ndim)`, when given, gives each
        array's sharding (e.g. `train.sharding.batch_sharding` over a mesh)."""
        b, s = layout.batch_size, layout.seq_len

        def arr(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=None if sharding is None else sharding(len(shape)))

        labels: Labels = None
        if layout.labels == "target":
            labels = TargetLabels(next_ids=arr((b, s), jnp.int32))
        elif layout.labels == "soft":
            t = layout.soft_topk
            labels = SoftLabels(next_ids=arr((b, s), jnp.int32), ids=arr((b, s, t), jnp.int32),
                                probs=arr((b, s, t), jnp.float32))
        return cls(tokens=arr((b, s), jnp.int32), loss_mask=arr((b, s), jnp.float32),
                   features=arr((b, s, layout.feature_dim), jnp.bfloat16) if layout.feature_dim else None,
                   segment_ids=arr((b, s), jnp.int32) if layout.packed else None, labels=labels,
                   walk=arr((b, s), jnp.float32) if layout.walk else None)

    def check(self, layout: BatchLayout | None = None) -> TrainBatch:
        """Raise ValueError unless every array has its field's shape and dtype (those of `layout`, when given,
        else of this batch's own layout: all [B, S] fields agree); works on numpy arrays, jax arrays and tracers
        (the train step calls it while tracing). Returns the batch."""
        want = self.spec(layout or self.layout())
        have_kind, want_kind = self.label_kind, want.label_kind
        if have_kind != want_kind:
            raise ValueError(f"batch.labels must be {want_kind} labels; received {have_kind} labels")
        for (path, expected), actual in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                                            _leaves_like(self, want), strict=True):
            name = "batch." + ".".join(str(getattr(k, "name", k)) for k in path)
            if actual is None:
                raise ValueError(f"{name} must be an array of shape {list(expected.shape)}; received None")
            shape, dtype = tuple(np.shape(actual)), jnp.result_type(actual)
            if shape != expected.shape or dtype != expected.dtype:
                raise ValueError(f"{name} must be {expected.dtype.name} {list(expected.shape)}; received "
                                 f"{dtype.name} {list(shape)}")
        extra = [f for f in ("features", "segment_ids", "walk")
                 if getattr(want, f) is None and getattr(self, f) is not None]
        if extra:
            raise ValueError(f"batch.{extra[0]} must be None for this layout; received an array")
        return self

    def map(self, fn: Any) -> TrainBatch:
        """This batch with `fn` applied to every array (e.g. a row slice)."""
        return jax.tree.map(fn, self)


def _leaves_like(batch: TrainBatch, like: TrainBatch) -> list[Any]:
    """The arrays of `batch` at the paths of `like`'s leaves (None where `batch` has no such part)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]:
        node: Any = batch
        for key in path:
            node = getattr(node, key.name, None) if node is not None else None
        out.append(node)
    return out


def batch_layout(data: Any, batch_size: int, feature_dim: int) -> BatchLayout:
    """The layout of the batches `data` (a `data.config.DataConfig`) makes with `batch_size` rows, the drafter's
    features being `feature_dim` wide (F*D; stored only in offline mode)."""
    return BatchLayout(batch_size=batch_size, seq_len=data.pack or data.seq_len,
                       feature_dim=feature_dim if data.features == "offline" else 0, labels=data.labels,
                       soft_topk=data.soft_topk if data.labels == "soft" else 0, packed=bool(data.pack),
                       walk=bool(data.walk))


__all__ = ["LABEL_KINDS", "BatchLayout", "Labels", "SoftLabels", "TargetLabels", "TrainBatch", "batch_layout"]
