"""Teacher-forced acceptance of sampled drafts: drafters side by side on the same answers, both draft rules.

    .venv/bin/python benchmarks/sampled_acceptance.py --answers runs/t1/data/regenerated.jsonl \
        --drafter shipped=data/assets/drafters/smollm2-dflash --drafter mix=runs/study33/mix \
        [--config smollm2] [--rows 103] [--temperature 1] [--seq-len 448] [--json F] [--write]

Live sampled τ (`benchmarks/drafter_tau.py --temperature 1`) is a sample: each drafter's decode follows its own
random continuation, so two drafters differ by a few hundredths between prompt sets and seeds (D64, D65) and
a loss that moves acceptance by that much cannot be told apart from noise. This measures the same quantity
without the noise: on fixed answers (e.g. the target's own samples, `dflash data regenerate` at the serving
temperature), for every answer position a and block slot k, with the target's distribution p and the drafter's
q at `--temperature` given the true prefix,
- `argmax` drafts: slot k accepted with probability p(argmax q) (one-hot rejection, docs/design.md pitfall 8);
- `sample` drafts (`serve.draft_rule=sample`, speculative sampling): with probability sum_v min(p(v), q(v)).
Per slot the mean over positions, and a chain τ = 1 + mean over anchors of sum_k prod_{j<=k} acc_j (slots
independent given the true prefix: teacher-forced, so above live τ, which conditions on the drafts). Every
drafter sees the same positions, so the comparison is paired. q covers the drafter's draft vocabulary; p's mass
outside it counts as rejected.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def chain_tau(accept_NxK: object) -> float:
    """1 + mean over anchors of sum_k prod_{j<=k} accept_j: the expected accepted length per block when the
    slots accept independently with these probabilities, plus the target's own token."""
    import numpy as np

    a = np.asarray(accept_NxK, np.float64)
    return float(np.mean(1.0 + np.cumprod(a, axis=1).sum(axis=1)))


def slot_accept(models: object, drafter: object, tokens_1xS: object, t: float) -> tuple[object, object]:
    """Per anchor a [S] and slot 1..K-1 of one row: (p(argmax q), sum_v min(p, q)), p and q at temperature t,
    teacher-forced on the row's true prefix."""
    import jax
    import jax.numpy as jnp

    from dflash.models.decoder import forward
    from dflash.models.drafter import concat_features
    from dflash.serve.acceptance import block_hidden
    from dflash.serve.speculative import draft_logits

    k = drafter.arch.block_size
    s = tokens_1xS.shape[1]
    logits, feats = forward(models.target_params, models.target_cfg, tokens_1xS,
                            layer_ids=drafter.arch.layer_ids)
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32) / t, -1)  # [S, V]
    positions = jnp.arange(s)[:, None] + jnp.arange(k)[None]
    hidden = block_hidden(models, tokens_1xS, concat_features(feats), k)
    logq = jax.nn.log_softmax(draft_logits(models, hidden) / t, -1)  # [S, K-1, V']
    # slot j of the block at anchor a predicts position a + j, from the target's logits at a + j - 1
    p = jnp.exp(logp[jnp.clip(positions[:, 1:] - 1, 0, s - 1)])  # [S, K-1, V]
    p_draft = p if models.draft_ids is None else jnp.take(p, models.draft_ids, axis=-1)
    onehot = jnp.take_along_axis(p_draft, jnp.argmax(logq, -1)[..., None], -1)[..., 0]
    return onehot, jnp.minimum(p_draft, jnp.exp(logq)).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, required=True,
                        help="JSONL of conversations ({messages: [...]}), e.g. the target's sampled answers")
    parser.add_argument("--drafter", action="append", required=True, help="NAME=PATH[@STEP] (repeatable)")
    parser.add_argument("--config", default="smollm2", help="recipe whose target scores (default smollm2)")
    parser.add_argument("--rows", type=int, default=0, help="first N conversations (default 0: all)")
    parser.add_argument("--temperature", type=float, default=1.0, help="p and q at this temperature (default 1)")
    parser.add_argument("--seq-len", type=int, default=448, help="conversations truncated to this many tokens")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--write", action="store_true", help="record the table in a study page (see --page)")
    parser.add_argument("--page", type=Path, default=None, help="with --write: the study page to add the section to")
    args = parser.parse_args()
    if args.temperature <= 0 or args.rows < 0 or args.seq_len < 8:
        parser.error("--temperature must be > 0, --rows >= 0 and --seq-len >= 8")
    from benchmarks.drafter_tau import parse_drafter

    try:
        drafters = [parse_drafter(text) for text in args.drafter]
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    records = [json.loads(line) for line in args.answers.read_text().splitlines() if line.strip()]
    if not records or any("messages" not in r for r in records):
        parser.error(f"--answers {args.answers} must hold JSON lines with `messages`")
    records = records[: args.rows or None]

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks._report import machine, write_study
    from dflash.configs.recipe import load_recipe
    from dflash.data.chat_tokens import tokenize_rows
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.acceptance import LENGTH_STEP
    from dflash.serve.speculative import Models

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    rows, skipped = tokenize_rows(target.tokenizer, [r["messages"] for r in records], args.seq_len)
    t = args.temperature
    results = []
    for name, path, step in drafters:
        drafter = load_drafter(path, target.cfg, step=step)
        models = Models.of(target.params, target.cfg, drafter)
        k = drafter.arch.block_size

        # the weights are arguments, not closed-over constants: XLA would otherwise fold them into the program
        row_accept = jax.jit(functools.partial(slot_accept, drafter=drafter, t=t))
        found = {"argmax": [], "sample": []}
        for tokens, mask, n in rows:
            length = -(-n // LENGTH_STEP) * LENGTH_STEP  # one compile per length bucket, as the walk pads
            padded = np.zeros((1, length), np.int32)
            padded[0, :n] = tokens[:n]
            onehot, sampled = jax.device_get(row_accept(models, tokens_1xS=jnp.asarray(padded)))
            answer = np.flatnonzero(np.asarray(mask[:n]))
            answer = answer[answer + k - 1 < n]  # blocks whose every slot lies inside the row
            found["argmax"].append(onehot[answer])
            found["sample"].append(sampled[answer])
        for rule, parts in found.items():
            accept = np.concatenate(parts)
            results.append({"name": name, "path": path, "step": step, "draft_rule": rule, "positions": len(accept),
                            "accept_per_slot": [round(float(a), 4) for a in accept.mean(0)],
                            "chain_tau": round(chain_tau(accept), 4)})
            print(json.dumps(results[-1]), flush=True)

    command = shlex.join([".venv/bin/python", "benchmarks/sampled_acceptance.py", *sys.argv[1:]])
    lines = [f"## Teacher-forced acceptance of sampled drafts: {' vs '.join(d[0] for d in drafters)}", "",
             f"`{command}` on {machine()}; target of recipe `{args.config}`; {len(rows)} conversations of "
             f"`{args.answers.name}` ({skipped} without an answer token skipped), p and q at T={t:g}, "
             "teacher-forced on the true prefix (above live τ; a paired comparison).", "",
             "| drafter | draft rule | positions | acceptance per slot | chain τ (teacher-forced) |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} (`{r['path']}`{'@' + r['step'] if r['step'] else ''}) | {r['draft_rule']} | "
                     f"{r['positions']} | {' '.join(f'{a:.3f}' for a in r['accept_per_slot'])} | "
                     f"{r['chain_tau']:.3f} |")
    text = "\n".join(lines)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"answers": str(args.answers), "rows": len(rows), "temperature": t,
                                         "results": results}, indent=1) + "\n")
    if args.write:
        print(f"written to {write_study('sampled_acceptance_' + '_'.join(d[0] for d in drafters), text, args.page)}")


if __name__ == "__main__":
    main()
