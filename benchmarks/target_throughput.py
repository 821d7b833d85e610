"""Prefill and decode throughput of the default target: ours (jitted JAX) vs transformers, one run.

    .venv/bin/python benchmarks/target_throughput.py [--torch-python PATH] [--write]

Ours runs in this process, through the engine at one slot (AR, the serving path). transformers runs the
same workload on the same GGUF (dequantised, fp32, eager attention, same thread count) in a subprocess
started with `--torch-python`, a Python that has torch + transformers + gguf + accelerate (the
golden-file environment, see docs/development.md);
without it only our numbers are printed. Both sides use greedy decoding and the same prompt.
`--write` records the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_LENS = (128, 512)
DECODE_TOKENS = 64
REPEATS = 3


def ours(threads: int) -> dict:
    """Prefill and decode tokens/s of our target through the engine at one slot (`serve.engine.decode`, AR)."""
    import numpy as np

    from dflash.models.config import TargetConfig
    from dflash.models.target import load_target
    from dflash.serve.engine import decode

    target = load_target(TargetConfig(source="smollm2", dtype="float32", max_seq_len=1024))
    params, cfg = target.params, target.cfg
    rng = np.random.default_rng(0)
    out = {"prefill_tok_s": {}, "decode_tok_s": None}
    for n in PROMPT_LENS:
        prompt = [int(t) for t in rng.integers(100, 40000, size=n)]
        times = [decode(params, cfg, [prompt], 1, max_len=1024)[0].prefill_s for _ in range(REPEATS + 1)]
        out["prefill_tok_s"][n] = n / statistics.median(times[1:])
    prompt = [int(t) for t in rng.integers(100, 40000, size=128)]
    runs = [decode(params, cfg, [prompt], DECODE_TOKENS + 1, max_len=1024)[0].decode_s for _ in range(REPEATS + 1)]
    out["decode_tok_s"] = DECODE_TOKENS / statistics.median(runs[1:])
    return out


TORCH_SCRIPT = textwrap.dedent("""
    import json, statistics, sys, time, torch
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    gguf, threads, lens = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    n_dec, reps = int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(threads)
    p = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(0)
    out = {"prefill_tok_s": {}, "decode_tok_s": None}
    with torch.inference_mode():
        for n in lens:
            ids = torch.randint(100, 40000, (1, n), generator=g)
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - t0)
            out["prefill_tok_s"][n] = n / statistics.median(times[1:])
        ids = torch.randint(100, 40000, (1, 128), generator=g)
        runs = []
        for _ in range(reps + 1):
            o = model(ids, use_cache=True, logits_to_keep=1)
            past, tok = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            for _ in range(n_dec):
                o = model(tok, past_key_values=past, use_cache=True)
                past, tok = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                int(tok[0, 0])
            runs.append(time.perf_counter() - t0)
        out["decode_tok_s"] = n_dec / statistics.median(runs[1:])
    print("RESULT " + json.dumps(out))
""")


def reference(torch_python: str, threads: int) -> dict:
    from dflash.models.registry import default_gguf_path

    cmd = [torch_python, "-c", TORCH_SCRIPT, str(default_gguf_path()), str(threads), json.dumps(PROMPT_LENS),
           str(DECODE_TOKENS), str(REPEATS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"transformers reference failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["prefill_tok_s"] = {int(k): v for k, v in res["prefill_tok_s"].items()}
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-python", help="a Python with torch + transformers for the reference side")
    parser.add_argument("--write", action="store_true", help="record the table in docs/benchmarks.md")
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    mine = ours(threads)
    ref = reference(args.torch_python, threads) if args.torch_python else None
    rows = ["| measure | ours (JAX, jit) | transformers | ours / transformers |", "|---|---|---|---|"]
    for n in PROMPT_LENS:
        a = mine["prefill_tok_s"][n]
        b = ref["prefill_tok_s"][n] if ref else None
        rows.append(f"| prefill {n} tokens (tokens/s) | {a:.0f} | {f'{b:.0f}' if b else '-'} | "
                    f"{f'{a / b:.2f}x' if b else '-'} |")
    a, b = mine["decode_tok_s"], ref["decode_tok_s"] if ref else None
    rows.append(f"| decode after 128 (tokens/s, batch 1) | {a:.1f} | {f'{b:.1f}' if b else '-'} | "
                f"{f'{a / b:.2f}x' if b else '-'} |")
    from benchmarks._report import machine, write_section

    body = "\n".join([
        "## Target throughput (SmolLM2-135M-Instruct, fp32, greedy)",
        "",
        f"`benchmarks/target_throughput.py` on {machine()}; median of {REPEATS} runs after a warm-up; "
        "prefill = one cached forward over a random prompt, logits at its last token only (both sides); "
        f"decode = {DECODE_TOKENS} single-token steps after a 128-token prompt, each token fetched to the host.",
        "",
        *rows,
    ])
    print(body)
    if args.write:
        print(f"written to {write_section('target_throughput', body)}")


if __name__ == "__main__":
    main()
