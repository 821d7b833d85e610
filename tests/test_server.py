"""`dflash serve`'s HTTP API: OpenAI-shaped answers equal to AR decoding, 32 concurrent clients, bad
requests refused with 4xx JSON while the server keeps serving, streaming, metrics, shutdown."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from flax import nnx

from dflash.models.drafter import DFlashDrafter, DrafterConfig, resolve_drafter
from dflash.serve.engine import Engine, decode
from dflash.serve.http import make_server
from dflash.serve.plan import Chain, Limits

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


MAX_LEN = 512
AR_LEN = 256  # the AR references' context: the AR shapes test_chat_templates and test_smollm2 compile too
QUESTIONS = ["What is 2+2?", "Name a color.", "Say hi.", "What is the capital of France?", "Count to three.",
             "What is a cat?", "Give me a number.", "Is water wet?"]


@pytest.fixture(scope="module")
def server(smollm2_target):
    target = smollm2_target
    arch = resolve_drafter(DrafterConfig(num_layers=1, num_features=2, layer_ids=(1, 3), block_size=4), target.cfg,
                           mask_token_id=16)
    engine = Engine(target.params, target.cfg, DFlashDrafter(arch, nnx.Rngs(0)), Chain(4),
                    Limits(slots=4, max_len=MAX_LEN))
    srv = make_server(engine, target.tokenizer, "smollm2", port=0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}", target
    srv.close()
    thread.join(10)
    assert not thread.is_alive() and not srv.worker.thread.is_alive()


def _ar_text(target, question: str, max_tokens: int) -> str:
    ids = target.tokenizer.encode_chat([{"role": "user", "content": question}], add_generation_prompt=True)
    [done] = decode(target.params, target.cfg, [ids], max_tokens, max_len=AR_LEN,
                    stop_ids=target.tokenizer.stop_token_ids)
    out = done.token_ids
    return target.tokenizer.decode([t for t in out if t not in target.tokenizer.stop_token_ids])


@pytest.mark.slow
@pytest.mark.e2e
def test_thirty_two_concurrent_chat_clients_get_ar_answers(server):
    srv, url, target = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "smollm2"
    want = {q: _ar_text(target, q, 6) for q in QUESTIONS}

    def ask(i: int) -> tuple[str, dict]:
        q = QUESTIONS[i % len(QUESTIONS)]
        body = {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 6}
        return q, httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    for q, answer in answers:
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == want[q], q
        assert answer["usage"]["completion_tokens"] <= 6 and answer["dflash"]["steps"] >= 1
    metrics = httpx.get(f"{url}/metrics").text
    assert "dflash_generated_tokens_total" in metrics and "dflash_tau_bucket" in metrics


@pytest.mark.e2e
def test_streaming_equals_the_plain_answer(server):
    srv, url, target = server
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    chunks, done = [], False
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done and chunks[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["usage"] == plain["usage"]
    text = plain["choices"][0]["text"]
    cut = {**body, "stop": text[len(text) // 3: len(text) // 3 + 5]}  # spans tokens: its start must not leak
    whole = httpx.post(f"{url}/v1/completions", json=cut, timeout=120).json()["choices"][0]
    assert _stream_text(url, "/v1/completions", cut) == (whole["text"], whole["finish_reason"])
    assert whole["text"] == text[: text.index(cut["stop"])] and whole["finish_reason"] == "stop"


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "payload", "status", "needle"), [
    ("/v1/completions", b"{not json", 400, "must be JSON"),
    ("/v1/completions", {"prompt": "hi", "bogus": 1}, 400, "unknown field(s) ['bogus']"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be an integer in [1, 2**31)"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model 'gpt-9' does not exist"),
    ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 4}, 400, "must fit the context length max_len (512"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "context length max_len (512 tokens)"),
    ("/v1/completions", {"prompt": [1, 49152]}, 400, "prompt[1] must be a token id in [0, 49152)"),
    ("/v1/completions", {"prompt": [1, 2**31]}, 400, "prompt[1] must be a token id, an integer in [0, 2**31)"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, 400, "top_k must be an integer in [-1, 2**31)"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop must be a string or a list of non-empty strings"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]}, 400,
     "chat_template_kwargs must be an object"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be a number in [0, 100]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be a number in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2.5}, 400, "top_k must be an integer in [-1, 2**31)"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed must be an integer in [0, 2**63)"),
    ("/v1/nothing", {}, 404, "no route"),
])
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server, path, payload, status, needle):
    srv, url, _ = server
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    resp = httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=120)
    assert resp.status_code == status
    assert needle in resp.json()["error"]["message"]
    assert "max_new_tokens" not in resp.json()["error"]["message"]  # the request's words, not the engine's
    if isinstance(payload, dict) and path != "/v1/nothing":  # a stream is refused before its first byte
        streamed = httpx.post(f"{url}{path}", json={**payload, "stream": True}, timeout=120)
        assert streamed.status_code == status and needle in streamed.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# slow: test_http's test_the_seed_used_is_reported_and_an_unseeded_request_draws_one (the seed reported, fresh
# entropy without one, sent back to the worker) and test_engine's sampled tests (a seed fixes a sampled output)
@pytest.mark.slow
@pytest.mark.e2e
def test_unseeded_sampled_requests_are_independent_and_a_reported_seed_replays(server):
    """OpenAI's semantics: four identical T=1 requests without a seed are not all equal (each draws 63 bits of
    fresh entropy); the seed each reports (`dflash.seed`, the `X-DFlash-Seed` header) reproduces its reply."""
    srv, url, target = server
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTIONS[6]}], "max_tokens": 8,
            "temperature": 1.0}

    def ask(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, [body] * 4))
    texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
    seeds = [r.json()["dflash"]["seed"] for r in replies]
    assert [int(r.headers["x-dflash-seed"]) for r in replies] == seeds and len(set(seeds)) == 4
    assert len(set(texts)) > 1, texts
    again = ask({**body, "seed": seeds[0]}).json()
    assert again["choices"][0]["message"]["content"] == texts[0] and again["dflash"]["seed"] == seeds[0]


@pytest.mark.slow
@pytest.mark.e2e
def test_sampled_and_greedy_requests_share_the_engine(server):
    """Per-request rules: sampled requests run beside greedy ones; a seed reproduces its answer, the greedy
    answers stay AR-equal; a stop string cuts the text and ends the request at that token."""
    srv, url, target = server
    question = QUESTIONS[5]
    sampled = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 12,
               "temperature": 1.2, "top_k": 50}

    def ask(body: dict) -> dict:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()

    bodies = [dict(sampled, seed=s) for s in (1, 1, 2, 3, 4)] + [
        {"model": "smollm2", "messages": [{"role": "user", "content": q}], "max_tokens": 8} for q in QUESTIONS[:3]]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = [a["choices"][0]["message"]["content"] for a in pool.map(ask, bodies)]
    assert answers[0] == answers[1]  # same seed, same rule: same text, whatever else shared the steps
    assert len(set(answers[:5])) >= 3  # other seeds really sample
    assert answers[5:] == [_ar_text(target, q, 8) for q in QUESTIONS[:3]]
    want = _ar_text(target, question, 12)
    stop = want[len(want) // 2: len(want) // 2 + 3]
    cut = ask({"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 12,
               "stop": [stop]})
    assert cut["choices"][0]["message"]["content"] == want[: want.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] < 12


@pytest.mark.e2e
def test_a_stock_openai_client_gets_ar_answers(server):
    """The official `openai` client (chat and completions, plain and streamed) against the server."""
    import openai

    srv, url, target = server
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120) as client:
        _ask_openai(client, target)


def _ask_openai(client, target) -> None:
    import openai

    assert [m.id for m in client.models.list()] == ["smollm2"]
    question = QUESTIONS[3]
    want = _ar_text(target, question, 10)
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                          max_tokens=10)
    assert chat.choices[0].message.content == want and chat.usage.completion_tokens <= 10
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                            max_tokens=10, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    text = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5)
    assert text.choices[0].text and text.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be an integer in \[1, 2\*\*31\)"):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=0)


@pytest.mark.e2e
def test_an_engine_failure_gives_503_and_the_server_recovers(server, monkeypatch):
    srv, url, _ = server
    engine = srv.worker.engine
    real_decode = engine.decode  # the worker admits, publishes the first tokens, then decodes
    calls = {"n": 0}

    def failing_decode():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return real_decode()

    monkeypatch.setattr(engine, "decode", failing_decode)
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=120)
    assert bad.status_code == 503 and "simulated device fault" in bad.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------------------- issue 32


def _stream_text(url: str, path: str, body: dict) -> tuple[str, str]:
    """(streamed text, finish reason) of one streamed request."""
    text, reason = "", None
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                reason = choice["finish_reason"] or reason
    return text, reason


@pytest.mark.slow
@pytest.mark.e2e
def test_streamed_and_whole_answers_are_equal_over_many_stop_strings(server):
    """Stop strings live in the engine and streams hold back text that could still become one, so a stop
    string that spans tokens never leaks into a stream (issue 32: `stop="2. Blue"` streamed `'1. Red\\n2.'`)."""
    srv, url, target = server
    cases = []
    for prompt in ["List three colors:\n1.", "The capital of France is", "def add(a, b):"]:
        body = {"prompt": prompt, "max_tokens": 16}
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
        for start, size in [(1, 2), (len(want) // 3, 4), (len(want) // 2, 6), (len(want) - 3, 3)]:
            stop = want[max(start, 0): max(start, 0) + size]
            if stop.strip():
                cases.append({**body, "stop": [stop, "\u00a7never"]})
    assert len(cases) >= 9

    def both(body: dict) -> tuple[tuple[str, str], tuple[str, str]]:
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]
        return (whole["text"], whole["finish_reason"]), _stream_text(url, "/v1/completions", body)

    with ThreadPoolExecutor(8) as pool:
        for body, (whole, streamed) in zip(cases, pool.map(both, cases), strict=True):
            assert streamed == whole, body
            assert whole[1] == "stop" and body["stop"][0] not in whole[0]


@pytest.mark.e2e
def test_a_bad_request_never_touches_the_streams_in_flight(server):
    """Token ids out of range, top_k past int32: refused at the door while three streams run, which finish
    with their AR answers."""
    srv, url, target = server
    want = {q: _ar_text(target, q, 8) for q in QUESTIONS[:3]}

    def ask(q: str) -> tuple[str, str | None]:
        return _stream_text(url, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": q}], "max_tokens": 8})

    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(ask, q) for q in want]
        for body in ({"prompt": [1, 2**31 + 5]}, {"prompt": [49152]}, {"prompt": "hi", "top_k": 2**31},
                     {"prompt": [-1]}, {"prompt": "hi", "stop": 5}):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 400
        assert [f.result()[0] for f in streams] == list(want.values())


@pytest.mark.e2e
def test_request_shapes_of_stock_clients(server):
    """Several prompts (text and ids) with n, chat content as text parts, continuous usage, the role chunk,
    /v1/models/{id} with the context length."""
    srv, url, target = server
    ids = target.tokenizer.encode("The capital of France is")
    body = {"prompt": ["The capital of France is", ids], "max_tokens": 4, "n": 2, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3] and len(set(texts)) == 1  # greedy: one answer
    single = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 4}, timeout=300).json()
    assert texts[0] == single["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens"] == 2 * len(ids) and answer["usage"]["completion_tokens"] == 16
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[0]}]}]
    chunks = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json={
            "messages": parts, "max_tokens": 6, "stream": True,
            "stream_options": {"continuous_usage_stats": True, "include_usage": True}}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["usage"] is not None for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == _ar_text(
        target, QUESTIONS[0], 6)
    card = httpx.get(f"{url}/v1/models/smollm2", timeout=30).json()
    assert card["max_model_len"] == MAX_LEN == httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0][
        "max_model_len"]


@pytest.mark.e2e
def test_echo_logprobs_are_the_targets_own(server):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0 or 1) gives the log-probabilities of a
    plain target forward pass in fp32; chat top_logprobs are sorted and hold the chosen greedy token."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash.models.decoder import forward

    srv, url, target = server
    ids = target.tokenizer.encode("Paris is the capital of France")
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 3, "temperature": 0}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]
    logits, _ = forward(target.params, target.cfg, jnp.asarray([ids], jnp.int32))
    rows = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
    got = choice["logprobs"]["token_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    np.testing.assert_allclose(got[1:], [rows[i - 1, ids[i]] for i in range(1, len(ids))], atol=1e-4)
    assert choice["text"] == target.tokenizer.decode(ids)
    assert all(len(top) == 3 for top in choice["logprobs"]["top_logprobs"][1:])
    lm_eval = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=300).json()
    assert lm_eval["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == got
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 4, "logprobs": True,
        "top_logprobs": 5}).json()["choices"][0]
    for entry in chat["logprobs"]["content"]:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["logprob"] == tops[0]  # greedy: the likeliest


@pytest.mark.slow
@pytest.mark.e2e
def test_no_max_tokens_runs_until_a_stop_or_the_context_ends(server):
    """No max_tokens: the answer ends at a stop token or when the context (max_len) is full, never at a
    server default."""
    srv, url, target = server
    prompt = target.tokenizer.encode("word " * 600)[: MAX_LEN - 40]  # room for 36 new tokens at K = 4
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=600).json()
    reason, used = answer["choices"][0]["finish_reason"], answer["usage"]["total_tokens"]
    assert (reason == "stop" and used < MAX_LEN) or (reason == "length" and used == MAX_LEN - 4)
