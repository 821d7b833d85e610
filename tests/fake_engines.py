"""Small fake vLLM and SGLang servers for `dflash eval --url` tests: stdlib http.server in a thread, the OpenAI chat
completions API, and each engine's documented speculative statistics with known acceptance.

A fake "decodes" by a script: every verify step accepts the next count of `accepted` (cycled) out of K-1 drafts and
emits accepted + 1 tokens ("w0 w1 ..."), after a first token from the prefill, until `max_tokens` (the last step
cut short). Replies depend only on `max_tokens`, so a speculative fake and an AR fake (`spec=False`: one token per
step, no speculative statistics) agree token for token. Each request's ground truth is appended to `server.log`.

- vLLM (`vllm/v1/spec_decode/metrics.py`): /metrics through prometheus_client with vLLM's names and labels
  (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
  `..._num_accepted_tokens_per_pos{position}`, `vllm:request_success{finished_reason}`, labels `model_name`,
  `engine`), requests alternating between two engine indices (data parallel: the readers must sum over `engine`),
  counted `record_delay` seconds after the reply ends (vLLM records a step's stats after handing out its output);
  the usage chunk only with `stream_options.include_usage`; /v1/models `owned_by: vllm`.
- SGLang (`tokenizer_manager._calculate_spec_decoding_metrics`, `serving_chat`): the choice's `meta_info` with
  `return_meta_info` on an unstreamed request (a 400 on a streamed one, as SGLang), `spec_verify_ct`,
  `completion_tokens`, `spec_accept_length` (completion_tokens / spec_verify_ct), `spec_accept_token_num`,
  `spec_draft_token_num`, `spec_accept_histogram`, the prefill/decode stamps; /get_server_info with
  `speculative_num_draft_tokens` (K); /v1/models `owned_by: sglang`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake/target"


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, engine: str, spec: bool, k: int, accepted: list[int], step_s: float, record_delay: float,
                 owned_by: str | None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.engine, self.spec, self.k, self.accepted = engine, spec, k, accepted
        self.step_s, self.record_delay = step_s, record_delay
        self.owned_by = engine if owned_by is None else owned_by
        self.log: list[dict[str, Any]] = []
        self.bodies: list[dict[str, Any]] = []  # every chat request's body, as received
        self.lock = threading.Lock()
        self.requests = 0
        self.cursor = 0  # where in the `accepted` cycle the next step starts (continues across requests)
        if engine == "vllm":
            self._vllm_metrics()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def _vllm_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
              registry=self.registry).labels(MODEL, "0").set(0)
        self.finished = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*labels, "finished_reason"], registry=self.registry)
        if not self.spec:
            return
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                              registry=self.registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                    registry=self.registry)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                                       registry=self.registry)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               [*labels, "position"], registry=self.registry)
        for engine in ("0", "1"):  # vLLM creates every series at start-up (value 0)
            for counter in (self.drafts, self.draft_tokens, self.accepted_tokens):
                counter.labels(MODEL, engine)
            for pos in range(self.k - 1):
                self.per_pos.labels(MODEL, engine, str(pos))

    def decode(self, max_tokens: int) -> tuple[list[int], list[int]]:
        """(tokens emitted per chunk: the prefill's 1, then each verify step's, the last cut at max_tokens;
        drafts accepted at each verify step)."""
        chunks, steps, total = [1], [], 1
        with self.lock:
            while total < max_tokens:
                a = self.accepted[self.cursor % len(self.accepted)] if self.spec else 0
                self.cursor += 1 if self.spec else 0
                steps.append(a)
                emit = min(a + 1, max_tokens - total)
                chunks.append(emit)
                total += emit
        return chunks, steps

    def count(self, steps: list[int], completion_tokens: int, engine_index: str) -> None:
        """The request's ground truth in `log`, and (vLLM) its counters, as vLLM's SpecDecodingStats.observe_draft."""
        self.log.append({"steps": len(steps), "accepted": sum(steps), "completion_tokens": completion_tokens,
                         "per_step": steps})
        if self.engine != "vllm":
            return
        if self.spec:
            for a in steps:
                self.drafts.labels(MODEL, engine_index).inc(1)
                self.draft_tokens.labels(MODEL, engine_index).inc(self.k - 1)
                self.accepted_tokens.labels(MODEL, engine_index).inc(a)
                for pos in range(a):
                    self.per_pos.labels(MODEL, engine_index, str(pos)).inc(1)
        self.finished.labels(MODEL, engine_index, "length").inc(1)


class _Handler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib
        server = self.server
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                         "owned_by": server.owned_by, "max_model_len": 4096}]})
        elif self.path == "/health":
            self._json(200, {})
        elif self.path == "/metrics" and server.engine == "vllm":
            from prometheus_client import generate_latest

            data = generate_latest(server.registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/get_server_info" and server.engine == "sglang":
            spec = {"speculative_algorithm": "DFLASH", "speculative_num_draft_tokens": server.k,
                    "speculative_draft_model_path": "fake/drafter"} if server.spec else {"speculative_algorithm": None}
            self._json(200, {"model_path": MODEL, **spec, "version": "0.0.fake"})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802 - stdlib
        server = self.server
        if self.path != "/v1/chat/completions":
            self._json(404, {"detail": "Not Found"})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.bodies.append(body)
        if server.engine == "sglang" and body.get("stream") and body.get("return_meta_info"):
            self._json(400, {"object": "error", "message": "return_meta_info is not supported with streaming. "
                             "Please set stream=false when using return_meta_info=true.", "type": "BadRequestError",
                             "param": None, "code": 400})
            return
        with server.lock:
            index = str(server.requests % 2)
            server.requests += 1
        received = time.time()
        chunks, steps = server.decode(int(body["max_tokens"]))
        n = sum(chunks)
        words = [f"w{i} " for i in range(n)]
        if body.get("stream"):
            self._stream(body, chunks, words)
        else:
            prefill_done = time.time()
            time.sleep(server.step_s * len(steps))
            self._whole(body, words, steps, received, prefill_done)
        if server.engine == "vllm" and server.record_delay:
            threading.Timer(server.record_delay, server.count, (steps, n, index)).start()
        else:
            server.count(steps, n, index)

    def _stream(self, body: dict[str, Any], chunks: list[int], words: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(data: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
            self.wfile.flush()

        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        done = 0
        for i, size in enumerate(chunks):
            if i:
                time.sleep(self.server.step_s)
            event({**base, "choices": [{"index": 0, "delta": {"content": "".join(words[done:done + size])},
                                        "finish_reason": None}]})
            done += size
        event({**base, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            event({**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": done,
                                                    "total_tokens": 10 + done}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _whole(self, body: dict[str, Any], words: list[str], steps: list[int], received: float,
               prefill_done: float) -> None:
        server, n = self.server, len(words)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                                  "finish_reason": "length", "matched_stop": None}
        if body.get("return_meta_info"):
            meta: dict[str, Any] = {"id": "fake", "finish_reason": {"type": "length", "length": n},
                                    "prompt_tokens": 10, "completion_tokens": n, "cached_tokens": 0,
                                    "request_received_ts": received, "prefill_finished_ts": prefill_done,
                                    "decode_finished_ts": time.time(), "e2e_latency": time.time() - received}
            if server.spec:
                hist = [sum(a == j for a in steps) for j in range(server.k)]
                meta.update({"spec_verify_ct": len(steps), "spec_accept_length": n / len(steps) if steps else 0,
                             "spec_accept_rate": sum(steps) / (len(steps) * (server.k - 1)) if steps else 0.0,
                             "spec_accept_token_num": sum(steps), "spec_draft_token_num": len(steps) * (server.k - 1),
                             "spec_accept_histogram": hist})
            choice["meta_info"] = meta
        self._json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [choice], "usage": {"prompt_tokens": 10, "completion_tokens": n,
                                                        "total_tokens": 10 + n}})


@contextlib.contextmanager
def fake_server(engine: str, *, spec: bool = True, k: int = 4, accepted: list[int] | None = None,
                step_s: float = 0.001, record_delay: float = 0.05, owned_by: str | None = None
                ) -> Iterator[FakeServer]:
    """A fake `engine` ("vllm" or "sglang") server in a thread (see the module docstring); yields it (its `url`,
    its `log`); `owned_by`: what /v1/models says (default the engine; "" to make auto-detection look further)."""
    server = FakeServer(engine, spec, k, accepted or [3, 1, 0, 2, 3], step_s, record_delay, owned_by)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def pooled_tau(log: list[dict[str, Any]]) -> float:
    """The τ a fake produced over `log`'s requests (1 + accepted / verify steps)."""
    return 1.0 + sum(r["accepted"] for r in log) / sum(r["steps"] for r in log)
