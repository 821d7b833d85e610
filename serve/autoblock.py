"""`--block-size auto`: the inference block size K (at most the drafter's training K) that maximises expected
tokens per unit of step cost, from measured acceptance and this machine's measured step cost.

    costs = step_costs(target_params, target_cfg, drafter, candidate_ks(16), prompt_ids, max_len=1024)
    k, table = pick_block_size(accept_per_position, costs)

A DFlash step at block K emits E(K) = 1 + sum_{i < K-1} p_i tokens on average, p_i = share of steps whose
draft i+1 was accepted (`Completion.accept_per_position`, measured at the training K: a smaller K drafts the
same first positions), and costs c(K) seconds (draft + verify + host, measured here by decoding at K). The
pick maximises E(K) / c(K); K = 1 (AR, no drafter) is in the table as the reference, E = 1.

`--tree-nodes auto` does the same over tree budgets at the chosen K (`tree_costs`, `pick_tree_nodes`): for each
candidate N (0 = the chain) it decodes held-out prompts here, measuring the expected tokens per step (τ, the
acceptance of that tree budget: with a tree the acceptance of a position depends on N, so it is measured per N
rather than extrapolated) and the step cost (the verify-cost curve of tree masks, drafting included), and keeps
the N with the most tokens per second.
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


def candidate_nodes(k: int) -> list[int]:
    """0 (the chain of K) and the tree budgets N among 4, K, 2K, 4K, 8K, 16, 32 and 64 that lie in [3, 64]."""
    return [0] + sorted({n for n in (4, k, 2 * k, 4 * k, 8 * k, 16, 32, 64) if 3 <= n <= 64})


def tree_costs(target_params: Params, target_cfg: DecoderConfig, drafter: DFlashDrafter, k: int,
               nodes: Sequence[int], prompts: Sequence[Sequence[int]], *, max_len: int, new_tokens: int = 32,
               ngram: bool = False) -> dict[int, tuple[float, float]]:
    """{N: (τ, seconds per step)} at batch 1 for each tree budget N (0: the chain) at block size K: the engine
    decodes each prompt once to compile, then once timed; τ pooled over the prompts' steps."""
    from dflash.serve.engine import decode

    out = {}
    for n in nodes:
        kwargs = {"drafter": drafter, "block_size": k, "tree_nodes": n, "ngram": ngram and n >= 3}
        decode(target_params, target_cfg, [list(prompts[0])], new_tokens, max_len=max_len, **kwargs)  # compile
        steps, seconds, tokens = 0, 0.0, 0
        for prompt in prompts:
            done, = decode(target_params, target_cfg, [list(prompt)], new_tokens, max_len=max_len, **kwargs)
            steps += len(done.accepted)
            tokens += sum(a + 1 for a in done.accepted)
            seconds += done.decode_s
        out[n] = (tokens / max(steps, 1), seconds / max(steps, 1))
        log.info("tree nodes %d: tau %.2f, %.2f ms per step", n, out[n][0], 1e3 * out[n][1])
    return out


def pick_tree_nodes(costs: dict[int, tuple[float, float]]) -> tuple[int, list[BlockChoice]]:
    """(the N with the most measured tokens per second, the table in N order as `BlockChoice`s: k = N)."""
    if not costs:
        raise ValueError("costs must hold at least one tree budget; received none")
    table = [BlockChoice(n, tau, step_s) for n, (tau, step_s) in sorted(costs.items())]
    return max(table, key=lambda c: c.tokens_per_s).k, table


def format_table(table: Sequence[BlockChoice], chosen: int) -> str:
    """A small text table of the candidates (expected tokens, ms per step, tokens/s, speed vs AR)."""
    ar = next((c for c in table if c.k == 1), None)
    lines = ["  K   E[tokens/step]   ms/step   tokens/s   vs AR"]
    for c in table:
        vs = f"{c.tokens_per_s / ar.tokens_per_s:5.2f}x" if ar else "   - "
        lines.append(f"{c.k:3d}   {c.expected_tokens:14.2f}   {1e3 * c.step_s:7.1f}   {c.tokens_per_s:8.1f}   {vs}"
                     + ("   <- chosen" if c.k == chosen else ""))
    return "\n".join(lines)


__all__ = ["BlockChoice", "candidate_ks", "candidate_nodes", "expected_tokens", "format_table", "pick_block_size",
           "pick_tree_nodes", "step_costs", "tree_costs"]
