"""The OpenAI protocol layer (serve/openai.py) without a server: each parse rule and its error, the
field policy, the text of whole and streamed replies, and the shape of every response and stream chunk."""

from __future__ import annotations

import dataclasses

import pytest

from dflash.serve import openai
from dflash.serve.config import SamplingConfig
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
        return bytes(i - 1 for i in ids if 0 < i <= 256).decode("utf-8", errors="replace")  # special ids: ""

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


@dataclasses.dataclass
class Done:
    """A finished request as the engine hands it back (the contract's `Completion` fields the protocol reads)."""

    token_ids: list[int]
    text: str = ""
    finish_reason: str = "length"
    accepted: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Update:
    """The contract's `JobUpdate`."""

    token_ids: list[int]
    text_delta: str
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------------------------------- the body


def test_the_body_must_be_a_json_object():
    assert openai.parse_json(b'{"prompt": "x"}') == {"prompt": "x"}
    for raw in (b"", b"[1, 2]", b'"text"', b"null"):
        err = pytest.raises(RequestError, openai.parse_json, raw).value
        assert str(err) == "the request body must be a JSON object" and err.status == 400
    for raw in (b"{bad", b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": ' + b"9" * 5000 + b"}"):
        assert str(pytest.raises(RequestError, openai.parse_json, raw).value).startswith(
            "the request body must be JSON; ")


def test_the_body_must_be_utf8_text_nested_at_most_64_deep():
    err = pytest.raises(RequestError, openai.parse_json, b'{"prompt": "caf\xe9"}').value
    assert str(err) == "the request body must be UTF-8 JSON; byte 0xe9 at position 15 is not UTF-8"
    err = pytest.raises(RequestError, openai.parse_json, b'{"messages": [{"content": "a\\ud800b"}]}').value
    assert (str(err), err.param) == ("messages[0].content must be text that encodes as UTF-8; received '\\ud800' (a "
                                     "lone surrogate) at character 1", "messages")
    err = pytest.raises(RequestError, openai.parse_json, b'{"stop": {"\\udfff": 1}}').value
    assert err.param == "stop" and str(err).startswith("the key '\\udfff' of stop must be text that encodes")
    assert openai.parse_json(b'{"a": ' + b"[" * 63 + b"]" * 63 + b"}")["a"] is not None
    for depth in (64, 5000, 50_000):  # 50,000 is past the parser's recursion limit
        err = pytest.raises(RequestError, openai.parse_json, b'{"a": ' + b"[" * depth + b"]" * depth + b"}").value
        assert str(err).startswith("the request body must be JSON nested at most 64 deep; ")


# ------------------------------------------------------------------------------------------- field policy


def test_every_neutral_openai_field_accepts_null_on_its_endpoints():
    for endpoint in (COMPLETIONS, CHAT):
        body = {name: None for name in endpoint.openai_fields}
        assert openai.check_fields(endpoint, body, CONFIG) == []


def test_neutral_values_are_accepted_and_bookkeeping_fields_take_anything():
    body = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1, "suffix": ""}
    assert openai.check_fields(COMPLETIONS, body, CONFIG) == []
    body = {"tool_choice": "auto", "tools": [], "response_format": {"type": "text"}, "modalities": ["text"],
            "metadata": {"a": 1}, "store": True, "service_tier": "flex",
            "parallel_tool_calls": True, "reasoning_effort": "high"}
    assert openai.check_fields(CHAT, body, CONFIG) == []


@pytest.mark.parametrize(("endpoint", "field", "value", "message"), [
    (COMPLETIONS, "frequency_penalty", 0.5, "frequency_penalty must be 0 (penalties are not supported); received 0.5"),
    (COMPLETIONS, "best_of", True, "best_of must be 1 (one sample per choice); received True"),
    (COMPLETIONS, "suffix", "x", "suffix must be empty or null (insertion is not supported); received 'x'"),
    (CHAT, "logit_bias", {"1": 5}, "logit_bias must be empty (logit_bias is not supported); received {'1': 5}"),
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
    seed = request.seed  # drawn fresh: no seed was sent
    assert request == openai.GenerationRequest(COMPLETIONS, "m", ((98, 99),), 16, seed, (),
                                               SamplingConfig(temperature=0.5, top_p=0.9, top_k=7),
                                               prompt_texts=("ab",), seeded=False)
    assert not request.stream and not request.include_usage and request.logprobs is None
    assert request.choices == [openai.Choice(0, 0, (98, 99), seed)]
    assert parse({"prompt": "ab"}, config=ProtocolConfig("m")).max_tokens is None  # until a stop or the context ends


def test_a_completion_prompt_is_text_token_ids_or_a_list_of_either():
    assert parse({"prompt": [5, 6, 7]}).prompts == ((5, 6, 7),)
    request = parse({"prompt": ["ab", "c"]})
    assert request.prompts == ((98, 99), (100,)) and request.prompt_texts == ("ab", "c")
    request = parse({"prompt": [[5, 6], [0, 2**31 - 1]], "n": 2, "seed": 10})
    assert request.prompts == ((5, 6), (0, 2**31 - 1)) and request.prompt_texts == (None, None)
    assert request.choices == [openai.Choice(0, 0, (5, 6), 10), openai.Choice(1, 0, (5, 6), 11),
                               openai.Choice(2, 1, (0, 2**31 - 1), 10), openai.Choice(3, 1, (0, 2**31 - 1), 11)]
    assert request.prompt_tokens == 4
    rule = "prompt must be a non-empty string, a list of strings, a list of token ids or a list of token-id lists"
    for prompt in (None, [], 5, {"text": "x"}, [{"text": "x"}]):
        err = refused({"prompt": prompt})
        assert err.param == "prompt" and str(err).startswith(rule), prompt
    cases = [([1, "2"], "prompt[1] must be a token id, an integer in [0, 2**31); received '2'"),
             ([1.0], "prompt[0] must be a token id, an integer in [0, 2**31); received 1.0"),
             ([3, -1], "prompt[1] must be a token id, an integer in [0, 2**31); received -1"),
             ([2**31], "prompt[0] must be a token id, an integer in [0, 2**31); received 2147483648"),
             ([True], "prompt[0] must be a token id, an integer in [0, 2**31); received True"),
             ([[1], [2, 2**40]], "prompt[1][1] must be a token id, an integer in [0, 2**31); received 1099511627776"),
             ([[1], []], "prompt[1] must hold at least one token id; received []"),
             (["a", ""], "prompt[1] must be a non-empty string; received ''"),
             ("", "prompt must be a non-empty string; received ''")]
    for prompt, message in cases:
        err = refused({"prompt": prompt})
        assert (str(err), err.param) == (message, "prompt")


def test_a_chat_prompt_goes_through_the_template_with_its_variables():
    request = parse({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}, CHAT)
    assert request.endpoint is CHAT and TOK.decode(list(request.prompt_ids)) == (
        "user: hi\n[enable_thinking=False]assistant: ")
    for messages in (None, [], "hi"):
        err = refused({"messages": messages}, CHAT)
        assert err.param == "messages" and str(err).startswith(
            "messages must be a non-empty list of {role, content} objects; received ")
    for messages in (["hi"], [{"content": "hi"}], [{"role": 1, "content": "hi"}]):
        err = refused({"messages": messages}, CHAT)
        assert err.param == "messages" and str(err).startswith(
            "messages[0] must be an object with a string role and a content; received ")
    err = refused({"messages": MESSAGES, "chat_template_kwargs": ["enable_thinking"]}, CHAT)
    assert err.param == "chat_template_kwargs" and str(err).startswith("chat_template_kwargs must be an object")


def test_chat_content_is_a_string_or_a_list_of_text_parts():
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert TOK.decode(list(parse({"messages": parts}, CHAT).prompt_ids)) == "user: hi\nthere\nassistant: "
    one = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert parse({"messages": one}, CHAT).prompt_ids == parse({"messages": MESSAGES}, CHAT).prompt_ids
    cases = [(None, "messages[0].content must be a string or a non-empty list of text parts; received None"),
             (5, "messages[0].content must be a string or a non-empty list of text parts; received 5"),
             ([], "messages[0].content must be a string or a non-empty list of text parts; received []"),
             ([{"type": "image_url", "image_url": {"url": "x"}}],
              "messages[0].content[0] must be a text part {\"type\": \"text\", \"text\": ...}; received type "
              "'image_url' (only text is supported)"),
             (["hi"], "messages[0].content[0] must be a text part {\"type\": \"text\", \"text\": ...}; received 'hi' "
                      "(only text is supported)"),
             ([{"type": "text", "text": 3}], "messages[0].content[0].text must be a string; received 3")]
    for content, message in cases:
        err = refused({"messages": [{"role": "user", "content": content}]}, CHAT)
        assert (str(err), err.param) == (message, "messages")


def test_roles_are_openais():
    """The roles OpenAI's API takes, and no other (a stock client's "wizard" is a 400 naming the field)."""
    for role in openai.ROLES:
        assert parse({"messages": [{"role": role, "content": "x"}]}, CHAT).prompt_ids
    for role in ("wizard", "User", "", "bot"):
        err = refused({"messages": [*MESSAGES, {"role": role, "content": "x"}]}, CHAT)
        assert (str(err), err.param) == (f"messages[1].role must be one of {list(openai.ROLES)}; received {role!r}",
                                         "messages")


def test_bad_chat_template_kwargs_are_a_400_naming_the_field():
    """Template variables the server sets itself, and variables the template cannot render with, are refused
    naming `chat_template_kwargs`, not as a Python error about the call."""
    for key in ("add_generation_prompt", "messages"):
        err = refused({"messages": MESSAGES, "chat_template_kwargs": {key: True, "x": 1}}, CHAT)
        assert (str(err), err.param) == (f"chat_template_kwargs must not set {key!r} (the server sets "
                                         "['add_generation_prompt', 'messages']); received keys "
                                         f"{sorted([key, 'x'])}", "chat_template_kwargs")
        assert "TypeError" not in str(err) and "keyword argument" not in str(err)

    class Picky(ByteTokenizer):
        def encode_chat(self, messages, add_generation_prompt=True, **kwargs):
            if kwargs.get("enable_thinking") not in (None, True, False):
                raise ValueError("enable_thinking must be a boolean")
            return super().encode_chat(messages, add_generation_prompt, **kwargs)

    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": "maybe"}}
    err = pytest.raises(RequestError, openai.parse_request, CHAT, body, Picky(), CONFIG).value
    assert (str(err), err.param) == ("chat_template_kwargs must be variables the chat template can render with; "
                                     "with ['enable_thinking'] it failed: enable_thinking must be a boolean",
                                     "chat_template_kwargs")
    assert openai.parse_request(CHAT, {**body, "chat_template_kwargs": {"enable_thinking": False}}, Picky(), CONFIG)


def test_ignore_eos():
    assert parse({"prompt": "a", "ignore_eos": True}).ignore_eos
    assert not parse({"prompt": "a", "ignore_eos": None}).ignore_eos and not parse({"prompt": "a"}).ignore_eos
    assert parse({"messages": MESSAGES, "ignore_eos": True}, CHAT).ignore_eos
    err = refused({"prompt": "a", "ignore_eos": "yes"})
    assert (str(err), err.param) == ("ignore_eos must be true, false or null; received 'yes'", "ignore_eos")


def test_a_template_error_is_a_400_about_the_messages():
    class Strict(ByteTokenizer):
        def encode_chat(self, messages, add_generation_prompt=True, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant")

    err = pytest.raises(RequestError, openai.parse_request, CHAT, {"messages": MESSAGES}, Strict(), CONFIG).value
    assert (str(err), err.param) == ("messages could not be rendered by the chat template: Conversation roles must "
                                     "alternate user/assistant", "messages")


def test_max_tokens():
    assert parse({"prompt": "a", "max_tokens": 3}).max_tokens == 3
    assert parse({"prompt": "a", "max_tokens": None}).max_tokens == 16
    assert parse({"prompt": "a", "max_tokens": 2**31 - 1}).max_tokens == 2**31 - 1
    chat = {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 5}
    assert parse(chat, CHAT).max_tokens == 5
    for value in (0, -1, True, 1.5, "3", 2**31):
        err = refused({"prompt": "a", "max_tokens": value})
        assert (str(err), err.param) == (f"max_tokens must be an integer in [1, 2**31); received {value!r}",
                                         "max_tokens")
    err = refused({"messages": MESSAGES, "max_completion_tokens": 0}, CHAT)
    assert err.param == "max_completion_tokens"
    scored = parse({"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert (scored.max_tokens, scored.submit_max_tokens, scored.prompt_logprobs) == (0, 1, 1)
    err = refused({"prompt": "a", "max_tokens": -1, "echo": True})
    assert str(err) == "max_tokens must be an integer in [0, 2**31) (0 only with echo); received -1"


def test_n_stop_and_seed():
    assert parse({"prompt": "a", "n": 128}).n == 128
    for n in (0, 129, True, 1.0, "2"):
        err = refused({"prompt": "a", "n": n})
        assert (str(err), err.param) == (f"n must be an integer in [1, 128]; received {n!r}", "n")
    assert parse({"prompt": "a", "stop": "\n"}).stop == ("\n",)
    assert parse({"prompt": "a", "stop": ["x", "yz"]}).stop == ("x", "yz")
    assert parse({"prompt": "a", "stop": None}).stop == parse({"prompt": "a", "stop": ""}).stop == ()
    for stop in ([""], [1], ["x", None], 5, {"s": "x"}, True):
        err = refused({"prompt": "a", "stop": stop})
        assert (str(err), err.param) == (f"stop must be a string or a list of non-empty strings; received {stop!r}",
                                         "stop")
    assert parse({"prompt": "a", "seed": 2**63 - 1}).seed == 2**63 - 1
    assert parse({"prompt": "a", "seed": 0}).seeded and parse({"prompt": "a", "seed": 0}).seed == 0
    for seed in (-1, 2**63, True, 1.0):
        err = refused({"prompt": "a", "seed": seed})
        assert (str(err), err.param) == (f"seed must be an integer in [0, 2**63); received {seed!r}", "seed")
    err = refused({"prompt": "a", "seed": 2**63 - 2, "n": 3})
    assert str(err) == ("seed must be an integer in [0, 2**63 - 2) (choice i uses seed + i); received "
                        f"{2**63 - 2}")


def test_an_unseeded_request_draws_fresh_entropy():
    """OpenAI's semantics: a request without a seed (or with `seed: null`) is independent of every other; its
    seed is 63 fresh bits, leaving room for the n choices' seed + i."""
    drawn = [parse({"prompt": "a"}) for _ in range(64)] + [parse({"prompt": "a", "seed": None})]
    assert not any(r.seeded for r in drawn)
    seeds = [r.seed for r in drawn]
    assert len(set(seeds)) == len(seeds)  # a collision of 63-bit draws: 1 in 2**52
    assert all(0 <= s < 2**63 for s in seeds) and max(seeds) >= 2**60  # the whole range, not 31 or 32 bits
    many = parse({"prompt": "a", "n": 128})
    assert many.seed + 127 < 2**63 and [c.seed for c in many.choices][-1] == many.seed + 127
    assert all(0 <= openai.draw_seed(2**62) <= 2**62 for _ in range(200))


def test_stream_options():
    options = {"stream_options": {"include_usage": True}}
    assert (parse({"prompt": "a", "stream": True, **options}).include_usage is True)
    assert parse({"prompt": "a", **options}).include_usage is False
    assert parse({"prompt": "a", "stream": True}).include_usage is False
    every = parse({"prompt": "a", "stream": True,
                   "stream_options": {"continuous_usage_stats": True, "include_obfuscation": False}})
    assert every.continuous_usage and not every.include_usage
    for value in ({"include_usage": 1}, {"other": True}, "yes"):
        err = refused({"prompt": "a", "stream": True, "stream_options": value})
        assert err.param == "stream_options" and str(err).startswith("stream_options must be null or an object")
    err = refused({"prompt": "a", "stream": "yes"})
    assert (str(err), err.param) == ("stream must be true, false or null; received 'yes'", "stream")


def test_logprobs_fields():
    assert parse({"prompt": "a", "logprobs": 5}).logprobs == 5
    assert parse({"prompt": "a", "logprobs": 0}).logprobs == 0
    assert parse({"prompt": "a", "logprobs": None}).logprobs is None
    assert parse({"prompt": "a", "logprobs": False}).logprobs is None
    assert parse({"prompt": "a", "logprobs": 2}).prompt_logprobs is None  # the prompt's only with echo
    for value in (6, -1, True, 1.5):
        err = refused({"prompt": "a", "logprobs": value})
        assert (str(err), err.param) == (f"logprobs must be an integer in [0, 5] or null; received {value!r}",
                                         "logprobs")
    assert parse({"messages": MESSAGES, "logprobs": True}, CHAT).logprobs == 0
    assert parse({"messages": MESSAGES, "logprobs": True, "top_logprobs": 20}, CHAT).logprobs == 20
    assert parse({"messages": MESSAGES, "logprobs": False, "top_logprobs": 0}, CHAT).logprobs is None
    for value in (21, -1, 2.0):
        err = refused({"messages": MESSAGES, "logprobs": True, "top_logprobs": value}, CHAT)
        assert (str(err), err.param) == (f"top_logprobs must be an integer in [0, 20] or null; received {value!r}",
                                         "top_logprobs")
    err = refused({"messages": MESSAGES, "top_logprobs": 2}, CHAT)
    assert (str(err), err.param) == ("top_logprobs needs logprobs: true; received top_logprobs 2 with logprobs None",
                                     "top_logprobs")
    err = refused({"messages": MESSAGES, "logprobs": 1}, CHAT)
    assert (str(err), err.param) == ("logprobs must be true, false or null; received 1", "logprobs")
    assert refused({"prompt": "a", "echo": 1}).param == "echo"


def test_sampling_fields_override_the_servers_default():
    assert parse({"prompt": "a", "temperature": 0}).sampling == SamplingConfig(0.0, 0.9, 7)
    assert parse({"prompt": "a", "top_p": 1, "top_k": -1}).sampling == SamplingConfig(0.5, 1.0, 0)
    assert parse({"prompt": "a", "temperature": 1.5, "top_k": 3}).sampling == SamplingConfig(1.5, 0.9, 3)
    cases = [("temperature", 101, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", -0.1, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", True, "be a number in [0, 100] (0 = greedy)"),
             ("temperature", "1", "be a number in [0, 100] (0 = greedy)"),
             ("temperature", 1e400, "be a number in [0, 100] (0 = greedy)"),
             ("top_p", 0, "be a number in (0, 1]"), ("top_p", 1.5, "be a number in (0, 1]"),
             *[("top_k", v, "be an integer in [-1, 2**31) (0 or -1 = off)") for v in (-2, 1.5, False, 2**31)]]
    for field, value, rule in cases:
        err = refused({"prompt": "a", field: value})
        assert (str(err), err.param) == (f"{field} must {rule}; received {value!r}", field)


def test_the_first_broken_field_is_named():
    """prompt, then max_tokens, n, stop, seed, stream, logprobs, then the sampling fields."""
    assert refused({"prompt": None, "max_tokens": 0}).param == "prompt"
    assert refused({"prompt": "a", "max_tokens": 0, "n": 0}).param == "max_tokens"
    assert refused({"prompt": "a", "n": 0, "stop": [1]}).param == "n"
    assert refused({"prompt": "a", "stop": [1], "seed": -1}).param == "stop"
    assert refused({"prompt": "a", "seed": -1, "logprobs": 9}).param == "seed"
    assert refused({"prompt": "a", "logprobs": 9, "temperature": -1}).param == "logprobs"


class Rejected(ValueError):
    """The worker's `RequestRejected`: a ValueError naming the field in engine terms."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def test_the_engines_refusal_speaks_in_the_requests_terms():
    request = parse({"prompt": "ab"})
    err = openai.rejected(request, Rejected("the prompt (2 tokens) plus max_new_tokens (900) must fit the context "
                                            "(max_len 512)", "max_new_tokens"), request.choices[0])
    assert (str(err), err.param, err.status) == (
        "the prompt (2 tokens) plus max_tokens (900) must fit the context (max_len 512)", "max_tokens", 400)
    many = parse({"prompt": [[1], [2, 70000]]})
    err = openai.rejected(many, Rejected("prompt_ids[1] must be a token id in [0, 49152); received 70000",
                                         "prompt_ids"), many.choices[1])
    assert (str(err), err.param) == ("prompt[1]: prompt[1] must be a token id in [0, 49152); received 70000",
                                     "prompt")
    chat = parse({"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}, CHAT)
    err = openai.rejected(chat, Rejected("prompt_ids (9000 tokens) must fit max_len 512", "prompt_ids"),
                          chat.choices[0])
    assert (str(err), err.param) == ("messages (9000 tokens) must fit max_len 512", "messages")
    assert openai.rejected(chat, Rejected("no", "logprobs"), chat.choices[0]).param == "top_logprobs"
    assert openai.rejected(request, Rejected("sampling.top_k too big", "sampling.top_k"),
                           request.choices[0]).param == "top_k"
    assert openai.rejected(request, ValueError("odd"), request.choices[0]).param == "prompt"


# ------------------------------------------------------------------------------------------- responses

DFLASH_STATS = {"tau": 2.0, "steps": 2, "accepted_per_step": [2, 0]}
AR_STATS = {"tau": None, "steps": 0}


def test_response_ids_are_unique_and_stats_sum_over_choices():
    ids = {openai.response_id(COMPLETIONS) for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("cmpl-") for i in ids)
    assert openai.response_id(CHAT).startswith("chatcmpl-")
    assert openai.usage(3, 4) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert openai.dflash_stats([Done([1], accepted=[2, 0])]) == DFLASH_STATS
    assert openai.dflash_stats([Done([1], accepted=[3]), Done([1], accepted=[0, 1])]) == {
        "tau": 7 / 3, "steps": 3, "accepted_per_step": [3, 0, 1]}
    assert openai.dflash_stats([Done([1])]) == openai.dflash_stats([None]) == AR_STATS
    assert openai.dflash_stats([None], seed=7) == {**AR_STATS, "seed": 7}
    seeded = parse({"prompt": "a", "seed": 9, "n": 2})
    assert openai.response_body(seeded, "k", 1, [Done([1]), Done([1])], TOK)["dflash"]["seed"] == 9  # choice i: 9 + i


def test_a_completion_response():
    request = parse({"prompt": "abc"})
    body = openai.response_body(request, "cmpl-1", 100, [Done([5, 6, 7, 8], "xyz", accepted=[2, 0])], TOK)
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 100, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "text": "xyz"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
                    "dflash": {**DFLASH_STATS, "seed": request.seed}}


def test_several_prompts_and_n_answer_in_index_order_with_summed_usage():
    request = parse({"prompt": ["ab", "c"], "n": 2})
    done = [Done([1, 2], "p0s0", "stop"), Done([1], "p0s1"), Done([3, 4, 5], "p1s0"), Done([6], "p1s1", "stop")]
    body = openai.response_body(request, "cmpl-1", 100, done, TOK)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "p0s0", "stop"), (1, "p0s1", "length"), (2, "p1s0", "length"), (3, "p1s1", "stop")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}


def test_a_chat_response():
    request = parse({"messages": MESSAGES}, CHAT)
    body = openai.response_body(request, "chatcmpl-1", 100, [Done([104, 105], "hello", "stop")], TOK)
    n = len(request.prompt_ids)
    assert body == {"id": "chatcmpl-1", "object": "chat.completion", "created": 100, "model": "m",
                    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                 "message": {"role": "assistant", "content": "hello"}}],
                    "usage": {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2},
                    "dflash": {**AR_STATS, "seed": request.seed}}


A, B, EOS = TOK.encode("a")[0], TOK.encode("b")[0], STOP


def scored() -> Done:
    """"ab" generated after the prompt "ab" (ids 98 99), then the stop token; log-probs from a fake target."""
    return Done([A, B, EOS], "ab", "stop", token_logprobs=[-0.5, -1.0, float("-inf")],
                top_logprobs=[[(A, -0.5), (B, -1.5)], [(A, -0.25), (B, -1.0)], [(EOS, -0.1), (A, -3.0)]],
                prompt_logprobs=[None, -2.0], prompt_top_logprobs=[[], [(B, -2.0), (A, -2.5)]])


def test_chat_logprobs_in_openais_shape():
    request = parse({"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}, CHAT)
    [choice] = openai.response_body(request, "c", 1, [scored()], TOK)["choices"]
    content = choice["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                          "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                           {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    assert [e["token"] for e in content] == ["a", "b", ""] and content[1]["logprob"] == -1.0
    assert content[2]["logprob"] == openai.LOGPROB_FLOOR  # -inf is not JSON
    e_acute = TOK.encode("é")[:1]
    [entry] = openai.chat_logprobs(TOK, e_acute, [-1.0], [[]])["content"]
    assert entry["bytes"] == list(TOK.decode(e_acute).encode())  # a partial character is what decode makes of it


def test_completion_logprobs_in_the_legacy_shape_with_and_without_echo():
    request = parse({"prompt": "ab", "logprobs": 2})
    [choice] = openai.response_body(request, "k", 1, [scored()], TOK)["choices"]
    assert choice["text"] == "ab"
    assert choice["logprobs"] == {"tokens": ["a", "b", ""], "token_logprobs": [-0.5, -1.0, -9999.0],
                                  "top_logprobs": [{"a": -0.5, "b": -1.5}, {"a": -0.25, "b": -1.0},
                                                   {"": -0.1, "a": -3.0}],
                                  "text_offset": [0, 1, 2]}
    echo = parse({"prompt": "ab", "logprobs": 2, "echo": True})
    [choice] = openai.response_body(echo, "k", 1, [scored()], TOK)["choices"]
    assert choice["text"] == "abab"
    assert choice["logprobs"]["tokens"] == ["a", "b", "a", "b", ""]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -0.5, -1.0, -9999.0]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"b": -2.0, "a": -2.5}]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]


def test_an_echo_with_max_tokens_0_scores_the_prompt_alone():
    """lm-eval's loglikelihood request: the prompt's log-probs; the one token the engine made is dropped."""
    request = parse({"prompt": [A, B], "max_tokens": 0, "echo": True, "logprobs": 1})
    body = openai.response_body(request, "k", 1, [scored()], TOK)
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "length")
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0] and choice["logprobs"]["tokens"] == ["a", "b"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    plain = parse({"prompt": "ab", "echo": True, "max_tokens": 3})
    [choice] = openai.response_body(plain, "k", 1, [scored()], TOK)["choices"]
    assert choice["text"] == "abab" and choice["logprobs"] is None


def test_chat_stream_chunks():
    request = parse({"messages": MESSAGES, "stream": True}, CHAT)
    head = {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "m"}
    assert openai.role_chunk(request, "c", 5, 0) == {**head, "choices": [
        {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"role": "assistant", "content": ""}}]}
    assert openai.chunk(request, "c", 5, 0, Update([104, 105], "Hi"), TOK) == {**head, "choices": [
        {"index": 0, "finish_reason": None, "logprobs": None, "delta": {"content": "Hi"}}]}
    assert openai.final_chunk(request, "c", 5, 0, Done([1, 2, 3], "Hi", "stop"), whole_usage=openai.usage(4, 3)) == {
        **head, "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "delta": {"content": ""}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        "dflash": {**AR_STATS, "seed": request.seed}}


def test_streamed_logprobs_per_chunk():
    chat = parse({"messages": MESSAGES, "stream": True, "logprobs": True, "top_logprobs": 1}, CHAT)
    update = Update([A, B], "ab", [-0.5, -1.0], [[(A, -0.5)], [(A, -0.25)]])
    content = openai.chunk(chat, "c", 5, 2, update, TOK)["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["top_logprobs"][0]["logprob"]) for e in content] == [
        ("a", -0.5, -0.5), ("b", -1.0, -0.25)]
    text = parse({"prompt": "ab", "stream": True, "logprobs": 1})
    choice = openai.chunk(text, "k", 5, 0, update, TOK, offset=7)["choices"][0]
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                                  "top_logprobs": [{"a": -0.5}, {"a": -0.25}], "text_offset": [7, 8]}
    echo = parse({"prompt": "ab", "stream": True, "logprobs": 1, "echo": True})
    first = openai.echo_chunk(echo, "k", 5, echo.choices[0], scored(), TOK)["choices"][0]
    assert first["text"] == "ab" and first["logprobs"]["token_logprobs"] == [None, -2.0]


def test_completion_stream_chunks_with_usage_options():
    request = parse({"prompt": "ab", "stream": True, "stream_options": {"include_usage": True}})
    head = {"id": "k", "object": "text_completion", "created": 5, "model": "m"}
    assert openai.chunk(request, "k", 5, 0, Update([120], "x"), TOK) == {
        **head, "choices": [{"index": 0, "finish_reason": None, "logprobs": None, "text": "x"}], "usage": None}
    assert openai.final_chunk(request, "k", 5, 0, Done([1, 2, 3], accepted=[2, 0])) == {
        **head, "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "text": ""}], "usage": None,
        "dflash": {**DFLASH_STATS, "seed": request.seed}}
    assert openai.usage_chunk(request, "k", 5, 3) == {
        **head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    every = parse({"prompt": "ab", "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert openai.chunk(every, "k", 5, 0, Update([120], "x"), TOK, usage_now=openai.usage(2, 1))["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}


def test_errors_and_models():
    assert openai.stream_error("boom", 503) == {"error": {"message": "boom", "type": "server_error", "param": None,
                                                          "code": None}}
    for status, kind in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "invalid_request_error"),
                         (405, "invalid_request_error"), (413, "invalid_request_error"), (500, "server_error"),
                         (503, "server_error")]:
        body = openai.error_body(RequestError("bad", "prompt", status=status))
        assert body == {"error": {"message": "bad", "type": kind, "param": "prompt", "code": None}}
    card = {"id": "m", "object": "model", "created": 7, "owned_by": "dflash", "max_model_len": 512, "block_size": 4,
            "drafter": "abc"}
    assert openai.model_card("m", 7, 4, "abc", 512) == card
    assert openai.models_body("m", 7, 4, "abc", 512) == {"object": "list", "data": [card]}
