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


def load_eval_set(name: str, limit: int | None = None) -> list[EvalItem]:
    """The first `limit` items (None: all) of a packaged set (`PACKAGED`), a local .json / .jsonl file, or
    `hf:<dataset id>[:split]` (default split `test`)."""
    loaders = {"gsm8k": _gsm8k, "math500": _math500, "humaneval": _humaneval, "mbpp": _mbpp, "mtbench": _mtbench}
    if name in loaders:
        return loaders[name](limit)
    if name.startswith("hf:"):
        return _hub(name[3:], limit)
    path = Path(name).expanduser()
    if path.suffix in (".json", ".jsonl"):
        if not path.is_file():
            raise FileNotFoundError(f"evaluation set file {path} does not exist")
        return _local(path, limit)
    raise ValueError(f"an evaluation set must be one of {list(PACKAGED)}, a .json/.jsonl file or hf:<id>; "
                     f"received {name!r}")


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


__all__ = ["PACKAGED", "EvalItem", "EvalPrompt", "eval_prompts", "load_eval_set"]
