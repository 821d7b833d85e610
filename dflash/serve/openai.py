"""The OpenAI API as pure functions: request bodies in, engine inputs and response bodies out (no sockets).

    body = parse_json(raw)                                    # a RequestError (a 4xx) names what is wrong
    ignored = check_fields(COMPLETIONS, body, config)         # the field policy; unknown names to warn about
    request = parse_request(COMPLETIONS, body, tokenizer, config)   # -> GenerationRequest
    ... the engine generates `ids` ...
    text, reason = final_text(tokenizer, ids, request.stop, completion)
    response_body(request, rid, created, text, reason, len(ids), completion)

Streaming: `TextStream` turns new token ids into new text; `chunk`, `final_chunk`, `usage_chunk` and
`stream_error` are the server-sent events' payloads. The transport (`serve.http`) moves the bytes.
Design: docs/decisions.md D14, D40.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash.models.tokenizer import ChatTokenizer
from dflash.serve.config import SamplingConfig

if TYPE_CHECKING:
    from dflash.serve.engine import Completion


class RequestError(ValueError):
    """A client error: HTTP status, message, and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


# ---------------------------------------------------------------------------------------------- field policy

COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "stop",
                               "seed", "n", "user"})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                         "stream", "stop", "seed", "n", "user", "chat_template_kwargs"})


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
_COMPLETION_OPENAI = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "echo", "best_of",
                                "suffix", "stream_options"})
_CHAT_OPENAI = frozenset(_NEUTRAL) - {"echo", "best_of", "suffix"}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One generation route: the fields it takes and the names its responses use.

    fields: this server's request fields; openai_fields: the documented OpenAI fields it accepts at their
    neutral values (`_NEUTRAL`); prompt_param: the field an error of the engine about the prompt names."""

    chat: bool
    fields: frozenset[str]
    openai_fields: frozenset[str]
    object: str
    chunk_object: str
    id_prefix: str
    prompt_param: str


COMPLETIONS = Endpoint(False, COMPLETION_FIELDS, _COMPLETION_OPENAI, "text_completion", "text_completion", "cmpl",
                       "prompt")
CHAT = Endpoint(True, CHAT_FIELDS, _CHAT_OPENAI, "chat.completion", "chat.completion.chunk", "chatcmpl", "messages")
ENDPOINTS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


@dataclasses.dataclass(frozen=True)
class ProtocolConfig:
    """What the server decides for its requests: the model id it serves, the defaults of the fields a request
    leaves out (max_tokens; temperature / top_p / top_k from `sampling`), and unknown_fields: "reject" (a 400)
    or "ignore" for fields that are neither this server's nor documented OpenAI ones."""

    model_name: str
    max_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    unknown_fields: str = "reject"

    def __post_init__(self) -> None:
        if self.unknown_fields not in ("reject", "ignore"):
            raise ValueError(f"unknown_fields must be 'reject' or 'ignore'; received {self.unknown_fields!r}")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is not one)."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body must be JSON; {err}") from err
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def check_fields(endpoint: Endpoint, body: dict[str, Any], config: ProtocolConfig) -> list[str]:
    """The field policy, before any field is read: a documented OpenAI field this server has no feature for
    is accepted at its neutral value and refused otherwise (400 naming the field); an unknown field is a 400
    under `unknown_fields="reject"`; `model`, when given, must be the served one (404). Returns the unknown
    field names accepted under "ignore" (sorted), for the transport to warn about."""
    for name in sorted(endpoint.openai_fields & set(body)):
        rule = _NEUTRAL[name]
        if rule is not None and not rule[0](body[name]):
            raise RequestError(f"{name} {rule[1]}; received {body[name]!r}", name)
    unknown = sorted(set(body) - endpoint.fields - endpoint.openai_fields)
    if unknown and config.unknown_fields == "reject":
        raise RequestError(f"unknown field(s) {unknown}; this endpoint takes {sorted(endpoint.fields)}", unknown[0])
    model = body.get("model", config.model_name)
    if model != config.model_name:
        raise RequestError(f"model {model!r} does not exist; this server serves {config.model_name!r}", "model",
                           status=404)
    return unknown


# ---------------------------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One parsed request: what the engine needs (prompt_ids, max_tokens, seed, stop, sampling) and how to
    answer (endpoint, model, stream, include_usage: a last stream chunk with the usage)."""

    endpoint: Endpoint
    model: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    stop: tuple[str, ...]
    sampling: SamplingConfig
    stream: bool = False
    include_usage: bool = False


def parse_request(endpoint: Endpoint, body: dict[str, Any], tokenizer: ChatTokenizer,
                  config: ProtocolConfig) -> GenerationRequest:
    """`body` (which passed `check_fields`) as engine inputs: the prompt tokenized (`prompt` for completions,
    `messages` through the chat template for chat), then max_tokens, n, stop, seed, stream, then sampling;
    the first field that breaks its rule is a 400 naming it."""
    ids = _chat_prompt(body, tokenizer) if endpoint.chat else _completion_prompt(body, tokenizer)
    max_tokens = _max_tokens(body, config)
    _check_n(body)
    stop = _stop(body)
    seed = _seed(body)
    stream = bool(body.get("stream", False))
    include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
    return GenerationRequest(endpoint, config.model_name, tuple(ids), max_tokens, seed, stop,
                             _sampling(body, config.sampling), stream, include_usage)


def _completion_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt")


def _chat_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise RequestError("messages must be a non-empty list of {role, content} strings", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise RequestError("chat_template_kwargs must be an object of template variables, e.g. "
                           '{"enable_thinking": false}', "chat_template_kwargs")
    return tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs)


def _max_tokens(body: dict[str, Any], config: ProtocolConfig) -> int:
    """`max_completion_tokens`, else `max_tokens`, else the server's default."""
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                      config.max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise RequestError(f"max_tokens must be a positive integer; received {max_tokens!r}", "max_tokens")
    return max_tokens


def _check_n(body: dict[str, Any]) -> None:
    """One choice per request: `n` must be 1 (or absent)."""
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise RequestError("n must be 1", "n")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    """`stop`: a string or a list of them; the engine ends the request (freeing its slot) at the token that
    completes one, and the text is cut before it (`final_text`, `TextStream`)."""
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    return stop


def _seed(body: dict[str, Any]) -> int:
    seed = body.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise RequestError(f"seed must be a non-negative integer; received {seed!r}", "seed")
    return seed


def _sampling(body: dict[str, Any], default: SamplingConfig) -> SamplingConfig:
    """The request's rule: its temperature / top_p / top_k, the server's default (the recipe's `sampling:`)
    for the ones it leaves out. temperature 0 = greedy; top_k is an extension, as in vLLM (0 or -1 = off).
    Rules are per request inside one engine step (`serve.sampling.SamplingRows`), so a greedy and a sampled
    request share a batch without affecting each other."""

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


# ---------------------------------------------------------------------------------------------- text


def _visible_text(tokenizer: ChatTokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode([t for t in ids if t not in tokenizer.stop_token_ids])


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the earliest stop string in it, and whether one was found."""
    cuts = [text.index(s) for s in stop if s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


def _engine_reason(completion: Completion | None) -> str:
    return completion.finish_reason if completion and completion.finish_reason else "length"


def final_text(tokenizer: ChatTokenizer, generated: Sequence[int], stop: tuple[str, ...],
               completion: Completion | None) -> tuple[str, str]:
    """(text, finish_reason) of a whole reply: the generated ids decoded without stop tokens and cut before
    the earliest stop string ("stop"), else the engine's finish reason ("length" when it gave none)."""
    text, hit = _cut_at_stop(_visible_text(tokenizer, generated), stop)
    return (text, "stop") if hit else (text, _engine_reason(completion))


class TextStream:
    """A streamed reply's text, grown by the ids the engine publishes: `feed` returns the text not sent yet.

    Text is held back while it ends in an incomplete UTF-8 character; once a stop string appears the text is
    cut before it, `reason` becomes "stop", and later ids are neither kept nor decoded. `generated`: the ids
    kept (the usage's completion tokens)."""

    def __init__(self, tokenizer: ChatTokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.generated: list[int] = []
        self.sent = ""
        self.reason: str | None = None

    def feed(self, ids: Sequence[int]) -> str:
        if self.reason is not None:
            return ""  # a stop string ended the text; the rest is drained unread
        self.generated += ids
        text, hit = _cut_at_stop(_visible_text(self.tokenizer, self.generated), self.stop)
        if hit:
            self.reason = "stop"
        elif text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the rest
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def finish_reason(self, completion: Completion | None) -> str:
        """"stop" after a stop string, else the engine's reason ("length" when it gave none)."""
        return self.reason or _engine_reason(completion)


# ---------------------------------------------------------------------------------------------- responses


def response_id(endpoint: Endpoint, key: int) -> str:
    """The id of a response (`cmpl-…` or `chatcmpl-…`) from a number unique among live requests."""
    return f"{endpoint.id_prefix}-{key:x}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def dflash_stats(completion: Completion | None) -> dict[str, Any]:
    """The `dflash` object of a response: τ, verify steps and drafts accepted per step (DFlash only)."""
    if completion is None or not completion.accepted:
        return {"tau": None, "steps": 0}
    return {"tau": completion.tau, "steps": len(completion.accepted), "accepted_per_step": completion.accepted}


def response_body(request: GenerationRequest, rid: str, created: int, text: str, finish_reason: str,
                  completion_tokens: int, completion: Completion | None) -> dict[str, Any]:
    """A whole (non-streamed) reply: `text_completion` or `chat.completion`, with `usage` and `dflash`."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if request.endpoint.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": request.endpoint.object, "created": created, "model": request.model,
            "choices": [choice], "usage": usage(len(request.prompt_ids), completion_tokens),
            "dflash": dflash_stats(completion)}


def chunk(request: GenerationRequest, rid: str, created: int, delta: str, finish_reason: str | None = None,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stream event's payload with new text `delta` (chat: a `delta` object, empty on the finishing
    chunk; completions: `text`); with include_usage every chunk has `"usage": null`; `extra` is merged last."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if request.endpoint.chat:
        choice["delta"] = {"content": delta} if delta or finish_reason is None else {}
    else:
        choice["text"] = delta
    return {"id": rid, "object": request.endpoint.chunk_object, "created": created, "model": request.model,
            "choices": [choice], **({"usage": None} if request.include_usage else {}), **(extra or {})}


def final_chunk(request: GenerationRequest, rid: str, created: int, finish_reason: str, completion_tokens: int,
                completion: Completion | None) -> dict[str, Any]:
    """The finishing chunk: the finish reason and `dflash`, and `usage` unless include_usage moves it to
    `usage_chunk`."""
    stats = dflash_stats(completion)
    extra = ({"dflash": stats} if request.include_usage else
             {"usage": usage(len(request.prompt_ids), completion_tokens), "dflash": stats})
    return chunk(request, rid, created, "", finish_reason, extra)


def usage_chunk(request: GenerationRequest, rid: str, created: int, completion_tokens: int) -> dict[str, Any]:
    """With `stream_options.include_usage`, as in OpenAI's API: a last chunk with empty `choices` and the usage."""
    return {"id": rid, "object": request.endpoint.chunk_object, "created": created, "model": request.model,
            "choices": [], "usage": usage(len(request.prompt_ids), completion_tokens)}


def stream_error(message: str) -> dict[str, Any]:
    """The event that ends a stream whose request failed after the 200 was sent."""
    return {"error": {"message": message}}


def error_body(err: RequestError) -> dict[str, Any]:
    """An error response: `{"error": {"message", "type", "param", "code"}}`, the type from the status."""
    kind = {401: "authentication_error"}.get(err.status, "invalid_request_error" if err.status < 500
                                             else "server_error")
    return {"error": {"message": str(err), "type": kind, "param": err.param, "code": None}}


def models_body(model: str, created: int, block_size: int, drafter: str | None) -> dict[str, Any]:
    """GET /v1/models: the one served model, with the engine's block size and drafter fingerprint."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "dflash",
                                        "block_size": block_size, "drafter": drafter}]}


__all__ = ["CHAT", "COMPLETIONS", "ENDPOINTS", "Endpoint", "GenerationRequest", "ProtocolConfig", "RequestError",
           "TextStream", "check_fields", "chunk", "dflash_stats", "error_body", "final_chunk", "final_text",
           "models_body", "parse_json", "parse_request", "response_body", "response_id", "stream_error", "usage",
           "usage_chunk"]
