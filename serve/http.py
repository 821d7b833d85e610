"""`dflash serve`'s transport: an OpenAI-compatible HTTP server (the stdlib's) over the engine thread.

    server = make_server(engine, tokenizer, "smollm2", port=8000)
    server.serve_forever()          # from another thread: server.close() finishes the requests in flight

Handler threads read bytes, check the API key, body size and timeouts, route, and write JSON or server-sent
events; what a request means and what a response holds is `serve.openai`, the engine thread is
`serve.worker.EngineWorker`. One request's failure is answered to that request alone: every error path
answers (4xx for the client's mistakes, 500 for a bug here, 503 when the engine failed as a whole), a client
that leaves is logged in one INFO line and its jobs are cancelled. Design: docs/decisions.md D14, D40.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import io
import json
import logging
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from prometheus_client import generate_latest

from dflash.models.tokenizer import ChatTokenizer
from dflash.serve import openai
from dflash.serve.engine import Engine
from dflash.serve.openai import GenerationRequest, ProtocolConfig, RequestError
from dflash.serve.sampling import GREEDY
from dflash.serve.worker import EngineWorker, Job, ShuttingDown

log = logging.getLogger(__name__)

GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)  # the client went away
POLL_S = 0.1  # how often a waiting handler checks that its client is still there
GET_ROUTES = ("/health", "/metrics", "/v1/models")
SEED_HEADER = "X-DFlash-Seed"  # the seed a generation request used (drawn fresh when it sent none)
MODEL_PREFIX = "/v1/models/"


def _forward(i: int, job: Job, merged: queue.Queue[Any]) -> None:
    """Copy a job's updates onto a request's merged queue as (i, update), then (i, None)."""
    while (update := job.tokens.get()) is not None:
        merged.put((i, update))
    merged.put((i, None))


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


class HeadDeadline(io.RawIOBase):
    """A connection's reads with a deadline on each request's head: from the first byte of a request line until
    its headers end, reads may take `head_timeout` seconds in all (a client that trickles its headers, a line per
    few seconds, is cut); otherwise (waiting for the next request, reading a body) each read may wait
    `idle_timeout` (None: forever). `arm` before a request, `disarm` once its headers are in; `expired` tells
    that the deadline, not a silent client, ended a read."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, idle_timeout: float | None,
                 head_timeout: float | None):
        super().__init__()
        self.raw, self.sock, self.idle, self.head = raw, sock, idle_timeout, head_timeout
        self.armed, self.deadline, self.expired = False, None, False

    def arm(self) -> None:
        self.armed, self.deadline, self.expired = self.head is not None, None, False

    def disarm(self) -> None:
        self.armed, self.deadline = False, None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        timeout = self.idle
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.expired = True
                raise TimeoutError(f"the request head did not arrive within {self.head} s")
            timeout = remaining if timeout is None else min(timeout, remaining)
        self.sock.settimeout(timeout)
        try:
            n = self.raw.readinto(buffer)
        except TimeoutError:
            self.expired = self.deadline is not None and time.monotonic() >= self.deadline
            raise
        if self.armed and n:  # the request's first bytes: its head has `head` seconds from now
            self.armed, self.deadline = False, time.monotonic() + self.head
        return n

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


def allowed_methods(path: str) -> str | None:
    """The `Allow` header of a route; None for a path that is no route."""
    if path in openai.ENDPOINTS:
        return "POST, OPTIONS"
    if path in GET_ROUTES or (path.startswith(MODEL_PREFIX) and len(path) > len(MODEL_PREFIX)):
        return "GET, HEAD, OPTIONS"
    return None



@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What a connection may take: `max_body_bytes` (larger bodies get a 413 unread), `read_timeout` (seconds a
    connection may stay silent, mid-request or idle between keep-alive requests; None: never) and `header_timeout`
    (seconds a request's line and headers may take in all, from their first byte: a deadline, not a per-read
    timeout; None: none)."""

    max_body_bytes: int = 4 << 20
    read_timeout: float | None = 30.0
    header_timeout: float | None = 10.0


class DFlashServer(ThreadingHTTPServer):
    """The HTTP server over one `EngineWorker`: `protocol` (the request policy `serve.openai` applies), the
    connection limits and API key the handler enforces, and the set of open connections `close` ends."""

    # Handler threads are joined on close (idle keep-alive connections are shut first): a daemon thread
    # left blocked on a socket at interpreter exit can abort the process.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 256  # the listen backlog (the stdlib's 5 resets bursts of concurrent clients)

    def __init__(self, address: tuple[str, int], worker: EngineWorker, tokenizer: ChatTokenizer, model_name: str,
                 max_len: int, default_max_tokens: int | None = None, *, limits: HttpLimits = HttpLimits(),
                 api_key: str | None = None, unknown_fields: str = "reject"):
        # the request policy; the default sampling rule is the engine's (the recipe's `sampling:`)
        self.protocol = ProtocolConfig(model_name, default_max_tokens, worker.engine.sampling or GREEDY,
                                       unknown_fields)
        self._connections: set[Any] = set()
        self._conn_lock = threading.Lock()
        self.max_body_bytes, self.read_timeout = limits.max_body_bytes, limits.read_timeout
        self.header_timeout = limits.header_timeout or None
        self.api_key = api_key or None
        self._warned_fields: set[str] = set()
        super().__init__(address, _Handler)
        self.worker, self.tokenizer, self.model_name, self.max_len = worker, tokenizer, model_name, max_len
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


    def handle_error(self, request: Any, client_address: Any) -> None:
        """An exception that escaped a handler: a client that left is one INFO line, anything else an ERROR
        with its traceback (the server keeps serving either way)."""
        err = sys.exc_info()[1]
        if isinstance(err, GONE):
            log.info("client %s:%s disconnected (%s)", *client_address[:2], type(err).__name__)
        else:
            log.exception("unexpected error serving %s:%s", *client_address[:2])


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (a thread each, from `ThreadingHTTPServer`).

    Routes: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as server-sent
    events), GET (and HEAD) /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text); OPTIONS on any
    route answers its `Allow`; another method on a route is a 405 with `Allow`; query strings are ignored.
    Responses carry `usage` plus a `dflash` object with the request's acceptance statistics (τ, steps,
    accepted per step) and its seed, also in the `X-DFlash-Seed` header (a request without one draws it
    fresh). A bad request gets a 4xx JSON error (`openai.error_body`) before any byte of a stream (the
    worker's `submit` validates synchronously), and the server keeps serving; a request the engine failed
    alone ends with the job's status (400), an engine-wide failure with 503; an unexpected exception here is
    a 500 JSON answer and an ERROR log line. Fields and their rules: `openai.check_fields`,
    `openai.parse_request`.

    Hardening: a bad or negative Content-Length is a 400, one over `max_body_bytes` a 413 (before the body
    is read); a connection that sends nothing for `read_timeout` seconds is answered 408 (mid-body) or
    closed; a request line and headers that take over `header_timeout` seconds in all are answered 408 and the
    connection closed (`HeadDeadline`); with `api_key`, /v1/* needs `Authorization: Bearer <key>` (else 401).
    After an error whose body was not read the connection is closed. Every refusal of a generation request is
    counted in `dflash_requests_total{status, finish_reason="rejected"}`. A client that disconnects while its
    request runs has its jobs cancelled, freeing their slots: a non-streamed request's socket is polled for the
    end of input every `POLL_S`
    (a half-close counts, as in uvicorn; what was made is still sent, finish_reason "cancelled"), a stream's
    client is gone when a write fails.
    """

    server: DFlashServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout  # StreamRequestHandler.setup sets it on the socket
        super().setup()
        self._head = HeadDeadline(self.rfile.detach(), self.connection, self.server.read_timeout,
                                  self.server.header_timeout)
        self.rfile = io.BufferedReader(self._head)

    def handle_one_request(self) -> None:
        """The stdlib's, with the head's deadline: a request line or headers that take longer than
        `header_timeout` are answered 408 and the connection closed."""
        self._head.arm()
        self.requestline, self.request_version, self.command = "", self.default_request_version, ""
        super().handle_one_request()
        if self._head.expired:
            with contextlib.suppress(*GONE, OSError):
                self.send_error(408, f"the request line and headers must arrive within {self.server.header_timeout} "
                                "s; this connection sent them slower")

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            self._head.disarm()  # the body's reads wait `read_timeout` each

    default_request_version = "HTTP/1.0"  # a malformed request line still gets a status line

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's errors (a malformed request line or header, an unknown method) as JSON, then close."""
        self.close_connection = True
        text = message or explain or HTTPStatus(code).phrase
        self._send_json(code, openai.error_body(RequestError(text, status=code)), {"Connection": "close"})

    # ------------------------------------------------------------------ plumbing

    def _send_json(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if getattr(self, "command", None) != "HEAD":
            self.wfile.write(data)

    def _error(self, err: RequestError, headers: dict[str, str] | None = None) -> None:
        if not self._body_read and self.headers.get("Content-Length", "0").strip() not in ("", "0"):
            self.close_connection = True  # the unread body would be taken for the next request
        self._send_json(err.status, openai.error_body(err), headers)

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None or not self._path.startswith("/v1/"):
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

    def _event(self, payload: dict[str, Any] | str) -> None:
        """One server-sent event (a JSON payload, or the literal `[DONE]`)."""
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the client closed its end: readable with nothing to read (EOF), or the socket failed. Bytes
        the client sent ahead (a pipelined request) are left where they are."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    # ------------------------------------------------------------------ routes

    def _dispatch(self) -> None:
        """Route one request; every outcome answers (or, when the client left, logs one INFO line)."""
        self._body_read, self._started = False, False
        self._path = urlsplit(self.path).path
        try:
            if self.command != "OPTIONS":  # a browser's preflight carries no credentials
                self._authorize()
            allow = allowed_methods(self._path)
            if self.command == "OPTIONS" and self.path == "*":
                self._send_empty(204, {"Allow": "GET, HEAD, POST, OPTIONS"})
            elif allow is None:
                raise RequestError(f"no route {self.command} {self._path}", status=404)
            elif self.command == "OPTIONS":
                self._send_empty(204, {"Allow": allow})
            elif self.command not in allow:
                self._error(RequestError(f"method {self.command} is not allowed on {self._path}; allowed: {allow}",
                                         status=405), {"Allow": allow})
            elif self.command == "POST":
                self._post(openai.ENDPOINTS[self._path])
            else:
                self._get()
        except RequestError as err:
            if self.command == "POST" and self._path in openai.ENDPOINTS and not err.counted:
                self.server.worker.refused(err.status)  # every refusal of a generation request is counted
            self._error(err)
        except (ClientGone, *GONE) as err:
            log.info("client %s:%s disconnected during %s %s (%s)", *self.client_address[:2], self.command,
                     self._path, type(err).__name__)
            self.close_connection = True
        except Exception:  # noqa: BLE001 - a bug here must not close the connection unanswered
            log.exception("unexpected error serving %s %s", self.command, self._path)
            self.close_connection = True
            if not self._started:
                self._send_json(500, openai.error_body(RequestError(
                    "internal server error while serving this request (logged on the server)", status=500)))

    def _send_empty(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_HEAD = do_OPTIONS = do_PUT = do_DELETE = do_PATCH = _dispatch  # noqa: N815 - stdlib

    def _get(self) -> None:
        server, engine = self.server, self.server.worker.engine
        card = (server.model_name, server.created, engine.k, engine.drafter_fingerprint, engine.max_len)
        if self._path == "/health":
            self._send_json(200, {"status": "ok"})
        elif self._path == "/v1/models":
            self._send_json(200, openai.models_body(*card))
        elif self._path.startswith(MODEL_PREFIX):
            model = unquote(self._path[len(MODEL_PREFIX):])
            if model != server.model_name:
                raise RequestError(f"model {model!r} does not exist; this server serves {server.model_name!r}",
                                   "model", status=404)
            self._send_json(200, openai.model_card(*card))
        else:  # /metrics
            data = generate_latest(server.worker.registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    def _post(self, endpoint: openai.Endpoint) -> None:
        body = openai.parse_json(self._read_body())
        if ignored := openai.check_fields(endpoint, body, self.server.protocol):
            self.server.warn_unknown(ignored)
        request = openai.parse_request(endpoint, body, self.server.tokenizer, self.server.protocol)
        jobs = self._submit(request)
        self._ended: set[int] = set()
        self._merged: queue.Queue[Any] | None = None
        try:
            if request.stream:
                self._stream(request, jobs)
            else:
                self._whole(request, jobs)
        finally:
            for i, job in enumerate(jobs):  # a client that left, or a choice failed: free the others' slots
                if i not in self._ended:
                    self.server.worker.cancel(job)

    # ------------------------------------------------------------------ completion

    def _submit(self, request: GenerationRequest) -> list[Job]:
        """One job per choice, submitted before any byte is sent: the worker's refusal (`RequestRejected`) is a
        400 in the request's terms, and the choices already taken are cancelled."""
        jobs: list[Job] = []
        try:
            for choice in request.choices:
                try:
                    jobs.append(self.server.worker.submit(
                        choice.prompt_ids, request.submit_max_tokens, seed=choice.seed, sampling=request.sampling,
                        stop_strings=request.stop, logprobs=request.logprobs,
                        prompt_logprobs=request.prompt_logprobs, ignore_eos=request.ignore_eos))
                except ValueError as err:  # RequestRejected, counted by the worker
                    refusal = openai.rejected(request, err, choice)
                    refusal.counted = True
                    raise refusal from err
        except (RequestError, ShuttingDown) as err:
            for job in jobs:
                self.server.worker.cancel(job)
            if isinstance(err, ShuttingDown):
                raise RequestError(str(err), status=503) from err
            raise
        return jobs

    def _updates(self, jobs: list[Job], poll: bool) -> Iterator[tuple[int, Any]]:
        """(job position, `JobUpdate`) as the jobs publish them, then (position, None) as each ends, until all
        ended. poll: check every `POLL_S` that the client did not close its connection (else `ClientGone`)."""
        if self._merged is None:  # one merged queue per request, read by every pass
            if len(jobs) == 1:  # the common case: the job's own queue, no forwarding thread
                self._merged = jobs[0].tokens
            else:
                self._merged = queue.Queue()
                for i, job in enumerate(jobs):
                    threading.Thread(target=_forward, args=(i, job, self._merged), name="dflash-job",
                                     daemon=True).start()
        checked = time.monotonic()
        while len(self._ended) < len(jobs):
            try:
                item = self._merged.get(timeout=POLL_S)
            except queue.Empty:
                item = ...
            if poll and (item is ... or time.monotonic() - checked >= POLL_S):
                checked = time.monotonic()
                if self._client_gone():
                    raise ClientGone
            if item is ...:
                continue
            i, update = (0, item) if len(jobs) == 1 else item
            if update is None:
                self._ended.add(i)
            yield i, update

    def _failure(self, jobs: list[Job]) -> RequestError | None:
        """The first failed job's error, with its status (400: it failed alone; 503: the engine failed)."""
        for job in jobs:
            if job.error:
                failed = RequestError(job.error, None, status=job.status or 500)
                failed.counted = True  # the worker counted how it ended
                return failed
        return None

    def _whole(self, request: GenerationRequest, jobs: list[Job]) -> None:
        try:
            for i, update in self._updates(jobs, poll=True):
                if update is None and jobs[i].error:
                    break  # the request fails; the other choices are cancelled
        except ClientGone:
            # Closed, or only half-closed (a client may shut its sending side and still read): its jobs end now,
            # freeing their slots, and what they made is still sent (finish_reason "cancelled").
            log.info("client %s:%s disconnected (closed its connection) during POST %s; its request is cancelled",
                     *self.client_address[:2], self._path)
            self.close_connection = True
            for i, job in enumerate(jobs):
                if i not in self._ended:
                    self.server.worker.cancel(job)
            for _ in self._updates(jobs, poll=False):
                pass
            with contextlib.suppress(*GONE):
                self._answer(request, jobs)
            return
        self._answer(request, jobs)

    def _answer(self, request: GenerationRequest, jobs: list[Job]) -> None:
        if err := self._failure(jobs):
            raise err
        self._send_json(200, openai.response_body(request, openai.response_id(request.endpoint), int(time.time()),
                                                  [job.request for job in jobs], self.server.tokenizer),
                        {SEED_HEADER: str(request.seed)})

    def _stream(self, request: GenerationRequest, jobs: list[Job]) -> None:
        """Server-sent events: per choice a first chunk (chat: the role; completions with echo: the prompt),
        chunks as stable text arrives (interleaved by choice index), the choice's finishing chunk; then the
        usage chunk with `stream_options.include_usage`, then `[DONE]`. A job that fails after the 200 ends
        the stream with an error event."""
        tok, rid, choices = self.server.tokenizer, openai.response_id(request.endpoint), request.choices
        generated, offsets, opened = [0] * len(jobs), [0] * len(jobs), [False] * len(jobs)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.send_header(SEED_HEADER, str(request.seed))
        self.end_headers()
        self._started = self.close_connection = True

        def usage_now() -> dict[str, int] | None:
            return openai.usage(request.prompt_tokens, sum(generated)) if request.continuous_usage else None

        def open_choice(i: int) -> None:
            opened[i] = True
            if request.endpoint.chat:
                self._event(openai.role_chunk(request, rid, int(time.time()), choices[i].index, usage_now()))
            elif request.echo:
                echo = openai.echo_chunk(request, rid, int(time.time()), choices[i], jobs[i].request, tok, usage_now())
                offsets[i] = len(echo["choices"][0]["text"])
                self._event(echo)

        if request.endpoint.chat:  # the role at once: a client's time to first token is the engine's
            for i in range(len(jobs)):
                open_choice(i)
        left = len(jobs)
        for i, update in self._updates(jobs, poll=False):  # a client that left is seen when a write fails
            if not opened[i]:
                open_choice(i)
            if update is not None:
                if request.max_tokens == 0:
                    continue  # the scored prompt's one generated token is dropped
                generated[i] += len(update.token_ids)
                if update.text_delta or (update.token_ids and (request.logprobs is not None or
                                                               request.continuous_usage)):
                    self._event(openai.chunk(request, rid, int(time.time()), choices[i].index, update, tok,
                                             offsets[i], usage_now()))
                    offsets[i] += len(update.text_delta)
                continue
            job = jobs[i]
            if job.error:
                self._event(openai.stream_error(job.error, job.status or 500))
                self._event("[DONE]")
                return
            left -= 1
            generated[i] = openai.completion_tokens(request, job.request)
            whole = None
            if not left and not request.include_usage and not request.continuous_usage:
                whole = openai.usage(request.prompt_tokens, sum(generated))
            self._event(openai.final_chunk(request, rid, int(time.time()), choices[i].index, job.request,
                                           usage_now(), whole))
        if request.include_usage:
            self._event(openai.usage_chunk(request, rid, int(time.time()), sum(generated)))
        self._event("[DONE]")


def make_server(engine: Engine, tokenizer: ChatTokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                default_max_tokens: int | None = None, *, limits: HttpLimits = HttpLimits(),
                api_key: str | None = None, unknown_fields: str = "reject") -> DFlashServer:
    """A started engine thread and a bound (not yet serving) HTTP server; call `serve_forever()`.

    default_max_tokens: the budget of requests that send no max_tokens (None: until a stop or the end of the
    context, as vLLM); limits: the connection limits (`HttpLimits`: body size, read and header timeouts); api_key:
    if set, /v1/* needs
    `Authorization: Bearer <key>`; unknown_fields: "reject" (a 400) or "ignore" (one logged warning per field
    name) for fields that are neither this server's nor documented OpenAI ones (OpenAI fields are always
    accepted at neutral values).
    """
    worker = EngineWorker(engine).start()
    return DFlashServer((host, port), worker, tokenizer, model_name, engine.max_len, default_max_tokens,
                        limits=limits, api_key=api_key, unknown_fields=unknown_fields)


@contextlib.contextmanager
def running(servers: list[DFlashServer]) -> Iterator[list[str]]:
    """Serve each of `servers` (`build_servers`) in a thread of this process; yields their base URLs in order, and
    on exit closes them (the requests in flight finish, the engine threads stop)."""
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [f"http://{s.server_address[0]}:{s.server_address[1]}" for s in servers]
    finally:
        for server in servers:
            server.close()
        for thread in threads:
            thread.join(timeout=30)

__all__ = ["running", "SEED_HEADER", "DFlashServer", "HeadDeadline", "HttpLimits", "allowed_methods", "make_server"]
