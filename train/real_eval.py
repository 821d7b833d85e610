"""Real τ inside training (`train.eval_every`): the current drafter decodes a small fixed set of held-out
prompts with the serving engine (greedy, one batch) beside the teacher-forced proxy, and the best drafter
by real τ is kept in `<run_dir>/best/` (z-lab layout + best.json), which `load_drafter(run_dir, cfg,
step="best")`, `dflash serve --drafter RUN_DIR/best` and `dflash eval` read. With `train.eval_temperature` > 0
the same prompts are also decoded sampled at that temperature (fixed seeds, so the same drafter gives the same
τ) and logged as `eval/real_tau_t/...`; the best drafter is still picked by greedy τ.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash.data.eval_sets import load_eval_set
from dflash.data.files import fsync_path, fsync_tree
from dflash.data.walk import teacher_taus
from dflash.models.drafter import DFlashDrafter, DraftVocab
from dflash.models.target import Target
from dflash.models.tokenizer import ChatTokenizer
from dflash.models.zlab import save_zlab
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import decode
from dflash.serve.speculative import Models, bucket
from dflash.train.config import TrainConfig

log = logging.getLogger(__name__)

BEST_DIR = "best"
BEST_JSON = "best.json"


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt: its set and its chat-templated first user turn."""

    set: str
    ids: tuple[int, ...]


def eval_prompts(tokenizer: ChatTokenizer, sets: Sequence[str], per_set: int, skip: int = 0) -> list[EvalPrompt]:
    """Items `skip` .. `skip + per_set - 1` of each evaluation set (default the first `per_set`), first turn
    only, chat-templated for generation."""
    prompts = []
    for name in sets:
        for item in load_eval_set(name, skip + per_set)[skip:]:
            ids = tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}], add_generation_prompt=True)
            prompts.append(EvalPrompt(name, tuple(int(t) for t in ids)))
    return prompts


def decode_max_len(prompts: Sequence[EvalPrompt], new_tokens: int, block_size: int) -> int:
    """Context per slot: the longest prompt (as the engine pads it for prefill) + the new tokens + one block,
    rounded up to a multiple of 16."""
    longest = max(len(p.ids) for p in prompts)
    need = max(bucket(longest), longest + new_tokens + block_size)
    return -(-need // 16) * 16


def real_tau(target: Target, drafter: DFlashDrafter, prompts: Sequence[EvalPrompt], new_tokens: int,
             sampling: SamplingConfig | None = None, teacher: bool = True,
             prefill_chunk: int | None = None, draft_rule: str = "argmax") -> dict[str, Any]:
    """DFlash decode of `prompts` in one batch with the target's params as loaded, greedy or by `sampling`
    (prompt i seeded `sampling.seed + i`: the same drafter and prompts give the same τ); host metrics:
    `tau` (pooled over prompts: sum(accepted + 1) / verify steps), `tau/<set>`, `accept_per_position`
    (pooled share of steps whose draft i+1 was accepted), `tokens` (new tokens) and `seconds`; and, on the decoded
    answers, teacher-forced τ (`data.walk.teacher_taus`) at the serving walk's blocks (`tf_tau_walk`: `tau` again,
    computed from the stored tokens as `dflash data walk` does, equal to it up to numerics) and at every answer
    position (`tf_tau_uniform`: what uniform training anchors measure; minus `tau`, the train/serve gap), unless
    `teacher` is False (they run the drafter over every answer position of a row at once: at long contexts that
    costs more than the decode). `prefill_chunk`: as `Engine` (long prompts prefilled a chunk at a time, so a batch of
    8K-token prompts does not materialise their whole attention at once); `draft_rule`: as `Engine` (how sampled
    requests draft)."""
    t0 = time.perf_counter()
    k = drafter.arch.block_size
    done = decode(target.params, target.cfg, [list(p.ids) for p in prompts], new_tokens,
                  max_len=decode_max_len(prompts, new_tokens, k), drafter=drafter,
                  stop_ids=target.tokenizer.stop_token_ids, sampling=sampling, prefill_chunk=prefill_chunk,
                  draft_rule=draft_rule)
    metrics: dict[str, Any] = {"tau": _pooled_tau([c.accepted for c in done])}
    for name in dict.fromkeys(p.set for p in prompts):
        metrics[f"tau/{name}"] = _pooled_tau([c.accepted for c, p in zip(done, prompts, strict=True) if p.set == name])
    accepted = np.asarray([a for c in done for a in c.accepted], np.int64)
    metrics["accept_per_position"] = [float(np.mean(accepted > i)) if accepted.size else 0.0 for i in range(k - 1)]
    metrics["tokens"] = sum(len(c.token_ids) for c in done)
    if teacher:
        rows = []
        for c in done:
            tokens = np.asarray(c.prompt_ids + c.token_ids, np.int32)
            mask = np.zeros(tokens.size, np.float32)
            mask[len(c.prompt_ids):] = 1
            rows.append((tokens, mask, tokens.size))
        taus = teacher_taus(Models.of(target.params, target.cfg, drafter), rows, k)
        metrics["tf_tau_walk"], metrics["tf_tau_uniform"] = taus["walk"], taus["uniform"]
    metrics["seconds"] = time.perf_counter() - t0
    return metrics


def _pooled_tau(accepted: Sequence[Sequence[int]]) -> float:
    steps = sum(len(a) for a in accepted)
    return sum(x + 1 for a in accepted for x in a) / steps if steps else 0.0


def drafter_from_state(graphdef: nnx.GraphDef, params: Any) -> DFlashDrafter:
    """A drafter holding copies of the TrainState's `params` (fetched to the host, then put on this process's
    first device), so the training state is never aliased and may be donated by the next step."""
    host = jax.device_get(params)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jnp.array(a, copy=True), host))


def read_best(run_dir: str | Path) -> dict[str, Any] | None:
    """`<run_dir>/best/best.json`, or None when no best drafter was kept (a replacement interrupted between
    its two renames is finished first)."""
    best = Path(run_dir) / BEST_DIR
    old = best.with_name(BEST_DIR + ".old")
    if not best.exists() and (old / BEST_JSON).is_file():
        old.rename(best)
    path = best / BEST_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def save_best(run_dir: str | Path, drafter: DFlashDrafter, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write `drafter` (z-lab layout) and best.json into `<run_dir>/best/` atomically: everything goes to a
    temporary directory beside it, fsynced, which then replaces best/ by renames (best/ is never half
    written). Returns the best.json record."""
    run_dir = Path(run_dir)
    best, tmp, old = run_dir / BEST_DIR, run_dir / (BEST_DIR + ".tmp"), run_dir / (BEST_DIR + ".old")
    record = {"step": int(step), "tau": float(metrics["tau"]),
              "tau_per_set": {k[4:]: float(v) for k, v in metrics.items() if k.startswith("tau/")},
              "accept_per_position": [float(x) for x in metrics["accept_per_position"]]}
    read_best(run_dir)  # finish an interrupted replacement first
    shutil.rmtree(tmp, ignore_errors=True)
    save_zlab(drafter, tmp)
    (tmp / BEST_JSON).write_text(json.dumps(record, indent=2) + "\n")
    fsync_tree(tmp)  # markov_head/ too
    shutil.rmtree(old, ignore_errors=True)
    if best.exists():
        best.rename(old)
    tmp.rename(best)
    fsync_path(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    return record


class RealTauEval:
    """The loop's side of it: prompts built once per run, `due(step)`, and `__call__(step, params)` which
    decodes, keeps `best` (resumed from best.json) and returns the metrics to log under `eval/`. Runs only
    with a single process (logs one warning and stays off otherwise)."""

    def __init__(self, cfg: TrainConfig, target: Target, graphdef: nnx.GraphDef, run_dir: Path,
                 draft_vocab: DraftVocab | None = None):
        self.every, self.final_step, self.new_tokens = cfg.eval_every, cfg.steps, cfg.eval_tokens
        self.sampling = SamplingConfig(temperature=cfg.eval_temperature, seed=cfg.seed) \
            if cfg.eval_temperature > 0 else None
        self.draft_rule = cfg.eval_draft_rule
        self.draft_vocab = draft_vocab  # proposals over the training vocabulary, as the served drafter's
        self.target, self.graphdef, self.run_dir = target, graphdef, run_dir
        if self.every and jax.process_count() > 1:
            log.warning("train.eval_every=%d: in-loop real τ needs a single process (%d here); skipped",
                        self.every, jax.process_count())
            self.every = 0
        self.prompts = eval_prompts(target.tokenizer, cfg.eval_sets, cfg.eval_prompts) if self.every else []
        self.best = read_best(run_dir) if self.every else None

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.final_step)

    def __call__(self, step: int, params: Any) -> dict[str, Any]:
        drafter = drafter_from_state(self.graphdef, params)
        drafter.draft_vocab = self.draft_vocab
        metrics = real_tau(self.target, drafter, self.prompts, self.new_tokens)
        if self.best is None or metrics["tau"] > self.best["tau"]:
            self.best = save_best(self.run_dir, drafter, step, metrics)
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
                               draft_rule=self.draft_rule)
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


__all__ = ["BEST_DIR", "BEST_JSON", "EvalPrompt", "RealTauEval", "decode_max_len", "drafter_from_state",
           "eval_from_record", "eval_prompts", "read_best", "real_tau", "save_best"]
