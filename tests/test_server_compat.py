"""`dflash serve` with stock clients and hostile ones: documented OpenAI fields accepted at neutral values
(refused with a 400 naming the field otherwise), unknown vendor fields ignored with one warning,
`stream_options.include_usage`, bad / oversized Content-Length, a silent client cut off by the read
timeout, and the API key; the `openai` client over every request shape of the API (chat content as text parts,
completions prompts as str / list[str] / list[int] / list[list[int]], n > 1, chat and completions log-probabilities
with echo, `stream_options.continuous_usage_stats`, models.retrieve, methods and HEAD); guidellm's streaming chat
benchmark and lm-eval's `local-completions` (generate_until and multiple choice), offline. Every case is followed
by a normal request that must still succeed."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dflash.serve.engine import Engine
from dflash.serve.http import HttpLimits, make_server
from dflash.serve.plan import AR, Limits

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


MAX_LEN = 256
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP = 4096
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DATA = Path(__file__).parent / "data"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def server(smollm2_target):
    target = smollm2_target
    # AR: the HTTP layer is under test; test_server_fuzz's slots and context, so the two share compiled programs
    engine = Engine(target.params, target.cfg, None, AR(), Limits(slots=4, max_len=MAX_LEN))
    srv = make_server(engine, target.tokenizer, "smollm2", port=0,
                      limits=HttpLimits(max_body_bytes=CAP, read_timeout=1.0), api_key=KEY, unknown_fields="ignore")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.close()
    thread.join(10)
    assert not thread.is_alive() and not srv.worker.thread.is_alive()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_target, tmp_path_factory) -> Path:
    """The served model's tokenizer as a Hugging Face directory (tokenizer.json + tokenizer_config.json), for
    clients that count tokens with transformers' AutoTokenizer (guidellm's --processor): no Hub access."""
    tok = smollm2_target.tokenizer
    path = tmp_path_factory.mktemp("tokenizer")
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "chat_template": tok.chat_template, "model_max_length": MAX_LEN}))
    return path


def _still_serves(url: str) -> None:
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, headers=AUTH, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def _raw(url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes, float]:
    """Send raw bytes and read until the server closes: (status, whole response, seconds)."""
    port = int(url.rsplit(":", 1)[1])
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data, time.monotonic() - start


def _post_head(length: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _client(url: str, key: str = KEY):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


@pytest.mark.e2e
def test_stock_client_sends_neutral_openai_fields(server):
    srv, url = server
    with _client(url) as client:
        plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6)
        chat = client.chat.completions.create(
            model="smollm2", messages=QUESTION, max_completion_tokens=6, frequency_penalty=0, presence_penalty=0,
            logit_bias={}, logprobs=False, top_logprobs=None, n=1, response_format={"type": "text"},
            tool_choice="none", parallel_tool_calls=False, service_tier="auto", store=False, metadata={"k": "v"},
            modalities=["text"], prediction=None, reasoning_effort=None, user="u1", seed=0, stop=None,
            temperature=0, top_p=1)
        assert chat.choices[0].message.content == plain.choices[0].message.content
        text = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                         best_of=1, echo=False, logprobs=0, suffix=None, frequency_penalty=0.0,
                                         presence_penalty=0, logit_bias=None, n=1, user="u1")
        assert text.choices[0].text and text.usage.completion_tokens == 4
    _still_serves(url)


@pytest.mark.e2e
@pytest.mark.parametrize(("path", "field", "value", "needle"), [
    ("/v1/chat/completions", "presence_penalty", 0.5, "presence_penalty must be 0 (penalties are not supported); "
                                                      "received 0.5"),
    ("/v1/completions", "logprobs", 6, "logprobs"),  # completions take at most 5
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}], "tool calling"),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}, "structured output"),
    ("/v1/completions", "best_of", 3, "best_of must be 1"),
])
def test_non_neutral_openai_fields_get_400_naming_the_field(server, path, field, value, needle):
    srv, url = server
    body = {"model": "smollm2", "max_tokens": 2, field: value,
            **({"messages": QUESTION} if "chat" in path else {"prompt": "hi"})}
    resp = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == field and needle in err["message"]
    _still_serves(url)


@pytest.mark.e2e
def test_unknown_vendor_fields_are_ignored_with_one_warning(server, caplog):
    srv, url = server
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "repetition_penalty": 1.0, "length_penalty": 1.0}
    with caplog.at_level(logging.WARNING, logger="dflash.serve.http"):
        for _ in range(3):
            resp = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    warned = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sum("'repetition_penalty'" in m for m in warned) == 1
    assert sum("'length_penalty'" in m for m in warned) == 1
    _still_serves(url)


@pytest.mark.e2e
def test_stream_include_usage_ends_with_a_usage_chunk(server):
    srv, url = server
    with _client(url) as client:
        plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6)
        chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    _still_serves(url)


@pytest.mark.e2e
@pytest.mark.parametrize("length", ["abc", "-5", "1e3"])
def test_a_bad_content_length_gets_400(server, length):
    srv, url = server
    status, data, _ = _raw(url, _post_head(length), b"{}")
    assert status == 400 and b"Content-Length must be a non-negative integer" in data
    _still_serves(url)


@pytest.mark.e2e
def test_a_body_over_the_cap_gets_413_unread(server):
    srv, url = server
    status, data, _ = _raw(url, _post_head(str(CAP * 100)), b'{"prompt": "')
    assert status == 413 and b"at most 4096" in data
    too_big = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * (CAP + 10)}, headers=AUTH, timeout=60)
    assert too_big.status_code == 413
    _still_serves(url)


@pytest.mark.e2e
def test_a_silent_client_is_cut_off_after_the_read_timeout(server):
    srv, url = server
    status, data, seconds = _raw(url, _post_head("100"))  # the socket's own 20 s timeout bounds a server that hangs
    # the 408 names the read timeout, which cannot end the wait before it has passed (no upper wall-clock bound: a
    # loaded machine may answer late, and that is not what this test is about)
    assert status == 408 and b"did not arrive within 1.0 s" in data and seconds >= srv.read_timeout
    _still_serves(url)


@pytest.mark.e2e
def test_the_api_key_guards_v1_but_not_health(server):
    import openai

    srv, url = server
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    missing = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert missing.status_code == 401 and "API key" in missing.json()["error"]["message"]
    wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=60)
    assert wrong.status_code == 401
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{url}/health", timeout=60).json() == {"status": "ok"}
    with _client(url, "nope") as bad, pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smollm2", prompt="hi", max_tokens=2)
    with _client(url) as client:
        assert [m.id for m in client.models.list()] == ["smollm2"]
        out = client.completions.create(model="smollm2", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens == 2
    _still_serves(url)



def test_a_client_gone_mid_stream_frees_its_slot_without_a_traceback(server, caplog):
    srv, url = server
    engine = srv.worker.engine
    port = int(url.rsplit(":", 1)[1])
    body = (b'{"messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}], '
            b'"max_tokens": 200, "stream": true}')
    head = _post_head(str(len(body))).replace(b"/v1/completions", b"/v1/chat/completions")
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(head + body)
            seen = b""
            while b"data: " not in seen:  # streaming has begun
                chunk = sock.recv(65536)
                assert chunk, seen
                seen += chunk

        def cancelled() -> bool:
            return any("client" in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records)

        def idle() -> bool:  # the chat stream's first event is sent before the engine thread takes the job
            return not (engine.running or engine.queue or srv.worker.jobs or not srv.worker.inbox.empty())

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (cancelled() and idle()):
            time.sleep(0.05)
        assert cancelled(), "the disconnect was not noticed"
        assert idle(), "the request kept decoding"
        assert engine.pool.num_free == engine.pool.num_usable, "its pages were not given back"
    assert engine.done == {}, "the cancelled request was not handed back"
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in caplog.records), "a traceback was logged"
    _still_serves(url)


@pytest.mark.slow
@pytest.mark.e2e
def test_lm_eval_local_chat_completions_runs_a_local_task(server, tmp_path):
    """A third-party client as users run it: lm-evaluation-harness's `local-chat-completions` model on a local
    generate_until task (offline: the data is a local JSONL file), with the API key."""
    import json
    import os
    import subprocess
    import sys

    _, url = server
    (tmp_path / "qa.jsonl").write_text(
        '{"question": "What is 2+3? Answer with a number only.", "answer": "5"}\n'
        '{"question": "What is the capital of France? Answer with one word.", "answer": "Paris"}\n')
    (tmp_path / "dflash_qa.yaml").write_text(
        f"task: dflash_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'qa.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\nmetric_list:\n  - metric: exact_match\n"
        "    aggregation: mean\n    higher_is_better: true\n")
    args = f"model=smollm2,base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": KEY}  # its key source
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-chat-completions", "--model_args", args,
                           "--tasks", "dflash_qa", "--include_path", str(tmp_path), "--apply_chat_template",
                           "--output_path", str(tmp_path / "out"), "--log_samples"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    assert 0.0 <= json.loads(results.read_text())["results"]["dflash_qa"]["exact_match,none"] <= 1.0
    [samples] = (tmp_path / "out").rglob("samples_dflash_qa_*.jsonl")
    replies = [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]
    assert len(replies) == 2 and all(isinstance(r, str) and r.strip() for r in replies), replies
    _still_serves(url)


@pytest.mark.e2e
def test_guidellm_benchmarks_streaming_chat_with_ttft_and_itl(server, hf_tokenizer, tmp_path):
    """guidellm as users run it (its own console script): a synchronous streaming chat-completions run over a
    local prompt file, token counts from the served model's tokenizer given as a local directory, JSON report.
    Its requests carry `stream_options.include_usage`, `max_tokens` + `max_completion_tokens`, `stop: null` and
    the vendor field `ignore_eos` (ignored here with one warning)."""
    _, url = server
    out = tmp_path / "report.json"
    env = {**os.environ, **OFFLINE, "GUIDELLM__PREFERRED_ROUTE": "chat_completions",
           "GUIDELLM__OPENAI__API_KEY": KEY, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    done = subprocess.run([str(Path(sys.executable).with_name("guidellm")), "benchmark", "--target", url,
                           "--model", "smollm2", "--processor", str(hf_tokenizer), "--data",
                           str(DATA / "guidellm_prompts.jsonl"), "--rate-type", "synchronous", "--max-requests", "4",
                           "--random-seed", "0", "--disable-progress", "--output-path", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    [bench] = json.loads(out.read_text())["benchmarks"]
    totals = bench["request_totals"]
    errors = [r.get("error") for r in bench["requests"]["errored"]]
    assert totals["successful"] == 4 and totals["errored"] == 0 and totals["incomplete"] == 0, (totals, errors)
    metrics = bench["metrics"]
    for name in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency"):
        stats = metrics[name]["successful"]
        assert stats["count"] > 0 and stats["mean"] > 0 and stats["min"] > 0, (name, stats)
    assert metrics["output_token_count"]["successful"]["min"] > 1, metrics["output_token_count"]  # ITL needs 2+
    _still_serves(url)


@pytest.mark.slow  # ~35 s: nightly; lm-eval's local-chat-completions run and the echo log-probability shapes stay
@pytest.mark.e2e
def test_lm_eval_local_completions_runs_generate_until_and_multiple_choice(server, hf_tokenizer, tmp_path):
    """lm-evaluation-harness's `local-completions` model with its default settings (tokenized requests: `prompt`
    as a list of one token-id list), offline: a local generate_until task (`max_tokens`, `stop`, `seed`) and a
    local multiple-choice task, whose loglikelihood requests are `echo: true, logprobs: 1, max_tokens: 1` and
    read `logprobs.token_logprobs` / `top_logprobs` of the echoed prompt. The tokenizer is the served model's,
    as a local directory (lm-eval first probes GET /tokenizer_info, gets a 404 and falls back to it)."""
    _, url = server
    args = f"model=smollm2,base_url={url}/v1/completions,tokenizer={hf_tokenizer},num_concurrent=1,max_retries=1"
    env = {**os.environ, **OFFLINE, "OPENAI_API_KEY": KEY}  # lm-eval's key source
    tasks = DATA / "lm_eval"
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "dflash_gen,dflash_mc", "--include_path", str(tasks), "--output_path",
                           str(tmp_path / "out"), "--log_samples"], cwd=tasks, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [results] = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert 0.0 <= scores["dflash_gen"]["exact_match,none"] <= 1.0, scores
    assert 0.0 <= scores["dflash_mc"]["acc,none"] <= 1.0, scores
    [samples] = (tmp_path / "out").rglob("samples_dflash_mc_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == 3
    for doc in docs:  # one (log-likelihood, is-greedy) per choice: finite, negative, not all equal
        lls = [float(resp[0][0]) for resp in doc["resps"]]  # lm-eval logs them as strings
        assert len(lls) == 3 and all(-1e4 < ll < 0 for ll in lls) and len(set(lls)) > 1, doc["resps"]
    [samples] = (tmp_path / "out").rglob("samples_dflash_gen_*.jsonl")
    replies = [json.loads(line)["resps"][0][0] for line in samples.read_text().splitlines()]
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies), replies
    _still_serves(url)


# ------------------------------------------------------------------ every request shape (issue 32 items 2, 3)

PROMPT = "The capital of France is"


@pytest.mark.e2e
def test_chat_content_as_a_list_of_text_parts(server):
    _, url = server
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    with _client(url) as client:
        plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6)
        listed = client.chat.completions.create(model="smollm2", messages=parts, max_tokens=6)
        split = client.chat.completions.create(model="smollm2", max_tokens=6, messages=[
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " 2+2?"}]}])
    assert listed.choices[0].message.content == plain.choices[0].message.content
    assert listed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert split.choices[0].message.content and split.usage.completion_tokens > 0
    _still_serves(url)


@pytest.mark.e2e
def test_completions_prompt_in_every_shape_answers_each_prompt_by_index(server):
    srv, url = server
    tok = srv.tokenizer
    other = "Two plus two equals"
    ids, other_ids = tok.encode(PROMPT), tok.encode(other)
    with _client(url) as client:
        def ask(prompt):
            return client.completions.create(model="smollm2", prompt=prompt, max_tokens=4)

        one, two = ask(PROMPT), ask(other)
        texts = [one.choices[0].text, two.choices[0].text]
        for shape in ([PROMPT, other], [ids, other_ids]):
            both = ask(shape)
            assert [c.index for c in both.choices] == [0, 1]
            assert [c.text for c in both.choices] == texts, shape
            assert both.usage.prompt_tokens == len(ids) + len(other_ids)
            assert both.usage.completion_tokens == one.usage.completion_tokens + two.usage.completion_tokens
        assert ask(ids).choices[0].text == texts[0]
        assert ask([PROMPT]).choices[0].text == texts[0]
        assert len({one.id, two.id, ask(PROMPT).id}) == 3, "response ids repeat"
    _still_serves(url)


@pytest.mark.e2e
def test_n_samples_of_one_prompt_come_back_as_indexed_choices(server):
    _, url = server
    with _client(url) as client:
        chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=5, n=3,
                                              temperature=1.0, seed=7)
        text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=7)
        again = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=7)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.content for c in chat.choices)
    assert [c.index for c in text.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in text.choices], "a seed must repeat its samples"
    _still_serves(url)


@pytest.mark.e2e
def test_chat_logprobs_and_top_logprobs(server):
    import openai

    _, url = server
    with _client(url) as client:
        out = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, logprobs=True,
                                             top_logprobs=3)
        content = out.choices[0].logprobs.content
        assert len(content) == out.usage.completion_tokens
        for entry in content:  # greedy: the chosen token is the most likely one
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0.0
            assert entry.logprob == pytest.approx(tops[0], abs=1e-5) and entry.token == entry.top_logprobs[0].token
        assert "".join(e.token for e in content) == out.choices[0].message.content
        bare = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, logprobs=True)
        assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2, logprobs=True,
                                           top_logprobs=21)
    _still_serves(url)


@pytest.mark.e2e
def test_completions_logprobs_with_echo_give_the_prompts_log_probabilities(server):
    import openai

    srv, url = server
    n_prompt = len(srv.tokenizer.encode(PROMPT))
    with _client(url) as client:
        out = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, logprobs=2, echo=True)
        [choice] = out.choices
        lp = choice.logprobs
        total = n_prompt + out.usage.completion_tokens
        assert choice.text.startswith(PROMPT) and out.usage.prompt_tokens == n_prompt
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == total
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0.0 for x in lp.token_logprobs[1:])
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the 2 likeliest + the chosen one, by text
        assert lp.text_offset == sorted(lp.text_offset)
        # the generated tokens' log-probabilities (decode) equal those of the same text echoed (prefill)
        ids = srv.tokenizer.encode(choice.text)
        assert len(ids) == total, "this prompt and its greedy answer re-encode to the same tokens"
        echoed = client.completions.create(model="smollm2", prompt=ids, max_tokens=1, logprobs=0, echo=True)
        assert echoed.choices[0].logprobs.token_logprobs[1:total] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
        with pytest.raises(openai.BadRequestError, match="logprobs"):
            client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, logprobs=6)
    _still_serves(url)


@pytest.mark.e2e
def test_stream_continuous_usage_stats_and_the_first_chat_chunk_carries_the_role(server):
    _, url = server
    options = {"include_usage": True, "continuous_usage_stats": True}
    with _client(url) as client:
        plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6)
        chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, stream=True,
                                                     stream_options=options))
        texts = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, stream=True,
                                               stream_options=options))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    for stream in (chunks, texts):
        assert all(c.usage is not None for c in stream), "continuous_usage_stats: every chunk has usage"
        counts = [c.usage.completion_tokens for c in stream]
        assert counts == sorted(counts) and stream[-1].choices == []
        assert len({c.id for c in stream}) == 1
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    _still_serves(url)


@pytest.mark.e2e
def test_models_retrieve_reports_the_context_length(server):
    _, url = server
    with _client(url) as client:
        model = client.models.retrieve("smollm2")
        listed = client.models.list()
    assert model.id == "smollm2" and model.max_model_len == MAX_LEN
    assert [m.max_model_len for m in listed] == [MAX_LEN]
    assert httpx.get(f"{url}/v1/models/nope", headers=AUTH, timeout=60).status_code == 404
    _still_serves(url)


@pytest.mark.e2e
def test_methods_heads_and_query_strings(server):
    _, url = server
    wrong = httpx.get(f"{url}/v1/completions", headers=AUTH, timeout=60)
    assert wrong.status_code == 405 and "POST" in wrong.headers["Allow"]
    assert httpx.put(f"{url}/v1/models", headers=AUTH, timeout=60).status_code == 405
    head = httpx.head(f"{url}/health", timeout=60)
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(f"{url}/v1/models?limit=1", headers=AUTH, timeout=60).status_code == 200
    query = httpx.post(f"{url}/v1/completions?x=1", json={"prompt": [1, 2, 3], "max_tokens": 2}, headers=AUTH,
                       timeout=120)
    assert query.status_code == 200
    _still_serves(url)
