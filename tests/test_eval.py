"""`dflash eval` against the served engine: the CLI over server subprocesses writes results.json, report.md and
the plots; τ reported through HTTP equals the in-process engine's; an interrupted eval resumes; the report's
statistics on known records."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from dflash.configs.recipe import load_recipe
from dflash.eval.report import final_answer, headline_line, render_markdown, summarize
from dflash.eval.run import EvalSettings, RecordStore, evaluate
from dflash.eval.servers import serve_in_process
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import load_target
from dflash.models.zlab import save_zlab
from dflash.serve.engine import DecodeRun, decode

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


ROOT = Path(__file__).resolve().parents[1]
# The in-process servers' context: 128 tokens precompile 6 prefill lengths and 4 attention spans per engine, against
# 8 and 5 at the recipe's 256 (SmolLM2's programs, the fixture's minutes: 20 programs, not 26, the longest prefills
# gone). The longest prompt (GSM8K's first question, 114 tokens) plus NEW tokens plus the last step's K = 8 fill it.
MAX_LEN = 128
NEW = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    recipe = load_recipe("tiny")
    target = load_target(recipe.target)
    drafter = DFlashDrafter(target.drafter_arch(recipe.drafter), nnx.Rngs(0))
    directory = tmp_path_factory.mktemp("drafter")
    save_zlab(drafter, directory)
    return recipe, target, drafter, directory


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    """An in-process evaluation over real HTTP (DFlash and AR servers in threads); its output directory."""
    _, target, drafter, _ = tiny
    out = tmp_path_factory.mktemp("eval")
    settings = EvalSettings(sets=("gsm8k", "mtbench"), limit=1, max_new_tokens=NEW, concurrency=(1,))
    with serve_in_process(target, drafter, slots=1, max_len=MAX_LEN) as url, \
            serve_in_process(target, None, slots=1, max_len=MAX_LEN) as ar_url:
        results, paths = evaluate(url, ar_url, settings, out, progress=False)
        yield results, paths, out, (url, ar_url, settings)


@pytest.mark.slow
@pytest.mark.e2e
def test_cli_over_server_subprocesses_writes_the_report(tiny, tmp_path):
    _, _, _, directory = tiny
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "-m", "dflash.launch.cli", "eval", "--config", "tiny",
                           "--drafter", str(directory),
                           "--sets", "gsm8k,mtbench", "--limit", "1", "--max-new-tokens", "6", "--out", str(out),
                           "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"DFlash vs AR: [\d.]+x tokens/s \(3 paired requests: too few to trust; tau [\d.]+, K=8\)$",
                     done.stdout.strip()), done.stdout  # gsm8k's one turn and mtbench's two, each on both modes
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "dflash-eval/1" and set(results["sets"]) == {"gsm8k", "mtbench"}
    assert results["headline"]["mismatches"] == 0 and results["settings"]["block_size"] == 8
    assert results["compiles"] == {"dflash": 0, "ar": 0}  # `dflash serve` precompiled at start-up
    assert 1.0 <= results["headline"]["tau"] <= 8.0
    assert "DFlash vs AR:" in (out / "report.md").read_text()
    for name in ("acceptance_by_position.png", "tau_per_set.png", "concurrency.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    log = (out / "server.log").read_text()  # one process served both modes (`dflash serve --ar-port`)
    assert "--ar-port" in log and log.count("serving ") == 2 and " - AR, " in log


def test_served_tau_equals_the_in_process_engine(tiny, served):
    """Every DFlash reply's per-step acceptance, as the server reported it, equals a decode of the same prompt
    in this process (MT-Bench's second turn on the first turn's reply)."""
    _, target, drafter, _ = tiny
    results, _, out, _ = served
    records = [r for r in RecordStore(out / "records.jsonl").records.values() if r["kind"] == "reply"]
    dflash = {(r["id"], r["turn"]): r for r in records if r["mode"] == "dflash"}
    from dflash.data.eval_sets import load_eval_set

    items = {i.id: i for name in ("gsm8k", "mtbench") for i in load_eval_set(name, 1)}
    assert len(dflash) == sum(len(i.turns) for i in items.values()) == 3
    tok = target.tokenizer
    for (item_id, turn), record in dflash.items():
        messages = []
        for t in range(turn + 1):
            messages.append({"role": "user", "content": items[item_id].turns[t]})
            if t < turn:
                messages.append({"role": "assistant", "content": dflash[item_id, t]["text"]})
        prompt = tok.encode_chat(messages, add_generation_prompt=True)
        [local] = decode(target.params, target.cfg, [prompt], NEW, max_len=MAX_LEN,
                         drafter=drafter, stop_ids=tok.stop_token_ids)
        assert record["accepted"] == local.accepted and record["tokens"] == len(local.token_ids), (item_id, turn)
    pooled = [a for r in dflash.values() for a in r["accepted"]]
    assert results["headline"]["tau"] == pytest.approx(sum(a + 1 for a in pooled) / len(pooled))
    # `dflash serve` told from its /v1/models (owned_by dflash): τ from each reply's `dflash` object
    assert results["engine"]["dflash"] == results["engine"]["ar"] == "dflash"
    assert results["headline"]["tau_source"] == "per request"
    assert results["headline"]["mismatches"] == 0
    assert results["compiles"] == {"dflash": 0, "ar": 0}  # the servers precompiled: nothing compiled while timed


def test_an_interrupted_eval_resumes_sending_only_what_is_missing(served):
    _, _, out, (url, ar_url, settings) = served
    path = out / "records.jsonl"
    lines = path.read_text().splitlines()
    again, _ = evaluate(url, ar_url, settings, out, progress=False)
    assert path.read_text().splitlines() == lines, "a complete eval resent requests"
    # Lose the DFlash record of MT-Bench's second turn and leave a torn line, as a kill would.
    dropped = [i for i, line in enumerate(lines) if json.loads(line).get("id") == "mtbench:0"
               and json.loads(line)["mode"] == "dflash" and json.loads(line)["turn"] == 1]
    kept = [line for i, line in enumerate(lines) if i not in dropped]
    path.write_text("\n".join(kept) + '\n{"kind": "reply", "mo')
    resumed, _ = evaluate(url, ar_url, settings, out, progress=False)
    added = [json.loads(line) for line in path.read_text().splitlines()[len(kept):]]
    assert [(r["kind"], r.get("id"), r.get("turn")) for r in added] == [
        ("reply", "mtbench:0", 0), ("reply", "mtbench:0", 1), ("wall", None, None), ("compiles", None, None)]
    assert resumed["headline"]["tau"] == again["headline"]["tau"]


@pytest.mark.slow  # ~25 s: nightly; the record store's rule is checked without servers below
def test_a_rerun_against_another_drafter_measures_it_again(tiny, served, tmp_path):
    """Records are kept per setup: the same directory evaluated against a server with other drafter weights
    (or an old directory whose records carry no setup) sends the DFlash requests again and keeps AR's, so a
    drafter is never reported with another drafter's replies."""
    import shutil

    recipe, target, _, _ = tiny
    _, _, out, (_, ar_url, settings) = served
    copy = tmp_path / "eval"
    shutil.copytree(out, copy)
    before = list(RecordStore(copy / "records.jsonl").records.values())
    setups = {r["mode"]: r["setup"] for r in before if r["kind"] == "setup"}
    assert set(setups) == {"dflash", "ar"} and setups["ar"]["drafter"] is None
    assert setups["dflash"]["drafter"] and setups["dflash"]["max_new_tokens"] == NEW
    other = DFlashDrafter(target.drafter_arch(recipe.drafter), nnx.Rngs(1))
    with serve_in_process(target, other, slots=2, max_len=MAX_LEN, precompile=False) as url:
        evaluate(url, ar_url, settings, copy, progress=False)
    after = list(RecordStore(copy / "records.jsonl").records.values())
    new = {r["mode"]: r["setup"] for r in after if r["kind"] == "setup"}
    assert new["ar"] == setups["ar"] and new["dflash"]["drafter"] != setups["dflash"]["drafter"]
    replies = lambda records, mode: [r for r in records if r["kind"] == "reply" and r["mode"] == mode]  # noqa: E731
    assert replies(after, "ar") == replies(before, "ar"), "AR's replies were sent again"
    assert len(replies(after, "dflash")) == len(replies(before, "dflash")) == 3
    # Sent again: the DFlash replies now follow AR's (the first run recorded DFlash's first).
    where = lambda records, mode: [i for i, r in enumerate(records) if r["kind"] == "reply" and r["mode"] == mode]  # noqa: E731
    assert min(where(before, "dflash")) < min(where(before, "ar"))
    assert min(where(after, "dflash")) > max(where(after, "ar"))

    # Records written before setups were recorded are not trusted either.
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text("".join(json.dumps(r) + "\n" for r in before if r["kind"] != "setup"))
    store = RecordStore(legacy)
    store.begin("ar", setups["ar"])
    assert not [k for k in store.records if k[1] == "ar" and k[0] != "setup"]
    # 3 replies, the wall time and the compile count of the timed region
    assert sorted(k[0] for k in RecordStore(legacy).records if k[1] == "dflash") == ["compiles", *["reply"] * 3,
                                                                                     "wall"]


@pytest.mark.slow  # ~40 s: nightly; the sampled report (test_sampled_reports_do_not_compare_replies) and the engine's
# seeded sampling (test_engine) stay
def test_a_sampled_eval_records_its_rule_and_is_the_engine_sampling_with_those_seeds(tiny, served, tmp_path):
    """`temperature` > 0: every request is sampled with its own stable seed (the same for both modes), results.json
    records the rule, replies are not compared with AR (mismatches None), and each DFlash first turn's acceptance
    equals an in-process sampled decode of the prompt with that seed; a greedy run in the same directory drops
    the sampled records instead of reporting them."""
    from dflash.serve.config import SamplingConfig

    _, target, drafter, _ = tiny
    _, _, _, (url, ar_url, settings) = served
    sampled = dataclasses.replace(settings, temperature=1.0, top_p=0.9, seed=7)
    results, paths = evaluate(url, ar_url, sampled, tmp_path, progress=False)
    assert {k: results["settings"][k] for k in ("temperature", "top_p", "seed")} == {"temperature": 1.0,
                                                                                    "top_p": 0.9, "seed": 7}
    assert results["headline"]["mismatches"] is None and "T=1 top-p 0.9" in paths["report.md"].read_text()
    records = [r for r in RecordStore(tmp_path / "records.jsonl").records.values() if r["kind"] == "reply"]
    tok = target.tokenizer
    from dflash.data.eval_sets import load_eval_set

    items = {i.id: i for name in ("gsm8k", "mtbench") for i in load_eval_set(name, 1)}
    firsts = [r for r in records if r["mode"] == "dflash" and r["turn"] == 0]
    assert len(firsts) == 2
    for r in firsts:
        prompt = tok.encode_chat([{"role": "user", "content": items[r["id"]].turns[0]}], add_generation_prompt=True)
        [local] = decode(target.params, target.cfg, [prompt], NEW, max_len=MAX_LEN,
                         drafter=drafter, stop_ids=tok.stop_token_ids,
                         sampling=SamplingConfig(temperature=1.0, top_p=0.9),
                         run=DecodeRun(seeds=[sampled.request_seed(r["id"], 0)]))
        assert r["accepted"] == local.accepted and r["tokens"] == len(local.token_ids), r["id"]
    greedy, _ = evaluate(url, ar_url, settings, tmp_path, progress=False)
    assert greedy["headline"]["mismatches"] == 0 and greedy["settings"]["temperature"] == 0.0


def test_sampled_reports_do_not_compare_replies():
    records = [_reply("dflash", "gsm8k:1", 0, "the answer is 7", [2], 0.05),
               _reply("ar", "gsm8k:1", 0, "the answer is 8", [], 0.10)]
    settings = dataclasses.asdict(EvalSettings(sets=("gsm8k",), limit=1, temperature=0.7))
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {**settings, "block_size": 4}}
    r = summarize(records, ["gsm8k"], [1], 4, {}, meta, compare=False)
    assert r["sets"]["gsm8k"]["mismatches"] is None and r["headline"]["mismatches"] is None
    assert "K=4, sampled at T=0.7" in headline_line(r)
    assert "not compared" in render_markdown(r)
    with pytest.raises(ValueError, match="temperature"):
        EvalSettings(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        EvalSettings(temperature=1.0, top_p=0.0)
    assert EvalSettings().request_seed("gsm8k:0", 0) is None
    one = EvalSettings(temperature=1.0, seed=3)
    assert one.request_seed("gsm8k:0", 1) == one.request_seed("gsm8k:0", 1) != one.request_seed("gsm8k:0", 0)


def _reply(mode, item, turn, text, accepted, tpot):
    return {"kind": "reply", "mode": mode, "concurrency": 1, "id": item, "set": item.split(":")[0], "turn": turn,
            "text": text, "tokens": 10, "finish": "length", "latency_s": 1.0, "ttft_s": 0.1, "tpot_s": tpot,
            "accepted": accepted}


def test_replies_of_another_setup_are_dropped_and_the_other_modes_kept(tmp_path):
    """The record store keeps a mode's replies only under the setup they were made with: a rerun against another
    drafter drops DFlash's replies (on disk too) and keeps AR's; replies written before setups were recorded are
    not trusted either. (The served version of this: test_a_rerun_against_another_drafter_measures_it_again.)"""
    path = tmp_path / "records.jsonl"
    first, other, ar = {"drafter": "aaa", "max_new_tokens": 8}, {"drafter": "bbb", "max_new_tokens": 8}, {
        "drafter": None, "max_new_tokens": 8}
    store = RecordStore(path)
    store.begin("dflash", first)
    store.begin("ar", ar)
    for mode in ("dflash", "ar"):
        for turn in (0, 1):
            store.add(_reply(mode, "mtbench:0", turn, "x", [1] if mode == "dflash" else [], 0.1))
    replies = lambda s, mode: sorted(k for k in s.records if k[0] == "reply" and k[1] == mode)  # noqa: E731
    again = RecordStore(path)
    again.begin("dflash", first)
    again.begin("ar", ar)
    assert len(replies(again, "dflash")) == len(replies(again, "ar")) == 2 and again.path.read_text() == \
        path.read_text()
    again.begin("dflash", other)
    assert replies(again, "dflash") == [] and len(replies(again, "ar")) == 2
    reread = RecordStore(path)
    assert replies(reread, "dflash") == [] and len(replies(reread, "ar")) == 2
    assert reread.records[("setup", "dflash", None, None, None)]["setup"] == other
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text("".join(json.dumps(r) + "\n" for r in store.records.values() if r["kind"] != "setup"))
    old = RecordStore(legacy)
    old.begin("ar", ar)
    assert replies(old, "ar") == [] and len(replies(old, "dflash")) == 2


def test_report_statistics_on_known_records():
    records = [_reply("dflash", "gsm8k:0", 0, "so \\boxed{1,234}", [3, 0, 1], 0.05),
               _reply("ar", "gsm8k:0", 0, "so \\boxed{1,234}", [], 0.10),
               _reply("dflash", "gsm8k:1", 0, "the answer is 7", [2], 0.05),
               _reply("ar", "gsm8k:1", 0, "the answer is 8", [], 0.10),
               {"kind": "wall", "mode": "dflash", "concurrency": 1, "seconds": 2.0, "tokens": 20},
               {"kind": "wall", "mode": "ar", "concurrency": 1, "seconds": 4.0, "tokens": 20}]
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {"block_size": 4}}
    r = summarize(records, ["gsm8k"], [1], 4, {"gsm8k:0": "1234", "gsm8k:1": "8"}, meta)
    s = r["sets"]["gsm8k"]
    assert s["tau"] == pytest.approx((4 + 1 + 2 + 3) / 4) and s["steps"] == 4
    assert s["accept_per_position"] == [0.75, 0.5, 0.25] and s["accept_hist"] == [0.25, 0.25, 0.25, 0.25]
    assert s["speedup"] == pytest.approx(2.0) and s["mismatches"] == 1 and s["mismatched"] == ["gsm8k:1#0"]
    assert s["accuracy"] == {"dflash": 0.5, "ar": 1.0}
    assert r["concurrency"]["1"]["throughput_ratio"] == pytest.approx(2.0)
    assert final_answer("x = \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}" and final_answer("no digits") is None


def _compiled_run(count):
    """The results of a greedy run whose DFlash server compiled `count` programs inside its timed requests at
    concurrency 4 (0 at 1; the AR server none)."""
    records = [_reply("dflash", "gsm8k:0", 0, "7", [1], 0.05), _reply("ar", "gsm8k:0", 0, "7", [], 0.10)]
    records += [{"kind": "compiles", "mode": m, "concurrency": c, "count": count if (m, c) == ("dflash", 4) else 0}
                for m in ("dflash", "ar") for c in (1, 4)]
    settings = dataclasses.asdict(EvalSettings(sets=("gsm8k",), limit=1, concurrency=(1, 4)))
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {**settings, "block_size": 4},
            "engine": {"dflash": "dflash", "ar": "dflash", "source": "replies", "unavailable": None}}
    results = summarize(records, ["gsm8k"], [1, 4], 4, {}, meta)
    results["compiles"] = {"dflash": count, "ar": 0}
    return results


def test_a_compile_inside_the_timed_requests_marks_the_numbers():
    """Reported per mode and per concurrency, on the headline and in report.md (negative control: a clean run shows
    none of it)."""
    marked, clean = _compiled_run(3), _compiled_run(0)
    assert marked["compiled_in_timed"] == {"dflash": 3} and clean["compiled_in_timed"] == {}
    assert marked["concurrency"]["4"]["dflash"]["compiles"] == 3 and marked["concurrency"]["1"]["dflash"]["compiles"] \
        == 0
    assert headline_line(marked).endswith("; compiled inside timed requests: dflash 3)")
    assert "compiled" not in headline_line(clean)
    report = render_markdown(marked)
    assert "Compiled inside the timed requests: dflash 3 program(s)" in report and "| 4 (!) |" in report
    assert "| 1 |" in report and "(!)" not in render_markdown(clean)


@pytest.mark.parametrize("strict", [False, True])
def test_a_finished_eval_exits_0_on_compiles_unless_strict(strict, monkeypatch, tmp_path, capsys):
    """`dflash eval` reports a forced compile inside the timed requests (a note; with --strict an error) and exits 1
    on it only with --strict; a clean run exits 0 either way."""
    from dflash.eval import run as eval_run
    from dflash.launch.cli import main

    for count, code in ((3, 1 if strict else 0), (0, 0)):
        results = _compiled_run(count)
        monkeypatch.setattr(eval_run, "run_eval", lambda *a, results=results, **k: (
            results, {"report.md": tmp_path / "report.md"}))
        argv = ["eval", "--config", "tiny", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]
        assert main(argv + (["--strict"] if strict else [])) == code
        out = capsys.readouterr().out
        assert ("the servers compiled inside the timed requests ({'dflash': 3}" in out) == bool(count)
        assert out.count("ERROR") == (1 if count and strict else 0)


def test_speedup_is_the_median_of_per_request_ratios_and_its_timing_noise_is_judged():
    """Each request's AR TPOT over the same request's DFlash TPOT; the median resists one request of a slow spell
    (the mean of TPOTs does not). A ratio is the request's τ times the cost ratio of the two modes' steps: the
    prompts move the τ, only the timing moves the cost ratio, so the headline trusts the speedup by the cost
    ratios' 95% interval (at most 10% of their median) and says when it is wider or the pairs too few."""
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {"block_size": 4}}

    def summary(ratios, steps=None):  # a reply of 10 tokens over `steps` verify steps: tau 10 / steps
        steps = steps or [1] * len(ratios)
        records = [r for i, (ratio, n) in enumerate(zip(ratios, steps, strict=True)) for r in (
            _reply("dflash", f"gsm8k:{i}", 0, "x", [0] * n, 0.1 / ratio), _reply("ar", f"gsm8k:{i}", 0, "x", [], 0.1))]
        return summarize(records, ["gsm8k"], [1], 4, {}, meta)

    ratios = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.0, 1.98, 0.5]  # the last pair ran in a slow spell of DFlash's
    r = summary(ratios)
    paired = r["headline"]["paired"]
    assert r["headline"]["speedup"] == pytest.approx(2.0) and paired["pairs"] == 10
    assert paired["ci"] == (pytest.approx(1.9), pytest.approx(2.05))  # the 2nd and 9th of 10
    assert paired["noise"] == pytest.approx(0.15 / 2.0) and paired["trusted"]
    assert "(median of 10 paired requests, timing noise +-4%; tau" in headline_line(r)
    # Prompts of different acceptance at one cost ratio (0.8): the ratios spread 2.4x, the timing not at all.
    steps = [2, 3, 4, 5, 6, 7, 8, 9, 10, 5]
    mixed = summary([10 / n * 0.8 for n in steps], steps)
    assert mixed["headline"]["paired"]["ci"][1] / mixed["headline"]["paired"]["ci"][0] > 2
    assert mixed["headline"]["paired"]["cost_ratio"] == pytest.approx(0.8)
    assert mixed["headline"]["paired"]["noise"] == pytest.approx(0.0) and mixed["headline"]["paired"]["trusted"]
    noisy = summary([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6, 2.8])  # one tau, the timing all over the place
    assert not noisy["headline"]["paired"]["trusted"]
    assert "timing noise +-37%: too noisy to trust" in headline_line(noisy)  # (2.6 - 1.2) / 1.9 / 2
    few = summary(ratios[:5])  # below 6 values no interval reaches 95%
    assert few["headline"]["paired"]["noise"] is None and not few["headline"]["paired"]["trusted"]
    assert "5 paired requests: too few to trust" in headline_line(few)


def test_median_interval_matches_the_binomial_table():
    from dflash.eval.report import median_interval

    # Order statistics (k-th smallest, k-th largest) of the 95% interval of a median, from the binomial table.
    table = {6: 1, 8: 1, 9: 2, 10: 2, 11: 2, 12: 3, 17: 5, 20: 6, 30: 10}
    for n, k in table.items():
        assert median_interval(list(range(n))) == (k - 1, n - k), n
    assert median_interval([1.0] * 5) is None


class _FakeServer:
    """A server `eval.run.collect` talks to: DFlash when its mode ends in "dflash" (block size 4, one accepted draft
    per reply), else AR; every reply 3 tokens; `calls` records the order of the chat requests; the mode `one_chunk`
    streams its replies in one chunk (TPOT 0)."""

    def __init__(self, mode, *, calls, one_chunk=None):
        self.mode, self.calls, self.one_chunk = mode, calls, one_chunk

    def get(self, path):
        return {"data": [{"id": "m", "block_size": 4 if self.mode.endswith("dflash") else None}]}

    def model(self):
        return "m"

    def compiles(self):
        return 0

    def chat(self, model, messages, *args):
        self.calls.append(self.mode)
        return type("Reply", (), {"text": "ok", "tokens": 3, "finish_reason": "length", "latency_s": 0.01,
                                  "ttft_s": 0.001, "tpot_s": 0.0 if self.mode == self.one_chunk else 0.001,
                                  "accepted": [1] if self.mode.endswith("dflash") else []})()


def test_paired_collection_alternates_which_mode_goes_first(tmp_path):
    """With both servers up at concurrency 1, each conversation runs on both back to back, DFlash first for even
    conversations and AR first for odd ones; both modes' wall records count only their own requests."""
    from dflash.eval import run as eval_run

    calls = []
    Fake = functools.partial(_FakeServer, calls=calls)

    settings = EvalSettings(sets=("gsm8k",), limit=4, max_new_tokens=3)
    items = eval_run.eval_items(settings)
    records = eval_run.collect({"dflash": Fake("dflash"), "ar": Fake("ar")}, settings, tmp_path, items, False)
    timed = calls[2:]  # after each mode's warm-up request
    assert timed == ["dflash", "ar", "ar", "dflash", "dflash", "ar", "ar", "dflash"]
    walls = {r["mode"]: r for r in records if r["kind"] == "wall"}
    assert walls["dflash"]["tokens"] == walls["ar"]["tokens"] == 4 * 3


def test_collection_pairs_any_number_of_modes(tmp_path):
    """benchmarks/vs_vllm.py's use: four servers (two engines, each DFlash and AR) paired at concurrency 1, the order
    reversed from one conversation to the next, the named speculative modes' counts read; a reply whose tokens came
    in one chunk (TPOT 0) is summarised without a decode rate."""
    from dflash.eval import run as eval_run

    calls = []
    Fake = functools.partial(_FakeServer, calls=calls, one_chunk="x-dflash")

    modes = ("x-dflash", "x-ar", "y-dflash", "y-ar")
    settings = EvalSettings(sets=("gsm8k",), limit=2, max_new_tokens=3)
    items = eval_run.eval_items(settings)
    records = eval_run.collect({m: Fake(m) for m in modes}, settings, tmp_path, items, False,
                               speculative=("x-dflash", "y-dflash"))
    assert calls[4:] == [*modes, *reversed(modes)]  # after each mode's warm-up request
    x = [{**r, "mode": r["mode"][2:]} for r in records if r["mode"].startswith("x-") and r["concurrency"] == 1]
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {"block_size": 4}}
    head = summarize(x, ["gsm8k"], [1], 4, {}, meta)["headline"]
    assert head["dflash"]["tpot_ms"] == 0.0 and head["dflash"]["decode_tok_s"] is None
    assert head["ar"]["decode_tok_s"] == pytest.approx(1000.0) and head["tau"] == 2.0


@pytest.mark.slow
def test_run_eval_starts_one_process_serving_both_modes(tiny, served, monkeypatch, tmp_path):
    """`dflash eval --drafter` starts one server process for both modes (`dflash serve --ar-port`: on an
    accelerator host a second process could not open the chips) and pairs the requests over its two ports. The
    results are those of the servers side by side."""
    import contextlib

    from dflash.eval import servers
    from dflash.eval.run import ServeArgs, run_eval

    _, target, drafter, directory = tiny
    started = []

    @contextlib.contextmanager
    def fake_pair(args, log, slots):
        started.append(args)
        with serve_in_process(target, drafter, slots=2, max_len=MAX_LEN, precompile=False) as url, \
                serve_in_process(target, None, slots=2, max_len=MAX_LEN, precompile=False) as ar:
            yield url, ar

    def no_single(*args, **kwargs):
        raise AssertionError("a second server process was started")

    monkeypatch.setattr(servers, "serve_pair_subprocess", fake_pair)
    monkeypatch.setattr(servers, "serve_subprocess", no_single)
    _, _, _, (_, _, settings) = served
    results, _ = run_eval(settings, tmp_path / "eval", drafter=str(directory), serve=ServeArgs("tiny"), progress=False)
    assert len(started) == 1 and "--drafter" in started[0] and "--ar" not in started[0]
    reference, _, _, _ = served
    assert results["headline"]["mismatches"] == 0
    assert results["headline"]["tau"] == reference["headline"]["tau"]
