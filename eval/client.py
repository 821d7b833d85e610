"""A small OpenAI-compatible chat client for `dflash serve`, vLLM and SGLang: one request (streamed unless the engine
needs otherwise, `eval.engines`), timed on the client side."""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.parse
from typing import Any


class ServerError(RuntimeError):
    """The server answered with an error or could not be reached."""


@dataclasses.dataclass
class Reply:
    """One chat reply: text, token count, times (client-side), and the server's DFlash statistics (`accepted`:
    drafts accepted per verify step; empty for an AR server or another engine); `meta`: SGLang's per-request
    `meta_info` when asked for; `timing`: how first_s / last_s were measured (`stream`: the first and last streamed
    content; `server`: an unstreamed reply's decode span from the server's stamps, ending when the reply arrived;
    `latency`: an unstreamed reply without them, first_s = sent_s, so TPOT includes the prefill)."""

    text: str
    tokens: int
    finish_reason: str | None
    sent_s: float
    first_s: float
    last_s: float
    accepted: list[int]
    meta: dict[str, Any] | None = None
    timing: str = "stream"

    @property
    def latency_s(self) -> float:
        return self.last_s - self.sent_s

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None with fewer than two tokens)."""
        return (self.last_s - self.first_s) / (self.tokens - 1) if self.tokens > 1 else None


class Client:
    """Requests to one server (`url` like http://127.0.0.1:8000); greedy chat completions, streamed."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"url must look like http://HOST:PORT; received {url!r}")
        self.host, self.port, self.timeout = parsed.hostname, parsed.port or 80, timeout
        self.prefix = parsed.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.url = f"http://{self.host}:{self.port}{self.prefix}"
        self.stream = True  # how chat requests go (set by eval.engines for the engine serving the URL)
        self.extra_body: dict[str, Any] = {}
        self.sent = 0  # chat requests sent so far (a counter engine's reads wait until the server counted them)
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _get_bytes(self, path: str) -> bytes:
        """The body of a 200 answer to GET `path`; a ServerError otherwise."""
        conn = self._conn()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
        except OSError as err:
            raise ServerError(f"{self.url}{path} could not be reached ({err})") from err
        finally:
            conn.close()
        if response.status != 200:
            raise ServerError(f"GET {self.url}{path} answered {response.status}: {body[:300]!r}")
        return body

    def get(self, path: str) -> Any:
        return json.loads(self._get_bytes(path))

    def text(self, path: str) -> str:
        """GET `path` as text (e.g. /metrics)."""
        return self._get_bytes(path).decode("utf-8", errors="replace")

    def compiles(self) -> int | None:
        """The programs the server's engine compiled so far (`dflash_compiles_total` at /metrics); None when the
        server does not report it (another engine, or no /metrics)."""
        try:
            text = self.text("/metrics")
        except ServerError:
            return None
        for line in text.splitlines():
            if line.startswith("dflash_compiles_total "):
                return int(float(line.split()[1]))
        return None

    def model(self) -> str:
        """The id of the served model (`GET /v1/models`)."""
        return self.get("/v1/models")["data"][0]["id"]

    def chat(self, model: str, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, template_kwargs: dict[str, Any] | None = None) -> Reply:
        """One chat completion (streamed unless `self.stream` is False; with `self.extra_body`'s fields): greedy, or
        sampled at `temperature` (> 0) with `top_p` and `seed`; `template_kwargs`: the chat template's variables
        (`chat_template_kwargs`, which dflash serve, vLLM and SGLang read)."""
        sampled = {"top_p": top_p, **({"seed": seed} if seed is not None else {})} if temperature > 0 else {}
        if template_kwargs:
            sampled["chat_template_kwargs"] = template_kwargs
        extra = {k: v for k, v in self.extra_body.items() if self.stream or k != "stream_options"}
        body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": temperature, **sampled, **extra, "stream": self.stream})
        conn = self._conn()
        with self._lock:
            self.sent += 1
        sent = time.perf_counter()
        try:
            conn.request("POST", self.prefix + "/v1/chat/completions", body=body, headers=self.headers)
            response = conn.getresponse()
            if response.status != 200:
                raise ServerError(f"POST {self.url}/v1/chat/completions answered {response.status}: "
                                  f"{response.read()[:300]!r}")
            return _read_stream(response, sent) if self.stream else _read_whole(response.read(), sent)
        except OSError as err:
            raise ServerError(f"{self.url} failed mid-request ({err})") from err
        finally:
            conn.close()


def _read_stream(response: http.client.HTTPResponse, sent: float) -> Reply:
    parts: list[str] = []
    first = last = None
    finish, tokens, accepted = None, 0, []
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise ServerError(f"the server failed the request: {event['error']}")
        for choice in event.get("choices", []):
            content = (choice.get("delta") or {}).get("content") or ""
            if content:
                now = time.perf_counter()
                first = first or now
                last = now
                parts.append(content)
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
        if event.get("dflash"):
            accepted = list(event["dflash"].get("accepted_per_step") or [])
    end = time.perf_counter()
    return Reply("".join(parts), tokens, finish, sent, first or end, last or end, accepted)


def _read_whole(data: bytes, sent: float) -> Reply:
    """An unstreamed reply: its first choice, usage, `dflash` object and SGLang `meta_info`; times from the server's
    stamps when the meta_info has them (see `Reply.timing`)."""
    end = time.perf_counter()
    try:
        body = json.loads(data)
        if isinstance(body, dict) and "error" in body:
            raise ServerError(f"the server failed the request: {body['error']}")
        choice = body["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ServerError(f"the server's reply is not a chat completion ({err}): {data[:300]!r}") from err
    meta = choice.get("meta_info") or body.get("meta_info")
    tokens = int((body.get("usage") or {}).get("completion_tokens") or (meta or {}).get("completion_tokens") or 0)
    accepted = list((body.get("dflash") or {}).get("accepted_per_step") or [])
    first, timing = sent, "latency"
    stamps = (meta or {}).get("prefill_finished_ts"), (meta or {}).get("decode_finished_ts")
    if all(isinstance(t, (int, float)) for t in stamps) and stamps[1] >= stamps[0]:
        first, timing = max(sent, end - (stamps[1] - stamps[0])), "server"
    text = (choice.get("message") or {}).get("content") or ""
    return Reply(text, tokens, choice.get("finish_reason"), sent, first, end, accepted, meta, timing)


__all__ = ["Client", "Reply", "ServerError"]
