"""DFlash engine costs on this machine, in one run: the target's verify cost over K, the drafter's propose
cost over K, and end-to-end AR vs DFlash decoding on GSM8K prompts.

    .venv/bin/python benchmarks/engine_throughput.py [--drafter RUN_DIR] [--ks 1 2 4 8 16 32 64]
        [--batches 1 8] [--propose-ks 8 16 32] [--prompts 4] [--new-tokens 64] [--repeats 5] [--quick] [--write]

Target: the embedded SmolLM2-135M-Instruct, fp32, paged cache of 1024 slots (attention over the pages in use,
as the engine does), greedy.

1. K-flat curve: one `serve.speculative.verify` (a target forward over [pending, d_1 .. d_{K-1}] with
   the drafter's feature capture and draft-cache update) per K and batch B, after a ~64-token prefill;
   every timed call starts from a fresh copy of the prefilled state (verify donates it; the copy is made
   outside the timed region). K=1 is `verify` with no drafts (always measured): the ratios are against
   it at the same B, so every row is the same program. The engine's AR step (`verify` with no drafter: a
   one-token forward + argmax, no feature capture) is shown beside it for reference.
2. `propose` (one drafter forward over the block + the LM head) for the default 5-layer drafter, random
   init (cost only), over K and B, on the same prefilled state.
3. End to end, batch 1, both through the engine (`serve.engine.decode`): AR vs DFlash (the drafter of
   `--drafter`, at its training K) on chat-templated GSM8K test questions, exactly
   `--new-tokens` tokens each (no stop ids, so both sides emit the same count). Each prompt is run once
   to compile, then timed. TPOT = decode seconds / (tokens - 1): prefill excluded (the engine stamps the
   first token once its prefill is done). tau = tokens per verify step (accepted + bonus).
   Efficiency = measured speedup / (tau * t_AR / (t_draft + t_verify)), with t_AR the AR TPOT and
   t_draft, t_verify the drafter's own propose and verify at its K and B=1, timed as in 1 and 2: how
   much of the ideal speedup the host loop keeps. Without `--drafter` a random 2-layer K=8 drafter is
   used (tau ~ 1, the worst case).

Every figure is the median of `--repeats` calls after a warm-up call, with jax.block_until_ready.
`--quick` is a smoke run (fewer K, B up to 2, 2 prompts of 16 tokens, 2 repeats); explicit flags
override it. `--write` records the tables in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_LEN = 1024
PROMPT_LEN = 64
FULL = {"ks": [1, 2, 4, 8, 16, 32, 64], "batches": [1, 8], "propose_ks": [8, 16, 32], "prompts": 4,
        "new_tokens": 64, "repeats": 5}
QUICK = {"ks": [1, 4, 16], "batches": [1, 2], "propose_ks": [8], "prompts": 2, "new_tokens": 16, "repeats": 2}


def median_s(fn: Any, fresh: Any, repeats: int) -> float:
    """Median seconds of `fn(fresh())` over `repeats` calls after one warm-up; `fresh()` runs untimed."""
    import jax

    times = []
    for i in range(repeats + 1):
        arg = jax.block_until_ready(fresh())
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefilled(target: Any, drafter: Any, tokens_BxT: Any, lengths_B: Any, room: int = 80) -> Any:
    """(Models, SpecState) with B prompts prefilled (`drafter` None: AR, no draft cache), each slot holding
    pages for `room` more tokens (verify writes K ahead)."""
    import jax.numpy as jnp
    import numpy as np

    from dflash.serve.paged import PagePool, PageTable
    from dflash.serve.sampling import SamplingRows
    from dflash.serve.speculative import Admission, Models, empty_state, prefill, sync_page_table

    b, page = tokens_BxT.shape[0], 16
    max_pages = -(-MAX_LEN // page)
    pool = PagePool(b * max_pages + 1, page)
    table = PageTable(pool, b, max_pages)
    models = Models.of(target.params, target.cfg, drafter)
    arch = None if drafter is None else drafter.arch
    state = empty_state(target.cfg, arch, b, MAX_LEN, pool.num_pages, page, target.params["embed"].dtype)
    table.ensure_batch(np.asarray(lengths_B) + room)
    state, _ = sync_page_table(state, table, 0)
    new = Admission(jnp.arange(b, dtype=jnp.int32), jnp.asarray(tokens_BxT), jnp.asarray(lengths_B, jnp.int32),
                    jnp.zeros((b, 2), jnp.uint32), SamplingRows.of([None] * b))
    return models, prefill(models, state, new)


def spec_state(target: Any, drafter: Any, batch: int) -> Any:
    """(Models, SpecState) after prefilling B random PROMPT_LEN-token prompts."""
    import numpy as np

    rng = np.random.default_rng(batch)
    tokens = rng.integers(100, 40000, size=(batch, PROMPT_LEN)).astype(np.int32)
    return prefilled(target, drafter, tokens, np.full((batch,), PROMPT_LEN, np.int32))


def step_costs(target: Any, drafter: Any, batch: int, ks: list[int], propose_ks: list[int],
               repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of the AR step (key 'decode': `verify` with no drafter and no drafts, what the engine's AR
    mode runs), verify per K and propose per K at batch B for `drafter`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash.serve.speculative import propose, span_pages, verify

    models, state = spec_state(target, drafter, batch)
    ar_models, ar_state = spec_state(target, None, batch)
    copy = lambda: jax.tree.map(jnp.copy, state)  # noqa: E731
    out: dict[str, dict[int, float]] = {"decode": {}, "verify": {}, "propose": {}}
    max_pages = state.target.page_table.shape[1]
    span = lambda k: span_pages(PROMPT_LEN + k, state.target.page_size, max_pages)  # noqa: E731 - as the engine
    none = jnp.zeros((batch, 0), jnp.int32)
    out["decode"][1] = median_s(lambda s: verify(ar_models, s, none, span(1)),
                                lambda: jax.tree.map(jnp.copy, ar_state), repeats)
    rng = np.random.default_rng(0)
    for k in ks:
        drafts = jnp.asarray(rng.integers(100, 40000, size=(batch, k - 1)), jnp.int32)
        pages = span(k)
        out["verify"][k] = median_s(lambda s, d=drafts, p=pages: verify(models, s, d, p), copy, repeats)
    for k in propose_ks:
        out["propose"][k] = median_s(lambda s, k=k: propose(models, s, k, span(k) * state.target.page_size),
                                     lambda: state, repeats)
    return out


def end_to_end(target: Any, drafter: Any, n_prompts: int, new_tokens: int) -> list[dict[str, float]]:
    """Per prompt: AR and DFlash decode seconds (prefill excluded), tokens, and DFlash steps/accepted, both
    through the engine at one slot (`serve.engine.decode`)."""
    from dflash.data.packaged import load_gsm8k
    from dflash.serve.engine import decode

    rows = []
    for conv in load_gsm8k("test", limit=n_prompts):
        prompt = target.tokenizer.encode_chat(conv[:1], add_generation_prompt=True)
        for _ in range(2):  # the first pass compiles; the second is timed
            [ar] = decode(target.params, target.cfg, [prompt], new_tokens, max_len=MAX_LEN)
            [spec] = decode(target.params, target.cfg, [prompt], new_tokens, max_len=MAX_LEN, drafter=drafter)
        if spec.token_ids != ar.token_ids:
            print(f"note: DFlash and AR outputs differ on a prompt of {len(prompt)} tokens (fp32 ties?)")
        rows.append({"prompt_len": len(prompt), "ar_tokens": len(ar.token_ids), "ar_decode_s": ar.decode_s,
                     "ar_prefill_s": ar.prefill_s, "spec_tokens": len(spec.token_ids),
                     "spec_decode_s": spec.decode_s, "spec_total_s": spec.prefill_s + spec.decode_s,
                     "steps": len(spec.accepted), "accepted": sum(spec.accepted)})
    return rows


def engine_sweep(target: Any, drafters: dict[int, Any], batches: list[int], n_prompts: int,
                 new_tokens: int) -> list[dict[str, Any]]:
    """AR vs DFlash through `serve.engine.Engine` (the serving path: continuous batching, paged cache) for
    every batch B (B slots, B GSM8K prompts) and every K in `drafters` (K -> drafter); one warm-up run per
    configuration (compiles), then one timed run. Wall time includes the prefills."""
    import numpy as np

    from dflash.data.packaged import load_gsm8k
    from dflash.serve.engine import Engine
    from dflash.serve.plan import AR, Chain, Limits

    convs = load_gsm8k("test", limit=max(n_prompts, max(batches)))
    prompts = [target.tokenizer.encode_chat(c[:1], add_generation_prompt=True) for c in convs]
    any_drafter = next(iter(drafters.values()))
    rows = []
    for b in batches:
        for k, drafter in [(None, any_drafter), *sorted(drafters.items())]:
            for _ in range(2):  # a warm-up run (compiles), then the timed run
                engine = Engine(target.params, target.cfg, drafter, AR() if k is None else Chain(k),
                                Limits(slots=b, max_len=MAX_LEN))
                for prompt in prompts[:b]:
                    engine.submit(prompt, new_tokens)
                t0 = time.perf_counter()
                done = engine.run()
                seconds = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for c in done.values())
            taus = [c.tau for c in done.values() if c.accepted]
            rows.append({"batch": b, "k": k, "seconds": seconds, "tokens": tokens, "steps": engine.steps,
                         "tau": float(np.mean(taus)) if taus else 1.0})
            print(f"engine B={b} {'AR' if k is None else f'K={k}'}: {tokens / seconds:.1f} tok/s, "
                  f"tau {rows[-1]['tau']:.2f}")
    return rows


def sweep_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown rows of `engine_sweep`: tok/s, TPOT and tau per (B, decoder), speedup vs AR at that B."""
    lines = ["| B | decoder | tok/s | TPOT (ms) | tau | vs AR at B |", "|---|---|---|---|---|---|"]
    ar = {r["batch"]: r["tokens"] / r["seconds"] for r in rows if r["k"] is None}
    for r in rows:
        rate = r["tokens"] / r["seconds"]
        tpot = r["seconds"] / (r["tokens"] / r["batch"]) * 1e3
        name = "AR" if r["k"] is None else f"DFlash K={r['k']}"
        lines.append(f"| {r['batch']} | {name} | {rate:.1f} | {tpot:.1f} | {r['tau']:.2f} | "
                     f"{rate / ar[r['batch']]:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="a `dflash train` run dir (default: a random 2-layer K=8 drafter)")
    parser.add_argument("--ks", type=int, nargs="+", help=f"verify chunk sizes K (default {FULL['ks']})")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes B (default {FULL['batches']})")
    parser.add_argument("--propose-ks", type=int, nargs="+", help=f"propose block sizes (default {FULL['propose_ks']})")
    parser.add_argument("--prompts", type=int, help=f"GSM8K test prompts end to end (default {FULL['prompts']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens per prompt (default {FULL['new_tokens']})")
    parser.add_argument("--repeats", type=int, help=f"timed calls per micro-benchmark (default {FULL['repeats']})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--write", action="store_true", help="record the tables in docs/benchmarks.md")
    args = parser.parse_args()
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.ks) < 1 or min(args.propose_ks) < 2 or min(args.batches) < 1:
        parser.error(f"--ks must be >= 1, --propose-ks >= 2, --batches >= 1; received {args.ks}, "
                     f"{args.propose_ks}, {args.batches}")
    if max(args.ks) + PROMPT_LEN > MAX_LEN or args.new_tokens < 2 or args.prompts < 1 or args.repeats < 1:
        parser.error("--ks must stay under the cache, --new-tokens >= 2, --prompts >= 1, --repeats >= 1")

    import jax
    from flax import nnx

    from benchmarks._report import machine, write_section
    from dflash.models.config import TargetConfig
    from dflash.models.drafter import DFlashDrafter, DrafterConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target

    t_start = time.perf_counter()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=MAX_LEN))
    big = DFlashDrafter(target.drafter_arch(DrafterConfig(block_size=max(args.propose_ks))),
                        nnx.Rngs(0))
    costs = {}
    for b in args.batches:
        costs[b] = step_costs(target, big, b, sorted(set(args.ks) | {1}), args.propose_ks, args.repeats)
        print(f"B={b}: decode {costs[b]['decode'][1] * 1e3:.1f} ms, verify "
              + ", ".join(f"K={k} {s * 1e3:.1f}" for k, s in costs[b]["verify"].items())
              + " ms, propose " + ", ".join(f"K={k} {s * 1e3:.1f}" for k, s in costs[b]["propose"].items()) + " ms")

    if args.drafter:
        drafter, source = load_drafter(args.drafter, target.cfg), f"the trained drafter `{args.drafter}`"
    else:
        drafter = DFlashDrafter(target.drafter_arch(DrafterConfig(num_layers=2, block_size=8)),
                                nnx.Rngs(0))
        source = "a RANDOM-init drafter (no `--drafter`; tau ~ 1, the worst case)"
    k_e2e = drafter.arch.block_size
    own = step_costs(target, drafter, 1, [k_e2e], [k_e2e], args.repeats)
    rows = end_to_end(target, drafter, args.prompts, args.new_tokens)
    sweep_drafters = {k: drafter for k in (4, 8, 16) if k <= k_e2e}
    wide = [k for k in (4, 8, 16) if k > k_e2e]
    if wide:  # K beyond the trained drafter's K: a random drafter of that K (cost of the step; tau ~ 1)
        rnd = DFlashDrafter(target.drafter_arch(DrafterConfig(num_layers=2, block_size=max(wide))),
                            nnx.Rngs(0))
        sweep_drafters.update({k: rnd for k in wide})
    sweep = engine_sweep(target, sweep_drafters, args.batches, args.prompts, max(2, args.new_tokens // 2))
    total_min = (time.perf_counter() - t_start) / 60

    ar_tpot = sum(r["ar_decode_s"] for r in rows) / sum(r["ar_tokens"] - 1 for r in rows)
    sp_tpot = sum(r["spec_decode_s"] for r in rows) / sum(r["spec_tokens"] - 1 for r in rows)
    ar_tps = sum(r["ar_tokens"] for r in rows) / sum(r["ar_prefill_s"] + r["ar_decode_s"] for r in rows)
    sp_tps = sum(r["spec_tokens"] for r in rows) / sum(r["spec_total_s"] for r in rows)
    tau = (sum(r["accepted"] for r in rows) + sum(r["steps"] for r in rows)) / sum(r["steps"] for r in rows)
    t_draft, t_verify = own["propose"][k_e2e], own["verify"][k_e2e]
    speedup = ar_tpot / sp_tpot
    ideal = tau * ar_tpot / (t_draft + t_verify)
    efficiency = speedup / ideal

    bs = args.batches
    head = "| K | " + " | ".join(f"B={b} ms | B={b} vs K=1 | B={b} target tok/s" for b in bs) + " |"
    kflat = [head, "|---|" + "---|---|---|" * len(bs)]

    kflat.append("| 1 (AR step: `verify`, no drafter) | " + " | ".join(
        f"{costs[b]['decode'][1] * 1e3:.1f} | {costs[b]['decode'][1] / costs[b]['verify'][1]:.2f}x | "
        f"{b / costs[b]['decode'][1]:.0f}" for b in bs) + " |")
    for k in sorted(costs[bs[0]]["verify"]):
        label = "1 (`verify`, no drafts)" if k == 1 else str(k)
        kflat.append(f"| {label} | " + " | ".join(
            f"{costs[b]['verify'][k] * 1e3:.1f} | {costs[b]['verify'][k] / costs[b]['verify'][1]:.2f}x | "
            f"{b * k / costs[b]['verify'][k]:.0f}" for b in bs) + " |")
    prop = ["| K | " + " | ".join(f"B={b} propose ms | B={b} propose / verify(K)" for b in bs) + " |",
            "|---|" + "---|---|" * len(bs)]
    for k in args.propose_ks:
        prop.append(f"| {k} | " + " | ".join(
            f"{costs[b]['propose'][k] * 1e3:.1f} | "
            + (f"{costs[b]['propose'][k] / costs[b]['verify'][k]:.2f}" if k in costs[b]["verify"] else "-")
            for b in bs) + " |")
    e2e = ["| decoder | TPOT (ms) | decode tok/s | end-to-end tok/s (prefill incl.) | tau | speedup |",
           "|---|---|---|---|---|---|",
           f"| AR (engine, no drafter) | {ar_tpot * 1e3:.1f} | {1 / ar_tpot:.1f} | {ar_tps:.1f} | 1 | 1.00x |",
           f"| DFlash K={k_e2e} (engine) | {sp_tpot * 1e3:.1f} | {1 / sp_tpot:.1f} | {sp_tps:.1f} | "
           f"{tau:.2f} | {speedup:.2f}x |"]

    b_lo, b_hi = bs[0], bs[-1]
    kmax = max(costs[b_hi]["verify"])
    ratio = {b: {k: s / costs[b]["verify"][1] for k, s in costs[b]["verify"].items()} for b in bs}
    flat_upto = {b: max(k for k, r in ratio[b].items() if r <= 1.5) for b in bs}
    host = ("the rest is the host loop: per-step device->host fetches of the tokens and acceptance counts, and "
            "the Python bookkeeping" if efficiency < 0.95 else
            "at or above 1 within timing noise: the host loop costs next to nothing beside the forwards")
    reading = (
        f"Reading: a K={kmax} verify costs {ratio[b_lo][kmax]:.2f}x a K=1 verify at B={b_lo}"
        + (f" and {ratio[b_hi][kmax]:.2f}x at B={b_hi}" if b_hi != b_lo else "")
        + "; it stays within 1.5x of K=1 up to K="
        + ", ".join(f"{flat_upto[b]} at B={b}" for b in bs)
        + ". So on this machine the target forward is flat in K only for small chunks, while reading the weights "
        "dominates; beyond that the matmuls are compute-bound and the cost grows with the B*K tokens "
        f"(target tok/s saturates). Propose at K={args.propose_ks[0]} costs "
        f"{costs[b_lo]['propose'][args.propose_ks[0]] * 1e3:.1f} ms at B={b_lo} for the 5-layer drafter. "
        f"End to end with {source}: tau = {tau:.2f}, t_draft = {t_draft * 1e3:.1f} ms, "
        f"t_verify = {t_verify * 1e3:.1f} ms at K={k_e2e}, B=1, AR TPOT = {ar_tpot * 1e3:.1f} ms, so the ideal "
        f"speedup tau * t_AR / (t_draft + t_verify) is {ideal:.2f}x; measured {speedup:.2f}x, an engine "
        f"efficiency of {efficiency:.2f} ({host}).")
    command = shlex.join([".venv/bin/python", "benchmarks/engine_throughput.py", *sys.argv[1:]])
    quick = " QUICK SMOKE RUN (small sizes; not representative)." if args.quick else ""
    device = jax.devices()[0]
    where = "this CPU" if device.platform == "cpu" else f"one {device.device_kind}"
    body = "\n".join([
        f"## Engine throughput on {where} (SmolLM2-135M target, fp32, greedy DFlash vs AR)",
        "",
        f"`{command}` on {machine()}; the run took {total_min:.1f} min.{quick} Median of {args.repeats} timed "
        "calls after a warm-up, each blocked on; paged cache of 1024 slots, attention over the pages in use "
        "(the power-of-two span the engine picks, `serve.speculative.span_pages`), prompts of "
        f"{PROMPT_LEN} random tokens for the micro-benchmarks. verify = `serve.speculative.verify` (target "
        "forward over the K-token chunk, feature capture, acceptance, draft-cache update), each call on a "
        "fresh copy of the prefilled state made outside the timed region; the ratios are against `verify` at "
        "K=1 (no drafts) at the same B; the engine's AR step (`verify` with no drafter: one-token forward + "
        "greedy pick, no feature capture) is shown for reference; target tok/s = B*K / verify.",
        "",
        *kflat,
        "",
        "Drafter `propose` (default 5-layer drafter, random init; one forward over [pending, MASK x (K-1)] "
        "against the context K/V, then the target's LM head over the K-1 draft positions):",
        "",
        *prop,
        "",
        f"End to end, batch 1, {len(rows)} GSM8K test questions (chat template, {min(r['prompt_len'] for r in rows)}"
        f"-{max(r['prompt_len'] for r in rows)} prompt tokens), {args.new_tokens} new tokens each (no stop ids), "
        f"{source}, K={k_e2e}: TPOT = decode seconds / (tokens - 1), prefill excluded; end-to-end tok/s includes "
        "the prefill; tau = tokens per verify step (accepted + bonus).",
        "",
        *e2e,
        "",
        reading,
        "",
        f"Through the serving engine (`serve.engine.Engine`: continuous batching, paged cache), B slots serving "
        f"B GSM8K test prompts, {max(2, args.new_tokens // 2)} new tokens each, wall time including the "
        f"prefills; DFlash at K <= {k_e2e} with {source}"
        + (f", at K = {', '.join(map(str, wide))} with a random-init drafter (tau ~ 1: the cost of the step, "
           "not a speedup claim)" if wide else "") + ":",
        "",
        *sweep_table(sweep),
    ])
    print(body)
    if args.write:
        # one section per kind of device: an accelerator's run sits beside this machine's CPU one
        suffix = "" if device.platform == "cpu" else "_" + device.platform
        print(f"written to {write_section('engine_throughput' + suffix, body)}")


if __name__ == "__main__":
    main()
