"""The OpenAI protocol layer (dflash/serve/openai.py) without a server: each parse rule and its error, the
field policy, the text of whole and streamed replies, and the shape of every response and stream chunk."""

from __future__ import annotations

import dataclasses

import pytest

from dflash.serve import openai
from dflash.serve.config import SamplingConfig
from dflash.serve.engine import Completion
from dflash.serve.openai import CHAT, COMPLETIONS, ProtocolConfig, RequestError

CONFIG = ProtocolConfig("m", max_tokens=16, sampling=SamplingConfig(temperature=0.5, top_p=0.9, top_k=7))
STOP = 0


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Ids are UTF-8 bytes + 1 (0 is the stop token); chat renders `role: content` lines, then the template
    variables, then `assistant: `."""

    stop_token_ids: tuple[int, ...] = (STOP,)

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids).decode("utf-8", errors="replace")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        text += "".join(f"[{k}={v}]" for k, v in sorted(kwargs.items()))
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))


TOK = ByteTokenizer()
MESSAGES = [{"role": "user", "content": "hi"}]


def parse(body: dict, endpoint: openai.Endpoint = COMPLETIONS, config: ProtocolConfig = CONFIG):
    openai.check_fields(endpoint, body, config)
    return openai.parse_request(endpoint, body, TOK, config)


def refused(body: dict, endpoint: openai.Endpoint = COMPLETIONS, config: ProtocolConfig = CONFIG) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body, endpoint, config)
    return info.value


def completion(**fields) -> Completion:
    return Completion(request_id=0, prompt_ids=[1], max_new_tokens=8, stop_ids=(STOP,), seed=0, **fields)


# ------------------------------------------------------------------------------------------- the body


def test_the_body_must_be_a_json_object():
    assert openai.parse_json(b'{"prompt": "x"}') == {"prompt": "x"}
    for raw in (b"", b"[1, 2]", b'"text"', b"null"):
        err = pytest.raises(RequestError, openai.parse_json, raw).value
        assert str(err) == "the request body must be a JSON object" and err.status == 400
    for raw in (b"{bad", b"\xff\xfe"):
        assert str(pytest.raises(RequestError, openai.parse_json, raw).value).startswith(
            "the request body must be JSON; ")


# ------------------------------------------------------------------------------------------- field policy


def test_every_neutral_openai_field_accepts_null_on_its_endpoints():
    for endpoint in (COMPLETIONS, CHAT):
        body = {name: None for name in endpoint.openai_fields}
        assert openai.check_fields(endpoint, body, CONFIG) == []


def test_neutral_values_are_accepted_and_bookkeeping_fields_take_anything():
    body = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False, "echo": False,
            "best_of": 1, "suffix": "", "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert openai.check_fields(COMPLETIONS, body, CONFIG) == []
    body = {"tool_choice": "auto", "tools": [], "response_format": {"type": "text"}, "modalities": ["text"],
            "logprobs": 0, "top_logprobs": 0, "metadata": {"a": 1}, "store": True, "service_tier": "flex",
            "parallel_tool_calls": True, "reasoning_effort": "high"}
    assert openai.check_fields(CHAT, body, CONFIG) == []


@pytest.mark.parametrize(("endpoint", "field", "value", "message"), [
    (COMPLETIONS, "frequency_penalty", 0.5, "frequency_penalty must be 0 (penalties are not supported); received 0.5"),
    (COMPLETIONS, "logprobs", 5, "logprobs must be false, 0 or null (logprobs are not supported); received 5"),
    (COMPLETIONS, "echo", True, "echo must be false (echo is not supported); received True"),
    (COMPLETIONS, "best_of", True, "best_of must be 1 (one sample per request); received True"),
    (COMPLETIONS, "suffix", "x", "suffix must be empty or null (insertion is not supported); received 'x'"),
    (COMPLETIONS, "stream_options", {"include_usage": 1},
     'stream_options must be null or {"include_usage": bool}; received {\'include_usage\': 1}'),
    (CHAT, "logit_bias", {"1": 5}, "logit_bias must be empty (logit_bias is not supported); received {'1': 5}"),
    (CHAT, "top_logprobs", 2, "top_logprobs must be 0 or null (logprobs are not supported); received 2"),
    (CHAT, "response_format", {"type": "json_object"},
     'response_format must be {"type": "text"} (structured output is not supported); received '
     "{'type': 'json_object'}"),
    (CHAT, "tools", [{"type": "function"}],
     "tools must be empty (tool calling is not supported); received [{'type': 'function'}]"),
    (CHAT, "tool_choice", "required",
     "tool_choice must be \"none\" or \"auto\" (tool calling is not supported); received 'required'"),
    (CHAT, "functions", [{}], "functions must be empty (function calling is not supported); received [{}]"),
    (CHAT, "function_call", "f", 'function_call must be "none" or "auto" (function calling is not supported); '
     "received 'f'"),
    (CHAT, "modalities", ["audio"], 'modalities must be ["text"] (text output only); received [\'audio\']'),
    (CHAT, "audio", {}, "audio must be null (audio output is not supported); received {}"),
    (CHAT, "web_search_options", {}, "web_search_options must be null (web search is not supported); received {}"),
])
def test_a_non_neutral_openai_field_is_a_400_naming_it(endpoint, field, value, message):
    with pytest.raises(RequestError) as info:
        openai.check_fields(endpoint, {field: value}, CONFIG)
    assert (str(info.value), info.value.param, info.value.status) == (message, field, 400)


def test_openai_fields_of_the_other_endpoint_are_unknown():
    err = pytest.raises(RequestError, openai.check_fields, CHAT, {"echo": False}, CONFIG).value
    assert err.param == "echo" and str(err).startswith("unknown field(s) ['echo']; this endpoint takes ['chat_")
    err = pytest.raises(RequestError, openai.check_fields, COMPLETIONS, {"tools": []}, CONFIG).value
    assert err.param == "tools"


def test_unknown_fields_are_refused_or_returned_to_warn_about():
    body = {"prompt": "x", "zeta": 1, "alpha": 2}
    err = pytest.raises(RequestError, openai.check_fields, COMPLETIONS, body, CONFIG).value
    assert str(err) == (f"unknown field(s) ['alpha', 'zeta']; this endpoint takes {sorted(COMPLETIONS.fields)}")
    assert (err.param, err.status) == ("alpha", 400)
    lenient = dataclasses.replace(CONFIG, unknown_fields="ignore")
    assert openai.check_fields(COMPLETIONS, body, lenient) == ["alpha", "zeta"]


def test_the_model_must_be_the_served_one():
    assert openai.check_fields(COMPLETIONS, {"model": "m"}, CONFIG) == []
    assert openai.check_fields(COMPLETIONS, {}, CONFIG) == []
    err = pytest.raises(RequestError, openai.check_fields, CHAT, {"model": "gpt-4"}, CONFIG).value
    assert (str(err), err.param, err.status) == ("model 'gpt-4' does not exist; this server serves 'm'", "model", 404)


def test_the_unknown_fields_policy_is_checked_at_construction():
    with pytest.raises(ValueError, match="unknown_fields must be 'reject' or 'ignore'; received 'warn'"):
        ProtocolConfig("m", unknown_fields="warn")


# ------------------------------------------------------------------------------------------- parsing


def test_a_completion_request_with_defaults():
    request = parse({"prompt": "ab"})
    assert request == openai.GenerationRequest(COMPLETIONS, "m", (98, 99), 16, 0, (),
                                               SamplingConfig(temperature=0.5, top_p=0.9, top_k=7))
    assert not request.stream and not request.include_usage


def test_a_completion_prompt_is_text_or_token_ids():
    assert parse({"prompt": [5, 6, 7]}).prompt_ids == (5, 6, 7)
    for prompt in (None, [], [1, "2"], [1.0], 5, {"text": "x"}):
        err = refused({"prompt": prompt})
        assert (str(err), err.param) == ("prompt must be a non-empty string or a list of token ids", "prompt")


def test_a_chat_prompt_goes_through_the_template_with_its_variables():
    request = parse({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, CHAT)
    assert request.endpoint is CHAT and TOK.decode(list(request.prompt_ids)) == (
        "user: hi\n[enable_thinking=False]assistant: ")
    for messages in (None, [], [{"role": "user"}], [{"role": "user", "content": ["part"]}], ["hi"]):
        err = refused({"messages": messages}, CHAT)
        assert (str(err), err.param) == ("messages must be a non-empty list of {role, content} strings", "messages")
    err = refused({"messages": MESSAGES, "chat_template_kwargs": ["enable_thinking"]}, CHAT)
    assert err.param == "chat_template_kwargs" and str(err).startswith("chat_template_kwargs must be an object")


def test_max_tokens():
    assert parse({"prompt": "a", "max_tokens": 3}).max_tokens == 3
    assert parse({"prompt": "a", "max_tokens": None}).max_tokens == 16
    chat = {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 5}
    assert parse(chat, CHAT).max_tokens == 5
    for value in (0, -1, True, 1.5, "3"):
        err = refused({"prompt": "a", "max_tokens": value})
        assert (str(err), err.param) == (f"max_tokens must be a positive integer; received {value!r}", "max_tokens")


def test_n_stop_and_seed():
    assert parse({"prompt": "a", "n": 1}).seed == 0
    for n in (2, True, 0):
        assert (str(err := refused({"prompt": "a", "n": n})), err.param) == ("n must be 1", "n")
    assert parse({"prompt": "a", "stop": "\n"}).stop == ("\n",)
    assert parse({"prompt": "a", "stop": ["x", "yz"]}).stop == ("x", "yz")
    assert parse({"prompt": "a", "stop": None}).stop == parse({"prompt": "a", "stop": ""}).stop == ()
    for stop in ([""], [1], ["x", None]):
        err = refused({"prompt": "a", "stop": stop})
        assert (str(err), err.param) == ("stop must be a string or a list of non-empty strings", "stop")
    assert parse({"prompt": "a", "seed": 2**63 - 1}).seed == 2**63 - 1
    for seed in (-1, 2**63, True, 1.0, None):
        err = refused({"prompt": "a", "seed": seed})
        assert (str(err), err.param) == (f"seed must be a non-negative integer; received {seed!r}", "seed")


def test_include_usage_needs_a_stream():
    options = {"stream_options": {"include_usage": True}}
    assert (parse({"prompt": "a", "stream": True, **options}).include_usage is True)
    assert parse({"prompt": "a", **options}).include_usage is False
    assert parse({"prompt": "a", "stream": True}).include_usage is False


def test_sampling_fields_override_the_servers_default():
    assert parse({"prompt": "a", "temperature": 0}).sampling == SamplingConfig(0.0, 0.9, 7)
    assert parse({"prompt": "a", "top_p": 1, "top_k": -1}).sampling == SamplingConfig(0.5, 1.0, 0)
    assert parse({"prompt": "a", "temperature": 1.5, "top_k": 3}).sampling == SamplingConfig(1.5, 0.9, 3)
    cases = [("temperature", 101, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", -0.1, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", True, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", "1", "be a number in [0, 100] (0 = greedy)"),
             ("top_p", 0, "be a number in (0, 1]"), ("top_p", 1.5, "be a number in (0, 1]"),
             *[("top_k", v, "be an integer >= -1 (0 or -1 = off)") for v in (-2, 1.5, False)]]
    for field, value, rule in cases:
        err = refused({"prompt": "a", field: value})
        assert (str(err), err.param) == (f"{field} must {rule}; received {value!r}", field)


def test_the_first_broken_field_is_named():
    """prompt, then max_tokens, n, stop, seed, then the sampling fields."""
    assert refused({"prompt": None, "max_tokens": 0}).param == "prompt"
    assert refused({"prompt": "a", "max_tokens": 0, "n": 2}).param == "max_tokens"
    assert refused({"prompt": "a", "n": 2, "stop": [1]}).param == "n"
    assert refused({"prompt": "a", "stop": [1], "seed": -1}).param == "stop"
    assert refused({"prompt": "a", "seed": -1, "temperature": -1}).param == "seed"


# ------------------------------------------------------------------------------------------- text


def test_final_text_drops_stop_tokens_and_cuts_at_the_earliest_stop_string():
    ids = TOK.encode("one. two! three") + [STOP]
    assert openai.final_text(TOK, ids, (), completion(finish_reason="stop")) == ("one. two! three", "stop")
    assert openai.final_text(TOK, ids, ("!", "."), completion(finish_reason="length")) == ("one", "stop")
    assert openai.final_text(TOK, ids, ("?",), completion(finish_reason="length")) == ("one. two! three", "length")
    assert openai.final_text(TOK, ids, (), None) == ("one. two! three", "length")
    assert openai.final_text(TOK, ids, (), completion()) == ("one. two! three", "length")


def test_a_text_stream_holds_back_a_split_character_and_ends_at_a_stop_string():
    text = openai.TextStream(TOK, ("END",))
    e_acute = TOK.encode("é")
    assert text.feed(TOK.encode("caf") + e_acute[:1]) == ""  # text ending in half a character waits
    assert text.feed(e_acute[1:]) == "café"
    assert text.feed([STOP]) == ""
    assert text.feed(TOK.encode(" ok EN")) == " ok EN"
    assert text.reason is None and text.finish_reason(completion(finish_reason="length")) == "length"
    assert text.feed(TOK.encode("D and more")) == ""  # the stop string cuts before what was already sent
    assert text.reason == "stop" and text.finish_reason(completion(finish_reason="length")) == "stop"
    kept = list(text.generated)
    assert text.feed(TOK.encode("after")) == "" and text.generated == kept


def test_a_text_stream_sends_the_text_before_a_stop_string():
    text = openai.TextStream(TOK, ("\n\n",))
    assert text.feed(TOK.encode("a")) == "a"
    assert text.feed(TOK.encode("b\n\nc")) == "b" and text.reason == "stop"
    assert text.finish_reason(None) == "stop"
    assert openai.TextStream(TOK, ()).finish_reason(None) == "length"


# ------------------------------------------------------------------------------------------- responses

DFLASH_STATS = {"tau": 2.0, "steps": 2, "accepted_per_step": [2, 0]}
AR_STATS = {"tau": None, "steps": 0}


def test_response_ids_and_stats():
    assert openai.response_id(COMPLETIONS, 255) == "cmpl-ff" and openai.response_id(CHAT, 16) == "chatcmpl-10"
    assert openai.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert openai.dflash_stats(completion(accepted=[2, 0])) == DFLASH_STATS
    assert openai.dflash_stats(completion()) == openai.dflash_stats(None) == AR_STATS


def test_a_completion_response():
    request = parse({"prompt": "abc"})
    body = openai.response_body(request, "cmpl-1", 100, "xyz", "length", 4, completion(accepted=[2, 0]))
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "text": "xyz"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
                    "dflash": DFLASH_STATS}


def test_a_chat_response():
    request = parse({"messages": MESSAGES}, CHAT)
    body = openai.response_body(request, "chatcmpl-1", 100, "hello", "stop", 2, None)
    n = len(request.prompt_ids)
    assert body == {"id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                 "message": {"role": "assistant", "content": "hello"}}],
                    "usage": {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}, "dflash": AR_STATS}


def test_chat_stream_chunks():
    request = parse({"messages": MESSAGES, "stream": True}, CHAT)
    head = {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    assert openai.chunk(request, "c", 5, "") == {**head, "choices": [{"index": 0, "finish_reason": None,
                                                                      "delta": {"content": ""}}]}
    assert openai.chunk(request, "c", 5, "Hi") == {**head, "choices": [{"index": 0, "finish_reason": None,
                                                                        "delta": {"content": "Hi"}}]}
    n = len(request.prompt_ids)
    assert openai.final_chunk(request, "c", 5, "stop", 3, None) == {
        **head, "choices": [{"index": 0, "finish_reason": "stop", "delta": {}}],
        "usage": {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}, "dflash": AR_STATS}


def test_completion_stream_chunks_with_include_usage():
    request = parse({"prompt": "ab", "stream": True, "stream_options": {"include_usage": True}})
    head = {"id": "k", "object": "text_completion", "created": 5, "model": "m"}
    assert openai.chunk(request, "k", 5, "x") == {**head, "choices": [{"index": 0, "finish_reason": None,
                                                                       "text": "x"}], "usage": None}
    assert openai.final_chunk(request, "k", 5, "length", 3, completion(accepted=[2, 0])) == {
        **head, "choices": [{"index": 0, "finish_reason": "length", "text": ""}], "usage": None,
        "dflash": DFLASH_STATS}
    assert openai.usage_chunk(request, "k", 5, 3) == {
        **head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_errors_and_models():
    assert openai.stream_error("boom") == {"error": {"message": "boom"}}
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "invalid_request_error"),
                         (413, "invalid_request_error"), (500, "server_error"), (503, "server_error")]:
        body = openai.error_body(RequestError("bad", "prompt", status=status))
        assert body == {"error": {"message": "bad", "type": kind, "param": "prompt", "code": None}}
    assert openai.models_body("m", 7, 4, "abc") == {"object": "list", "data": [
        {"id": "m", "object": "model", "created": 7, "owned_by": "dflash", "block_size": 4, "drafter": "abc"}]}
