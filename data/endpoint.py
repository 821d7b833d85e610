"""Regeneration through an OpenAI-compatible server: vLLM, SGLang, tpu-inference or `dflash serve`, the fleets users
already run (docs/design.md §6), instead of the engine in this process.

    backend = connect(cfg.regen, tokenizer, target_source=recipe.target.source)   # checks the server first
    stats = regenerate(backend, tokenizer, items, "data/regenerated.jsonl", cfg.regen)

The output file, its meta and its resume by item id are `data.regenerate`'s: only where the turns are answered
changes. Each turn is one `POST /v1/chat/completions` (not streamed) with the conversation so far, the recipe's
sampling rule, `max_tokens` and the turn's seed (`request_seed`), and the template variables as
`chat_template_kwargs`; up to `concurrency` are in flight.

Checks, so that a server of another model or tokenizer is refused instead of writing a dataset the drafter
cannot use (`check_server`, on unless `endpoint.check` is false):
- the model sent (`endpoint.model`, default the recipe's `target.source`) must be one `/v1/models` lists;
- a probe conversation's prompt must count as many tokens on the server (`usage.prompt_tokens`) as the recipe's
  tokenizer and chat template give it, and the probe's reply must survive a round trip through the recipe's
  tokenizer (decode(encode(text)) == text).
Every reply is re-tokenised with the recipe's tokenizer: a text that does not round-trip is the item's error
("mismatch"); a token count other than the server's `usage.completion_tokens` (the stop token aside) is counted
(`RegenStats.retokenized_differs`) and kept, since training reads the text. A reply split into
`reasoning_content` (a server started with a reasoning parser) stops the run: the text must be the whole reply.

Failures: a connection error, a timeout, a 429 or a 5xx is retried `retries` times with exponential backoff;
then the run stops with the error (a rerun resumes by item id, losing nothing written). A 400 is that item's
error ("server"); 401, 403 and 404 stop the run. The protocol parts (`chat_body`, `parse_reply`) are pure
functions; `Transport` only moves bytes.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import http.client
import json
import logging
import os
import random
import ssl
import time
import urllib.parse
from collections.abc import Hashable, Mapping
from typing import Any

from dflash.configs.schema import ConfigError
from dflash.data.config import EndpointConfig, RegenConfig
from dflash.data.regenerate import ItemError, Reply

log = logging.getLogger(__name__)

# Digits, accents, CJK, an emoji, code and whitespace: tokenizers of other families split these differently.
PROBE = ("Probe 1: count 12345 and 6789, café naïve Ωμέγα, 世界 ✓ 🚀\n```python\ndef f(x):\n\treturn {x: [1, 2]}\n```"
         "  Reply with one word.")
MAX_BACKOFF_S = 60.0
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
FATAL_STATUS = frozenset({401, 403, 404})


class EndpointError(RuntimeError):
    """The server cannot be used (refused at the check, unreachable after the retries, or answering wrongly);
    the run stops and a rerun resumes it."""


class _Retryable(Exception):
    """A failure worth another try (connection, timeout, 429, 5xx)."""


def base_url(url: str) -> str:
    """The OpenAI base (…/v1) of `url`: http://h:8000, http://h:8000/ and http://h:8000/v1 all give http://h:8000/v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def api_key(cfg: EndpointConfig) -> str | None:
    """The key in the environment variable `cfg.api_key_env` names (None without one); an unset variable is an
    error naming it (the key itself is never printed)."""
    if not cfg.api_key_env:
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise ConfigError(f"data.regen.endpoint.api_key_env names an environment variable that must hold the API "
                          f"key; received {cfg.api_key_env!r}, which is unset or empty here")
    return key


def chat_body(model: str, messages: list[dict[str, str]], cfg: RegenConfig, seed: int,
              max_tokens: int | None = None) -> dict[str, Any]:
    """The /v1/chat/completions body of one turn: the recipe's whole sampling rule (top_k -1 = off, as vLLM, SGLang
    and `dflash serve` read it: a server's own defaults, e.g. a generation_config's top_k, must not apply), the
    turn's seed, and the template variables as `chat_template_kwargs` (sent only when set)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens or cfg.max_new_tokens,
                            "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or -1,
                            "seed": seed, "stream": False}
    if cfg.template_kwargs:
        body["chat_template_kwargs"] = dict(cfg.template_kwargs)
    return body


def parse_reply(body: Any) -> tuple[str, int, str, int | None]:
    """(text, completion tokens, finish reason, prompt tokens or None) of a chat completion; EndpointError when
    the body is not one, or when the reply was split into `reasoning_content`."""
    try:
        choice = body["choices"][0]
        message = choice["message"]
        text = message.get("content") or ""
        reason = choice.get("finish_reason")
        usage = body.get("usage") or {}
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise EndpointError(f"the server's answer must be a chat completion with choices[0].message; received "
                            f"{json.dumps(body)[:300]}") from err
    if message.get("reasoning_content") or message.get("reasoning"):
        raise EndpointError("the server returned the reply split into reasoning_content and content (it runs a "
                            "reasoning parser); start it without --reasoning-parser so that the text is the whole "
                            "reply the target wrote")
    if not isinstance(text, str):
        raise EndpointError(f"choices[0].message.content must be a string; received {text!r:.200}")
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int):
        raise EndpointError(f"the server must report usage.completion_tokens (an integer); received {usage!r:.200}")
    prompt = usage.get("prompt_tokens")
    return text, tokens, str(reason), prompt if isinstance(prompt, int) else None


class Transport:
    """JSON over HTTP(S) to one server: GET and POST with retries and exponential backoff."""

    def __init__(self, url: str, *, key: str | None = None, timeout_s: float = 600.0, retries: int = 5,
                 backoff_s: float = 1.0):
        self.base = base_url(url)
        parts = urllib.parse.urlsplit(self.base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"data.regen.endpoint.url must be an http(s):// base URL; received {url!r}")
        self.https, self.host, self.port = parts.scheme == "https", parts.hostname, parts.port
        self.prefix = parts.path
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def _once(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn_cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        kwargs: dict[str, Any] = {"context": ssl.create_default_context()} if self.https else {}
        conn = conn_cls(self.host, self.port, timeout=self.timeout_s, **kwargs)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, self.prefix + path, body=data, headers=self.headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as err:  # timeouts are OSErrors
            raise _Retryable(f"{method} {self.base}{path}: {type(err).__name__}: {err}") from err
        finally:
            conn.close()
        if response.status in RETRY_STATUS:
            raise _Retryable(f"{method} {self.base}{path} answered {response.status}: {raw[:300]!r}")
        try:
            return response.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return response.status, raw.decode("utf-8", "replace")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, JSON body) of the first try that is not retryable; EndpointError after `retries` retries."""
        for attempt in range(self.retries + 1):
            try:
                return self._once(method, path, body)
            except _Retryable as err:
                if attempt == self.retries:
                    raise EndpointError(f"{err} (after {self.retries} retries); the run stops here: rerun it to "
                                        "resume where it stopped") from err
                wait = min(MAX_BACKOFF_S, self.backoff_s * 2**attempt) * (0.5 + random.random() / 2)
                log.warning("%s; retry %d of %d in %.1f s", err, attempt + 1, self.retries, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")


def served_models(transport: Transport) -> list[str]:
    """The ids /v1/models lists."""
    status, body = transport.request("GET", "/models")
    if status != 200 or not isinstance(body, Mapping) or not isinstance(body.get("data"), list):
        raise EndpointError(f"GET {transport.base}/models must answer 200 with a model list; received {status}: "
                            f"{str(body)[:300]}")
    return [str(m.get("id")) for m in body["data"] if isinstance(m, Mapping)]


def check_server(transport: Transport, model: str, tokenizer: Any, cfg: RegenConfig, target_source: str) -> None:
    """Refuse a server that does not serve `model` or whose tokenizer or chat template is not the recipe's
    (the module docstring says how); log what was checked."""
    ids = served_models(transport)
    if model not in ids:
        raise EndpointError(f"data.regen.endpoint.model must be a model the server at {transport.base} serves "
                            f"({ids}); received {model!r} (default: the recipe's target.source {target_source!r}; "
                            "vLLM and SGLang serve the HF id, or --served-model-name)")
    messages = [{"role": "user", "content": PROBE}]
    ours = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          **cfg.template_kwargs))
    status, body = transport.request("POST", "/chat/completions",
                                     chat_body(model, messages, dataclasses.replace(cfg, temperature=0.0), 0, 8))
    if status != 200:
        raise EndpointError(f"the probe request to {transport.base}/chat/completions must succeed; received {status}: "
                            f"{str(body)[:300]}")
    text, _, _, prompt_tokens = parse_reply(body)
    fingerprint = getattr(tokenizer, "fingerprint", lambda: "?")()[:12]
    if prompt_tokens != len(ours):
        raise EndpointError(
            f"the server at {transport.base} (model {model!r}) does not tokenise like the recipe's target "
            f"{target_source!r}: the probe prompt is {prompt_tokens} tokens there and {len(ours)} with the recipe's "
            f"tokenizer and chat template (fingerprint {fingerprint}); serve the recipe's target with its own chat "
            "template (and the same data.regen.template_kwargs), or set data.regen.endpoint.check=false to skip "
            "this check")
    if tokenizer.decode(tokenizer.encode(text)) != text:
        raise EndpointError(f"the server's probe reply {text[:80]!r} does not round-trip through the recipe's "
                            f"tokenizer (fingerprint {fingerprint}): its model is not the recipe's target "
                            f"{target_source!r}")
    log.info("endpoint %s serves %r; probe prompt %d tokens on both sides (tokenizer %s)", transport.base, model,
             len(ours), fingerprint)


class EndpointBackend:
    """Turns through an OpenAI-compatible server, `concurrency` at a time (a `data.regenerate.Backend`)."""

    def __init__(self, transport: Transport, model: str, tokenizer: Any, cfg: RegenConfig):
        self.transport, self.model, self.tok, self.cfg = transport, model, tokenizer, cfg
        self.capacity = cfg.endpoint.concurrency
        self.pool = futures.ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="regen-endpoint")
        self.pending: dict[futures.Future, int] = {}
        self._next = 0

    def submit(self, messages: list[dict[str, str]], prompt_ids: list[int], seed: int, turn: int) -> Hashable:
        # the same bound as the engine in process (AR: one position of the context is the last step's), so that
        # the same conversations are cut whichever way they are answered
        room = self.cfg.max_len - len(prompt_ids) - 1
        if self.cfg.max_new_tokens > room:
            raise ItemError("too_long", f"the prompt ({len(prompt_ids)} tokens) plus max_new_tokens "
                                        f"({self.cfg.max_new_tokens}) must fit data.regen.max_len ({self.cfg.max_len})",
                            turn)
        handle = self._next
        self._next += 1
        body = chat_body(self.model, messages, self.cfg, seed)
        self.pending[self.pool.submit(self._ask, body, turn)] = handle
        return handle

    def _ask(self, body: dict[str, Any], turn: int) -> Reply | ItemError:
        status, answer = self.transport.request("POST", "/chat/completions", body)
        if status in FATAL_STATUS:
            raise EndpointError(f"POST {self.transport.base}/chat/completions answered {status}: {str(answer)[:300]}")
        if status != 200:
            return ItemError("server", f"the server answered {status}: {str(answer)[:300]}", turn)
        text, tokens, reason, _ = parse_reply(answer)
        if reason not in ("stop", "length"):
            raise EndpointError(f"the server ended a reply with finish_reason {reason!r}; expected 'stop' or "
                                "'length' (the server may have aborted it: rerun to resume)")
        ids = self.tok.encode(text)
        if self.tok.decode(ids) != text:
            return ItemError("mismatch", f"the reply does not round-trip through the recipe's tokenizer: "
                                         f"{text[:120]!r}", turn)
        same = tokens == len(ids) or (reason == "stop" and tokens == len(ids) + 1)
        return Reply(text, tokens, reason, retokenized_same=same)

    def poll(self) -> list[tuple[Hashable, Reply | ItemError]]:
        if not self.pending:
            return []
        finished, _ = futures.wait(list(self.pending), return_when=futures.FIRST_COMPLETED)
        out: list[tuple[Hashable, Reply | ItemError]] = []
        for future in finished:
            handle = self.pending.pop(future)
            try:
                out.append((handle, future.result()))
            except BaseException:
                self.close()
                raise
        return out

    def close(self) -> None:
        for future in self.pending:
            future.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def connect(cfg: RegenConfig, tokenizer: Any, *, target_source: str) -> EndpointBackend:
    """The backend for `cfg.endpoint`, after `check_server` (unless `endpoint.check` is false)."""
    endpoint = cfg.endpoint
    transport = Transport(endpoint.url, key=api_key(endpoint))
    model = endpoint.model or target_source
    if endpoint.check:
        check_server(transport, model, tokenizer, cfg, target_source)
    else:
        log.warning("data.regen.endpoint.check is false: the server's model and tokenizer are not checked")
    return EndpointBackend(transport, model, tokenizer, cfg)


__all__ = ["EndpointBackend", "EndpointError", "PROBE", "Transport", "api_key", "base_url", "chat_body",
           "check_server", "connect", "parse_reply", "served_models"]
