"""What the HTTP path costs the evaluation: the same greedy requests through `dflash serve` (a server in this
process on a loopback port, streamed, timed by `eval.client`) vs the engine called directly
(`serve.engine.decode`), at concurrency 1, one run.

    .venv/bin/python benchmarks/eval_overhead.py [--drafter RUN_DIR] [--prompts 6] [--new-tokens 64] [--write]

Target: the embedded SmolLM2-135M-Instruct, fp32; DFlash with `--drafter` (default: a random-init 2-layer
K=8 drafter, tau ~ 1) and AR. Prompts: chat-templated GSM8K test questions; every prompt runs once untimed
(compiles), then in-process and HTTP alternate per prompt. Decode tokens/s = (tokens - 1) / (last token -
first token): prefill excluded on both sides. `--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MAX_LEN = 1024


def measure(target, drafter, prompts, messages, new_tokens: int) -> dict[str, float]:
    """Decode tokens/s in-process and over HTTP for one decoder (`drafter` None: AR)."""
    from dflash.eval.client import Client
    from dflash.eval.servers import serve_in_process
    from dflash.serve.engine import decode

    def local(prompt):
        [c] = decode(target.params, target.cfg, [prompt], new_tokens, max_len=MAX_LEN, drafter=drafter)
        return len(c.token_ids) - 1, c.decode_s

    with serve_in_process(target, drafter, slots=1, max_len=MAX_LEN) as url:
        client = Client(url)
        model = client.model()

        def http(msgs):
            reply = client.chat(model, msgs, new_tokens)
            return reply.tokens - 1, reply.last_s - reply.first_s

        for prompt, msgs in zip(prompts, messages, strict=True):  # compile every shape first
            local(prompt)
            http(msgs)
        sums = {"local": [0, 0.0], "http": [0, 0.0]}
        for prompt, msgs in zip(prompts, messages, strict=True):
            for side, (n, seconds) in (("local", local(prompt)), ("http", http(msgs))):
                sums[side][0] += n
                sums[side][1] += seconds
    return {side: n / seconds for side, (n, seconds) in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", help="a run dir or exported drafter (default: random-init 2-layer K=8)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    from flax import nnx

    from benchmarks._report import machine, write_section
    from dflash.data.packaged import load_gsm8k
    from dflash.models.config import DrafterConfig, TargetConfig
    from dflash.models.drafter import DFlashDrafter
    from dflash.models.drafter_io import load_drafter
    from dflash.models.target import load_target

    t0 = time.perf_counter()
    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=MAX_LEN))
    drafter = (load_drafter(args.drafter, target.cfg) if args.drafter else
               DFlashDrafter(target.drafter_arch(DrafterConfig(num_layers=2, block_size=8)), nnx.Rngs(0)))
    messages = [c[:1] for c in load_gsm8k("test", limit=args.prompts)]
    prompts = [target.tokenizer.encode_chat(m, add_generation_prompt=True) for m in messages]
    rows = []
    for name, d in ((f"DFlash K={drafter.arch.block_size}", drafter), ("AR", None)):
        rates = measure(target, d, prompts, messages, args.new_tokens)
        rows.append(f"| {name} | {rates['local']:.1f} | {rates['http']:.1f} | {rates['http'] / rates['local']:.2f} |")
        print(rows[-1], flush=True)
    source = f"`{args.drafter}`" if args.drafter else "a random-init 2-layer K=8 drafter (tau ~ 1)"
    command = shlex.join([".venv/bin/python", "benchmarks/eval_overhead.py", *sys.argv[1:]])
    body = "\n".join([
        "## Evaluation path: HTTP vs in-process (SmolLM2-135M target, fp32, greedy, concurrency 1)", "",
        f"`{command}` on {machine()}; {(time.perf_counter() - t0) / 60:.1f} min. {args.prompts} GSM8K test "
        f"prompts, {args.new_tokens} new tokens, drafter {source}. Decode tokens/s (prefill excluded) of the same "
        "requests through a streamed `dflash serve` on loopback (client-side timing, `eval.client`) and "
        "through `serve.engine.decode` in-process, alternating per prompt after a compile pass.", "",
        "| decoder | in-process tok/s | HTTP tok/s | HTTP / in-process |", "|---|---|---|---|", *rows, ""])
    print(body)
    if args.write:
        write_section("Evaluation path: HTTP vs in-process", body)


if __name__ == "__main__":
    main()
