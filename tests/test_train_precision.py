"""The train step's compute dtype and memory: under bf16 every matmul of the drafter and of the frozen LM head
runs on bf16 operands (read from the jaxpr), and the chunked head keeps temporary memory far below the
[B, N*K, V] logits at the paper's shapes (read from XLA's memory analysis of the compiled step, built
abstractly: nothing is allocated)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import pytest

from dflash.data.batch import BatchLayout, TrainBatch
from dflash.models.config import DecoderConfig, DrafterConfig
from dflash.models.drafter import resolve_drafter
from dflash.train.loop import drafter_graphdef, fresh_state
from dflash.train.objective import Objective
from dflash.train.step import FrozenTarget, StepSpec, make_optimizer, make_train_step, train_head, train_step

QWEN3_VOCAB = 151_936

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


def _target_cfg(vocab: int = 512) -> DecoderConfig:
    return DecoderConfig(family="qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True)


def _abstract_inputs(cfg: DecoderConfig, arch, dtype, b: int, s: int):
    """Abstract (state, offline batch, target params, head) of a step: only the embedding and the untied head
    are read with offline features."""
    optimizer = make_optimizer(1e-3, total_steps=10)
    state = jax.eval_shape(functools.partial(fresh_state, 0, arch, optimizer))
    d, f = cfg.hidden_size, arch.num_features
    batch = TrainBatch.spec(BatchLayout(batch_size=b, seq_len=s, feature_dim=f * d))
    target = {"embed": jax.ShapeDtypeStruct((cfg.vocab_size, d), dtype),
              "lm_head": jax.ShapeDtypeStruct((d, cfg.vocab_size), dtype)}
    return optimizer, state, batch, target, train_head(target, cfg)


def _dot_operand_dtypes(jaxpr) -> Iterator[tuple[str, ...]]:
    """Operand dtypes of every dot_general in `jaxpr` and all its sub-jaxprs (scan, custom_vjp, pjit, ...)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield tuple(str(v.aval.dtype) for v in eqn.invars)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _dot_operand_dtypes(inner)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_matmul_of_the_step_runs_in_the_compute_dtype(dtype):
    cfg = _target_cfg()
    arch = resolve_drafter(DrafterConfig(num_layers=2, num_features=2, layer_ids=(1, 2), block_size=4), cfg,
                           mask_token_id=cfg.vocab_size - 1)
    optimizer, state, batch, target, head = _abstract_inputs(cfg, arch, dtype, b=2, s=32)
    body = functools.partial(train_step, spec=StepSpec(graphdef=drafter_graphdef(arch, dtype), target_cfg=cfg,
                                                       arch=arch, num_anchors=4, objective=Objective(),
                                                       optimizer=optimizer, compute_dtype=dtype))
    frozen = FrozenTarget(params=target, head=head)
    dots = list(_dot_operand_dtypes(jax.make_jaxpr(body)(state, batch, frozen).jaxpr))
    # fc, 2 layers x (q, k, v, o, gate, up, down + 4 attention einsums + context k, v), head: forward and backward
    assert len(dots) >= 2 * (1 + 2 * 13 + 1)
    want = jnp.dtype(dtype).name
    assert all(dt == (want, want) for dt in dots), sorted(set(dots))


def test_chunked_head_memory_does_not_grow_with_block_tokens_times_vocab():
    """At the paper's shapes (S = 3072, N = 512 anchors, K = 16) the [N*K, V] fp32 logits of a Qwen3 vocab
    (V = 151,936) alone are 4.98 GB per sequence. The compiled step with that vocab needs hardly more
    temporary memory than the same step with a 4,096-token vocab: the head's chunks fit in buffers the step
    needs anyway (what remains grows with N*K*S: the drafter's attention scores)."""
    temps = {}
    for vocab in (4096, QWEN3_VOCAB):
        cfg = _target_cfg(vocab)
        arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 2), block_size=16), cfg,
                               mask_token_id=vocab - 1)
        optimizer, state, batch, target, head = _abstract_inputs(cfg, arch, jnp.bfloat16, b=1, s=3072)
        spec = StepSpec(graphdef=drafter_graphdef(arch, jnp.bfloat16), target_cfg=cfg, arch=arch, num_anchors=512,
                        objective=Objective(), optimizer=optimizer, compute_dtype=jnp.bfloat16)
        step = make_train_step(spec, FrozenTarget(params=target, head=head))
        temps[vocab] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = 512 * 16 * QWEN3_VOCAB * 4
    assert temps[QWEN3_VOCAB] - temps[4096] < logits_bytes / 16, (temps, logits_bytes)
    assert temps[QWEN3_VOCAB] < logits_bytes / 2, (temps, logits_bytes)


def test_training_vocab_orders_by_label_count_and_keeps_pinned_tokens():
    import numpy as np

    from dflash.data.examples import training_vocab

    tokens = np.array([5, 5, 5, 7, 7, 9, 3, 3, 3, 3, 0, 0], np.int32)
    mask = np.array([0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0], np.float32)  # labels: 5 x2, 7 x2, 9 x1; 3 only prompt
    examples = [(tokens, mask, 10)]  # the last two tokens are padding
    assert training_vocab(examples, 3, 12).tolist() == [5, 7, 9]
    assert training_vocab(examples, 4, 12).tolist() == [3, 5, 7, 9]  # then by count anywhere
    assert training_vocab(examples, 3, 12, always=(11,)).tolist() == [5, 7, 11]  # pinned first, then 5 and 7
    cfg = _target_cfg(12)
    params = {"embed": jnp.arange(12 * 64, dtype=jnp.float32).reshape(12, 64),
              "lm_head": jnp.arange(64 * 12, dtype=jnp.float32).reshape(64, 12)}
    sub = train_head(params, cfg, [5, 7, 9])
    assert sub.vocab_major
    np.testing.assert_array_equal(np.asarray(sub.matrix), np.asarray(params["lm_head"])[:, [5, 7, 9]].T)
    assert np.asarray(sub.label_map).tolist() == [-1] * 5 + [0, -1, 1, -1, 2, -1, -1]
    full = train_head(params, cfg)  # untied: the LM head itself, [D, V], the target's own array
    assert not full.vocab_major and full.label_map is None and full.matrix is params["lm_head"]
