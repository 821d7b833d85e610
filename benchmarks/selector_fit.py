"""DFlash2's path selector trained on a fixed drafter (issue 34, item 2): held-out greedy τ of the serving walk with
the selector's walk against the drafter's argmax drafts.

    .venv/bin/python benchmarks/selector_fit.py --config smollm2 \
        --drafter data/assets/drafters/smollm2-dflash [--train-rows 96] [--eval-rows 32] [--steps 400] \
        [--rank 256] [--top-k 16] [--lr 3e-3] [--batch 512] [--save DIR] [--json F]

The selector's loss trains the selector only (`train.selector`: the backbone's hidden states and unary logits are
held fixed), so a selector trained on top of a fixed drafter is what `drafter.selector` adds to it. Rows are the
recipe's training set (the target's own greedy answers): the first `--train-rows` train it, the next `--eval-rows`
are held out. One target forward and one drafter forward per row (as `data.walk.teacher_hits`) give, at every
answer position, the block's hidden states, its top-k unary candidates and the target's greedy labels; a fresh
selector (`models.drafter.CandidateSelector`) is then fitted with Adam on blocks anchored at uniform answer
positions, on the selector's loss (`train.selector`: the per-slot cross-entropy given the label before it; D55's
second loss, `path`, the CRF over the top-k lattice, is at git tag arch3-retired-options, docs/retired.md). τ is
the teacher walk's (`data.walk.teacher_taus`' `walk`: the blocks greedy serving visits; equal to the engine's,
tests/test_walk.py and tests/test_selector.py), from the same arrays for the argmax and the selector. Prints one
screen; nothing is written unless --json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2")
    parser.add_argument("--drafter", default="data/assets/drafters/smollm2-dflash")
    parser.add_argument("--train-rows", type=int, default=96)
    parser.add_argument("--eval-rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=512, help="blocks per update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default="", help="write the drafter with each fitted selector as a DFlash2 z-lab "
                        "export into SAVE/<loss> (for benchmarks/drafter_tau.py)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from dflash.configs.recipe import load_recipe
    from dflash.data.examples import build_examples
    from dflash.models.decoder import embed, forward
    from dflash.models.drafter import BlockVisibility, CandidateSelector, DFlashDrafter, concat_features
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.models.zlab import save_zlab
    from dflash.serve.acceptance import LENGTH_STEP, answer_spans, chain, matched_prefix
    from dflash.serve.speculative import Models, draft_logits
    from dflash.train.objective import default_gamma
    from dflash.train.selector import lattice_loss

    recipe = load_recipe(args.config)
    target = load_target(recipe.target)
    drafter = load_drafter(args.drafter, target.cfg)
    arch, k, c = drafter.arch, drafter.arch.block_size, args.top_k
    models = Models.of(target.params, target.cfg, drafter)
    examples, _ = build_examples(recipe.data, target.tokenizer, limit=args.train_rows + args.eval_rows)
    vocab = target.cfg.vocab_size
    row_of = np.full(vocab, -1, np.int32)  # token id -> its draft-vocabulary row (-1: not proposable)
    if models.draft_ids is not None:
        row_of[np.asarray(models.draft_ids)] = np.arange(len(models.draft_ids), dtype=np.int32)
    else:
        row_of[:] = np.arange(vocab, dtype=np.int32)

    @jax.jit
    def collect(models, tokens_1xS):
        """Per anchor a (every position): next ids [S], hidden [S, K-1, D], top-k ids / logits [S, K-1, C], the
        logit of the target's greedy token at each slot [S, K-1] (-inf outside the draft vocabulary)."""
        s = tokens_1xS.shape[1]
        logits, feats = forward(models.target_params, models.target_cfg, tokens_1xS, layer_ids=arch.layer_ids)
        next_S = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
        a_S = jnp.arange(s, dtype=jnp.int32)
        ids = jnp.concatenate([tokens_1xS[0][:, None], jnp.full((s, k - 1), arch.mask_token_id, jnp.int32)], axis=1)
        pos = a_S[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
        emb = embed(models.target_params, ids.reshape(1, s * k)).astype(jnp.float32)
        hidden = models.drafter()(emb, pos.reshape(1, s * k), concat_features(feats), a_S[None],
                                  BlockVisibility.from_anchors(a_S[None], jnp.ones((1, s), bool)))
        hidden = hidden.reshape(s, k, -1)[:, 1:]
        unary_all = jax.lax.map(lambda h: draft_logits(models, h[None])[0], hidden)  # [S, K-1, V']
        unary, rows = jax.lax.top_k(unary_all, c)
        cand = rows if models.draft_ids is None else jnp.take(models.draft_ids, rows)
        labels = next_S[jnp.clip(pos[:, 1:] - 1, 0, s - 1)]
        lrow = jnp.asarray(row_of)[labels]
        label_logit = jnp.where(lrow >= 0, jnp.take_along_axis(unary_all, jnp.maximum(lrow, 0)[..., None], -1)[..., 0],
                                -jnp.inf)
        return next_S, hidden, cand.astype(jnp.int32), unary, labels, label_logit

    t0 = time.perf_counter()
    data = []  # per row: dict of host arrays over its anchors in [p0, last), plus what the walk needs
    for tokens, mask, n in examples:
        length = -(-n // LENGTH_STEP) * LENGTH_STEP
        padded = np.zeros((1, length), np.int32)
        padded[0, :n] = tokens[:n]
        next_S, hidden, cand, unary, labels, label_logit = jax.device_get(collect(models, jnp.asarray(padded)))
        spans = []
        for p0, e in answer_spans(mask, n):
            last = p0 + matched_prefix(tokens, next_S[:n], p0, e) - 1
            spans.append((p0, last))
        keep = np.zeros(length, bool)
        for p0, last in spans:
            keep[p0:max(last, p0)] = True
        idx = np.nonzero(keep)[0]
        # slot j (1-based j+1) of anchor a is scored when its token a + j + 1 lies inside the reproduced answer
        last_of = np.full(length, -1)
        for p0, last in spans:
            last_of[p0:max(last, p0)] = last
        valid = (idx[:, None] + np.arange(1, k)[None, :] <= last_of[idx][:, None]) & np.isfinite(label_logit[idx])
        data.append({"anchor": np.asarray(tokens)[idx], "pos": idx, "hidden": hidden[idx], "cand": cand[idx],
                     "unary": unary[idx], "labels": labels[idx], "label_logit": np.where(valid, label_logit[idx], 0.0),
                     "mask": valid, "spans": spans})
    collect_s = time.perf_counter() - t0
    train, held = data[:args.train_rows], data[args.train_rows:]
    cat = {key: np.concatenate([d[key] for d in train]) for key in ("anchor", "hidden", "cand", "unary", "labels",
                                                                     "label_logit", "mask")}
    num_blocks = len(cat["anchor"])

    def picks(selector, d):
        """Teacher-forced hits [A, K-1] of one row's anchors: slot j's pick (argmax, or the selector's step from the
        target's token before it) equals the label."""
        if selector is None:
            return d["cand"][:, :, 0] == d["labels"]
        prev = np.concatenate([d["anchor"][:, None], d["labels"][:, :-1]], axis=1)
        proj = np.asarray(selector.hidden_projection(jnp.asarray(d["hidden"])))
        e = np.asarray(selector.edges(jnp.asarray(prev), jnp.asarray(proj), jnp.asarray(d["cand"])))
        best = np.argmax(d["unary"] + e, axis=-1)
        return np.take_along_axis(d["cand"], best[..., None], -1)[..., 0] == d["labels"]

    def walk_tau(selector, rows):
        taus = []
        for d in rows:
            hits = picks(selector, d) & d["mask"]
            lead = dict(zip(d["pos"].tolist(), np.cumprod(hits, axis=1).sum(axis=1).tolist(), strict=True))
            for p0, last in d["spans"]:
                taus += [acc + 1 for _, acc in chain(lambda a, lead=lead: lead.get(a, 0), p0, last)]
        return float(np.mean(taus)) if taus else 0.0, len(taus)

    base_tau, blocks = walk_tau(None, held)
    base_train, _ = walk_tau(None, train[:args.eval_rows])
    result = {"rows": [len(train), len(held)], "train_blocks": num_blocks, "held_out_walk_blocks": blocks,
              "collect_s": collect_s, "rank": args.rank, "top_k": c, "steps": args.steps, "lr": args.lr,
              "batch": args.batch, "argmax": {"held_out_tau": base_tau, "train_tau": base_train}}
    print(json.dumps(result))
    gamma = default_gamma(k)
    sel_arch = dataclasses.replace(arch, selector_rank=args.rank, selector_top_k=c)
    kind = "edge"
    selector = CandidateSelector(sel_arch, jnp.float32, nnx.Rngs(args.seed))
    graphdef, params = nnx.split(selector, nnx.Param)
    opt = optax.adam(args.lr)
    opt_state = opt.init(params)

    @jax.jit
    def update(params, opt_state, batch):
        def loss_fn(p):
            return lattice_loss(nnx.merge(graphdef, p), batch["hidden"], batch["cand"], batch["unary"],
                                batch["labels"], batch["label_logit"], batch["mask"], batch["anchor"], gamma)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    rng = np.random.default_rng(args.seed)
    history, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        take = rng.integers(0, num_blocks, size=args.batch)
        batch = {key: jnp.asarray(v[take]) for key, v in cat.items()}
        params, opt_state, metrics = update(params, opt_state, batch)
        if step % args.eval_every == 0 or step == args.steps:
            fitted = nnx.merge(graphdef, params)
            tau, _ = walk_tau(fitted, held)
            tau_train, _ = walk_tau(fitted, train[:args.eval_rows])
            history.append({"step": step, "loss": float(metrics["loss/selector"]),
                            "tf_walk_tau_batch": float(metrics["selector/acceptance_length"]),
                            "held_out_tau": tau, "train_tau": tau_train,
                            "s_per_step": (time.perf_counter() - t0) / step})
            print(json.dumps({kind: history[-1]}), flush=True)
    result[kind] = history
    if args.save:
        two = DFlashDrafter(dataclasses.replace(sel_arch, variant="dflash2"), nnx.Rngs(0))
        nnx.update(two, nnx.state(drafter, nnx.Param))
        two.candidate_selector = nnx.merge(graphdef, params)
        two.draft_vocab = drafter.draft_vocab
        save_zlab(two, Path(args.save) / kind)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
