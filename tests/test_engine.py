"""Continuous batching: requests join and leave between steps; each one's output is what it would be alone."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from conftest import ALONE_LEN, ALONE_SLOTS, ar_alone, decode_alone, tiny_engine_models

from dflash.serve.engine import Engine, RequestRejected
from dflash.serve.plan import AR, Chain, Limits
from dflash.serve.sampling import SamplingConfig
from dflash.serve.speculative import view_slots

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


# the engines' slots and context wherever a test needs no other: the references' (conftest.decode_alone), so the
# tests and their references share compiled programs
SLOTS, MAX_LEN = ALONE_SLOTS, ALONE_LEN


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params, drafter = tiny_engine_models()
    rng = np.random.default_rng(2)
    requests = [(list(rng.integers(0, 255, size=n)), budget) for n, budget in
                [(5, 12), (20, 30), (9, 4), (33, 17), (2, 25), (14, 9), (7, 21)]]
    return target_cfg, target_params, drafter, requests


# slow: test_requests_with_different_sampling_rules_share_steps (the same 7 requests through the same 3-slot engine,
# joining and leaving; the greedy ones equal AR alone) and test_engine_pages'
# test_requests_wait_for_pages_and_all_finish (24 requests through 4 slots, each equal to AR alone)
@pytest.mark.slow
@pytest.mark.parametrize("block_size", [None, 4, 8])
def test_requests_joining_and_leaving_equal_ar_alone(setup, block_size):
    target_cfg, target_params, drafter, requests = setup
    plan = AR() if block_size is None else Chain(block_size)
    engine = Engine(target_params, target_cfg, drafter, plan, Limits(slots=3, max_len=MAX_LEN))
    ids = [engine.submit(p, budget) for p, budget in requests[:4]]
    engine.step()
    assert len(engine.running) == 3 and len(engine.queue) == 1  # 3 slots, 1 waiting
    ids += [engine.submit(p, budget) for p, budget in requests[4:]]  # join while others run
    done = engine.run()
    assert sorted(done) == ids and not engine.running and not engine.queue
    for rid, (prompt, budget) in zip(ids, requests, strict=True):
        assert done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget), rid
        assert done[rid].finish_reason == "length"
        if block_size is not None:
            assert 1.0 <= done[rid].tau <= block_size


def test_requests_arriving_together_share_one_padded_prefill(setup):
    """Three requests joining a running one are prefilled in one call of 4 rows (one padding row, which writes
    nothing); greedy outputs equal AR alone, a sampled one equals its seed's output alone."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=4, max_len=MAX_LEN))
    first = engine.submit(*requests[1])
    engine.step()
    ids = [engine.submit(*requests[0]), engine.submit(*requests[2]), engine.submit(*requests[3], seed=7,
                                                                                    sampling=sampling)]
    engine.step()
    assert len(engine.running) == 4 and not engine.queue
    assert ("prefill", 4, 48) in engine.compiled_shapes  # 3 prompts (5, 9, 33 tokens) padded to 4 rows x 48
    done = engine.run()
    for rid, (prompt, budget) in zip([first, *ids[:2]], [requests[1], requests[0], requests[2]], strict=True):
        assert done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget), rid
    # a 4-slot engine's sampled request against its 3-slot solo run: the output does not depend on the slot count
    alone = decode_alone(target_params, target_cfg, drafter, *requests[3], block_size=4, sampling=sampling, seed=7)
    assert done[ids[2]].token_ids == alone
    assert engine.pool.num_free == engine.pool.num_usable


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_decodes(setup):
    """With prefill_chunk=16 a 33-token prompt joining a running batch takes 3 engine steps (16 + 16 + 1 tokens),
    and the running request decodes in each of them; greedy outputs equal AR, a sampled long prompt equals its
    seed's unchunked output, and a request cancelled part way through its prefill frees its slot and pages."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=3, max_len=MAX_LEN, prefill_chunk=16))
    running = engine.submit(*requests[4])
    engine.step()
    long_ = engine.submit(*requests[3])  # 33 tokens
    sampled = engine.submit(requests[1][0] + requests[3][0], 6, seed=5, sampling=sampling)  # 53 tokens
    progress = []
    for _ in range(3):
        before = len(engine.running[0].token_ids)
        engine.step()
        progress.append(len(engine.running[0].token_ids) - before)
        assert set(engine.running) == ({0, 1} if len(progress) == 3 else {0})
    assert min(progress) >= 1  # the running request was not stalled by the long prompt
    assert [(slot, r.request_id, n) for slot, (r, n) in engine.prefilling.items()] == [(2, sampled, 0)]  # next
    done = engine.run()
    for rid, (prompt, budget) in [(running, requests[4]), (long_, requests[3])]:
        assert done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget), rid
    plain = decode_alone(target_params, target_cfg, drafter, requests[1][0] + requests[3][0], 6, block_size=4,
                   sampling=sampling, seed=5)
    assert done[sampled].token_ids == plain
    assert ("prefill_chunk", 1, 16, 2) in engine.compiled_shapes and engine.pool.num_free == engine.pool.num_usable
    rid = engine.submit(requests[3][0], 4)
    engine.step()
    assert rid in [r.request_id for r, _ in engine.prefilling.values()] and engine.cancel(rid)
    assert done[rid].finish_reason == "cancelled" and not engine.busy
    assert engine.pool.num_free == engine.pool.num_usable


def test_stop_tokens_free_the_slot_early(setup):
    target_cfg, target_params, drafter, requests = setup
    prompt, budget = requests[1]
    stop = ar_alone(target_params, target_cfg, prompt, budget)[5]
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN))
    rid = engine.submit(prompt, budget, stop_ids=[stop])
    done = engine.run()
    assert done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget, stop_ids=[stop])
    assert done[rid].finish_reason == "stop"


def test_sampled_output_does_not_depend_on_the_batch(setup):
    """At T > 0 a request's tokens depend on its seed only, not on which requests share its steps."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN),
                    sampling=sampling)
    ids = [engine.submit(p, budget, seed=100 + i) for i, (p, budget) in enumerate(requests)]
    done = engine.run()
    for i, (rid, (prompt, budget)) in enumerate(zip(ids, requests, strict=True)):
        alone = decode_alone(target_params, target_cfg, drafter, prompt, budget, block_size=4, sampling=sampling,
                       seed=100 + i)
        assert done[rid].token_ids == alone, rid


def test_seeds_that_differ_above_bit_32_sample_differently(setup):
    """A request's key is built from its whole 64-bit seed (`request_keys`): seed 2**32 + 9 is not seed 9."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=1.0)
    low, high = (decode_alone(target_params, target_cfg, drafter, *requests[1], block_size=4, sampling=sampling, seed=s)
                 for s in (9, 2**32 + 9))
    assert low != high and len(low) == len(high) == requests[1][1]


def test_bad_requests_are_refused_naming_the_field_and_a_normal_one_still_runs(setup):
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN))
    vocab = target_cfg.vocab_size
    cases = [  # (submit's arguments, the field named, a piece of the message)
        (([], 4), {}, "prompt_ids", "at least one token"),
        (([1, 2], 0), {}, "max_new_tokens", "received 0"),
        (([1] * 100, 40), {}, "max_new_tokens", "context length max_len (128 tokens)"),
        (([1] * 126, None), {}, "prompt_ids", "max_len (128 tokens)"),
        (([1, 2**31], 4), {}, "prompt_ids", "prompt_ids[1] must be a token id in [0, 256)"),
        (([1, vocab], 4), {}, "prompt_ids", f"received {vocab}"),
        (([-1, 2], 4), {}, "prompt_ids", "received -1"),
        (([1, 2], 4), {"sampling": SamplingConfig(temperature=1.0, top_k=2**31)}, "sampling.top_k", str(2**31)),
        (([1, 2], 4), {"seed": 2**63}, "seed", "[0, 2**63)"),
        (([1, 2], 4), {"seed": -1}, "seed", "received -1"),
        (([1, 2], 4), {"logprobs": 21}, "logprobs", "[0, 20]"),
        (([1, 2], 4), {"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
        (([1, 2], 4), {"stop_ids": [2**40]}, "stop_ids", "stop_ids[0]"),
    ]
    for args, kwargs, field, piece in cases:
        with pytest.raises(RequestRejected, match=re.escape(piece)) as caught:
            engine.submit(*args, **kwargs)
        assert caught.value.field == field, (args, kwargs)
        assert "65536" not in str(caught.value) and "bucket" not in str(caught.value)
    assert not engine.queue  # nothing refused was queued
    prompt, _ = requests[0]
    rid = engine.submit(prompt, 6)
    assert engine.run()[rid].token_ids == ar_alone(target_params, target_cfg, prompt, 6)


def test_no_budget_means_until_the_context_is_full(setup):
    target_cfg, target_params, _, requests = setup
    engine = Engine(target_params, target_cfg, None, AR(), Limits(slots=SLOTS, max_len=MAX_LEN))
    prompt = requests[0][0]  # 5 tokens: 128 - 5 - K(1) = 122 new tokens fit
    rid = engine.submit(prompt, None)
    done = engine.run()[rid]
    assert len(done.token_ids) == 122 and done.finish_reason == "length"


def test_a_request_whose_host_side_work_fails_ends_alone(setup):
    """A detokenizer that raises on one request's tokens: that request ends with finish_reason "error"; the
    neighbours sharing its steps keep exactly their AR tokens, and the engine serves the next request."""
    target_cfg, target_params, drafter, requests = setup
    (victim, v_budget), (other, o_budget) = requests[1], requests[3]
    v_ar = ar_alone(target_params, target_cfg, victim, v_budget)
    o_ar = ar_alone(target_params, target_cfg, other, o_budget)
    poison = next(t for t in v_ar[2:] if t not in o_ar)

    def detokenize(ids):
        if poison in ids:
            raise KeyError(f"token {poison} has no text")
        return _text(ids)

    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN),
                    detokenize=detokenize)
    bad, good = engine.submit(victim, v_budget), engine.submit(other, o_budget)
    done = engine.run()
    assert done[bad].finish_reason == "error" and f"token {poison} has no text" in done[bad].error
    assert poison in done[bad].token_ids and len(done[bad].token_ids) < v_budget
    assert done[good].token_ids == o_ar and done[good].finish_reason == "length" and done[good].error is None
    assert done[good].text == _text(o_ar) == done[good].stable_text
    assert engine.pool.num_free == engine.pool.num_usable and not engine.running
    again = engine.submit(other, 5)
    assert engine.run()[again].token_ids == o_ar[:5]


def _text(ids):
    """A stand-in detokenizer for the tiny vocabulary: two letters per token."""
    return "".join(chr(97 + t % 26) + chr(97 + t // 26 % 26) for t in ids)


def test_requests_with_different_sampling_rules_share_steps(setup):
    """Greedy and sampled requests (different temperatures, top-p, top-k) in one batch: the greedy ones equal
    AR, each sampled one equals its solo run with its rule and seed."""
    target_cfg, target_params, drafter, requests = setup
    rules = [None, SamplingConfig(temperature=0.7), None, SamplingConfig(temperature=1.2, top_k=20),
             SamplingConfig(temperature=0.9, top_p=0.8), None, SamplingConfig(temperature=1.0)]
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN))
    ids = [engine.submit(p, budget, seed=7 + i, sampling=rule)
           for i, ((p, budget), rule) in enumerate(zip(requests, rules, strict=True))]
    done = engine.run()
    for i, (rid, (prompt, budget), rule) in enumerate(zip(ids, requests, rules, strict=True)):
        if rule is None:
            assert done[rid].token_ids == ar_alone(target_params, target_cfg, prompt, budget), rid
        else:
            alone = decode_alone(target_params, target_cfg, drafter, prompt, budget, block_size=4, sampling=rule,
                           seed=7 + i)
            assert done[rid].token_ids == alone, rid
    sampled = [done[rid].token_ids for rid, rule in zip(ids, rules, strict=True) if rule is not None]
    greedy_of_same = [ar_alone(target_params, target_cfg, p, b) for (p, b), r in zip(requests, rules, strict=True) if r]
    assert sampled != greedy_of_same  # the sampled rows really sampled


@pytest.mark.parametrize("block_size", [None, 4])
def test_stop_strings_end_the_request_at_the_completing_token(setup, block_size):
    target_cfg, target_params, drafter, requests = setup
    prompt, budget = requests[3]
    ar = ar_alone(target_params, target_cfg, prompt, budget)
    stop = _text(ar)[9:13]  # spans tokens 4, 5 and 6: the request must keep ar[:7]
    expected = next(ar[:end] for end in range(1, len(ar) + 1) if stop in _text(ar[:end]))
    engine = Engine(target_params, target_cfg, drafter, AR() if block_size is None else Chain(block_size),
                    Limits(slots=SLOTS, max_len=MAX_LEN), detokenize=_text)
    rid = engine.submit(prompt, budget, stop_strings=["zzzzzz", stop])
    other = engine.submit(requests[1][0], requests[1][1])
    done = engine.run()
    assert done[rid].token_ids == expected and len(expected) < budget
    assert done[rid].finish_reason == "stop" and done[rid].stop_string == stop
    assert done[other].token_ids == ar_alone(target_params, target_cfg, *requests[1])  # its neighbour is unaffected
    assert engine.pool.num_free == engine.pool.num_usable  # both slots' pages came back
    with pytest.raises(ValueError, match="detokenize"):
        Engine(target_params, target_cfg, drafter, AR(), Limits(slots=1, max_len=MAX_LEN)).submit([1], 4,
               stop_strings=["x"])


def test_compiled_shapes_are_logged_and_bounded(setup, caplog):
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=3, max_len=MAX_LEN))
    with caplog.at_level("INFO", logger="dflash.serve.engine"):
        for prompt, budget in requests:
            engine.submit(prompt, budget)
        engine.run()
    prefills = sorted(shape[1:] for shape in engine.compiled_shapes if shape[0] == "prefill")
    # the first three requests (5, 20 and 9 tokens) are admitted together in one prefill of 3 rows (all slots);
    # the others join one at a time as slots free: prompts of 2..33 tokens, three length buckets
    assert prefills == [(1, 16), (1, 48), (3, 32)]
    # verify: one program per power-of-two span of 16-token pages; the longest request (33 + 17 tokens + K)
    # needs 4 pages, so the spans seen are 1, 2 and 4 at most (prompts start at 2..33 tokens).
    # Each step computes the smallest bucket of rows holding the running requests (1, 2, then the 3 slots): three
    # together first, one alone at the end.
    verifies = {s[1:] for s in engine.compiled_shapes if s[0] == "verify"}
    assert {b for b, _, _ in verifies} == {1, 2, 3} and {k for _, k, _ in verifies} == {4}
    spans = {s for _, _, s in verifies}
    assert spans <= {1, 2, 4} and 4 in spans
    assert sum("engine: first" in r.message for r in caplog.records) == len(engine.compiled_shapes) == 3 + len(verifies)


def test_cancel_frees_the_slot_and_its_pages_and_spares_the_neighbours(setup):
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN))
    ids = [engine.submit(p, budget) for p, budget in requests[:4]]
    engine.step()  # requests 0, 1 and 2 run, 3 waits
    assert engine.cancel(ids[1]) and engine.cancel(ids[3]) and not engine.cancel(12345)
    assert ids[1] not in [r.request_id for r in engine.running.values()] and not engine.queue
    done = engine.run()
    assert done[ids[1]].finish_reason == done[ids[3]].finish_reason == "cancelled" and not done[ids[3]].token_ids
    for i in (0, 2):
        assert done[ids[i]].token_ids == ar_alone(target_params, target_cfg, *requests[i])
    assert engine.pool.num_free == engine.pool.num_usable


def _bytes_text(ids):
    """The tiny vocabulary as bytes, decoded as UTF-8: multi-byte characters span tokens, and an unfinished one
    ends the text as U+FFFD until its last byte arrives."""
    return bytes(ids).decode("utf-8", errors="replace")


def _non_streamed(ar, stops):
    """The answer of a request whose greedy tokens are `ar`: its text cut before the first stop string found."""
    for end in range(1, len(ar) + 1):
        text = _bytes_text(ar[:end])
        hits = [s for s in stops if s in text]
        if hits:
            return text[:min(text.index(s) for s in hits)]
    return _bytes_text(ar)


def test_stable_text_only_grows_and_ends_as_the_non_streamed_answer(setup):
    """Many prompts x stop strings (spanning tokens, partial matches, absent ones, several at once): after every
    step each request's stable_text extends the previous one (what a stream sends), never shows the start of a
    stop string that later matches, and ends equal to the text a non-streamed request returns."""
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=SLOTS, max_len=MAX_LEN),
                    detokenize=_bytes_text)
    cases = {}
    for prompt, budget in [requests[i] for i in (0, 1, 3, 4)]:
        ar = ar_alone(target_params, target_cfg, prompt, budget)
        full = _bytes_text(ar)
        stop_sets = [(full[i:i + w],) for i, w in [(1, 3), (4, 2), (len(full) // 2, 4), (len(full) - 3, 3)]]
        stop_sets += [("zzzq",), (full[2:4] + "\x00\x00", full[6:9]), (full[3], full[-2:] + "#")]
        for stops in stop_sets:
            stops = tuple(s for s in stops if s) or ("\x00\x01",)
            rid = engine.submit(prompt, budget, stop_strings=stops)
            cases[rid] = (_non_streamed(ar, stops), [""])
    while engine.busy:
        engine.step()
        for request in [*engine.running.values(), *engine.done.values()]:
            seen = cases[request.request_id][1]
            assert request.stable_text.startswith(seen[-1]), request.request_id
            assert request.text.startswith(request.stable_text)
            seen.append(request.stable_text)
    for rid, (expected, seen) in cases.items():
        done = engine.done[rid]
        assert done.text == done.stable_text == expected, (rid, done.stop_strings)
        assert all(expected.startswith(s) for s in seen)
    assert sum(engine.done[rid].finish_reason == "stop" for rid in cases) >= len(cases) // 2


@pytest.mark.parametrize("block_size", [pytest.param(None, marks=pytest.mark.slow), 4])  # AR: nightly
def test_logprobs_are_the_targets_own_for_greedy_and_sampled_requests(setup, block_size):
    """Generated and prompt log-probabilities (and the top alternatives) equal a plain full forward of the
    target over prompt + output, in fp32, for AR and DFlash, greedy and sampled requests sharing steps; a
    neighbour that asks for none gets none."""
    import jax
    import jax.numpy as jnp

    from dflash.models.decoder import forward

    target_cfg, target_params, drafter, requests = setup
    chosen = [requests[1], requests[3], requests[0]]
    greedy = {tuple(p): p + ar_alone(target_params, target_cfg, p, budget) for p, budget in chosen}
    engine = None

    def oracle(state, k):  # drafts from the greedy continuation: whole blocks accepted, sampled rows mixed
        lengths = np.asarray(state.lengths)
        drafts = np.zeros((len(lengths), k - 1), np.int32)
        for row, slot in enumerate(view_slots(state)):
            if slot in engine.running:  # else a row padding the step's bucket
                seq = greedy[tuple(engine.running[slot].prompt_ids)][lengths[row] + 1:lengths[row] + k]
                drafts[row, :len(seq)] = seq
        return drafts

    engine = Engine(target_params, target_cfg, drafter, Chain(block_size, drafts=oracle) if block_size else AR(),
                    Limits(slots=3, max_len=MAX_LEN))
    rules = [None, SamplingConfig(temperature=0.9, top_k=30), None]
    ids = [engine.submit(p, budget, seed=3 + i, sampling=rule, logprobs=[5, 20, None][i],
                         prompt_logprobs=[3, None, None][i])
           for i, ((p, budget), rule) in enumerate(zip(chosen, rules, strict=True))]
    done = engine.run()
    assert done[ids[2]].token_logprobs == [] and done[ids[2]].prompt_logprobs == []
    for rid, n in zip(ids[:2], (5, 20), strict=True):
        request = done[rid]
        full = request.prompt_ids + request.token_ids
        logits, _ = forward(target_params, target_cfg, jnp.asarray([full], jnp.int32))
        lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
        start = len(request.prompt_ids) - 1
        assert len(request.token_logprobs) == len(request.top_logprobs) == len(request.token_ids)
        for i, token in enumerate(request.token_ids):
            row = lp[start + i]
            np.testing.assert_allclose(request.token_logprobs[i], row[token], atol=1e-5)
            top_ids, top_values = zip(*request.top_logprobs[i], strict=True)
            np.testing.assert_allclose(top_values, -np.sort(-row)[:n], atol=1e-5)
            np.testing.assert_allclose(row[list(top_ids)], top_values, atol=1e-5)
        if rid == ids[0]:
            assert request.prompt_logprobs[0] is None and request.prompt_top_logprobs[0] == []
            np.testing.assert_allclose(request.prompt_logprobs[1:],
                                       [lp[j - 1, t] for j, t in enumerate(request.prompt_ids) if j], atol=1e-5)
            assert all(len(top) == 3 for top in request.prompt_top_logprobs[1:])
    if block_size is not None:  # verify steps that accepted drafts were scored at the right positions too
        assert sum(done[ids[0]].accepted) > 0


@pytest.mark.slow  # ~60 s of compiles; the default tier checks 0 compiles in `dflash eval`'s timed region (test_eval)
@pytest.mark.parametrize("chunk,steps", [(None, 1), (16, 1), (16, 4), (64, 4)])
def test_after_precompile_no_request_compiles(setup, chunk, steps):
    """precompile compiles every prefill length (a max_len that is no power of two caps the last bucket) and row
    count, every prefill chunk's span and every attention span, with and without log-probabilities, and with R > 1
    the device loops (then unscored single steps only where a prompt can be chunked: a chunk of 64 > max_len never
    is); requests of any prompt length, budget and kind then compile nothing."""
    target_cfg, target_params, drafter, requests = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4),
                    Limits(slots=3, max_len=48, page_size=8, prefill_chunk=chunk, steps_per_dispatch=steps))
    count, seconds = engine.precompile()
    # prefill lengths 16, 32, 48 x (plain at 1, 2 and 3 rows, logprobs at 1 row); spans of 1, 2, 4, 6 pages x
    # (verify, verify with logprobs, propose); the activation update once. With chunks of 16: plain prompts of
    # 16 tokens at most, and chunks starting at 0, 16, 32 (spans of 2, 4, 6 pages).
    if chunk is None:
        assert count == engine.compiles == 3 * 3 + 3 + 4 * 3 + 1 and seconds > 0
    elif chunk > 48:  # no prompt is chunked: no chunk programs and no unscored single steps, the loops instead
        assert count == engine.compiles and seconds > 0
        kinds = {s[0] for s in engine.compiled_shapes}
        assert "prefill_chunk" not in kinds and "decode_steps" in kinds
    else:  # jit caches are process-wide: count only what this engine's shapes added, checked by kind
        assert count == engine.compiles and seconds > 0
        assert {s[1:] for s in engine.compiled_shapes if s[0] == "prefill_chunk"} == {(1, 16, 2), (1, 16, 4),
                                                                                     (1, 16, 6)}
        assert {s[1:] for s in engine.compiled_shapes if s[0] == "prefill"} == {(1, 16), (2, 16), (3, 16), (1, 32),
                                                                               (1, 48)}
    assert not engine.busy and engine.pool.num_free == engine.pool.num_usable
    rng = np.random.default_rng(9)
    # with R > 1 only the first request asks for log-probabilities, so that unscored single steps run too (while a
    # prompt is chunked)
    for i, (n, budget) in enumerate([(1, 3), (15, None), (17, 5), (33, 10), (43, 1), (30, None)]):
        prompt = [int(t) for t in rng.integers(0, 255, size=n)]
        engine.submit(prompt, budget, seed=i, logprobs=3 if i % 3 == 0 and (steps == 1 or i == 0) else None,
                      prompt_logprobs=2 if i % 4 == 1 else None,
                      sampling=SamplingConfig(temperature=0.7) if i % 2 else None)
    done = engine.run()
    assert len(done) == 6 and all(r.finish_reason == "length" for r in done.values())
    assert engine.compiles == count  # nothing compiled inside a request


def test_a_drafter_committed_to_its_device_compiles_nothing_inside_requests(setup):
    """A drafter restored from a checkpoint is committed to a device (Orbax restores onto one) beside an uncommitted
    target: the engine commits every array to that one device, so the programs precompile builds are the ones its
    steps call. Before, each program after the first prefill compiled again (jit tells committed arguments from
    uncommitted ones), and `dflash eval` of a run's checkpoint reported compiles inside its timed requests."""
    from flax import nnx

    target_cfg, target_params, drafter, requests = setup
    graphdef, state = nnx.split(drafter)
    committed = nnx.merge(graphdef, jax.device_put(state, jax.local_devices()[0]))
    assert all(leaf.committed for leaf in jax.tree.leaves(nnx.state(committed)))
    # 64 tokens of context in 16-token pages (the 3 requests fit): 4 prefill lengths x 2 row counts and 3 attention
    # spans x 2 buckets to precompile, against 6 x 2 and 4 x 2 at 128 tokens in 8-token pages (14 programs, not 20)
    engine = Engine(target_params, target_cfg, committed, Chain(4), Limits(slots=2, max_len=64, prefill_chunk=None,
                                                                            steps_per_dispatch=2))
    count, _ = engine.precompile(logprobs=False)
    for prompt, budget in requests[:3]:  # two at once, the third joining as one finishes
        engine.submit(prompt, budget)
    done = engine.run()
    assert len(done) == 3 and engine.compiles == count


@pytest.mark.parametrize("block_size,draft_rule", [(4, "argmax"),
                                                   pytest.param(4, "sample", marks=pytest.mark.slow),  # ~40 s;
                                                   # test_tree's sampled steps-per-dispatch test keeps it
                                                   pytest.param(None, "argmax", marks=pytest.mark.slow)])
def test_several_steps_per_dispatch_change_no_output(setup, block_size, draft_rule):
    """R = 4 decode steps per dispatch (one device loop) against R = 1, same requests: a stop id, a stop string and
    a budget that fall inside a chunk, a seeded sampled request, requests joining while others run (one prefilled
    in chunks), and one cancelled; every request's tokens, finish reason and acceptance are identical, and the
    stops cut exactly. With draft_rule "sample" the sampled requests' drafts are drawn from the drafter in both."""
    target_cfg, target_params, drafter, requests = setup
    sampling = SamplingConfig(temperature=0.8, top_p=0.9)
    ar1, ar3 = ar_alone(target_params, target_cfg, *requests[1]), ar_alone(target_params, target_cfg, *requests[3])
    stop_id, stop_text = ar1[6], _text(ar3)[9:13]

    def run(r):
        plan = AR() if block_size is None else Chain(block_size, draft_rule)
        engine = Engine(target_params, target_cfg, drafter, plan,  # requests[3] (33 tokens) prefilled in chunks
                        Limits(slots=3, max_len=MAX_LEN, steps_per_dispatch=r, prefill_chunk=16), detokenize=_text)
        ids = [engine.submit(*requests[0]), engine.submit(*requests[1], stop_ids=[stop_id]),
               engine.submit(*requests[3], stop_strings=[stop_text])]
        engine.step()
        ids += [engine.submit(*requests[2], seed=3, sampling=sampling), engine.submit(*requests[6])]
        engine.step()
        engine.cancel(ids[-1])
        ids.append(engine.submit(*requests[5], seed=4, sampling=sampling))
        done = engine.run()
        assert engine.pool.num_free == engine.pool.num_usable
        return engine, [done[rid] for rid in ids]

    (_, one), (looped, four) = run(1), run(4)
    assert any(s[0] == "decode_steps" for s in looped.compiled_shapes)
    for a, b in zip(one, four, strict=True):
        assert (a.token_ids, a.finish_reason, a.stop_string, a.accepted) == (b.token_ids, b.finish_reason,
                                                                             b.stop_string, b.accepted)
        assert a.text == b.text
    assert four[0].token_ids == ar_alone(target_params, target_cfg, *requests[0]) and four[0].finish_reason == "length"
    assert four[1].token_ids == ar1[:ar1.index(stop_id) + 1] and four[1].finish_reason == "stop"
    assert four[2].finish_reason == "stop" and four[2].stop_string == stop_text and len(four[2].token_ids) < len(ar3)
    assert four[4].finish_reason == "cancelled"


def test_prefill_chunk_and_steps_per_dispatch_are_checked(setup):
    target_cfg, target_params, drafter, _ = setup
    for chunk in (8, 24, True):
        with pytest.raises(ValueError, match=rf"prefill_chunk must be None or a power of two >= 16; received {chunk}"):
            Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=1, max_len=MAX_LEN, prefill_chunk=chunk))
    for r in (0, 2.0):
        with pytest.raises(ValueError, match=rf"steps_per_dispatch must be an integer >= 1; received {r}"):
            Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=1, max_len=MAX_LEN, steps_per_dispatch=r))
