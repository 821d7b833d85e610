"""The OpenAI API as pure functions: request bodies in, engine inputs and response bodies out (no sockets).

    body = parse_json(raw)                                    # a RequestError (a 4xx) names what is wrong
    ignored = check_fields(COMPLETIONS, body, config)         # the field policy; unknown names to warn about
    request = parse_request(COMPLETIONS, body, tokenizer, config)   # -> GenerationRequest
    for c in request.choices: worker.submit(c.prompt_ids, request.submit_max_tokens, seed=c.seed, ...)
    ... except RequestRejected as err: raise rejected(request, err, c)          # the engine's refusal, in API terms
    response_body(request, rid, created, [job.request, ...], tokenizer)         # one Completion per choice

Streaming: `role_chunk`, `echo_chunk`, `chunk`, `final_chunk`, `usage_chunk` and `stream_error` are the
server-sent events' payloads, built from the worker's `JobUpdate`s (their `text_delta` is text the engine
calls stable: stop strings are the engine's, so streamed and whole answers are equal). The transport
(`serve.http`) moves the bytes. Design: docs/decisions.md D14, D40.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dflash.models.tokenizer import ChatTokenizer
from dflash.serve.config import TEMPERATURE_RULE, SamplingConfig, temperature_ok

if TYPE_CHECKING:
    from dflash.serve.engine import Completion

MAX_DEPTH = 64  # nesting of the JSON body
MAX_N = 128  # choices per prompt
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
INT32 = 2**31  # token ids, top_k and max_tokens are int32 on the device
SEEDS = 2**63
LOGPROB_FLOOR = -9999.0  # -inf (a token the model rules out) as JSON can carry it, as vLLM does


class RequestError(ValueError):
    """A client error: HTTP status, message, and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status
        self.counted = False  # already counted in the metrics (the worker's own refusals)


# ---------------------------------------------------------------------------------------------- field policy

COMPLETION_FIELDS = frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stream", "stop",
                               "seed", "n", "user", "logprobs", "echo", "stream_options", "ignore_eos"})
CHAT_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                         "stream", "stop", "seed", "n", "user", "chat_template_kwargs", "logprobs", "top_logprobs",
                         "stream_options", "ignore_eos"})
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # the chat roles OpenAI's API takes
TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt"})  # what `chat_template_kwargs` may not set
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats", "include_obfuscation"})


def _is_zero(v: Any) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v == 0)


def _is_empty(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


def _is_text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


# Documented OpenAI fields with no feature behind them here: (accepts the value, what is supported). A
# neutral value (the API's default) is accepted and ignored; any other value is a 400 naming the field. None
# as the test: any value is accepted and ignored (bookkeeping and hints that do not change the output).
_NEUTRAL: dict[str, tuple[Any, str] | None] = {
    "frequency_penalty": (_is_zero, "must be 0 (penalties are not supported)"),
    "presence_penalty": (_is_zero, "must be 0 (penalties are not supported)"),
    "logit_bias": (_is_empty, "must be empty (logit_bias is not supported)"),
    "best_of": (lambda v: v is None or (v == 1 and not isinstance(v, bool)), "must be 1 (one sample per choice)"),
    "suffix": (_is_empty, "must be empty or null (insertion is not supported)"),
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
_COMPLETION_OPENAI = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "best_of", "suffix"})
_CHAT_OPENAI = frozenset(_NEUTRAL) - {"best_of", "suffix"}


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
    leaves out (max_tokens: None = until a stop or the end of the context; temperature / top_p / top_k from
    `sampling`), and unknown_fields: "reject" (a 400) or "ignore" for fields that are neither this server's
    nor documented OpenAI ones."""

    model_name: str
    max_tokens: int | None = None
    sampling: SamplingConfig = SamplingConfig()
    unknown_fields: str = "reject"

    def __post_init__(self) -> None:
        if self.unknown_fields not in ("reject", "ignore"):
            raise ValueError(f"unknown_fields must be 'reject' or 'ignore'; received {self.unknown_fields!r}")
        if self.max_tokens is not None and not 0 < self.max_tokens < INT32:
            raise ValueError(f"max_tokens must be None or an integer in [1, 2**31); received {self.max_tokens!r}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object: UTF-8, nested at most `MAX_DEPTH` deep, strictly JSON (no NaN or
    Infinity), every string (keys too) encodable as UTF-8 (no lone surrogates from `\\ud800` escapes)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"the request body must be UTF-8 JSON; byte {raw[err.start]:#04x} at position "
                           f"{err.start} is not UTF-8") from err
    try:
        body = json.loads(text or "null", parse_constant=_reject_constant)
    except RecursionError as err:
        raise RequestError(f"the request body must be JSON nested at most {MAX_DEPTH} deep; it is nested deeper "
                           "than Python's parser allows") from err
    except ValueError as err:  # JSONDecodeError, NaN / Infinity, integers of over 4300 digits
        raise RequestError(f"the request body must be JSON; {err}") from err
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    """Depth and text of every value, without recursion: the first offender is named by its path."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        value, path, depth = todo.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise RequestError(f"the request body must be JSON nested at most {MAX_DEPTH} deep; {path} is "
                                   f"nested deeper", _param(path))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key, path or "the body", is_key=True)
                child = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)
                todo.append((item, child, depth + 1))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: str, is_key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        what = f"the key {text!r} of {path}" if is_key else path
        raise RequestError(f"{what} must be text that encodes as UTF-8; received {text[err.start:err.end]!r} (a "
                           f"lone surrogate) at character {err.start}", _param(path)) from err


def _param(path: str) -> str:
    return path.split(".")[0].split("[")[0]


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
class Choice:
    """One engine job of a request: `choices[index]` of the answer, from prompt `prompt` with `seed`."""

    index: int
    prompt: int
    prompt_ids: tuple[int, ...]
    seed: int


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One parsed request: what the engine needs (prompts, max_tokens, seed, stop, sampling, logprobs) and
    how to answer (endpoint, model, n, echo, stream, include_usage: a last stream chunk with the usage,
    continuous_usage: usage on every chunk).

    prompts: one or more token-id prompts (`prompt` as a list); prompt_texts: their text when sent as text
    (None: sent as ids; echo decodes them); seed: the client's, or for a request without one (or `null`)
    fresh entropy (`draw_seed`), reported in the response (`dflash.seed`, the `X-DFlash-Seed` header) so the
    reply can be reproduced; seeded: whether the client sent it; max_tokens None: until a stop or the end of the
    context; 0: no generation (completions with echo: the prompt's log-probabilities only); logprobs: alternatives
    per token (completions `logprobs`, chat `top_logprobs`), None when not asked; ignore_eos: the stop tokens do
    not end the request (vLLM's extension: a fixed output length, as load generators ask)."""

    endpoint: Endpoint
    model: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int | None
    seed: int
    stop: tuple[str, ...]
    sampling: SamplingConfig
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: int | None = None
    echo: bool = False
    prompt_texts: tuple[str | None, ...] = ()
    seeded: bool = True
    ignore_eos: bool = False

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        """The first (for most requests: the only) prompt."""
        return self.prompts[0]

    @property
    def choices(self) -> list[Choice]:
        """The jobs, in `choices` order: n per prompt, with seeds seed, seed + 1, ... (index = prompt * n + i)."""
        return [Choice(p * self.n + i, p, ids, self.seed + i) for p, ids in enumerate(self.prompts)
                for i in range(self.n)]

    @property
    def submit_max_tokens(self) -> int | None:
        """The worker's budget: max_tokens, except 1 for max_tokens 0 (its token is generated, then dropped)."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    @property
    def prompt_logprobs(self) -> int | None:
        """Log-probabilities of the prompt: with echo and logprobs (lm-eval's loglikelihood requests)."""
        return self.logprobs if self.echo else None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def parse_request(endpoint: Endpoint, body: dict[str, Any], tokenizer: ChatTokenizer,
                  config: ProtocolConfig) -> GenerationRequest:
    """`body` (which passed `check_fields`) as engine inputs: the prompt(s) tokenized (`prompt` for
    completions, `messages` through the chat template for chat), then max_tokens, n, stop, seed, stream,
    logprobs, then sampling; the first field that breaks its rule is a 400 naming it."""
    if endpoint.chat:
        prompts, texts = (tuple(_chat_prompt(body, tokenizer)),), (None,)
    else:
        prompts, texts = _completion_prompts(body, tokenizer)
    echo = _flag(body, "echo")
    max_tokens = _max_tokens(body, config, echo)
    n = _n(body)
    stop = _stop(body)
    seed = _seed(body, n)
    stream = _flag(body, "stream")
    options = _stream_options(body)
    logprobs = _chat_logprobs(body) if endpoint.chat else _completion_logprobs(body)
    seeded = seed is not None
    ignore_eos = _flag(body, "ignore_eos")
    return GenerationRequest(endpoint, config.model_name, prompts, max_tokens,
                             draw_seed(n) if seed is None else seed, stop, _sampling(body, config.sampling), n,
                             stream, stream and options.get("include_usage", False),
                             stream and options.get("continuous_usage_stats", False), logprobs, echo, texts, seeded,
                             ignore_eos)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true, false or null; received {value!r}", name)
    return bool(value)


def _token_ids(ids: list[Any], where: str) -> tuple[int, ...]:
    if not ids:
        raise RequestError(f"{where} must hold at least one token id; received []", "prompt")
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < INT32:
            raise RequestError(f"{where}[{i}] must be a token id, an integer in [0, 2**31); received {t!r}", "prompt")
    return tuple(ids)


def _completion_prompts(body: dict[str, Any],
                        tokenizer: ChatTokenizer) -> tuple[tuple[tuple[int, ...], ...], tuple[str | None, ...]]:
    """`prompt`: a string, a list of strings, a list of token ids or a list of token-id lists."""
    prompt = body.get("prompt")
    rule = ("prompt must be a non-empty string, a list of strings, a list of token ids or a list of token-id "
            "lists")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError(f"{rule}; received {prompt!r}", "prompt")
    if any(isinstance(t, int | float) for t in prompt):  # a token list (a non-integer in it is named)
        return (_token_ids(prompt, "prompt"),), (None,)
    prompts, texts = [], []
    for i, p in enumerate(prompt):
        where = "prompt" if isinstance(body["prompt"], str) else f"prompt[{i}]"
        if isinstance(p, str):
            ids = tokenizer.encode(p)
            if not ids:
                raise RequestError(f"{where} must be a non-empty string; received {p!r}", "prompt")
            prompts.append(tuple(ids))
            texts.append(p)
        elif isinstance(p, list):
            prompts.append(_token_ids(p, where))
            texts.append(None)
        else:
            raise RequestError(f"{rule}; {where} is {p!r}", "prompt")
    return tuple(prompts), tuple(texts)


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or a non-empty list of `{"type": "text", "text": ...}` parts (joined by
    newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestError(f"{where} must be a string or a non-empty list of text parts; received {content!r}",
                           "messages")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise RequestError(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}; received "
                               f"{'type ' + repr(kind) if isinstance(part, dict) else repr(part)} (only text is "
                               "supported)", "messages")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{i}].text must be a string; received {part.get('text')!r}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_prompt(body: dict[str, Any], tokenizer: ChatTokenizer) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects; received {messages!r}",
                           "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string role and a content; received {m!r}",
                               "messages")
        if m["role"] not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {list(ROLES)}; received {m['role']!r}",
                               "messages")
        rendered.append({"role": m["role"], "content": _content(m.get("content"), f"messages[{i}].content")})
    kwargs = body.get("chat_template_kwargs") or {}
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise RequestError("chat_template_kwargs must be an object of template variables, e.g. "
                           f'{{"enable_thinking": false}}; received {kwargs!r}', "chat_template_kwargs")
    if reserved := sorted(TEMPLATE_NAMES & set(kwargs)):
        raise RequestError(f"chat_template_kwargs must not set {reserved[0]!r} (the server sets "
                           f"{sorted(TEMPLATE_NAMES)}); received keys {sorted(kwargs)}", "chat_template_kwargs")
    try:
        ids = tokenizer.encode_chat(rendered, add_generation_prompt=True, **kwargs)
    except Exception as err:  # noqa: BLE001 - the template raises what it likes (jinja errors, raise_exception)
        if kwargs and _renders(tokenizer, rendered):  # without them it renders: the variables broke it
            raise RequestError(f"chat_template_kwargs must be variables the chat template can render with; with "
                               f"{sorted(kwargs)} it failed: {_why(err)}", "chat_template_kwargs") from err
        raise RequestError(f"messages could not be rendered by the chat template: {_why(err)}", "messages") from err
    if not ids:
        raise RequestError("messages render to an empty prompt", "messages")
    return ids


def _renders(tokenizer: ChatTokenizer, messages: list[dict[str, str]]) -> bool:
    try:
        tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - any failure of the template
        return False
    return True


def _why(err: Exception) -> str:
    """A template's error as a client reads it: its message, with its kind when that says more (not a bare
    Python type name before a message)."""
    text = str(err).strip()
    return text or type(err).__name__


def _max_tokens(body: dict[str, Any], config: ProtocolConfig, echo: bool) -> int | None:
    """`max_completion_tokens`, else `max_tokens`, else the server's default (None: until a stop or the end of
    the context). 0 only with echo: the prompt is scored, nothing is generated."""
    name = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    if name is None:
        return config.max_tokens
    value = body[name]
    low = 0 if echo else 1
    if not _is_int(value) or not low <= value < INT32:
        rule = "[0, 2**31) (0 only with echo)" if echo else "[1, 2**31)"
        raise RequestError(f"{name} must be an integer in {rule}; received {value!r}", name)
    return value


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer in [1, {MAX_N}]; received {n!r}", "n")
    return n


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    """`stop`: a string or a list of non-empty strings; the engine ends the request (freeing its slot) at the
    token that completes one, and its text is cut before it."""
    stop = body.get("stop")
    if stop is None or stop == "":
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a string or a list of non-empty strings; received {stop!r}", "stop")
    return tuple(stop)


def draw_seed(n: int = 1) -> int:
    """A seed for a request that sent none: 63 bits of fresh entropy (`secrets`, the OS's), in [0, 2**63 - n] so
    that the n choices' seeds seed .. seed + n - 1 are all valid. Unseeded requests are independent, as in
    OpenAI's API; the seed is reported so that a reply can be reproduced."""
    while (seed := secrets.randbits(63)) > SEEDS - n:  # pragma: no cover - a 1 in 2**63 / n event
        pass
    return seed


def _seed(body: dict[str, Any], n: int) -> int | None:
    """The client's seed (None: it sent none, or null)."""
    seed = body.get("seed")
    if seed is None:
        return None
    if not _is_int(seed) or not 0 <= seed <= SEEDS - n:
        top = "2**63)" if n == 1 else f"2**63 - {n - 1}) (choice i uses seed + i)"
        raise RequestError(f"seed must be an integer in [0, {top}; received {seed!r}", "seed")
    return seed


def _stream_options(body: dict[str, Any]) -> dict[str, bool]:
    options = body.get("stream_options")
    if options is None:
        return {}
    if not (isinstance(options, dict) and set(options) <= STREAM_OPTIONS
            and all(isinstance(v, bool) for v in options.values())):
        raise RequestError(f"stream_options must be null or an object of booleans with keys in "
                           f"{sorted(STREAM_OPTIONS)}; received {options!r}", "stream_options")
    return options


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions `logprobs`: the number of alternatives per token, 0..5 (false / null: none)."""
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS:
        raise RequestError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] or null; received "
                           f"{value!r}", "logprobs")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat `logprobs: true` (the chosen tokens' log-probabilities) and `top_logprobs` (alternatives, 0..20)."""
    wanted, top = _flag(body, "logprobs"), body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
        raise RequestError(f"top_logprobs must be an integer in [0, {MAX_CHAT_TOP_LOGPROBS}] or null; received "
                           f"{top!r}", "top_logprobs")
    if top and not wanted:
        raise RequestError(f"top_logprobs needs logprobs: true; received top_logprobs {top} with logprobs "
                           f"{body.get('logprobs')!r}", "top_logprobs")
    return (top or 0) if wanted else None


def _sampling(body: dict[str, Any], default: SamplingConfig) -> SamplingConfig:
    """The request's rule: its temperature / top_p / top_k, the server's default (the recipe's `sampling:`)
    for the ones it leaves out. temperature 0 = greedy; top_k is an extension, as in vLLM (0 or -1 = off).
    Rules are per request inside one engine step (`serve.sampling.SamplingRows`), so a greedy and a sampled
    request share a batch without affecting each other."""

    def number(name: str, value: Any, ok: bool, expected: str) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not ok):
            raise RequestError(f"{name} must {expected}; received {value!r}", name)

    temperature, top_p, top_k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    number("temperature", temperature, isinstance(temperature, int | float) and temperature_ok(temperature),
           TEMPERATURE_RULE)
    number("top_p", top_p, isinstance(top_p, int | float) and 0 < top_p <= 1, "be a number in (0, 1]")
    if top_k is not None and (not _is_int(top_k) or not -1 <= top_k < INT32):
        raise RequestError(f"top_k must be an integer in [-1, 2**31) (0 or -1 = off); received {top_k!r}", "top_k")
    return SamplingConfig(temperature=default.temperature if temperature is None else float(temperature),
                          top_p=default.top_p if top_p is None else float(top_p),
                          top_k=default.top_k if top_k is None else max(top_k, 0))


# The engine's names of request fields (`RequestRejected.field`), in each endpoint's terms.
_ENGINE_FIELDS = {"prompt_ids": None, "max_new_tokens": "max_tokens", "seed": "seed", "stop_strings": "stop",
                  "sampling.top_k": "top_k", "sampling.top_p": "top_p", "sampling.temperature": "temperature",
                  "logprobs": "logprobs", "prompt_logprobs": "logprobs"}
_ENGINE_WORDS = [("max_new_tokens", "max_tokens"), ("stop_strings", "stop"), ("sampling.top_k", "top_k"),
                 ("sampling.top_p", "top_p"), ("sampling.temperature", "temperature")]


def rejected(request: GenerationRequest, err: Exception, choice: Choice) -> RequestError:
    """The worker's refusal of one choice (`RequestRejected`: a ValueError with `field` in engine terms) as a
    400 in the request's terms: the field the client sent and its words (max_new_tokens -> max_tokens, the
    prompt's ids -> prompt / messages), the prompt's position when the request has several."""
    field = getattr(err, "field", None)
    param = _ENGINE_FIELDS.get(field, field) or request.endpoint.prompt_param
    if param == "logprobs" and request.endpoint.chat:
        param = "top_logprobs"
    message = str(err)
    for engine_word, word in _ENGINE_WORDS:
        message = message.replace(engine_word, word)
    message = message.replace("prompt_ids", request.endpoint.prompt_param)
    if len(request.prompts) > 1:
        message = f"prompt[{choice.prompt}]: {message}"
    return RequestError(message, param)


# ---------------------------------------------------------------------------------------------- responses


def response_id(endpoint: Endpoint) -> str:
    """A new response id (`cmpl-…` or `chatcmpl-…`), unique across requests and restarts."""
    return f"{endpoint.id_prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def dflash_stats(completions: Sequence[Completion | None], seed: int | None = None) -> dict[str, Any]:
    """The `dflash` object of a response: τ, verify steps and drafts accepted per step (DFlash only), over
    all its choices, and the request's `seed` (choice i used seed + i; sent back with the same body, it
    reproduces a sampled reply)."""
    accepted = [a for c in completions if c is not None for a in c.accepted]
    stats: dict[str, Any] = {"tau": None, "steps": 0}
    if accepted:
        stats = {"tau": sum(a + 1 for a in accepted) / len(accepted), "steps": len(accepted),
                 "accepted_per_step": accepted}
    if seed is not None:
        stats["seed"] = seed
    return stats


def completion_tokens(request: GenerationRequest, completion: Completion) -> int:
    """Generated tokens a choice is charged (none for max_tokens 0, whose token is dropped)."""
    return 0 if request.max_tokens == 0 else len(completion.token_ids)


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_text(tokenizer: ChatTokenizer, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer: ChatTokenizer, ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """OpenAI's chat shape: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                        for t, lp, alts in zip(ids, logprobs, top, strict=True)]}


def completion_logprobs(tokenizer: ChatTokenizer, ids: Sequence[int], logprobs: Sequence[float | None],
                        top: Sequence[Sequence[tuple[int, float]] | None], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: `tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob} dict per
    token; None where the log-probability is None, i.e. the first prompt token) and `text_offset` (each
    token's start in the choice's text, counting from `offset`)."""
    tokens = [_token_text(tokenizer, t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _logprob(lp) for lp in logprobs],
            "top_logprobs": [None if lp is None else {_token_text(tokenizer, a): _logprob(alp) for a, alp in alts or ()}
                             for lp, alts in zip(logprobs, top, strict=True)],
            "text_offset": offsets}


def _prompt_text(request: GenerationRequest, tokenizer: ChatTokenizer, prompt: int) -> str:
    text = request.prompt_texts[prompt] if prompt < len(request.prompt_texts) else None
    return tokenizer.decode(list(request.prompts[prompt])) if text is None else text


def _choice(request: GenerationRequest, choice: Choice, completion: Completion,
            tokenizer: ChatTokenizer) -> dict[str, Any]:
    """One whole choice: its text (the prompt's first with echo), finish reason and log-probabilities."""
    generate = request.max_tokens != 0
    text = completion.text if generate else ""
    ids = list(completion.token_ids[: len(completion.token_logprobs)]) if generate else []
    logprobs: dict[str, Any] | None = None
    out: dict[str, Any] = {"index": choice.index, "finish_reason": completion.finish_reason if generate else "length"}
    if request.endpoint.chat:
        if request.logprobs is not None:
            logprobs = chat_logprobs(tokenizer, ids, completion.token_logprobs, completion.top_logprobs)
        out["message"] = {"role": "assistant", "content": text}
    else:
        head = _prompt_text(request, tokenizer, choice.prompt) if request.echo else ""
        if request.logprobs is not None:
            lps: list[float | None] = list(completion.token_logprobs[: len(ids)])
            tops: list[Any] = list(completion.top_logprobs[: len(ids)])
            if request.echo:
                ids = list(choice.prompt_ids) + ids
                lps = list(completion.prompt_logprobs) + lps
                tops = list(completion.prompt_top_logprobs) + tops
            logprobs = completion_logprobs(tokenizer, ids, lps, tops)
        out["text"] = head + text
    out["logprobs"] = logprobs
    return out


def response_body(request: GenerationRequest, rid: str, created: int, completions: Sequence[Completion],
                  tokenizer: ChatTokenizer) -> dict[str, Any]:
    """A whole (non-streamed) reply: `text_completion` or `chat.completion`, one choice per completion (in
    `request.choices` order), with `usage` (summed) and `dflash`."""
    choices = [_choice(request, c, done, tokenizer) for c, done in zip(request.choices, completions, strict=True)]
    generated = sum(completion_tokens(request, c) for c in completions)
    return {"id": rid, "object": request.endpoint.object, "created": created, "model": request.model,
            "choices": choices, "usage": usage(request.prompt_tokens, generated),
            "dflash": dflash_stats(completions, request.seed)}


def _chunk(request: GenerationRequest, rid: str, created: int, choice: dict[str, Any],
           usage_now: dict[str, int] | None) -> dict[str, Any]:
    body = {"id": rid, "object": request.endpoint.chunk_object, "created": created, "model": request.model,
            "choices": [choice]}
    if request.continuous_usage:
        body["usage"] = usage_now
    elif request.include_usage:
        body["usage"] = None
    return body


def role_chunk(request: GenerationRequest, rid: str, created: int, index: int,
               usage_now: dict[str, int] | None = None) -> dict[str, Any]:
    """A chat stream's first chunk of a choice: `{"role": "assistant", "content": ""}`."""
    choice = {"index": index, "finish_reason": None, "logprobs": None, "delta": {"role": "assistant", "content": ""}}
    return _chunk(request, rid, created, choice, usage_now)


def chunk(request: GenerationRequest, rid: str, created: int, index: int, update: Any, tokenizer: ChatTokenizer,
          offset: int = 0, usage_now: dict[str, int] | None = None) -> dict[str, Any]:
    """One stream event with a `JobUpdate`'s new stable text (chat: a `delta`; completions: `text`) and, when
    asked, its tokens' log-probabilities (`offset`: where its text starts in the choice's text)."""
    choice: dict[str, Any] = {"index": index, "finish_reason": None, "logprobs": None}
    ids = list(update.token_ids[: len(update.logprobs)])
    if request.endpoint.chat:
        choice["delta"] = {"content": update.text_delta}
        if request.logprobs is not None:
            choice["logprobs"] = chat_logprobs(tokenizer, ids, update.logprobs, update.top_logprobs)
    else:
        choice["text"] = update.text_delta
        if request.logprobs is not None:
            choice["logprobs"] = completion_logprobs(tokenizer, ids, update.logprobs, update.top_logprobs, offset)
    return _chunk(request, rid, created, choice, usage_now)


def echo_chunk(request: GenerationRequest, rid: str, created: int, choice: Choice, completion: Completion | None,
               tokenizer: ChatTokenizer, usage_now: dict[str, int] | None = None) -> dict[str, Any]:
    """A completions stream's first chunk of a choice with echo: the prompt's text (and log-probabilities)."""
    out: dict[str, Any] = {"index": choice.index, "finish_reason": None, "logprobs": None,
                           "text": _prompt_text(request, tokenizer, choice.prompt)}
    if request.logprobs is not None and completion is not None:
        out["logprobs"] = completion_logprobs(tokenizer, choice.prompt_ids, completion.prompt_logprobs,
                                              completion.prompt_top_logprobs)
    return _chunk(request, rid, created, out, usage_now)


def final_chunk(request: GenerationRequest, rid: str, created: int, index: int, completion: Completion,
                usage_now: dict[str, int] | None = None, whole_usage: dict[str, int] | None = None) -> dict[str, Any]:
    """The finishing chunk of a choice: its finish reason and `dflash` (with the request's seed); `whole_usage`
    (the request's usage, on the last choice to finish when no usage chunk follows)."""
    reason = completion.finish_reason if request.max_tokens != 0 else "length"
    choice: dict[str, Any] = {"index": index, "finish_reason": reason, "logprobs": None}
    if request.endpoint.chat:
        choice["delta"] = {"content": ""}  # not {}: clients (guidellm) read delta.content on every chunk
    else:
        choice["text"] = ""
    body = _chunk(request, rid, created, choice, usage_now)
    if whole_usage is not None:
        body["usage"] = whole_usage
    body["dflash"] = dflash_stats([completion], request.seed)
    return body


def usage_chunk(request: GenerationRequest, rid: str, created: int, generated: int) -> dict[str, Any]:
    """With `stream_options.include_usage`, as in OpenAI's API: a last chunk with empty `choices` and the usage."""
    return {"id": rid, "object": request.endpoint.chunk_object, "created": created, "model": request.model,
            "choices": [], "usage": usage(request.prompt_tokens, generated)}


def stream_error(message: str, status: int) -> dict[str, Any]:
    """The event that ends a stream whose request failed after the 200 was sent."""
    return error_body(RequestError(message, status=status))


def error_body(err: RequestError) -> dict[str, Any]:
    """An error response: `{"error": {"message", "type", "param", "code"}}`, the type from the status."""
    kind = {401: "authentication_error"}.get(err.status, "invalid_request_error" if err.status < 500
                                             else "server_error")
    return {"error": {"message": str(err), "type": kind, "param": err.param, "code": None}}


def model_card(model: str, created: int, block_size: int, drafter: str | None, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models/{id}: the served model, with the served context length (`max_model_len`, as vLLM), the
    engine's block size and the drafter fingerprint."""
    return {"id": model, "object": "model", "created": created, "owned_by": "dflash", "max_model_len": max_model_len,
            "block_size": block_size, "drafter": drafter}


def models_body(model: str, created: int, block_size: int, drafter: str | None, max_model_len: int) -> dict[str, Any]:
    """GET /v1/models: the one served model (`model_card`)."""
    return {"object": "list", "data": [model_card(model, created, block_size, drafter, max_model_len)]}


__all__ = ["CHAT", "COMPLETIONS", "ENDPOINTS", "ROLES", "Choice", "Endpoint", "GenerationRequest", "ProtocolConfig",
           "RequestError", "chat_logprobs", "check_fields", "chunk", "completion_logprobs", "completion_tokens",
           "dflash_stats", "draw_seed", "echo_chunk", "error_body", "final_chunk", "model_card", "models_body",
           "parse_json",
           "parse_request", "rejected", "response_body", "response_id", "role_chunk", "stream_error", "usage",
           "usage_chunk"]
