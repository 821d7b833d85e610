"""Training rows: the conversations of `data.source` (or held-out GSM8K test) tokenised with the chat
template, loss on the assistant tokens only. Online training, `dflash data capture` and the held-out
evaluation all read them from here, so online and offline train on the same rows."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import numpy as np

from data.chat_tokens import tokenize_rows
from data.config import DataConfig
from data.packaged import load_gsm8k
from data.regenerate import read_regenerated

log = logging.getLogger(__name__)

# (tokens int32[S], loss_mask float32[S], n real tokens) per example, all with the same S.
Example = tuple[np.ndarray, np.ndarray, int]


def training_conversations(cfg: DataConfig, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The conversations of `data.source`: packaged GSM8K train, or data.dir/regenerated.jsonl."""
    if cfg.source == "gsm8k":
        return load_gsm8k("train", limit=limit)
    path = cfg.regenerated_path
    if not path.is_file():
        raise FileNotFoundError(f"data.source=regenerated reads {path}, which does not exist; run "
                                "`dflash data regenerate` with this config first (or set data.dir)")
    return read_regenerated(path, limit=limit)


def build_examples(cfg: DataConfig, tokenizer: Any, split: str = "train",
                   limit: int | None = None) -> tuple[list[Example], str]:
    """(examples, sha256 identifying them): `data.source`'s conversations (split "train") or GSM8K test
    (split "test", the held-out set), tokenised to `data.seq_len` with the serving template variables
    (`data.regen.template_kwargs`): a row's prompt ids are the ids the engine is served."""
    limit = limit if limit is not None else (cfg.max_examples or None)
    conversations = training_conversations(cfg, limit) if split == "train" else load_gsm8k(split, limit=limit)
    examples, skipped = tokenize_rows(tokenizer, conversations, cfg.seq_len,
                                      template_kwargs=cfg.regen.template_kwargs)
    if skipped:
        log.info("skipped %d of %d conversations with no assistant token within seq_len=%d", skipped,
                 len(conversations), cfg.seq_len)
    digest = hashlib.sha256()
    for tokens, mask, _ in examples:
        digest.update(tokens.tobytes())
        digest.update(mask.tobytes())
    return examples, digest.hexdigest()


__all__ = ["Example", "build_examples", "training_conversations"]
