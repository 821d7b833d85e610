"""The training loop: the whole `dflash train` stage, `run_training(recipe)`, in three parts.

`build_run` loads what a run trains against (target read straight onto the mesh, each device its share; batches,
optimizer, drafter graph);
`create_or_restore_state` creates the sharded TrainState or resumes it from `<run_dir>/checkpoints`;
`train_loop` steps, logs and checkpoints, and every `train.eval_every` steps measures real τ with the engine
(`train.real_eval`: keeps `<run_dir>/best/`). Mechanics and the resume guarantees: docs/decisions.md D9/D10.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from dflash.configs.recipe import Recipe, check_train_data
from dflash.configs.schema import ConfigError, require, to_dict
from dflash.data.batch import TrainBatch, batch_layout
from dflash.data.capture import examples_hash as capture_examples_hash
from dflash.data.config import DataConfig
from dflash.data.examples import build_examples, training_vocab
from dflash.data.manifest import ExpectedFeatures, chat_template_hash, check_manifest, load_manifest
from dflash.data.offline import HostShare, ReadOptions, make_offline_batches
from dflash.data.online import make_batches
from dflash.data.progress import Progress
from dflash.data.walk import find_walk, load_walk, walk_weights
from dflash.models.config import DecoderConfig
from dflash.models.drafter import DFlashDrafter, DrafterArch, DraftVocab
from dflash.models.placement import log_memory_per_device
from dflash.models.target import Target, load_target
from dflash.train.checkpoint import Checkpointer
from dflash.train.config import TrainConfig
from dflash.train.metrics import MetricsWriter, check_finite, read_metrics
from dflash.train.objective import Objective, default_gamma
from dflash.train.preemption import Preempted, PreemptionWatch
from dflash.train.real_eval import RealTauEval
from dflash.train.sharding import (
    DRAFTER_RULES,
    TARGET_RULES,
    batch_divisor,
    head_rules,
    make_mesh,
    place,
    shard_batch,
    tree_shardings,
)
from dflash.train.step import (
    FrozenTarget,
    StepSpec,
    TrainState,
    init_state,
    make_eval_step,
    make_optimizer,
    make_train_step,
    train_head,
)

log = logging.getLogger(__name__)

EVAL_EXAMPLES = 32  # held-out GSM8K test conversations for the final teacher-forced evaluation
THROUGHPUT_WINDOW = 20  # finished steps over which block tokens/s is measured


@dataclasses.dataclass
class TrainResult:
    """What a run did. `last` / `eval` hold host metrics (floats; lists for per-position values); `best` is
    `<run_dir>/best/best.json` (the best drafter by real τ) or None when none was kept."""

    run_dir: Path
    arch: DrafterArch
    start_step: int
    final_step: int
    last: dict[str, Any]
    eval: dict[str, Any]
    seconds: float
    best: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """What a run trains against (`build_run`): the frozen target (`frozen`: its params cast to the compute dtype
    and placed by TARGET_RULES, and the head the loss runs through, the target's or a training vocabulary's
    rows), the step's static spec (`spec`: the drafter's architecture and graph, the loss, the optimizer), the
    mesh, this host's batch iterator and the fingerprint of its data (checked on resume)."""

    target: Target
    frozen: FrozenTarget
    spec: StepSpec
    mesh: Mesh
    batches: Any
    data_fingerprint: str
    draft_vocab: DraftVocab | None = None  # train.head_vocab's tokens: the drafter proposes over these at serving

    @property
    def arch(self) -> DrafterArch:
        return self.spec.arch


def arch_dict(arch: DrafterArch) -> dict[str, Any]:
    """The architecture as JSON-able values (recorded in checkpoints and compared on resume)."""
    return json.loads(json.dumps(to_dict(arch)))


READ = ReadOptions()  # stored features read in this process, bad records stopping the run, sizes checked

def run_training(recipe: Recipe, *, target: Target | None = None, progress: bool = True,
                 read: ReadOptions = READ) -> TrainResult:
    """Train (or resume) the drafter of `recipe` (stored features read by `read`); see the module docstring."""
    t_start = time.time()
    cfg = recipe.train
    run_dir = _run_dir(cfg)
    is_main = jax.process_index() == 0
    target = target if target is not None else load_target(recipe.target)
    run = build_run(cfg, recipe.data, target, target.drafter_arch(recipe.drafter), read)
    meta = {"arch": arch_dict(run.arch), "recipe": to_dict(recipe), "target_fingerprint": target.fingerprint}
    if run.draft_vocab is not None:
        meta["draft_vocab"] = run.draft_vocab.ids.tolist()
    real_eval = RealTauEval(cfg, target, drafter_graphdef(run.arch), run_dir, run.draft_vocab,  # every process
                            template_kwargs=recipe.data.regen.template_kwargs, run_meta=meta)
    ckpt = Checkpointer(run_dir / "checkpoints", meta, keep=cfg.keep_checkpoints)
    state, shardings, start = create_or_restore_state(cfg, run.arch, run.spec.optimizer, run.mesh, ckpt,
                                                      run.batches, run.data_fingerprint, target)
    log_memory_per_device("train")  # the target's share, the head and the sharded state, before the first step
    writer = MetricsWriter(run_dir, config=to_dict(recipe), wandb_mode=cfg.wandb,
                           enabled=is_main)
    metrics = StepMetrics(cfg, writer, block_tokens=cfg.batch_size * cfg.num_anchors * run.arch.block_size,
                          start=start, show=progress and is_main)
    try:
        state = train_loop(cfg, run, state, shardings, start, ckpt, metrics, real_eval)
        eval_metrics = evaluate(recipe.data, cfg.num_anchors, run, state.params)
        if eval_metrics and is_main:
            writer.write(cfg.steps, {f"eval/{k}": v for k, v in eval_metrics.items()})
    finally:
        metrics.close()
        ckpt.close()
        writer.close()
        if hasattr(run.batches, "close"):
            run.batches.close()  # offline loader: stop its worker processes
    return TrainResult(run_dir=run_dir, arch=run.arch, start_step=start, final_step=int(jax.device_get(state.step)),
                       last=metrics.last, eval=eval_metrics, seconds=time.time() - t_start,
                       best=real_eval.best)


# --- build -------------------------------------------------------------------------------------------------


def build_run(cfg: TrainConfig, data: DataConfig, target: Target, arch: DrafterArch,
              read: ReadOptions = READ) -> TrainRun:
    """The mesh of `train.mesh` (the global batch size checked against it), the target placed on it in the
    compute dtype, this host's batches of `data`, and the step's spec (`step_spec`)."""
    spec = step_spec(cfg, arch, target.cfg)
    check_train_data(cfg, data)  # the recipe's cross-section rules, for callers that pass sections
    if target.cfg.num_layers - 1 in arch.layer_ids:
        log.warning("drafter.layer_ids %s include the target's last layer %d: vLLM and SGLang feed HF "
                    "hidden_states[L], which is post-final-norm, while this trainer uses the pre-norm output; "
                    "dflash-export refuses such a drafter", arch.layer_ids, target.cfg.num_layers - 1)
    mesh = make_mesh(cfg.mesh)
    log.info("train mesh %s over %d devices of %d process(es)", " x ".join(f"{k}={v}" for k, v in mesh.shape.items()),
             mesh.size, jax.process_count())
    require(cfg.batch_size % batch_divisor(mesh) == 0, "train.batch_size", cfg.batch_size,
            f"be a multiple of mesh data x fsdp = {batch_divisor(mesh)}")
    require(cfg.batch_size % jax.process_count() == 0, "train.batch_size", cfg.batch_size,
            f"be a multiple of the process count {jax.process_count()}")
    target_params = target.on(mesh, TARGET_RULES, spec.compute_dtype)  # each device reads its share, nothing else
    examples = build_examples(data, target.tokenizer) if cfg.head_vocab or data.features == "online" else None
    vocab, ids = None, None
    if cfg.head_vocab:
        ids = init_vocab(cfg.init_from, target) if cfg.init_from else None
        if ids is None:
            ids = training_vocab(examples[0], min(cfg.head_vocab, target.cfg.vocab_size), target.cfg.vocab_size,
                                 tuple(target.tokenizer.stop_token_ids))
        vocab = DraftVocab(np.asarray(ids)) if len(ids) < target.cfg.vocab_size else None
        log.info("training vocabulary: %d of %d tokens", len(ids), target.cfg.vocab_size)
    head = train_head(target_params, target.cfg, ids)
    head = place(head, head_rules(head.vocab_major), mesh)
    batches, data_fingerprint = build_batches(data, target, arch, cfg.batch_size // jax.process_count(), seed=cfg.seed,
                                              examples=examples, walk_power=cfg.walk_oversample, read=read)
    return TrainRun(target=target, frozen=FrozenTarget(params=target_params, head=head), spec=spec, mesh=mesh,
                    batches=batches, data_fingerprint=data_fingerprint, draft_vocab=vocab)


def build_batches(data: DataConfig, target: Target, arch: DrafterArch, per_host: int, *, seed: int = 0,
                  examples: tuple[list[Any], str] | None = None, walk_power: float = 0.0,
                  read: ReadOptions = READ) -> tuple[Any, str]:
    """This host's Grain iterator of `per_host`-row batches and the data fingerprint: online (conversations
    tokenised with the target's chat template; `examples`, when given, is `build_examples`' result, not
    rebuilt) or offline (stored features, `data.features`). With `data.walk`, the batches carry the serving
    walk's anchor weights ((K - accepted)^walk_power at its block starts; `walk_anchor_weights`). seed: the
    loader's shuffle (`train.seed`, each epoch a different permutation); read: how stored features are read."""
    if data.features == "offline":
        return _offline_batches(data, target, arch, per_host, seed, walk_power, read)
    examples, fingerprint = examples if examples is not None else build_examples(data, target.tokenizer)
    walk, walk_tag = None, ""
    if data.walk:
        weights, walk_tag = walk_anchor_weights(data, capture_examples_hash(examples), len(examples), arch, walk_power)
        walk = [weights.get(i, np.zeros(data.seq_len, np.float32)) for i in range(len(examples))]
    batches = make_batches([(t, m) for t, m, _ in examples], per_host, seed,
                           shard_index=jax.process_index(), shard_count=jax.process_count(), walk=walk)
    return batches, fingerprint + walk_tag


def walk_anchor_weights(data: DataConfig, examples_hash: str, num_examples: int, arch: DrafterArch,
                        power: float) -> tuple[dict[int, np.ndarray], str]:
    """The serving walk of `data.walk` for these rows (checked by their examples hash and count) as anchor weights
    f32 [seq_len] by row index (`data.walk.walk_weights`), and the tag it adds to the data fingerprint (a resume
    with another walk or weighting is refused)."""
    meta = find_walk(data.dir, data.walk, examples_hash)
    records = load_walk(meta, examples_hash, num_examples)
    blocks = sum(len(r.starts) for r in records.values())
    log.info("serving walk %s: %d rows, %d block starts (%d rows whose decode left the stored answer)", meta,
             len(records), blocks, sum(r.mismatch for r in records.values()))
    weights = {i: walk_weights(r, data.seq_len, arch.block_size, power) for i, r in records.items()}
    return weights, f":walk-{meta.name.removesuffix('.meta.json')}-p{power:g}"


def _offline_batches(data: DataConfig, target: Target, arch: DrafterArch, per_host: int, seed: int,
                     walk_power: float, read: ReadOptions) -> tuple[Any, str]:
    """The Grain iterator over data.dir/shards, after checking the capture against this run (every differing
    field named), and the fingerprint of the stored examples (their manifest's examples_hash)."""
    shard_dir = data.shard_dir
    manifest = load_manifest(shard_dir, verify=read.verify)
    check_manifest(manifest, ExpectedFeatures(
        target_fingerprint=target.fingerprint, tokenizer_fingerprint=target.tokenizer.fingerprint(),
        chat_template_hash=chat_template_hash(target.tokenizer.chat_template), layer_ids=arch.layer_ids,
        hidden_size=target.cfg.hidden_size, seq_len=data.seq_len, target_labels=True if data.labels != "text" else None,
        target_topk=data.soft_topk if data.labels == "soft" else None))
    width = arch.num_features * arch.hidden_size  # stored features, whatever data.features says of training
    layout = dataclasses.replace(batch_layout(data, per_host, width), feature_dim=width)
    walk, walk_tag = None, ""
    if data.walk:
        walk, walk_tag = walk_anchor_weights(data, manifest.examples_hash, manifest.num_samples, arch, walk_power)
    batches = make_offline_batches(shard_dir, layout, seed, seq_len=data.seq_len,
                                   host=HostShare(jax.process_index(), jax.process_count()),
                                   worker_count=read.workers, skip_bad_records=read.skip_bad_records,
                                   walk=walk)
    log.info("offline features: %d samples, %d tokens in %d shards under %s (%.0f bytes/token)",
             manifest.num_samples, manifest.total_tokens, manifest.num_shards, shard_dir, manifest.bytes_per_token)
    labels = {"text": "", "target": ":target-labels", "soft": f":soft-labels-{data.soft_topk}"}[data.labels]
    return batches, (f"offline:{manifest.examples_hash}" + labels
                     + (f":packed-{data.pack}" if data.pack else "") + walk_tag)


def make_train_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW on warmup + cosine with global-norm clipping, as `train` configures it."""
    return make_optimizer(cfg.lr, cfg.steps, cfg.warmup_frac, cfg.clip, cfg.weight_decay)


def walk_count(cfg: TrainConfig) -> int:
    """Anchors per row drawn from the serving walk: round(train.walk_anchors x num_anchors)."""
    return round(cfg.walk_anchors * cfg.num_anchors)


def step_spec(cfg: TrainConfig, arch: DrafterArch, target_cfg: DecoderConfig) -> StepSpec:
    """The train step's static spec as `train` configures it: the drafter's graph in the compute dtype, the loss
    (`make_objective`), the optimizer (`make_train_optimizer`), the anchors per row and the walk's share of them."""
    compute_dtype = jnp.dtype(cfg.compute_dtype)
    return StepSpec(graphdef=drafter_graphdef(arch, compute_dtype), target_cfg=target_cfg, arch=arch,
                    num_anchors=cfg.num_anchors, objective=make_objective(cfg, arch),
                    optimizer=make_train_optimizer(cfg), compute_dtype=compute_dtype, walk_count=walk_count(cfg))


def make_objective(cfg: TrainConfig, arch: DrafterArch) -> Objective:
    """The loss `train` configures (gamma 0 = by block size): its terms (`train.loss`) and weighting."""
    return Objective(kind=cfg.weighting, gamma=cfg.gamma or default_gamma(arch.block_size),
                     dpace_alpha=cfg.dpace_alpha, head_chunk=cfg.head_chunk,
                     terms=cfg.loss_terms, opd_gamma=cfg.opd_gamma,
                     selector_weight=cfg.selector_weight)


def drafter_graphdef(arch: DrafterArch, compute_dtype: Any = jnp.float32) -> nnx.GraphDef:
    """The drafter's graph (built abstractly, no arrays), its matmuls computing in `compute_dtype` (the params
    stay fp32 masters, cast per step); its params travel in the TrainState."""
    model = nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0), dtype=compute_dtype))
    graphdef, _ = nnx.split(model, nnx.Param)
    return graphdef


# --- state -------------------------------------------------------------------------------------------------


def fresh_state(seed: int, arch: DrafterArch, optimizer: optax.GradientTransformation,
                init_params: Any = None) -> TrainState:
    """A new TrainState: drafter params initialised from `seed` (or `init_params`, an nnx.State of the same
    tree), RNG key `seed + 1`. Traced by `create_state` under jit, so that no full copy ever sits on one
    device."""
    params = nnx.state(DFlashDrafter(arch, nnx.Rngs(params=seed)), nnx.Param) if init_params is None else init_params
    return init_state(params, optimizer, jax.random.PRNGKey(seed + 1))


def state_layout(seed: int, arch: DrafterArch, optimizer: optax.GradientTransformation,
                 mesh: Mesh) -> tuple[Any, Any]:
    """The TrainState's abstract tree (shapes and dtypes, nothing allocated) and its DRAFTER_RULES shardings."""
    abstract = jax.eval_shape(functools.partial(fresh_state, seed, arch, optimizer))
    return abstract, tree_shardings(abstract, DRAFTER_RULES, mesh)


def create_state(seed: int, arch: DrafterArch, optimizer: optax.GradientTransformation,
                 mesh: Mesh, init_params: Any = None) -> tuple[TrainState, Any]:
    """A fresh TrainState created sharded by DRAFTER_RULES (jit with out_shardings), and its shardings;
    `init_params`: start from these drafter params (`init_from_params`) instead of a random init."""
    _, shardings = state_layout(seed, arch, optimizer, mesh)
    state = jax.jit(functools.partial(fresh_state, seed, arch, optimizer), out_shardings=shardings)(init_params)
    return state, shardings


def init_vocab(path: str, target: Target) -> list[int] | None:
    """The draft vocabulary of the drafter at `train.init_from` (its token ids), or None when it has none: a run
    with `train.head_vocab` that starts from a drafter keeps the vocabulary it was trained and is served over
    (a fine-tune on a slice of the data would otherwise count another one)."""
    from dflash.models.drafter_io import load_drafter

    vocab = load_drafter(Path(path).expanduser(), target.cfg).draft_vocab
    if vocab is None:
        return None
    log.info("train.init_from %s: training over its draft vocabulary (%d tokens)", path, len(vocab.ids))
    return [int(t) for t in np.asarray(vocab.ids)]


WEIGHTLESS_FIELDS = ("block_size", "layer_types", "sliding_window")  # drafter fields no weight depends on


def init_from_params(path: str, arch: DrafterArch, target: Target) -> Any:
    """The drafter params of `train.init_from` (a run dir or an export), checked against the recipe's `arch`
    (ConfigError naming every differing field). A drafter without a path selector may start a recipe that has
    one (`drafter.selector`), and a DFlash drafter a DFlash2 recipe (`drafter.variant: dflash2`): what is added
    starts as in a new drafter (the selector's edge scores at zero, the convolutions at the identity), so step 0
    drafts exactly what the loaded drafter does. The block size may differ (no weight's shape depends on K): a
    drafter trained at K = 4 starts a K = 8 recipe with all its weights. So may the draft window
    (`drafter.layer_types`, `drafter.sliding_window`): a full-attention drafter starts a sliding-window recipe, or
    the reverse."""
    from dflash.models.drafter_io import load_drafter

    loaded = load_drafter(Path(path).expanduser(), target.cfg)
    mine = arch_dict(arch)
    if arch.variant == "dflash2" and loaded.arch.variant == "dflash":
        grown = dataclasses.replace(loaded.arch, variant=arch.variant, conv_kernel_size=arch.conv_kernel_size,
                                    conv_group_size=arch.conv_group_size)
        fresh = DFlashDrafter(grown, nnx.Rngs(params=0))  # its convolutions start at the identity
        nnx.update(fresh, nnx.state(loaded, nnx.Param))
        fresh.draft_vocab, loaded = loaded.draft_vocab, fresh
        log.info("train.init_from %s is a DFlash drafter: it starts this DFlash2 recipe with identity convolutions",
                 path)
    if arch.selector_rank and not loaded.arch.selector_rank:
        grown = dataclasses.replace(loaded.arch, selector_rank=arch.selector_rank, selector_top_k=arch.selector_top_k)
        fresh = DFlashDrafter(grown, nnx.Rngs(params=0))  # its successor codebook starts at zero
        nnx.update(fresh, nnx.state(loaded, nnx.Param))
        fresh.draft_vocab, loaded = loaded.draft_vocab, fresh
        log.info("train.init_from %s has no path selector: a new one (rank %d) is added", path, arch.selector_rank)

    def same(a: Any, b: Any) -> bool:  # float fields may have been written in float32 by an export
        return math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) and isinstance(b, float) else a == b

    # K and the draft window size no weight (the window only limits the context keys a layer sees, D63): the
    # recipe's values are taken
    taken = {f: getattr(arch, f) for f in WEIGHTLESS_FIELDS if getattr(loaded.arch, f) != getattr(arch, f)}
    if taken:
        log.info("train.init_from %s starts this recipe with its %s", path, "; ".join(
            f"{f} {v!r} (trained with {getattr(loaded.arch, f)!r})" for f, v in taken.items()))
    theirs = dataclasses.replace(loaded.arch, **taken)
    differ = [f"{k}: {v!r} there vs {mine[k]!r} in the recipe" for k, v in arch_dict(theirs).items()
              if not same(v, mine[k])]
    if differ:
        raise ConfigError(f"train.init_from {path} holds another drafter architecture (" + "; ".join(differ) + ")")
    log.info("initialised the drafter from %s", path)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.state(loaded, nnx.Param))  # host: jit places it


def create_or_restore_state(cfg: TrainConfig, arch: DrafterArch, optimizer: optax.GradientTransformation,
                            mesh: Mesh, ckpt: Checkpointer, batches: Any, data_fingerprint: str,
                            target: Target | None = None) -> tuple[TrainState, Any, int]:
    """(state, its shardings, the step it is at): restored from the latest checkpoint of `ckpt` (its data
    fingerprint checked, `batches` moved to the saved position) or, when there is none, created fresh.
    Process 0 drops the metrics.jsonl records after that step (logged by a run that died before its next
    checkpoint)."""
    run_dir = _run_dir(cfg)
    latest = ckpt.latest_step()
    if latest is None:
        init = init_from_params(cfg.init_from, arch, target) if cfg.init_from else None
        state, shardings = create_state(cfg.seed, arch, optimizer, mesh, init)
    else:
        abstract, shardings = state_layout(cfg.seed, arch, optimizer, mesh)
        state, data_state = ckpt.restore(latest, abstract, shardings)
        if data_state.get("data_fingerprint") != data_fingerprint:
            raise ConfigError(f"checkpoint step {latest} in {ckpt.directory} was trained on other data (its "
                              "examples hash differs: data or the tokenizer changed); resume with the same "
                              "data settings or use a new train.run_dir")
        batches.set_state(data_state["iterator"])
    if jax.process_index() == 0:
        _truncate_metrics(run_dir, 0 if latest is None else latest)
    if latest is not None:
        log.info("resumed %s from step %d", run_dir, latest)
    return state, shardings, int(jax.device_get(state.step))


def _run_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir).expanduser().resolve()


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl records after `step`."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        keep = [r for r in read_metrics(run_dir) if r["step"] <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


# --- loop --------------------------------------------------------------------------------------------------


def train_loop(cfg: TrainConfig, run: TrainRun, state: TrainState, shardings: Any, start: int, ckpt: Checkpointer,
               metrics: StepMetrics, real_eval: RealTauEval | None = None) -> TrainState:
    """Steps start+1 .. train.steps: batch -> jitted step (state donated) -> the previous step's metrics ->
    an async checkpoint every save_every steps and at the last, once that step's metrics proved finite ->
    real τ when `real_eval` is due (after the step's metrics; it reads copies of the params and touches
    neither the state nor the data, so training results are the same with it or without). On SIGTERM
    (`train.preemption`) the step in flight is checkpointed and `Preempted` is raised: nothing is redone on restart.
    The batch is placed explicitly (`shard_batch`; across processes `make_array_from_process_local_data` counts as a
    guarded transfer, so it stays outside) and the step runs under `jax.transfer_guard("disallow")`: an implicit
    transfer (a host array or a device fetch inside the step) fails the step instead of slowing every one."""
    step_fn = make_train_step(run.spec, run.frozen, state_shardings=shardings)
    with PreemptionWatch() as preemption:
        for step in range(start + 1, cfg.steps + 1):
            batch = shard_batch(next(run.batches), run.mesh)  # the step's one host-to-device copy, explicit
            with jax.transfer_guard("disallow"):  # the step gets device arrays only: no silent host copy per step
                state, device_metrics = step_fn(state, batch)
            metrics.push(step, device_metrics)
            stop = preemption.stop_at(step)  # SIGTERM: this step is checkpointed and the run stops (`Preempted`)
            if stop or step % cfg.save_every == 0 or step == cfg.steps:
                metrics.flush()  # never checkpoint a state whose step went non-finite
                ckpt.save(step, state, {"iterator": _iterator_state(run.batches),
                                        "data_fingerprint": run.data_fingerprint})
            if stop:
                ckpt.wait()
                raise Preempted(step)
            if real_eval is not None and real_eval.due(step):
                metrics.flush()
                measured = real_eval(step, state.params)  # process 0 decodes; the others wait for it
                if measured:
                    metrics.write_eval(step, measured)
    metrics.flush()
    return state


class StepMetrics:
    """The host side of the loop. A step's metrics are fetched one step late (the device never waits on the
    host), checked finite (NonFiniteMetricError names the step), given the block tokens/s over the last
    THROUGHPUT_WINDOW finished steps, shown on the progress bar, and written every log_every steps and at
    the last one. `last` holds the latest finished step's host metrics."""

    def __init__(self, cfg: TrainConfig, writer: MetricsWriter, *, block_tokens: int, start: int, show: bool):
        self.writer = writer
        self.log_every, self.final_step, self.block_tokens = cfg.log_every, cfg.steps, block_tokens
        self.bar = Progress(cfg.steps, initial=start, enabled=show, unit="step", desc="train")
        self.last: dict[str, Any] = {}
        self.real_tau: float | None = None  # the latest in-loop real τ, shown beside the teacher-forced one
        self._pending: tuple[int, Any] | None = None
        self._fields: dict[str, str] = {}
        self._window: list[tuple[float, int]] = []

    def push(self, step: int, device_metrics: Any) -> None:
        """Take `step`'s metrics (still on device) and finish the previous step's."""
        self.flush()
        self._pending = (step, device_metrics)

    def flush(self) -> None:
        """Finish the pending step, if any."""
        if self._pending is not None:
            step, device_metrics = self._pending
            self._pending = None
            self._finish(step, device_metrics)

    def _finish(self, step: int, device_metrics: Any) -> None:
        metrics = _host(device_metrics)
        check_finite(metrics, step)
        self.last = metrics
        self._window.append((time.time(), step))
        del self._window[:-THROUGHPUT_WINDOW]
        if len(self._window) > 1:
            (t0, s0), (t1, s1) = self._window[0], self._window[-1]
            metrics["block_tokens_per_s"] = (s1 - s0) * self.block_tokens / max(t1 - t0, 1e-9)
        self.bar.update(step - self.bar.n, tokens=(step - self.bar.n) * self.block_tokens)
        self._postfix(loss=f"{metrics['loss']:.3f}", tau=f"{metrics['acceptance_length']:.2f}",
                      tok_s=f"{metrics.get('block_tokens_per_s', 0):.0f}")
        if step % self.log_every == 0 or step == self.final_step:
            self.writer.write(step, metrics)

    def write_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Log an in-loop real-τ evaluation (`eval/...` metrics) at `step` and show its τ on the bar."""
        self.real_tau = metrics["eval/tau"]
        self.writer.write(step, metrics)
        self._postfix(**self._fields)

    def _postfix(self, **fields: str) -> None:
        self._fields = fields
        real = {} if self.real_tau is None else {"real_tau": f"{self.real_tau:.2f}"}
        self.bar.set_postfix({**fields, **real}, refresh=False)

    def close(self) -> None:
        self.bar.close()


def _host(tree: Any) -> dict[str, Any]:
    out = {}
    for name, value in jax.device_get(tree).items():
        arr = np.asarray(value, np.float64)
        out[name] = float(arr) if arr.ndim == 0 else arr.tolist()
    return out


def _iterator_state(batches: Any) -> dict[str, Any]:
    """The data iterator's state. Orbax writes process 0's copy only, so every host's must be equal (it is:
    each host counts the same number of global batches); checked when there are several processes."""
    state = batches.get_state()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.assert_equal(np.int64(state["next_index"]), "data iterator positions differ across hosts")
    return state


def evaluate(data: DataConfig, num_anchors: int, run: TrainRun, params: Any) -> dict[str, Any]:
    """Teacher-forced metrics of `params` on the first EVAL_EXAMPLES GSM8K test conversations (fixed anchors).
    Those carry the text's labels only, so a loss of distribution terms (`train.loss` beyond ce) is measured
    there as ce with the run's weighting."""
    examples, _ = build_examples(data, run.target.tokenizer, split="test", limit=EVAL_EXAMPLES)
    objective = run.spec.objective
    objective = dataclasses.replace(objective, terms=(("ce", 1.0),)) if objective.divergences else objective
    unit = math.lcm(batch_divisor(run.mesh), jax.process_count())  # same global rows whatever the process count
    rows = len(examples) // unit * unit // jax.process_count()
    if rows == 0:
        return {}
    spec = dataclasses.replace(run.spec, num_anchors=num_anchors, objective=objective, optimizer=None, walk_count=0)
    eval_step = make_eval_step(spec, run.frozen)
    mine = examples[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    batch = TrainBatch(tokens=np.stack([t for t, _, _ in mine]), loss_mask=np.stack([m for _, m, _ in mine]))
    return _host(eval_step(params, shard_batch(batch, run.mesh), jax.random.PRNGKey(1234)))


__all__ = ["StepMetrics", "TrainResult", "TrainRun", "arch_dict", "build_batches", "build_run",
           "create_or_restore_state", "create_state", "drafter_graphdef", "evaluate",
           "fresh_state", "make_objective", "make_train_optimizer", "run_training", "state_layout", "step_spec",
           "train_loop"]
