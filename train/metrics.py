"""Training metrics: metrics.jsonl + TensorBoard + wandb, written by process 0 only.

The loop hands over host values (already fetched, one step late so the device never waits on the
host); this module only formats and writes. Vector metrics (per-position accuracy) are written as one
scalar per position (`accuracy/pos_01`, ...), and as a list in metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np


class NonFiniteMetricError(FloatingPointError):
    """A loss or gradient norm became NaN or Inf; the message names the step."""


def check_finite(metrics: dict[str, Any], step: int) -> None:
    """Raise NonFiniteMetricError naming `step` if any metric holds a NaN or Inf."""
    bad = sorted(k for k, v in metrics.items() if not np.all(np.isfinite(np.asarray(v, np.float64))))
    if bad:
        values = ", ".join(f"{k}={np.asarray(metrics[k]).tolist()}" for k in bad)
        raise NonFiniteMetricError(
            f"non-finite training metrics at step {step}: {values}; the run stops here (the last checkpoint "
            "before it is intact: lower train.lr, raise train.warmup_frac or check the data, then rerun)")


def flatten(metrics: dict[str, Any]) -> dict[str, float]:
    """Scalars as floats; a vector metric `name` [K] becomes `name/pos_00` .. `name/pos_{K-1}`."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        arr = np.asarray(value, np.float64)
        if arr.ndim == 0:
            out[name] = float(arr)
        else:
            width = max(2, len(str(arr.size - 1)))
            out.update({f"{name}/pos_{i:0{width}d}": float(x) for i, x in enumerate(arr.reshape(-1))})
    return out


class MetricsWriter:
    """Append-only metrics sinks of one run (no-ops on processes other than 0)."""

    def __init__(self, run_dir: str | Path, *, config: dict[str, Any], wandb_mode: str = "offline",
                 tensorboard: bool = True, enabled: bool = True, run_name: str | None = None):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project="dflash", dir=str(self.run_dir), mode=wandb_mode, config=config,
                                     name=run_name or self.run_dir.name, resume="allow",
                                     id=_wandb_id(self.run_dir), reinit="create_new")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step}
        for name, value in metrics.items():
            arr = np.asarray(value, np.float64)
            record[name] = float(arr) if arr.ndim == 0 else arr.tolist()
        self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self._jsonl.flush()
        scalars = flatten(metrics)
        if self._tb is not None:
            for name, value in scalars.items():
                if math.isfinite(value):
                    self._tb.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_id(run_dir: Path) -> str:
    """A stable wandb run id per run directory, so a resumed run continues the same wandb run."""
    path = run_dir / "wandb_id"
    if path.is_file():
        return path.read_text().strip()
    import uuid

    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id)
    return run_id


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl`, in order ([] if there is none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["MetricsWriter", "NonFiniteMetricError", "check_finite", "flatten", "read_metrics"]
