"""A tiny mixture-of-experts target as a Hugging Face directory: the golden tiny `qwen3_moe` or `gpt_oss` weights
(tests/golden/tiny, made by tools/golden_families.py) beside a 200-token word-level tokenizer trained on GSM8K
answers and a ChatML template (their 256-row embeddings fit no real tokenizer). Used by
tests/test_target_moe_e2e.py and the pod rehearsal (tools/pod_smoke.py); its MASK token for a drafter is
MASK_TOKEN_ID, a row no word uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from dflash.data.packaged import load_gsm8k

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "tiny"
CASES = ("qwen3_moe", "gpt_oss")
MASK_TOKEN_ID = 255  # past the tokenizer's 200 words, inside the 256-row embedding
CHATML = (r"{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endfor %}"
          r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def tiny_moe_dir(case: str, root: Path) -> Path:
    """`root` made into the tiny `case` target's directory (weights, config, tokenizer, template); returns it."""
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}; received {case!r}")
    shutil.copytree(GOLDEN / case, root, ignore=shutil.ignore_patterns("reference.npz", "mxfp4"))
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.WordLevelTrainer(vocab_size=200, special_tokens=[AddedToken(t, special=True) for t in special])
    texts = [m["content"] for c in load_gsm8k("train", limit=200) for m in c] + ["user assistant"]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return root
