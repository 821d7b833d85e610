"""Regeneration through an OpenAI-compatible server (data/endpoint.py): the protocol's pure parts, retries with
backoff, and a real `dflash serve` on the tiny recipe with the regenerating process killed (-9) mid-run: the rerun
resumes by item id, nothing lost, nothing duplicated, the same file as an uninterrupted run.

Equality with in-process regeneration (greedy and sampled) and the refusal of another model or tokenizer are
tested in tests/test_data_regenerate.py, over the tiny random target its other tests use."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash.data.config import EndpointConfig, RegenConfig
from dflash.data.endpoint import EndpointBackend, EndpointError, Transport, base_url, chat_body, parse_reply
from dflash.data.regenerate import ItemError, Reply

ROOT = Path(__file__).resolve().parents[1]


def _answer(text: str, tokens: int, reason: str = "stop", **message) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text, **message},
                         "finish_reason": reason}], "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}


def test_protocol_is_pure() -> None:
    assert base_url("http://h:8000") == base_url("http://h:8000/") == base_url("http://h:8000/v1/") == "http://h:8000/v1"
    cfg = RegenConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64,
                      template_kwargs={"enable_thinking": False})
    body = chat_body("m", [{"role": "user", "content": "hi"}], cfg, seed=5)
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                    "temperature": 0.7, "top_p": 0.9, "seed": 5, "stream": False, "top_k": 20,
                    "chat_template_kwargs": {"enable_thinking": False}}
    plain = chat_body("m", [], RegenConfig(), 0)
    assert plain["top_k"] == -1 and plain["temperature"] == 0.0 and "chat_template_kwargs" not in plain
    assert parse_reply(_answer("Hello.", 3)) == ("Hello.", 3, "stop", 9)
    with pytest.raises(EndpointError, match="reasoning_content .* start it without --reasoning-parser"):
        parse_reply(_answer("42", 3, reasoning_content="let me think"))
    with pytest.raises(EndpointError, match=r"must be a chat completion with choices\[0\].message"):
        parse_reply({"error": "nope"})
    with pytest.raises(EndpointError, match="must report usage.completion_tokens"):
        parse_reply({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}]})
    for fields, message in [({"url": "10.0.0.1:8000"}, "endpoint.url must be '' .* or an http"),
                            ({"concurrency": 0}, "endpoint.concurrency must be >= 1"),
                            ({"api_key_env": "sk-abc123"}, "api_key_env must be the name of an environment variable")]:
        with pytest.raises(ValueError, match=message):
            EndpointConfig(**fields)


class _Script(BaseHTTPRequestHandler):
    """Answers POSTs from `server.script` (status, body) in order, then the last one forever."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append(self.headers.get("Authorization"))
        status, body = self.server.script[min(len(self.server.seen), len(self.server.script)) - 1]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def scripted():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Script)
    httpd.seen, httpd.script = [], []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd
    httpd.shutdown()


class _Tok:
    """Characters as tokens: enough for the backend's re-tokenisation check."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text.replace("\ufffd", "")]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


def test_retries_with_backoff_then_the_item_or_the_run(scripted) -> None:
    url = f"http://127.0.0.1:{scripted.server_address[1]}"
    scripted.script = [(503, {"error": "loading"}), (429, {"error": "busy"}), (200, _answer("Hi!", 4))]
    transport = Transport(url, key="k", retries=2, backoff_s=0.01)
    assert transport.request("POST", "/chat/completions", {}) == (200, _answer("Hi!", 4))
    assert scripted.seen == ["Bearer k"] * 3
    scripted.seen.clear()
    with pytest.raises(EndpointError, match=r"answered 429: .*\(after 1 retries\); the run stops here: rerun it"):
        Transport(url, retries=1, backoff_s=0).request("POST", "/chat/completions", {})

    cfg = RegenConfig(max_new_tokens=8, max_len=64, endpoint=EndpointConfig(url=url, concurrency=2))
    backend = EndpointBackend(Transport(url, retries=0), "m", _Tok(), cfg)
    with pytest.raises(ItemError, match=r"the prompt \(60 tokens\) plus max_new_tokens \(8\) must fit"):
        backend.submit([], list(range(60)), 0, 0)
    script = [(200, _answer("Hi!", 4)), (200, _answer("Hi!", 9, "length")), (400, {"error": "bad"}),
              (200, _answer("x\ufffd", 2))]
    results = []
    for status_body in script:
        scripted.seen.clear()
        scripted.script = [status_body]
        handle = backend.submit([{"role": "user", "content": "q"}], [1, 2], 0, 1)
        results += [result for h, result in backend.poll() if h == handle]
    assert results[0] == Reply("Hi!", 4, "stop", retokenized_same=True)  # 3 characters and the stop token
    assert results[1] == Reply("Hi!", 9, "length", retokenized_same=False)  # counted, kept
    assert isinstance(results[2], ItemError) and results[2].kind == "server" and "answered 400" in str(results[2])
    assert isinstance(results[3], ItemError) and results[3].kind == "mismatch"
    scripted.script = [(401, {"error": "no key"})]
    backend.submit([], [1], 0, 0)
    with pytest.raises(EndpointError, match="answered 401"):
        backend.poll()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow  # ~60 s of subprocesses; test_data_writes' kill -9 test keeps the property without a server
@pytest.mark.e2e
@pytest.mark.heavy
def test_kill_9_mid_run_against_dflash_serve_loses_and_duplicates_nothing(tmp_path, monkeypatch, capsys) -> None:
    """`dflash data regenerate` through a real `dflash serve --ar` (subprocesses, the tiny recipe), killed with
    SIGKILL after its third conversation (DFLASH_FLUSH_SECONDS=0: each conversation its own chunk, so that a kill
    falls mid-run); the rerun ends with every item once, equal to an uninterrupted run."""
    from dflash.configs.recipe import load_recipe
    from dflash.data.regen_store import done_ids
    from dflash.data.sources import mix, mix_spec
    from dflash.data.stages import run_regenerate
    from dflash.eval.servers import serve_subprocess

    overrides = ["data.max_prompts=8", "data.regen.max_new_tokens=16", "data.regen.endpoint.concurrency=2",
                 "data.regen.endpoint.api_key_env=REGEN_KEY"]
    monkeypatch.setenv("REGEN_KEY", "k9")
    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL", "1")
    monkeypatch.setenv("DFLASH_FLUSH_SECONDS", "0")
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    with serve_subprocess(["--config", "tiny", "--ar", "--no-precompile", "--api-key", "k9"], tmp_path / "serve.log",
                          slots=2) as url:
        endpoint = [f"data.regen.endpoint.url={url}/v1", *overrides]
        killed = tmp_path / "killed"
        out = killed / "regenerated.jsonl"
        with open(tmp_path / "first.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "dflash.launch.cli", "data", "regenerate", "--config",
                                     "tiny", f"data.dir={killed}", *endpoint], stdout=log, stderr=subprocess.STDOUT)
            deadline = time.time() + 300
            while proc.poll() is None and len(done_ids(out)) < 3 and time.time() < deadline:
                time.sleep(0.02)
            assert proc.poll() is None, f"finished before it was killed: {(tmp_path / 'first.log').read_text()}"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        before = len(done_ids(out))
        assert 3 <= before < 8 and not out.exists()  # in chunks, not merged
        progress = r"regenerate: \d/8 conv \(\d+\.\d%\) \| [\d.]+ conv/s \| \d+ tokens/s \| elapsed \w+ \| ETA \w+"
        assert re.search(progress, (tmp_path / "first.log").read_text())  # progress lines in a log, no terminal

        capsys.readouterr()
        recipe = load_recipe("tiny", [f"data.dir={killed}", *endpoint])
        _, stats, _ = run_regenerate(recipe)  # the rerun resumes by item id
        assert (stats.skipped, stats.succeeded, stats.errors) == (before, 8 - before, 0)
        err = capsys.readouterr().err.splitlines()
        assert any(line.startswith("regenerate: 8/8 conv (100.0%) | ") for line in err), err
        whole = load_recipe("tiny", [f"data.dir={tmp_path / 'whole'}", *endpoint])
        run_regenerate(whole, progress=False)  # the same, uninterrupted
    records = [json.loads(line) for line in _lines(out)]
    ids = [r["id"] for r in records]
    items, _ = mix(mix_spec(recipe.data))
    assert sorted(ids) == sorted(i["id"] for i in items) and len(set(ids)) == 8  # nothing lost or duplicated
    assert _lines(killed / "regenerated.jsonl.errors.jsonl") == []
    uninterrupted = [json.loads(line) for line in _lines(tmp_path / "whole" / "regenerated.jsonl")]
    assert {r["id"]: r for r in records} == {r["id"]: r for r in uninterrupted}
