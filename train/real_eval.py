"""Real τ inside training (`train.eval_every`): the current drafter decodes a small fixed set of held-out prompts
with the serving engine (greedy, one batch; `serve.acceptance.real_tau`) beside the teacher-forced proxy, and the best
drafter by real τ is kept in `<run_dir>/best/` (z-lab layout + best.json), which `load_drafter(run_dir, cfg,
step="best")`, `dflash serve --drafter RUN_DIR/best` and `dflash eval` read. With `train.eval_temperature` > 0 the
same prompts are also decoded sampled at that temperature (fixed seeds, so the same drafter gives the same τ) and
logged as `eval/real_tau_t/...`; the best drafter is still picked by greedy τ.

The target is read onto process 0's first device for each evaluation (from its checkpoint, `models.target.Target.on`)
and freed after it, so that between evaluations no device holds more than its share of the training mesh.

On several processes (a pod slice) every process gathers the drafter's params (a collective over the sharded state),
process 0 decodes with the gathered drafter on its first device and writes `best/`, and the others wait for it at a
barrier (`BARRIER_TIMEOUT_S`), so that no host runs ahead into the next step's collectives meanwhile.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dflash.data.eval_sets import eval_prompts
from dflash.data.files import fsync_path, fsync_tree
from dflash.models.drafter import DFlashDrafter, DraftVocab
from dflash.models.drafter_io import BEST_DIR, BEST_JSON, RUN_JSON, read_best
from dflash.models.target import Target
from dflash.models.zlab import save_zlab
from dflash.serve.acceptance import real_tau
from dflash.serve.config import SamplingConfig
from dflash.train.config import TrainConfig

log = logging.getLogger(__name__)

BARRIER_TIMEOUT_S = 3600  # how long the other processes wait for process 0's evaluation


def host_params(params: Any) -> Any:
    """The TrainState's `params` as host arrays: fetched (one process), or gathered from every process's shards (a
    collective: every process calls it)."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


def drafter_from_state(graphdef: nnx.GraphDef, host: Any) -> DFlashDrafter:
    """A drafter holding copies of the TrainState's params as `host_params` returned them (put on this process's
    first device), so the training state is never aliased and may be donated by the next step."""
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.array(a, copy=True), host))


def save_best(run_dir: str | Path, drafter: DFlashDrafter, step: int, metrics: dict[str, Any],
              setup: dict[str, Any] | None = None, run_meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `drafter` (z-lab layout), best.json and run.json into `<run_dir>/best/` atomically: everything goes to a
    temporary directory beside it, fsynced, which then replaces best/ by renames (best/ is never half written).

    best.json: {step, tau, tau_per_set, accept_per_position, eval: `setup`} (the prompts, token budget and chat
    template variables the τ was measured with); run.json: `run_meta`, the run's checkpoint meta (recipe,
    architecture, target fingerprint), so that best/ copied alone still carries what `dflash export` writes into
    the model card. Returns the best.json record."""
    run_dir = Path(run_dir)
    best, tmp, old = run_dir / BEST_DIR, run_dir / (BEST_DIR + ".tmp"), run_dir / (BEST_DIR + ".old")
    record = {"step": int(step), "tau": float(metrics["tau"]),
              "tau_per_set": {k[4:]: float(v) for k, v in metrics.items() if k.startswith("tau/")},
              "accept_per_position": [float(x) for x in metrics["accept_per_position"]]}
    if setup is not None:
        record["eval"] = setup
    read_best(run_dir)  # finish an interrupted replacement first
    shutil.rmtree(tmp, ignore_errors=True)
    save_zlab(drafter, tmp)
    (tmp / BEST_JSON).write_text(json.dumps(record, indent=2) + "\n")
    if run_meta is not None:
        (tmp / RUN_JSON).write_text(json.dumps(run_meta) + "\n")
    fsync_tree(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        best.rename(old)
    tmp.rename(best)
    fsync_path(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return record


class RealTauEval:
    """The loop's side of it: prompts built once per run, `due(step)`, and `__call__(step, params)` which
    decodes, keeps `best` (resumed from best.json) and returns the metrics to log under `eval/`. Every process
    makes one and calls it at the same steps; process 0 alone decodes, keeps `best/` and returns metrics (the
    others return {} once it is done; see the module docstring)."""

    def __init__(self, cfg: TrainConfig, target: Target, graphdef: nnx.GraphDef, run_dir: Path,
                 draft_vocab: DraftVocab | None = None, *, template_kwargs: Mapping[str, Any] | None = None,
                 run_meta: dict[str, Any] | None = None):
        self.every, self.final_step, self.new_tokens = cfg.eval_every, cfg.steps, cfg.eval_tokens
        self.sampling = SamplingConfig(temperature=cfg.eval_temperature, seed=cfg.seed) \
            if cfg.eval_temperature > 0 else None
        self.draft_rule = cfg.eval_draft_rule
        self.draft_vocab = draft_vocab  # proposals over the training vocabulary, as the served drafter's
        self.target, self.graphdef, self.run_dir, self.run_meta = target, graphdef, run_dir, run_meta
        self.main = jax.process_index() == 0
        decodes = bool(self.every) and self.main
        # the recipe's data.regen.template_kwargs: the prompts are rendered as the training answers were made
        self.template_kwargs = dict(template_kwargs or {})
        self.setup = {"sets": list(cfg.eval_sets), "per_set": cfg.eval_prompts, "new_tokens": cfg.eval_tokens,
                      "template_kwargs": self.template_kwargs}
        self.prompts = eval_prompts(target.tokenizer, cfg.eval_sets, cfg.eval_prompts,
                                    template_kwargs=self.template_kwargs) if decodes else []
        self.best = read_best(run_dir) if decodes else None
        if decodes:
            log.info("real τ every %d steps: %d prompts (%d of each of %s, first turns), %d new tokens each, chat "
                     "template variables %s (data.regen.template_kwargs)", self.every, len(self.prompts),
                     cfg.eval_prompts, ", ".join(cfg.eval_sets), self.new_tokens,
                     json.dumps(self.template_kwargs) if self.template_kwargs else "none (the template's defaults)")
        if self.best is not None and self.best.get("eval") != self.setup:
            log.warning("%s/%s/%s was measured on another evaluation (%s; this run: %s): its τ %.3f is not compared "
                        "with this run's, and the next evaluation replaces it", run_dir, BEST_DIR, BEST_JSON,
                        self.best.get("eval", "not recorded"), self.setup, self.best["tau"])
            self.best = None

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.final_step)

    def __call__(self, step: int, params: Any) -> dict[str, Any]:
        gathered = host_params(params)  # every process: the state is sharded across them
        out = self._decode(step, gathered) if self.main else {}
        if jax.process_count() > 1:
            from orbax.checkpoint import multihost

            if not self.main:
                log.info("step %d: waiting for process 0's real-τ evaluation", step)
            multihost.get_barrier_sync_fn()(key=f"dflash-real-tau-{step}", timeout_ms=BARRIER_TIMEOUT_S * 1000)
        return out

    def _decode(self, step: int, gathered: Any) -> dict[str, Any]:
        drafter = drafter_from_state(self.graphdef, gathered)
        drafter.draft_vocab = self.draft_vocab
        # the whole target on this process's first device for this evaluation only (read from its checkpoint, freed
        # when it returns): between evaluations no device holds more than its share of the training mesh
        params = self.target.on(jax.local_devices()[0])
        metrics = real_tau(self.target, drafter, self.prompts, self.new_tokens, params=params)
        if self.best is None or metrics["tau"] > self.best["tau"]:
            self.best = save_best(self.run_dir, drafter, step, metrics, self.setup, self.run_meta)
        log.info("step %d: real τ %.3f on %d prompts (%s; %d tokens in %.1f s); best %.3f at step %d; "
                 "teacher-forced τ at the serving walk %.3f, at uniform anchors %.3f", step,
                 metrics["tau"], len(self.prompts), ", ".join(f"{k[4:]} {v:.2f}" for k, v in metrics.items()
                                                             if k.startswith("tau/")),
                 metrics["tokens"], metrics["seconds"], self.best["tau"], self.best["step"],
                 metrics["tf_tau_walk"], metrics["tf_tau_uniform"])
        out = {f"eval/{k}": v for k, v in metrics.items() if k == "tau" or k.startswith("tau/")}
        out["eval/tf_tau_walk"], out["eval/tf_tau_uniform"] = metrics["tf_tau_walk"], metrics["tf_tau_uniform"]
        out.update({f"eval/accept_pos_{i}": v for i, v in enumerate(metrics["accept_per_position"])})
        out["eval/tokens"], out["eval/seconds"] = metrics["tokens"], metrics["seconds"]
        if self.sampling is not None:  # the same prompts sampled: its own metric, not the best drafter's criterion
            sampled = real_tau(self.target, drafter, self.prompts, self.new_tokens, self.sampling,
                               draft_rule=self.draft_rule, params=params)
            log.info("step %d: real τ at temperature %g %.3f (%s)", step, self.sampling.temperature, sampled["tau"],
                     ", ".join(f"{k[4:]} {v:.2f}" for k, v in sampled.items() if k.startswith("tau/")))
            out["eval/real_tau_t"] = sampled["tau"]
            out.update({f"eval/real_tau_t/{k[4:]}": v for k, v in sampled.items() if k.startswith("tau/")})
            out["eval/real_tau_t/temperature"] = self.sampling.temperature
        return out


def eval_from_record(record: dict[str, Any]) -> dict[str, Any] | None:
    """A metrics.jsonl record's real-τ evaluation as {tau, tau_per_set, accept_per_position} (the inverse of
    `RealTauEval`'s `eval/...` keys), or None for a record without one."""
    if "eval/tau" not in record:
        return None
    sets = {k.removeprefix("eval/tau/"): v for k, v in record.items() if k.startswith("eval/tau/")}
    positions = sorted(int(k.removeprefix("eval/accept_pos_")) for k in record if k.startswith("eval/accept_pos_"))
    return {"tau": record["eval/tau"], "tau_per_set": sets,
            "accept_per_position": [record[f"eval/accept_pos_{i}"] for i in positions]}


__all__ = ["BARRIER_TIMEOUT_S", "RealTauEval", "drafter_from_state", "eval_from_record", "host_params",
           "save_best"]
