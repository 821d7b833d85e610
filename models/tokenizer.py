"""Tokenizer and chat template for a target model, built without torch or transformers.

Two sources give the same `ChatTokenizer`:
- a GGUF file: the byte-level BPE vocabulary, merges, token types, special ids and chat template stored
  in its `tokenizer.*` metadata (llama.cpp key names);
- a Hugging Face directory: `tokenizer.json` plus `tokenizer_config.json` (and optionally
  `chat_template.jinja`, `special_tokens_map.json`, `generation_config.json`).

Pre-tokenization for a GGUF follows `tokenizer.ggml.pre`, reproducing the Hugging Face `tokenizer.json`
of the model family (which is what the model was trained with):
- `smollm` / `starcoder`: split every numeric character on its own, then the GPT-2 regex
  (HF: `Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]`; llama.cpp: `\\p{N}` then
  the GPT-2 regex). transformers' GGUF loader omits the digit split (see tools/golden_smollm2.py).
- `gpt-2`: the GPT-2 regex alone.
- `llama-bpe` / `llama3` / `llama-v3`: the Llama 3 regex (`\\p{N}{1,3}`), and whole-word vocabulary
  matches before merges (`ignore_merges`, as in Llama 3's tokenizer.json and llama.cpp).
- `qwen2`: the Qwen2 regex (single digits) after NFC normalization, as in Qwen2's tokenizer.json.

Stop tokens: an assistant turn ends with `<|im_end|>` (ChatML), `<|eot_id|>` (Llama 3), etc. A start
marker such as `<|im_start|>` is never a stop token, even when metadata labels it EOS.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from dflash.models.gguf_file import GGUFFile, read_gguf

# Tokens that end an assistant turn or a document, in the families we support.
# Turn ends: ChatML, Llama 3, Gemma 3 (`<end_of_turn>`), gpt-oss's harmony (`<|return|>` ends the answer, `<|call|>` a
# tool call; its `<|end|>` closes a message the model goes on after, such as its analysis, so it is not one).
STOP_TOKEN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "<end_of_turn>",
                    "<|return|>", "<|call|>")
# A token whose text matches this opens something; it is never a stop token.
_START_MARKER = re.compile(r"start|begin", re.IGNORECASE)

# llama.cpp token types (`tokenizer.ggml.token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_FAMILIES = {
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "gpt-2": "gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "qwen2": "qwen2",
}


@dataclasses.dataclass(frozen=True)
class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and the special tokens that matter for decoding.

    `encode(text, add_special_tokens=True)` adds what the backend's post-processor adds (for a GGUF:
    BOS iff `tokenizer.ggml.add_bos_token`). Chat prompts are rendered to text by the template (which
    writes its own special tokens) and encoded without adding any.
    """

    backend: tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str | None
    bos_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) stay one token each."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; byte-level tokens are joined before UTF-8 decoding, so `decode(encode(s)) == s`."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (dicts with `role` and `content`) with the chat template, as transformers does.

        `template_kwargs` become template variables (e.g. `tools`, `enable_thinking`) and may override
        `bos_token` / `eos_token`. `strftime_now="YYYY-MM-DD"` pins the day the template's `strftime_now(...)`
        renders (gpt-oss's `Current date:`, Llama 3.1's `Today Date:`), so that a conversation renders to the same ids
        on another day (training rows against the prompts regeneration served); unset, it is today.
        """
        if self.chat_template is None:
            raise ValueError(
                "chat_template must be set to render messages; received None (the tokenizer source has no "
                "chat template: pass a GGUF with tokenizer.chat_template or a directory with one)"
            )
        variables: dict[str, Any] = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables.update(template_kwargs)
        if isinstance(variables.get("strftime_now"), str):
            variables["strftime_now"] = _pinned_strftime(variables["strftime_now"])
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        return _compile_template(self.chat_template).render(**variables)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the rendered chat prompt; the template already wrote the special tokens, none are added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (SmolLM2: 49152)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def fingerprint(self) -> str:
        """sha256 hex of the serialized tokenizer JSON and the chat template (equal prints: equal ids)."""
        digest = hashlib.sha256()
        digest.update(self.backend.to_str().encode("utf-8"))
        digest.update(b"\x00chat_template\x00")
        digest.update((self.chat_template or "").encode("utf-8"))
        return digest.hexdigest()


def load_tokenizer(path: str | Path) -> ChatTokenizer:
    """Load from a `.gguf` file or a Hugging Face tokenizer directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        return load_tokenizer_from_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_tokenizer_from_gguf(path)
    if path.exists():
        raise ValueError(f"tokenizer source must be a .gguf file or a directory; received {str(path)!r}")
    raise FileNotFoundError(
        f"tokenizer source {str(path)!r} does not exist; expected a .gguf file or a Hugging Face directory "
        "with tokenizer.json and tokenizer_config.json"
    )


def load_tokenizer_from_gguf(path: str | Path) -> ChatTokenizer:
    """Build the tokenizer from a GGUF's `tokenizer.*` metadata (byte-level BPE: `tokenizer.ggml.model`
    must be 'gpt2'; `tokenizer.ggml.pre` picks the pre-tokenizer, see the module docstring)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist; expected a .gguf model file")
    reader = read_gguf(path)  # cached: the target's weights were read from the same parse
    family, tokens, merges, token_types = _gguf_vocabulary(reader, path.name)
    backend = _gguf_backend(family, tokens, merges, token_types, path.name)
    bos_id = _optional_id(reader.get("tokenizer.ggml.bos_token_id"), len(tokens), "tokenizer.ggml.bos_token_id")
    eos_id = _optional_id(reader.get("tokenizer.ggml.eos_token_id"), len(tokens), "tokenizer.ggml.eos_token_id")
    add_bos = bool(reader.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(reader.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    return _make(backend, reader.get("tokenizer.chat_template"), bos_id, eos_id, extra_stop_ids=())


def _gguf_vocabulary(reader: GGUFFile, name: str) -> tuple[str, list[str], list[str], list[int]]:
    """(pre-tokenizer family, tokens, merges, token types) of a GGUF, each checked (`name`: the file's)."""
    model = reader.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE, the only kind supported); "
            f"received {model!r} in {name}; load the model's Hugging Face directory instead"
        )
    pre = reader.get("tokenizer.ggml.pre")
    if pre not in _PRE_FAMILIES:
        raise ValueError(
            f"tokenizer.ggml.pre must be one of {sorted(_PRE_FAMILIES)}; received {pre!r} in {name}; "
            "load the model's Hugging Face directory instead"
        )
    tokens = reader.get("tokenizer.ggml.tokens")
    merges = reader.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError(
            f"tokenizer.ggml.tokens and tokenizer.ggml.merges must be present; missing in {name}"
        )
    token_types = reader.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.token_type must have one entry per token ({len(tokens)}); "
            f"received {len(token_types)}"
        )
    return _PRE_FAMILIES[pre], tokens, merges, token_types


def _gguf_backend(
    family: str, tokens: list[str], merges: list[str], token_types: list[int], name: str
) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer of a GGUF vocabulary, its control and user-defined tokens added."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.tokens must be unique; {len(tokens) - len(vocab)} duplicates in {name}"
        )
    backend = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab=vocab, merges=[_split_merge(m) for m in merges], ignore_merges=family == "llama3"
        )
    )
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()

    # Control tokens are special (skipped by decode(skip_special_tokens=True)); user-defined ones are plain
    # added tokens. Both are matched whole in the text, before pre-tokenization.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == _TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"GGUF special tokens must be in tokenizer.ggml.tokens; the vocabulary grew in {name}"
        )
    return backend


def load_tokenizer_from_hf_dir(path: str | Path) -> ChatTokenizer:
    """Build the tokenizer from `tokenizer.json` + `tokenizer_config.json` in a Hugging Face model directory.

    The chat template comes from `chat_template.jinja` when present, else `tokenizer_config.json`'s
    `chat_template`. BOS/EOS come from `tokenizer_config.json`, else `special_tokens_map.json`. EOS ids in
    `generation_config.json` are added to the stop ids.
    """
    path = Path(path).expanduser()
    tokenizer_file = path / "tokenizer.json"
    config_file = path / "tokenizer_config.json"
    for required in (tokenizer_file, config_file):
        if not required.is_file():
            raise FileNotFoundError(
                f"{required.name} is missing in {str(path)!r}; a Hugging Face tokenizer directory must hold "
                "tokenizer.json and tokenizer_config.json"
            )
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config = _read_json(config_file)
    special_map = (
        _read_json(path / "special_tokens_map.json") if (path / "special_tokens_map.json").is_file() else {}
    )

    template: str | None = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        template = config["chat_template"]
    elif isinstance(config.get("chat_template"), list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
        template = named.get("default")

    def special_id(name: str) -> int | None:
        value = config.get(name, special_map.get(name))
        if isinstance(value, dict):  # serialized AddedToken
            value = value.get("content")
        if value is None:
            return None
        token_id = backend.token_to_id(value)
        if token_id is None:
            raise ValueError(f"{name} must be a token of tokenizer.json; received {value!r} in {str(path)!r}")
        return token_id

    extra_stop: list[int] = []
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = _read_json(generation_file).get("eos_token_id")
        extra_stop = [int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    return _make(backend, template, special_id("bos_token"), special_id("eos_token"), tuple(extra_stop))


def _make(
    backend: tokenizers.Tokenizer,
    chat_template: str | None,
    bos_id: int | None,
    eos_id: int | None,
    extra_stop_ids: tuple[int, ...],
) -> ChatTokenizer:
    """Assemble the ChatTokenizer; stop ids = EOS (unless a start marker), named end tokens, extra ids."""
    candidates: list[int] = []
    if eos_id is not None:
        candidates.append(eos_id)
    candidates += [i for i in (backend.token_to_id(name) for name in STOP_TOKEN_NAMES) if i is not None]
    candidates += extra_stop_ids
    stop_ids: list[int] = []
    for token_id in candidates:
        text = backend.id_to_token(token_id)
        if token_id not in stop_ids and text is not None and not _START_MARKER.search(text):
            stop_ids.append(token_id)
    return ChatTokenizer(
        backend=backend,
        chat_template=chat_template,
        bos_token=None if bos_id is None else backend.id_to_token(bos_id),
        bos_token_id=bos_id,
        eos_token=None if eos_id is None else backend.id_to_token(eos_id),
        eos_token_id=eos_id,
        stop_token_ids=tuple(stop_ids),
    )


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer chain of a `_PRE_FAMILIES` value."""
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def _post_processor(
    tokens: Sequence[str], bos_id: int | None, eos_id: int | None
) -> processors.PostProcessor:
    """What `encode(add_special_tokens=True)` adds: BOS and/or EOS per the GGUF flags, else nothing."""
    if bos_id is None and eos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    prefix = [] if bos_id is None else [f"{tokens[bos_id]}:0"]
    suffix = [] if eos_id is None else [f"{tokens[eos_id]}:0"]
    special = [(tokens[i], i) for i in {bos_id, eos_id} if i is not None]
    return processors.TemplateProcessing(
        single=" ".join(prefix + ["$A:0"] + suffix),
        pair=" ".join(prefix + ["$A:0"] + suffix + prefix + ["$B:1"] + suffix),
        special_tokens=special,
    )


def _split_merge(merge: str) -> tuple[str, str]:
    """GGUF stores a merge as 'left right'; byte-level tokens never contain a literal space."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"tokenizer.ggml.merges entries must be 'left right'; received {merge!r}")
    return left, right


def _optional_id(value: Any, vocab_size: int, field_name: str) -> int | None:
    if value is None:
        return None
    if not 0 <= int(value) < vocab_size:
        raise ValueError(f"{field_name} must be in [0, {vocab_size}); received {value}")
    return int(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path.name} must be valid JSON; received a parse error: {error}") from error
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} must hold a JSON object; received {type(data).__name__}")
    return data


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (an assistant-mask marker in some HF templates): the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own filter: no HTML escaping, and transformers' keyword options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _pinned_strftime(day: str) -> Any:
    """`strftime_now` for a template variable pinned to `day` (ISO 'YYYY-MM-DD', midnight)."""
    try:
        moment = datetime.datetime.combine(datetime.date.fromisoformat(day), datetime.time())
    except ValueError as error:
        raise ValueError(f"template variable strftime_now must be a date 'YYYY-MM-DD' (the day the chat template "
                         f"renders as today); received {day!r}") from error
    return moment.strftime


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """A sandboxed jinja2 template configured like transformers' chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
