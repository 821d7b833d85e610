"""The `train` section of a recipe."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from dflash.configs.schema import ConfigError, require
from dflash.serve.config import DRAFT_RULES

LOSS_TERMS = ("ce", "tv", "kl", "rkl", "opd")  # the terms of train.loss, defined by train.objective.head_loss


def parse_loss(text: str) -> tuple[tuple[str, float], ...]:
    """`train.loss` as ((term, weight), ...): `NAME` or `NAME:WEIGHT,NAME:WEIGHT,...` over LOSS_TERMS (weight 1 when
    left out), each name at most once, each weight a finite number > 0 (ConfigError naming the rule otherwise).
    `decay` / `dpace`, the per-slot weightings `train.loss` named until the distribution losses, are refused with
    a pointer to `train.weighting`."""
    field = "train.loss"
    text = str(text)
    require(text.strip() not in ("decay", "dpace"), field, text,
            "name loss terms; the per-slot weighting it used to name is now train.weighting (e.g. train.loss=ce "
            f"train.weighting={text.strip()})")
    terms = []
    for part in text.split(","):
        name, _, weight = part.strip().partition(":")
        name = name.strip()
        require(name in LOSS_TERMS, field, text, f"name terms among {list(LOSS_TERMS)}, as NAME or NAME:WEIGHT joined "
                                                 "by commas (e.g. ce:0.1,tv:0.9)")
        try:
            value = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise ConfigError(f"{field} must give each term's weight as a number (NAME:WEIGHT); received "
                              f"{text!r}") from None
        require(math.isfinite(value) and value > 0, field, text, f"give each term a finite weight > 0 ({name})")
        terms.append((name, value))
    names = [n for n, _ in terms]
    require(len(set(names)) == len(names), field, text, "name each term once")
    return tuple(terms)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1 (= all remaining devices). Their product must equal the
    number of devices used."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        sizes = (self.data, self.fsdp, self.tensor)
        require(all(s == -1 or s >= 1 for s in sizes), "train.mesh", sizes, "hold sizes >= 1 or -1")
        require(sum(s == -1 for s in sizes) <= 1, "train.mesh", sizes, "hold at most one -1")


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `num_devices`, the -1 filled in (pure: `dflash launch` checks a recipe's mesh
    against a slice's chips with it before any pod starts; `train.sharding.make_mesh` builds the mesh)."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        require(num_devices % known == 0, "train.mesh", tuple(sizes),
                f"divide the {num_devices} devices (the fixed axes multiply to {known})")
        sizes[sizes.index(-1)] = num_devices // known
    require(math.prod(sizes) == num_devices, "train.mesh", tuple(sizes),
            f"multiply to the number of devices ({num_devices})")
    return sizes[0], sizes[1], sizes[2]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run.

    run_dir: checkpoints, metrics.jsonl, TensorBoard and wandb files; a run resumes from its latest
             checkpoint automatically.
    init_from: a fresh run starts from this drafter's weights instead of a random init: a run dir (its latest
             checkpoint), a z-lab or speculators export, or an HF Hub export downloaded locally; its
             architecture must equal the recipe's (every differing field is named), except that a path
             selector or DFlash2's convolutions the recipe adds start as in a new drafter (drafting what
             the loaded one drafts: `loop.init_from_params`), and the block size may differ (a drafter trained
             at one K fine-tuned at another). Weights ignored on resume;
             with head_vocab the run trains over that drafter's draft vocabulary when it has one.
    steps / batch_size / num_anchors: updates, sequences per update (global), anchors (blocks) per
             sequence (N).
    lr / warmup_frac / clip / weight_decay: AdamW on linear warmup + cosine to 0, global-norm clipping; the
             decay applies to kernels only, not to the RMSNorm scales (`train.step.decays`).
    loss: the loss terms, `NAME` or a weighted mix `NAME:WEIGHT,...` (`parse_loss`) of `ce` (cross-entropy
             against the label, or with data.labels=soft the target's renormalised top-k), and, needing
             data.labels=soft, `tv` (total variation to the target's distribution: the rejection probability of
             sampled speculative decoding), `kl` (forward KL(target || drafter)), `rkl` (reverse KL(drafter ||
             target)) and `opd` (per block, kl on the slots the teacher-forced chain accepts, rkl decayed by
             opd_gamma per slot from the first rejection on); `train.objective.head_loss` has the definitions.
    weighting: the per-slot weights on top of every term: `decay` (the paper's fixed exp(-(k-1)/gamma)) or `dpace`
             (D-PACE: from the drafter's own confidence in each slot's label, `train.objective.dpace_weights`);
             docs/decisions.md D19, D27.
    gamma: loss decay of docs/design.md §4.2 (0 = chosen from the block size). dpace_alpha: D-PACE's confidence floor.
    opd_gamma: the `opd` term's decay per slot past a block's first rejection, in (0, 1].
    head_chunk: rows per chunk of the LM head + cross-entropy (0 = about 128 MiB of fp32 logits per chunk).
    selector_weight: DFlash2's path selector (`drafter.selector`) trains on a per-slot k-way cross-entropy given
             the label before it (speculators' objective), weighted by selector_weight in the drafter's loss; only
             the selector learns from it (`train.selector`).
    head_vocab: train the softmax over the `head_vocab` most frequent tokens of the training answers (labels
             outside it are left out), 0 = the full vocabulary; the served drafter proposes over the same
             tokens (its draft vocabulary, `models.drafter.DraftVocab`; docs/decisions.md D24).
    compute_dtype: forward dtype (master params and optimizer state are always fp32).
    seed: the run's one seed: the drafter's initialisation and the loader's order (each epoch a different
             permutation), and the sampled real-τ decodes.
    save_every / keep_checkpoints: checkpoint cadence (the last step is always saved) and retention.
    log_every: metrics cadence (metrics.jsonl, TensorBoard under run_dir/tensorboard always, wandb).
    wandb: `offline` (default; files under run_dir/wandb, no network), `online`, or `disabled`.
    eval_every: steps between real-τ evaluations (0 = off; when on, the last step is always evaluated): the
             current drafter decodes `eval_prompts` held-out prompts of each of `eval_sets` (first turns,
             greedy, `eval_tokens` new tokens each, rendered with data.regen.template_kwargs) with the engine; the
             best drafter by real τ is kept in run_dir/best (z-lab layout + best.json + run.json). 8 per set: the
             paired τ difference of two checkpoints varies by 0.015 (std) between sets of 24 prompts, 0.030 between
             sets of 6 (docs/studies/2026-12-07-best-noise.md, D94).
    walk_anchors: the fraction of each row's num_anchors drawn from the serving walk's block starts (`data.walk`,
             `dflash data walk`), the rest uniformly among the row's valid positions as without it (0 = off).
    walk_oversample: p of the walk anchors' weights (K - accepted)^p: 0 draws the walk's block starts alike, p > 0
             favours the blocks that rejected early (a block that rejected its first draft weighs K^p, one that
             accepted all K-1 drafts 1); drawn without replacement by Gumbel top-k over those weights.
    eval_temperature: when > 0, each real-τ evaluation also decodes the same prompts sampled at this temperature
             (a fixed seed; lossless speculative sampling) and logs that τ as its own metric (`real_tau_t/...`);
             the best drafter is still chosen by greedy τ.
    eval_draft_rule: how those sampled decodes draft (`serve.draft_rule`: argmax, or sample, D64).
    """

    run_dir: str = "runs/default"
    init_from: str = ""
    steps: int = 2000
    batch_size: int = 8
    num_anchors: int = 16
    lr: float = 6e-4
    warmup_frac: float = 0.04
    clip: float = 1.0
    weight_decay: float = 0.0
    loss: str = "ce"
    weighting: Literal["decay", "dpace"] = "decay"
    gamma: float = 0.0
    opd_gamma: float = 0.5
    dpace_alpha: float = 0.5
    head_chunk: int = 0
    head_vocab: int = 0
    selector_weight: float = 1.0
    compute_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    seed: int = 0
    save_every: int = 200
    keep_checkpoints: int = 3
    log_every: int = 10
    wandb: Literal["offline", "online", "disabled"] = "offline"
    eval_every: int = 0
    eval_prompts: int = 8
    eval_sets: tuple[str, ...] = ("gsm8k", "mtbench", "humaneval")
    eval_tokens: int = 48
    walk_anchors: float = 0.0
    walk_oversample: float = 0.0
    eval_temperature: float = 0.0
    eval_draft_rule: str = "argmax"
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        require(self.steps >= 1, "train.steps", self.steps, "be at least 1")
        require(self.batch_size >= 1, "train.batch_size", self.batch_size, "be at least 1")
        require(self.num_anchors >= 1, "train.num_anchors", self.num_anchors, "be at least 1")
        require(self.lr > 0, "train.lr", self.lr, "be > 0")
        require(0 <= self.warmup_frac < 1, "train.warmup_frac", self.warmup_frac, "lie in [0, 1)")
        require(self.clip > 0, "train.clip", self.clip, "be > 0")
        require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "be >= 0")
        _ = self.loss_terms  # parse_loss validates the spelling
        require(0 < self.opd_gamma <= 1, "train.opd_gamma", self.opd_gamma, "lie in (0, 1]")
        require(self.gamma >= 0, "train.gamma", self.gamma, "be >= 0 (0 = chosen from the block size)")
        require(0 < self.dpace_alpha <= 1, "train.dpace_alpha", self.dpace_alpha, "lie in (0, 1]")
        require(self.head_vocab >= 0, "train.head_vocab", self.head_vocab, "be >= 0 (0 = the full vocabulary)")
        require(self.selector_weight >= 0, "train.selector_weight", self.selector_weight, "be >= 0")
        require(self.head_chunk >= 0, "train.head_chunk", self.head_chunk, "be >= 0 (0 = automatic)")
        require(self.save_every >= 1, "train.save_every", self.save_every, "be at least 1")
        require(self.keep_checkpoints >= 1, "train.keep_checkpoints", self.keep_checkpoints, "be at least 1")
        require(self.log_every >= 1, "train.log_every", self.log_every, "be at least 1")
        require(self.eval_every >= 0, "train.eval_every", self.eval_every, "be >= 0 (0 = no real-τ evaluation)")
        require(self.eval_prompts >= 1, "train.eval_prompts", self.eval_prompts, "be at least 1")
        require(len(self.eval_sets) >= 1 and all(isinstance(s, str) and s for s in self.eval_sets),
                "train.eval_sets", self.eval_sets, "hold at least one evaluation set name")
        require(len(set(self.eval_sets)) == len(self.eval_sets), "train.eval_sets", self.eval_sets,
                "name each set once")
        require(self.eval_tokens >= 1, "train.eval_tokens", self.eval_tokens, "be at least 1")
        require(0 <= self.walk_anchors <= 1, "train.walk_anchors", self.walk_anchors, "lie in [0, 1] (0 = off)")
        require(self.walk_oversample >= 0, "train.walk_oversample", self.walk_oversample, "be >= 0")
        require(math.isfinite(self.eval_temperature) and self.eval_temperature >= 0, "train.eval_temperature",
                self.eval_temperature, "be >= 0 (0 = greedy only)")
        require(self.eval_draft_rule in DRAFT_RULES, "train.eval_draft_rule", self.eval_draft_rule,
                "be argmax or sample (serve.draft_rule)")

    @property
    def loss_terms(self) -> tuple[tuple[str, float], ...]:
        """`loss` parsed: ((term, weight), ...)."""
        return parse_loss(self.loss)


__all__ = ["LOSS_TERMS", "MeshConfig", "TrainConfig", "mesh_shape", "parse_loss"]
