"""One request against a server of many slots: DFlash TPOT on servers of 1 and of N slots, interleaved in one run.

    .venv/bin/python benchmarks/engine_slots.py [--slots 1 16] [--plans chain tree] [--sets gsm8k math500]
        [--limit 4] [--max-tokens 128] [--rounds 2] [--write]

Loads the embedded SmolLM2 target (fp32) and the drafter shipped for it once and serves them through real HTTP
servers in this process, one per plan and slot count, each engine sized as `dflash serve --slots N` sizes it
(`launch.serving.ServeOptions`: prefill chunk 512, 4 steps per dispatch) and precompiled: the chain of K = 4 (the
`smollm2` recipe) and the demo recipe's tree (8 nodes + prompt lookup). Each round sends every prompt (the first
turns of `--limit` items of each set) to every server in turn, one request at a time (greedy, streamed, the order of
the servers rotating from prompt to prompt so that drifts of the machine hit them alike); TPOT and TTFT come from the
client (`eval.client`). Per plan it prints the mean TPOT and TTFT on each server and the N-slot / 1-slot ratio of
TPOT (the median of the per-request ratios, and the ratio of the means), and checks that every server answered the
same text (greedy output never depends on the server's size). The engine runs a step at the smallest bucket of rows
that holds the running requests (D99), so a request alone on a 16-slot server costs what it costs on a 1-slot one.
`--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DRAFTER = "data/assets/drafters/smollm2-dflash"


def plans(names: list[str]) -> dict[str, Any]:
    from dflash.serve.plan import Chain, Tree

    table = {"chain": Chain(4), "tree": Tree(4, 8, lookup=True)}  # the smollm2 recipe's chain; the demo's tree
    return {name: table[name] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16], help="server sizes (default 1 16)")
    parser.add_argument("--plans", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "math500"], help="evaluation sets of the prompts")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="times every prompt goes to every server")
    parser.add_argument("--max-len", type=int, default=1024, help="the servers' context (default 1024)")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    if min(args.slots) < 1 or args.limit < 1 or args.rounds < 1 or args.max_tokens < 2:
        parser.error("--slots, --limit and --rounds must be >= 1 and --max-tokens >= 2")

    from benchmarks._report import machine, write_section
    from dflash.data.eval_sets import load_eval_set
    from dflash.eval.client import Client
    from dflash.eval.servers import serve_engine
    from dflash.launch.serving import ServeOptions
    from dflash.models.config import TargetConfig
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target
    from dflash.serve.compile_cache import converted_dir, enable_compile_cache
    from dflash.serve.engine import Engine

    enable_compile_cache()
    load = os.getloadavg()[0]
    t_start = time.perf_counter()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=args.max_len), converted_dir())
    drafter = load_drafter(DRAFTER, target.cfg)
    prompts = [item.turns[0] for name in args.sets for item in load_eval_set(name, args.limit)]
    servers = {}
    with contextlib.ExitStack() as stack:
        for name, plan in plans(args.plans).items():
            for slots in args.slots:
                engine = Engine(target.params, target.cfg, drafter, plan,
                                ServeOptions(slots=slots).limits(args.max_len))
                count, seconds = engine.precompile(logprobs=False)
                print(f"{name}, {slots} slots: {count} programs precompiled in {seconds:.1f} s "
                      f"({engine.loaded} from the compilation cache)", flush=True)
                url = stack.enter_context(serve_engine(engine, target.tokenizer, "smollm2"))
                servers[name, slots] = (Client(url), engine)
        order = list(servers)
        replies: dict[Any, list[Any]] = {key: [] for key in order}
        for key in order:  # one untimed request each: nothing left to compile or warm
            servers[key][0].chat("smollm2", [{"role": "user", "content": prompts[0]}], 8)
        compiled = {key: engine.compiles for key, (_, engine) in servers.items()}
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                shift = (r * len(prompts) + i) % len(order)
                for key in order[shift:] + order[:shift]:
                    reply = servers[key][0].chat("smollm2", [{"role": "user", "content": prompt}], args.max_tokens)
                    replies[key].append((r, i, reply))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
        compiled = {key: engine.compiles - compiled[key] for key, (_, engine) in servers.items()}

    lines = ["| plan | slots | TPOT ms (mean) | TTFT ms (mean) | tau | TPOT / 1-slot TPOT (median of requests) "
             "| mean / mean | texts equal to 1 slot | compiles in timed region |", "|---|" + "---|" * 8]
    base_slots = min(args.slots)
    for name in args.plans:
        base = {(r, i): reply for r, i, reply in replies[name, base_slots]}
        for slots in args.slots:
            got = replies[name, slots]
            tpot = statistics.mean(reply.tpot_s for _, _, reply in got) * 1e3
            ttft = statistics.mean(reply.ttft_s for _, _, reply in got) * 1e3
            accepted = [a for _, _, reply in got for a in reply.accepted]
            tau = statistics.mean(a + 1 for a in accepted) if accepted else float("nan")
            ratios = [reply.tpot_s / base[r, i].tpot_s for r, i, reply in got]
            base_tpot = statistics.mean(reply.tpot_s for reply in base.values()) * 1e3
            equal = sum(reply.text == base[r, i].text for r, i, reply in got)
            lines.append(f"| {name} | {slots} | {tpot:.1f} | {ttft:.0f} | {tau:.2f} | "
                         f"{statistics.median(ratios):.3f} | {tpot / base_tpot:.3f} | {equal}/{len(got)} | "
                         f"{compiled[name, slots]} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        command = shlex.join([".venv/bin/python", "benchmarks/engine_slots.py", *sys.argv[1:]])
        write_section("engine_slots", "\n".join([
            "## One request on a server of many slots",
            "",
            f"`{command}` on {machine()}, commit {commit}, {(time.perf_counter() - t_start) / 60:.0f} min, load "
            f"average {load:.1f} at the start. SmolLM2 (fp32) and the shipped drafter behind in-process HTTP servers "
            f"sized as `dflash serve --slots N` (4 steps per dispatch, prefill chunk 512, precompiled); {len(prompts)} "
            f"prompts ({', '.join(args.sets)}, first turns), {args.max_tokens} new tokens at most, greedy, one request "
            f"at a time, each prompt sent to every server in turn ({args.rounds} rounds, the servers' order rotating). "
            "A step runs at the smallest bucket of rows holding the running requests (D99).",
            "",
            table,
        ]))


if __name__ == "__main__":
    main()
