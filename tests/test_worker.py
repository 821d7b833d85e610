"""The engine thread: validation in the caller's thread, stable-text updates, isolation of failures, metrics."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import ar_alone, tiny_engine_models
from prometheus_client import generate_latest

from dflash.serve.engine import Engine, RequestRejected
from dflash.serve.plan import Chain, Limits
from dflash.serve.sampling import SamplingConfig
from dflash.serve.worker import EngineWorker

pytestmark = pytest.mark.heavy

MAX_LEN = 128


@pytest.fixture(scope="module")
def setup():
    target_cfg, target_params, drafter = tiny_engine_models()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 255, size=n)] for n in (6, 17, 11)]
    return target_cfg, target_params, drafter, prompts


def _bytes_text(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def _drain(job):
    updates = []
    while (update := job.tokens.get(timeout=120)) is not None:
        updates.append(update)
    return updates


def _metric(text: str, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(inner) + r"\}" if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, (name, labels)
    return float(match.group(1))


def test_updates_stream_stable_text_refusals_are_synchronous_and_failures_stay_apart(setup):
    """Refused requests raise at submit (nothing reaches the engine thread); the updates' text deltas and
    token ids add up to the final answer; a failed device step ends the requests in flight with 503 and the
    next request is served; /metrics counts all of it, with the gauges at 0 afterwards."""
    target_cfg, target_params, drafter, prompts = setup
    fail = {"now": False}

    def drafts(state, k):  # a proposer that can be made to fail: a failure of the batched device step
        if fail["now"]:
            raise RuntimeError("device lost")
        return np.zeros((state.pending.shape[0], k - 1), np.int32)

    engine = Engine(target_params, target_cfg, drafter, Chain(4, drafts=drafts), Limits(slots=3, max_len=MAX_LEN),
                    detokenize=_bytes_text)
    worker = EngineWorker(engine).start()
    try:
        for bad in ([1, 2**31], [1, -3], [1, 256]):
            with pytest.raises(RequestRejected) as caught:
                worker.submit(bad, 4)
            assert caught.value.field == "prompt_ids"
        with pytest.raises(RequestRejected, match="sampling.top_k"):
            worker.submit([1, 2], 4, sampling=SamplingConfig(temperature=1.0, top_k=2**31))
        assert worker.inbox.empty()

        ar = ar_alone(target_params, target_cfg, prompts[0], 20)
        stop = _bytes_text(ar)[5:8]
        jobs = [worker.submit(prompts[0], 20, stop_strings=(stop,)), worker.submit(prompts[1], 12, logprobs=2)]
        for job in jobs:
            updates = _drain(job)
            assert job.error is None and job.status is None
            assert "".join(u.text_delta for u in updates) == job.request.text
            assert [t for u in updates for t in u.token_ids] == job.request.token_ids
            assert [v for u in updates for v in u.logprobs] == job.request.token_logprobs
        assert jobs[0].request.finish_reason == "stop" and stop not in jobs[0].request.text
        assert len(jobs[1].request.token_logprobs) == 12 and all(len(t) == 2 for t in jobs[1].request.top_logprobs)

        fail["now"] = True
        doomed = [worker.submit(p, 30) for p in prompts]
        for job in doomed:
            _drain(job)
            assert job.status == 503 and "device lost" in job.error
        fail["now"] = False
        after = worker.submit(prompts[2], 5)
        _drain(after)
        assert after.status is None and len(after.request.token_ids) == 5
        metrics = generate_latest(worker.registry).decode()
    finally:
        worker.shutdown()
    assert _metric(metrics, "dflash_requests_total", status="400", finish_reason="rejected") == 4
    assert _metric(metrics, "dflash_requests_total", status="503", finish_reason="error") == 3
    assert _metric(metrics, "dflash_requests_total", status="200", finish_reason="length") == 2
    assert _metric(metrics, "dflash_requests_total", status="200", finish_reason="stop") == 1
    assert _metric(metrics, "dflash_running_requests") == 0 and _metric(metrics, "dflash_queue_depth") == 0
    # the three served, and the three doomed ones: each first token goes out after its prefill, before the decode
    # step that fails
    assert _metric(metrics, "dflash_time_to_first_token_seconds_count") == 6
    assert _metric(metrics, "dflash_e2e_request_latency_seconds_count") == 3
    assert _metric(metrics, "dflash_inter_token_latency_seconds_count") == sum(
        len(j.request.token_ids) - 1 for j in [*jobs, after])
    assert _metric(metrics, "dflash_tau_count") == 3
    assert _metric(metrics, "dflash_compiles_total") == engine.compiles >= 1


def test_gauges_show_a_request_from_admission_on_and_prompt_tokens_are_counted(setup):
    """While the engine prefills a request (held here), /metrics shows it running and the one submitted meanwhile
    queued; afterwards both read 0, and `dflash_prompt_tokens_total` holds both prompts."""
    import threading

    target_cfg, target_params, drafter, prompts = setup
    engine = Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=3, max_len=MAX_LEN))
    entered, release = threading.Event(), threading.Event()
    prefill = engine._prefill

    def held(batch):
        entered.set()
        assert release.wait(120)
        return prefill(batch)

    engine._prefill = held
    worker = EngineWorker(engine).start()
    try:
        first = worker.submit(prompts[0], 4)
        assert entered.wait(120)
        second = worker.submit(prompts[1], 4)
        during = generate_latest(worker.registry).decode()
        release.set()
        _drain(first), _drain(second)
        after = generate_latest(worker.registry).decode()
    finally:
        release.set()
        worker.shutdown()
    assert _metric(during, "dflash_running_requests") == 1 and _metric(during, "dflash_queue_depth") == 1
    assert _metric(after, "dflash_running_requests") == 0 and _metric(after, "dflash_queue_depth") == 0
    assert _metric(after, "dflash_prompt_tokens_total") == len(prompts[0]) + len(prompts[1])


def test_ignore_eos_runs_past_the_stop_tokens(setup):
    """With the server's stop ids set, a request ends at the first one; with `ignore_eos` it runs to its budget
    and its tokens are AR's, the stop id among them."""
    target_cfg, target_params, drafter, prompts = setup
    ar = ar_alone(target_params, target_cfg, prompts[2], 12)
    stop = ar[3]
    worker = EngineWorker(Engine(target_params, target_cfg, drafter, Chain(4), Limits(slots=3, max_len=MAX_LEN)))
    worker.stop_ids = (stop,)
    worker.start()
    try:
        plain, ignoring = worker.submit(prompts[2], 12), worker.submit(prompts[2], 12, ignore_eos=True)
        _drain(plain), _drain(ignoring)
    finally:
        worker.shutdown()
    assert plain.request.token_ids == ar[: ar.index(stop) + 1] and plain.request.finish_reason == "stop"
    assert ignoring.request.token_ids == ar and ignoring.request.finish_reason == "length" and stop in ar
