"""Training checkpoints with Orbax (docs/design.md §4.5): state, data-iterator state and run metadata per step.

Layout under `<run_dir>/checkpoints/<step>/`:
- `state/`: the `TrainState` pytree (fp32 master params, optimizer state, step, RNG key), sharded
  arrays written by every process, restored straight into the run's shardings;
- `data/`:  the data iterator's state (JSON) taken right after the step's batch was drawn;
- `meta/`:  JSON: format version, the resolved drafter architecture, the recipe, target fingerprint.

Saves are asynchronous (the step loop goes on while the arrays are written); Orbax writes into a
temporary directory and renames it when complete, so a run killed mid-save leaves at most an unfinished
temporary directory that is never picked up as a checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dflash.models.drafter import RETIRED_ARCH_FIELDS, DrafterArch
from dflash.models.drafter_io import FORMAT, CheckpointError, checkpoint_manager, read_meta, read_raw


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Async Orbax checkpoints of one run; `meta` (JSON-able) is written with every step and checked on
    restore: its `arch` entry must equal the checkpoint's."""

    def __init__(self, directory: str | Path, meta: dict[str, Any], keep: int = 3):
        self.directory = Path(directory).resolve()
        self.meta = {"format": FORMAT, **meta}
        self._manager = checkpoint_manager(self.directory, keep=keep, create=True, asynchronous=True)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict[str, Any]) -> None:
        """Start writing checkpoint `step` in the background (returns once the arrays are copied off)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  meta=ocp.args.JsonSave(self.meta))
        self._manager.save(step, args=args, force=True)

    def read_meta(self, step: int) -> dict[str, Any]:
        """The meta JSON of checkpoint `step`; CheckpointError if it is missing or unreadable."""
        return read_meta(self._manager, self.directory, step)

    def check_compatible(self, step: int) -> dict[str, Any]:
        """Raise CheckpointError naming every architecture field that differs from this run's."""
        meta = self.read_meta(step)
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {self.directory / str(step)} has format {meta.get('format')!r}; "
                                  f"this trainer reads {FORMAT!r}")
        # fields added since a checkpoint was written hold their defaults in it (e.g. selector_rank 0), and fields
        # retired since (docs/retired.md) their off value in this run (a checkpoint with the option on is refused)
        defaults = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default  # as JSON reads them
                    for f in dataclasses.fields(DrafterArch) if f.default is not dataclasses.MISSING}
        defaults.update(RETIRED_ARCH_FIELDS)
        ours, theirs = ({**defaults, **self.meta.get("arch", {})}, {**defaults, **meta.get("arch", {})})
        note = {k: " (retired from this trainer: docs/retired.md)" for k in RETIRED_ARCH_FIELDS}
        diffs = [f"{k}: checkpoint {theirs.get(k)!r} vs run {ours.get(k)!r}{note.get(k, '')}"
                 for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds a drafter of another architecture ("
                + "; ".join(diffs) + "); resume it with its own config or start a new run_dir")
        return meta

    def restore(self, step: int, state_like: Any, shardings: Any) -> tuple[Any, dict[str, Any]]:
        """(state, data_state) of checkpoint `step`, arrays placed with `shardings`.

        `state_like` gives the structure, shapes and dtypes (arrays or ShapeDtypeStructs). The
        architecture is checked first; any Orbax failure becomes a CheckpointError naming the path.
        """
        self.check_compatible(step)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(state_like, shardings)),
                                  data=ocp.args.JsonRestore())
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as err:  # noqa: BLE001 - Orbax raises many types for bad files; all mean "unusable"
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} could not be restored ({type(err).__name__}: {err}); "
                "it is corrupt or was written for a different state layout: delete it or use a new run_dir"
            ) from err
        return restored["state"], dict(restored["data"])

    def restore_raw(self, step: int) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """(state as saved: nested dicts of host arrays, data_state, meta) of checkpoint `step`, without
        knowing the architecture (for inspection, export and comparisons)."""
        return read_raw(self._manager, self.directory, step)

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


__all__ = ["CheckpointError", "Checkpointer", "FORMAT"]
