"""The training loop: target + data + sharded state + jitted step + async checkpoints + metrics.

`run_training(recipe)` is the whole `dflash train` stage:

    target (frozen, cast to compute dtype, placed by TARGET_RULES)
    online:  examples = conversations (packaged GSM8K, or data.dir/regenerated.jsonl) -> chat tokens +
             assistant-only mask; batches = Grain iterator (seeded, per-host slice)   (data.online)
    offline: batches = Grain iterator over data.dir/shards (tokens, mask, stored bf16 features), after
             the manifest is checked against this run's target, tokenizer, layer ids and seq_len
             (data.offline); the same seed gives the same rows in the same order as online mode
    state    = TrainState created sharded by DRAFTER_RULES, or restored from <run_dir>/checkpoints
    loop:    batch -> step (donated state) -> metrics of the PREVIOUS step fetched (the device never
             waits on the host) -> NaN/Inf check -> logs -> async checkpoint every save_every steps
    end:     held-out teacher-forced acceptance on GSM8K test; wait for the last checkpoint

Resume is automatic: when `<run_dir>/checkpoints` holds a checkpoint, the state and the iterator position
are restored and the run continues to `train.steps`. Steps are deterministic functions of (state, batch),
so a run killed at any point and resumed ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from configs.recipe import Recipe
from configs.schema import ConfigError, require, to_dict
from data.examples import build_examples
from data.offline import make_offline_batches
from data.online import make_batches
from data.shards import chat_template_hash, check_manifest, load_manifest
from models.drafter import DFlashDrafter, DrafterArch
from models.target import Target, load_target
from train.checkpoint import Checkpointer
from train.metrics import MetricsWriter, check_finite, read_metrics
from train.objective import default_gamma
from train.sharding import (
    DRAFTER_RULES,
    TARGET_RULES,
    batch_divisor,
    make_mesh,
    place,
    shard_batch,
    tree_shardings,
)
from train.step import TrainState, cast_floats, init_state, make_eval_step, make_optimizer, make_train_step

log = logging.getLogger(__name__)

EVAL_EXAMPLES = 32  # held-out GSM8K test conversations for the final teacher-forced evaluation


@dataclasses.dataclass
class TrainResult:
    """What a run did. `last` / `eval` hold host metrics (floats; lists for per-position values)."""

    run_dir: Path
    arch: DrafterArch
    start_step: int
    final_step: int
    last: dict[str, Any]
    eval: dict[str, Any]
    seconds: float


def arch_dict(arch: DrafterArch) -> dict[str, Any]:
    """The architecture as JSON-able values (recorded in checkpoints and compared on resume)."""
    return json.loads(json.dumps(to_dict(arch)))


def _offline_batches(recipe: Recipe, target: Target, arch: DrafterArch, per_host: int) -> tuple[Any, str]:
    """The Grain iterator over data.dir/shards, after checking the capture against this run (every differing
    field named), and the fingerprint of the stored examples (their manifest's examples_hash)."""
    shard_dir = recipe.data.shard_dir
    manifest = load_manifest(shard_dir, verify=recipe.data.verify_shards)
    check_manifest(manifest, target_fingerprint=target.fingerprint,
                   tokenizer_fingerprint=target.tokenizer.fingerprint(),
                   chat_template_hash=chat_template_hash(target.tokenizer.chat_template), layer_ids=arch.layer_ids,
                   hidden_size=target.cfg.hidden_size, seq_len=recipe.data.seq_len)
    batches = make_offline_batches(shard_dir, per_host, recipe.data.shuffle_seed, recipe.data.seq_len,
                                   shard_index=jax.process_index(), shard_count=jax.process_count(),
                                   worker_count=recipe.data.loader_workers,
                                   skip_bad_records=recipe.data.skip_bad_records)
    log.info("offline features: %d samples, %d tokens in %d shards under %s (%.0f bytes/token)",
             manifest.num_samples, manifest.total_tokens, manifest.num_shards, shard_dir, manifest.bytes_per_token)
    return batches, f"offline:{manifest.examples_hash}"


def _host(tree: Any) -> dict[str, Any]:
    out = {}
    for name, value in jax.device_get(tree).items():
        arr = np.asarray(value, np.float64)
        out[name] = float(arr) if arr.ndim == 0 else arr.tolist()
    return out


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records after `step` (logged by a run that died before its next checkpoint)."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        keep = [r for r in read_metrics(run_dir) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


def _iterator_state(batches: Any) -> dict[str, Any]:
    """The data iterator's state. Orbax writes process 0's copy only, so every host's must be equal (it is:
    each host counts the same number of global batches); checked when there are several processes."""
    state = batches.get_state()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.assert_equal(np.int64(state["next_index"]), "data iterator positions differ across hosts")
    return state


def run_training(recipe: Recipe, *, target: Target | None = None, progress: bool = True) -> TrainResult:
    """Train (or resume) the drafter of `recipe`; see the module docstring."""
    t_start = time.time()
    cfg = recipe.train
    run_dir = Path(cfg.run_dir).expanduser().resolve()
    is_main = jax.process_index() == 0
    target = target if target is not None else load_target(recipe.target)
    arch = target.drafter_arch(recipe.drafter)
    gamma = cfg.gamma or default_gamma(arch.block_size)
    compute_dtype = jnp.dtype(cfg.compute_dtype)

    mesh = make_mesh(cfg.mesh)
    require(cfg.batch_size % batch_divisor(mesh) == 0, "train.batch_size", cfg.batch_size,
            f"be a multiple of mesh data x fsdp = {batch_divisor(mesh)}")
    require(cfg.batch_size % jax.process_count() == 0, "train.batch_size", cfg.batch_size,
            f"be a multiple of the process count {jax.process_count()}")
    target_params = place(cast_floats(target.params, compute_dtype), TARGET_RULES, mesh)

    per_host = cfg.batch_size // jax.process_count()
    if recipe.data.features == "offline":
        batches, data_fp = _offline_batches(recipe, target, arch, per_host)
    else:
        examples, data_fp = build_examples(recipe.data, target.tokenizer)
        batches = make_batches([(t, m) for t, m, _ in examples], per_host, recipe.data.shuffle_seed,
                               shard_index=jax.process_index(), shard_count=jax.process_count())

    optimizer = make_optimizer(cfg.lr, cfg.steps, cfg.warmup_frac, cfg.clip, cfg.weight_decay)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))), nnx.Param)

    def fresh_state() -> TrainState:
        params = nnx.state(DFlashDrafter(arch, nnx.Rngs(params=cfg.seed)), nnx.Param)
        return init_state(params, optimizer, jax.random.PRNGKey(cfg.seed + 1))

    abstract = jax.eval_shape(fresh_state)
    shardings = tree_shardings(abstract, DRAFTER_RULES, mesh)
    meta = {"arch": arch_dict(arch), "recipe": to_dict(recipe), "target_fingerprint": target.fingerprint}
    ckpt = Checkpointer(run_dir / "checkpoints", meta, keep=cfg.keep_checkpoints)
    latest = ckpt.latest_step()
    if latest is None:
        state = jax.jit(fresh_state, out_shardings=shardings)()
        if is_main:
            _truncate_metrics(run_dir, 0)  # records of a run killed before its first checkpoint
    else:
        state, data_state = ckpt.restore(latest, abstract, shardings)
        if data_state.get("data_fingerprint") != data_fp:
            raise ConfigError(f"checkpoint step {latest} in {ckpt.directory} was trained on other data (its "
                              "examples hash differs: data or the tokenizer changed); resume with the same "
                              "data settings or use a new train.run_dir")
        batches.set_state(data_state["iterator"])
        if is_main:
            _truncate_metrics(run_dir, latest)
        log.info("resumed %s from step %d", run_dir, latest)
    start = int(jax.device_get(state.step))

    step_fn = make_train_step(graphdef=graphdef, target_params=target_params, target_cfg=target.cfg, arch=arch,
                              num_anchors=cfg.num_anchors, gamma=gamma, optimizer=optimizer,
                              compute_dtype=compute_dtype, state_shardings=shardings)
    writer = MetricsWriter(run_dir, config=to_dict(recipe), wandb_mode=cfg.wandb, tensorboard=cfg.tensorboard,
                           enabled=is_main)
    block_tokens = cfg.batch_size * cfg.num_anchors * arch.block_size
    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress and is_main), unit="step",
               dynamic_ncols=True, desc="train")
    last: dict[str, Any] = {}
    pending: tuple[int, Any] | None = None
    window: list[tuple[float, int]] = []

    def finish(step: int, device_metrics: Any) -> None:
        nonlocal last
        metrics = _host(device_metrics)
        check_finite(metrics, step)
        last = metrics
        now = time.time()
        window.append((now, step))
        del window[:-20]
        if len(window) > 1:
            (t0, s0), (t1, s1) = window[0], window[-1]
            metrics["block_tokens_per_s"] = (s1 - s0) * block_tokens / max(t1 - t0, 1e-9)
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['acceptance_length']:.2f}",
                        tok_s=f"{metrics.get('block_tokens_per_s', 0):.0f}", refresh=False)
        if step % cfg.log_every == 0 or step == cfg.steps:
            writer.write(step, metrics)

    try:
        for step in range(start + 1, cfg.steps + 1):
            batch = shard_batch(next(batches), mesh)
            state, metrics = step_fn(state, batch)
            if pending is not None:
                finish(*pending)
            pending = (step, metrics)
            if step % cfg.save_every == 0 or step == cfg.steps:
                finish(*pending)  # never checkpoint a state whose step went non-finite
                pending = None
                ckpt.save(step, state, {"iterator": _iterator_state(batches), "data_fingerprint": data_fp})
        if pending is not None:
            finish(*pending)
        eval_metrics = evaluate(recipe, target, arch, graphdef, state.params, target_params, gamma, compute_dtype,
                                mesh)
        if eval_metrics and is_main:
            writer.write(cfg.steps, {f"eval/{k}": v for k, v in eval_metrics.items()})
    finally:
        bar.close()
        ckpt.close()
        writer.close()
        if hasattr(batches, "close"):
            batches.close()  # offline loader: stop its worker processes
    return TrainResult(run_dir=run_dir, arch=arch, start_step=start, final_step=int(jax.device_get(state.step)),
                       last=last, eval=eval_metrics, seconds=time.time() - t_start)


def evaluate(recipe: Recipe, target: Target, arch: DrafterArch, graphdef: nnx.GraphDef, params: Any,
             target_params: Any, gamma: float, compute_dtype: Any, mesh: Any) -> dict[str, Any]:
    """Teacher-forced metrics on the first EVAL_EXAMPLES GSM8K test conversations (fixed anchors)."""
    cfg = recipe.train
    examples, _ = build_examples(recipe.data, target.tokenizer, split="test", limit=EVAL_EXAMPLES)
    unit = math.lcm(batch_divisor(mesh), jax.process_count())  # same global rows whatever the process count
    rows = len(examples) // unit * unit // jax.process_count()
    if rows == 0:
        return {}
    eval_step = make_eval_step(graphdef=graphdef, target_params=target_params, target_cfg=target.cfg, arch=arch,
                               num_anchors=cfg.num_anchors, gamma=gamma, compute_dtype=compute_dtype)
    mine = examples[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    batch = {"tokens": np.stack([t for t, _, _ in mine]), "loss_mask": np.stack([m for _, m, _ in mine])}
    return _host(eval_step(params, shard_batch(batch, mesh), jax.random.PRNGKey(1234)))


__all__ = ["TrainResult", "arch_dict", "evaluate", "run_training"]
