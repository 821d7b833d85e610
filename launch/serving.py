"""`dflash serve` as one library call: a recipe's target and drafter behind the OpenAI-compatible server.

    serve_recipe(load_recipe("smollm2"), ServeOptions(port=8000))     # until SIGINT / SIGTERM

`build_server` does everything but serving (load the target and the drafter, pick K, build the engine and
a bound server). It lives in the launch layer because `block_size="auto"` measures acceptance with
`train.real_eval`, above `serve` in the layer order (docs/decisions.md D40).
"""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path
from typing import Any

from dflash.configs.recipe import Recipe
from dflash.models.drafter_io import load_drafter
from dflash.models.target import load_target
from dflash.serve.config import DRAFT_RULES
from dflash.serve.engine import Engine
from dflash.serve.http import DFlashServer, make_server


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to serve a recipe (`dflash serve`'s flags).

    drafter: a `dflash train` run dir or an exported drafter dir (None: the recipe's train.run_dir); step: a
    checkpoint step of a run dir, "best", or None (the latest); ar: serve the target alone; block_size: K
    at inference, a K >= 2, 0 (the drafter's training K) or "auto" (`_auto_block_size`); tree_nodes /
    tree_ngram: the recipe's `serve` section when None (`ServeConfig`: 0 the chain, N a tree of N nodes, "auto"
    measured here, `_auto_tree_nodes`); draft_rule: the recipe's serve.draft_rule when None; slots: concurrent
    sequences per step; prefill_chunk: a longer prompt is prefilled one chunk of this many tokens per engine step
    (0: in one call; `Engine`); steps_per_dispatch: decode steps per host round trip (`Engine`); model_name: the
    model id clients send (None: target.source); precompile: compile every shape the engine can use before serving
    (`Engine.precompile`; False: requests compile as they come); the rest as `make_server`'s arguments."""

    drafter: str | Path | None = None
    step: int | str | None = None
    ar: bool = False
    block_size: int | str = 0
    tree_nodes: int | str | None = None
    tree_ngram: bool | None = None
    draft_rule: str | None = None
    slots: int = 8
    prefill_chunk: int = 512
    steps_per_dispatch: int = 4
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    read_timeout: float | None = 30.0
    unknown_fields: str = "ignore"
    precompile: bool = True

    def __post_init__(self) -> None:
        k = self.block_size
        if not (k == "auto" or (isinstance(k, int) and not isinstance(k, bool) and (k == 0 or k >= 2))):
            raise ValueError(f"block_size must be an integer >= 2, 0 (the drafter's training K) or 'auto'; "
                             f"received {k!r}")
        n = self.tree_nodes
        if not (n is None or n == "auto" or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)):
            raise ValueError(f"tree_nodes must be an integer >= 0 (0: the chain), 'auto' or None (the recipe's); "
                             f"received {n!r}")
        if self.draft_rule is not None and self.draft_rule not in DRAFT_RULES:
            raise ValueError(f"draft_rule must be argmax, sample or None (the recipe's); received {self.draft_rule!r}")
        c = self.prefill_chunk
        if not (isinstance(c, int) and not isinstance(c, bool) and (c == 0 or (c >= 16 and c & (c - 1) == 0))):
            raise ValueError(f"prefill_chunk must be 0 (off) or a power of two >= 16; received {c!r}")
        r = self.steps_per_dispatch
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
            raise ValueError(f"steps_per_dispatch must be an integer >= 1; received {r!r}")

    def drafter_dir(self, recipe: Recipe) -> Path:
        return Path(self.drafter or recipe.train.run_dir).expanduser()


def _auto_block_size(target: Any, drafter: Any, source: Path, max_len: int) -> int:
    """`block_size="auto"`: acceptance per position from the run's best.json when it has one, else measured
    here on held-out prompts (2 each of GSM8K, MT-Bench, HumanEval, 48 tokens, at the training K); step
    costs measured here; the K with the most expected tokens per second (`serve.autoblock`)."""
    from dflash.serve.autoblock import candidate_ks, format_table, pick_block_size, step_costs
    from dflash.train.real_eval import eval_prompts, read_best, real_tau

    prompts = eval_prompts(target.tokenizer, ("gsm8k", "mtbench", "humaneval"), 2)
    best = read_best(source) if source.is_dir() else None
    if best and len(best.get("accept_per_position", ())) == drafter.arch.block_size - 1:
        accept, where = best["accept_per_position"], f"{source}/best/best.json (step {best.get('step')})"
    else:
        accept, where = real_tau(target, drafter, prompts, 48)["accept_per_position"], "6 held-out prompts"
    costs = step_costs(target.params, target.cfg, drafter, candidate_ks(drafter.arch.block_size), prompts[0].ids,
                       max_len=max_len)
    k, table = pick_block_size(accept, costs)
    print(f"--block-size auto: acceptance from {where}, step costs measured here\n{format_table(table, k)}",
          flush=True)
    return k


def _auto_tree_nodes(target: Any, drafter: Any, k: int, max_len: int, ngram: bool) -> int:
    """`tree_nodes="auto"`: τ and step cost measured here for each candidate budget (`autoblock.tree_costs`) on
    held-out prompts (1 each of GSM8K, MT-Bench, HumanEval, 32 tokens); the N with the most tokens per second."""
    from dflash.serve.autoblock import candidate_nodes, format_table, pick_tree_nodes, tree_costs
    from dflash.train.real_eval import eval_prompts

    prompts = [p.ids for p in eval_prompts(target.tokenizer, ("gsm8k", "mtbench", "humaneval"), 1)]
    costs = tree_costs(target.params, target.cfg, drafter, k, candidate_nodes(k), prompts, max_len=max_len,
                       ngram=ngram)
    n, table = pick_tree_nodes(costs)
    print(f"--tree-nodes auto (K={k}; 0 = the chain): tau and step cost measured here\n"
          + format_table(table, n).replace("  K   E[tokens/step]", "  N   E[tokens/step]"), flush=True)
    return n


def build_server(recipe: Recipe, options: ServeOptions) -> DFlashServer:
    """Load the recipe's target and (unless `options.ar`) the drafter, pick K, build the engine (the recipe's
    sampling as the requests' default) and return a bound server with its engine thread started."""
    target = load_target(recipe.target)
    max_len = recipe.target.max_seq_len
    nodes = recipe.serve.tree_nodes if options.tree_nodes is None else options.tree_nodes
    ngram = recipe.serve.tree_ngram if options.tree_ngram is None else options.tree_ngram
    rule = recipe.serve.draft_rule if options.draft_rule is None else options.draft_rule
    if options.ar:
        block, drafter, nodes, ngram, rule = None, None, 0, False, "argmax"  # AR mode needs no drafter
    else:
        source = options.drafter_dir(recipe)
        drafter = load_drafter(source, target.cfg, step=options.step)
        if options.block_size == "auto":
            block = _auto_block_size(target, drafter, source, max_len)
        else:
            block = options.block_size or drafter.arch.block_size
        if nodes == "auto":
            nodes = _auto_tree_nodes(target, drafter, block, max_len, ngram)
    engine = Engine(target.params, target.cfg, drafter, slots=options.slots, max_len=max_len, block_size=block,
                    sampling=recipe.sampling, tree_nodes=nodes, ngram=ngram and nodes >= 3,
                    prefill_chunk=options.prefill_chunk or None, steps_per_dispatch=options.steps_per_dispatch,
                    draft_rule=rule)
    if options.precompile:
        count, seconds = engine.precompile()
        print(f"precompiled {count} programs in {seconds:.1f} s (every prompt length and attention span up to "
              f"{max_len} tokens; --no-precompile skips this)", flush=True)
    return make_server(engine, target.tokenizer, options.model_name or recipe.target.source, options.host,
                       options.port, max_body_bytes=options.max_body_bytes, read_timeout=options.read_timeout,
                       api_key=options.api_key, unknown_fields=options.unknown_fields)


def serve_recipe(recipe: Recipe, options: ServeOptions) -> None:
    """`build_server`, then serve until SIGINT or SIGTERM (which finish the requests in flight); call from the
    main thread (signal handlers are installed)."""
    server = build_server(recipe, options)
    engine = server.worker.engine
    tree = f", tree of {engine.tree_nodes} nodes" + (" + prompt lookup" if engine.ngram_nodes else "")
    mode = "AR" if options.ar else (f"DFlash K={engine.k}{tree if engine.tree_nodes else ''} "
                                    f"(drafter {options.drafter_dir(recipe)})")
    print(f"serving {server.model_name} on http://{options.host}:{server.server_address[1]}/v1 - {mode}, "
          f"{options.slots} slots; Ctrl-C stops", flush=True)

    def stop(*_: object) -> None:
        threading.Thread(target=server.close, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()
    server.worker.shutdown()


__all__ = ["ServeOptions", "build_server", "serve_recipe"]
