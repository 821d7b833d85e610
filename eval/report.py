"""Numbers, report and plots of an evaluation: `results.json` (schema `dflash-eval/1`), `report.md`, PNGs.

Per set, from the first concurrency level: τ (accepted + 1 per verify step, bonus included, pooled over
steps, from the engine's own counts: `eval.engines`; `tau_source` says whether they came per request or, for an
engine with only counters at concurrency above 1, pooled over the run, then for the headline only), acceptance by
draft position and the histogram of accepted drafts per step, mean TPOT and tokens/s
of DFlash and AR, speedup = the median over requests of AR TPOT / DFlash TPOT of the same request (`paired`: its
quartiles, count, the median's 95% interval and the timing noise; a noisy timing is flagged), greedy replies that
differ from AR (must be 0; not compared when sampled: `mismatches` is None, and losslessness rests on the engine's
sampled-decoding tests), GSM8K / MATH-500 answer accuracy; per concurrency level: throughput and p50 / p95 latency
of each. `settings` records the sampling rule (temperature, top_p, seed).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.eval.engines import Counts

SCHEMA = "dflash-eval/1"
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The last \\boxed{...} of a reply, else its last number; normalised (no spaces, commas, $ or trailing .0)."""
    boxed = _BOXED.findall(text)
    found = boxed[-1] if boxed else (_NUMBER.findall(text) or [None])[-1]
    if found is None:
        return None
    answer = found.replace(" ", "").replace(",", "").replace("$", "").rstrip(".")
    return answer[:-2] if answer.endswith(".0") else answer


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _mode_stats(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """TPOT, tokens/s and TTFT of one mode's replies. A reply whose tokens all came in one streamed chunk has TPOT
    0 (nothing measured after its first token): counted in the mean TPOT; the decode rate is None when that mean
    is 0."""
    tpots = [r["tpot_s"] for r in replies if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in replies)
    latency = sum(r["latency_s"] for r in replies)
    mean_tpot = statistics.mean(tpots) if tpots else None
    return {"replies": len(replies), "tokens": tokens,
            "tpot_ms": mean_tpot * 1e3 if mean_tpot is not None else None,
            "decode_tok_s": 1.0 / mean_tpot if mean_tpot else None,
            "tok_s": tokens / latency if latency > 0 else None,
            "ttft_ms": statistics.mean(r["ttft_s"] for r in replies) * 1e3 if replies else None}


def reply_counts(record: dict[str, Any], block_size: int = 0) -> Counts | None:
    """A reply record's speculative counts: another engine's (`spec`), or our engine's per-step accepted drafts."""
    if record.get("spec"):
        return Counts.from_json(record["spec"])
    return Counts.of_steps(record["accepted"], block_size - 1) if record.get("accepted") else None


def _acceptance(replies: list[dict[str, Any]], block_size: int, pooled: Counts | None = None) -> dict[str, Any]:
    """τ, verify steps, acceptance by position and the histogram over `replies`' counts (per request), or over
    `pooled` when no reply has any (`tau_source` says which; None: the engine reported none)."""
    counts = [c for c in (reply_counts(r, block_size) for r in replies) if c is not None]
    source = "per request" if counts else "pooled" if pooled is not None and pooled.steps > 0 else None
    if source is None:
        return {"tau": None, "steps": 0, "accept_per_position": [], "accept_hist": [], "tau_source": None}
    counts = counts or [pooled]
    steps, accepted = sum(c.steps for c in counts), sum(c.accepted for c in counts)
    placed = [c for c in counts if c.per_position or c.hist]  # counts that say where their drafts were accepted
    total = sum(placed, Counts(0, 0))
    hist, positions = total.histogram(), total.positions()
    return {"tau": 1.0 + accepted / steps, "steps": steps,
            "accept_per_position": [n / total.steps for n in positions] if total.steps else [],
            "accept_hist": [n / total.steps for n in hist] if total.steps else [], "tau_source": source}


def _accuracy(replies: list[dict[str, Any]], answers: dict[str, str]) -> float | None:
    graded = [r for r in replies if r["turn"] == 0 and answers.get(r["id"])]
    if not graded:
        return None
    return sum(final_answer(r["text"]) == final_answer(answers[r["id"]]) or
               final_answer(r["text"]) == answers[r["id"]].replace(" ", "") for r in graded) / len(graded)


CI_LEVEL = 0.95
NOISE_LIMIT = 0.1  # the cost ratio's 95% interval wider than 10% of it (about +-5%): the timing is too noisy to trust


def median_interval(values: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float] | None:
    """A distribution-free `level` confidence interval of the median of `values` (order statistics: the k-th
    smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2); None when there
    are too few values for one (n < 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail, k, cdf = (1 - level) / 2, 0, 0.0
    while k < n // 2:
        cdf += math.comb(n, k) / 2**n  # P(B <= k)
        if cdf > tail:
            break
        k += 1
    return None if k == 0 else (xs[k - 1], xs[n - k])


def _relative_interval(values: Sequence[float]) -> tuple[tuple[float, float] | None, float | None]:
    interval = median_interval(values)
    return interval, None if interval is None else (interval[1] - interval[0]) / statistics.median(values)


def _paired(dflash: list[dict[str, Any]], ar: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-request speed ratios AR TPOT / DFlash TPOT of the requests both modes answered (the same item and
    turn): their median (the speedup), quartiles, count and the median's 95% interval (`median_interval`: how much
    another draw of prompts could move it). Each ratio is the request's τ (tokens per verify step, counted, exact)
    times the cost ratio AR step time / DFlash step time, which holds only the timing: the interval of the cost
    ratios' median (`noise`, as a share of it) says how far the timing moved during the run, and the speedup is
    trusted when it is at most NOISE_LIMIT (where the server reports no per-request τ: the ratios' own interval)."""
    ar_tpot = {(r["id"], r["turn"]): r["tpot_s"] for r in ar if r["tpot_s"]}
    pairs = [(ar_tpot[r["id"], r["turn"]] / r["tpot_s"], r) for r in dflash
             if r["tpot_s"] and (r["id"], r["turn"]) in ar_tpot]
    ratios = [ratio for ratio, _ in pairs]
    counted = [(ratio, reply_counts(r), r["tokens"]) for ratio, r in pairs]  # any engine's per-request verify steps
    costs = [ratio * c.steps / tokens for ratio, c, tokens in counted if c is not None and c.steps and tokens]
    if not ratios:
        return {"median": None, "p25": None, "p75": None, "pairs": 0, "ci": None, "cost_ratio": None,
                "noise": None, "trusted": False}
    interval, width = _relative_interval(ratios)
    noise = _relative_interval(costs)[1] if len(costs) == len(ratios) else width
    return {"median": statistics.median(ratios), "p25": _pct(ratios, 0.25), "p75": _pct(ratios, 0.75),
            "pairs": len(ratios), "ci": interval, "cost_ratio": statistics.median(costs) if costs else None,
            "noise": noise, "trusted": noise is not None and noise <= NOISE_LIMIT}


def _set_summary(replies: list[dict[str, Any]], c0: int, block_size: int, answers: dict[str, str],
                 compare: bool = True, pooled: Counts | None = None) -> dict[str, Any]:
    first = {m: [r for r in replies if r["mode"] == m and r["concurrency"] == c0] for m in ("dflash", "ar")}
    ar_text = {(r["id"], r["turn"]): r["text"] for r in first["ar"]}
    mismatched = sorted(f"{r['id']}#{r['turn']}" for r in first["dflash"]
                        if (r["id"], r["turn"]) in ar_text and r["text"] != ar_text[r["id"], r["turn"]])
    if not compare:  # sampled: DFlash and AR draw different samples of the same distribution
        mismatched = None
    dflash, ar = _mode_stats(first["dflash"]), _mode_stats(first["ar"])
    paired = _paired(first["dflash"], first["ar"])
    speedup = paired["median"]
    return {**_acceptance(first["dflash"], block_size, pooled), "dflash": dflash, "ar": ar, "speedup": speedup,
            "paired": paired,
            "mismatches": None if mismatched is None else len(mismatched),
            "mismatched": None if mismatched is None else mismatched[:20],
            "accuracy": {m: _accuracy(first[m], answers) for m in ("dflash", "ar")}}


def _concurrency(records: list[dict[str, Any]], levels: Sequence[int]) -> dict[str, Any]:
    out = {}
    for c in levels:
        row = {}
        for mode in ("dflash", "ar"):
            wall = next((r for r in records if r["kind"] == "wall" and r["mode"] == mode and r["concurrency"] == c),
                        None)
            lat = [r["latency_s"] for r in records if r["kind"] == "reply" and r["mode"] == mode
                   and r["concurrency"] == c]
            row[mode] = {"throughput_tok_s": wall["tokens"] / wall["seconds"] if wall and wall["seconds"] else None,
                         "p50_latency_s": _pct(lat, 0.5), "p95_latency_s": _pct(lat, 0.95)}
            counted = [r["count"] for r in records if r["kind"] == "compiles" and r["mode"] == mode
                       and r["concurrency"] == c]
            row[mode]["compiles"] = None if not counted or None in counted else sum(counted)
        d, a = row["dflash"]["throughput_tok_s"], row["ar"]["throughput_tok_s"]
        row["throughput_ratio"] = d / a if d and a else None
        out[str(c)] = row
    return out


def summarize(records: list[dict[str, Any]], sets: Sequence[str], concurrency: Sequence[int], block_size: int,
              answers: dict[str, str], meta: dict[str, Any], compare: bool = True) -> dict[str, Any]:
    """The results.json document of `records` (see the module docstring); `compare`: check DFlash's replies
    against AR's (greedy runs only)."""
    replies = [r for r in records if r["kind"] == "reply"]
    pooled = next((Counts.from_json(r["counts"]) for r in records if r["kind"] == "spec" and r["mode"] == "dflash"
                   and r["concurrency"] == concurrency[0]), None)  # counters read around a segment: headline only
    by_set = {}
    for name in sets:
        mine = [r for r in replies if r["set"] == Path(name).stem or r["set"] == name]
        by_set[name] = _set_summary(mine, concurrency[0], block_size, answers, compare)
    headline = _set_summary(replies, concurrency[0], block_size, answers, compare, pooled)
    categories = sorted({r["category"] for r in replies if r.get("category")})  # SPEED-Bench's
    by_category = {c: _set_summary([r for r in replies if r.get("category") == c], concurrency[0], block_size,
                                   answers, compare) for c in categories}
    compiled: dict[str, int] = {}  # programs each mode's server compiled inside its timed requests (0: none)
    for r in records:
        if r["kind"] == "compiles" and r["count"]:
            compiled[r["mode"]] = compiled.get(r["mode"], 0) + r["count"]
    return {"schema": SCHEMA, **meta, "sets": by_set, "categories": by_category, "compiled_in_timed": compiled,
            "headline": {k: headline[k] for k in ("tau", "tau_source", "steps", "speedup", "paired", "mismatches",
                                                  "dflash", "ar", "accept_per_position")},
            "concurrency": _concurrency(records, concurrency)}


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _sampling(settings: dict[str, Any]) -> str:
    """", sampled at T=.. [top-p ..]" for a sampled run, "" for a greedy one."""
    t = settings.get("temperature", 0.0)
    if not t:
        return ""
    top_p = settings.get("top_p", 1.0)
    return f", sampled at T={t:g}" + (f" top-p {top_p:g}" if top_p < 1 else "")


def _engine(results: dict[str, Any]) -> str:
    """The engine that served the speculative side (`dflash` for results written before engines were recorded)."""
    return (results.get("engine") or {}).get("dflash", "dflash")


def tau_text(results: dict[str, Any]) -> str:
    """`tau <τ>`, `tau <τ> pooled` (from counters read around the whole run), or `τ not available from <engine>`."""
    h = results["headline"]
    if h["tau"] is None:
        return f"τ not available from {_engine(results)}"
    return f"tau {_fmt(h['tau'])}" + (" pooled" if h.get("tau_source") == "pooled" else "")


def headline_line(results: dict[str, Any]) -> str:
    """`DFlash vs AR: <median per-request speed ratio>x tokens/s (median of n paired requests, timing noise +-x%;
    tau <τ>, K=<K>)`, the engine when it is not ours, with a warning inside the brackets when the timing is too
    noisy (or the pairs too few) to trust (`_paired`)."""
    h = results["headline"]
    paired = h.get("paired") or {}
    n, noise = paired.get("pairs") or 0, paired.get("noise")
    where = ""
    if noise is not None:
        where = f"median of {n} paired requests, timing noise +-{noise / 2:.0%}" + (
            "" if paired.get("trusted") else ": too noisy to trust") + "; "
    elif n:
        where = f"{n} paired request{'s' if n > 1 else ''}: too few to trust; "
    engine = _engine(results)
    compiled = results.get("compiled_in_timed") or {}
    marked = f"; compiled inside timed requests: {_compiled_text(compiled)}" if compiled else ""
    return (f"DFlash vs AR: {_fmt(h['speedup'])}x tokens/s ({where}{tau_text(results)}, "
            f"K={results['settings']['block_size'] or '?'}{_sampling(results['settings'])}"
            f"{'' if engine == 'dflash' else f', {engine}'}{marked})")


def _compiled_text(compiled: dict[str, int]) -> str:
    """`dflash 3, ar 1`: the programs each mode's server compiled inside its timed requests."""
    return ", ".join(f"{mode} {n}" for mode, n in compiled.items())


def _engine_lines(results: dict[str, Any]) -> list[str]:
    """Which engine served the speculative side and where its τ came from (nothing for results of old runs)."""
    engine = results.get("engine")
    if not engine:
        return []
    h = results["headline"]
    where = (engine.get("unavailable", "") if h["tau"] is None else
             f"τ from {engine.get('source', '?')}" + ("; pooled over the run: per set not attributable"
                                                      if h.get("tau_source") == "pooled" else ""))
    return [f"Engine: {engine['dflash']} (AR: {engine.get('ar', '?')}); {where}.", ""]


def _compile_lines(results: dict[str, Any]) -> list[str]:
    """The warning that marks the numbers when a server compiled inside the timed requests (nothing otherwise)."""
    compiled = results.get("compiled_in_timed") or {}
    if not compiled:
        return []
    return [f"**Compiled inside the timed requests: {_compiled_text(compiled)} program(s)** (rows marked (!) below): "
            "those requests' times include XLA compiles, so their speed is understated (`dflash eval --strict` exits "
            "1 on this).", ""]


def render_markdown(results: dict[str, Any]) -> str:
    h, s, drafter = results["headline"], results["settings"], results["drafter"]
    lines = [f"# DFlash evaluation: {results['target'].get('model', '?')}", "",
             f"**{headline_line(results)}**; "
             + (f"greedy replies differing from AR: {h['mismatches']}"
                + (" (must be 0: an engine error)" if h["mismatches"] else "")
                if h["mismatches"] is not None else
                "sampled replies are not compared with AR's (lossless sampling rests on the engine's "
                "sampled-decoding tests)"), "",
             f"Drafter: `{drafter.get('path') or drafter.get('url', '?')}`; sets {', '.join(s['sets'])}, "
             f"{s['limit']} items each, {s['max_new_tokens']} new tokens per turn, concurrency {s['concurrency']}; "
             f"{results['environment'].get('machine', '')}.", "", *_engine_lines(results), *_compile_lines(results),
             "| set | tau | DFlash TPOT ms | AR TPOT ms | speedup (median, p25-p75) | DFlash tok/s | AR tok/s "
             "| accuracy (AR) | differ from AR |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["sets"].items():
        paired = r.get("paired") or {}
        quartiles = f" ({_fmt(paired.get('p25'))}-{_fmt(paired.get('p75'))})" if paired.get("pairs") else ""
        lines.append(f"| {name} | {_fmt(r['tau'])} | {_fmt(r['dflash']['tpot_ms'], '.1f')} | "
                     f"{_fmt(r['ar']['tpot_ms'], '.1f')} | {_fmt(r['speedup'], '.2f', 'x')}{quartiles} | "
                     f"{_fmt(r['dflash']['tok_s'], '.1f')} | {_fmt(r['ar']['tok_s'], '.1f')} | "
                     f"{_fmt(r['accuracy']['ar'], '.2f')} | {_fmt(r['mismatches'], 'd')} |")
    if results.get("categories"):
        lines += ["", "Per SPEED-Bench category:", "", "| category | tau | DFlash TPOT ms | AR TPOT ms "
                  "| speedup (median) | requests | differ from AR |", "|---|---|---|---|---|---|---|"]
        for name, r in results["categories"].items():
            lines.append(f"| {name} | {_fmt(r['tau'])} | {_fmt(r['dflash']['tpot_ms'], '.1f')} | "
                         f"{_fmt(r['ar']['tpot_ms'], '.1f')} | {_fmt(r['speedup'], '.2f', 'x')} | "
                         f"{r['dflash']['replies']} | {_fmt(r['mismatches'], 'd')} |")
    lines += ["", "| concurrency | DFlash tok/s | AR tok/s | ratio | DFlash p50 / p95 s | AR p50 / p95 s "
              "| compiled while timed (DFlash / AR) |", "|---|---|---|---|---|---|---|"]
    for c, r in results["concurrency"].items():
        d, a = r["dflash"], r["ar"]
        mark = " (!)" if d.get("compiles") or a.get("compiles") else ""
        lines.append(f"| {c}{mark} | {_fmt(d['throughput_tok_s'], '.1f')} | {_fmt(a['throughput_tok_s'], '.1f')} | "
                     f"{_fmt(r['throughput_ratio'], '.2f', 'x')} | {_fmt(d['p50_latency_s'])} / "
                     f"{_fmt(d['p95_latency_s'])} | {_fmt(a['p50_latency_s'])} / {_fmt(a['p95_latency_s'])} | "
                     f"{_fmt(d.get('compiles'), 'd')} / {_fmt(a.get('compiles'), 'd')} |")
    lines += ["", "Acceptance by draft position (share of verify steps whose draft i was accepted):", "",
              "| set | " + " | ".join(f"d{i + 1}" for i in range(len(h["accept_per_position"]))) + " |",
              "|---|" + "---|" * len(h["accept_per_position"])]
    for name, r in results["sets"].items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in r["accept_per_position"]) + " |")
    lines += ["", "Plots: `acceptance_by_position.png`, `tau_per_set.png`, `concurrency.png`.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """The three PNGs of the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results["sets"].items():
        if r["accept_per_position"]:
            ax.plot(range(1, len(r["accept_per_position"]) + 1), r["accept_per_position"], marker="o", label=name)
    ax.set(xlabel="draft position", ylabel="share of steps accepted", ylim=(0, 1.02),
           title="Acceptance by draft position")
    if any(r["accept_per_position"] for r in results["sets"].values()):
        ax.legend()
    paths.append(_save(fig, out_dir / "acceptance_by_position.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(results["sets"])
    ax.bar(names, [results["sets"][n]["tau"] or 0 for n in names])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="tau (tokens per verify step)", title=f"tau per set (K={results['settings']['block_size']})")
    paths.append(_save(fig, out_dir / "tau_per_set.png"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    levels = [int(c) for c in results["concurrency"]]
    rows = [results["concurrency"][str(c)] for c in levels]
    for mode in ("dflash", "ar"):
        left.plot(levels, [r[mode]["throughput_tok_s"] or 0 for r in rows], marker="o", label=mode)
    left.set(xlabel="concurrency", ylabel="tokens/s", title="Throughput", xscale="log", xticks=levels)
    left.set_xticklabels([str(c) for c in levels])
    left.legend()
    right.plot(levels, [r["throughput_ratio"] or 0 for r in rows], marker="o", color="C2")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(xlabel="concurrency", ylabel="DFlash / AR tokens/s", title="Speedup", xscale="log", xticks=levels)
    right.set_xticklabels([str(c) for c in levels])
    paths.append(_save(fig, out_dir / "concurrency.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """results.json, report.md and the PNGs in `out_dir` (each written to a temporary name, then renamed)."""
    written = {}
    for name, text in (("results.json", json.dumps(results, indent=2)), ("report.md", render_markdown(results))):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)
        written[name] = out_dir / name
    for path in plot(results, out_dir):
        written[path.name] = path
    return written


__all__ = ["SCHEMA", "final_answer", "headline_line", "plot", "render_markdown", "summarize", "write_outputs"]
