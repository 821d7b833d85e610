"""`dflash serve` under property-based fuzzing (issue 32 item 9): request bodies generated from the API's field
types (every field of both endpoints, valid and invalid values: huge, negative and boundary ints, floats with NaN
and infinities, bools, nested lists, unicode with lone surrogates as raw JSON escapes, deep nesting), random bytes
and broken HTTP (bad request lines, bad headers, truncated bodies), all over raw sockets, while a "victim" greedy
stream runs again and again beside them.

Asserted: never a 5xx; a syntactically complete HTTP request always gets a response (never a closed connection);
a 200 stream ends with `[DONE]` and carries no error event (a bad streaming request is refused before its first
byte); every victim run streams exactly the text and token count the same request gives alone; afterwards the
server still answers a normal request. The default tier runs a bounded, derandomized number of examples; the
`slow` variant many more. What the first run against the server found: docs/benchmarks.md ("Fuzzing the server").
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.serve.engine import Engine
from dflash.serve.http import HttpLimits, make_server
from dflash.serve.plan import AR, Limits

pytestmark = [pytest.mark.heavy, pytest.mark.e2e]

MAX_LEN = 256
VOCAB = 49152  # SmolLM2's
VICTIM = {"prompt": "Once upon a time, a dragon and a knight", "max_tokens": 40, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}}
# RFC 9110 15.6.2 and 15.6.6: 501 answers a method the server does not recognize and 505 an HTTP major version it
# does not support; any other 5xx is a failure
STANDARD_METHODS = {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"CONNECT", b"OPTIONS", b"TRACE", b"PATCH"}


# ------------------------------------------------------------------ the server, a raw exchange, the victim

@pytest.fixture(scope="module")
def server(smollm2_target):
    target = smollm2_target
    engine = Engine(target.params, target.cfg, None, AR(),
                    Limits(slots=4, max_len=MAX_LEN))  # AR: the HTTP layer is under test
    srv = make_server(engine, target.tokenizer, "smollm2", port=0,
                      limits=HttpLimits(max_body_bytes=1 << 20, read_timeout=2.0), unknown_fields="ignore")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, srv.server_address[1]
    srv.close()
    thread.join(10)
    assert not thread.is_alive() and not srv.worker.thread.is_alive()


def exchange(port: int, data: bytes, timeout: float = 120.0) -> bytes:
    """Send `data`, close our sending side (the server sees the end of input: no wait for a read timeout), and
    read until the server closes the connection; everything it sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # it answered and closed before reading all of it
            pass
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def status_of(response: bytes) -> int | None:
    """The status code of the first response in `response`, or None when there is none."""
    if not response.startswith(b"HTTP/1."):
        return None
    try:
        return int(response.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


def stream_text(response: bytes) -> tuple[str, int | None, list[str]]:
    """(the streamed text, the usage chunk's completion_tokens, the events that are errors) of an SSE response."""
    text, tokens, errors = "", None, []
    for line in response.split(b"\n"):
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(json.dumps(event))
        for choice in event.get("choices") or ():
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return text, tokens, errors


@dataclass
class Victim:
    """A greedy stream run again and again on its own thread: each run must give `expected` (text, tokens)."""

    port: int
    expected: tuple[str, int | None]
    runs: int = 0
    failures: list[str] | None = None

    def start(self) -> Callable[[], None]:
        self.failures = []
        stop = threading.Event()

        def loop() -> None:
            body = json.dumps(VICTIM).encode()
            while not stop.is_set():
                try:
                    got = exchange(self.port, post("/v1/completions", body))
                    text, tokens, errors = stream_text(got)
                    if status_of(got) != 200 or errors or (text, tokens) != self.expected:
                        self.failures.append(f"status {status_of(got)}, errors {errors}, got {(text, tokens)!r}")
                except Exception as err:  # noqa: BLE001 - every way a run fails is a finding
                    self.failures.append(f"{type(err).__name__}: {err}")
                self.runs += 1

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()

        def finish() -> None:
            stop.set()
            thread.join(300)
            assert not thread.is_alive(), "the victim stream hangs"

        return finish


def victim_alone(port: int) -> Victim:
    got = exchange(port, post("/v1/completions", json.dumps(VICTIM).encode()))
    text, tokens, errors = stream_text(got)
    assert status_of(got) == 200 and not errors and tokens and text, got[-500:]
    return Victim(port, (text, tokens))


def still_serves(port: int) -> None:
    ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                    timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------ JSON values, written as raw JSON text

@dataclass(frozen=True)
class Deep:
    """`depth` nested arrays, written as raw text (deeper than any encoder would go)."""

    depth: int


def to_json(value: Any) -> str:
    """JSON text of `value` as a hostile client would write it: NaN and Infinity as bare words, lone surrogates
    as \\ud800 escapes (ensure_ascii), `Deep` as raw brackets."""
    if isinstance(value, Deep):
        return "[" * value.depth + "]" * value.depth
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


BOUNDARY_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                                 -(2**63), 2**64, 10**30, -(10**30), VOCAB - 1, VOCAB, MAX_LEN, MAX_LEN + 1])
INTS = st.one_of(st.integers(-3, 8), BOUNDARY_INTS, st.integers())
FLOATS = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e308, 5e-324, float("nan"),
                                                 float("inf"), float("-inf")]))
SURROGATES = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2)
TEXT = st.one_of(st.text(max_size=16), SURROGATES, st.builds("".join, st.lists(st.one_of(st.text(max_size=3),
                                                                                          SURROGATES), max_size=4)),
                 st.sampled_from(["", "\x00", "<|im_end|>", "<|im_start|>user", "\n\n", "\U0001f600", "é" * 3]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY = st.one_of(
    st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(TEXT, inner, max_size=3)), max_leaves=10),
    st.builds(Deep, st.one_of(st.integers(1, 64), st.sampled_from([500, 1000, 5000, 50_000, 100_000]))))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), INTS, FLOATS, st.booleans()), max_size=12)
SMALL_BUDGET = st.one_of(st.integers(0, 4), BOUNDARY_INTS, st.integers(max_value=-1), FLOATS, TEXT, st.booleans(),
                         st.lists(st.integers(0, 4), max_size=2))  # valid ones generate at most 4 tokens


def _either(typed: st.SearchStrategy, weight_any: bool = True) -> st.SearchStrategy:
    """Values of the field's type, or (less often) any JSON value at all."""
    return st.one_of(typed, ANY) if weight_any else typed


CONTENT_PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                         st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "refusal", ""]),
                                                "text": TEXT}), ANY)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "tool"]), TEXT),
     "content": st.one_of(TEXT, st.lists(CONTENT_PART, max_size=3), ANY)},
    optional={"name": TEXT, "tool_calls": ANY, "tool_call_id": TEXT, "extra": ANY})
STREAM_OPTIONS = _either(st.fixed_dictionaries({}, optional={"include_usage": _either(st.booleans()),
                                                             "continuous_usage_stats": _either(st.booleans())}))
COMMON = {  # the fields both endpoints know, with their types
    "model": st.one_of(st.just("smollm2"), TEXT, ANY),
    "temperature": _either(st.one_of(st.sampled_from([0, 0.0, 0.7, 1, 2]), FLOATS, INTS)),
    "top_p": _either(st.one_of(st.sampled_from([1, 0.9, 0.0]), FLOATS, INTS)),
    "top_k": _either(st.one_of(st.sampled_from([-1, 0, 1, 40]), INTS)),
    "stream": _either(st.booleans()),
    "stream_options": STREAM_OPTIONS,
    "stop": _either(st.one_of(st.none(), TEXT, st.lists(TEXT, max_size=5), INTS)),
    "seed": _either(INTS),
    "n": _either(st.one_of(st.integers(-1, 3), BOUNDARY_INTS)),
    "user": _either(TEXT),
    "frequency_penalty": _either(FLOATS), "presence_penalty": _either(FLOATS),
    "logit_bias": _either(st.dictionaries(TEXT, FLOATS, max_size=2)),
    "ignore_eos": ANY,  # vLLM's extension: a boolean runs past the stop tokens, anything else is a 400
}
COMPLETIONS = {
    "prompt": _either(st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3))),
    "max_tokens": SMALL_BUDGET,
    "logprobs": _either(st.one_of(st.integers(-1, 7), st.booleans(), BOUNDARY_INTS)),
    "echo": _either(st.booleans()),
    "best_of": _either(INTS), "suffix": _either(TEXT),
}
CHAT = {
    "messages": _either(st.lists(MESSAGE, max_size=3)),
    "max_tokens": SMALL_BUDGET,
    "max_completion_tokens": SMALL_BUDGET,
    "logprobs": _either(st.booleans()),
    "top_logprobs": _either(st.one_of(st.integers(-1, 22), BOUNDARY_INTS)),
    "chat_template_kwargs": _either(st.dictionaries(TEXT, ANY, max_size=2)),
    "response_format": _either(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "tools": ANY, "tool_choice": _either(st.sampled_from(["none", "auto", "required"])),
    "parallel_tool_calls": ANY, "metadata": ANY, "store": ANY, "service_tier": ANY, "modalities": ANY,
}


def _body(required: str, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A request body of one endpoint: mostly its required field and a small budget plus any of the others, else
    any subset of the fields (the required one may be missing), plus unknown names; or a non-object."""
    rest = {k: v for k, v in {**COMMON, **fields}.items() if k not in (required, "max_tokens")}
    usual = st.fixed_dictionaries({required: fields[required], "max_tokens": fields["max_tokens"]}, optional=rest)
    loose = st.fixed_dictionaries({}, optional={**COMMON, **fields})
    extra = st.dictionaries(st.one_of(TEXT, st.sampled_from(["repetition_penalty", "best_of", "min_tokens"])), ANY,
                            max_size=2)
    objects = st.builds(lambda a, b: {**b, **a}, st.one_of(usual, usual, usual, loose), extra)
    return st.one_of(objects, objects, objects, ANY)


BASES = {"/v1/completions": ({"prompt": "Hello there", "max_tokens": 2}, COMPLETIONS),
         "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, CHAT)}


def _one_field(path: str, name: str, value: Any, stream: bool) -> tuple[str, dict[str, Any]]:
    base, _ = BASES[path]
    return path, {**base, "stream": stream, name: value}


# the fields that reach the tokenizer, the engine or the sampler: drawn three times as often
KEY_FIELDS = {"prompt", "messages", "stop", "top_k", "top_p", "temperature", "seed", "n", "max_tokens",
              "max_completion_tokens", "logprobs", "top_logprobs", "echo", "stream_options"}
# a valid request with one field set to a value of its type or any value: reaches the code behind validation
ONE_FIELD = st.one_of([st.builds(_one_field, st.just(path), st.just(name), strategy, st.booleans())
                       for path, (_, fields) in BASES.items() for name, strategy in {**COMMON, **fields}.items()
                       for _ in range(3 if name in KEY_FIELDS else 1)])
JSON_REQUESTS = st.one_of(ONE_FIELD, ONE_FIELD,st.tuples(st.just("/v1/completions"), _body("prompt", COMPLETIONS)),
                          st.tuples(st.just("/v1/chat/completions"), _body("messages", CHAT)))


# ------------------------------------------------------------------ raw HTTP, well formed or not

METHODS = st.one_of(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT",
                                     "get", "PRI"]), st.text(max_size=8))
PATHS = st.one_of(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/smollm2",
                                   "/v1/models/x", "/health", "/metrics", "/", "*", "/v1/completions?x=1",
                                   "/v1/../health", "//v1/models", "/v1/completions%00", "/" + "a" * 70_000]),
                  st.text(max_size=30))
VERSIONS = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1x", "HTTP/1", "", "http/1.1"])
HEADER_LINES = st.one_of(
    st.sampled_from(["Content-Length: 5", "Content-Length: -1", "Content-Length: 99999999999999999999",
                     "Content-Length: 0x10", "Content-Length: 3, 3", "Transfer-Encoding: chunked",
                     "Content-Type: text/plain", "Content-Type: application/json; charset=utf-16",
                     "Authorization: Bearer x", "Expect: 100-continue", "Connection: close", "Connection: upgrade",
                     "Upgrade: h2c", "no colon here", ": empty name", "X-Long: " + "v" * 70_000, " folded",
                     "Host:", "Content-Length:"]),
    st.builds(lambda k, v: f"{k}: {v}", st.text(max_size=12), st.text(max_size=24)))


TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 5.6.2: a method or a header name


def _header_ok(line: str) -> bool:
    name, colon, value = line.partition(":")
    return bool(colon) and TOKEN.fullmatch(name) is not None and value.isascii() and value.isprintable() \
        and len(line) < 60_000


@dataclass(frozen=True)
class RawRequest:
    """Bytes to send, and whether they are a syntactically complete HTTP/1.x request (which must be answered)."""

    data: bytes
    complete: bool


def _raw(method: str, path: str, version: str, headers: list[str], body: bytes, cut: int | None) -> RawRequest:
    names = [h.split(":", 1)[0].strip().lower() for h in headers]
    lines = [f"{method} {path} {version}", *headers]
    if cut is None and "content-length" not in names:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass")
    data = head + (body if cut is None else body[:cut])
    well_formed = (TOKEN.fullmatch(method) is not None and version in ("HTTP/1.1", "HTTP/1.0")
                   and path.startswith("/") and path.isascii() and path.isprintable() and " " not in path
                   and len(path) < 60_000 and all(_header_ok(h) for h in headers)
                   and not {"content-length", "transfer-encoding", "expect"} & set(names))
    return RawRequest(data, well_formed and cut is None)


RAW_REQUESTS = st.one_of(
    st.builds(_raw, METHODS, PATHS, VERSIONS, st.lists(HEADER_LINES, max_size=4),
              st.one_of(st.binary(max_size=64), JSON_REQUESTS.map(lambda r: to_json(r[1]).encode())),
              st.one_of(st.none(), st.integers(0, 40))),
    st.builds(lambda b: RawRequest(b, False), st.binary(max_size=300)),  # random bytes
    st.builds(lambda body, n: RawRequest(post("/v1/completions", body)[:n], False),  # truncated mid-request
              JSON_REQUESTS.map(lambda r: to_json(r[1]).encode()), st.integers(0, 200)),
    st.builds(lambda path, body: RawRequest(post(path, body), True),  # bodies that are not (UTF-8) JSON
              st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.one_of(st.binary(max_size=64), st.sampled_from([
                  b"", b"{", b"null", b"[]", b'"x"', b"1e999", b"NaN", b'{"prompt": "a", "prompt": [1]}',
                  b"\xef\xbb\xbf{}", '{"prompt": "é"}'.encode("utf-16"), b'{"prompt": "\xff\xfe"}',
                  b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"prompt": [1e400], "max_tokens": 1}',
                  b'{"prompt": "hi", "max_tokens": 1e400}']))),
)


# ------------------------------------------------------------------ the property

def check_response(request: RawRequest, response: bytes) -> None:
    status = status_of(response)
    if request.complete:
        assert status is not None, f"the connection closed without a response: {response[:200]!r}"
    if status is None:
        return
    line = request.data.split(b"\r\n", 1)[0].split(b" ")
    unknown_method = line[0] not in STANDARD_METHODS
    other_version = line[-1].startswith(b"HTTP/") and not line[-1].startswith(b"HTTP/1.")
    assert status < 500 or (status == 501 and unknown_method) or (status == 505 and other_version), \
        f"a {status}: {response[:600]!r}"
    head, _, body = response.partition(b"\r\n\r\n")
    if status == 200 and b"text/event-stream" in head:
        _, _, errors = stream_text(body)
        assert not errors, f"a 200 stream carried an error event (refuse before the first byte): {errors}"
        assert b"data: [DONE]" in body, "a 200 stream did not end with [DONE]"


CASES = st.one_of(JSON_REQUESTS.map(lambda r: RawRequest(post(r[0], to_json(r[1]).encode()), True)), RAW_REQUESTS)


def fuzz(server: Any, max_examples: int) -> None:
    srv, port = server
    victim = victim_alone(port)
    finish = victim.start()

    @settings(max_examples=max_examples, derandomize=True, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(CASES)
    def one_request(request: RawRequest) -> None:
        check_response(request, exchange(port, request.data))

    try:
        start = time.monotonic()
        one_request()
        print(f"fuzzed {max_examples} examples in {time.monotonic() - start:.1f} s; the victim ran {victim.runs} "
              "times")
    finally:
        finish()
    assert victim.runs >= 1 and victim.failures == [], victim.failures[:5]
    assert srv.worker.thread.is_alive()
    still_serves(port)


def test_fuzzed_requests_never_touch_another_stream(server):
    fuzz(server, 100)  # the default tier; 3,000 in the slow one


@pytest.mark.slow
def test_fuzzed_requests_never_touch_another_stream_many(server):
    fuzz(server, 3000)
