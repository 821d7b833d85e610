"""`dflash eval --url` against other engines: τ and acceptance by position from each engine's own statistics (vLLM's
Prometheus counters, SGLang's per-request meta_info), the engine told from the server, speed paired against an AR
server, and an engine without speculative statistics reported, not a crash. The servers are the fakes of
tests/fake_engines.py, which implement those engines' documented metrics with known acceptance; `dflash serve`
itself is evaluated in tests/test_eval.py."""

from __future__ import annotations

import json

import pytest
from fake_engines import fake_server, pooled_tau

from dflash.eval.client import Client, ServerError
from dflash.eval.engines import Counts, Meter, VLLMEngine, detect, engine_for, metric_samples
from dflash.eval.report import headline_line, render_markdown
from dflash.eval.run import EvalSettings, RecordStore, evaluate
from dflash.launch.cli import main

SETS = ("gsm8k", "mtbench")  # 3 turns at limit 1: gsm8k's one, MT-Bench's two
WARM_UPS = len(SETS)  # one untimed request per set comes first


def _replies(out, mode="dflash"):
    return [r for r in RecordStore(out / "records.jsonl").records.values() if r["kind"] == "reply"
            and r["mode"] == mode]


def test_counts_add_subtract_and_give_the_histogram_of_a_prefix():
    ours = Counts.of_steps([3, 0, 1, 2], width=3)
    assert ours == Counts(4, 6, (3, 2, 1), (1, 1, 1, 1)) and ours.tau == pytest.approx(2.5)
    # vLLM gives no histogram: derived from the per-position counts (drafts are accepted as a prefix)
    assert Counts(4, 6, (3, 2, 1)).histogram() == (1, 1, 1, 1)
    both = ours + Counts(2, 1, (1, 0, 0), (1, 1, 0, 0))
    assert both == Counts(6, 7, (4, 2, 1), (2, 2, 1, 1)) and both - ours == Counts(2, 1, (1, 0, 0), (1, 1, 0, 0))
    assert Counts.from_json(json.loads(json.dumps(both.to_json()))) == both
    assert Counts(0, 0).tau is None


def test_vllm_counters_are_read_with_their_names_and_summed_over_engines():
    with fake_server("vllm", k=4, accepted=[2, 0, 3], record_delay=0) as server:
        client = Client(server.url)
        engine = VLLMEngine()
        assert engine.snapshot(client) == (Counts(0, 0, (0, 0, 0)), 0.0)
        assert engine.describe(client) == {"id": "fake/target", "block_size": 4, "drafter": None}
        client.stream, client.extra_body = True, dict(engine.extra_body)
        for _ in range(2):  # one request on engine index 0, one on 1
            client.chat("fake/target", [{"role": "user", "content": "hi"}], 8)
        samples = metric_samples(client.text("/metrics"))
        assert {labels["engine"] for labels, _ in samples["vllm:spec_decode_num_drafts_total"]} == {"0", "1"}
        counts, finished = engine.snapshot(client)
        steps = [a for r in server.log for a in r["per_step"]]
        assert finished == 2.0 and counts.steps == len(steps) and counts.accepted == sum(steps)
        assert counts.per_position == tuple(sum(a > i for a in steps) for i in range(3))


def test_the_engine_is_told_from_the_server():
    with fake_server("vllm") as vllm, fake_server("vllm", owned_by="") as vllm_metrics, \
            fake_server("sglang") as sglang, fake_server("sglang", owned_by="") as sglang_info, \
            fake_server("sglang", owned_by="somebody") as unknown:
        assert detect(Client(vllm.url)) == "vllm"
        assert detect(Client(vllm_metrics.url)) == "vllm"  # no owned_by: the vllm: metric names
        assert detect(Client(sglang.url)) == "sglang"
        assert detect(Client(sglang_info.url)) == "sglang"  # no owned_by, no /metrics: /get_server_info
        unknown.engine = "other"  # answers no /get_server_info any more
        with pytest.raises(ServerError, match="pass --engine dflash, vllm or sglang"):
            detect(Client(unknown.url))
        assert engine_for(Client(unknown.url), fallback=True).name == "openai"
        client = Client(sglang.url)
        assert engine_for(client, "sglang").name == "sglang" and client.stream is False
        assert client.extra_body == {"return_meta_info": True}
        with pytest.raises(ValueError, match="engine must be auto or one of dflash, vllm, sglang; received 'tgi'"):
            engine_for(client, "tgi")


def test_dflash_eval_url_measures_a_fake_vllm_servers_tau_from_its_metrics(tmp_path, capsys):
    """The issue's done-when line: `dflash eval --url` on a fake vLLM reports the τ the fake produced, per request
    (counter deltas around each request at concurrency 1; the fake counts each request 0.25 s after its reply ends,
    as vLLM records a step's statistics after handing out its output), and its acceptance by position; speed
    paired against an AR vLLM, the waits for the counters left out of the timed segment."""
    out = tmp_path / "eval"
    with fake_server("vllm", k=5, accepted=[3, 1, 0, 4, 2, 2], record_delay=0.25) as spec, \
            fake_server("vllm", spec=False) as ar:
        code = main(["eval", "--config", "tiny", "--url", spec.url, "--ar-url", ar.url, "--sets", ",".join(SETS),
                     "--limit", "1", "--max-new-tokens", "24", "--out", str(out), "--no-progress"])
        timed = spec.log[WARM_UPS:]
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    results = json.loads((out / "results.json").read_text())
    h = results["headline"]
    assert results["engine"]["dflash"] == "vllm" and results["engine"]["ar"] == "vllm"
    assert h["tau"] == pytest.approx(pooled_tau(timed), abs=1e-12) and h["tau_source"] == "per request"
    steps = [a for r in timed for a in r["per_step"]]
    assert h["steps"] == len(steps) and results["settings"]["block_size"] == 5
    assert h["accept_per_position"] == pytest.approx([sum(a > i for a in steps) / len(steps) for i in range(4)])
    # each reply's counts are its own request's, though the fake counted it after the reply ended
    assert [r["spec"]["accepted"] for r in _replies(out)] == [r["accepted"] for r in timed]
    assert results["sets"]["mtbench"]["tau"] == pytest.approx(pooled_tau(timed[1:]))  # gsm8k's turn ran first
    assert h["paired"]["pairs"] == 3 and h["speedup"] is not None and h["mismatches"] == 0
    wall = next(r for r in RecordStore(out / "records.jsonl").records.values() if r["kind"] == "wall"
                and r["mode"] == "dflash")
    assert wall["seconds"] < sum(r["latency_s"] for r in _replies(out)) + 0.1  # not the 3 x 0.25 s of waiting
    assert f"tau {h['tau']:.2f}, K=5, vllm" in stdout.strip().splitlines()[-1]
    assert "Engine: vllm (AR: vllm); τ from its Prometheus counters" in (out / "report.md").read_text()


def test_chat_template_kwargs_reach_every_request_of_both_servers_and_the_records_setup(tmp_path, capsys):
    """`--chat-template-kwargs` (gpt-oss's reasoning effort, Qwen3's thinking switch): sent with every request,
    warm-ups included, to the speculative and the AR server alike, and kept in each mode's setup, so replies made
    without them are measured again rather than mixed in; a value that is not a JSON object is refused naming the
    flag."""
    out = tmp_path / "eval"
    argv = ["eval", "--config", "tiny", "--sets", "gsm8k", "--limit", "1", "--max-new-tokens", "8", "--out", str(out),
            "--no-progress"]
    with fake_server("vllm", record_delay=0) as spec, fake_server("vllm", spec=False) as ar:
        urls = ["--url", spec.url, "--ar-url", ar.url]
        assert main([*argv, *urls]) == 0
        plain = len(spec.bodies)
        assert main([*argv, *urls, "--chat-template-kwargs", '{"reasoning_effort": "low"}']) == 0
        sent = spec.bodies[plain:], ar.bodies[plain:]
    assert all("chat_template_kwargs" not in b for b in spec.bodies[:plain] + ar.bodies[:plain])
    assert all(len(bodies) == plain for bodies in sent)  # the earlier replies were not reused: measured again
    assert all(b["chat_template_kwargs"] == {"reasoning_effort": "low"} for bodies in sent for b in bodies)
    setups = [r["setup"] for r in RecordStore(out / "records.jsonl").records.values() if r["kind"] == "setup"]
    assert [s.get("chat_template_kwargs") for s in setups] == [{"reasoning_effort": "low"}] * 2
    capsys.readouterr()
    assert main([*argv, "--url", "http://127.0.0.1:9", "--chat-template-kwargs", "low"]) == 2
    assert "--chat-template-kwargs must be a JSON object" in capsys.readouterr().err


def test_sglang_tau_and_acceptance_come_from_each_replys_meta_info(tmp_path):
    """SGLang refuses meta_info on a streamed chat request: requests go unstreamed, τ = (completion_tokens - 1) /
    spec_verify_ct per request (the first token is the prefill's), acceptance by position from
    spec_accept_histogram, K from /get_server_info, times from the server's prefill/decode stamps."""
    settings = EvalSettings(sets=SETS, limit=1, max_new_tokens=20)
    with fake_server("sglang", k=4, accepted=[3, 0, 2, 1]) as spec, fake_server("sglang", spec=False) as ar:
        results, _ = evaluate(spec.url, ar.url, settings, tmp_path, progress=False)
        timed = spec.log[WARM_UPS:]
    h = results["headline"]
    assert results["engine"]["dflash"] == "sglang" and results["settings"]["block_size"] == 4
    assert h["tau"] == pytest.approx(sum(r["completion_tokens"] - 1 for r in timed) / sum(r["steps"] for r in timed))
    steps = [a for r in timed for a in r["per_step"]]
    assert h["accept_per_position"] == pytest.approx([sum(a > i for a in steps) / len(steps) for i in range(3)])
    replies = _replies(tmp_path)
    assert {r["timing"] for r in replies} == {"server"} and all(r["tpot_s"] > 0 for r in replies)
    assert h["paired"]["pairs"] == 3 and h["mismatches"] == 0


def test_an_engine_without_speculative_counts_is_reported_and_its_speed_still_measured(tmp_path, capsys):
    """A vLLM server started without --speculative-config (no vllm:spec_decode_* counters) as --url: τ not
    available from vllm, said on the headline and in a note, and the speed still measured; the same for an SGLang
    server without --speculative-algorithm."""
    out = tmp_path / "eval"
    with fake_server("vllm", spec=False) as plain, fake_server("vllm", spec=False) as ar:
        code = main(["eval", "--config", "tiny", "--url", plain.url, "--ar-url", ar.url, "--sets", "gsm8k",
                     "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    results = json.loads((out / "results.json").read_text())
    assert results["headline"]["tau"] is None and results["headline"]["speedup"] is not None
    assert "τ not available from vllm, K=?, vllm" in stdout.strip().splitlines()[-2]  # the headline, then the note
    assert "note: τ not available from vllm: its /metrics has no vllm:spec_decode_* counters" in stdout
    assert "served without --speculative-config?" in render_markdown(results)
    with fake_server("sglang", spec=False) as plain, fake_server("sglang", spec=False) as ar:
        results, _ = evaluate(plain.url, ar.url, EvalSettings(sets=("gsm8k",), limit=2, max_new_tokens=8),
                              tmp_path / "sglang", progress=False)
    assert results["headline"]["tau"] is None and results["headline"]["speedup"] is not None
    assert "τ not available from sglang" in headline_line(results)


def test_counters_read_around_concurrent_requests_are_pooled_and_labelled_so(tmp_path):
    """Above concurrency 1 a counter engine's deltas cannot be told apart per request: τ is pooled over the segment
    (read once every request of it is counted), the headline says `pooled`, the sets report none."""
    settings = EvalSettings(sets=SETS, limit=2, max_new_tokens=16, concurrency=(3,))
    with fake_server("vllm", k=4, record_delay=0.2) as spec, fake_server("vllm", spec=False) as ar:
        results, _ = evaluate(spec.url, ar.url, settings, tmp_path, progress=False)
        timed = spec.log[WARM_UPS:]
    h = results["headline"]
    assert h["tau_source"] == "pooled" and h["tau"] == pytest.approx(pooled_tau(timed))
    assert all(s["tau"] is None for s in results["sets"].values())
    assert "pooled" in headline_line(results) and "per set not attributable" in render_markdown(results)


def test_a_meter_waits_for_the_counters_to_count_every_request_sent():
    """A read of vLLM's counters waits until its finished-request counter has counted every request sent (the fake
    counts each 0.3 s after its reply): a warm-up's counts stay out of the next request's, and each request's land
    on it."""
    with fake_server("vllm", k=4, accepted=[2, 2, 0, 1], record_delay=0.3) as server:
        client = Client(server.url)
        meter = Meter(engine_for(client, "vllm"), client)
        client.chat("fake/target", [{"role": "user", "content": "warm up"}], 7)  # 2 steps: 2, 2
        before = meter.before(1)
        reply = client.chat("fake/target", [{"role": "user", "content": "hi"}], 4)  # 2 steps: 0, 1
        counts = meter.after(reply, before, 1)
    assert counts == Counts(2, 1, (1, 0, 0)) and reply.tokens == 4 and meter.available


def test_dflash_eval_sends_the_recipes_template_variables_unless_the_flag_is_given(tmp_path, capsys):
    """`dflash eval` without --chat-template-kwargs sends the recipe's data.regen.template_kwargs (the variables its
    training answers were made with) with every request, and says so; the flag overrides them, `{}` included. They
    are recorded in results.json's settings (the model card names them) and in each mode's setup."""
    recipe = ["--config", "tiny", "data.regen.template_kwargs={enable_thinking: false}"]
    for flag, want, origin in (([], {"enable_thinking": False}, "the recipe's data.regen.template_kwargs"),
                               (["--chat-template-kwargs", "{}"], {}, "--chat-template-kwargs")):
        out = tmp_path / f"eval{len(flag)}"
        with fake_server("vllm") as spec, fake_server("vllm", spec=False) as ar:
            code = main(["eval", *recipe, "--url", spec.url, "--ar-url", ar.url, "--sets", "gsm8k", "--limit", "1",
                         "--max-new-tokens", "8", "--out", str(out), "--no-progress", *flag])
        stdout = capsys.readouterr().out
        assert code == 0, stdout
        assert f"dflash eval: chat template variables {json.dumps(want)} ({origin})" in stdout
        assert json.loads((out / "results.json").read_text())["settings"]["chat_template_kwargs"] == want
        setups = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()
                  if json.loads(line)["kind"] == "setup"]
        assert [s["setup"].get("chat_template_kwargs", {}) for s in setups] == [want, want]
