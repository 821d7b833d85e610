"""Evaluation prompt sets in the DFlash reference's formats (z-lab `dflash/benchmark.py`): math asks for
step-by-step reasoning with the final answer in \\boxed{}, HumanEval wraps the function stub in a request
to solve it, MBPP and MT-Bench are sent as written (MT-Bench: two turns, the second on the model's own first
answer). Local .json / .jsonl files and `hf:<dataset id>` work too (a `turns`, `prompt`, `question`,
`problem`, `instruction` or `messages` field per row).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash.data.packaged import _read_jsonl, gsm8k_path, humaneval_path, load_mbpp, load_mtbench, math_path, mbpp_path
from dflash.models.tokenizer import ChatTokenizer

PACKAGED = ("gsm8k", "math500", "humaneval", "mbpp", "mtbench")
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{}\n```")
_PROMPT_FIELDS = ("prompt", "question", "problem", "instruction", "input")


@dataclasses.dataclass(frozen=True)
class EvalItem:
    """One evaluation conversation: its user turns (each answered by the model before the next is sent) and,
    for GSM8K / MATH-500, the reference final answer."""

    id: str
    set: str
    turns: tuple[str, ...]
    answer: str | None = None
    category: str | None = None  # SPEED-Bench's category (a semantic domain, or a throughput split's entropy tier)


def _gsm8k(limit: int | None) -> list[EvalItem]:
    rows = _read_jsonl(gsm8k_path("test"), limit)
    return [EvalItem(f"gsm8k:{i}", "gsm8k", (row["question"].strip() + MATH_SUFFIX,),
                     row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")) for i, row in enumerate(rows)]


def _math500(limit: int | None) -> list[EvalItem]:
    rows = _read_jsonl(math_path("500"), limit)
    return [EvalItem(f"math500:{i}", "math500", (row["problem"].strip() + MATH_SUFFIX,), str(row["answer"]).strip())
            for i, row in enumerate(rows)]


def _humaneval(limit: int | None) -> list[EvalItem]:
    rows = _read_jsonl(humaneval_path(), limit)
    return [EvalItem(f"humaneval:{i}", "humaneval", (HUMANEVAL_FORMAT.format(row["prompt"].strip()),))
            for i, row in enumerate(rows)]


def _mbpp(limit: int | None) -> list[EvalItem]:
    tasks = json.loads(mbpp_path().read_text(encoding="utf-8"))
    tasks = [t for t in tasks if 11 <= int(t["task_id"]) <= 510][:limit]  # the test split, as the reference
    if not tasks:
        load_mbpp("test", limit)  # raises the packaged loader's clear error
    return [EvalItem(f"mbpp:{t['task_id']}", "mbpp", (t["prompt"].strip(),)) for t in tasks]


def _mtbench(limit: int | None) -> list[EvalItem]:
    return [EvalItem(f"mtbench:{i}", "mtbench", tuple(turn["content"] for turn in conv))
            for i, conv in enumerate(load_mtbench(limit))]


def _row_turns(row: Any, where: str) -> tuple[str, ...]:
    if isinstance(row, dict):
        if isinstance(row.get("turns"), list):
            return tuple(str(t) for t in row["turns"])
        if isinstance(row.get("messages"), list):
            return tuple(m["content"] for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user")
        for name in _PROMPT_FIELDS:
            if isinstance(row.get(name), str):
                return (row[name],)
    raise ValueError(f"{where} must have a 'turns' list, 'messages', or one of the fields {list(_PROMPT_FIELDS)}; "
                     f"received {str(row)[:120]!r}")


def _from_rows(name: str, rows: list[Any], limit: int | None) -> list[EvalItem]:
    items = []
    for i, row in enumerate(rows[:limit]):
        turns = tuple(t.strip() for t in _row_turns(row, f"{name} row {i}") if t and t.strip())
        if not turns:
            raise ValueError(f"{name} row {i} has no non-empty user turn")
        answer = row.get("answer") if isinstance(row, dict) and isinstance(row.get("answer"), str) else None
        items.append(EvalItem(f"{name}:{i}", name, turns, answer))
    return items


def _local(path: Path, limit: int | None) -> list[EvalItem]:
    if path.suffix == ".jsonl":
        rows = _read_jsonl(path, None)
    else:
        rows = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(rows, dict):
            rows = next((v for v in rows.values() if isinstance(v, list)), [rows])
    return _from_rows(path.stem, list(rows), limit)


def _hub(dataset_id: str, limit: int | None) -> list[EvalItem]:
    from datasets import load_dataset

    name, _, split = dataset_id.partition(":")
    rows = load_dataset(name, split=split or "test")
    count = min(len(rows), limit or len(rows))
    return _from_rows(name.rsplit("/", 1)[-1], [dict(r) for r in rows.select(range(count))], limit)


# SPEED-Bench (NVIDIA's speculative-decoding benchmark, Hub dataset nvidia/SPEED-Bench): its configs ("splits" here)
# and each one's categories, as its dataset card and NVIDIA's loaders (Model-Optimizer examples/specdec_bench, aiperf's
# speed_bench loader) define them: rows {question_id, category, sub_category, turns: [str], source, src_id,
# difficulty, multiturn}, split `test`; the qualitative config holds 880 prompts, 80 in each of 11 categories, each
# throughput config 1,536 prompts of about 1k..32k input tokens, 512 in each of 3 entropy tiers. Rows whose turns are
# licence placeholders must be prepared first with NVIDIA's specdec_bench `prepare_data.py` (which fetches them from
# their sources); prepared JSONL in the `messages` schema (aiperf's) is read too.
SPEEDBENCH_HUB = "hf:nvidia/SPEED-Bench"
SPEEDBENCH_SPLITS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k",
                     "throughput_32k")
SPEEDBENCH_CATEGORIES = {"qualitative": ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning",
                                         "roleplay", "stem", "summarization", "writing"),
                         **{split: ("low_entropy", "mixed", "high_entropy") for split in SPEEDBENCH_SPLITS[1:]}}
SPEEDBENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def _speedbench_rows(source: str, split: str) -> list[dict[str, Any]]:
    """The rows of SPEED-Bench's `split` from `source`: `hf:<id>` (that config's test split) or a directory holding
    `<split>.jsonl`, `<split>.parquet` or `<split>/` with parquet files (what the prepare scripts write)."""
    if source.startswith("hf:"):
        from datasets import load_dataset

        return [dict(r) for r in load_dataset(source[3:], split, split="test")]
    root = Path(source).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--speedbench must be hf:<dataset id> or a directory of SPEED-Bench splits "
                                f"(<split>.jsonl, <split>.parquet or <split>/*.parquet); received {source!r}, which "
                                "is no directory")
    if (root / f"{split}.jsonl").is_file():
        return _read_jsonl(root / f"{split}.jsonl", None)
    files = [root / f"{split}.parquet"] if (root / f"{split}.parquet").is_file() else \
        sorted((root / split).glob("*.parquet")) if (root / split).is_dir() else []
    if not files:
        raise FileNotFoundError(f"--speedbench directory {root} must hold {split}.jsonl, {split}.parquet or "
                                f"{split}/*.parquet for the split {split!r}; found none")
    import pyarrow.parquet as pq

    return [row for f in files for row in pq.read_table(f).to_pylist()]


def _speedbench(name: str, limit: int | None, source: str) -> list[EvalItem]:
    """`speedbench[:SPLIT][:CATEGORY]`: SPEED-Bench's split (default qualitative), one category of it or all of
    them, the first `limit` rows of each category (so every category is in the per-category table)."""
    parts = name.split(":")[1:]
    split = parts.pop(0) if parts and parts[0] in SPEEDBENCH_SPLITS else "qualitative"
    known = SPEEDBENCH_CATEGORIES[split]
    if len(parts) > 1 or (parts and parts[0] not in known):
        raise ValueError(f"--sets {name!r}: a SPEED-Bench set must be speedbench[:SPLIT][:CATEGORY] with SPLIT one of "
                         f"{list(SPEEDBENCH_SPLITS)} and CATEGORY one of {split}'s {list(known)}; received "
                         f"{':'.join(parts)!r}")
    wanted = parts[0] if parts else None
    taken: dict[str, int] = {}
    items = []
    for i, row in enumerate(_speedbench_rows(source, split)):
        category = str(row.get("category", ""))
        if (wanted and category != wanted) or taken.get(category, 0) >= (limit or 1 << 62):
            continue
        turns = tuple(str(t) for t in row["turns"]) if isinstance(row.get("turns"), list) else \
            _row_turns(row, f"{source} {split} row {i}")
        if any(t.startswith(SPEEDBENCH_PLACEHOLDER) for t in turns):
            raise ValueError(f"SPEED-Bench row {row.get('question_id', i)} ({split}, category {category}) from "
                             f"{source} holds the licence placeholder instead of its prompt: prepare the split with "
                             "NVIDIA's specdec_bench prepare_data.py (Model-Optimizer examples/specdec_bench), then "
                             "pass its output directory as --speedbench DIR")
        taken[category] = taken.get(category, 0) + 1
        items.append(EvalItem(f"{name}:{row.get('question_id', i)}", name, turns, category=category))
    if not items:
        raise ValueError(f"--sets {name!r}: no SPEED-Bench rows of {split}{f' in category {wanted}' if wanted else ''} "
                         f"in {source}")
    return items


def load_eval_set(name: str, limit: int | None = None, speedbench: str = SPEEDBENCH_HUB) -> list[EvalItem]:
    """The first `limit` items (None: all) of a packaged set (`PACKAGED`), a local .json / .jsonl file,
    `hf:<dataset id>[:split]` (default split `test`), or `speedbench[:SPLIT][:CATEGORY]` read from `speedbench`
    (`hf:<id>` or a directory of prepared splits; `limit` per category)."""
    loaders = {"gsm8k": _gsm8k, "math500": _math500, "humaneval": _humaneval, "mbpp": _mbpp, "mtbench": _mtbench}
    if name in loaders:
        return loaders[name](limit)
    if name == "speedbench" or name.startswith("speedbench:"):
        return _speedbench(name, limit, speedbench)
    if name.startswith("hf:"):
        return _hub(name[3:], limit)
    path = Path(name).expanduser()
    if path.suffix in (".json", ".jsonl"):
        if not path.is_file():
            raise FileNotFoundError(f"--sets names the file {str(path)!r}, which does not exist; pass an existing "
                                    f".json/.jsonl file, one of {list(PACKAGED)}, speedbench[:CATEGORY] or hf:<id>")
        return _local(path, limit)
    raise ValueError(f"an evaluation set must be one of {list(PACKAGED)}, speedbench[:SPLIT][:CATEGORY], a "
                     f".json/.jsonl file or hf:<id>; received {name!r}")


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """One held-out prompt: its set and its chat-templated first user turn."""

    set: str
    ids: tuple[int, ...]


def eval_prompts(tokenizer: ChatTokenizer, sets: Sequence[str], per_set: int, skip: int = 0,
                 template_kwargs: Mapping[str, Any] | None = None) -> list[EvalPrompt]:
    """Items `skip` .. `skip + per_set - 1` of each evaluation set (default the first `per_set`), first turn
    only, chat-templated for generation with the template's variables `template_kwargs` (the recipe's
    `data.regen.template_kwargs`: a drafter trained on Qwen3's non-thinking answers is measured on non-thinking
    replies, gpt-oss at the effort and date its answers were made with): the held-out prompts of real τ
    (`serve.acceptance`)."""
    prompts = []
    kwargs = dict(template_kwargs or {})
    for name in sets:
        for item in load_eval_set(name, skip + per_set)[skip:]:
            ids = tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}], add_generation_prompt=True,
                                        **kwargs)
            prompts.append(EvalPrompt(name, tuple(int(t) for t in ids)))
    return prompts


__all__ = ["PACKAGED", "SPEEDBENCH_CATEGORIES", "SPEEDBENCH_HUB", "SPEEDBENCH_SPLITS", "EvalItem", "EvalPrompt",
           "eval_prompts", "load_eval_set"]
