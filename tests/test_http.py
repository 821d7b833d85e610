"""The transport (serve/http.py) over a fake worker that keeps the worker contract (`submit` refuses
synchronously with a `RequestRejected`-like error, jobs publish `JobUpdate`s, then the `Completion`, `error`
and `status`): routes and methods, every error path answered (and the server serving the next request),
4xx before a stream's first byte, several prompts and n, streaming shapes, log-probabilities over HTTP, and
cancelling a request whose client left. No model and no compile: fast."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import queue
import select
import socket
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from test_openai_protocol import ByteTokenizer, Done, Update

from dflash.serve import http as transport
from dflash.serve.http import DFlashServer, HttpLimits

TOK = ByteTokenizer()
VOCAB = 257
MAX_LEN = 64
HTTP = httpx.Client(timeout=30)  # one client: a new one per call costs more than the calls


class Rejected(ValueError):
    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class FakeJob:
    prompt_ids: list[int]
    max_tokens: int | None
    seed: int
    logprobs: int | None
    prompt_logprobs: int | None
    ignore_eos: bool
    tokens: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    request: Done | None = None
    error: str | None = None
    status: int | None = None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass
class FakeEngine:
    sampling: None = None
    k: int = 1
    drafter_fingerprint: None = None
    max_len: int = MAX_LEN
    detokenize: object = None


class FakeWorker:
    """Replies `<seed>:` then the prompt's bytes over and over, one token per update (`delay` s apart for a
    prompt starting with "slow"); a prompt "fail" ends with an engine-wide failure (503), "alone" with a
    failure of its own (400). Log-probabilities: -0.1 * (position + 1) at each token, the token itself the
    likeliest alternative; the prompt's: None, then -1.0."""

    def __init__(self) -> None:
        self.engine, self.stop_ids, self.registry = FakeEngine(), (), CollectorRegistry()
        self.jobs: list[FakeJob] = []
        self.cancelled: list[FakeJob] = []
        self.refusals: list[int] = []  # statuses, as `requests_total{finish_reason="rejected"}` counts them

    def refused(self, status: int) -> None:
        self.refusals.append(status)

    def submit(self, prompt_ids, max_tokens, *, seed=0, sampling=None, stop_strings=(), logprobs=None,
               prompt_logprobs=None, ignore_eos=False) -> FakeJob:
        for i, t in enumerate(prompt_ids):
            if t >= VOCAB:
                self.refused(400)
                raise Rejected(f"prompt_ids[{i}] must be a token id in [0, {VOCAB}); received {t}", "prompt_ids")
        if max_tokens is not None and len(prompt_ids) + max_tokens > MAX_LEN:
            self.refused(400)
            raise Rejected(f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({max_tokens}) must fit the "
                           f"context (max_len {MAX_LEN})", "max_new_tokens")
        job = FakeJob(list(prompt_ids), max_tokens, seed, logprobs, prompt_logprobs, ignore_eos)
        self.jobs.append(job)
        threading.Thread(target=self._run, args=(job,), daemon=True).start()
        return job

    def cancel(self, job: FakeJob) -> None:
        self.cancelled.append(job)
        job.cancelled.set()

    def shutdown(self) -> None:
        pass

    def _run(self, job: FakeJob) -> None:
        prompt = TOK.decode(job.prompt_ids)
        slow = prompt.startswith("slow")
        budget = job.max_tokens or (10_000 if slow else MAX_LEN - len(job.prompt_ids))
        reply = (TOK.encode(f"{job.seed}:") + job.prompt_ids * budget)[:budget]
        n = job.logprobs
        done = Done([], "", "length")
        if job.prompt_logprobs is not None:
            done.prompt_logprobs = [None] + [-1.0] * (len(job.prompt_ids) - 1)
            done.prompt_top_logprobs = [[]] + [[(t, -1.0)][:job.prompt_logprobs] for t in job.prompt_ids[1:]]
        job.request = done
        for pos, token in enumerate(reply):
            if job.cancelled.is_set():
                done.finish_reason = "cancelled"
                break
            if prompt in ("fail", "alone") and pos == 1:
                job.error, job.status = ("the engine failed (RuntimeError: boom)", 503) if prompt == "fail" else (
                    "this request failed alone", 400)
                break
            lp, top = ([-0.1 * (pos + 1)], [[(token, -0.1 * (pos + 1))][:n]]) if n is not None else ([], [])
            done.token_ids.append(token)
            done.text += TOK.decode([token])
            done.token_logprobs += lp
            done.top_logprobs += top
            job.tokens.put(Update([token], TOK.decode([token]), lp, top))
            if slow:
                time.sleep(0.02)
        job.tokens.put(None)


DRAW_SEED = transport.openai.draw_seed  # the real one: the fixture draws 0 so that the fake's replies are short


@pytest.fixture(scope="module")
def served():
    worker = FakeWorker()
    srv = DFlashServer(("127.0.0.1", 0), worker, TOK, "m", MAX_LEN, limits=HttpLimits(read_timeout=5.0))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport.openai, "draw_seed", lambda n=1: 0)
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}", worker
    srv.close()
    thread.join(10)


def post(url: str, path: str, body: dict | bytes, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HTTP.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30,
                      **kwargs)


def still_serves(url: str) -> None:
    ok = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "0:h"


def events(url: str, path: str, body: dict) -> tuple[int, list]:
    """(status, the stream's JSON payloads then "[DONE]")."""
    out = []
    with HTTP.stream("POST", f"{url}{path}", json=body, timeout=30) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return 200, out


def raw(url: str, data: bytes) -> bytes:
    """Send raw bytes, half-close, read the whole answer."""
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while part := sock.recv(65536):
            answer += part
    return answer


# ------------------------------------------------------------------------------------------- the door


@pytest.mark.parametrize(("body", "param", "needle"), [
    (b'{"prompt": "hi", "stop": 5}', "stop", "stop must be a string or a list of non-empty strings; received 5"),
    (b'{"prompt": "hi\\ud800"}', "prompt", "prompt must be text that encodes as UTF-8"),
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None, "nested at most 64 deep"),
    (b'{"prompt": "caf\xe9"}', None, "must be UTF-8 JSON; byte 0xe9"),
    (b'{"prompt": [1, 2147483648]}', "prompt", "prompt[1] must be a token id, an integer in [0, 2**31)"),
    (b'{"prompt": "hi", "top_k": 2147483648}', "top_k", "top_k must be an integer in [-1, 2**31)"),
    (b'{"prompt": [1, 300]}', "prompt", "prompt[1] must be a token id in [0, 257); received 300"),
    (b'{"prompt": "hi", "max_tokens": 100}', "max_tokens", "plus max_tokens (100) must fit the context (max_len 64)"),
    (b'{"prompt": [[1], [2, 999]]}', "prompt", "prompt[1]: prompt_ids"[:10]),
])
def test_every_field_is_checked_at_the_door(served, body, param, needle):
    _, url, _ = served
    for stream in (False, True):  # a bad stream is a 4xx too: nothing is sent before the checks pass
        sent = body if not stream else body[:-1] + b', "stream": true}'
        resp = post(url, "/v1/completions", sent)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert needle in error["message"] and error["param"] == param
        assert "max_new_tokens" not in error["message"]  # the engine's words are the request's
        still_serves(url)


def test_a_refused_choice_cancels_the_choices_already_taken(served):
    _, url, worker = served
    before = len(worker.jobs)
    resp = post(url, "/v1/completions", {"prompt": [[1, 2], [3, 999]], "n": 2})
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("prompt[1]: ")
    taken = worker.jobs[before:]
    assert len(taken) == 2 and all(job in worker.cancelled for job in taken)
    still_serves(url)


def test_a_failed_request_fails_alone_and_an_engine_failure_is_a_503(served):
    _, url, _ = served
    alone = post(url, "/v1/completions", {"prompt": "alone"})
    assert alone.status_code == 400 and alone.json()["error"]["message"] == "this request failed alone"
    failed = post(url, "/v1/completions", {"prompt": "fail"})
    assert failed.status_code == 503 and failed.json()["error"]["type"] == "server_error"
    still_serves(url)
    status, chunks = events(url, "/v1/completions", {"prompt": "fail", "stream": True})
    assert status == 200 and chunks[-2]["error"]["message"] == "the engine failed (RuntimeError: boom)"
    assert chunks[-1] == "[DONE]"
    still_serves(url)


def test_an_unexpected_error_is_a_500_json_and_an_error_log_line(served, monkeypatch, caplog):
    _, url, _ = served

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(transport.openai, "response_body", broken)
    with caplog.at_level(logging.ERROR, logger="dflash.serve.http"):
        resp = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "a bug" in caplog.text
    monkeypatch.undo()
    still_serves(url)


def test_broken_http_is_answered(served):
    _, url, _ = served
    for data in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\xff\xfe\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{\"a\":"):
        answer = raw(url, data)
        assert answer.startswith(b"HTTP/1.") and int(answer.split(b" ", 2)[1]) >= 400, (data, answer[:80])
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        still_serves(url)


# ------------------------------------------------------------------------------------------- routes


def test_routes_methods_head_options_and_query_strings(served):
    _, url, _ = served
    for method, path, allow in [("GET", "/v1/completions", "POST, OPTIONS"), ("PUT", "/v1/chat/completions",
                                                                               "POST, OPTIONS"),
                                ("POST", "/v1/models", "GET, HEAD, OPTIONS"), ("DELETE", "/health",
                                                                               "GET, HEAD, OPTIONS")]:
        resp = HTTP.request(method, f"{url}{path}", timeout=30)
        assert resp.status_code == 405 and resp.headers["allow"] == allow
        assert resp.json()["error"]["message"] == f"method {method} is not allowed on {path}; allowed: {allow}"
    head = HTTP.head(f"{url}/health", timeout=30)
    get = HTTP.get(f"{url}/health", timeout=30)
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(get.content))
    options = HTTP.options(f"{url}/v1/chat/completions", timeout=30)
    assert options.status_code == 204 and options.headers["allow"] == "POST, OPTIONS"
    assert HTTP.get(f"{url}/nothing", timeout=30).status_code == 404
    assert HTTP.options(f"{url}/nothing", timeout=30).status_code == 404
    models = HTTP.get(f"{url}/v1/models?limit=5", timeout=30).json()
    assert models["data"][0]["id"] == "m" and models["data"][0]["max_model_len"] == MAX_LEN
    assert HTTP.get(f"{url}/v1/models/m", timeout=30).json() == models["data"][0]
    missing = HTTP.get(f"{url}/v1/models/gpt-4", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    ok = post(url, "/v1/completions?api-version=1", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "0:"


# ------------------------------------------------------------------------------------------- shapes


def test_several_prompts_and_n_in_one_request(served):
    _, url, _ = served
    body = {"prompt": ["ab", [120, 121]], "n": 2, "seed": 3, "max_tokens": 4}
    resp = post(url, "/v1/completions", body).json()
    assert [(c["index"], c["text"]) for c in resp["choices"]] == [(0, "3:ab"), (1, "4:ab"), (2, "3:wx"), (3, "4:wx")]
    assert resp["usage"] == {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20}
    status, chunks = events(url, "/v1/completions", {**body, "stream": True})
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert status == 200 and texts == {0: "3:ab", 1: "4:ab", 2: "3:wx", 3: "4:wx"}
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1, 2, 3]
    assert chunks[-2]["usage"] == resp["usage"] and chunks[-1] == "[DONE]"
    ids = {post(url, "/v1/completions", {"prompt": "a", "max_tokens": 1}).json()["id"] for _ in range(5)}
    assert len(ids) == 5


def test_the_seed_used_is_reported_and_an_unseeded_request_draws_one(served, monkeypatch):
    """The body's `dflash.seed` and the `X-DFlash-Seed` header name the seed the worker got: the client's, or
    fresh entropy when it sent none (or null); sending it back reproduces the reply."""
    _, url, worker = served
    seeded = post(url, "/v1/completions", {"prompt": "a", "max_tokens": 3, "seed": 42})
    assert seeded.headers[transport.SEED_HEADER] == "42" and seeded.json()["dflash"]["seed"] == 42
    assert worker.jobs[-1].seed == 42 and seeded.json()["choices"][0]["text"] == "42:"
    monkeypatch.setattr(transport.openai, "draw_seed", DRAW_SEED)
    drawn = []
    for body in ({"prompt": "a", "max_tokens": 2}, {"prompt": "a", "max_tokens": 2, "seed": None}):
        for _ in range(2):
            resp = post(url, "/v1/completions", body)
            seed = resp.json()["dflash"]["seed"]
            assert resp.headers[transport.SEED_HEADER] == str(seed) and worker.jobs[-1].seed == seed
            drawn.append(seed)
    assert len(set(drawn)) == 4
    status, chunks = events(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 2, "stream": True})
    assert status == 200 and chunks[-2]["dflash"]["seed"] == worker.jobs[-1].seed not in drawn
    with HTTP.stream("POST", f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}) as resp:
        resp.read()
        assert int(resp.headers[transport.SEED_HEADER]) == worker.jobs[-1].seed


def test_chat_streams_start_with_the_role_and_continuous_usage_counts_up(served):
    _, url, _ = served
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    status, chunks = events(url, "/v1/chat/completions", body)
    assert status == 200 and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    prompt = len(TOK.encode_chat([{"role": "user", "content": "hi"}]))
    assert [c["usage"]["completion_tokens"] for c in chunks[:-2]] == [0, 1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks[:-1])
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 3
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2]) == "0:u"
    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    bad = post(url, "/v1/chat/completions", {**body, "messages": image})
    assert bad.status_code == 400 and "only text is supported" in bad.json()["error"]["message"]
    still_serves(url)


def test_logprobs_and_echo_over_http(served):
    _, url, worker = served
    resp = post(url, "/v1/completions", {"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    [choice] = resp["choices"]
    assert choice["text"] == "ab" and choice["logprobs"]["token_logprobs"] == [None, -1.0]
    assert choice["logprobs"]["top_logprobs"] == [None, {"b": -1.0}]
    assert worker.jobs[-1].max_tokens == 1 and worker.jobs[-1].prompt_logprobs == 1
    assert resp["usage"]["completion_tokens"] == 0
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                              "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [("0", -0.1), (":", -0.2)]
    status, chunks = events(url, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 1, "echo": True,
                                                     "stream": True})
    assert chunks[0]["choices"][0]["text"] == "ab" and chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [
        None, -1.0]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[1:3]] == [[2], [3]]


# ------------------------------------------------------------------------------------------- disconnects


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_has_its_request_cancelled_in_one_info_line(served, caplog, stream):
    _, url, worker = served
    body = json.dumps({"prompt": "slow", "stream": stream}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    before = len(worker.jobs)
    with caplog.at_level(logging.INFO, logger="dflash.serve.http"):
        sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=20)
        sock.sendall(head + body)
        while len(worker.jobs) == before:
            time.sleep(0.01)
        job = worker.jobs[before]
        sock.close()
        assert job.cancelled.wait(20)  # long before its 10,000 tokens
        while not any("disconnected" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
    assert len(job.request.token_ids) < 10_000
    assert [r.levelname for r in caplog.records if "disconnected" in r.getMessage()] == ["INFO"]
    assert not any(r.exc_info for r in caplog.records)
    still_serves(url)


def test_a_half_closed_connection_still_gets_its_answer(served):
    """A client that shuts its sending side after the request (as raw-socket tools do): a stream runs to its end
    (a stream's client is gone only when a write fails); a non-streamed request counts as abandoned (as in
    uvicorn) and is cancelled, but what it made is still sent."""
    _, url, worker = served
    body = json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}).encode()
    answer = raw(url, f"POST /v1/completions HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    head, _, stream = answer.partition(b"\r\n\r\n")
    chunks = [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]
    assert head.startswith(b"HTTP/1.1 200") and stream.rstrip().endswith(b"data: [DONE]")
    assert "".join(c["choices"][0]["text"] for c in chunks) == "0:hih"
    body = json.dumps({"prompt": "slow"}).encode()
    answer = raw(url, f"POST /v1/completions HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    head, _, whole = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(whole)["choices"][0]["finish_reason"] == "cancelled"
    assert worker.jobs[-1] in worker.cancelled
    still_serves(url)


# ------------------------------------------------------------------------------------------- the stock-client round


def test_every_refusal_of_a_generation_request_is_counted_once(served):
    """A malformed body, an unknown model, a bad field, a worker's refusal, an oversized body and a bad
    `ignore_eos` each count one refusal with their status (the worker's own refusal once, by the worker); other
    routes' and methods' errors, answered requests and a request that failed in the engine (the worker counts how
    it ended) count none."""
    srv, url, worker = served
    before = len(worker.refusals)
    assert post(url, "/v1/completions", b"{not json").status_code == 400
    assert post(url, "/v1/completions", {"prompt": "hi", "model": "gpt-9"}).status_code == 404
    assert post(url, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    assert post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}).status_code == 400
    assert post(url, "/v1/completions", {"prompt": [1, 300]}).status_code == 400  # refused by the worker
    assert post(url, "/v1/completions", {"prompt": "hi", "ignore_eos": 1}).status_code == 400
    big = post(url, "/v1/completions", b"x" * (srv.max_body_bytes + 1))
    assert big.status_code == 413
    assert HTTP.get(f"{url}/v1/models/gpt-9", timeout=30).status_code == 404
    assert HTTP.get(f"{url}/v1/completions", timeout=30).status_code == 405
    assert post(url, "/v1/nothing", {}).status_code == 404
    assert post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert post(url, "/v1/completions", {"prompt": "alone"}).status_code == 400  # failed in the engine: its count
    assert worker.refusals[before:] == [400, 404, 400, 400, 400, 400, 413]


def test_ignore_eos_reaches_the_worker(served):
    _, url, worker = served
    for body, want in [({"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, True),
                       ({"prompt": "hi", "max_tokens": 2}, False),
                       ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "ignore_eos": True}, True)]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert post(url, path, body).status_code == 200 and worker.jobs[-1].ignore_eos is want


@pytest.fixture()
def strict():
    """A server whose request heads must arrive within 1 s (each read may wait 5 s)."""
    worker = FakeWorker()
    srv = DFlashServer(("127.0.0.1", 0), worker, TOK, "m", MAX_LEN,
                      limits=HttpLimits(read_timeout=5.0, header_timeout=1.0))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield int(srv.server_address[1])
    srv.close()
    thread.join(10)


def _trickle(port: int, parts: list[bytes], gap: float) -> tuple[bytes, float]:
    """Send `parts` `gap` seconds apart (stopping when the server closes), then read the answer: (answer, seconds
    from the first byte to the end of the answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        start = time.monotonic()
        try:
            for part in parts:
                sock.sendall(part)
                if select.select([sock], [], [], gap)[0]:
                    break  # the server answered (or closed)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer, time.monotonic() - start


def test_a_request_head_that_trickles_past_the_deadline_is_cut(strict):
    """Headers a line per 0.4 s (each read well within the 5 s read timeout) are answered 408 about 1 s after the
    request's first byte, as is a request line sent a few bytes at a time; a prompt head with a slow body, and a
    connection idle longer than the deadline before its request, are served."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Type: application/json\r\n",
            b"Connection: close\r\n", b"X-Two: 2\r\n", b"X-Three: 3\r\n", b"X-Four: 4\r\n",
            f"Content-Length: {len(body)}\r\n\r\n".encode(), body]
    answer, took = _trickle(strict, head, 0.4)
    assert answer.startswith(b"HTTP/1.") and b" 408 " in answer.split(b"\r\n", 1)[0], answer[:80]
    assert b"must arrive within 1.0 s" in answer and took < 2.6, took
    line = [b"POST /v1/comp", b"letions HT", b"TP/1.1\r\n", b"Host: x\r\n", b"\r\n"]
    answer, took = _trickle(strict, line, 0.4)
    assert b" 408 " in answer.split(b"\r\n", 1)[0] and took < 2.6, (answer[:80], took)
    slow_body = [b"".join(head[:-1]), body[:5], body[5:]]
    answer, _ = _trickle(strict, slow_body, 1.2)  # the body's reads wait the read timeout each
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
    answer, _ = _trickle(strict, [b"", b"".join(head)], 1.2)  # idle first: the deadline starts at the first byte
    assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
