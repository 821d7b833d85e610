"""Prompt sources and the mix that feeds regeneration (docs/design.md §2: prompts -> regenerate with the target).

    spec = parse_mix("sharegpt:3,gsm8k:1")        # or a MixSpec of SourceSpecs (presets, files, Hub ids)
    items, stats = mix(dataclasses.replace(spec, max_prompts=2000, seed=0))
    print(stats.summary())                        # items: [{"id", "source", "messages"}, ...]

Sources: `SourceSpec` (and `load_source` for the record formats read); the mixing rules (ids, dedup,
quotas, sampling): `mix`. Design: docs/decisions.md D15.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from dflash.configs.schema import ConfigError, build, require
from dflash.data import packaged
from dflash.data.config import PRESET_NAMES, SourceSpec, parse_source
from dflash.data.packaged import CleanStats, Conversation

PROMPT_FIELDS = ("prompt", "question", "instruction", "input")
ANSWER_FIELDS = ("response", "output", "answer", "completion")
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_DEFAULT_SPLIT = "train"

# name -> (description, loader(with_answers) -> (conversations, stats)).
_Loader = Callable[[bool], tuple[list[Conversation], CleanStats]]


def _plain(load: Callable[[bool], list[Conversation]]) -> _Loader:
    """A loader that drops nothing: its stats count every conversation as kept."""

    def loader(with_answers: bool) -> tuple[list[Conversation], CleanStats]:
        conversations = load(with_answers)
        return conversations, CleanStats(records=len(conversations), kept=len(conversations), dropped={})

    return loader


PRESETS: dict[str, tuple[str, _Loader]] = {
    "sharegpt": (
        "ShareGPT V3: 17671 complete records, 17296 after cleaning (multi-turn)",
        lambda a: packaged.load_sharegpt(with_answers=a),
    ),
    "gsm8k": ("GSM8K train, 7473", _plain(lambda a: packaged.load_gsm8k("train", with_answers=a))),
    "gsm8k_test": ("GSM8K test, 1319", _plain(lambda a: packaged.load_gsm8k("test", with_answers=a))),
    "math": ("MATH train, 7500", _plain(lambda a: packaged.load_math("train", with_answers=a))),
    "math_test": ("MATH test, 5000 (holds MATH-500)", _plain(lambda a: packaged.load_math("test", with_answers=a))),
    "math500": ("MATH-500, 500", _plain(lambda a: packaged.load_math("500", with_answers=a))),
    "humaneval": ("HumanEval, 164 code prompts", _plain(lambda a: packaged.load_humaneval())),
    "mtbench": ("MT-Bench, 80 two-turn questions", _plain(lambda a: packaged.load_mtbench())),
    "mbpp": ("MBPP sanitized, 427 tasks", _plain(lambda a: packaged.load_mbpp())),
    "mbpp_train": ("MBPP sanitized train + validation + prompt splits, 170 tasks (not in the eval's test split)",
                   _plain(lambda a: [c for s in ("train", "validation", "prompt") for c in packaged.load_mbpp(s)])),
}

assert tuple(PRESETS) == PRESET_NAMES, "data.config.PRESET_NAMES must list the presets PRESETS loads"

Item = dict[str, Any]  # {"id": str, "source": str, "messages": Conversation}


@dataclasses.dataclass(frozen=True)
class MixSpec:
    """A weighted mix of prompt sources (the exact rules: `mix`).

    max_prompts: total number of conversations (0: everything every source has). dedup: drop conversations
    whose user turns repeat an earlier one. seed: sampling and shuffling. with_answers: keep reference
    assistant turns where sources have them (regeneration drops and rewrites them; they also mark where
    each reply goes in multi-turn conversations); with False only system and user turns are kept.
    min_user_tokens / max_user_tokens: leave out conversations whose user turns together hold fewer / more
    tokens (0: no bound; `mix` then needs a token counter, the target's tokenizer).
    """

    sources: tuple[SourceSpec, ...]
    max_prompts: int = 0
    dedup: bool = True
    seed: int = 0
    with_answers: bool = True
    min_user_tokens: int = 0
    max_user_tokens: int = 0

    def __post_init__(self) -> None:
        require(
            isinstance(self.sources, tuple)
            and len(self.sources) > 0
            and all(isinstance(s, SourceSpec) for s in self.sources),
            "mix.sources",
            self.sources,
            "be a non-empty tuple of SourceSpec",
        )
        names = [s.source_name for s in self.sources]
        repeated = sorted({n for n in names if names.count(n) > 1})
        require(
            not repeated,
            "mix.sources",
            repeated,
            "have unique names (ids are '<name>:<index>'); give repeated sources distinct labels",
        )
        require(
            isinstance(self.max_prompts, int) and not isinstance(self.max_prompts, bool) and self.max_prompts >= 0,
            "mix.max_prompts",
            self.max_prompts,
            "be an integer >= 0 (0: all)",
        )
        require(isinstance(self.dedup, bool), "mix.dedup", self.dedup, "be true or false")
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0,
            "mix.seed",
            self.seed,
            "be an integer >= 0",
        )
        require(isinstance(self.with_answers, bool), "mix.with_answers", self.with_answers, "be true or false")
        for key in ("min_user_tokens", "max_user_tokens"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"mix.{key}", value,
                    "be an integer >= 0 (0: no bound)")
        require(self.max_user_tokens == 0 or self.max_user_tokens >= self.min_user_tokens, "mix.max_user_tokens",
                self.max_user_tokens, f"be 0 or >= mix.min_user_tokens ({self.min_user_tokens})")

    @property
    def filters_length(self) -> bool:
        return bool(self.min_user_tokens or self.max_user_tokens)


@dataclasses.dataclass(frozen=True)
class SourceStats:
    """Counts for one source: records read -> `loaded` after cleaning (`invalid` dropped) -> `filtered` out by
    the length bounds -> `duplicates` removed -> `available` after its max_prompts cap -> `selected` into the
    mix."""

    name: str
    records: int
    invalid: int
    loaded: int
    duplicates: int
    available: int
    selected: int
    filtered: int = 0


@dataclasses.dataclass(frozen=True)
class MixStats:
    """Per-source counts of one `mix` call, in the spec's source order; `summary()` prints them as a table."""

    sources: tuple[SourceStats, ...]

    @property
    def selected(self) -> int:
        return sum(s.selected for s in self.sources)

    def summary(self) -> str:
        """A small table, one row per source and a total."""
        header = ("source", "records", "invalid", "loaded", "filtered", "duplicates", "available", "selected")
        rows = [header] + [
            (s.name, *map(str, (s.records, s.invalid, s.loaded, s.filtered, s.duplicates, s.available, s.selected)))
            for s in self.sources
        ]
        totals = [sum(getattr(s, f) for s in self.sources) for f in header[1:]]
        rows.append(("total", *map(str, totals)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        )


def load_source(
    spec: SourceSpec, *, with_answers: bool = True, cache_dir: str | Path | None = None
) -> tuple[list[Conversation], CleanStats]:
    """(conversations, stats) of one source, cleaned; `cache_dir` is datasets' cache (path/hub sources).

    File and Hub records may be in any of three formats, chosen per dataset by its columns:
    - OpenAI `messages`: `[{"role", "content"}, …]`;
    - ShareGPT `conversations`: `[{"from", "value"}, …]` (`role`/`content` keys are accepted too);
    - a prompt column: `prompt_field`, else the first of `PROMPT_FIELDS` present; a record with
      `instruction` and a non-blank `input` (Alpaca, CodeAlpaca) gets `instruction + "\\n\\n" + input`. Its
      reference answer, if any, is `answer_field`, else the first of `ANSWER_FIELDS` present.
    Every record goes through `data.packaged.clean_conversation` (role aliases, leading assistant turns
    trimmed, drops counted by reason), as ShareGPT does.
    """
    if spec.name is not None:
        return PRESETS[spec.name][1](with_answers)
    dataset = _load_dataset(spec, cache_dir)
    fmt = _record_format(spec, dataset.column_names)
    records = [] if fmt is None else [_record_turns(row, fmt) for row in dataset]
    return packaged.clean_conversations(records, with_answers=with_answers)


def dedup_key(conversation: Conversation) -> bytes:
    """sha256 of the conversation's user turns, each NFKC-normalized, case-folded and whitespace-collapsed."""
    digest = hashlib.sha256()
    for message in conversation:
        if message["role"] == "user":
            text = " ".join(unicodedata.normalize("NFKC", message["content"]).casefold().split())
            digest.update(text.encode("utf-8") + b"\x00")
    return digest.digest()


def allocate(available: Sequence[int], weights: Sequence[float], total: int) -> list[int]:
    """Per-source quotas: `total` shared by `weights`, capped by `available`, shortfalls redistributed.

    `total` 0 or >= sum(available): everything. Otherwise `total` is shared in proportion to the weights;
    a source whose share is >= its `available` takes all of it and leaves the mix; the rest is shared
    again among the others by their weights, until every remaining share fits. The remaining shares are
    rounded by largest remainder (floors first; the units left go to the largest fractional parts, ties
    to the earlier source), computed with exact fractions."""
    if len(available) != len(weights):
        raise ValueError(
            f"available and weights must have the same length; received {len(available)} and {len(weights)}"
        )
    if any(a < 0 for a in available) or any(not w > 0 for w in weights):
        raise ValueError(f"available must be >= 0 and weights > 0; received {list(available)} and {list(weights)}")
    if total < 0:
        raise ValueError(f"total must be >= 0; received {total}")
    if total == 0 or total >= sum(available):
        return list(available)
    quotas = [0] * len(available)
    exact = [Fraction(w) for w in weights]
    active = [i for i, a in enumerate(available) if a > 0]
    remaining = total
    while True:
        weight_sum = sum(exact[i] for i in active)
        full = [i for i in active if available[i] <= remaining * exact[i] / weight_sum]
        if not full:
            break
        for i in full:
            quotas[i] = available[i]
            remaining -= available[i]
        active = [i for i in active if i not in full]
    shares = {i: remaining * exact[i] / weight_sum for i in active}
    for i in active:
        quotas[i] = math.floor(shares[i])
    left = remaining - sum(quotas[i] for i in active)
    by_remainder = sorted(active, key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    for i in by_remainder[:left]:
        quotas[i] += 1
    return quotas


TokenCounter = Callable[[Sequence[str]], Sequence[int]]  # texts -> their token counts


def user_text(conversation: Conversation) -> str:
    """The user turns of a conversation, joined by newlines: what the length filters measure."""
    return "\n".join(m["content"] for m in conversation if m["role"] == "user")


def mix(spec: MixSpec, *, cache_dir: str | Path | None = None,
        count_tokens: TokenCounter | None = None) -> tuple[list[Item], MixStats]:
    """The mixed, deduplicated, shuffled items `{"id", "source", "messages"}` and per-source counts.

    1. Every source is loaded in order; each conversation gets the id `f"{source}:{index}"`, `index` its
       position in the source's cleaned list (before filters, dedup and sampling), so ids are stable for the
       same data and code and regeneration can resume by id. `source` is `SourceSpec.source_name`.
    2. Length filters (`spec.min_user_tokens` / `max_user_tokens`, measured by `count_tokens` over `user_text`):
       a conversation out of bounds counts as `filtered` and takes no part in dedup.
    3. Dedup (`spec.dedup`, key `dedup_key`): the first occurrence wins, in source order then file order;
       later ones count as `duplicates`.
    4. Quotas (`allocate`) over `available_i` = source i's unique conversations, capped by its
       `max_prompts` (0: no cap).
    5. Sampling: `rng = numpy.random.default_rng(spec.seed)`; in source order, source i takes the first
       quota_i entries of `rng.permutation(len(unique_i))` (a uniform sample without replacement of its
       whole unique pool, not its first `max_prompts`), kept in pool order; then all items are shuffled
       with `rng.permutation`. Same spec, same data -> same items in the same order.
    """
    if spec.filters_length and count_tokens is None:
        raise ValueError(f"count_tokens must be given when the mix filters by length (min_user_tokens "
                         f"{spec.min_user_tokens}, max_user_tokens {spec.max_user_tokens}); received None")
    seen: set[bytes] = set()
    pools: list[list[tuple[int, Conversation]]] = []
    partial: list[tuple[str, CleanStats, int, int]] = []
    for source in spec.sources:
        conversations, clean = load_source(source, with_answers=spec.with_answers, cache_dir=cache_dir)
        keep = [True] * len(conversations)
        if spec.filters_length:
            assert count_tokens is not None
            counts = count_tokens([user_text(c) for c in conversations])
            high = spec.max_user_tokens or float("inf")
            keep = [spec.min_user_tokens <= n <= high for n in counts]
        pool: list[tuple[int, Conversation]] = []
        duplicates = 0
        for index, conversation in enumerate(conversations):
            if not keep[index]:
                continue
            if spec.dedup:
                key = dedup_key(conversation)
                if key in seen:
                    duplicates += 1
                    continue
                seen.add(key)
            pool.append((index, conversation))
        pools.append(pool)
        partial.append((source.source_name, clean, duplicates, keep.count(False)))

    available = [
        len(pool) if not s.max_prompts else min(len(pool), s.max_prompts)
        for s, pool in zip(spec.sources, pools, strict=True)
    ]
    quotas = allocate(available, [s.weight for s in spec.sources], spec.max_prompts)
    rng = np.random.default_rng(spec.seed)
    items: list[Item] = []
    stats: list[SourceStats] = []
    for (name, clean, duplicates, filtered), pool, have, quota in zip(partial, pools, available, quotas,
                                                                      strict=True):
        picks = np.sort(rng.permutation(len(pool))[:quota])
        items += [{"id": f"{name}:{pool[p][0]}", "source": name, "messages": pool[p][1]} for p in picks]
        stats.append(SourceStats(name, clean.records, clean.records - clean.kept, clean.kept, duplicates, have, quota,
                                 filtered))
    order = rng.permutation(len(items))
    return [items[i] for i in order], MixStats(tuple(stats))


def mix_spec(data: Any) -> MixSpec:
    """The MixSpec of a recipe's `data` section (`data.prompts` and its mix settings)."""
    return MixSpec(sources=data.prompt_sources, max_prompts=data.max_prompts, dedup=data.dedup, seed=data.seed,
                   min_user_tokens=data.min_user_tokens, max_user_tokens=data.max_user_tokens)


def tokenizer_counter(tokenizer: Any) -> TokenCounter:
    """A `count_tokens` over a `ChatTokenizer` (its backend's batch encoder, no special tokens added)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return lambda texts: [len(e.ids) for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return lambda texts: [len(tokenizer.encode(t)) for t in texts]


def parse_mix(obj: MixSpec | Mapping[str, Any] | Sequence[Any] | str) -> MixSpec:
    """A MixSpec from YAML-like data or the CLI's short form.

    - a mapping: the MixSpec fields (`sources`, `max_prompts`, `dedup`, `seed`, `with_answers`); each source a
      mapping of SourceSpec fields or a short-form string; unknown keys are errors naming the key;
    - a list: the sources alone;
    - a string: comma-separated `SOURCE[:WEIGHT]`, SOURCE a preset name, `hf:<dataset id>` or a local path,
      e.g. "sharegpt:3,gsm8k:1" or "hf:org/chat:2,./extra.jsonl".
    """
    if isinstance(obj, MixSpec):
        return obj
    if isinstance(obj, str):
        tokens = obj.split(",")
        return MixSpec(sources=tuple(parse_source(t, obj) for t in tokens))
    if isinstance(obj, Sequence):
        obj = {"sources": obj}
    if not isinstance(obj, Mapping):
        raise ConfigError(f"mix must be a mapping, a list of sources or a 'name:weight,…' string; received {obj!r}")
    data = dict(obj)
    sources = data.get("sources")
    if isinstance(sources, str):
        data["sources"] = [parse_source(t, sources) for t in sources.split(",")]
    elif isinstance(sources, Sequence):
        data["sources"] = [parse_source(s) if isinstance(s, str) else s for s in sources]
    return build(MixSpec, data, prefix="mix")


def _builder(path: Path) -> str | None:
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    return _BUILDERS.get(suffixes[0]) if suffixes else None


def _split_error(spec: SourceSpec, split: str, error: Exception) -> ConfigError | None:
    """A ConfigError naming the split when datasets refused it ("Unknown split ... Should be one of [...]")."""
    text = str(error)
    if "Unknown split" not in text:
        return None
    known = text.partition("Should be one of")[2].strip(" .") or "(see the dataset's files)"
    return ConfigError(f"source {spec.source_name!r}: split must be one of the dataset's splits {known}; "
                       f"received {split!r}")


def _load_dataset(spec: SourceSpec, cache_dir: str | Path | None) -> Any:
    """The `datasets.Dataset` of a path or hub source."""
    import datasets  # local: only file and Hub sources need it

    split = spec.split or _DEFAULT_SPLIT
    cache = None if cache_dir is None else str(cache_dir)
    if spec.hub is not None:
        try:
            return datasets.load_dataset(spec.hub, spec.subset, split=split, cache_dir=cache)
        except Exception as error:  # datasets raises many kinds; all mean "not loadable here"
            named = _split_error(spec, split, error)
            if named is not None:
                raise named from error
            raise RuntimeError(
                f"could not load the Hugging Face dataset {spec.hub!r} (subset {spec.subset!r}, split {split!r}): "
                f"{type(error).__name__}: {error}; without network access, download it where there is access "
                "(`huggingface-cli download --repo-type dataset ID --local-dir DIR`) and name the directory "
                "(`hf:DIR` or `path: DIR`, with the same split)"
            ) from error
    path = Path(str(spec.path)).expanduser()
    expected = "a .json, .jsonl or .parquet file (optionally .gz), a glob of such files, or a directory of them"
    where = f"source {spec.source_name!r}: path"
    if spec.is_glob:
        root = Path(path.anchor) if path.is_absolute() else Path()
        pattern = str(path.relative_to(root)) if path.is_absolute() else str(path)
        files = sorted(f for f in root.glob(pattern) if f.is_file())
        require(bool(files), where, spec.path, f"match at least one file ({expected}); it matches none")
        kinds = {_builder(f) for f in files}
        require(len(kinds) == 1 and None not in kinds, where, spec.path,
                f"match files of one kind (.json/.jsonl or .parquet); it matches {sorted({f.suffix for f in files})}")
        builder = kinds.pop()
        load = {"data_files": {split: [str(f) for f in files]}}
    elif path.is_file():
        builder = _builder(path)
        if builder is None:
            raise ValueError(
                f"source path {str(path)!r} must be {expected}; received suffix {''.join(path.suffixes)!r}"
            )
        load = {"data_files": {split: str(path)}}
    elif path.is_dir():
        kinds = {_builder(f) for f in path.rglob("*") if f.is_file() and not f.name.startswith(".")} - {None}
        if len(kinds) != 1:
            raise ValueError(
                f"source path {str(path)!r} must hold files of one kind (.json/.jsonl or .parquet); found "
                f"{sorted(k for k in kinds if k) or 'none'}"
            )
        builder = kinds.pop()
        load = {"data_dir": str(path)}
    else:
        raise FileNotFoundError(f"source path {str(path)!r} does not exist; expected {expected}")
    try:
        return datasets.load_dataset(builder, split=split, cache_dir=cache, **load)
    except Exception as error:
        named = _split_error(spec, split, error)
        if named is not None:
            raise named from error
        raise ValueError(
            f"could not read source path {str(path)!r} (split {split!r}) with datasets' {builder!r} builder: "
            f"{type(error).__name__}: {error}"
        ) from error


@dataclasses.dataclass(frozen=True)
class _Format:
    kind: str  # "turns" | "prompt"
    column: str = ""  # the turn list's column, or the prompt's
    extra_input: bool = False
    answer: str | None = None


def _record_format(spec: SourceSpec, columns: Sequence[str]) -> _Format | None:
    """How to read records with these columns (the formats: `load_source`)."""
    where = f"source {spec.source_name!r}"
    for key in ("messages_field", "prompt_field", "answer_field"):
        value = getattr(spec, key)
        require(value is None or value in columns, f"{where}: {key}", value,
                f"be one of the dataset's columns {list(columns)}")
    if spec.messages_field is not None:
        return _Format("turns", spec.messages_field)
    if spec.prompt_field is None:
        for column in ("messages", "conversations"):
            if column in columns:
                return _Format("turns", column)
    if spec.prompt_field is not None:
        prompt = spec.prompt_field
    else:
        prompt = next((f for f in PROMPT_FIELDS if f in columns), "")
        if not prompt:
            if not columns:
                return None  # an empty dataset
            raise ConfigError(
                f"{where}: records must have a 'messages' or 'conversations' column or a prompt column "
                f"(set messages_field or prompt_field, or name it one of {list(PROMPT_FIELDS)}); received columns "
                f"{list(columns)}"
            )
    if spec.answer_field is not None:
        answer = spec.answer_field
    else:
        answer = next((f for f in ANSWER_FIELDS if f in columns and f != prompt), None)
    extra = prompt == "instruction" and spec.prompt_field is None and "input" in columns
    return _Format("prompt", prompt, extra, answer)


def _record_turns(row: Mapping[str, Any], fmt: _Format) -> list[tuple[Any, Any]] | None:
    """(speaker, text) pairs of one record, for `clean_conversation`; None when the turn list is malformed."""
    if fmt.kind == "turns":
        turns = row.get(fmt.column)
        if not isinstance(turns, list):
            return None
        pairs = []
        for turn in turns:
            if not isinstance(turn, Mapping):
                return None
            speaker = turn.get("role") if turn.get("role") is not None else turn.get("from")
            text = turn.get("content") if turn.get("content") is not None else turn.get("value")
            pairs.append((speaker, text))
        return pairs
    prompt = row.get(fmt.column)
    if fmt.extra_input and isinstance(prompt, str) and isinstance(row.get("input"), str) and row["input"].strip():
        prompt = f"{prompt}\n\n{row['input']}"
    pairs = [("user", prompt)]
    answer = row.get(fmt.answer) if fmt.answer else None
    if isinstance(answer, str) and answer.strip():
        pairs.append(("assistant", answer))
    return pairs
