"""Drafters from disk: one `load_drafter(path, target_cfg)` for `dflash train` run dirs (Orbax) and exported
Hugging Face directories (z-lab or speculators layout, ours or released ones), `read_run` for the exporter
(no target needed), and the read side of the trainer's checkpoint format (`train.checkpoint` writes it).

A trainer checkpoint `<run_dir>/checkpoints/<step>/` holds three Orbax items: `state` (the TrainState:
params, optimizer, step, rng), `data` (the loader position, JSON) and `meta` (JSON: FORMAT, the drafter
architecture, the recipe, the target fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash.models.config import DecoderConfig, RopeScaling
from dflash.models.drafter import (
    DFlashDrafter,
    DrafterArch,
    DraftVocab,
    check_fits_target,
    restore_drafter,
    without_retired,
)
from dflash.models.speculators import is_speculators, load_speculators
from dflash.models.zlab import load_zlab, read_config, read_zlab

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

FORMAT = "dflash-train/1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: unreadable, corrupt, or of another architecture."""


def checkpoint_manager(directory: str | Path, keep: int | None = None, create: bool = False,
                       asynchronous: bool = False) -> ocp.CheckpointManager:
    """An Orbax manager over `directory` with the trainer's three items (state, data, meta). Orbax is imported here,
    not with the module: `dflash serve` of an exported drafter never needs it (~0.5 s of its start)."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                           enable_async_checkpointing=asynchronous)
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(Path(directory), options=options, item_handlers=handlers)


def read_meta(manager: ocp.CheckpointManager, directory: Path, step: int) -> dict[str, Any]:
    """The meta JSON of checkpoint `step`; CheckpointError if it is missing or unreadable."""
    if not (directory / str(step) / "meta").is_dir():
        raise CheckpointError(f"checkpoint {directory / str(step)} has no meta/ entry; it is not a "
                              f"{FORMAT} checkpoint or it is incomplete")
    import orbax.checkpoint as ocp

    try:
        return dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
    except Exception as err:  # noqa: BLE001 - any failure to read means the same thing here
        raise CheckpointError(f"checkpoint meta of {directory / str(step)} is unreadable "
                              f"({type(err).__name__}: {err}); the checkpoint is corrupt: delete that step "
                              "directory or use a new run_dir") from err


def read_raw(manager: ocp.CheckpointManager, directory: Path, step: int) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(state as saved: nested dicts of arrays on this process's first device, data state, meta) of
    checkpoint `step`, whatever mesh and process count wrote it."""
    import orbax.checkpoint as ocp

    meta = read_meta(manager, directory, step)
    try:
        local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        saved = manager.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=local), saved)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        restored = manager.restore(step, args=args)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {directory / str(step)} could not be restored "
                              f"({type(err).__name__}: {err}); it is corrupt") from err
    return restored["state"], dict(restored["data"]), meta


def arch_from_meta(fields: dict[str, Any], where: str = "the checkpoint") -> DrafterArch:
    """The DrafterArch recorded in a checkpoint's meta (`meta["arch"]`, JSON values); a field retired since it was
    written (`RETIRED_ARCH_FIELDS`) is dropped when off, and refused (CheckpointError) when on."""
    try:
        fields = without_retired(dict(fields), where)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    fields["layer_ids"] = tuple(fields["layer_ids"])
    fields["layer_types"] = tuple(fields.get("layer_types", ()))
    if fields.get("rope_scaling") is not None:
        scaling = dict(fields["rope_scaling"])
        scaling["freq_factors"] = tuple(scaling.get("freq_factors", ()))
        fields["rope_scaling"] = RopeScaling(**scaling)
    return DrafterArch(**fields)


def _read_checkpoint(path: Path, step: int | None) -> tuple[DFlashDrafter, int, dict[str, Any], Path]:
    """(drafter, step, meta, checkpoints directory) of checkpoint `step` (default: the latest) of a run dir."""
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not directory.is_dir():
        raise FileNotFoundError(f"drafter checkpoint directory {str(directory)!r} does not exist; pass a "
                                "`dflash train` run dir (train.run_dir), its checkpoints/ directory, or a z-lab "
                                "drafter directory (config.json + model.safetensors)")
    directory = directory.resolve()
    manager = checkpoint_manager(directory)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{directory} holds no finished checkpoint")
        steps = sorted(manager.all_steps())
        if step not in steps:
            raise CheckpointError(f"{directory} has no checkpoint step {step}; its steps are {steps}")
        saved, _, meta = read_raw(manager, directory, step)
    finally:
        manager.close()
    if "arch" not in meta:
        raise CheckpointError(f"checkpoint {directory / str(step)} records no drafter architecture (meta has no "
                              "'arch'); it was not written by `dflash train`")
    arch = arch_from_meta(meta["arch"], f"checkpoint {directory / str(step)}")

    def value(keys: tuple[Any, ...], variable: nnx.Param) -> jax.Array:
        node = saved["params"]
        for key in (*keys, "value"):
            node = node[str(key)]
        if tuple(node.shape) != tuple(variable.shape):
            raise CheckpointError(f"{directory} step {step}: parameter {'/'.join(map(str, keys))} has shape "
                                  f"{tuple(node.shape)}, the architecture says {tuple(variable.shape)}")
        return jnp.asarray(node, jnp.float32)

    drafter = restore_drafter(arch, value)  # built abstractly: no random init for the checkpoint to overwrite
    if meta.get("draft_vocab"):
        drafter.draft_vocab = DraftVocab(np.asarray(meta["draft_vocab"], np.int64))
    return drafter, step, meta, directory


def _load_checkpoint(path: Path, target_cfg: DecoderConfig, step: int | None) -> DFlashDrafter:
    drafter, step, _, directory = _read_checkpoint(path, step)
    try:
        check_fits_target(drafter.arch, target_cfg, f"{directory} (step {step})")
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    return drafter


def load_hf_dir(directory: str | Path, target_cfg: DecoderConfig, expect: DrafterArch | None = None) -> DFlashDrafter:
    """A drafter from an exported directory, z-lab or speculators layout (told apart by config.json),
    checked against `target_cfg` and, when given, `expect` (e.g. the recipe's resolved drafter): every
    mismatch of widths, vocab, layer ids, mask id and block size is named in one error."""
    directory = Path(directory).expanduser()
    if is_speculators(read_config(directory)):
        return load_speculators(directory, target_cfg, expect)
    return load_zlab(directory, target_cfg, expect)


BEST_DIR = "best"  # <run_dir>/best: the best drafter by real τ (z-lab layout) and best.json (`train.real_eval`)
BEST_JSON = "best.json"
RUN_JSON = "run.json"  # <run_dir>/best/run.json: the run's checkpoint meta (recipe, arch, target fingerprint) at best


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """`<run_dir>/best/best.json` ({step, tau, tau_per_set, accept_per_position}), or None when no best drafter was
    kept (a replacement interrupted between its two renames is finished first)."""
    best = Path(run_dir) / BEST_DIR
    old = best.with_name(BEST_DIR + ".old")
    if not best.exists() and (old / BEST_JSON).is_file():
        old.rename(best)
    path = best / BEST_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def _run_dir_of(path: Path) -> Path:
    """The run dir of `path`: itself, or its parent when it is a run's checkpoints/ directory (one holding no best/
    of its own)."""
    return path.parent if path.name == "checkpoints" and not (path / BEST_DIR).is_dir() else path


def _best_dir(path: Path) -> Path:
    """`<run_dir>/best` of a run dir (or of its checkpoints/ directory); FileNotFoundError when absent."""
    best = _run_dir_of(path) / BEST_DIR
    if not (best / "config.json").is_file():
        raise FileNotFoundError(f"{best} holds no best drafter: a run keeps <run_dir>/best/ (the best drafter "
                                "by real τ) only when it evaluates real τ during training; set train.eval_every "
                                "(e.g. train.eval_every=100) and train, or load a checkpoint step instead")
    return best


def best_dir_of(path: str | Path, step: int | str | None) -> Path | None:
    """The `best/` directory a drafter argument names: `<run_dir>/best` for a run dir (or its checkpoints/) with step
    "best", the directory itself when it is a best/ (it holds best.json), else None."""
    path = Path(path).expanduser()
    if (path / BEST_JSON).is_file():
        return path
    best = _run_dir_of(path) / BEST_DIR
    return best if _step_arg(step) == "best" and (best / BEST_JSON).is_file() else None


def best_or_latest(path: str | Path, step: int | str | None) -> tuple[int | str | None, str]:
    """`step` for a drafter at `path`, and a message when it was changed: "best" of a `dflash train` run dir that kept
    no `best/` (a run without real-τ evaluation, `train.eval_every=0`, or one stopped before its first) falls back to
    its newest checkpoint (None: the latest), saying so; anything else is returned as given, with "". What `dflash
    eval` and `dflash export` do with `--step best`; `load_drafter(step="best")` itself stays strict."""
    path = Path(path).expanduser()
    if _step_arg(step) != "best":
        return step, ""
    run_dir = _run_dir_of(path)
    if (run_dir / BEST_DIR / "config.json").is_file() or not (run_dir / "checkpoints").is_dir():
        return step, ""  # the best drafter, or not a run dir at all: load_drafter / read_run say what is wrong
    manager = checkpoint_manager((run_dir / "checkpoints").resolve())
    try:
        latest = manager.latest_step()
    finally:
        manager.close()
    if latest is None:
        return step, ""
    read_best(run_dir)  # an interrupted replacement of best/ is finished first
    if (run_dir / BEST_DIR / "config.json").is_file():
        return step, ""
    return None, (f"{run_dir} has no {BEST_DIR}/ (the best drafter by real τ is kept only when the run evaluates it: "
                  f"train.eval_every > 0); using its newest checkpoint, step {latest}, instead of --step best")


def _step_arg(step: int | str | None) -> int | str | None:
    if isinstance(step, str) and step.isdigit():
        return int(step)
    if isinstance(step, str) and step != "best":
        raise ValueError(f"step must be a checkpoint step (int), 'best' or None; received {step!r}")
    return step


def load_drafter(path: str | Path, target_cfg: DecoderConfig, step: int | str | None = None,
                 expect: DrafterArch | None = None) -> DFlashDrafter:
    """The drafter stored at `path`, checked against `target_cfg` (every mismatching field named).

    path: an exported directory (config.json + model.safetensors, z-lab or speculators layout, e.g.
    `<run_dir>/best` or a released drafter), or a `dflash train` run dir or its checkpoints/ directory.
    step: a checkpoint step (int or digits; default: the latest), or "best": the run's best drafter by real
    τ (`<run_dir>/best`, kept when train.eval_every > 0). expect: an exported directory must also match
    this architecture in layer ids, mask id, block size and widths (see `load_hf_dir`)."""
    path = Path(path).expanduser()
    step = _step_arg(step)
    if step == "best":
        return load_hf_dir(_best_dir(path), target_cfg, expect)
    if (path / "config.json").is_file():
        return load_hf_dir(path, target_cfg, expect)
    return _load_checkpoint(path, target_cfg, step)


@dataclasses.dataclass(frozen=True)
class RunDrafter:
    """A trained drafter as the exporter sees it: the drafter, the step it was saved at, where it came from,
    and the run's checkpoint meta (recipe, target fingerprint; None when the run has no checkpoint left)."""

    drafter: DFlashDrafter
    step: int | None
    source: Path
    run_dir: Path
    meta: dict[str, Any] | None
    best: dict[str, Any] | None = None  # best.json of a best/ drafter: its real τ and how it was measured


def read_run(path: str | Path, step: int | str | None = None, target_family: str | None = None) -> RunDrafter:
    """The drafter of a `dflash train` run dir (or its checkpoints/ directory) at `step` (default: the latest
    checkpoint; "best": `<run_dir>/best`), without loading any target. `target_family` is the target's family
    for a `best` drafter whose run kept no checkpoint to record it (default: the checkpoint's, else qwen3).
    CheckpointError / FileNotFoundError name what is missing or corrupt."""
    path = Path(path).expanduser()
    step = _step_arg(step)
    if (path / "config.json").is_file() and not (path / "checkpoints").is_dir():
        raise ValueError(f"{path} is an exported drafter directory, not a `dflash train` run dir; pass the run dir "
                         "(train.run_dir) it came from, with --step best for <run_dir>/best")
    run_dir = path.parent if path.name == "checkpoints" else path
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run dir {str(run_dir)!r} does not exist; pass a `dflash train` run dir "
                                "(train.run_dir)")
    if step == "best":
        best = _best_dir(path)
        # the meta saved beside the best drafter (what the card needs, even with best/ copied alone), else the run's
        # newest checkpoint's (a best/ kept before run.json was)
        meta = json.loads((best / RUN_JSON).read_text()) if (best / RUN_JSON).is_file() else _latest_meta(run_dir)
        family = meta["arch"]["target_family"] if meta and "arch" in meta else target_family or "qwen3"
        record = json.loads((best / BEST_JSON).read_text()) if (best / BEST_JSON).is_file() else {}
        return RunDrafter(read_zlab(best, family), record.get("step"), best, run_dir, meta, record or None)
    if not (run_dir / "checkpoints").is_dir() and path.name != "checkpoints":
        raise FileNotFoundError(f"{run_dir} has no checkpoints/ directory: it is not a `dflash train` run dir, or "
                                "the run saved no checkpoint yet")
    drafter, found, meta, directory = _read_checkpoint(path, step)
    return RunDrafter(drafter, found, directory / str(found), run_dir, meta)


def _latest_meta(run_dir: Path) -> dict[str, Any] | None:
    """The meta of the latest checkpoint of `run_dir`, or None when it has none (or it is unreadable)."""
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        return None
    manager = checkpoint_manager(directory.resolve())
    try:
        step = manager.latest_step()
        return None if step is None else read_meta(manager, directory.resolve(), step)
    except CheckpointError:
        return None
    finally:
        manager.close()


__all__ = ["BEST_DIR", "BEST_JSON", "FORMAT", "RUN_JSON", "CheckpointError", "RunDrafter", "arch_from_meta",
           "best_dir_of", "best_or_latest", "checkpoint_manager", "load_drafter", "load_hf_dir", "read_meta",
           "read_raw", "read_run"]
