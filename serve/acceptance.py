"""Acceptance: how many drafts the target accepts, measured live through the engine or teacher-forced over stored
rows, and the serving choices that follow from it (docs/decisions.md D69). The serve, train and eval layers read
acceptance here; it imports nothing above `serve`.

    metrics = real_tau(target, drafter, prompts, 48)          # live: the engine decodes held-out prompts
    taus = teacher_taus(models, rows, block_size=4)           # teacher-forced: the serving walk and uniform anchors
    plan = plan_from(recipe.serve, drafter, Measured(target, prompts, max_len=1024))   # serve.*: auto

Live (`real_tau`): τ = sum(accepted + 1) / verify steps, pooled over the prompts (bonus included), per set, and
the share of steps whose draft i + 1 was accepted (`accept_per_position`).

Teacher-forced (`teacher_hits`): one target forward and one drafter forward per row give, for a block anchored at
EVERY position a, whether the drafter's argmax at slot k equals the target's greedy token at a + k; the serving walk
visits the blocks greedy decoding visits (`chain`: a_{j+1} = a_j + n_j + 1), uniform anchors visit them all.

Choices: a DFlash step at block K emits E(K) = 1 + sum_{i < K-1} p_i tokens on average and costs c(K) seconds
(measured here by decoding at K); `pick_block_size` maximises E(K) / c(K) (K = 1, AR, is in the table as the
reference). Over tree budgets at the chosen K (`tree_costs`, `pick_tree_nodes`) τ is measured per N rather than
extrapolated (with a tree the acceptance of a position depends on N). `Measured` is the chooser `plan_from`
takes for `serve.block_size: auto` and `serve.tree_nodes: auto`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from dflash.models.config import DecoderConfig
from dflash.models.decoder import Params, embed, forward
from dflash.models.drafter import BlockVisibility, DFlashDrafter, concat_features
from dflash.models.target import Target
from dflash.serve.config import SamplingConfig, lookup_fits
from dflash.serve.engine import DecodeRun, decode
from dflash.serve.plan import AR, Chain, Tree
from dflash.serve.speculative import Models, argmax_drafts, bucket, selector_drafts

log = logging.getLogger(__name__)

LENGTH_STEP = 64  # teacher rows are padded to a multiple of this (a power of two would waste up to half the forward)


# ----------------------------------------------------------------------------- live: through the engine


class EvalPrompt(Protocol):
    """One held-out prompt: its set's name and its chat-templated first user turn (`data.eval_sets.EvalPrompt`)."""

    set: str
    ids: tuple[int, ...]


def pooled_tau(accepted: Sequence[Sequence[int]]) -> float:
    """τ pooled over requests: sum(accepted + 1) / verify steps (0 with no step)."""
    steps = sum(len(a) for a in accepted)
    return sum(x + 1 for a in accepted for x in a) / steps if steps else 0.0


def accept_per_position(accepted: Sequence[Sequence[int]], k: int) -> list[float]:
    """The pooled share of steps whose draft i + 1 was accepted, i = 0 .. K - 2."""
    flat = np.asarray([a for steps in accepted for a in steps], np.int64)
    return [float(np.mean(flat > i)) if flat.size else 0.0 for i in range(k - 1)]


REAL_TAU_SLOTS = 8  # real τ decodes at most this many held-out prompts at once (the engine's pages are per slot)


def decode_max_len(prompts: Sequence[EvalPrompt], new_tokens: int, block_size: int) -> int:
    """Context per slot: the longest prompt (as the engine pads it for prefill) + the new tokens + one block,
    rounded up to a multiple of 16."""
    longest = max(len(p.ids) for p in prompts)
    need = max(bucket(longest), longest + new_tokens + block_size)
    return -(-need // 16) * 16


def real_tau(target: Target, drafter: DFlashDrafter, prompts: Sequence[EvalPrompt], new_tokens: int,
             sampling: SamplingConfig | None = None, teacher: bool = True, prefill_chunk: int | None = None,
             draft_rule: str = "argmax", params: Any = None) -> dict[str, Any]:
    """DFlash decode of `prompts`, REAL_TAU_SLOTS at once (the chain at the drafter's training K, sampled requests
    drafting by `draft_rule`) with the target's params as loaded, greedy or by `sampling` (prompt i seeded
    `sampling.seed + i`: the same drafter and prompts give the same τ); host metrics: `tau` (pooled over prompts),
    `tau/<set>`, `accept_per_position` (pooled), `tokens` (new tokens) and `seconds`; and, on the decoded answers,
    teacher-forced τ (`teacher_taus`) at the serving walk's blocks (`tf_tau_walk`: `tau` again, computed from the
    stored tokens as `dflash data walk` does, equal to it up to numerics) and at every answer position
    (`tf_tau_uniform`: what uniform training anchors measure; minus `tau`, the train/serve gap), unless `teacher` is
    False (they run the drafter over every answer position of a row at once: at long contexts that costs more than
    the decode). `prefill_chunk`: as `Limits` (long prompts prefilled a chunk at a time, so a batch of 8K-token
    prompts does not materialise their whole attention at once). `params`: the target's params on one device
    (default: `target.params`, kept on the target)."""
    t0 = time.perf_counter()
    k = drafter.arch.block_size
    params = target.params if params is None else params
    done = decode(params, target.cfg, [list(p.ids) for p in prompts], new_tokens,
                  max_len=decode_max_len(prompts, new_tokens, k), drafter=drafter, plan=Chain(k, draft_rule),
                  stop_ids=target.tokenizer.stop_token_ids, sampling=sampling,
                  run=DecodeRun(slots=REAL_TAU_SLOTS, prefill_chunk=prefill_chunk))
    metrics: dict[str, Any] = {"tau": pooled_tau([c.accepted for c in done])}
    for name in dict.fromkeys(p.set for p in prompts):
        metrics[f"tau/{name}"] = pooled_tau([c.accepted for c, p in zip(done, prompts, strict=True) if p.set == name])
    metrics["accept_per_position"] = accept_per_position([c.accepted for c in done], k)
    metrics["tokens"] = sum(len(c.token_ids) for c in done)
    if teacher:
        rows = []
        for c in done:
            tokens = np.asarray(c.prompt_ids + c.token_ids, np.int32)
            mask = np.zeros(tokens.size, np.float32)
            mask[len(c.prompt_ids):] = 1
            rows.append((tokens, mask, tokens.size))
        taus = teacher_taus(Models.of(params, target.cfg, drafter), rows, k)
        metrics["tf_tau_walk"], metrics["tf_tau_uniform"] = taus["walk"], taus["uniform"]
    metrics["seconds"] = time.perf_counter() - t0
    return metrics


# ----------------------------------------------------------------------------- teacher-forced: over stored rows


def answer_spans(loss_mask_S: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The assistant turns of a row: (P, E) for each run of loss_mask 1 within its n real tokens (inclusive)."""
    m = np.asarray(loss_mask_S[:n]) > 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])))
    return [(int(s), int(e) - 1) for s, e in zip(edges[::2], edges[1::2], strict=True)]


def chain(lead: Callable[[int], int], start: int, last: int) -> list[tuple[int, int]]:
    """The blocks greedy decoding visits over positions start .. last (x_start is the pending token, x_last the
    last one emitted): [(a_j, n_j)] with n_j = min(lead(a_j), last - a_j - 1) and a_{j+1} = a_j + n_j + 1,
    while a_j < last. `lead(a)`: how many of the block at a's drafts equal the target's greedy tokens."""
    out, a = [], start
    while a < last:
        n = min(int(lead(a)), last - a - 1)
        out.append((a, n))
        a += n + 1
    return out


def block_hidden(models: Models, tokens_1xS: jax.Array, feats_1xSxDf: jax.Array, block_size: int) -> jax.Array:
    """The drafter's hidden states [S, K-1, D] at the draft slots of a block anchored at every position a of one
    row: ids [x_a, MASK..], context the target features at positions < a, as the engine proposes it."""
    drafter = models.drafter()
    s, k = tokens_1xS.shape[1], block_size
    a_S = jnp.arange(s, dtype=jnp.int32)
    ids_SxK = jnp.concatenate([tokens_1xS[0][:, None], jnp.full((s, k - 1), drafter.arch.mask_token_id, jnp.int32)],
                              axis=1)
    pos_SxK = a_S[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    embeds = embed(models.target_params, ids_SxK.reshape(1, s * k)).astype(jnp.float32)
    visible = BlockVisibility.from_anchors(a_S[None], jnp.ones((1, s), bool), window=drafter.arch.sliding_window)
    # every position is an anchor, and the context positions are the row's positions
    hidden = drafter(embeds, pos_SxK.reshape(1, s * k), feats_1xSxDf, a_S[None], visible)
    return hidden.reshape(s, k, -1)[:, 1:]


@partial(jax.jit, static_argnames=("block_size", "chunk"))
def teacher_hits(models: Models, tokens_1xS: jax.Array, block_size: int, chunk: int = 512,
                 feats_1xSxDf: jax.Array | None = None, next_S: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(next_ids int32 [S], hits bool [S, K-1]) of one row: next_ids[p] the target's greedy token after
    tokens[:p+1]; hits[a, k-1] whether the drafter's argmax at slot k of a block anchored at a (ids [x_a, MASK..],
    context the target features at positions < a, as the engine proposes it) equals the target's greedy token
    at a + k, i.e. next_ids[a + k - 1]. With DFlash2's path selector, slot k reads the target's
    token at a + k - 1 (what the engine's drafted token there is whenever the chain has reached slot k). The
    head runs `chunk` rows at a time
    over the draft vocabulary's rows or the full head, as `speculative.propose` does.

    Stored features (`feats_1xSxDf`, e.g. a capture's) replace the target's forward; then `next_S` is the stored
    greedy tokens (a capture's target labels, -1 where unknown) or, when None, the row's own next tokens (the
    stored answer taken as the target's greedy one)."""
    drafter = models.drafter()
    arch, k = drafter.arch, block_size
    s = tokens_1xS.shape[1]
    if feats_1xSxDf is None:
        logits, feats_FxBxSxDt = forward(models.target_params, models.target_cfg, tokens_1xS, layer_ids=arch.layer_ids)
        next_S = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
        feats_1xSxDf = concat_features(feats_FxBxSxDt)
    elif next_S is None:
        next_S = jnp.concatenate([tokens_1xS[0, 1:], jnp.full((1,), -1, tokens_1xS.dtype)]).astype(jnp.int32)
    pos_SxK = jnp.arange(s, dtype=jnp.int32)[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    hidden_RxD = block_hidden(models, tokens_1xS, feats_1xSxDf, k).reshape(s * (k - 1), -1)
    t = hidden_RxD.shape[0]
    c = min(chunk, t)
    pad = -(-t // c) * c - t
    parts = jnp.pad(hidden_RxD, ((0, pad), (0, 0))).reshape(-1, c, hidden_RxD.shape[-1])
    if drafter.candidate_selector is None:
        drafts = jax.lax.map(lambda h: argmax_drafts(models, h[None])[0], parts).reshape(-1)[:t].reshape(s, k - 1)
    else:  # the path selector: slot k's walk step from the target's token at a + k - 1 (the anchor for slot 1)
        prev_R = jnp.concatenate([tokens_1xS[0][:, None], next_S[jnp.clip(pos_SxK[:, 1:-1] - 1, 0, s - 1)]],
                                 axis=1).reshape(-1)
        prevs = jnp.pad(prev_R, (0, pad)).reshape(-1, c)
        step = lambda hp: selector_drafts(models, drafter, hp[0][:, None], hp[1])[:, 0]  # noqa: E731
        drafts = jax.lax.map(step, (parts, prevs)).reshape(-1)[:t].reshape(s, k - 1)
    want = next_S[jnp.clip(pos_SxK[:, 1:] - 1, 0, s - 1)]
    return next_S, (drafts == want) & (pos_SxK[:, 1:] - 1 < s)


def leading(hits_SxJ: np.ndarray) -> np.ndarray:
    """int [S]: the number of leading True of each row (drafts accepted before the first miss)."""
    return np.cumprod(np.asarray(hits_SxJ, bool), axis=1).sum(axis=1)


def teacher_leads(models: Models, tokens_S: np.ndarray, n: int, block_size: int,
                  stored: tuple[np.ndarray, np.ndarray | None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(next_ids [n], lead [n]) of one row's n real tokens (`teacher_hits` on the row padded to a multiple of
    LENGTH_STEP, one compile per length; then the leading hits: how many drafts a block anchored at each position
    gets accepted, before any cut). `stored`: (features [>= n, F*D], next ids [>= n] or None) to use instead of the
    target's forward."""
    length = -(-n // LENGTH_STEP) * LENGTH_STEP
    padded = np.zeros((1, length), np.int32)
    padded[0, :n] = tokens_S[:n]
    feats = next_ids = None
    if stored is not None:
        feats_n, ids_n = stored
        feats = np.zeros((1, length, feats_n.shape[-1]), np.float32)
        feats[0, :n] = np.asarray(feats_n[:n], np.float32)
        if ids_n is not None:
            next_ids = np.full(length, -1, np.int32)
            next_ids[:n] = ids_n[:n]
    next_S, hits = jax.device_get(teacher_hits(models, jnp.asarray(padded), block_size, feats_1xSxDf=feats,
                                               next_S=next_ids))
    return np.asarray(next_S[:n]), leading(hits)[:n]


def matched_prefix(tokens_S: np.ndarray, next_S: np.ndarray, p0: int, e: int) -> int:
    """How many answer tokens x_P .. x_E the target's greedy choices reproduce (x_p == next_ids[p-1])."""
    same = np.asarray(tokens_S[p0:e + 1]) == next_S[p0 - 1:e] if p0 > 0 else np.zeros(e + 1 - p0, bool)
    return int(np.argmin(same)) if not same.all() else e + 1 - p0


def teacher_taus(models: Models, rows: Sequence[tuple[np.ndarray, np.ndarray, int]],
                 block_size: int) -> dict[str, float]:
    """Teacher-forced τ of `rows` (tokens, loss_mask, n) two ways, over each answer's reproduced prefix:
    `walk` at the blocks serving visits (pooled mean accepted + 1 over the chain) and `uniform` at every answer
    position a < last (1 + min(lead, last - a - 1)), what uniform training anchors measure; `walk_blocks` and
    `uniform_blocks` count them. The gap uniform - walk is the train/serve gap of the issue."""
    walk, uniform = [], []
    for tokens, mask, n in rows:
        next_S, lead = teacher_leads(models, tokens, n, block_size)
        for p0, e in answer_spans(mask, n):
            last = p0 + matched_prefix(tokens, next_S, p0, e) - 1
            walk += [acc + 1 for _, acc in chain(lead.__getitem__, p0, last)]
            uniform += [1 + min(int(lead[a]), last - a - 1) for a in range(p0, last)]
    return {"walk": float(np.mean(walk)) if walk else 0.0, "uniform": float(np.mean(uniform)) if uniform else 0.0,
            "walk_blocks": float(len(walk)), "uniform_blocks": float(len(uniform))}

# ----------------------------------------------------------------------------- choices: K and the tree budget


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
    costs = {}
    for k in ks:
        plan = AR() if k == 1 else Chain(k)
        decode(target_params, target_cfg, [list(prompt_ids)], new_tokens, max_len=max_len, drafter=drafter,
               plan=plan)  # compile
        per_step = []
        for _ in range(repeats):
            done, = decode(target_params, target_cfg, [list(prompt_ids)], new_tokens, max_len=max_len,
                           drafter=drafter, plan=plan)
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
    out = {}
    for n in nodes:
        plan = Tree(k, n, ngram and lookup_fits(n)) if n > 1 else Chain(k)
        decode(target_params, target_cfg, [list(prompts[0])], new_tokens, max_len=max_len, drafter=drafter,
               plan=plan)  # compile
        steps, seconds, tokens = 0, 0.0, 0
        for prompt in prompts:
            done, = decode(target_params, target_cfg, [list(prompt)], new_tokens, max_len=max_len, drafter=drafter,
                           plan=plan)
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


class Measured:
    """The chooser for `serve.block_size: auto` and `serve.tree_nodes: auto` (`serve.plan.plan_from`), measured on
    this machine over `prompts` (held-out, chat-templated): K from acceptance per position (`accept`, e.g. a run's
    best.json, when it has the drafter's K - 1 positions; else measured here by `real_tau` over the prompts, 48
    tokens) and step costs measured here; N from τ and step cost measured here per candidate budget (the first
    prompt of each set, 32 tokens). Each choice's table goes to `say` (default: print)."""

    def __init__(self, target: Target, prompts: Sequence[EvalPrompt], *, max_len: int,
                 accept: tuple[Sequence[float], str] | None = None, say: Callable[[str], Any] = print):
        self.target, self.prompts, self.max_len, self.accept, self.say = target, prompts, max_len, accept, say

    def block_size(self, drafter: DFlashDrafter) -> int:
        if self.accept is not None and len(self.accept[0]) == drafter.arch.block_size - 1:
            accept, where = self.accept
        else:
            accept = real_tau(self.target, drafter, self.prompts, 48)["accept_per_position"]
            where = f"{len(self.prompts)} held-out prompts"
        costs = step_costs(self.target.params, self.target.cfg, drafter, candidate_ks(drafter.arch.block_size),
                           self.prompts[0].ids, max_len=self.max_len)
        k, table = pick_block_size(accept, costs)
        self.say(f"serve.block_size auto: acceptance from {where}, step costs measured here\n{format_table(table, k)}")
        return k

    def tree_nodes(self, drafter: DFlashDrafter, k: int, lookup: bool) -> int:
        firsts = [p.ids for p in {p.set: p for p in reversed(self.prompts)}.values()]
        costs = tree_costs(self.target.params, self.target.cfg, drafter, k, candidate_nodes(k), firsts,
                           max_len=self.max_len, ngram=lookup)
        n, table = pick_tree_nodes(costs)
        self.say(f"serve.tree_nodes auto (K={k}; 0 = the chain): tau and step cost measured here\n"
                 + format_table(table, n).replace("  K   E[tokens/step]", "  N   E[tokens/step]"))
        return n


__all__ = ["LENGTH_STEP", "BlockChoice", "EvalPrompt", "Measured", "accept_per_position", "answer_spans",
           "block_hidden", "candidate_ks", "candidate_nodes", "chain", "decode_max_len", "expected_tokens",
           "format_table", "leading", "matched_prefix", "pick_block_size", "pick_tree_nodes", "pooled_tau", "real_tau",
           "step_costs", "teacher_hits", "teacher_leads", "teacher_taus", "tree_costs"]
