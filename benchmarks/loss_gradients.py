"""How the distribution losses' gradients behave on real training slots: for one batch of a recipe's soft-label
data, the size of each term's gradient w.r.t. the drafter's hidden state per labelled slot, by how much mass the
drafter gives the target's token.

    .venv/bin/python benchmarks/loss_gradients.py --config smollm2 \
        --drafter data/assets/drafters/smollm2-dflash data.dir=runs/loss/data data.labels=soft [--batches 2]

The batch, the anchors and the frozen head are what `dflash train` would use (`train.loop.build_run`, one step's
`block_inputs`); the drafter is `--drafter` (a run dir or an export). For each labelled slot it forms
||d term / d h|| for ce (against the renormalised top-k), tv, kl and rkl (`train.objective.head_divergences`,
one row at a time through the custom gradient), and prints their means per bin of p(label), the drafter's
probability of the target's argmax, and the share of slots where tv's gradient is under 10% of ce's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BINS = (0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2")
    parser.add_argument("--drafter", required=True, help="a run dir or an exported drafter")
    parser.add_argument("--batches", type=int, default=1, help="training batches to measure on (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dflash.configs.recipe import load_recipe
    from dflash.models.target import load_target
    from dflash.train import step as step_mod
    from dflash.train.loop import build_run, init_from_params
    from dflash.train.objective import head_divergences

    recipe = load_recipe(args.config, args.overrides)
    target = load_target(recipe.target)
    arch = target.drafter_arch(recipe.drafter)
    run = build_run(recipe.train, recipe.data, target, arch)
    params = nnx.state(nnx.merge(run.spec.graphdef, init_from_params(args.drafter, arch, target)), nnx.Param)
    captured = {}

    def grab(hidden_BxQxD, head, blocks, block_size, objective):  # replaces head_loss: keep what it reads
        captured.update(hidden=hidden_BxQxD, blocks=blocks)
        return jnp.zeros(()), {}

    step_mod.head_loss = grab
    names = ("ce", "tv", "kl", "rkl")
    rows_out = []
    rng = jax.random.key(recipe.train.seed)
    for _ in range(args.batches):
        batch = next(run.batches)
        rng, key = jax.random.split(rng)
        inputs = step_mod.block_inputs(batch, run.frozen.params, run.spec, key)
        step_mod.drafter_loss(params, inputs, run.frozen.head, run.spec)
        h, b = captured["hidden"], captured["blocks"]
        lm = np.asarray(run.frozen.head.label_map)
        labels = lm[np.asarray(b.labels)]
        ids = lm[np.asarray(b.soft_ids)]
        probs = np.where(ids >= 0, np.asarray(b.soft_probs), 0.0) * (np.asarray(b.label_mask) > 0)[..., None]
        keep = (np.asarray(b.label_mask) > 0) & (labels >= 0) & (probs.sum(-1) > 0)
        h_T = jnp.asarray(np.asarray(h, np.float32)[keep])
        args_T = (jax.lax.stop_gradient(run.frozen.head.matrix), jnp.asarray(labels[keep]),
                  jnp.asarray(np.maximum(ids[keep], 0)), jnp.asarray(probs[keep], jnp.float32))

        def term(x, m, args_T=args_T):  # rows are independent: the gradient of the sum is each row's own
            return jnp.sum(head_divergences(x, *args_T, True, 256, names)[0][:, m])

        out = {name: np.linalg.norm(np.asarray(jax.grad(term)(h_T, m)), axis=-1) for m, name in enumerate(names)}
        _, nll, _ = head_divergences(h_T, *args_T, True, 256, ("ce",))
        out["p_label"] = np.exp(-np.asarray(nll))
        rows_out.append(out)
    data = {k: np.concatenate([r[k] for r in rows_out]) for k in rows_out[0]}
    print(f"{data['p_label'].size} labelled slots; mean ||d term / d h|| per bin of the drafter's p(label):")
    print("| p(label) | slots | ce | tv | kl | rkl | tv / ce |")
    print("|---|---|---|---|---|---|---|")
    table = []
    for lo, hi in zip(BINS[:-1], BINS[1:], strict=True):
        sel = (data["p_label"] >= lo) & (data["p_label"] < hi)
        if not sel.any():
            continue
        means = {n: float(data[n][sel].mean()) for n in names}
        table.append({"lo": lo, "hi": min(hi, 1.0), "slots": int(sel.sum()), **means})
        print(f"| {lo:.2f}-{min(hi, 1.0):.2f} | {int(sel.sum())} | " + " | ".join(f"{means[n]:.3f}" for n in names)
              + f" | {means['tv'] / max(means['ce'], 1e-12):.2f} |")
    weak = float(np.mean(data["tv"] < 0.1 * data["ce"]))
    print(f"tv's gradient under 10% of ce's on {weak:.0%} of the slots")
    print(json.dumps({"slots": int(data["p_label"].size), "bins": table, "tv_under_tenth_of_ce": weak}))


if __name__ == "__main__":
    main()
