"""`dflash launch compile`: compile a recipe's train step (and the engine's propose and verify, regeneration's AR step
and capture's forward at the recipe's settings) ahead of time for a TPU slice from a machine without TPUs, and report
memory per chip (arguments, outputs, temporaries), whether it fits the chip's HBM, and the step's FLOPs with the
run's cost at a stated MFU. Beside the programs, each stage's need per chip: what it holds between calls
(`launch.resident.stage_holdings`: placed params, optimizer state, K/V pages and slots) plus its largest program's
working memory (`CompileReport.stage_needs`); a program or a stage that does not fit is refused, named
(`CompileReport.refusals`, exit 3).

Nothing is allocated: the target and the drafter are built abstractly (`models.registry.known_target`,
`jax.eval_shape`), every input is a `jax.ShapeDtypeStruct` carrying its sharding from the rules of
`train.sharding`, and the programs go through `jit(...).lower(...).compile()`.

Two backends, each in a subprocess of its own (the device set is fixed when JAX starts):
- `tpu`: the slice's devices from libtpu's compile-only topology (`jax.experimental.topologies`), so XLA's TPU
  compiler does the memory assignment, exactly as on the pod. libtpu is not in the project's environment:
  `tools/setup_libtpu.sh` puts the wheel jax[tpu] pins into a cache directory, found through `TPU_LIBRARY_PATH`
  (docs/decisions.md D20).
- `cpu`: a simulated CPU mesh of the same number of devices and the same (data, fsdp, tensor) shape
  (`--xla_force_host_platform_device_count`). XLA's CPU compiler fuses and schedules differently, so its
  temporaries are an estimate of the TPU's, not the TPU's; the report says which backend made it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from dflash.configs.schema import ConfigError
from dflash.launch.resident import ENGINE_SLOTS, StageHoldings, stage_holdings
from dflash.launch.tpus import TpuType, parse_tpu_type

ROOT = Path(__file__).resolve().parents[2]  # the repository (the worker runs from it)
LIBTPU_VERSION = "0.0.50"  # what jax[tpu]==0.12.0.1 pins (libtpu==0.0.50.*)
LIBTPU_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash" / f"libtpu-{LIBTPU_VERSION}"
DEFAULT_MFU = 0.4
GIB = 1 << 30


# ----------------------------------------------------------------------------- the report


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's memory per chip (XLA's `memory_analysis`) and FLOPs per chip (`cost_analysis`).

    peak = arguments + outputs - aliased (donated inputs reused as outputs) + temporaries + code: what must be
    resident at once on one chip.
    """

    name: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: float
    error: str = ""  # the compiler's out-of-memory message, when it refused (temp_bytes is then its figure)

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


@dataclasses.dataclass(frozen=True)
class StageNeed:
    """A stage's memory per chip: what it holds (`stage`) plus `program`'s working memory (its peak less its
    arguments, which are arrays the stage holds; None: none of its programs was compiled)."""

    stage: StageHoldings
    program: ProgramMemory | None
    hbm_bytes: int

    @property
    def working_bytes(self) -> int:
        return 0 if self.program is None else self.program.peak_bytes - self.program.argument_bytes

    @property
    def need_bytes(self) -> int:
        return self.stage.held_bytes + self.working_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.hbm_bytes and not (self.program is not None and self.program.error)

    def describe(self) -> str:
        held = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.stage.holds)
        work = f"; {self.program.name}'s working memory {self.working_bytes / GIB:.2f}" if self.program else ""
        return f"holds {self.stage.held_bytes / GIB:.2f} GiB: {held}{work}"


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What `dflash launch compile` prints: the backend, the slice, the mesh, every program, and the run's cost."""

    recipe: str
    tpu_type: str
    num_slices: int
    backend: str
    mesh: dict[str, int]
    hbm_bytes: int
    peak_flops: float
    batch_size: int
    seq_len: int
    steps: int
    params: dict[str, int]
    programs: list[ProgramMemory]
    step_flops: float = 0.0  # matmul FLOPs of one train step over the whole slice, counted from its jaxpr
    stages: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # `launch.resident.StageHoldings`

    def fits(self, program: ProgramMemory) -> bool:
        return not program.error and program.peak_bytes <= self.hbm_bytes

    def stage_needs(self) -> list[StageNeed]:
        """Each stage's need per chip: what it holds (`launch.resident`) plus the working memory (peak less
        arguments) of the largest of its programs that were compiled."""
        by_name = {p.name: p for p in self.programs}
        out = []
        for stage in map(StageHoldings.from_json, self.stages):
            compiled = [by_name[n] for n in stage.programs if n in by_name]
            worst = max(compiled, key=lambda p: p.peak_bytes - p.argument_bytes, default=None)
            out.append(StageNeed(stage, worst, self.hbm_bytes))
        return out

    def refusals(self) -> list[str]:
        """Why the recipe does not fit: each program the compiler refused or that exceeds HBM, and each stage whose
        need per chip exceeds it (naming the stage, the bytes and the chip's HBM); empty when everything fits."""
        hbm = self.hbm_bytes / GIB
        out = [f"program {p.name} needs {p.peak_bytes / GIB:.2f} GiB per chip, over the chip's {hbm:.1f} GiB HBM"
               + (f" ({p.error})" if p.error else "") for p in self.programs if not self.fits(p)]
        out += [f"stage {n.stage.name} needs {n.need_bytes / GIB:.2f} GiB per chip ({n.describe()}), over the "
                f"{self.tpu_type} chip's {hbm:.1f} GiB HBM" for n in self.stage_needs() if not n.fits]
        return out

    @property
    def train(self) -> ProgramMemory:
        return next(p for p in self.programs if p.name == "train_step")

    @property
    def chips(self) -> int:
        return self.train.devices

    def step_seconds(self, mfu: float = DEFAULT_MFU) -> float:
        """One train step at `mfu`: the step's FLOPs (jaxpr count) over the slice's peak bf16 FLOP/s times `mfu`."""
        return self.step_flops / (self.chips * self.peak_flops * mfu)

    def hours(self, mfu: float = DEFAULT_MFU) -> float:
        return self.steps * self.step_seconds(mfu) / 3600

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["programs"] = [{**dataclasses.asdict(p), "peak_bytes": p.peak_bytes, "fits": self.fits(p)}
                           for p in self.programs]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompileReport:
        fields = {f.name for f in dataclasses.fields(ProgramMemory)}
        programs = [ProgramMemory(**{k: v for k, v in p.items() if k in fields}) for p in data["programs"]]
        return cls(**{**data, "programs": programs})

    def format(self, mfu: float = DEFAULT_MFU) -> str:
        """The one-screen report."""
        gib = lambda b: f"{b / GIB:8.2f}"  # noqa: E731
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [
            f"recipe {self.recipe} on {self.num_slices} x {self.tpu_type} ({self.chips} chips, HBM "
            f"{self.hbm_bytes / GIB:.1f} GiB per chip); compiled by {self.backend}",
            f"train mesh {mesh}; global batch {self.batch_size} x {self.seq_len} tokens; "
            + ", ".join(f"{k} {v / 1e6:,.1f}M" for k, v in self.params.items()),
            "",
            "memory per chip in GiB:",
            f"{'program':<14}{'chips':>6}{'arguments':>11}{'outputs':>10}{'aliased':>10}{'temps':>10}{'peak':>10}"
            f"{'fits':>6}",
        ]
        for p in self.programs:
            lines.append(f"{p.name:<14}{p.devices:>6}{gib(p.argument_bytes):>11}{gib(p.output_bytes):>10}"
                         f"{gib(p.alias_bytes):>10}{gib(p.temp_bytes):>10}{gib(p.peak_bytes):>10}"
                         f"{'yes' if self.fits(p) else 'NO':>6}")
            if p.error:
                lines.append(f"  {p.name}: {p.error}")
        needs = self.stage_needs()
        if needs:
            lines += ["", "memory per chip by stage in GiB: what it holds between calls, plus its largest program's "
                      "working memory (peak less arguments):",
                      f"{'stage':<19}{'chips':>6}{'holds':>9}{'program':>15}{'working':>9}{'need':>9}{'fits':>6}"]
            for n in needs:
                program = n.program.name if n.program else "-"
                lines.append(f"{n.stage.name:<19}{n.stage.chips:>6}{gib(n.stage.held_bytes):>9}{program:>15}"
                             f"{gib(n.working_bytes):>9}{gib(n.need_bytes):>9}{'yes' if n.fits else 'NO':>6}")
                lines.append("    holds " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in n.stage.holds)
                             + (f"; {n.stage.note}" if n.stage.note else ""))
        tokens = self.batch_size * self.seq_len
        hours = self.hours(mfu)
        lines += [
            "",
            f"train step: {_flops(self.step_flops)} (matmuls of its jaxpr, loops counted in full; XLA's cost "
            f"analysis, which counts a loop body once, says {_flops(self.train.flops)} per chip); at {mfu:.0%} MFU "
            f"{self.step_seconds(mfu) * 1e3:,.1f} ms/step",
            f"run: {self.steps:,} steps x {tokens:,} tokens = {self.steps * tokens / 1e6:,.1f}M tokens; "
            + (f"{hours:,.2f} h" if hours >= 0.01 else f"{hours * 3600:,.1f} s")
            + f" on {self.num_slices} x {self.tpu_type} ({hours * self.chips:,.2f} chip-hours) at {mfu:.0%} MFU",
        ]
        return "\n".join(lines)


def _flops(n: float) -> str:
    return f"{n / 1e15:,.2f} PFLOP" if n >= 1e15 else f"{n / 1e12:,.2f} TFLOP" if n >= 1e12 else f"{n / 1e9:,.2f} GFLOP"


# ----------------------------------------------------------------------------- building the programs (worker)


def _devices(tpu: TpuType, num_slices: int, backend: str) -> list[Any]:
    import jax

    if backend == "cpu":
        devices = jax.devices("cpu")
        want = tpu.chips * num_slices
        if len(devices) != want:
            raise RuntimeError(f"the simulated mesh needs {want} CPU devices; JAX has {len(devices)} "
                               "(XLA_FLAGS must set --xla_force_host_platform_device_count before JAX starts)")
        return devices
    from jax.experimental.topologies import get_topology_desc

    kwargs: dict[str, Any] = {"num_slices": num_slices}
    if tpu.gen.cores_per_chip == 2:  # one device per chip (megacore), as the pod runs it
        kwargs |= {"chip_config_name": "megacore", "chips_per_host_bounds": (2, 2, 1)}
    return list(get_topology_desc(tpu.jax_topology, "tpu", **kwargs).devices)


def _mesh(cfg: Any, devices: list[Any]) -> Any:
    import numpy as np
    from jax.sharding import Mesh

    from dflash.train.sharding import AXES, mesh_shape

    shape = mesh_shape(cfg, len(devices))
    try:  # the physical (torus-aware) order on a TPU topology
        from jax.experimental import mesh_utils

        array = mesh_utils.create_device_mesh(shape, devices)
    except Exception:  # noqa: BLE001 - CPU devices and multi-slice sets have no torus: plain order
        array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(array, AXES)


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _shard_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every array of `tree` (ShapeDtypeStructs with shardings)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


def _compile(name: str, lowered: Any, devices: int, args: Any) -> ProgramMemory:
    """Compile `lowered`; when the compiler runs out of HBM (only the TPU compiler checks), the program is
    reported with the temporaries it asked for and the error, instead of failing the report."""
    from jax.errors import JaxRuntimeError

    try:
        return _memory(name, lowered.compile(), devices)
    except JaxRuntimeError as err:
        m = _OOM.search(str(err))
        if "RESOURCE_EXHAUSTED" not in str(err) or m is None:
            raise
        temp = round(float(m.group(1)) * 1024 ** ("KMGT".index(m.group(2)) + 1))
        message = str(err).splitlines()[0][:400]
        return ProgramMemory(name=name, devices=devices, argument_bytes=_shard_bytes(args), output_bytes=0,
                             alias_bytes=0, temp_bytes=temp, code_bytes=0, flops=0.0, error=message)


def _memory(name: str, compiled: Any, devices: int) -> ProgramMemory:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return ProgramMemory(name=name, devices=devices, argument_bytes=int(mem.argument_size_in_bytes),
                         output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                         temp_bytes=int(mem.temp_size_in_bytes), code_bytes=int(mem.generated_code_size_in_bytes),
                         flops=float((cost or {}).get("flops", 0.0)))


def abstract_train_inputs(recipe: Any, mesh: Any) -> dict[str, Any]:
    """Everything the train step takes, abstract and sharded on `mesh`: target params (compute dtype,
    TARGET_RULES), the frozen head (the target's, or a training vocabulary's rows), the TrainState
    (DRAFTER_RULES), one global batch (`TrainBatch.spec` of the recipe's layout); and the step's static spec
    (`spec`, `train.loop.step_spec`)."""
    import jax
    import jax.numpy as jnp

    from dflash.data.batch import TrainBatch, batch_layout
    from dflash.models.drafter import resolve_drafter
    from dflash.models.registry import abstract_target_params, known_target
    from dflash.train.loop import state_layout, step_spec
    from dflash.train.objective import TrainHead
    from dflash.train.sharding import TARGET_RULES, batch_divisor, batch_sharding, head_rules, tree_shardings
    from dflash.train.step import train_head

    cfg = recipe.train
    known = known_target(recipe.target.source)
    arch = resolve_drafter(recipe.drafter, known.cfg, known.mask_token_id)
    if cfg.batch_size % batch_divisor(mesh):
        raise ConfigError(f"train.batch_size must be a multiple of mesh data x fsdp = {batch_divisor(mesh)}; "
                          f"received {cfg.batch_size}")
    compute = jnp.dtype(cfg.compute_dtype)
    target = abstract_target_params(known.cfg, compute)
    if cfg.head_vocab:
        v = min(cfg.head_vocab, known.cfg.vocab_size)
        head = TrainHead(matrix=jax.ShapeDtypeStruct((v, known.cfg.hidden_size), compute),
                         label_map=jax.ShapeDtypeStruct((known.cfg.vocab_size,), jnp.int32), vocab_major=True)
    else:
        head = train_head(target, known.cfg)

    def with_shardings(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    target = with_shardings(target, tree_shardings(target, TARGET_RULES, mesh))
    head = with_shardings(head, tree_shardings(head, head_rules(head.vocab_major), mesh))
    spec = step_spec(cfg, arch, known.cfg)
    state, state_shardings = state_layout(cfg.seed, arch, spec.optimizer, mesh)
    state = with_shardings(state, state_shardings)
    layout = batch_layout(recipe.data, cfg.batch_size, arch.num_features * arch.hidden_size)
    batch = TrainBatch.spec(layout, lambda ndim: batch_sharding(mesh, ndim))
    return {"known": known, "arch": arch, "target": target, "head": head, "state": state,
            "state_shardings": state_shardings, "batch": batch, "spec": spec}


def jaxpr_flops(jaxpr: Any) -> float:
    """Matmul FLOPs (2 per multiply-add of every dot_general and ragged_dot_general) of a jaxpr, every scan counted
    `length` times, the larger branch of a cond, the body of a while loop once; nested jaxprs (jit, remat,
    custom_vjp) included."""
    from jax.extend import core

    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract_lhs, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract_lhs)
        elif name == "ragged_dot_general":  # a MoE's grouped matmul: each lhs row meets one group's matrix
            (contract_lhs, _), _ = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract_lhs)
        elif name == "scan":
            total += eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(jaxpr_flops(branch.jaxpr) for branch in eqn.params["branches"])
        else:
            for value in eqn.params.values():
                if isinstance(value, core.ClosedJaxpr):
                    total += jaxpr_flops(value.jaxpr)
                elif isinstance(value, core.Jaxpr):
                    total += jaxpr_flops(value)
    return total


def train_step_flops(recipe: Any, ins: dict[str, Any]) -> float:
    """The matmul FLOPs of one train step (forward, backward and update; the whole global batch)."""
    from functools import partial

    import jax

    from dflash.train.step import FrozenTarget, train_step

    body = partial(train_step, spec=ins["spec"])
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (ins["state"], ins["batch"], FrozenTarget(params=ins["target"], head=ins["head"])))
    return jaxpr_flops(jax.make_jaxpr(body)(*bare).jaxpr)  # global shapes: the whole batch's FLOPs


def compile_train_step(recipe: Any, mesh: Any) -> tuple[ProgramMemory, dict[str, Any]]:
    """(the train step's memory and FLOPs per chip, its abstract inputs) for `recipe` on `mesh`."""
    from dflash.train.step import FrozenTarget, make_train_step

    ins = abstract_train_inputs(recipe, mesh)
    step = make_train_step(ins["spec"], FrozenTarget(params=ins["target"], head=ins["head"]),
                           state_shardings=ins["state_shardings"])
    lowered = step.lower(ins["state"], ins["batch"])
    args = (ins["state"], ins["batch"], ins["target"], ins["head"])
    return _compile("train_step", lowered, mesh.devices.size, args), ins


def compile_engine(recipe: Any, devices: list[Any], slots: int = ENGINE_SLOTS, max_len: int | None = None,
                   ar: bool = False, name: str = "") -> list[ProgramMemory]:
    """The engine's programs for `recipe`'s target and drafter on one host's chips (`devices`): the target's weights
    and paged K/V split over them in tensor parallel and the drafter replicated, as `dflash serve --devices` places
    them (`models.sharding`); `slots` sequences of up to `max_len` (default target.max_seq_len) tokens, target in
    target.dtype, drafter in fp32: `propose` and `verify`, or with `ar` (no drafter, as regeneration runs it) the
    AR step (`verify` of a block of one) named `name`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash.models.drafter import DFlashDrafter, resolve_drafter
    from dflash.models.registry import abstract_target_params, known_target
    from dflash.models.sharding import CACHE_RULES, TARGET_RULES, replicated, tensor_mesh, tree_shardings
    from dflash.serve.speculative import Models, empty_state, propose, verify

    known = known_target(recipe.target.source)
    arch = resolve_drafter(recipe.drafter, known.cfg, known.mask_token_id)
    dtype = jnp.dtype(recipe.target.dtype)
    mesh = tensor_mesh(devices)

    def place(tree: Any, rules: Any = None) -> Any:
        shardings = tree_shardings(tree, rules, mesh) if rules else jax.tree.map(lambda _: replicated(mesh), tree)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    target = place(abstract_target_params(known.cfg, dtype), TARGET_RULES)
    page_size, max_len = 16, max_len or recipe.target.max_seq_len
    num_pages = slots * -(-max_len // page_size) + 1
    n = len(devices)
    suffix = f" x{n}" if n > 1 else ""
    if ar:
        models = Models(target, None, known.cfg, None)
        state = place(jax.eval_shape(lambda: empty_state(known.cfg, None, slots, max_len, num_pages, page_size,
                                                         dtype)), CACHE_RULES)
        drafts = jax.ShapeDtypeStruct((slots, 0), jnp.int32, sharding=replicated(mesh))
        return [_compile(name + suffix, verify.lower(models, state, drafts), n, (models, state, drafts))]
    graphdef, drafter_params = nnx.split(nnx.eval_shape(lambda: DFlashDrafter(arch, nnx.Rngs(0))), nnx.Param)
    models = Models(target, place(drafter_params), known.cfg, graphdef)
    state = place(jax.eval_shape(lambda: empty_state(known.cfg, arch, slots, max_len, num_pages, page_size, dtype)),
                  CACHE_RULES)
    drafts = jax.ShapeDtypeStruct((slots, arch.block_size - 1), jnp.int32, sharding=replicated(mesh))
    return [_compile("propose" + suffix, propose.lower(models, state, block_size=arch.block_size), n, (models, state)),
            _compile("verify" + suffix, verify.lower(models, state, drafts), n, (models, state, drafts))]


def compile_capture(recipe: Any, devices: list[Any]) -> ProgramMemory:
    """`dflash data capture`'s forward (the target's features of `data.capture_batch_size` rows of `data.seq_len`
    tokens, with its labels when `data.labels` asks for them) on one replica's chips (`devices`: the target split
    over them in tensor parallel, the batch replicated, as `data.capture` places them)."""
    import jax
    import jax.numpy as jnp

    from dflash.data.capture import _features_and_next_ids, _features_bf16
    from dflash.models.drafter import resolve_drafter
    from dflash.models.registry import abstract_target_params, known_target
    from dflash.models.sharding import TARGET_RULES, replicated, tensor_mesh, tree_shardings

    known = known_target(recipe.target.source)
    arch = resolve_drafter(recipe.drafter, known.cfg, known.mask_token_id)
    mesh = tensor_mesh(devices)
    target = abstract_target_params(known.cfg, jnp.dtype(recipe.target.dtype))
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target,
                          tree_shardings(target, TARGET_RULES, mesh))
    data = recipe.data
    tokens = jax.ShapeDtypeStruct((data.capture_batch_size, data.seq_len), jnp.int32, sharding=replicated(mesh))
    layer_ids = tuple(arch.layer_ids)
    if data.labels == "text":
        lowered = _features_bf16.lower(target, tokens, target_cfg=known.cfg, layer_ids=layer_ids)
    else:
        lowered = _features_and_next_ids.lower(target, tokens, target_cfg=known.cfg, layer_ids=layer_ids,
                                               topk=data.soft_topk if data.labels == "soft" else 0)
    n = len(devices)
    return _compile("capture" + (f" x{n}" if n > 1 else ""), lowered, n, (target, tokens))


def build_report(recipe_name: str, overrides: list[str], tpu_type: str, num_slices: int, backend: str,
                 engine: bool = True) -> CompileReport:
    """Compile the programs in this process (whose JAX must already see the devices of `backend`)."""
    from dflash.configs.recipe import load_recipe

    recipe = load_recipe(recipe_name, overrides)
    tpu = parse_tpu_type(tpu_type)
    devices = _devices(tpu, num_slices, backend)
    mesh = _mesh(recipe.train.mesh, devices)
    train, ins = compile_train_step(recipe, mesh)
    programs = [train]
    if engine:  # the engine on one chip (`dflash serve`'s default), and over one host's chips (`--devices 0`)
        host = tpu.chips // tpu.hosts
        programs += compile_engine(recipe, devices[:1])
        programs += compile_engine(recipe, devices[:host]) if host > 1 else []
        regen = recipe.data.regen
        if not regen.endpoint.url:  # the data stages' programs, on one replica's chips at the recipe's settings
            programs += compile_engine(recipe, devices[:regen.devices_per_replica], regen.slots, regen.max_len,
                                       ar=True, name="regen_step")
        programs.append(compile_capture(recipe, devices[:recipe.data.capture_devices_per_replica]))
    stages = [s.to_json() for s in stage_holdings(recipe, tpu)]
    state = ins["state"]
    params = {"target params": sum(math.prod(x.shape) for x in _leaves(ins["target"])),
              "drafter params": sum(math.prod(x.shape) for x in _leaves(state.params))}
    what = (f"XLA's TPU compiler (libtpu, topology {tpu.jax_topology})" if backend == "tpu"
            else f"XLA's CPU compiler on a simulated mesh of {len(devices)} devices (an estimate of the TPU's)")
    return CompileReport(recipe=recipe_name, tpu_type=tpu.name, num_slices=num_slices, backend=what,
                         mesh=dict(mesh.shape), hbm_bytes=tpu.hbm_bytes, peak_flops=tpu.peak_flops,
                         batch_size=recipe.train.batch_size, seq_len=recipe.data.seq_len, steps=recipe.train.steps,
                         params=params, programs=programs, step_flops=train_step_flops(recipe, ins), stages=stages)


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)


# ----------------------------------------------------------------------------- the subprocess (parent side)


def find_libtpu(explicit: str | None = None) -> Path | None:
    """libtpu.so for the `tpu` backend: `explicit`, $TPU_LIBRARY_PATH, the cache `tools/setup_libtpu.sh` fills,
    or an installed `libtpu` package; None when there is none."""
    import importlib.util

    for candidate in (explicit, os.environ.get("TPU_LIBRARY_PATH"), LIBTPU_CACHE / "libtpu" / "libtpu.so"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    spec = importlib.util.find_spec("libtpu")
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / "libtpu.so").is_file():
        return Path(spec.origin).parent / "libtpu.so"
    return None


def worker_env(backend: str, tpu: TpuType, num_slices: int, libtpu: Path | None) -> dict[str, str]:
    """The compile subprocess's environment: the CPU device count of the simulated mesh, or libtpu's path
    with the variables that keep it from probing for TPU hardware and metadata servers."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                             "JAX_PROCESS_ID", "DFLASH_DISTRIBUTED")}
    env["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if backend == "cpu":
        flags.append(f"--xla_force_host_platform_device_count={tpu.chips * num_slices}")
    else:
        env |= {"TPU_LIBRARY_PATH": str(libtpu), "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": tpu.name,
                "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_compile(recipe: str, overrides: list[str], tpu_type: str, num_slices: int = 1, backend: str = "auto",
                libtpu: str | None = None, engine: bool = True, timeout: float | None = None,
                log=print) -> CompileReport:
    """Compile in a subprocess on `backend` (`auto`: `tpu` when libtpu is found, else `cpu`; a failed `tpu`
    compile under `auto` falls back to `cpu`, saying why) and return its report."""
    tpu = parse_tpu_type(tpu_type)
    if num_slices < 1:
        raise ConfigError(f"--num-slices must be >= 1; received {num_slices}")
    if backend not in ("auto", "tpu", "cpu"):
        raise ConfigError(f"--backend must be auto, tpu or cpu; received {backend!r}")
    lib = find_libtpu(libtpu)
    if backend == "tpu" and lib is None:
        raise ConfigError("--backend tpu needs libtpu: run tools/setup_libtpu.sh, or pass --libtpu PATH/libtpu.so "
                          "(or set TPU_LIBRARY_PATH)")
    order = ["tpu", "cpu"] if backend == "auto" and lib is not None else ["cpu"] if backend == "auto" else [backend]
    errors = []
    for which in order:
        cmd = [sys.executable, "-m", "dflash.launch.compile", "--worker", "--recipe", recipe, "--topology", tpu.name,
               "--num-slices", str(num_slices), "--backend", which, *(["--no-engine"] if not engine else []),
               *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(which, tpu, num_slices, lib), capture_output=True,
                              text=True, timeout=timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            return CompileReport.from_json(json.loads(lines[-1]))
        tail = proc.stderr.strip().splitlines()[-12:]
        errors.append(f"{which}: exit {proc.returncode}: " + "\n".join(tail))
        if which == "tpu" and len(order) > 1:
            log(f"the TPU compile failed; falling back to a simulated CPU mesh:\n{errors[-1]}")
    raise RuntimeError("compile failed:\n" + "\n\n".join(errors))


def main(argv: list[str] | None = None) -> int:
    """The subprocess: compile and print the report as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m dflash.launch.compile")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--recipe", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--backend", choices=("tpu", "cpu"), required=True)
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    report = build_report(args.recipe, args.overrides, args.topology, args.num_slices, args.backend,
                          engine=not args.no_engine)
    print(json.dumps(report.to_json()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
