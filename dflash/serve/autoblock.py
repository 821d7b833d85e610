"""`--block-size auto`: the inference block size K (at most the drafter's training K) that maximises expected
tokens per unit of step cost, from measured acceptance and this machine's measured step cost.

    costs = step_costs(target_params, target_cfg, drafter, candidate_ks(16), prompt_ids, max_len=1024)
    k, table = pick_block_size(accept_per_position, costs)

A DFlash step at block K emits E(K) = 1 + sum_{i < K-1} p_i tokens on average, p_i = share of steps whose
draft i+1 was accepted (`Completion.accept_per_position`, measured at the training K: a smaller K drafts the
same first positions), and costs c(K) seconds (draft + verify + host, measured here by decoding at K). The
pick maximises E(K) / c(K); K = 1 (AR, no drafter) is in the table as the reference, E = 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params
from dflash.models.drafter import DFlashDrafter

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """One candidate K: expected tokens per step, measured seconds per step, and their ratio."""

    k: int
    expected_tokens: float
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.step_s


def candidate_ks(train_k: int) -> list[int]:
    """1 (AR) and K in {2, 3, 4, 6, 8, 12, 16, 24, 32, ...} up to the training K, which is always included."""
    if train_k < 2:
        raise ValueError(f"train_k must be >= 2; received {train_k}")
    ladder = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    return [1] + sorted({k for k in ladder if k < train_k} | {train_k})


def expected_tokens(accept_per_position: Sequence[float], k: int) -> float:
    """E(K) = 1 + sum of the first K-1 acceptance rates (each p_i = P(draft i+1 accepted))."""
    if k < 1:
        raise ValueError(f"k must be >= 1; received {k}")
    if k - 1 > len(accept_per_position):
        raise ValueError(f"k - 1 = {k - 1} positions need acceptance rates; received {len(accept_per_position)}")
    return 1.0 + float(sum(accept_per_position[: k - 1]))


def step_costs(target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter, ks: Sequence[int],
               prompt_ids: Sequence[int], *, max_len: int, new_tokens: int = 24, repeats: int = 2) -> dict[int, float]:
    """Seconds per decode step at batch 1 for each K in `ks` (1 = AR): the engine decodes `prompt_ids` for
    `new_tokens` tokens once to compile, then `repeats` times timed; decode seconds / steps, best run."""
    from dflash.serve.engine import decode

    costs = {}
    for k in ks:
        kwargs = {} if k == 1 else {"drafter": drafter, "block_size": k}
        decode(target_params, target_cfg, [list(prompt_ids)], new_tokens, max_len=max_len, **kwargs)  # compile
        per_step = []
        for _ in range(repeats):
            done, = decode(target_params, target_cfg, [list(prompt_ids)], new_tokens, max_len=max_len, **kwargs)
            steps = len(done.accepted) if k > 1 else len(done.token_ids) - 1
            per_step.append(done.decode_s / max(steps, 1))
        costs[k] = min(per_step)
        log.info("block size %d: %.2f ms per step", k, 1e3 * costs[k])
    return costs


def pick_block_size(accept_per_position: Sequence[float], costs: dict[int, float]) -> tuple[int, list[BlockChoice]]:
    """(the K > 1 with the most expected tokens per second, every candidate's numbers in K order). DFlash
    is served even where AR (K = 1) would be faster; the table shows it."""
    table = [BlockChoice(k, expected_tokens(accept_per_position, k), costs[k]) for k in sorted(costs)]
    drafting = [c for c in table if c.k > 1]
    if not drafting:
        raise ValueError(f"costs must include a K > 1; received {sorted(costs)}")
    return max(drafting, key=lambda c: c.tokens_per_s).k, table


def format_table(table: Sequence[BlockChoice], chosen: int) -> str:
    """A small text table of the candidates (expected tokens, ms per step, tokens/s, speed vs AR)."""
    ar = next((c for c in table if c.k == 1), None)
    lines = ["  K   E[tokens/step]   ms/step   tokens/s   vs AR"]
    for c in table:
        vs = f"{c.tokens_per_s / ar.tokens_per_s:5.2f}x" if ar else "   - "
        lines.append(f"{c.k:3d}   {c.expected_tokens:14.2f}   {1e3 * c.step_s:7.1f}   {c.tokens_per_s:8.1f}   {vs}"
                     + ("   <- chosen" if c.k == chosen else ""))
    return "\n".join(lines)


__all__ = ["BlockChoice", "candidate_ks", "expected_tokens", "format_table", "pick_block_size", "step_costs"]
