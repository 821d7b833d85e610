"""Tree drafting and verification (serve/tree.py; docs/design.md §4.4): the best-first tree holds the most probable
paths, greedy tree decoding equals AR token for token (fp32, CPU) at several budgets and batch sizes with requests
joining and leaving, sampled tree decoding has the target's distribution (chi-square), prompt lookup alone and
merged into the tree stays exact.

The tiny random target (vocab 256) and an untrained drafter, whose trees are mostly rejected; an oracle gives
ranked lists whose right token is never the first choice, so accepted paths run through siblings.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ar_alone, tiny_engine_models

from dflash.serve.engine import DecodeRun, Engine, decode
from dflash.serve.lookup import append_history, lookup_paths, ngram_continuation
from dflash.serve.plan import Limits, Lookup, Tree
from dflash.serve.sampling import SamplingConfig
from dflash.serve.speculative import view_slots
from dflash.serve.tree import build_tree

TRAIN_K = 8
MAX_LEN = 128
NEW = 20


def test_best_first_tree_holds_the_most_probable_paths():
    """The N - 1 non-root nodes are exactly the N - 1 most probable paths of the product of the per-depth lists
    (brute force over every path), parents come before children, siblings in rank order."""
    rng = np.random.default_rng(3)
    d, m, nodes = 3, 4, 14
    logp = -np.sort(rng.exponential(1.0, size=(2, d, m)), axis=-1)  # descending at each depth
    ids = rng.permutation(256)[: 2 * d * m].reshape(2, d, m)
    tree = build_tree(jnp.asarray(ids, jnp.int32), jnp.asarray(logp, jnp.float32), jnp.asarray([7, 9]), nodes)
    token, parent, depth = (np.asarray(a) for a in (tree.token, tree.parent, tree.depth))
    for b in range(2):
        paths = {}
        for length in range(1, d + 1):
            for ranks in itertools.product(range(m), repeat=length):
                paths[tuple(int(ids[b, i, r]) for i, r in enumerate(ranks))] = sum(logp[b, i, r]
                                                                                   for i, r in enumerate(ranks))
        want = sorted(paths, key=paths.get, reverse=True)[: nodes - 1]
        got = []
        for i in range(1, nodes):
            assert 0 <= parent[b, i] < i and depth[b, i] == depth[b, parent[b, i]] + 1
            path, j = [], i
            while j > 0:
                path.append(int(token[b, j]))
                j = parent[b, j]
            got.append(tuple(path[::-1]))
        assert sorted(got) == sorted(want) and token[b, 0] == [7, 9][b] and parent[b, 0] == -1
        for i in range(1, nodes):  # siblings in rank order: an elder sibling's token ranks higher at its depth
            for j in range(i + 1, nodes):
                if parent[b, i] == parent[b, j]:
                    row = list(ids[b, depth[b, i] - 1])
                    assert row.index(token[b, i]) < row.index(token[b, j])


def test_an_extra_path_merges_as_a_trie():
    """A lookup path sharing its first token with a drafter node follows that node and adds the rest as new
    nodes; a path of length 0 adds nothing (its nodes stay unused: no parent)."""
    ids = jnp.asarray([[[5, 6], [8, 9]]] * 2, jnp.int32)
    logp = jnp.log(jnp.asarray([[[0.6, 0.4], [0.7, 0.3]]] * 2, jnp.float32))
    tree = build_tree(ids, logp, jnp.asarray([1, 1]), 6, jnp.asarray([[5, 3], [4, 4]]), jnp.asarray([2, 0]))
    token, parent = np.asarray(tree.token), np.asarray(tree.parent)
    # drafter nodes: 5 (p .6), 5-8 (.42), 6 (.4); lookup [5, 3]: follows node 1, adds 3 under it
    assert token[0].tolist()[:4] == [1, 5, 8, 6] and parent[0].tolist()[:4] == [-1, 0, 1, 0]
    assert token[0, 5] == 3 and parent[0, 5] == 1 and parent[0, 4] == -1
    assert parent[1, 4:].tolist() == [-1, -1]


def test_ngram_continuation_takes_the_latest_longest_match():
    assert ngram_continuation([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3) == [7, 5, 1]
    assert ngram_continuation([4, 5, 6, 4], 2) == [5, 6]
    assert ngram_continuation([1, 2, 3], 4) == []


def test_device_lookup_equals_the_host_lookup():
    """`lookup_paths` (the device loop's prompt lookup) finds what `ngram_continuation` finds, on 200 random
    histories of every length 0 .. 40 over small vocabularies (so matches of 1, 2 and 3 tokens all occur), and
    `append_history` appends exactly the counted tokens."""
    rng = np.random.default_rng(5)
    histories = rng.integers(0, 4, size=(200, 40))
    histories[::2] = rng.integers(0, 9, size=(100, 40))
    sizes = rng.integers(0, 41, size=200)
    paths, lengths = (np.asarray(a) for a in lookup_paths(jnp.asarray(histories, jnp.int32), jnp.asarray(sizes), 5))
    for h, size, path, n in zip(histories, sizes, paths, lengths, strict=True):
        assert path[:n].tolist() == ngram_continuation(h[:size].tolist(), 5) and not path[n:].any()
    assert 0 < np.count_nonzero(lengths < 5) and 0 < np.count_nonzero(lengths == 5)
    history, size = append_history(jnp.zeros((2, 6), jnp.int32), jnp.asarray([1, 4]), jnp.asarray([[7, 8, 9],
                                                                                                   [5, 6, 7]]),
                                   jnp.asarray([2, 3]))
    assert np.asarray(history).tolist() == [[0, 7, 8, 0, 0, 0], [0, 0, 0, 0, 5, 6]] and size.tolist() == [3, 7]


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params, drafter = tiny_engine_models(TRAIN_K)
    rng = np.random.default_rng(0)
    # the last prompt repeats itself, so prompt lookup finds matches
    prompts = [list(rng.integers(0, 255, size=n)) for n in (5, 17, 9)] + [[3, 4, 5, 6, 7] * 4]
    ar = [ar_alone(target_params, target_cfg, p, NEW) for p in prompts]
    return target_cfg, target_params, drafter, prompts, ar


def _oracle_lists(prompts, ar):
    """Ranked lists whose right token (read from AR) is second at every depth, just behind a wrong one, with a
    third, unlikely choice: a binary best-first tree, so an accepted path always runs through siblings."""
    def lists(state, k, m):
        lengths, pending = np.asarray(state.lengths), np.asarray(state.pending)
        ids = np.zeros((len(pending), k - 1, m), np.int32)
        logp = np.full((len(pending), k - 1, m), -30.0, np.float32)
        logp[:, :, 0], logp[:, :, 1], logp[:, :, 2:] = -0.69, -0.70, -20.0
        for b, slot in enumerate(view_slots(state)):  # the step's rows: decode's slot i holds prompt i
            ids[b] = np.arange(m)[None, :] + 100
            done = int(lengths[b]) - len(prompts[slot % len(prompts)])
            ref = ar[slot % len(ar)]
            for i in range(1, k):
                right = ref[done + i] if 0 <= done and done + i < len(ref) else 0
                ids[b, i - 1, 0], ids[b, i - 1, 1] = (right + 1) % 256, right
                ids[b, i - 1, 2:] = [(right + 2 + j) % 256 for j in range(m - 2)]
        return ids, logp
    return lists


# slow: test_greedy_tree_follows_siblings_and_equals_ar (a tree without lookup, batch 4, equals AR) and
# test_tree_steps_per_dispatch_change_no_output[argmax] (the drafter's own trees, with lookup, equal AR)
@pytest.mark.slow
@pytest.mark.parametrize("nodes, ngram", [(5, False), (12, True)])
def test_greedy_tree_equals_ar_batch_4(setup, nodes, ngram):
    target_cfg, target_params, drafter, prompts, ar = setup
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, drafter=drafter,
                     plan=Tree(TRAIN_K, nodes, ngram))
    for res, ref in zip(results, ar, strict=True):
        assert res.token_ids == ref
        assert sum(a + 1 for a in res.accepted) == len(res.token_ids) - 1


def test_greedy_tree_follows_siblings_and_equals_ar(setup):
    """Oracle lists with the right token second: 16 nodes form a binary tree 3 levels deep (plus one node),
    so every full step accepts 3 drafts, each through a second child."""
    target_cfg, target_params, drafter, prompts, ar = setup
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN,
                     plan=Tree(TRAIN_K, 16, ranked=_oracle_lists(prompts, ar)), drafter=drafter)
    for res, ref in zip(results, ar, strict=True):
        assert res.token_ids == ref
        assert all(a == 3 for a in res.accepted[:-1]) and res.accepted[-1] <= 3


# slow: test_tree_steps_per_dispatch_change_no_output[argmax] (the same plan and engine shape: 4 requests on 2 slots
# joining as others leave, a stop id and budgets, equal to AR)
@pytest.mark.slow
def test_tree_requests_joining_and_leaving_equal_ar(setup):
    """Two slots, four requests of different budgets (a stop token in one): requests join as others leave,
    and each output equals AR alone."""
    target_cfg, target_params, drafter, prompts, ar = setup
    engine = Engine(target_params, target_cfg, drafter, Tree(TRAIN_K, 12, lookup=True),
                    Limits(slots=2, max_len=MAX_LEN))
    budgets = [NEW, 7, 13, NEW]
    stop = ar[2][4]
    ids = [engine.submit(p, n, stop_ids=(stop,) if i == 2 else ()) for i, (p, n) in enumerate(zip(prompts, budgets,
                                                                                                    strict=True))]
    done = engine.run()
    for i, rid in enumerate(ids):
        want = ar[i][: budgets[i]]
        if i == 2 and stop in want:
            want = want[: want.index(stop) + 1]
        assert done[rid].token_ids == want
    assert engine.pool.num_free == engine.pool.num_usable


@pytest.mark.parametrize("rule", ["argmax", "sample"])
def test_tree_steps_per_dispatch_change_no_output(setup, rule):
    """A tree with prompt lookup at R = 4 steps per dispatch (`decode_tree_steps`, lookup on the device) against
    R = 1, two slots, requests joining as others leave: a stop id and budgets inside a dispatch, and a seeded
    sampled request (its children the top-ranked tokens, or drawn from the drafter); tokens, finish reasons and
    per-step acceptance are identical, and greedy outputs equal AR (the sample rule leaves them alone)."""
    target_cfg, target_params, drafter, prompts, ar = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    stop = next(t for i, t in enumerate(ar[1]) if i >= 5 and ar[1].index(t) == i)  # first seen after 5 tokens

    def run(r):
        engine = Engine(target_params, target_cfg, drafter, Tree(TRAIN_K, 12, lookup=True, rule=rule),
                        Limits(slots=2, max_len=MAX_LEN, steps_per_dispatch=r))
        ids = [engine.submit(prompts[3], NEW), engine.submit(prompts[1], NEW, stop_ids=(stop,)),
               engine.submit(prompts[0], 7), engine.submit(prompts[2], NEW, seed=5, sampling=sampling)]
        done = engine.run()
        assert engine.pool.num_free == engine.pool.num_usable
        return engine, [done[rid] for rid in ids]

    (_, one), (looped, four) = run(1), run(4)
    assert any(s[0] == "decode_tree_steps" for s in looped.compiled_shapes)
    for a, b in zip(one, four, strict=True):
        assert (a.token_ids, a.finish_reason, a.accepted) == (b.token_ids, b.finish_reason, b.accepted)
    assert four[0].token_ids == ar[3] and sum(four[0].accepted) > 0
    assert four[1].token_ids == ar[1][:ar[1].index(stop) + 1] and four[1].finish_reason == "stop"
    assert four[2].token_ids == ar[0][:7] and four[2].finish_reason == "length"


def test_prompt_lookup_alone_equals_ar(setup):
    """No drafter: the chain's drafts are the lookup continuation; the output equals AR and each step accepts
    exactly the continuation's prefix that AR agrees with (replayed here from the AR reference)."""
    target_cfg, target_params, _, prompts, ar = setup
    k = 4
    results = decode(target_params, target_cfg, prompts, NEW, max_len=MAX_LEN, plan=Lookup(k))
    for prompt, res, ref in zip(prompts, results, ar, strict=True):
        assert res.token_ids == ref
        want, pos = [], 0  # ref[pos] is the pending token
        while pos < len(ref) - 1:
            drafts = ngram_continuation(prompt + ref[:pos + 1], k - 1)
            n = 0
            while n < len(drafts) and pos + 1 + n < len(ref) and drafts[n] == ref[pos + 1 + n]:
                n += 1
            n = min(n, len(ref) - 2 - pos)  # the budget cuts the last step
            want.append(n)
            pos += n + 1
        assert res.accepted == want
    assert sum(sum(r.accepted) for r in results) > 0


THREE = 4000  # draws of the first three tokens (27 cells)


@pytest.fixture(scope="module")
def three_tokens(setup):
    """T=1, top-k 3, one prompt: the target's exact law of its first three tokens (prefill, then one tree step):
    (prompt, rule, cells [(a, b, c)], their probabilities, the second tokens' laws p2[a], the third's p3[(a, b)])."""
    from dflash.models.decoder import forward
    from dflash.serve.sampling import filtered_logprobs

    target_cfg, target_params, _, _, _ = setup
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    prompt = [11, 42, 7, 99, 3, 150]

    def law(tokens):
        logits, _ = forward(target_params, target_cfg, jnp.asarray([tokens]))
        return np.exp(np.asarray(filtered_logprobs(logits[0, -1], sampling), np.float64))

    p1 = law(prompt)
    firsts = [int(t) for t in np.flatnonzero(p1 > 0)]
    p2 = {a: law(prompt + [a]) for a in firsts}
    p3 = {(a, b): law(prompt + [a, b]) for a in firsts for b in np.flatnonzero(p2[a] > 0).tolist()}
    cells = [(a, b, c) for (a, b), p in p3.items() for c in np.flatnonzero(p > 0).tolist()]
    expected = np.array([p1[a] * p2[a][b] * p3[(a, b)][c] for a, b, c in cells])
    return prompt, sampling, cells, expected, p2, p3


def decode_three(setup, three_tokens, plan, budget=3):
    """THREE seeded decodes of the prompt (`budget` tokens) by `plan`: the chi-square of the joint law of the first
    three tokens against the target's (asserted p > 1e-3), and the completions."""
    from scipy.stats import chisquare

    target_cfg, target_params, drafter, _, _ = setup
    prompt, sampling, cells, expected, _, _ = three_tokens
    results = decode(target_params, target_cfg, [prompt] * THREE, budget, max_len=32, plan=plan, drafter=drafter,
                     sampling=sampling, run=DecodeRun(seeds=list(range(THREE))))
    triples = [tuple(r.token_ids[:3]) for r in results]
    observed = np.array([sum(1 for t in triples if t == c) for c in cells])
    assert observed.sum() == THREE, "a sequence outside the target's support was sampled"
    stat = chisquare(observed, expected / expected.sum() * THREE)
    assert stat.pvalue > 1e-3, (stat, list(zip(cells, observed, (expected * THREE).round(1), strict=True)))
    return results


def test_sampled_tree_has_the_target_distribution(setup, three_tokens):
    """The argmax rule (one-hot children) through the engine: the joint law of the first three tokens equals the
    target's exact law (chi-square over the 27 cells). The tree (7 nodes): a child outside the support first,
    then two of the target's tokens, the first two children with children of their own, so rejection, acceptance
    of a later sibling and the depth-2 walk all occur."""
    _, _, _, _, p2, p3 = three_tokens
    second = {a: [int(t) for t in np.argsort(-p2[a])[:2]] for a in p2}
    third = {a: [int(t) for t in np.argsort(-p3[(a, second[a][0])])[:2]] for a in p2}
    outside = {a: int(np.flatnonzero(p2[a] == 0)[0]) for a in p2}

    def lists(state, k, m):
        pending = np.asarray(state.pending)
        ids = np.zeros((len(pending), k - 1, m), np.int32)
        logp = np.full((len(pending), k - 1, m), -30.0, np.float32)
        logp[:, 0, :3] = [-0.1, -1.0, -2.0]
        logp[:, 1, :2] = [-0.5, -1.5]
        for b, a in enumerate(pending.tolist()):
            if a in second:
                ids[b, 0, :3] = [outside[a], second[a][1], second[a][0]]
                ids[b, 1, :2] = third[a]
        return ids, logp

    results = decode_three(setup, three_tokens, Tree(3, 7, ranked=lists))
    accepted = np.array([r.accepted[0] for r in results])
    assert 0.1 < np.mean(accepted) < 0.9, "both acceptance and rejection must be exercised"
    through_sibling = [r.accepted[0] > 0 and r.token_ids[1] != second[r.token_ids[0]][1] for r in results]
    assert np.mean(through_sibling) > 0.05, "a later sibling must be accepted after an earlier one's rejection"


def test_tree_of_drafts_drawn_from_the_drafter_has_the_target_distribution(setup, three_tokens):
    """The sample rule through the engine (`Tree(rule="sample")`: `rank_drafts` draws the drafter's nodes without
    replacement, the walk verifies them by multi-draft speculative sampling): the joint law of the first three
    tokens equals the target's. The drafter's law (in place of its forward) puts 0.15 outside the target's support
    and the rest on its three tokens in another order at depth 1, and at depth 2 on the third tokens after the
    most likely second one; the tree (4 nodes): two draws under the root, one under the first, so drafts are
    rejected, accepted as a later sibling, and accepted two deep (a budget of 4 tokens lets the first step emit
    3)."""
    _, _, _, _, p2, p3 = three_tokens
    vocab = next(iter(p2.values())).size

    def logits(state, k):
        pending = np.asarray(state.pending)
        q = np.full((len(pending), k - 1, vocab), 1e-4)
        for b, a in enumerate(pending.tolist()):
            if a in p2:
                order = np.argsort(-p2[a])
                q[b, 0, order[:3]] = [0.25, 0.45, 0.1]
                q[b, 0, np.flatnonzero(p2[a] == 0)[0]] = 0.15
                q[b, 1, np.argsort(-p3[(a, int(order[0]))])[:3]] = [0.5, 0.3, 0.15]
        return np.log(q / q.sum(-1, keepdims=True))

    results = decode_three(setup, three_tokens, Tree(3, 4, rule="sample", logits=logits), budget=4)  # n up to 2
    accepted = np.array([r.accepted[0] for r in results])
    assert 0.1 < np.mean(accepted > 0) < 0.9 and np.mean(accepted == 2) > 0.05, np.bincount(accepted)
    first_choice = [r.token_ids[1] == int(np.argsort(-p2[r.token_ids[0]])[1]) for r in results]
    assert 0.05 < np.mean([f for f, n in zip(first_choice, accepted, strict=True) if n > 0]) < 0.95
    # The walk verifies the draws by their law, not as one-hot drafts (also lossless, for any drafts fixed before
    # the target is read, but accepted less): the share of first steps accepting a draft is the multi-draft rule's
    # (a float64 reference over every draw order: the root's two children are the first two draws from q's
    # top-3 support), within 4 sigma, and far from what one-hot verification of the same draws accepts.
    p1 = {a: np.mean([r.token_ids[0] == a for r in results]) for a in p2}
    drafter = {a: top3(logits(type("State", (), {"pending": np.asarray([a])}), 3)[0, 0]) for a in p2}
    multi = sum(p1[a] * accept_any(p2[a], drafter[a], 2, drawn=True) for a in p2)
    one_hot = sum(p1[a] * accept_any(p2[a], drafter[a], 2, drawn=False) for a in p2)
    sigma = np.sqrt(multi * (1 - multi) / THREE)
    assert abs(np.mean(accepted > 0) - multi) < 4 * sigma and abs(one_hot - multi) > 8 * sigma, (multi, one_hot)


def top3(logits_V: np.ndarray) -> np.ndarray:
    """The drafter's law under the request's rule (T=1, top-k 3)."""
    q = np.exp(logits_V - logits_V.max()) * (logits_V >= np.sort(logits_V)[-3])
    return q / q.sum()


def accept_any(p: np.ndarray, q: np.ndarray, children: int, drawn: bool) -> float:
    """P(one of a node's children is accepted) when its children are the first `children` draws without
    replacement from q, verified by recursive rejection sampling against p as drawn from their laws (`drawn`) or
    as point masses (float64, every draw order)."""
    def rest(r: np.ndarray, left: np.ndarray, k: int) -> float:
        if k == children or left.sum() <= 0:
            return 0.0
        law = left / left.sum()
        total = 0.0
        for c in np.flatnonzero(law > 0):
            proposal = law if drawn else np.eye(len(q))[c]
            accept = min(1.0, r[c] / proposal[c])
            residual = np.maximum(r - proposal, 0.0)
            later = 0.0 if accept >= 1 else rest(residual / residual.sum(), np.where(np.arange(len(q)) == c, 0.0, left),
                                                 k + 1)
            total += law[c] * (accept + (1.0 - accept) * later)
        return total
    return rest(p, q, 0)


@pytest.mark.slow  # ~40 s of compiles
def test_after_precompile_tree_requests_compile_nothing(setup):
    target_cfg, target_params, drafter, prompts, _ = setup
    engine = Engine(target_params, target_cfg, drafter, Tree(4, 6, lookup=True),
                    Limits(slots=2, max_len=48, page_size=8, steps_per_dispatch=4))
    count, _ = engine.precompile()
    assert count == engine.compiles > 0
    for i, p in enumerate(prompts):
        engine.submit(p[:20], 10, seed=i, logprobs=2 if i % 2 else None,
                      sampling=SamplingConfig(temperature=0.8) if i % 3 == 0 else None)
    done = engine.run()
    assert len(done) == 4 and engine.compiles == count
