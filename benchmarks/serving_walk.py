"""The serving walk of a drafter over the first rows of a recipe's training set (issue 33, item 1): where greedy
DFlash decoding puts its blocks, the accept-length distribution there, teacher-forced τ at the walk's blocks
against teacher-forced τ at uniform anchors (the train/serve gap), and what the two walks cost per row.

    .venv/bin/python benchmarks/serving_walk.py --config smollm2 \
        --drafter data/assets/drafters/smollm2-dflash [--rows 48] [--engine-rows 16] [--json F]

The teacher-forced walk (`data.walk.walk_teacher`: one target and one drafter forward per row) runs on `--rows`
rows; the engine walk (`data.walk.walk_engine`, greedy DFlash through `serve.engine.Engine`, 8 slots) on the first
`--engine-rows` of them, and the two are compared block for block (they agree exactly in fp32 on the tiny models,
tests/test_walk.py). Prints one screen; nothing is written unless --json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--engine-rows", type=int, default=16)
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import numpy as np

    from dflash.configs.recipe import load_recipe
    from dflash.data.examples import build_examples
    from dflash.data.walk import walk_engine, walk_teacher
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import teacher_taus
    from dflash.serve.engine import Engine
    from dflash.serve.plan import Chain, Limits
    from dflash.serve.speculative import Models

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    drafter = load_drafter(args.drafter, target.cfg)
    k = drafter.arch.block_size
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=args.rows)
    models = Models.of(target.params, target.cfg, drafter)
    walk_teacher(models, *examples[0], k)  # compile the first length outside the timing
    t0 = time.perf_counter()
    teacher = [walk_teacher(models, t, m, n, k, i) for i, (t, m, n) in enumerate(examples)]
    teacher_s = (time.perf_counter() - t0) / len(examples)
    taus = teacher_taus(models, examples, k)
    counts = np.bincount([a for r in teacher for a in r.accepted], minlength=k)
    rows = [(i, t, m, n) for i, (t, m, n) in enumerate(examples[:args.engine_rows])]
    max_len = -(-(max(n for _, _, n in examples) + k + 1) // 16) * 16
    engine = Engine(target.params, target.cfg, drafter, Chain(k), Limits(slots=8, max_len=max_len))
    walk_engine(engine, rows[:1], target.tokenizer.stop_token_ids)  # compile outside the timing
    t0 = time.perf_counter()
    by_engine = walk_engine(engine, rows, target.tokenizer.stop_token_ids)
    engine_s = (time.perf_counter() - t0) / max(len(rows), 1)
    same = sum(a == b for a, b in zip(teacher, by_engine, strict=False))
    blocks_same = sum(x == y for a, b in zip(teacher, by_engine, strict=False)
                      for x, y in zip(zip(a.starts, a.accepted, strict=True), zip(b.starts, b.accepted, strict=True),
                                      strict=False))
    result = {
        "rows": len(examples), "engine_rows": len(rows), "block_size": k,
        "mismatched_rows": sum(r.mismatch for r in teacher),
        "answer_tokens": sum(r.answer for r in teacher), "matched_tokens": sum(r.matched for r in teacher),
        "blocks": int(counts.sum()), "accept_share": [float(c / max(counts.sum(), 1)) for c in counts],
        "walk_tau": taus["walk"], "uniform_tf_tau": taus["uniform"],
        "engine_walk_tau": float(np.mean([a + 1 for r in by_engine for a in r.accepted])),
        "teacher_s_per_row": teacher_s, "engine_s_per_row": engine_s,
        "engine_rows_identical": same, "engine_blocks_identical": blocks_same,
        "engine_blocks": sum(len(r.starts) for r in by_engine),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
