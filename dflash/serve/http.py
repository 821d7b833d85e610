"""`dflash serve`'s transport: an OpenAI-compatible HTTP server (the stdlib's) over the engine thread.

    server = make_server(engine, tokenizer, "smollm2", port=8000)
    server.serve_forever()          # from another thread: server.close() finishes the requests in flight

Handler threads read bytes, check the API key, body size and timeouts, route, and write JSON or server-sent
events; what a request means and what a response holds is `serve.openai`, the engine thread is
`serve.worker.EngineWorker`. Design: docs/decisions.md D14, D40.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest

from dflash.models.tokenizer import ChatTokenizer
from dflash.serve import openai
from dflash.serve.engine import Engine
from dflash.serve.openai import GenerationRequest, ProtocolConfig, RequestError
from dflash.serve.sampling import GREEDY
from dflash.serve.worker import EngineWorker, Job, ShuttingDown

log = logging.getLogger(__name__)


class DFlashServer(ThreadingHTTPServer):
    """The HTTP server over one `EngineWorker`: `protocol` (the request policy `serve.openai` applies), the
    connection limits and API key the handler enforces, and the set of open connections `close` ends."""

    # Handler threads are joined on close (idle keep-alive connections are shut first): a daemon thread
    # left blocked on a socket at interpreter exit can abort the process.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 256  # the listen backlog (the stdlib's 5 resets bursts of concurrent clients)

    def __init__(self, address: tuple[str, int], worker: EngineWorker, tokenizer: ChatTokenizer, model_name: str,
                 max_len: int, default_max_tokens: int = 128, *, max_body_bytes: int = 4 << 20,
                 read_timeout: float | None = 30.0, api_key: str | None = None, unknown_fields: str = "reject"):
        # the request policy; the default sampling rule is the engine's (the recipe's `sampling:`)
        self.protocol = ProtocolConfig(model_name, default_max_tokens, worker.engine.sampling or GREEDY,
                                       unknown_fields)
        self._connections: set[Any] = set()
        self._conn_lock = threading.Lock()
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
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


class _Handler(BaseHTTPRequestHandler):
    """One connection's requests (a thread each, from `ThreadingHTTPServer`).

    Routes: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` as server-sent
    events), GET /v1/models, GET /health, GET /metrics (Prometheus text). Responses carry `usage` plus a
    `dflash` object with the request's acceptance statistics (τ, steps, accepted per step). A bad request
    gets a 4xx JSON error (`openai.error_body`) and the server keeps serving; an engine failure ends the
    requests in flight with a 500. Fields and their rules: `openai.check_fields`, `openai.parse_request`.

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
        if self.command == "POST" and not getattr(self, "_body_read", True):
            self.close_connection = True  # the unread body would be taken for the next request
        self._send_json(err.status, openai.error_body(err))

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

    def _event(self, payload: dict[str, Any] | str) -> None:
        """One server-sent event (a JSON payload, or the literal `[DONE]`)."""
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

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
            self._send_json(200, openai.models_body(self.server.model_name, self.server.created, engine.k,
                                                    engine.drafter_fingerprint))
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
            endpoint = openai.ENDPOINTS.get(self.path)
            if endpoint is None:
                raise RequestError(f"no route POST {self.path}", status=404)
            body = openai.parse_json(self._read_body())
            if ignored := openai.check_fields(endpoint, body, self.server.protocol):
                self.server.warn_unknown(ignored)
            self._complete(openai.parse_request(endpoint, body, self.server.tokenizer, self.server.protocol))
        except RequestError as err:
            self._error(err)

    # ------------------------------------------------------------------ completion

    def _complete(self, request: GenerationRequest) -> None:
        try:
            job = self.server.worker.submit(request.prompt_ids, request.max_tokens, seed=request.seed,
                                            sampling=request.sampling, stop_strings=request.stop)
        except ShuttingDown as err:
            raise RequestError(str(err), status=503) from err
        rid = openai.response_id(request.endpoint, id(job))
        if request.stream:
            try:
                self._stream(request, job, rid)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away mid-stream
                self.server.worker.cancel(job)
                self.close_connection = True
            return
        generated: list[int] = []
        while (ids := job.tokens.get()) is not None:
            generated += ids
        if job.error:
            raise RequestError(job.error, request.endpoint.prompt_param, status=500 if job.engine_failed else 400)
        text, reason = openai.final_text(self.server.tokenizer, generated, request.stop, job.request)
        self._send_json(200, openai.response_body(request, rid, int(time.time()), text, reason, len(generated),
                                                  job.request))

    def _stream(self, request: GenerationRequest, job: Job, rid: str) -> None:
        """Server-sent events: the chunks `openai.chunk` builds as text arrives, the finishing chunk, the usage
        chunk with `stream_options.include_usage`, then `[DONE]`; a request that failed ends with an error
        event instead."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        text = openai.TextStream(self.server.tokenizer, request.stop)
        if request.endpoint.chat:
            self._event(openai.chunk(request, rid, int(time.time()), ""))
        while (ids := job.tokens.get()) is not None:
            if delta := text.feed(ids):
                self._event(openai.chunk(request, rid, int(time.time()), delta))
        if job.error:
            self._event(openai.stream_error(job.error))
        else:
            completion_tokens = len(text.generated)
            self._event(openai.final_chunk(request, rid, int(time.time()), text.finish_reason(job.request),
                                           completion_tokens, job.request))
            if request.include_usage:
                self._event(openai.usage_chunk(request, rid, int(time.time()), completion_tokens))
        self._event("[DONE]")


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


__all__ = ["DFlashServer", "make_server"]
