"""`dflash serve`: an OpenAI-compatible HTTP server (the stdlib's) over the continuous-batching engine.

    server = make_server(engine, tokenizer, "smollm2", port=8000)
    server.serve_forever()          # from another thread: server.close() finishes the requests in flight

HTTP handler threads validate requests and hand them to the one engine thread (`EngineWorker`); routes,
request fields and errors: `_Handler`; the OpenAI fields without a feature behind them: `_check_openai_fields`.
Design: docs/decisions.md D14.
"""

from __future__ import annotations

import dataclasses
import hmac
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

from dflash.models.tokenizer import ChatTokenizer
from dflash.serve.engine import Completion, Engine
from dflash.serve.sampling import GREEDY, SamplingConfig

log = logging.getLogger(__name__)

COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "stop", "seed", "n",
                     "user"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stream",
               "stop", "seed", "n", "user", "chat_template_kwargs"}


def _is_zero(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v == 0)


def _is_empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


def _is_text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


def _is_stream_options(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and set(v) <= {"include_usage", "include_obfuscation"}
                         and all(isinstance(x, bool) for x in v.values()))


# Documented OpenAI fields with no feature behind them here: (accepts the value, what is supported). A
# neutral value (the API's default) is accepted and ignored; any other value is a 400 naming the field. None
# as the test: any value is accepted and ignored (bookkeeping and hints that do not change the output).
_NEUTRAL: dict[str, tuple[Any, str] | None] = {
    "frequency_penalty": (_is_zero, "must be 0 (penalties are not supported)"),
    "presence_penalty": (_is_zero, "must be 0 (penalties are not supported)"),
    "logit_bias": (_is_empty, "must be empty (logit_bias is not supported)"),
    "logprobs": (lambda v: v is None or v is False or _is_zero(v), "must be false, 0 or null (logprobs are not "
                                                                   "supported)"),
    "top_logprobs": (_is_zero, "must be 0 or null (logprobs are not supported)"),
    "echo": (lambda v: v is None or v is False, "must be false (echo is not supported)"),
    "best_of": (lambda v: v is None or (v == 1 and not isinstance(v, bool)), "must be 1 (one sample per request)"),
    "suffix": (_is_empty, "must be empty or null (insertion is not supported)"),
    "stream_options": (_is_stream_options, "must be null or {\"include_usage\": bool}"),
    "response_format": (_is_text_format, 'must be {"type": "text"} (structured output is not supported)'),
    "tools": (_is_empty, "must be empty (tool calling is not supported)"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), 'must be "none" or "auto" (tool calling is not '
                                                           'supported)'),
    "functions": (_is_empty, "must be empty (function calling is not supported)"),
    "function_call": (lambda v: v in (None, "none", "auto"), 'must be "none" or "auto" (function calling is not '
                                                             'supported)'),
    "modalities": (lambda v: v is None or v == ["text"], 'must be ["text"] (text output only)'),
    "audio": (lambda v: v is None, "must be null (audio output is not supported)"),
    "web_search_options": (lambda v: v is None, "must be null (web search is not supported)"),
    "parallel_tool_calls": None, "service_tier": None, "service_level": None, "store": None, "metadata": None,
    "prediction": None, "reasoning_effort": None, "verbosity": None, "safety_identifier": None,
    "prompt_cache_key": None, "prompt_cache_retention": None, "prompt_cache_options": None, "moderation": None,
}
_COMPLETION_OPENAI = {"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "echo", "best_of", "suffix",
                      "stream_options"}
_CHAT_OPENAI = set(_NEUTRAL) - {"echo", "best_of", "suffix"}


def _check_openai_fields(body: dict[str, Any], fields: set[str]) -> None:
    """Accept the neutral values of the documented OpenAI fields this server has no feature for; refuse
    the others with a 400 naming the field."""
    for name in sorted(fields & set(body)):
        rule = _NEUTRAL[name]
        if rule is not None and not rule[0](body[name]):
            raise RequestError(f"{name} {rule[1]}; received {body[name]!r}", name)


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
    cancelled: bool = False  # the client went away: the engine thread ends the request and frees its slot


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

    def cancel(self, job: _Job) -> None:
        """End `job` (its client disconnected): the engine thread frees its slot and pages before its next step."""
        job.cancelled = True

    def _cancel_gone(self) -> None:
        cancelled = [rid for rid, job in list(self.jobs.items()) if job.cancelled and self.engine.cancel(rid)]
        if cancelled:
            log.info("cancelled request(s) %s: their clients disconnected", cancelled)
            self._publish()  # hands them back (and forgets them) even when no step follows

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
            self._cancel_gone()
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
                 max_len: int, default_max_tokens: int = 128, *, max_body_bytes: int = 4 << 20,
                 read_timeout: float | None = 30.0, api_key: str | None = None, unknown_fields: str = "reject"):
        if unknown_fields not in ("reject", "ignore"):
            raise ValueError(f"unknown_fields must be 'reject' or 'ignore'; received {unknown_fields!r}")
        self._connections: set[Any] = set()
        self._conn_lock = threading.Lock()
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
        self.api_key, self.unknown_fields = api_key or None, unknown_fields
        self._warned_fields: set[str] = set()
        super().__init__(address, _Handler)
        self.worker, self.tokenizer, self.model_name = worker, tokenizer, model_name
        self.max_len, self.default_max_tokens = max_len, default_max_tokens
        self.sampling = worker.engine.sampling or GREEDY  # the default of requests that don't say
        worker.stop_ids = tuple(tokenizer.stop_token_ids)
        worker.engine.detokenize = tokenizer.decode
        self.created = int(time.time())

    def warn_unknown(self, names: list[str]) -> None:
        """Log one warning per unknown field name over the server's life (as vLLM does)."""
        with self._conn_lock:
            new = [n for n in names if n not in self._warned_fields]
            self._warned_fields.update(new)
        for name in new:
            log.warning("ignoring the unknown request field %r (not an OpenAI field this server knows); further "
                        "requests with it are not logged", name)

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

    Hardening: a bad or negative Content-Length is a 400, one over `max_body_bytes` a 413 (before the body
    is read); a connection that sends nothing for `read_timeout` seconds is answered 408 (mid-body) or
    closed; with `api_key`, /v1/* needs `Authorization: Bearer <key>` (else 401). After an error whose body
    was not read the connection is closed.
    """

    server: DFlashServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout  # StreamRequestHandler.setup sets it on the socket
        super().setup()

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
        kind = {401: "authentication_error"}.get(err.status, "invalid_request_error" if err.status < 500
                                                  else "server_error")
        if self.command == "POST" and not getattr(self, "_body_read", True):
            self.close_connection = True  # the unread body would be taken for the next request
        self._send_json(err.status, {"error": {"message": str(err), "type": kind, "param": err.param,
                                               "code": None}})

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None or not self.path.startswith("/v1/"):
            return
        given = self.headers.get("Authorization") or ""
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise RequestError("a valid API key is required: send 'Authorization: Bearer <key>'", status=401)

    def _read_body(self) -> bytes:
        """The request body, after checking Content-Length against the cap (nothing read before that)."""
        header = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            raise RequestError("chunked request bodies are not supported; send a Content-Length")
        try:
            length = int(header) if header is not None else 0
        except ValueError:
            length = -1
        if length < 0 or (header is not None and not (header.strip().isascii() and header.strip().isdigit())):
            raise RequestError(f"Content-Length must be a non-negative integer; received {header!r}")
        if length > self.server.max_body_bytes:
            raise RequestError(f"the request body is {length} bytes; this server takes at most "
                               f"{self.server.max_body_bytes}", status=413)
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError as err:
            raise RequestError(f"the request body did not arrive within {self.server.read_timeout} s",
                               status=408) from err
        if len(raw) < length:
            raise RequestError(f"the request body ended after {len(raw)} of {length} bytes")
        self._body_read = True
        return raw

    def _body(self, allowed: set[str], openai_fields: set[str]) -> dict[str, Any]:
        raw = self._read_body()
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body must be JSON; {err}") from err
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        _check_openai_fields(body, openai_fields)
        unknown = sorted(set(body) - allowed - openai_fields)
        if unknown and self.server.unknown_fields == "reject":
            raise RequestError(f"unknown field(s) {unknown}; this endpoint takes {sorted(allowed)}", unknown[0])
        if unknown:
            self.server.warn_unknown(unknown)
        model = body.get("model", self.server.model_name)
        if model != self.server.model_name:
            raise RequestError(f"model {model!r} does not exist; this server serves {self.server.model_name!r}",
                               "model", status=404)
        return body

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        try:
            self._authorize()
        except RequestError as err:
            self._error(err)
            return
        if self.path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            engine = self.server.worker.engine
            self._send_json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                              "created": self.server.created, "owned_by": "dflash",
                                                              "block_size": engine.k,
                                                              "drafter": engine.drafter_fingerprint}]})
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
        self._body_read = False
        try:
            self._authorize()
            if self.path == "/v1/completions":
                body = self._body(COMPLETION_FIELDS, _COMPLETION_OPENAI)
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    ids = self.server.tokenizer.encode(prompt)
                elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                    ids = list(prompt)
                else:
                    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt")
                self._complete(body, ids, chat=False)
            elif self.path == "/v1/chat/completions":
                body = self._body(CHAT_FIELDS, _CHAT_OPENAI)
                messages = body.get("messages")
                if not (isinstance(messages, list) and messages and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in messages)):
                    raise RequestError("messages must be a non-empty list of {role, content} strings", "messages")
                kwargs = body.get("chat_template_kwargs") or {}
                if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
                    raise RequestError("chat_template_kwargs must be an object of template variables, e.g. "
                                       '{"enable_thinking": false}', "chat_template_kwargs")
                ids = self.server.tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs)
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
        max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                          self.server.default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer; received {max_tokens!r}", "max_tokens")
        if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
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
            options = body.get("stream_options") or {}
            try:
                self._stream(job, rid, chat, include_usage=bool(options.get("include_usage")))
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away mid-stream
                self.server.worker.cancel(job)
                self.close_connection = True
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

    def _stream(self, job: _Job, rid: str, chat: bool, include_usage: bool = False) -> None:
        """Server-sent events; the finishing chunk carries `usage` and `dflash`. With
        `stream_options.include_usage`, as in OpenAI's API, every chunk has `"usage": null` and a last chunk
        with empty `choices` carries the usage."""
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
                       "choices": [choice], **({"usage": None} if include_usage else {}), **(extra or {})}
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
            usage = self._usage(job.prompt_ids, generated)
            event("", reason, {"dflash": self._stats(job.request)} if include_usage else
                  {"usage": usage, "dflash": self._stats(job.request)})
            if include_usage:
                payload = {"id": rid, "object": kind, "created": int(time.time()), "model": self.server.model_name,
                           "choices": [], "usage": usage}
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def make_server(engine: Engine, tokenizer: ChatTokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                default_max_tokens: int = 128, *, max_body_bytes: int = 4 << 20, read_timeout: float | None = 30.0,
                api_key: str | None = None, unknown_fields: str = "reject") -> DFlashServer:
    """A started engine thread and a bound (not yet serving) HTTP server; call `serve_forever()`.

    max_body_bytes: larger bodies get a 413 unread; read_timeout: seconds a connection may stay silent
    (mid-request or idle between keep-alive requests); api_key: if set, /v1/* needs `Authorization: Bearer
    <key>`; unknown_fields: "reject" (a 400) or "ignore" (one logged warning per field name) for fields that
    are neither this server's nor documented OpenAI ones (OpenAI fields are always accepted at neutral values).
    """
    worker = EngineWorker(engine).start()
    return DFlashServer((host, port), worker, tokenizer, model_name, engine.max_len, default_max_tokens,
                        max_body_bytes=max_body_bytes, read_timeout=read_timeout, api_key=api_key,
                        unknown_fields=unknown_fields)


__all__ = ["DFlashServer", "EngineWorker", "RequestError", "make_server"]
