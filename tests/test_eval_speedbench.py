"""SPEED-Bench as `dflash eval --sets speedbench[:SPLIT][:CATEGORY]` (issue 63): its published schema read from a
directory of prepared splits (JSONL or parquet; the Hub is not reachable here), every category or one, `--limit`
per category, placeholder rows refused with what to do, and the report's per-category table. The fixture:
tests/data/speedbench/README.md."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dflash.data.eval_sets import SPEEDBENCH_CATEGORIES, SPEEDBENCH_PLACEHOLDER, load_eval_set
from dflash.eval.report import render_markdown, summarize
from dflash.eval.run import EvalSettings

FIXTURE = Path(__file__).resolve().parent / "data" / "speedbench"


def test_every_category_of_a_split_with_the_limit_per_category():
    items = load_eval_set("speedbench", 1, str(FIXTURE))
    assert [(i.category, i.set) for i in items] == [("coding", "speedbench"), ("math", "speedbench"),
                                                    ("writing", "speedbench")]
    everything = load_eval_set("speedbench", None, str(FIXTURE))
    assert len(everything) == 4 and everything[-1].turns == ("Write two sentences about a lighthouse.",
                                                             "Now make it rhyme.")  # multiturn: both turns
    assert items[0].id == "speedbench:" + "0" * 31 + "1"


def test_one_category_and_the_throughput_tiers():
    coding = load_eval_set("speedbench:coding", None, str(FIXTURE))
    assert {i.category for i in coding} == {"coding"} and len(coding) == 2
    tiers = load_eval_set("speedbench:throughput_1k", None, str(FIXTURE))
    assert [i.category for i in tiers] == ["low_entropy", "mixed", "high_entropy"]
    assert [i.category for i in load_eval_set("speedbench:throughput_1k:mixed", None, str(FIXTURE))] == ["mixed"]
    assert SPEEDBENCH_CATEGORIES["qualitative"][0] == "coding" and len(SPEEDBENCH_CATEGORIES["qualitative"]) == 11


def test_a_parquet_split_reads_as_the_jsonl_one(tmp_path):
    """The Hub's and specdec_bench prepare_data.py's format: parquet, in <split>/ or as <split>.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (FIXTURE / "qualitative.jsonl").read_text().splitlines()]
    (tmp_path / "qualitative").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qualitative" / "test.parquet")
    assert load_eval_set("speedbench", None, str(tmp_path)) == load_eval_set("speedbench", None, str(FIXTURE))


def test_wrong_names_and_unprepared_rows_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"CATEGORY one of qualitative's \['coding'"):
        load_eval_set("speedbench:poetry", 1, str(FIXTURE))
    with pytest.raises(FileNotFoundError, match="throughput_8k.jsonl, throughput_8k.parquet"):
        load_eval_set("speedbench:throughput_8k", 1, str(FIXTURE))
    with pytest.raises(FileNotFoundError, match="no directory"):
        load_eval_set("speedbench", 1, str(tmp_path / "missing"))
    row = {"question_id": "2" * 32, "category": "rag", "turns": [SPEEDBENCH_PLACEHOLDER + "\n\n{question}"]}
    (tmp_path / "qualitative.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="licence placeholder.*prepare_data.py"):
        load_eval_set("speedbench", 1, str(tmp_path))


def test_the_report_has_a_table_per_category():
    def reply(mode, item, accepted, tpot):
        return {"kind": "reply", "mode": mode, "concurrency": 1, "id": item.id, "set": item.set, "turn": 0,
                "category": item.category, "text": "x", "tokens": 10, "finish": "length", "latency_s": 1.0,
                "ttft_s": 0.1, "tpot_s": tpot, "accepted": accepted}

    items = load_eval_set("speedbench", 1, str(FIXTURE))
    records = [r for i, item in enumerate(items) for r in (reply("dflash", item, [i, i], 0.05),
                                                           reply("ar", item, [], 0.10))]
    settings = dataclasses.asdict(EvalSettings(sets=("speedbench",), limit=1))
    meta = {"environment": {}, "target": {"model": "m"}, "drafter": {}, "settings": {**settings, "block_size": 4}}
    results = summarize(records, ["speedbench"], [1], 4, {}, meta)
    assert list(results["categories"]) == ["coding", "math", "writing"]
    assert [results["categories"][c]["tau"] for c in ("coding", "math", "writing")] == [1.0, 2.0, 3.0]
    report = render_markdown(results)
    assert "Per SPEED-Bench category:" in report and "| math | 2.00 |" in report
    plain = summarize([{**r, "category": None} for r in records], ["speedbench"], [1], 4, {}, meta)
    assert plain["categories"] == {} and "Per SPEED-Bench category" not in render_markdown(plain)  # control
