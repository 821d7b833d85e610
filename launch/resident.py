"""What each stage of a recipe holds on a chip beside its compiled programs: bytes from the recipe's shapes and
shardings, nothing allocated and no device needed.

    stages = stage_holdings(recipe, parse_tpu_type("v5p-64"))
    for s in stages: print(s.name, s.chips, s.held_bytes, s.holds, s.programs)

A stage holds arrays between its programs' calls (the placed target and drafter params, the optimizer state, the
engine's K/V pages and slots at the recipe's settings, a batch or features in flight); each program adds its own
working memory while it runs (its compiled peak less the arguments, which are those held arrays). `dflash launch
compile` adds the two per chip against the chip's HBM (`launch.compile.stage_needs`) and refuses a recipe whose stage
does not fit, naming the stage; `tools/pod_smoke.py` prints the same table. Stages and what they hold:

- train: the target's share of the training mesh (compute dtype, `TARGET_RULES`), a training vocabulary's head
  rows (`train.head_vocab`; the full head is the target's own arrays), the drafter's fp32 params and optimizer
  state (`DRAFTER_RULES`), one global batch's rows;
- train real-τ eval (`train.eval_every`): the same on process 0's first chip, plus the whole target in its dtype,
  the gathered drafter and an engine's pages for the held-out prompts, while it decodes (`train.real_eval`);
- regenerate: per replica of `data.regen.devices_per_replica` chips, the target split over them in tensor parallel
  and an AR engine of `data.regen.slots` slots of `data.regen.max_len` tokens;
- capture: per replica of `data.capture_devices_per_replica` chips, the target and a second batch's features in
  flight (each replica keeps two batches in flight);
- serve: `dflash serve` (8 slots of `target.max_seq_len`, the drafter replicated) on one chip and over a host's;
- eval: the pod eval stage, a DFlash and an AR server in one process over one copy of the weights on one chip,
  one slot each (`dflash eval`'s concurrency 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ENGINE_SLOTS = 8  # `dflash serve --slots` default
EVAL_SLOTS = 1  # `dflash eval`'s default concurrency: the pod eval stage's servers' slots
PAGE_SIZE = 16  # `serve.plan.Limits.page_size`


@dataclasses.dataclass(frozen=True)
class StageHoldings:
    """One stage: `chips` one copy of what it holds spans, `holds` ((what, bytes on its fullest chip), ...), and the
    compiled programs (names in `launch.compile`'s report) one of which runs at a time on top of them."""

    name: str
    chips: int
    holds: tuple[tuple[str, int], ...]
    programs: tuple[str, ...]
    note: str = ""

    @property
    def held_bytes(self) -> int:
        return sum(b for _, b in self.holds)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "chips": self.chips, "holds": [list(h) for h in self.holds],
                "programs": list(self.programs), "note": self.note}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageHoldings:
        return cls(name=data["name"], chips=data["chips"], holds=tuple((str(k), int(v)) for k, v in data["holds"]),
                   programs=tuple(data["programs"]), note=data.get("note", ""))


def _mesh(data: int, fsdp: int, tensor: int) -> Any:
    from jax.sharding import AbstractMesh

    from dflash.models.sharding import AXES

    return AbstractMesh((data, fsdp, tensor), AXES)


def per_chip(tree: Any, rules: Any, mesh: Any) -> int:
    """Bytes of the fullest chip's shard of every array of `tree` (shapes and dtypes) laid out by `rules` on
    `mesh` (an AbstractMesh); `rules` None: replicated."""
    import jax

    from dflash.models.sharding import path_str, spec_for

    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        spec = spec_for(path_str(path), tuple(x.shape), rules, mesh) if rules else ()
        shape = list(x.shape)
        for i, axis in enumerate(spec):
            if axis is not None:
                shape[i] //= mesh.shape[axis]
        total += math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
    return total


def _bytes(tree: Any) -> int:
    import jax

    return sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def engine_cache(target_cfg: Any, arch: Any, slots: int, max_len: int, dtype: Any) -> Any:
    """The abstract decoding state of an engine of `slots` slots of `max_len` tokens (paged target K/V with every
    slot's pages and the null page, the draft cache unless `arch` is None, the per-slot arrays)."""
    import jax

    from dflash.serve.speculative import empty_state

    pages = slots * -(-max_len // PAGE_SIZE) + 1
    return jax.eval_shape(lambda: empty_state(target_cfg, arch, slots, max_len, pages, PAGE_SIZE, dtype))


def slot_bytes(target_cfg: Any, arch: Any, max_len: int, dtype: Any, chips: int = 1, engines: int = 1) -> int:
    """Bytes one more slot of `max_len` tokens holds on the fullest of `chips` chips (tensor parallel, by
    `CACHE_RULES`): its target K/V pages and per-slot arrays in each of `engines` engines (a DFlash server and its
    `--ar-port` companion: two), and its rows of the drafter's context cache in the first (unless `arch` is None)."""
    from dflash.models.sharding import CACHE_RULES

    mesh = _mesh(1, 1, chips)

    def held(slots: int, with_drafter: Any) -> int:
        return per_chip(engine_cache(target_cfg, with_drafter, slots, max_len, dtype), CACHE_RULES, mesh)

    first = held(2, arch) - held(1, arch)
    return first + (held(2, None) - held(1, None)) * (engines - 1)


def _engine_holds(known: Any, arch: Any, dtype: Any, chips: int, slots: int, max_len: int,
                  drafter: bool = True, engines: int = 1) -> list[tuple[str, int]]:
    """What an engine (or `engines` of them over one copy of the weights: a DFlash server's and an AR server's) holds
    per chip on `chips` chips in tensor parallel: the target by `TARGET_RULES`, the drafter's fp32 params
    replicated, each engine's caches by `CACHE_RULES`."""
    from dflash.models.registry import abstract_target_params
    from dflash.models.sharding import CACHE_RULES, TARGET_RULES

    mesh = _mesh(1, 1, chips)
    holds = [("target params", per_chip(abstract_target_params(known.cfg, dtype), TARGET_RULES, mesh))]
    if drafter:
        holds.append(("drafter params", _bytes(drafter_params(arch))))
    caches = per_chip(engine_cache(known.cfg, arch if drafter else None, slots, max_len, dtype), CACHE_RULES, mesh)
    if drafter and engines > 1:  # the AR server's engine: no draft cache
        caches += per_chip(engine_cache(known.cfg, None, slots, max_len, dtype), CACHE_RULES, mesh) * (engines - 1)
    what = f"{engines} x {slots} x {max_len}" if engines > 1 else f"{slots} x {max_len}"
    holds.append((f"KV pages and slots ({what})", caches))
    return holds


def drafter_params(arch: Any) -> Any:
    """The drafter's params as abstract arrays (fp32)."""
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter

    return nnx.state(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))), nnx.Param)


def _train_holds(recipe: Any, known: Any, arch: Any, chips: int) -> tuple[list[tuple[str, int]], Any]:
    import functools as ft

    import jax
    import jax.numpy as jnp

    from dflash.data.batch import TrainBatch, batch_layout
    from dflash.models.registry import abstract_target_params
    from dflash.models.sharding import DRAFTER_RULES, TARGET_RULES
    from dflash.train.config import mesh_shape
    from dflash.train.loop import fresh_state, step_spec
    from dflash.train.sharding import head_rules

    cfg = recipe.train
    data, fsdp, tensor = mesh_shape(cfg.mesh, chips)
    mesh = _mesh(data, fsdp, tensor)
    compute = jnp.dtype(cfg.compute_dtype)
    holds = [("target params", per_chip(abstract_target_params(known.cfg, compute), TARGET_RULES, mesh))]
    if cfg.head_vocab:
        v = min(cfg.head_vocab, known.cfg.vocab_size)
        rows = {"matrix": jax.ShapeDtypeStruct((v, known.cfg.hidden_size), compute)}
        holds.append(("training vocabulary head", per_chip(rows, head_rules(True), mesh)
                      + known.cfg.vocab_size * 4))
    spec = step_spec(cfg, arch, known.cfg)
    state = jax.eval_shape(ft.partial(fresh_state, cfg.seed, arch, spec.optimizer))
    params = per_chip(state.params, DRAFTER_RULES, mesh)
    holds += [("drafter params", params), ("optimizer state", per_chip(state, DRAFTER_RULES, mesh) - params)]
    layout = batch_layout(recipe.data, cfg.batch_size, arch.num_features * arch.hidden_size)
    holds.append(("batch", -(-_bytes(TrainBatch.spec(layout)) // (data * fsdp))))
    return holds, mesh


def stage_holdings(recipe: Any, tpu: Any) -> list[StageHoldings]:
    """Every stage of `recipe` on the slice `tpu` (a `launch.tpus.TpuType`): what it holds per chip (see the module
    docstring) and the programs whose working memory comes on top (named as `launch.compile` names them)."""
    import jax.numpy as jnp

    from dflash.models.drafter import resolve_drafter
    from dflash.models.registry import known_target

    known = known_target(recipe.target.source)
    arch = resolve_drafter(recipe.drafter, known.cfg, known.mask_token_id)
    dtype = jnp.dtype(recipe.target.dtype)
    host = tpu.chips // tpu.hosts  # chips per host: a data stage's or server's devices are one host's
    max_len = recipe.target.max_seq_len
    stages = []
    train, _ = _train_holds(recipe, known, arch, tpu.chips)
    stages.append(StageHoldings("train", tpu.chips, tuple(train), ("train_step",)))
    if recipe.train.eval_every:
        from dflash.serve.acceptance import REAL_TAU_SLOTS

        prompts = recipe.train.eval_prompts * len(recipe.train.eval_sets)
        decode = _engine_holds(known, arch, dtype, 1, min(prompts, REAL_TAU_SLOTS), max_len)
        stages.append(StageHoldings(
            "train real-τ eval", 1, tuple(train + [(f"eval {k}", b) for k, b in decode]), ("propose", "verify"),
            f"process 0's first chip while it decodes {prompts} held-out prompts, {min(prompts, REAL_TAU_SLOTS)} at a "
            "time, every train.eval_every steps "
            f"(context bound by target.max_seq_len {max_len}); the engine's programs at {ENGINE_SLOTS} slots"))
    regen = recipe.data.regen
    if not regen.endpoint.url:
        group = regen.devices_per_replica
        stages.append(StageHoldings(
            "regenerate", group, tuple(_engine_holds(known, arch, dtype, group, regen.slots, regen.max_len,
                                                     drafter=False)),
            (_suffix("regen_step", group),),
            f"{host // group if group <= host else 0} replica(s) per host of {group} chip(s), AR, "
            f"{regen.slots} slots of {regen.max_len} tokens"))
    group = recipe.data.capture_devices_per_replica
    capture = _capture_holds(recipe, known, arch, dtype, group)
    stages.append(StageHoldings("capture", group, tuple(capture), (_suffix("capture", group),),
                                f"{recipe.data.capture_batch_size} rows of {recipe.data.seq_len} tokens a batch, "
                                "2 batches in flight per replica"))
    for chips in dict.fromkeys((1, host)):
        stages.append(StageHoldings(_suffix("serve", chips), chips,
                                    tuple(_engine_holds(known, arch, dtype, chips, ENGINE_SLOTS, max_len)),
                                    (_suffix("propose", chips), _suffix("verify", chips)),
                                    f"dflash serve --devices {chips}, {ENGINE_SLOTS} slots of {max_len} tokens"))
    stages.append(StageHoldings("eval", 1, tuple(_engine_holds(known, arch, dtype, 1, EVAL_SLOTS, max_len,
                                                               engines=2)),
                                ("propose", "verify"),
                                f"the pod eval stage: a DFlash and an AR server in one process on one chip, "
                                f"{EVAL_SLOTS} slot(s) each"))
    return stages


def format_stages(stages: list[StageHoldings]) -> str:
    """One line per stage: its chips and what it holds per chip in GiB, the largest first (no program counted: what
    `dflash launch compile` adds from the compiled programs)."""
    gib = 1 << 30
    lines = []
    for s in stages:
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in sorted(s.holds, key=lambda h: -h[1]))
        lines.append(f"{s.name:<19} {s.chips:>3} chip(s)  holds {s.held_bytes / gib:7.2f} GiB per chip: {parts}")
    return "\n".join(lines)


def _capture_holds(recipe: Any, known: Any, arch: Any, dtype: Any, chips: int) -> list[tuple[str, int]]:
    from dflash.models.registry import abstract_target_params
    from dflash.models.sharding import TARGET_RULES

    data = recipe.data
    b, s = data.capture_batch_size, data.seq_len
    out = b * s * arch.num_features * arch.hidden_size * 2  # bf16 features
    if data.labels != "text":
        out += b * s * 4 + (b * s * data.soft_topk * 8 if data.labels == "soft" else 0)
    target = per_chip(abstract_target_params(known.cfg, dtype), TARGET_RULES, _mesh(1, 1, chips))
    return [("target params", target), ("the other batch in flight (features)", out)]


def _suffix(name: str, chips: int) -> str:
    """A program's or stage's name on `chips` chips, as `launch.compile` names the engine's (`verify x4`)."""
    return name + (f" x{chips}" if chips > 1 else "")


__all__ = ["ENGINE_SLOTS", "EVAL_SLOTS", "StageHoldings", "drafter_params", "engine_cache", "format_stages",
           "per_chip", "slot_bytes", "stage_holdings"]
