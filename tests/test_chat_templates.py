"""Assistant-only loss masks (docs/design.md §4.2) under each supported chat-template family.

For every family the mask must cover exactly the tokens the model writes in an assistant turn: the content
and the turn's end token (plus, for Qwen3 with thinking on, the empty think block the model writes itself).
The expectation is computed without the implementation's prefix-rendering: the full chat is checked against
the family's documented format written out by hand, each assistant turn's written text is located in it as a
substring, and the expected mask is 1 on the tokens whose character offsets lie inside those substrings.

Families:
- ChatML (SmolLM2, Qwen2.5): the real SmolLM2 tokenizer and template from the packaged GGUF (it inserts a
  default system prompt when none is given).
- Llama 3.1: `<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n…<|eot_id|>` then
  `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>` per turn, with the dated default
  system block always present.
- Qwen3: ChatML with `<think>\\n\\n</think>\\n\\n` after the assistant header; with `enable_thinking=False`
  the generation prompt ends in that empty think block (the template writes it, so it is not trained).
- gpt-oss (harmony): `<|start|>{role}<|message|>…<|end|>`, the answer on the `final` channel closed by `<|return|>`
  (a template written for this test from harmony's documentation; the published one also drops past reasoning;
  regeneration's channels and the rows per turn: tests/test_harmony.py).
- Gemma 3: `<bos><start_of_turn>user\\n{system\\n\\n}{content}<end_of_turn>\\n<start_of_turn>model\\n…<end_of_turn>\\n`
  (the system prompt opens the first user turn; the assistant role is `model`), with Gemma 3's published template;
  `<end_of_turn>` ends a turn (EOS `<eos>` too, as generation_config.json lists both).
Llama 3 and Qwen3 tokenizers are built here (no network): a small byte-level BPE trained on the test
conversations with the family's special tokens, saved as a Hugging Face directory with a template written
for this test, and loaded with `load_tokenizer_from_hf_dir`.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers

from dflash.data.chat_tokens import tokenize_conversation, tokenize_rows
from dflash.data.config import DataConfig, RegenConfig
from dflash.data.examples import build_examples
from dflash.models.registry import default_gguf_path
from dflash.models.tokenizer import ChatTokenizer, load_tokenizer, load_tokenizer_from_hf_dir

SYSTEM = "You answer in one short sentence."
USER_1 = "What is the capital of France?"
ANSWER_1 = "The capital of France is Paris."
USER_2 = "And of Italy, in 2024?"
ANSWER_2 = "Rome has been the capital of Italy since 1871."

CONVERSATIONS = {
    "single": [{"role": "user", "content": USER_1}, {"role": "assistant", "content": ANSWER_1}],
    "single_system": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": ANSWER_1},
    ],
    "multi": [
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": ANSWER_1},
        {"role": "user", "content": USER_2},
        {"role": "assistant", "content": ANSWER_2},
    ],
    "multi_system": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER_1},
        {"role": "assistant", "content": ANSWER_1},
        {"role": "user", "content": USER_2},
        {"role": "assistant", "content": ANSWER_2},
    ],
}

# --- templates written for these tests, rendering each family's documented format -----------------------

LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}
{{- system_message + '<|eot_id|>' }}
{%- for message in loop_messages %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

# Every assistant turn carries its think block (empty when the content has none): prefix-stable.
QWEN3_TEMPLATE = r"""{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if '</think>' not in message.content %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{{- message.content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

# Like Qwen3's published template: only assistant turns after the last user turn keep a think block, so the
# rendering of an earlier turn changes once the conversation goes on (a history rewrite).
QWEN3_HISTORY_REWRITE_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_user %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{{- message.content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

# Gemma 3's published chat template (google/gemma-3-*-it).
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"""
GEMMA3_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]

# gpt-oss's harmony format as its documentation writes it (a template written for this test): a system message with
# the reasoning effort, then `<|start|>{role}<|message|>…<|end|>`; an assistant answer on the `final` channel, closed
# by `<|return|>` when it is the conversation's last message and by `<|end|>` in the history before.
HARMONY_TEMPLATE = r"""{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort | default('medium')) }}
{{- '<|end|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
{%- else %}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""
HARMONY_SPECIAL = ["<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>"]

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = "<think>\n\n</think>\n\n"
# The pre-tokenizer split regexes of the families' tokenizer.json (Llama 3: numbers in runs of up to 3 digits;
# Qwen2/Qwen3: single digits). Newline runs stay one piece, so a prompt ending in "\n\n" tokenizes as a prefix.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# --- documented formats, written out by hand ----------------------------------------------------------


def _chatml(turns: Sequence[tuple[str, str]]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def _smollm2_text(conversation: list[dict[str, str]]) -> str:
    turns = [(m["role"], m["content"]) for m in conversation]
    if turns[0][0] != "system":
        turns.insert(0, ("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"))
    return _chatml(turns)


def _llama3_text(conversation: list[dict[str, str]]) -> str:
    system = conversation[0]["content"] if conversation[0]["role"] == "system" else ""
    rest = conversation[1:] if conversation[0]["role"] == "system" else conversation
    text = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    text += f"Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{system}<|eot_id|>"
    for m in rest:
        text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
    return text


def _gemma3_text(conversation: list[dict[str, str]]) -> str:
    system = conversation[0]["content"] + "\n\n" if conversation[0]["role"] == "system" else ""
    rest = conversation[1:] if system else conversation
    text = "<bos>"
    for i, m in enumerate(rest):
        role = "model" if m["role"] == "assistant" else m["role"]
        text += f"<start_of_turn>{role}\n{system if i == 0 else ''}{m['content']}<end_of_turn>\n"
    return text


def _qwen3_text(conversation: list[dict[str, str]]) -> str:
    return _chatml(
        [(m["role"], THINK + m["content"] if m["role"] == "assistant" else m["content"]) for m in conversation]
    )


# --- tokenizers --------------------------------------------------------------------------------------------


def _hf_dir(
    root: Path,
    split: str,
    special: list[str],
    added: list[str],
    template: str,
    bos: str | None,
    eos: str,
    corpus: list[str],
    generation_eos: Sequence[str] = (),
) -> Path:
    """A Hugging Face tokenizer directory: byte-level BPE trained on `corpus`, `special` tokens first."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    root.mkdir(parents=True)
    backend.save(str(root / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "chat_template": template}
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_eos:
        ids = [backend.token_to_id(t) for t in generation_eos]
        (root / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}), encoding="utf-8")
    return root


def _corpus() -> list[str]:
    texts = [m["content"] for conversation in CONVERSATIONS.values() for m in conversation]
    return texts * 4 + ["system user assistant Cutting Knowledge Date December Today", "\n\n" * 8]


@pytest.fixture(scope="module")
def smollm2() -> ChatTokenizer:
    return load_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    root = tmp_path_factory.mktemp("llama3") / "tok"
    return load_tokenizer_from_hf_dir(
        _hf_dir(root, LLAMA3_SPLIT, LLAMA3_SPECIAL, [], LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>", _corpus())
    )


def _qwen3(tmp_path_factory: pytest.TempPathFactory, template: str) -> ChatTokenizer:
    root = tmp_path_factory.mktemp("qwen3") / "tok"
    added = ["<think>", "</think>"]  # plain added tokens in Qwen3, not special ones
    return load_tokenizer_from_hf_dir(
        _hf_dir(root, QWEN2_SPLIT, QWEN3_SPECIAL, added, template, None, "<|im_end|>", _corpus())
    )


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return _qwen3(tmp_path_factory, QWEN3_TEMPLATE)


# --- the independent expectation -----------------------------------------------------------------------


def _expected_mask(tok: ChatTokenizer, text: str, written: Sequence[str]) -> np.ndarray:
    """1 on the tokens of `text` lying inside one of the `written` substrings (each occurs exactly once)."""
    encoding = tok.backend.encode(text, add_special_tokens=False)
    mask = np.zeros(len(encoding.ids), np.float32)
    for piece in written:
        assert text.count(piece) == 1, f"{piece!r} must occur once in the rendered chat"
        low = text.index(piece)
        high = low + len(piece)
        for position, (start, end) in enumerate(encoding.offsets):
            inside = low <= start and end <= high
            assert inside or end <= low or start >= high, f"token {position} straddles the edge of {piece!r}"
            mask[position] = max(mask[position], float(inside))
    return mask


def _check(
    tok: ChatTokenizer, conversation: list[dict[str, str]], text: str, written: Sequence[str],
    end_id: int | None = None, **template_kwargs
) -> None:
    assert tok.apply_chat_template(conversation, add_generation_prompt=False, **template_kwargs) == text
    ids, mask = tokenize_conversation(tok, conversation, max_len=4096, **template_kwargs)
    assert ids.tolist() == tok.encode(text)
    expected = _expected_mask(tok, text, written)
    assert expected.sum() > 0
    np.testing.assert_array_equal(mask, expected)
    # The last masked token of every assistant turn is a stop token, and the mask never covers a header.
    end_id = tok.stop_token_ids[0] if end_id is None else end_id
    assert ids[np.flatnonzero(np.diff(np.concatenate([mask, [0.0]])) < 0)].tolist() == [end_id] * len(written)


def _answers(conversation: list[dict[str, str]]) -> list[str]:
    return [m["content"] for m in conversation if m["role"] == "assistant"]


# --- one test per family ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_chatml_smollm2(smollm2: ChatTokenizer, case: str) -> None:
    conversation = CONVERSATIONS[case]
    assert smollm2.stop_token_ids[0] == smollm2.encode("<|im_end|>")[0]
    written = [f"{answer}<|im_end|>" for answer in _answers(conversation)]
    _check(smollm2, conversation, _smollm2_text(conversation), written)


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_llama3(llama3: ChatTokenizer, case: str) -> None:
    conversation = CONVERSATIONS[case]
    assert llama3.stop_token_ids[0] == llama3.encode("<|eot_id|>")[0]
    assert llama3.apply_chat_template(conversation[:-1]).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    written = [f"{answer}<|eot_id|>" for answer in _answers(conversation)]
    _check(llama3, conversation, _llama3_text(conversation), written)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    root = tmp_path_factory.mktemp("gemma3") / "tok"
    return load_tokenizer_from_hf_dir(_hf_dir(root, LLAMA3_SPLIT, GEMMA3_SPECIAL, [], GEMMA3_TEMPLATE, "<bos>", "<eos>",
                                              _corpus(), generation_eos=("<eos>", "<end_of_turn>")))


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_gemma3(gemma3: ChatTokenizer, case: str) -> None:
    """Gemma 3: `<end_of_turn>` is a stop token beside `<eos>`, the model writes content + `<end_of_turn>` after
    `<start_of_turn>model\\n`, and the system prompt (loss 0) opens the first user turn."""
    conversation = CONVERSATIONS[case]
    end = gemma3.encode("<end_of_turn>")[0]
    assert set(gemma3.stop_token_ids) == {gemma3.encode("<eos>")[0], end}
    assert gemma3.apply_chat_template(conversation[:-1]).endswith("<end_of_turn>\n<start_of_turn>model\n")
    written = [f"{answer}<end_of_turn>" for answer in _answers(conversation)]
    _check(gemma3, conversation, _gemma3_text(conversation), written, end_id=end)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    root = tmp_path_factory.mktemp("harmony") / "tok"
    stops = ("<|return|>", "<|endoftext|>", "<|call|>")  # gpt-oss's generation_config.json eos_token_id
    return load_tokenizer_from_hf_dir(_hf_dir(root, LLAMA3_SPLIT, HARMONY_SPECIAL, [], HARMONY_TEMPLATE, None,
                                              "<|return|>", _corpus(), generation_eos=stops))


@pytest.mark.parametrize("case", ["single", "single_system"])
def test_gpt_oss_harmony(harmony: ChatTokenizer, case: str) -> None:
    """gpt-oss: `<|return|>` and `<|call|>` stop, `<|end|>` does not (the model writes its analysis, `<|end|>`, then
    its final answer); the model writes the channel header, the answer and `<|return|>` after `<|start|>assistant`;
    the reasoning effort reaches the rendering; a second turn renders its first answer with `<|end|>` (a history
    rewrite), so `tokenize_conversation` refuses the whole multi-turn conversation as one row, and `tokenize_rows`
    makes one row per turn instead (D85; the rows and regeneration: tests/test_harmony.py)."""
    conversation = CONVERSATIONS[case]
    ids = {name: harmony.encode(name)[0] for name in ("<|return|>", "<|call|>", "<|end|>", "<|endoftext|>")}
    assert set(harmony.stop_token_ids) == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    assert harmony.apply_chat_template(conversation[:-1], reasoning_effort="low").startswith(
        "<|start|>system<|message|>Reasoning: low<|end|>")
    text = "<|start|>system<|message|>Reasoning: low<|end|>" + "".join(
        f"<|start|>{m['role']}<|message|>{m['content']}<|end|>" for m in conversation[:-1])
    text += f"<|start|>assistant<|channel|>final<|message|>{ANSWER_1}<|return|>"
    _check(harmony, conversation, text, [f"<|channel|>final<|message|>{ANSWER_1}<|return|>"],
           end_id=ids["<|return|>"], reasoning_effort="low")
    with pytest.raises(ValueError, match="prefix"):
        tokenize_conversation(harmony, CONVERSATIONS["multi"], 4096, reasoning_effort="low")
    rows, _ = tokenize_rows(harmony, [CONVERSATIONS["multi"]], 4096, template_kwargs={"reasoning_effort": "low"})
    assert [harmony.decode(t[m > 0], skip_special_tokens=False) for t, m, _ in rows] == [
        f"<|channel|>final<|message|>{answer}<|return|>" for answer in (ANSWER_1, ANSWER_2)]


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_qwen3_thinking_off(qwen3: ChatTokenizer, case: str) -> None:
    """enable_thinking=False: the generation prompt ends in the empty think block, so only content + <|im_end|>
    is written by the model and masked."""
    conversation = CONVERSATIONS[case]
    prompt = qwen3.apply_chat_template(conversation[:-1], enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n" + THINK)
    written = [f"{answer}<|im_end|>" for answer in _answers(conversation)]
    _check(qwen3, conversation, _qwen3_text(conversation), written, enable_thinking=False)


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_qwen3_thinking_on(qwen3: ChatTokenizer, case: str) -> None:
    """Thinking on (the default): the prompt ends at the assistant header and the model writes the (here empty)
    think block itself, so its tokens are in the mask; the flag reaches every rendering."""
    conversation = CONVERSATIONS[case]
    assert qwen3.apply_chat_template(conversation[:-1]).endswith("<|im_start|>assistant\n")
    written = [f"{THINK}{answer}<|im_end|>" for answer in _answers(conversation)]
    _check(qwen3, conversation, _qwen3_text(conversation), written)
    _check(qwen3, conversation, _qwen3_text(conversation), written, enable_thinking=True)
    _, mask_off = tokenize_conversation(qwen3, conversation, 4096, enable_thinking=False)
    _, mask_on = tokenize_conversation(qwen3, conversation, 4096)
    think_tokens = len(qwen3.encode(THINK))
    assert mask_on.sum() - mask_off.sum() == think_tokens * len(written)


def test_real_tau_prompts_are_rendered_with_the_recipes_template_variables(qwen3: ChatTokenizer,
                                                                           tmp_path: Path) -> None:
    """Real τ during training renders its held-out prompts with the recipe's data.regen.template_kwargs (a Qwen3
    drafter trained on non-thinking answers is chosen on non-thinking replies), and says which in best.json."""
    from types import SimpleNamespace

    from dflash.data.eval_sets import eval_prompts
    from dflash.train.config import TrainConfig
    from dflash.train.real_eval import RealTauEval

    off = eval_prompts(qwen3, ["gsm8k", "mtbench"], 2, template_kwargs={"enable_thinking": False})
    on = eval_prompts(qwen3, ["gsm8k", "mtbench"], 2)
    assert all(qwen3.decode(list(p.ids), skip_special_tokens=False).endswith("assistant\n" + THINK) for p in off)
    assert not any(qwen3.decode(list(p.ids), skip_special_tokens=False).endswith(THINK) for p in on)
    cfg = TrainConfig(eval_every=10, eval_prompts=2, eval_sets=("gsm8k", "mtbench"))
    evaluator = RealTauEval(cfg, SimpleNamespace(tokenizer=qwen3), None, tmp_path,
                            template_kwargs={"enable_thinking": False})
    assert evaluator.prompts == off
    assert evaluator.setup == {"sets": ["gsm8k", "mtbench"], "per_set": 2, "new_tokens": cfg.eval_tokens,
                               "template_kwargs": {"enable_thinking": False}}
    # a best/ measured on other prompts is not compared with this run's τ: the next evaluation replaces it
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(json.dumps({"step": 5, "tau": 9.0, "eval": {**evaluator.setup,
                                                                                              "template_kwargs": {}}}))
    assert RealTauEval(cfg, SimpleNamespace(tokenizer=qwen3), None, tmp_path).best is not None
    assert RealTauEval(cfg, SimpleNamespace(tokenizer=qwen3), None, tmp_path,
                       template_kwargs={"enable_thinking": False}).best is None


class _Chosen(Exception):
    """Raised by the fake K chooser with the prompts it was given (nothing is measured)."""


def test_the_k_chooser_of_serve_and_demo_renders_the_recipes_template_variables(qwen3: ChatTokenizer, tmp_path: Path,
                                                                                 monkeypatch, capsys) -> None:
    """`serve.block_size: auto` measures K on held-out prompts rendered with the recipe's data.regen.template_kwargs
    (one source of template variables, D93), in `dflash serve` (`build_servers`) and in `dflash demo`'s evaluation,
    and says which variables it used; without them the prompts are the template's defaults (thinking on)."""
    from types import SimpleNamespace

    import dflash.models.registry as registry
    from dflash.configs.recipe import load_recipe
    from dflash.data.eval_sets import eval_prompts
    from dflash.launch import demo, serving

    def chooser(target, prompts, **_):
        raise _Chosen(prompts)

    target = SimpleNamespace(cfg=None, tokenizer=qwen3)
    monkeypatch.setattr(serving, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(serving, "load_drafter", lambda *a, **k: object())
    monkeypatch.setattr(serving, "Measured", chooser)
    monkeypatch.setattr(registry, "shipped_drafter_path", lambda source: None)
    off = eval_prompts(qwen3, serving.AUTO_SETS, serving.AUTO_PER_SET, template_kwargs={"enable_thinking": False})
    on = eval_prompts(qwen3, serving.AUTO_SETS, serving.AUTO_PER_SET)
    assert off != on and all(qwen3.decode(list(p.ids), skip_special_tokens=False).endswith(THINK) for p in off)
    for kwargs, want in (("{enable_thinking: false}", off), ("{}", on)):
        recipe = load_recipe("tiny", ["serve.block_size=auto", f"data.regen.template_kwargs={kwargs}",
                                      f"train.run_dir={tmp_path}"])
        with pytest.raises(_Chosen) as served:
            serving.build_servers(recipe, serving.ServeOptions(drafter=tmp_path, port=0))
        out = io.StringIO()
        with pytest.raises(_Chosen) as demoed:
            demo.short_eval(recipe, target, out, progress=False)
        assert served.value.args[0] == demoed.value.args[0] == want
        said = f"chat-template variables {'{}' if want is on else '{\"enable_thinking\": false}'} (data.regen."
        assert said in out.getvalue() and said in capsys.readouterr().out  # demo: its `out`; serve: stdout


def test_qwen3_history_rewrite_is_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A template that drops the think blocks of earlier turns (as Qwen3's published one does) renders an
    earlier turn differently once the conversation goes on: single turns work, multi-turn is refused."""
    tok = _qwen3(tmp_path_factory, QWEN3_HISTORY_REWRITE_TEMPLATE)
    conversation = CONVERSATIONS["single"]
    _check(tok, conversation, _qwen3_text(conversation), [f"{ANSWER_1}<|im_end|>"], enable_thinking=False)
    for kwargs in ({"enable_thinking": False}, {}):
        with pytest.raises(ValueError, match="prefix"):
            tokenize_conversation(tok, CONVERSATIONS["multi"], 4096, **kwargs)


def test_truncation_keeps_the_mask_aligned(llama3: ChatTokenizer) -> None:
    conversation = CONVERSATIONS["multi_system"]
    ids, mask = tokenize_conversation(llama3, conversation, 4096)
    cut_ids, cut_mask = tokenize_conversation(llama3, conversation, len(ids) - 5)
    np.testing.assert_array_equal(cut_ids, ids[:-5])
    np.testing.assert_array_equal(cut_mask, mask[:-5])


def _regenerated_dir(tmp_path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    rows = [{"id": f"t:{i}", "source": "t", "messages": c} for i, c in enumerate(conversations)]
    (tmp_path / "regenerated.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_training_rows_use_the_serving_template_variables(qwen3: ChatTokenizer, tmp_path: Path) -> None:
    """With data.regen.template_kwargs = {enable_thinking: False} (how Qwen3 targets are served and
    regenerated), a training row starts with exactly the served prompt ids (empty think block included, loss
    0) and its first loss token is the answer's first token; without them the think block would be loss."""
    conversation = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}]
    data_dir = _regenerated_dir(tmp_path, [conversation])
    served = qwen3.encode_chat(conversation[:1], add_generation_prompt=True, enable_thinking=False)
    answer = qwen3.encode("It is 5.<|im_end|>")
    for kwargs, think_is_loss in (({"enable_thinking": False}, False), ({}, True)):
        cfg = DataConfig(dir=str(data_dir), source="regenerated", seq_len=64, regen=RegenConfig(template_kwargs=kwargs))
        (tokens, mask, n), = build_examples(cfg, qwen3)[0]
        p = len(served)
        assert tokens[:p].tolist() == served  # the think block renders identically either way
        if think_is_loss:
            assert mask[p - 1] == 1  # the empty think block was trained as if the model wrote it
        else:
            assert not mask[:p].any() and mask[p] == 1
            assert tokens[p:p + len(answer)].tolist() == answer and mask[p:p + len(answer)].all()
            assert n == p + len(answer) + 1  # + the template's trailing newline (loss 0)


def test_training_row_prompt_is_the_engine_prompt_and_first_loss_token_is_generated(smollm2_target,
                                                                                     tmp_path: Path) -> None:
    """The embedded target: its engine's greedy reply to a chat prompt, stored as a regenerated conversation,
    tokenises back to the served prompt ids followed by exactly the generated ids, loss from the first one."""
    from dflash.serve.engine import decode

    tok = smollm2_target.tokenizer
    user = [{"role": "user", "content": "Name a prime number between 10 and 20."}]
    prompt = tok.encode_chat(user, add_generation_prompt=True)
    completion, = decode(smollm2_target.params, smollm2_target.cfg, [prompt], 12, max_len=256)
    generated = completion.token_ids
    conversation = user + [{"role": "assistant", "content": tok.decode(generated)}]
    cfg = DataConfig(dir=str(_regenerated_dir(tmp_path, [conversation])), source="regenerated", seq_len=128)
    (tokens, mask, _), = build_examples(cfg, tok)[0]
    p = len(prompt)
    assert tokens[:p].tolist() == prompt and not mask[:p].any()
    assert tokens[p:p + len(generated)].tolist() == generated and mask[p:p + len(generated)].all()
