"""Training rows: the conversations of `data.source` (or held-out GSM8K test) tokenised with the chat
template, loss on the assistant tokens only. Online training, `dflash data capture` and the held-out
evaluation all read them from here, so online and offline train on the same rows."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import numpy as np

from dflash.data.chat_tokens import tokenize_rows
from dflash.data.config import DataConfig
from dflash.data.packaged import PACKAGED_REGENERATED, load_gsm8k, packaged_regenerated_path
from dflash.data.regen_store import read_regenerated

log = logging.getLogger(__name__)

# (tokens int32[S], loss_mask float32[S], n real tokens) per example, all with the same S.
Example = tuple[np.ndarray, np.ndarray, int]


def training_conversations(cfg: DataConfig, limit: int | None = None) -> list[list[dict[str, str]]]:
    """The conversations of `data.source`: packaged GSM8K train, a packaged regenerated set, or
    data.dir/regenerated.jsonl."""
    if cfg.source == "gsm8k":
        return load_gsm8k("train", limit=limit)
    if cfg.source in PACKAGED_REGENERATED:
        return read_regenerated(packaged_regenerated_path(cfg.source), limit=limit)
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
    if split == "train" and cfg.source in PACKAGED_REGENERATED:
        _check_packaged_tokenizer(cfg.source, tokenizer)
    conversations = training_conversations(cfg, limit) if split == "train" else load_gsm8k(split, limit=limit)
    examples, skipped = tokenize_rows(tokenizer, conversations, cfg.seq_len,
                                      template_kwargs=cfg.regen.template_kwargs)
    if skipped:
        log.info("skipped %d rows (of %d conversations) with no assistant token within seq_len=%d", skipped,
                 len(conversations), cfg.seq_len)
    digest = hashlib.sha256()
    for tokens, mask, _ in examples:
        digest.update(tokens.tobytes())
        digest.update(mask.tobytes())
    return examples, digest.hexdigest()


def _check_packaged_tokenizer(name: str, tokenizer: Any) -> None:
    """Warn when a packaged regenerated set was made by another target's tokenizer (then it is not this
    target's own answers, which is what makes regenerated data worth training on)."""
    meta_path = packaged_regenerated_path(name).with_name(PACKAGED_REGENERATED[name].removesuffix(".jsonl.xz")
                                                          + ".meta.json")
    made_by = json.loads(meta_path.read_text())["regeneration"]["tokenizer"] if meta_path.is_file() else None
    if made_by is not None and hasattr(tokenizer, "fingerprint") and tokenizer.fingerprint() != made_by:
        log.warning("data.source=%s holds another target's answers (tokenizer %s..., this target's %s...): "
                    "regenerate with `dflash data regenerate` for this target", name, made_by[:12],
                    tokenizer.fingerprint()[:12])


def training_vocab(examples: list[Example], size: int, vocab_size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The `size` token ids a training softmax covers (sorted): first `always` (e.g. the stop tokens), then by
    count as a label (loss-mask tokens of `examples`), then by count anywhere in the rows, then by id."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"size must lie in [1, {vocab_size}]; received {size}")
    labels = np.bincount(np.concatenate([t[m > 0] for t, m, _ in examples] or [np.zeros(0, np.int64)]),
                         minlength=vocab_size)
    anywhere = np.bincount(np.concatenate([t[:n] for t, _, n in examples] or [np.zeros(0, np.int64)]),
                           minlength=vocab_size)
    pinned = np.zeros(vocab_size, bool)
    pinned[list(always)] = True
    order = np.lexsort((np.arange(vocab_size), -anywhere[:vocab_size], -labels[:vocab_size], ~pinned))
    return np.sort(order[:size]).astype(np.int32)


__all__ = ["Example", "build_examples", "training_conversations", "training_vocab"]
