"""Regeneration with the target (data/regenerate.py): equals direct AR decoding, multi-turn feeds the
regenerated replies back, resumes after a crash to exactly the uninterrupted file, errors are isolated.

The target is a tiny random llama (vocab 49152, hidden 32) under the real SmolLM2 tokenizer from the
packaged GGUF, so prompts go through the real chat template; the row of `<|im_end|>` in its (tied)
embedding is scaled up so that some replies stop and others run into max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash.data.files import FlushPolicy
from dflash.data.regen_store import part_files, parts_dir, read_regenerated, repair_jsonl
from dflash.data.regenerate import (
    ItemError,
    RegenConfig,
    make_regen_engine,
    regenerate,
    request_seed,
    split_turns,
)
from dflash.models.config import DecoderConfig
from dflash.models.loading import _MATRICES, expected_shapes, layer_param_names
from dflash.models.registry import default_gguf_path
from dflash.models.target import Target
from dflash.models.tokenizer import load_tokenizer
from dflash.serve.engine import decode

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


MAX_LEN = 256
MAX_NEW = 24
IM_END = 2
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def target() -> Target:
    tok = load_tokenizer(default_gguf_path())
    cfg = DecoderConfig(family="llama", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e5,
                        tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    shapes = expected_shapes(cfg)

    def layer_param(name: str) -> np.ndarray:
        if name not in _MATRICES:
            return np.ones((cfg.num_layers, *shapes[name]), np.float32)
        return np.stack([0.3 * rng.standard_normal(shapes[name]).T for _ in range(cfg.num_layers)])

    layers = {name: layer_param(name) for name in layer_param_names(cfg)}
    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    embed[IM_END] *= 2.5  # some replies stop, some hit max_new_tokens
    params = {"embed": embed, "final_norm": np.ones(cfg.hidden_size, np.float32), "layers": layers}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    return Target("tiny-random", Path("tiny"), cfg, params, tok, jnp.float32)


@pytest.fixture(scope="module")
def engines(target):
    """One engine per (slots, temperature), reused across tests (regenerate leaves it idle)."""
    cache = {}

    def get(slots: int, temperature: float = 0.0):
        if (slots, temperature) not in cache:
            sampling = RegenConfig(temperature=temperature, top_p=0.9).sampling
            cache[slots, temperature] = make_regen_engine(target, slots=slots, max_len=MAX_LEN, sampling=sampling)
        return cache[slots, temperature]

    return get


def _items(n: int) -> list[dict]:
    """A mix: single-turn, two-turn with and without the final reply, one with its own system turn."""
    items = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                    {"role": "assistant", "content": f"ORIGINAL answer {i}"}]
        if i % 3 != 0:
            messages.append({"role": "user", "content": f"And times {i}?"})
            if i % 3 == 1:
                messages.append({"role": "assistant", "content": f"ORIGINAL follow-up {i}"})
        if i == 2:
            messages.insert(0, {"role": "system", "content": "Own system prompt."})
        items.append({"id": f"item-{i}", "source": "unit", "messages": messages})
    return items


def _read(path: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r["id"]: r for r in records}
    assert len(by_id) == len(records), "an id is written twice"
    return by_id


def _spy(engine, monkeypatch) -> list[list[int]]:
    """Record every prompt submitted to `engine`."""
    prompts: list[list[int]] = []
    submit = engine.submit

    def recording(prompt_ids, *args, **kwargs):
        prompts.append(list(prompt_ids))
        return submit(prompt_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    return prompts


@pytest.mark.slow
def test_greedy_equals_direct_ar_turn_by_turn(target, engines, tmp_path, monkeypatch):
    tok = target.tokenizer
    items = _items(6)
    cfg = RegenConfig(system_prompt=SYSTEM, max_new_tokens=MAX_NEW, max_len=MAX_LEN, slots=4)
    engine = engines(4)
    prompts = _spy(engine, monkeypatch)
    stats = regenerate(engine, tok, items, tmp_path / "out.jsonl", cfg, progress=False)
    out = _read(tmp_path / "out.jsonl")
    assert sorted(out) == sorted(i["id"] for i in items)
    assert (stats.succeeded, stats.errors, stats.skipped) == (6, 0, 0)
    assert stats.turns == sum(len(r["finish_reasons"]) for r in out.values()) == 10
    assert stats.generated_tokens == sum(r["tokens"] for r in out.values())
    reasons = [f for r in out.values() for f in r["finish_reasons"]]
    assert "stop" in reasons and "length" in reasons  # both endings are exercised
    references = []
    for item in items:
        record = out[item["id"]]
        messages = record["messages"]
        assert record["source"] == "unit"
        assert messages[0] == ({"role": "system", "content": "Own system prompt."} if item["id"] == "item-2"
                               else {"role": "system", "content": SYSTEM})
        assert [m["content"] for m in messages if m["role"] == "user"] == \
               [m["content"] for m in item["messages"] if m["role"] == "user"]
        assert not any("ORIGINAL" in m["content"] for m in messages)
        replies = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        assert messages[-1]["role"] == "assistant" and len(replies) == len(record["finish_reasons"])
        tokens = 0
        for j, reason in zip(replies, record["finish_reasons"], strict=True):
            prompt = tok.encode(tok.apply_chat_template(messages[:j], add_generation_prompt=True))
            references.append(prompt)
            [ref] = decode(target.params, target.cfg, [prompt], MAX_NEW, max_len=MAX_LEN, stop_ids=tok.stop_token_ids)
            tokens += len(ref.token_ids)
            assert reason == ("stop" if ref.stopped else "length")
            reply = ref.token_ids[:-1] if ref.stopped else ref.token_ids
            assert messages[j]["content"] == tok.decode(reply), (item["id"], j)
        assert record["tokens"] == tokens
    assert sorted(prompts) == sorted(references)  # the engine saw exactly these prompts
    assert stats.prompt_tokens == sum(map(len, references))


def test_turn_two_prompt_holds_the_regenerated_reply(target, engines, tmp_path, monkeypatch):
    tok = target.tokenizer
    item = _items(2)[1]  # user, assistant, user, assistant
    engine = engines(4)
    prompts = _spy(engine, monkeypatch)
    cfg = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    regenerate(engine, tok, [item], tmp_path / "out.jsonl", cfg, progress=False)
    messages = _read(tmp_path / "out.jsonl")["item-1"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    first, second = (tok.decode(p, skip_special_tokens=False) for p in prompts)
    assert second.startswith(first)
    assert messages[1]["content"] and messages[1]["content"] in second[len(first):]
    assert "ORIGINAL" not in second
    assert second.endswith("And times 1?<|im_end|>\n<|im_start|>assistant\n")

    regenerate(engine, tok, [item], tmp_path / "one.jsonl", dataclasses.replace(cfg, max_turns=1), progress=False)
    assert _read(tmp_path / "one.jsonl")["item-1"]["messages"] == messages[:2]


def test_ultrachat_layout_regenerates_multi_turn_through_the_recipe(target, engines, tmp_path, monkeypatch):
    """A local dataset laid out as UltraChat on the Hub (train_sft parquet shards, a `messages` column), named in
    data.prompts with its split, regenerated turn by turn: each reply after the target's own earlier replies."""
    from test_data_sources import ultrachat_layout

    from dflash.configs.recipe import load_recipe
    from dflash.data import stages

    root = ultrachat_layout(tmp_path / "ultrachat_200k")
    recipe = load_recipe("tiny", [f"data.dir={tmp_path / 'data'}", "data.max_prompts=0", "data.max_user_tokens=64",
                                  f"data.prompts=[{{path: '{root}', split: train_sft, label: uc}}]"])
    engine = engines(4)
    monkeypatch.setattr(stages, "make_regen_engine", lambda *a, **k: engine)
    prompts = _spy(engine, monkeypatch)
    mix_stats, stats, out = stages.run_regenerate(recipe, target=target, progress=False)
    assert (mix_stats.sources[0].filtered, mix_stats.sources[0].duplicates, mix_stats.selected) == (1, 1, 3)
    records = _read(out)
    assert sorted(records) == ["uc:0", "uc:1", "uc:2"]
    assert [len(records[i]["messages"]) for i in ("uc:0", "uc:1", "uc:2")] == [4, 2, 6]  # every turn answered
    assert (stats.turns, len(prompts)) == (6, 6)
    tok = target.tokenizer
    three = records["uc:2"]["messages"]
    assert [m["content"] for m in three if m["role"] == "user"] == ["What is 2 + 2?", "And 3 + 3?", "Thanks!"]
    assert not {"4", "6", "You're welcome."} & {m["content"] for m in three if m["role"] == "assistant"}
    for turn in (1, 2):  # turn t's prompt is the template over the target's own replies before it
        expected = tok.encode(tok.apply_chat_template(three[: 2 * turn + 1], add_generation_prompt=True))
        assert expected in prompts, turn


def test_progress_lines_without_a_terminal(target, engines, tmp_path, monkeypatch, capsys):
    """In a pod (stderr is no terminal) regeneration logs done/total, tokens/s and ETA lines, resumed items
    counted as done but not as speed."""
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL", "0.000001")
    items = _items(3)
    cfg = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    regenerate(engines(4), target.tokenizer, items[:1], tmp_path / "p.jsonl", cfg, progress=False)
    capsys.readouterr()
    regenerate(engines(4), target.tokenizer, items, tmp_path / "p.jsonl", cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("regenerate: ")]
    assert lines[0].startswith("regenerate: 2/3 conv (66.7%) | ")  # one resumed, one finished
    assert lines[-1].startswith("regenerate: 3/3 conv (100.0%) | ") and "ETA 0s" in lines[-1]
    assert all(" tokens/s | elapsed " in line for line in lines) and "ok=2 err=0 skip=1" in lines[-1]


def test_resume_after_a_crash_equals_an_uninterrupted_run(target, engines, tmp_path):
    tok = target.tokenizer
    items = _items(9) + [{"id": "empty", "source": "unit", "messages": [{"role": "user", "content": " "}]}]
    cfg = RegenConfig(system_prompt=SYSTEM, temperature=0.8, top_p=0.9, max_new_tokens=MAX_NEW, max_len=MAX_LEN,
                      seed=7, slots=4)
    engine = engines(4, 0.8)
    whole = regenerate(engine, tok, items, tmp_path / "whole.jsonl", cfg, progress=False)
    assert (whole.succeeded, whole.errors) == (9, 1)

    # What a kill leaves (tests/test_data_writes.py kills a real process): chunks renamed into place, one half
    # written under its temporary name; the chunks after it were never written.
    path = tmp_path / "crash.jsonl"
    regenerate(engine, tok, items, path, cfg, progress=False, merge=False, policy=FlushPolicy(records=2))
    chunks = part_files(path)
    assert len(chunks) == 5
    for chunk in chunks[3:]:
        chunk.unlink()
    (parts_dir(path) / (chunks[3].name + ".tmp")).write_text(chunks[3].name[:7])
    kept = {json.loads(line)["id"] for chunk in chunks[:3] for line in chunk.read_text().splitlines()}

    stats = regenerate(engine, tok, items, path, cfg, progress=False)
    assert (stats.succeeded + stats.errors, stats.skipped) == (10 - len(kept), len(kept)) and len(kept) == 6
    assert _read(path) == _read(tmp_path / "whole.jsonl")
    assert path.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()  # sorted by id: the same bytes
    errors = [json.loads(line) for line in (tmp_path / "crash.jsonl.errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["kind"]) for e in errors] == [("empty", "invalid")]
    assert not parts_dir(path).exists()

    again = regenerate(engine, tok, items, path, cfg, progress=False)
    assert (again.succeeded, again.errors, again.skipped, again.generated_tokens) == (0, 0, 10, 0)


@pytest.mark.slow  # ~27 s: nightly; test_engine's sampled-output-does-not-depend-on-the-batch stays
def test_sampled_results_do_not_depend_on_slots(target, engines, tmp_path):
    items = _items(6)
    cfg = RegenConfig(temperature=0.8, top_p=0.9, max_new_tokens=MAX_NEW, max_len=MAX_LEN, seed=3)
    for slots in (1, 4):
        regenerate(engines(slots, 0.8), target.tokenizer, items, tmp_path / f"s{slots}.jsonl", cfg, progress=False)
    one, four = _read(tmp_path / "s1.jsonl"), _read(tmp_path / "s4.jsonl")
    assert one == four
    greedy = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    regenerate(engines(4), target.tokenizer, items, tmp_path / "g.jsonl", greedy, progress=False)
    assert _read(tmp_path / "g.jsonl") != four  # the sampling really sampled


def test_errors_are_written_counted_and_do_not_stop_the_run(target, engines, tmp_path):
    tok = target.tokenizer
    boom = dataclasses.replace(tok, chat_template=(
        "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}"
        + tok.chat_template))
    long_text = " ".join(f"word{i}" for i in range(200))
    items = [
        {"id": "ok", "source": "s", "messages": [{"role": "user", "content": "Hi"}]},
        {"id": "too-long", "source": "s", "messages": [{"role": "user", "content": long_text}]},
        {"id": "empty", "source": "s", "messages": [{"role": "user", "content": ""}]},
        {"id": "role", "source": "s", "messages": [{"role": "robot", "content": "beep"}]},
        {"id": "no-user", "source": "s", "messages": [{"role": "assistant", "content": "hello"}]},
        {"id": "template", "source": "s", "messages": [{"role": "user", "content": "boom"}]},
        {"id": "ok", "source": "s", "messages": [{"role": "user", "content": "a duplicate id"}]},
        {"id": "later-too-long", "source": "s", "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": long_text}]},
        {"source": "s", "messages": [{"role": "user", "content": "no id"}]},
    ]
    cfg = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    out = tmp_path / "out.jsonl"
    stats = regenerate(engines(4), boom, items, out, cfg, progress=False)
    assert (stats.succeeded, stats.errors, stats.skipped, stats.turns_cut) == (2, 6, 1, 1)
    errors = {e["id"]: e for e in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())}
    assert {k: e["kind"] for k, e in errors.items()} == {
        "too-long": "too_long", "empty": "invalid", "role": "invalid", "no-user": "invalid",
        "template": "template", "None": "invalid"}
    assert "must fit the context" in errors["too-long"]["error"] and "no boom here" in errors["template"]["error"]
    done = _read(out)
    assert sorted(done) == ["later-too-long", "ok"]
    assert [m["role"] for m in done["later-too-long"]["messages"]] == ["user", "assistant"]  # cut after turn 1

    limited = regenerate(engines(4), boom, items[:1], tmp_path / "limit.jsonl",
                         dataclasses.replace(cfg, max_prompt_tokens=5), progress=False)
    assert (limited.succeeded, limited.errors) == (0, 1)

    rerun = regenerate(engines(4), boom, items[:-1], out, cfg, progress=False)
    assert (rerun.succeeded, rerun.errors, rerun.skipped) == (0, 0, 8)


def test_drop_truncated(target, engines, tmp_path):
    items = _items(9)
    cfg = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    regenerate(engines(4), target.tokenizer, items, tmp_path / "keep.jsonl", cfg, progress=False)
    stats = regenerate(engines(4), target.tokenizer, items, tmp_path / "drop.jsonl",
                       dataclasses.replace(cfg, drop_truncated=True), progress=False)
    keep, drop = _read(tmp_path / "keep.jsonl"), _read(tmp_path / "drop.jsonl")
    dropped = {e["id"] for e in map(json.loads, (tmp_path / "drop.jsonl.errors.jsonl").read_text().splitlines())}
    assert dropped == {k for k, r in keep.items() if r["finish_reasons"][0] == "length"} and dropped
    assert stats.dropped == len(dropped) and stats.errors == 0
    for k, record in drop.items():
        n = keep[k]["finish_reasons"].index("length") if "length" in keep[k]["finish_reasons"] else 99
        assert record["finish_reasons"] == ["stop"] * min(n, len(keep[k]["finish_reasons"]))
        replies = [j for j, m in enumerate(keep[k]["messages"]) if m["role"] == "assistant"]
        assert record["messages"] == keep[k]["messages"][: replies[len(record["finish_reasons"]) - 1] + 1]


def test_guards(target, engines, tmp_path):
    tok = target.tokenizer
    cfg = RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN)
    regenerate(engines(4), tok, [], tmp_path / "b.jsonl", cfg, progress=False)
    with pytest.raises(ValueError, match="other regeneration settings"):
        regenerate(engines(4), tok, [], tmp_path / "b.jsonl", dataclasses.replace(cfg, max_new_tokens=8))
    regenerate(engines(4), tok, [], tmp_path / "b.jsonl", dataclasses.replace(cfg, slots=2), progress=False)
    with pytest.raises(ValueError, match="regen.max_new_tokens must be >= 1"):
        RegenConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="sampling.top_p"):
        RegenConfig(top_p=0.0)


def test_split_turns_and_seeds():
    u, a, s = ({"role": r, "content": c} for r, c in (("user", "u"), ("assistant", "a"), ("system", "s")))
    assert split_turns([a, u, a, u, u, a, s]) == [[u], [u, u]]  # leading reply and trailing system dropped
    assert split_turns([u, a, u], system_prompt="S") == [[{"role": "system", "content": "S"}, u], [u]]
    assert split_turns([s, u, a, u], system_prompt="S", max_turns=1) == [[s, u]]
    assert split_turns([s, u, u]) == [[s, u], [u]]  # no assistant turn at all (MT-Bench): a reply per user turn
    with pytest.raises(ItemError, match="at least one user turn"):
        split_turns([s, a])
    assert request_seed(0, "x", 0) == request_seed(0, "x", 0) == 1520878665  # sha256: stable across processes
    assert len({request_seed(0, "x", 0), request_seed(1, "x", 0), request_seed(0, "y", 0),
                request_seed(0, "x", 1)}) == 4


def test_repair_keeps_every_complete_line(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "mess')
    records, removed = repair_jsonl(path)
    assert [r["id"] for r in records] == ["a", "b"] and removed == len('{"id": "c", "mess')
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(ValueError, match="f.jsonl:2 must be one JSON object per line"):
        repair_jsonl(path)


# --- regeneration through an OpenAI-compatible server (data/endpoint.py) -----------------------------------------


@pytest.fixture(scope="module")
def server(target):
    """`dflash serve`'s HTTP server over the same tiny target in a thread (key 'sekret'), at the engines' shape."""
    import threading

    from dflash.serve.engine import Engine
    from dflash.serve.http import make_server
    from dflash.serve.plan import AR, Limits

    engine = Engine(target.params, target.cfg, None, AR(), Limits(slots=4, max_len=MAX_LEN))
    httpd = make_server(engine, target.tokenizer, "tiny-random", "127.0.0.1", 0, api_key="sekret")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.close()
    thread.join(timeout=30)


def _endpoint(cfg: RegenConfig, url: str, **fields) -> RegenConfig:
    from dflash.data.config import EndpointConfig

    fields = {"url": url, "model": "tiny-random", "api_key_env": "REGEN_TEST_KEY", "concurrency": 4, **fields}
    return dataclasses.replace(cfg, endpoint=EndpointConfig(**fields))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_endpoint_regeneration_equals_in_process(target, engines, server, tmp_path, monkeypatch, temperature):
    """The same conversations, replies, finish reasons and token counts through the server as in process, greedy
    and sampled (each turn's seed travels with its request), and the same file: a run through one resumes the
    other's."""
    from dflash.data.endpoint import connect

    monkeypatch.setenv("REGEN_TEST_KEY", "sekret")
    tok = target.tokenizer
    items = _items(9)
    cfg = RegenConfig(system_prompt=SYSTEM, temperature=temperature, top_p=0.9, max_new_tokens=MAX_NEW,
                      max_len=MAX_LEN, seed=7)
    local = regenerate(engines(4, temperature), tok, items, tmp_path / "local.jsonl", cfg, progress=False)
    remote_cfg = _endpoint(cfg, server)
    remote = regenerate(connect(remote_cfg, tok, target_source="tiny"), tok, items, tmp_path / "remote.jsonl",
                        remote_cfg, progress=False)
    assert _read(tmp_path / "remote.jsonl") == _read(tmp_path / "local.jsonl")
    assert (remote.succeeded, remote.turns, remote.generated_tokens, remote.prompt_tokens) == (
        local.succeeded, local.turns, local.generated_tokens, local.prompt_tokens)
    # (the random target writes token sequences BPE would not: their texts re-tokenise to other counts, counted)
    assert 0 < remote.retokenized_differs < remote.turns
    meta = json.loads((tmp_path / "remote.jsonl.meta.json").read_text())
    assert meta == json.loads((tmp_path / "local.jsonl.meta.json").read_text())  # the same manifest
    resumed = regenerate(connect(remote_cfg, tok, target_source="tiny"), tok, items, tmp_path / "local.jsonl",
                         remote_cfg, progress=False)
    assert (resumed.succeeded, resumed.skipped) == (0, 9)


def test_endpoint_refuses_another_model_or_tokenizer(target, server, monkeypatch):
    from dflash.configs.schema import ConfigError
    from dflash.data.endpoint import EndpointError, connect

    tok = target.tokenizer
    cfg = _endpoint(RegenConfig(max_new_tokens=MAX_NEW, max_len=MAX_LEN), server)
    monkeypatch.delenv("REGEN_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"api_key_env names an environment variable .*received 'REGEN_TEST_KEY', "
                                          r"which is unset"):
        connect(cfg, tok, target_source="tiny")
    monkeypatch.setenv("REGEN_TEST_KEY", "wrong")
    with pytest.raises(EndpointError, match=r"GET .*/v1/models must answer 200 .*received 401"):
        connect(cfg, tok, target_source="tiny")
    monkeypatch.setenv("REGEN_TEST_KEY", "sekret")
    with pytest.raises(EndpointError, match=r"data.regen.endpoint.model must be a model the server at .* serves "
                                            r"\(\['tiny-random'\]\); received 'tiny' \(default: the recipe's "
                                            r"target.source 'tiny'"):
        connect(_endpoint(cfg, server, model=""), tok, target_source="tiny")
    other = dataclasses.replace(tok, chat_template="System: be brief.\n" + tok.chat_template)  # another template
    with pytest.raises(EndpointError, match=r"does not tokenise like the recipe's target 'tiny': the probe prompt is "
                                            r"\d+ tokens there and \d+ with the recipe's tokenizer"):
        connect(cfg, other, target_source="tiny")
    connect(_endpoint(cfg, server, check=False), other, target_source="tiny")  # the check can be turned off


# --- over a whole slice: shares per process, replicas per device (data/scaleout.py) --------------------------------


def _prompt_file(path: Path, n: int) -> Path:
    """n short single-turn prompts (one prefill length and few context sizes: few programs per device)."""
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} + {i}?"}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)])  # sampled: nightly
def test_the_dataset_does_not_depend_on_the_topology(target, tmp_path, temperature):
    """One device, 4 replicas on 4 devices, 2 replicas each split over 2 devices (tensor parallel, D81), and 2
    processes x 2 devices (each share run on its own, then merged): byte-identical files, greedy and sampled (seeded
    by item id)."""
    from dflash.configs.recipe import load_recipe
    from dflash.data import stages
    from dflash.data.regen_store import merge_parts
    from dflash.data.scaleout import Share, share_of

    N = 10  # noqa: N806
    prompts = _prompt_file(tmp_path / "prompts.jsonl", N)

    def recipe(name: str, replicas: int, per_replica: int = 1):
        return load_recipe("tiny", [f"data.dir={tmp_path / name}", f"data.prompts={prompts}", "data.max_prompts=0",
                                    f"data.regen.replicas={replicas}", f"data.regen.temperature={temperature}",
                                    f"data.regen.devices_per_replica={per_replica}", "data.regen.top_p=0.9",
                                    "data.regen.seed=3", "data.regen.max_new_tokens=12"])

    stages.run_regenerate(recipe("one", 1), target=target, progress=False)
    stages.run_regenerate(recipe("four", 4), target=target, progress=False)
    stages.run_regenerate(recipe("split", 2, per_replica=2), target=target, progress=False)
    sliced = recipe("sliced", 2)
    for index in (1, 0):
        _, stats, _ = stages.run_regenerate(sliced, target=target, progress=False, share=Share(index, 2), merge=False)
        assert stats.succeeded == sum(share_of(f"prompts:{i}", 2) == index for i in range(N)) > 0
    out = sliced.data.regenerated_path
    assert len(part_files(out)) == 2 and not out.exists()
    with pytest.raises(ValueError, match=r"must be merged with its chunks .* rerun `dflash data regenerate`"):
        read_regenerated(out.parent / "regenerated.jsonl")
    merge_parts(out)
    assert not part_files(out) and not (out.parent / "regenerated.jsonl.parts").exists()
    one = (tmp_path / "one" / "regenerated.jsonl").read_bytes()
    assert one == (tmp_path / "four" / "regenerated.jsonl").read_bytes() == out.read_bytes()
    assert one == (tmp_path / "split" / "regenerated.jsonl").read_bytes()
    ids = [json.loads(line)["id"] for line in one.splitlines()]
    assert ids == sorted(ids) and len(ids) == N
    # a rerun on another topology finds everything done
    _, again, _ = stages.run_regenerate(recipe("sliced", 1), target=target, progress=False)
    assert (again.succeeded, again.skipped) == (0, N) and out.read_bytes() == one
