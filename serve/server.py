"""`dflash serve`: an OpenAI-compatible HTTP server (the stdlib's) over the continuous-batching engine.

    server = make_server(engine, tokenizer, "smollm2", port=8000)
    server.serve_forever()          # from another thread: server.close() finishes the requests in flight

HTTP handler threads validate requests and hand them to the one engine thread (`EngineWorker`); routes,
request fields and errors: `_Handler`. Design: docs/decisions.md D14.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from models.tokenizer import ChatTokenizer
from serve.engine import Completion, Engine
from serve.sampling import GREEDY, SamplingConfig

log = logging.getLogger(__name__)

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "stop", "seed", "n",
                     "user"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stream",
               "stop", "seed", "n", "user"}


class RequestError(ValueError):
    """A client error: HTTP status, message, and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    stop_strings: tuple[str, ...]
    sampling: SamplingConfig = GREEDY
    request: Completion | None = None
    tokens: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # lists of new ids, then None
    error: str | None = None
    status: int = 400  # of `error`: 400 for a request the engine refused, 500 for an engine failure


class EngineWorker:
    """Runs the engine on its own thread; `submit` is safe to call from any thread.

    The engine thread admits submitted requests between steps and, after every step, publishes each
    request's new tokens on its job's queue (then None when it finished), and updates the Prometheus
    metrics served at /metrics.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop_ids: tuple[int, ...] = ()  # the tokenizer's, set by the server
        self.inbox: queue.Queue[_Job] = queue.Queue()
        self.jobs: dict[int, _Job] = {}
        self.sent: dict[int, int] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        registry = CollectorRegistry()
        self.registry = registry
        self.m_tokens = Counter("dflash_generated_tokens", "Generated tokens", registry=registry)
        self.m_requests = Counter("dflash_requests", "Finished requests", ["finish_reason"], registry=registry)
        self.m_queue = Gauge("dflash_queue_depth", "Requests waiting for a slot", registry=registry)
        self.m_running = Gauge("dflash_running_requests", "Requests decoding", registry=registry)
        self.m_tau = Histogram("dflash_tau", "Tokens per verify step per request (acceptance length)",
                               buckets=[1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64], registry=registry)
        self.m_accept = Gauge("dflash_accept_rate", "Share of steps whose draft at this position was accepted",
                              ["position"], registry=registry)
        self.m_tps = Gauge("dflash_tokens_per_second", "Generated tokens per second (last 10 s)", registry=registry)
        self._accept_counts = np.zeros(max(engine.k - 1, 1))
        self._accept_steps = 0
        self._recent: list[tuple[float, int]] = []

    def start(self) -> EngineWorker:
        self.thread.start()
        return self

    def submit(self, job: _Job) -> _Job:
        if self.stopping.is_set():
            raise RequestError("the server is shutting down", status=503)
        self.inbox.put(job)
        return job

    def _loop(self) -> None:
        while True:
            try:
                job = self.inbox.get(timeout=0.01 if self.engine.busy else 0.2)
            except queue.Empty:
                job = None
            while job is not None:
                try:
                    rid = self.engine.submit(job.prompt_ids, job.max_tokens, self.stop_ids, seed=job.seed,
                                             sampling=job.sampling, stop_strings=job.stop_strings)
                    self.jobs[rid], self.sent[rid] = job, 0
                except ValueError as err:
                    job.error = str(err)
                    job.tokens.put(None)
                try:
                    job = self.inbox.get_nowait()
                except queue.Empty:
                    job = None
            if self.engine.busy:
                try:
                    self.engine.step()
                except Exception as err:  # noqa: BLE001 - any engine failure must end the waiting requests
                    log.exception("engine step failed; failing the requests in flight and resetting the engine")
                    self._fail_all(f"the engine failed ({type(err).__name__}: {err}); the request was dropped")
                    continue
                self._publish()
            elif self.stopping.is_set() and self.inbox.empty():
                return

    def _publish(self) -> None:
        live = {r.request_id: r for r in self.engine.running.values()}
        finished = [rid for rid in list(self.jobs) if rid in self.engine.done]
        for rid, request in list(live.items()) + [(rid, self.engine.done[rid]) for rid in finished]:
            job = self.jobs[rid]
            job.request = request
            new = request.token_ids[self.sent[rid]:]
            if new:
                self.sent[rid] += len(new)
                job.tokens.put(list(new))
                self.m_tokens.inc(len(new))
                self._recent.append((time.monotonic(), len(new)))
        for rid in finished:
            job, request = self.jobs.pop(rid), self.engine.done.pop(rid)
            del self.sent[rid]
            self.m_requests.labels(request.finish_reason).inc()
            if request.accepted:
                self.m_tau.observe(request.tau)
                acc = np.asarray(request.accepted)
                self._accept_counts += np.array([np.sum(acc > i) for i in range(len(self._accept_counts))])
                self._accept_steps += len(acc)
                for i, c in enumerate(self._accept_counts):
                    self.m_accept.labels(str(i + 1)).set(c / self._accept_steps)
            job.tokens.put(None)
        now = time.monotonic()
        self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        self.m_tps.set(sum(n for _, n in self._recent) / 10.0)
        self.m_queue.set(len(self.engine.queue))
        self.m_running.set(len(self.engine.running))

    def _fail_all(self, message: str) -> None:
        """End every request in flight with a server error (HTTP 500) and give the engine a fresh state."""
        for job in self.jobs.values():
            job.error, job.status = message, 500
            job.tokens.put(None)
        self.jobs.clear()
        self.sent.clear()
        self.engine.reset()

    def shutdown(self, timeout: float = 60.0) -> None:
        self.stopping.set()
        self.thread.join(timeout)


class DFlashServer(ThreadingHTTPServer):
    # Handler threads are joined on close (idle keep-alive connections are shut first): a daemon thread
    # left blocked on a socket at interpreter exit can abort the process.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 256  # the listen backlog (the stdlib's 5 resets bursts of concurrent clients)

    def __init__(self, address: tuple[str, int], worker: EngineWorker, tokenizer: ChatTokenizer, model_name: str,
                 max_len: int, default_max_tokens: int = 128):
        self._connections: set[Any] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, _Handler)
        self.worker, self.tokenizer, self.model_name = worker, tokenizer, model_name
        self.max_len, self.default_max_tokens = max_len, default_max_tokens
        self.sampling = worker.engine.sampling or GREEDY  # the default of requests that don't say
        worker.stop_ids = tuple(tokenizer.stop_token_ids)
        worker.engine.detokenize = tokenizer.decode
        self.created = int(time.time())

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def close(self) -> None:
        """Stop accepting connections, finish the requests in flight, stop the engine thread, then close
        idle keep-alive connections and join their handler threads."""
        self.shutdown()
        self.worker.shutdown()
        with self._conn_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RD)  # wakes a handler waiting for the next request on this connection
            except OSError:
                pass
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (a thread each, from `ThreadingHTTPServer`).

    Routes: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as server-sent
    events), GET /v1/models, GET /health, GET /metrics (Prometheus text). Responses carry `usage` plus a
    `dflash` object with the request's acceptance statistics (τ, steps, accepted per step). A bad request
    gets a 4xx JSON error (`{"error": {"message", "type", "param", "code"}}`) and the server keeps serving;
    an engine failure ends the requests in flight with a 500. Sampling fields: `_sampling`; `stop`,
    `max_tokens`, `seed`: `_options`.
    """

    server: DFlashServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    # ------------------------------------------------------------------ plumbing

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: RequestError) -> None:
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        self._send_json(err.status, {"error": {"message": str(err), "type": kind, "param": err.param,
                                               "code": None}})

    def _body(self, allowed: set[str]) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as err:
            raise RequestError(f"the request body must be JSON; {err}") from err
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(f"unknown field(s) {unknown}; this endpoint takes {sorted(allowed)}", unknown[0])
        model = body.get("model", self.server.model_name)
        if model != self.server.model_name:
            raise RequestError(f"model {model!r} does not exist; this server serves {self.server.model_name!r}",
                               "model", status=404)
        return body

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                              "created": self.server.created, "owned_by": "dflash"}]})
        elif self.path == "/metrics":
            data = generate_latest(self.server.worker.registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._error(RequestError(f"no route GET {self.path}", status=404))

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        try:
            if self.path == "/v1/completions":
                body = self._body(COMPLETION_FIELDS)
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    ids = self.server.tokenizer.encode(prompt)
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                    ids = list(prompt)
                else:
                    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt")
                self._complete(body, ids, chat=False)
            elif self.path == "/v1/chat/completions":
                body = self._body(CHAT_FIELDS)
                messages = body.get("messages")
                if not (isinstance(messages, list) and messages and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
                    raise RequestError("messages must be a non-empty list of {role, content} strings", "messages")
                ids = self.server.tokenizer.encode_chat(messages, add_generation_prompt=True)
                self._complete(body, ids, chat=True)
            else:
                raise RequestError(f"no route POST {self.path}", status=404)
        except RequestError as err:
            self._error(err)

    # ------------------------------------------------------------------ completion

    def _sampling(self, body: dict[str, Any]) -> SamplingConfig:
        """The request's rule: its temperature / top_p / top_k, the server's default (the recipe's
        `sampling:`) for the ones it leaves out. temperature 0 = greedy; top_k is an extension, as in vLLM
        (0 or -1 = off). Rules are per request inside one engine step (`serve.sampling.SamplingRows`), so
        a greedy and a sampled request share a batch without affecting each other."""
        default = self.server.sampling

        def number(name: str, value: Any, ok: bool, expected: str) -> None:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not ok):
                raise RequestError(f"{name} must {expected}; received {value!r}", name)

        temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
        number("temperature", temperature, isinstance(temperature, int | float) and 0 <= temperature <= 100,
               "be a number in [0, 100] (0 = greedy)")
        number("top_p", top_p, isinstance(top_p, int | float) and 0 < top_p <= 1, "be a number in (0, 1]")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1 = off); received {top_k!r}", "top_k")
        return SamplingConfig(temperature=default.temperature if temperature is None else float(temperature),
                              top_p=default.top_p if top_p is None else float(top_p),
                              top_k=default.top_k if top_k is None else max(top_k, 0))

    def _options(self, body: dict[str, Any]) -> tuple[int, int, tuple[str, ...], bool]:
        """(max_tokens, seed, stop strings, stream). `seed` defaults to 0; `stop` strings go to the engine,
        which ends the request (freeing its slot) at the token that completes one; the text is cut before
        the stop string."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", self.server.default_max_tokens))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer; received {max_tokens!r}", "max_tokens")
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1", "n")
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a string or a list of non-empty strings", "stop")
        seed = body.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise RequestError(f"seed must be a non-negative integer; received {seed!r}", "seed")
        return max_tokens, seed, stop, bool(body.get("stream", False))

    def _complete(self, body: dict[str, Any], ids: list[int], chat: bool) -> None:
        max_tokens, seed, stop, stream = self._options(body)
        job = self.server.worker.submit(_Job(ids, max_tokens, seed, stop, self._sampling(body)))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{id(job):x}"
        if stream:
            self._stream(job, rid, chat)
            return
        generated: list[int] = []
        while (chunk := job.tokens.get()) is not None:
            generated += chunk
        if job.error:
            raise RequestError(job.error, "messages" if chat else "prompt", status=job.status)
        text, reason = self._text(generated, stop, job.request)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._send_json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                              "created": int(time.time()), "model": self.server.model_name, "choices": [choice],
                              "usage": self._usage(ids, generated), "dflash": self._stats(job.request)})

    def _text(self, generated: list[int], stop: tuple[str, ...], request: Completion | None) -> tuple[str, str]:
        tok = self.server.tokenizer
        text = tok.decode([t for t in generated if t not in tok.stop_token_ids])
        cuts = [text.index(s) for s in stop if s in text]
        if cuts:
            return text[: min(cuts)], "stop"
        return text, (request.finish_reason if request and request.finish_reason else "length")

    @staticmethod
    def _usage(ids: list[int], generated: list[int]) -> dict[str, int]:
        return {"prompt_tokens": len(ids), "completion_tokens": len(generated),
                "total_tokens": len(ids) + len(generated)}

    @staticmethod
    def _stats(request: Completion | None) -> dict[str, Any]:
        if request is None or not request.accepted:
            return {"tau": None, "steps": 0}
        return {"tau": request.tau, "steps": len(request.accepted), "accepted_per_step": request.accepted}

    def _stream(self, job: _Job, rid: str, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        kind = "chat.completion.chunk" if chat else "text_completion"
        tok, stop = self.server.tokenizer, job.stop_strings
        generated: list[int] = []
        printed, reason = "", None

        def event(delta: str, finish: str | None, extra: dict[str, Any] | None = None) -> None:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": delta} if delta or finish is None else {}
            else:
                choice["text"] = delta
            payload = {"id": rid, "object": kind, "created": int(time.time()), "model": self.server.model_name,
                       "choices": [choice], **(extra or {})}
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        if chat:
            event("", None)
        while (chunk := job.tokens.get()) is not None:
            if reason is not None:
                continue  # a stop string ended the text; drain the rest
            generated += chunk
            text = tok.decode([t for t in generated if t not in tok.stop_token_ids])
            cuts = [text.index(s) for s in stop if s in text]
            if cuts:
                text, reason = text[: min(cuts)], "stop"
            elif text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 character: wait for the rest
            if len(text) > len(printed):
                event(text[len(printed):], None)
                printed = text
        if job.error:
            self.wfile.write(f"data: {json.dumps({'error': {'message': job.error}})}\n\n".encode())
        else:
            reason = reason or (job.request.finish_reason if job.request else "length")
            event("", reason, {"usage": self._usage(job.prompt_ids, generated), "dflash": self._stats(job.request)})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def make_server(engine: Engine, tokenizer: ChatTokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                default_max_tokens: int = 128) -> DFlashServer:
    """A started engine thread and a bound (not yet serving) HTTP server; call `serve_forever()`."""
    worker = EngineWorker(engine).start()
    return DFlashServer((host, port), worker, tokenizer, model_name, engine.max_len, default_max_tokens)


__all__ = ["DFlashServer", "EngineWorker", "RequestError", "make_server"]
