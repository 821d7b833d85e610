"""The oracle ceiling: the speedup a perfect drafter would give on this machine, beside the measured DFlash speedup.

    .venv/bin/python benchmarks/oracle_ceiling.py [--concurrency 1 4] [--sets gsm8k mtbench humaneval math500]
        [--limit 2] [--max-tokens 128] [--slots 4] [--rounds 2] [--write]

Loads the embedded SmolLM2 target (fp32) and the shipped drafter (K = 4) once and serves every mode through a real
HTTP server in this process, each engine sized as `dflash serve --slots N` sizes it (prefill chunk 512, 4 steps per
dispatch) and precompiled:
- AR (the baseline), and the shipped drafter's chain (K = 4) and the demo recipe's tree (8 nodes + prompt lookup);
- the same engines with an oracle (`Engine(oracle=...)`, D99): a greedy request's drafts are its AR continuation,
  computed first by the same engine code (`serve.engine.decode`), so every draft is accepted and every step emits K
  tokens, while the step still runs the drafter's forward and the whole verify: the time a perfect drafter of this
  cost would take. At K = 8 (chain, and a tree of 16 nodes + prompt lookup) the drafter is a random-init one of the
  shipped drafter's architecture with a block of 8 (its drafts are replaced anyway; its forward costs what a trained
  one's would).
Each round sends the prompts (first turns of `--limit` items of each set) in groups of C concurrent requests to every
server in turn (the order rotating from group to group), greedy, streamed. Per mode and C: output tokens/s (all
tokens over the group's wall time, summed over groups), mean TPOT and TTFT, τ, and the speedup over AR (tokens/s
ratio); per drafter shape, the measured DFlash speedup as a share of its oracle's. Every mode must answer AR's text
(greedy output is lossless), which the table counts. `--write` records it in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DRAFTER = "data/assets/drafters/smollm2-dflash"


def group_chat(clients: list[Any], prompts: list[str], max_tokens: int) -> tuple[list[Any], float]:
    """The prompts sent at once, one thread each (client i sends prompt i); (the replies in order, wall seconds)."""
    replies: list[Any] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            replies[i] = clients[i].chat("smollm2", [{"role": "user", "content": prompts[i]}], max_tokens)
        except BaseException as err:  # noqa: BLE001 - raised after the threads end
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return replies, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "mtbench", "humaneval", "math500"])
    parser.add_argument("--limit", type=int, default=2, help="prompts per set (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=4, help="every server's slots (default 4; >= each C)")
    parser.add_argument("--rounds", type=int, default=2, help="times every group goes to every server")
    parser.add_argument("--max-len", type=int, default=512, help="the servers' context (default 512)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or max(args.concurrency) > args.slots or args.limit < 1 or args.max_tokens < 2:
        parser.error("--concurrency must lie in [1, --slots]; --limit >= 1; --max-tokens >= 2")

    from flax import nnx

    from benchmarks._report import machine, write_section
    from dflash.data.eval_sets import load_eval_set
    from dflash.eval.client import Client
    from dflash.eval.servers import serve_engine
    from dflash.launch.serving import ServeOptions
    from dflash.models.config import TargetConfig
    from dflash.models.drafter import DFlashDrafter
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.compile_cache import converted_dir, enable_compile_cache
    from dflash.serve.engine import Engine, decode
    from dflash.serve.plan import AR, Chain, Tree

    enable_compile_cache()
    load = os.getloadavg()[0]
    t_start = time.perf_counter()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=args.max_len), converted_dir())
    shipped = load_drafter(DRAFTER, target.cfg)
    wide = DFlashDrafter(dataclasses.replace(shipped.arch, block_size=8), nnx.Rngs(0))
    prompts = [item.turns[0] for name in args.sets for item in load_eval_set(name, args.limit)]
    ids = [tuple(target.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True))
           for p in prompts]
    done = decode(target.params, target.cfg, [list(i) for i in ids], args.max_tokens, max_len=args.max_len)
    oracle = {i: d.token_ids for i, d in zip(ids, done, strict=True)}  # greedy, no stop: the whole continuation
    modes = {  # name: (drafter, plan, oracle, the mode whose oracle it is)
        "AR": (None, AR(), None, None),
        "DFlash chain K=4": (shipped, Chain(4), None, "oracle chain K=4"),
        "DFlash tree 8+lookup K=4": (shipped, Tree(4, 8, lookup=True), None, "oracle tree 8+lookup K=4"),
        "oracle chain K=4": (shipped, Chain(4), oracle, None),
        "oracle tree 8+lookup K=4": (shipped, Tree(4, 8, lookup=True), oracle, None),
        "oracle chain K=8": (wide, Chain(8), oracle, None),
        "oracle tree 16+lookup K=8": (wide, Tree(8, 16, lookup=True), oracle, None),
    }
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, (drafter, plan, known, _) in modes.items():
            limits = ServeOptions(slots=args.slots).limits(args.max_len)
            engine = Engine(target.params, target.cfg, drafter, plan, limits, oracle=known)
            count, seconds = engine.precompile(logprobs=False)
            print(f"{name}: {count} programs precompiled in {seconds:.1f} s ({engine.loaded} from the cache)",
                  flush=True)
            url = stack.enter_context(serve_engine(engine, target.tokenizer, "smollm2"))
            servers[name] = ([Client(url) for _ in range(args.slots)], engine)
        for clients, _ in servers.values():  # one untimed group each
            group_chat(clients[:max(args.concurrency)], prompts[:max(args.concurrency)], 8)
        order = list(modes)
        for c in args.concurrency:
            groups = [prompts[i:i + c] for i in range(0, len(prompts), c)]
            got: dict[str, list[Any]] = {name: [] for name in order}
            wall = dict.fromkeys(order, 0.0)
            compiles = {name: engine.compiles for name, (_, engine) in servers.items()}
            for r in range(args.rounds):
                for g, group in enumerate(groups):
                    shift = (r * len(groups) + g) % len(order)
                    for name in order[shift:] + order[:shift]:
                        replies, seconds = group_chat(servers[name][0], group, args.max_tokens)
                        got[name] += [(r, g * c + j, reply) for j, reply in enumerate(replies)]
                        wall[name] += seconds
            ar_text = {(r, i): reply.text for r, i, reply in got["AR"]}
            for name in order:
                replies = [reply for _, _, reply in got[name]]
                accepted = [a for reply in replies for a in reply.accepted]
                tpots = [reply.tpot_s for reply in replies if reply.tpot_s]
                rows[name, c] = {
                    "tok_s": sum(reply.tokens for reply in replies) / wall[name],
                    "tpot_ms": statistics.mean(tpots) * 1e3,
                    "ttft_ms": statistics.mean(reply.ttft_s for reply in replies) * 1e3,
                    "tau": statistics.mean(a + 1 for a in accepted) if accepted else 1.0,
                    "equal": sum(reply.text == ar_text[r, i] for r, i, reply in got[name]), "n": len(replies),
                    "compiles": servers[name][1].compiles - compiles[name]}
            print(f"C={c} done", flush=True)

    lines = ["| mode | C | output tok/s | TPOT ms | TTFT ms | tau | speedup over AR (tok/s) | share of its oracle's "
             "speedup | replies equal to AR | compiles in timed region |", "|---|" + "---|" * 9]
    for c in args.concurrency:
        ar = rows["AR", c]["tok_s"]
        for name, (_, _, _, ceiling) in modes.items():
            row = rows[name, c]
            share = ""
            if ceiling:
                best = rows[ceiling, c]["tok_s"]
                gain = f"{(row['tok_s'] - ar) / (best - ar):.0%} of the gain, " if best > ar else ""
                share = f"{gain}{row['tok_s'] / best:.0%} of the tok/s"
            lines.append(f"| {name} | {c} | {row['tok_s']:.1f} | {row['tpot_ms']:.1f} | {row['ttft_ms']:.0f} | "
                         f"{row['tau']:.2f} | {row['tok_s'] / ar:.2f}x | {share} | {row['equal']}/{row['n']} | "
                         f"{row['compiles']} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        command = shlex.join([".venv/bin/python", "benchmarks/oracle_ceiling.py", *sys.argv[1:]])
        write_section("oracle_ceiling", "\n".join([
            "## The oracle ceiling: DFlash beside a perfect drafter",
            "",
            f"`{command}` on {machine()}, commit {commit}, {(time.perf_counter() - t_start) / 60:.0f} min, load "
            f"average {load:.1f} at the start. SmolLM2 (fp32) behind in-process HTTP servers of {args.slots} slots "
            f"sized as `dflash serve` sizes them (precompiled); {len(prompts)} prompts ({', '.join(args.sets)}, first "
            f"turns), {args.max_tokens} new tokens at most, greedy, streamed, in groups of C at once, every group to "
            f"every server in turn ({args.rounds} rounds). An oracle mode drafts each request's AR continuation "
            "(every draft accepted) while paying the drafter's forward and the whole verify: the speedup a perfect "
            "drafter of that cost gives here. The share is the measured DFlash gain over AR as a part of its oracle's "
            "gain (and its tokens/s as a part of the oracle's).",
            "",
            table,
        ]))


if __name__ == "__main__":
    main()
