"""The demo's evaluation step side by side with the chain and with trees: the drafter shipped for the demo
target served beside an AR server (real HTTP, in this process), one prompt each of GSM8K, MT-Bench, HumanEval and
MATH-500, greedy, exactly as the end of `bin/demo` (`dflash.launch.demo.short_eval`), once per mode, one after
the other in one process, each into a fresh run directory. Prints each mode's last line.

    .venv/bin/python benchmarks/demo_tree.py [--modes chain:0:0,tree8+lookup:8:1] [--config demo]

A mode is NAME:TREE_NODES:LOOKUP (0 nodes = the chain; LOOKUP 1 merges prompt-lookup paths). τ is deterministic;
the tokens/s ratio moves with the machine's load, so run it on a quiet machine and say what `uptime` showed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="chain:0:0,tree8+lookup:8:1",
                        help="comma-separated NAME:TREE_NODES:LOOKUP (default: %(default)s)")
    parser.add_argument("--config", default="demo", help="the recipe whose target, prompts and budget are used")
    args = parser.parse_args(argv)
    modes = []
    for spec in args.modes.split(","):
        name, nodes, lookup = spec.split(":")
        modes.append((name, int(nodes), lookup == "1"))

    from dflash.configs.recipe import load_recipe
    from dflash.launch.demo import short_eval
    from dflash.models.target import load_target

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    root = Path(tempfile.mkdtemp(prefix="demo_tree-"))
    lines = []
    for name, nodes, lookup in modes:
        run = dataclasses.replace(recipe, serve=dataclasses.replace(recipe.serve, tree_nodes=nodes, tree_ngram=lookup),
                                  train=dataclasses.replace(recipe.train, run_dir=str(root / name)))
        t0 = time.perf_counter()
        print(f"### {name} (tree nodes {nodes}, prompt lookup {lookup})", flush=True)
        results = short_eval(run, target, sys.stdout, progress=False)
        lines.append((name, results, time.perf_counter() - t0))
    from dflash.eval.report import headline_line

    print("\n| mode | last line | seconds |\n|---|---|---|")
    for name, results, seconds in lines:
        print(f"| {name} | `{headline_line(results)}` | {seconds:.0f} |")


if __name__ == "__main__":
    main()
