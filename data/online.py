"""The online-mode input pipeline: conversations -> fixed-length token rows -> a Grain batch iterator.

Online mode runs the frozen target inside the train step, so a batch is only tokens and the assistant-only
loss mask (docs/design.md §4.2): a `data.batch.TrainBatch` of tokens int32 [B, S] and loss_mask float32 [B, S].

    examples -> shuffle(seed) -> repeat -> global batch (B * hosts) -> this host's rows      (`make_batches`)

The offline pipeline (`data.offline`) makes the same batches from stored features. The Grain behaviour
this relies on: docs/decisions.md D12.
"""

from __future__ import annotations

import grain
import numpy as np

from dflash.data.batch import TrainBatch

# (tokens int32[S], loss_mask float32[S]) per example, all with the same S.
TokenizedExamples = list[tuple[np.ndarray, np.ndarray]]


def make_batches(
    examples: TokenizedExamples,
    batch_size: int,
    seed: int,
    *,
    shard_index: int = 0,
    shard_count: int = 1,
    walk: list[np.ndarray] | None = None,
) -> grain.DatasetIterator:
    """An endless iterator of `TrainBatch(tokens int32 [B, S], loss_mask float32 [B, S])` for this host.

    The chain, each step a Grain `MapDataset` transform: `source(examples)` -> `.shuffle(seed)` (a global
    permutation; each epoch a different one) -> `.repeat()` (infinite; element e * n + i is epoch e,
    position i) -> `.map(_to_arrays)` -> `.batch(B * shard_count, drop_remainder=True)` (the GLOBAL
    batch) -> `.map(_to_batch)` -> host i keeps its rows [i*B, (i+1)*B) -> `.to_iter_dataset` (synchronous,
    deterministic).
    A batch may straddle an epoch boundary (no example is dropped or duplicated within an epoch), and the
    global batch, hence training, is the same whatever the number of hosts.

    `get_state()` / `set_state()` resume the exact batch sequence; the state is `{"next_index": int}` (the
    number of batches returned, plain JSON). It does not identify the pipeline: restoring it into one
    built with another seed, batch size, sharding or example list silently gives other data, so
    checkpoint the data config beside it.

    `walk` (`data.walk`): one f32 [S] array of serving-walk anchor weights per example; the batches then hold them
    as `TrainBatch.walk`.
    """
    if not examples:
        raise ValueError("examples must hold at least one example; received none (were all of them skipped?)")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0; received {batch_size}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32) (grain's shuffle seed); received {seed}")
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise ValueError(
            f"shard_index must be in [0, shard_count) with shard_count > 0; "
            f"received shard_index={shard_index}, shard_count={shard_count}"
        )
    seq_lens = {tokens.shape for tokens, _ in examples} | {mask.shape for _, mask in examples}
    if len(seq_lens) != 1:
        raise ValueError(f"examples must all have one shape [S]; received shapes {sorted(seq_lens)}")

    if walk is not None and len(walk) != len(examples):
        raise ValueError(f"walk must hold one weight row per example ({len(examples)}); received {len(walk)}")
    dataset = grain.MapDataset.source(examples if walk is None else [(*e, w) for e, w in zip(examples, walk,
                                                                                            strict=True)])
    dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat()
    dataset = dataset.map(_to_arrays)
    dataset = dataset.batch(batch_size * shard_count, drop_remainder=True)
    dataset = dataset.map(_to_batch)
    if shard_count > 1:
        rows = slice(shard_index * batch_size, (shard_index + 1) * batch_size)
        dataset = dataset.map(lambda batch: batch.map(lambda x: x[rows]))
    iter_dataset = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return iter(iter_dataset)


def _to_arrays(example: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    tokens_S, loss_mask_S, *walk_S = example
    return (np.asarray(tokens_S, np.int32), np.asarray(loss_mask_S, np.float32),
            *(np.asarray(w, np.float32) for w in walk_S))


def _to_batch(stacked: tuple[np.ndarray, ...]) -> TrainBatch:
    tokens_BxS, loss_mask_BxS, *walk_BxS = stacked
    return TrainBatch(tokens=tokens_BxS, loss_mask=loss_mask_BxS, walk=walk_BxS[0] if walk_BxS else None)
