"""The README's main job (`bin/demo` = `dflash demo --config demo`), as far as the pipeline exists.

1. load the embedded default target;
2. a smoke run of the trainer: a few `dflash train` steps of a small drafter (online target features over the
   packaged set of the target's own answers), checkpointed under `train.run_dir` (a rerun resumes there; it trains
   nothing once the run is complete) and evaluated teacher-forced on held-out conversations. It shows the trainer
   working, not a drafter that accepts: training in earnest is configs/smollm2.yaml's hour;
3. chat with the target (AR decoding) and report decode tokens/s over the steps that compiled nothing;
4. evaluate against the served engine: greedy DFlash vs AR over HTTP on a few prompts of four kinds (GSM8K,
   MT-Bench, HumanEval, MATH-500), each request on both back to back (paired), reporting τ, acceptance by
   position, whether the output equals AR, and as the last line `DFlash vs AR: <speedup>x tokens/s (median of
   <n> paired requests, timing noise +-<x>%; tau <τ>, K=<K>)`. The drafter evaluated is the one
   shipped for the target in data/assets/drafters (trained by configs/smollm2.yaml, 2,600 steps: what
   training in earnest gives) when there is one, else the drafter just trained.
The server (`dflash serve`) and the data stages (`dflash data`) are separate commands.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from dflash.configs.recipe import Recipe
from dflash.models.target import load_target
from dflash.serve.chat import ChatTurn, chat

EVAL_SETS = ("gsm8k", "mtbench", "humaneval", "math500")
EVAL_LIMIT = 3  # conversations per set: 15 paired requests, enough for a 95% interval of the median speed ratio
DEMO_PROMPTS = (
    "What is speculative decoding, in two sentences?",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def run_demo(recipe: Recipe, prompts: Sequence[str] = DEMO_PROMPTS, out: TextIO | None = None,
             train: bool = True, progress: bool = True) -> list[ChatTurn]:
    """Load the target, train the drafter of `recipe.train` (unless `train` is False), then chat."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    target = load_target(recipe.target)
    out.write(f"loaded {target.path.name} ({target.cfg.family}, {target.cfg.num_layers} layers, "
              f"hidden {target.cfg.hidden_size}) in {time.perf_counter() - t0:.1f}s\n")
    if train:
        from dflash.models.registry import shipped_drafter_path
        from dflash.train.loop import run_training

        drafter, steps = recipe.drafter, recipe.train.steps
        served = "the drafter shipped for this target" if shipped_drafter_path(recipe.target.source) else "it"
        out.write(f"\n== a smoke run of the trainer: {steps} steps of a {drafter.num_layers}-layer drafter, block "
                  f"{drafter.block_size} -> {recipe.train.run_dir}\n(it shows the trainer working, not a drafter that "
                  f"accepts; the evaluation below serves {served})\n")
        out.flush()
        result = run_training(recipe, target=target, progress=progress)
        loss = result.last.get("loss")
        out.write(f"trained steps {result.start_step}..{result.final_step} in {result.seconds:.0f}s"
                  + (f", loss {loss:.2f} at the last step\n" if loss is not None else "\n"))
        if result.best:
            per_set = ", ".join(f"{k} {v:.2f}" for k, v in result.best.get("tau_per_set", {}).items())
            out.write(f"real tau of the drafter just trained (engine decode of held-out prompts, step "
                      f"{result.best.get('step')}): {result.best.get('tau', 0):.2f} ({per_set})\n")
        if result.eval:
            ev = result.eval
            per_pos = " ".join(f"{a:.2f}" for a in ev["accuracy_per_position"][1:])
            out.write(f"held-out teacher-forced acceptance length {ev['acceptance_length']:.2f} "
                      f"(1.00 = nothing accepted; block {result.arch.block_size}), loss {ev['loss']:.3f}\n"
                      f"accuracy by draft position: {per_pos}\n")
    out.write("\n== chat with the target (AR decoding)\n")
    turns = chat(target, recipe.sampling, recipe.target.max_seq_len, prompts, out=out)
    total = sum(len(t.result.token_ids) for t in turns)
    steady_tokens, steady_s = sum(t.steady_tokens for t in turns), sum(t.steady_s for t in turns)
    out.write(f"\nAR: {len(turns)} prompts, {total} tokens generated, {steady_tokens / max(steady_s, 1e-9):.1f} decode "
              "tokens/s (the steps that compiled nothing)\n")
    if train:
        short_eval(recipe, target, out, progress)
    return turns


def short_eval(recipe: Recipe, target: Any, out: TextIO, progress: bool = True) -> dict[str, Any]:
    """Evaluate a drafter against the served engine (DFlash and AR servers in this process, real HTTP) on a
    few prompts of four kinds: the one shipped for the target when there is one, else the drafter just
    trained; the report goes to <run_dir>/eval (a rerun resumes it)."""
    from dflash.eval.report import headline_line
    from dflash.eval.run import EvalSettings, evaluate
    from dflash.launch.serving import ServeOptions, build_servers, running
    from dflash.models.registry import shipped_drafter_path

    shipped = shipped_drafter_path(recipe.target.source)
    source = shipped if shipped is not None else Path(recipe.train.run_dir)
    settings = EvalSettings(sets=EVAL_SETS, limit=EVAL_LIMIT, max_new_tokens=recipe.sampling.max_new_tokens)
    which = (f"the drafter shipped for this target ({source}; see its README)" if shipped is not None
             else f"the drafter just trained ({source})")

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    out.write(f"\n== evaluation against the served engine of {which}: greedy DFlash vs AR on {settings.limit} prompts "
              f"each of {', '.join(EVAL_SETS)}, each request on both, paired\n")
    out.flush()
    # DFlash on one port, AR on another over the same weights, one slot each: what `dflash serve --ar-port` serves
    options = ServeOptions(drafter=source, slots=1, port=0, ar_port=0, model_name="dflash", precompile_logprobs=False)
    servers = build_servers(recipe, options, target=target, say=say)
    say(f"DFlash: {servers[0].worker.engine.plan.describe()}")
    with running(servers) as (url, ar_url):
        results, paths = evaluate(url, ar_url, settings, Path(recipe.train.run_dir) / "eval",
                                  drafter={"path": str(source)}, progress=progress)
    for name, r in results["sets"].items():
        per_pos = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        out.write(f"{name}: tau {r['tau']:.2f}, DFlash {r['dflash']['decode_tok_s']:.1f} vs AR "
                  f"{r['ar']['decode_tok_s']:.1f} decode tokens/s, identical to AR: "
                  f"{'yes' if r['mismatches'] == 0 else 'NO'}; acceptance by position: {per_pos}\n")
    out.write(f"report: {paths['report.md']}\n{headline_line(results)}\n")
    return results
