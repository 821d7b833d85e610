"""The engine on its own thread: `EngineWorker` takes requests from any thread and streams their text back.

    worker = EngineWorker(engine).start()
    job = worker.submit(prompt_ids, max_tokens, seed=0, sampling=GREEDY, stop_strings=(), logprobs=None)
    while (update := job.tokens.get()) is not None: ...   # JobUpdate: new stable text, its tokens, logprobs
    job.request, job.error, job.status                     # the final Completion; why it failed; 400 / 503
    worker.shutdown()                                      # finishes the requests in flight

`submit` validates in the caller's thread (`Engine.check`, raising `RequestRejected`), so a refused request
never reaches the engine thread and the transport can answer 400 before any byte of a stream. A request whose
own host-side work fails ends alone (status 400); a failed device step fails the requests in flight (status
503) and resets the engine, which keeps serving. Prometheus metrics live in `registry` (served at /metrics).
No HTTP here: `serve.http` is the transport.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dflash.serve.engine import Completion, Engine, RequestRejected
from dflash.serve.sampling import GREEDY, SamplingConfig

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ShuttingDown(RuntimeError):
    """`EngineWorker.submit` after `shutdown` began: the request is not taken."""


@dataclasses.dataclass(frozen=True)
class JobUpdate:
    """What became stable since the last update: text_delta (new stable text), the ids of the tokens whose text
    is now stable (at the end: the rest), and their log-probabilities when the request asked for them."""

    token_ids: list[int]
    text_delta: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclasses.dataclass
class Job:
    """One submitted request, shared between a caller's thread and the engine thread.

    tokens: `JobUpdate`s as text becomes stable, then None once the request ended; request: the engine's
    `Completion` (final once None arrived); error: why it failed; status: None (it did not fail), 400 (it
    failed alone) or 503 (the engine failed as a whole and was reset)."""

    request: Completion
    tokens: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    error: str | None = None
    status: int | None = None
    cancelled: bool = False  # the client went away: the engine thread ends the request and frees its slot
    sent_tokens: int = 0  # published so far
    sent_text: int = 0
    seen_tokens: int = 0  # generated so far, published or not (inter-token latency)
    seen_s: float = 0.0

    @property
    def engine_failed(self) -> bool:
        return self.status == 503


class EngineWorker:
    """Runs the engine on its own thread; `submit` and `cancel` are safe to call from any thread.

    The engine thread admits submitted requests between steps and, after every step (and after an admission, so
    that a first token never waits for the running requests' next decode dispatch), publishes each request's newly
    stable text on its job's queue (then None when it finished), and updates the Prometheus metrics in `registry`.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop_ids: tuple[int, ...] = ()  # the tokenizer's, set by the server
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.jobs: dict[int, Job] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        registry = CollectorRegistry()
        self.registry = registry
        self.m_tokens = Counter("dflash_generated_tokens", "Generated tokens", registry=registry)
        self.m_requests = Counter("dflash_requests", "Ended requests by status (200, 400 refused or failed alone, "
                                  "503 engine failure) and finish reason", ["status", "finish_reason"],
                                  registry=registry)
        self.m_prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of the requests taken",
                                       registry=registry)
        # Read when scraped, from the worker's own books: a request is queued from `submit` until the engine takes
        # it from its queue, then running (its prefill included) until its end is published.
        self.m_queue = Gauge("dflash_queue_depth", "Requests waiting for a slot", registry=registry)
        self.m_queue.set_function(lambda: self.inbox.qsize() + len(self.engine.queue))
        self.m_running = Gauge("dflash_running_requests", "Requests holding a slot (prefilling or decoding)",
                               registry=registry)
        self.m_running.set_function(lambda: max(len(self.jobs) - len(self.engine.queue), 0))
        self.m_ttft = Histogram("dflash_time_to_first_token_seconds", "Seconds from submission to the first token",
                                buckets=LATENCY_BUCKETS, registry=registry)
        self.m_itl = Histogram("dflash_inter_token_latency_seconds", "Seconds between a request's tokens (a step's "
                               "time spread over the tokens it emitted)", buckets=TOKEN_BUCKETS, registry=registry)
        self.m_e2e = Histogram("dflash_e2e_request_latency_seconds", "Seconds from submission to the end",
                               buckets=LATENCY_BUCKETS, registry=registry)
        self.m_tau = Histogram("dflash_tau", "Tokens per verify step per request (acceptance length)",
                               buckets=[1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64], registry=registry)
        self.m_accept = Gauge("dflash_accept_rate", "Share of steps whose draft at this position was accepted",
                              ["position"], registry=registry)
        self.m_tps = Gauge("dflash_tokens_per_second", "Generated tokens per second (last 10 s)", registry=registry)
        self.m_compiles = Counter("dflash_compiles", "Programs the engine compiled (jit cache misses)",
                                  registry=registry)
        self.m_compiles.inc(engine.compiles)
        self._compiles_seen = engine.compiles
        self._accept_counts = np.zeros(max(engine.k - 1, 1))
        self._accept_steps = 0
        self._recent: list[tuple[float, int]] = []

    def start(self) -> EngineWorker:
        self.thread.start()
        return self

    def submit(self, prompt_ids: Sequence[int], max_tokens: int | None, *, seed: int = 0,
               sampling: SamplingConfig = GREEDY, stop_strings: Sequence[str] = (), logprobs: int | None = None,
               prompt_logprobs: int | None = None, ignore_eos: bool = False) -> Job:
        """Validate a request here, in the caller's thread (`Engine.check`: raises `RequestRejected` naming the
        field), and queue it for the engine thread; its results arrive on the job. ignore_eos: the stop tokens
        (`stop_ids`) do not end this request. Raises `ShuttingDown` once `shutdown` began."""
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        try:
            request = self.engine.check(prompt_ids, max_tokens, () if ignore_eos else self.stop_ids, seed,
                                        sampling=sampling, stop_strings=stop_strings, logprobs=logprobs,
                                        prompt_logprobs=prompt_logprobs)
        except RequestRejected:
            self.refused(400)
            raise
        self.m_prompt_tokens.inc(len(request.prompt_ids))
        job = Job(request)
        self.inbox.put(job)
        return job

    def refused(self, status: int) -> None:
        """Count a request refused before it reached the engine (`requests_total{status, finish_reason="rejected"}`):
        `submit`'s own refusals, and the transport's (a malformed body, an unknown model, a bad field: 4xx)."""
        self.m_requests.labels(str(status), "rejected").inc()

    def cancel(self, job: Job) -> None:
        """End `job` (its client disconnected): the engine thread frees its slot and pages before its next step."""
        job.cancelled = True

    def _cancel_gone(self) -> None:
        cancelled = [rid for rid, job in list(self.jobs.items()) if job.cancelled and self.engine.cancel(rid)]
        if cancelled:
            log.info("cancelled request(s) %s: their clients disconnected", cancelled)
            self._publish()  # hands them back (and forgets them) even when no step follows

    def _loop(self) -> None:
        while True:
            try:  # busy: take what has arrived and go on decoding (a wait here delays every dispatch)
                job = self.inbox.get_nowait() if self.engine.busy else self.inbox.get(timeout=0.2)
            except queue.Empty:
                job = None
            while job is not None:
                self.jobs[self.engine.enqueue(job.request)] = job
                try:
                    job = self.inbox.get_nowait()
                except queue.Empty:
                    job = None
            self._cancel_gone()
            if self.engine.busy:
                try:
                    if self.engine.admit():  # a request started: its first token goes out before the next decode
                        self._publish()
                    self.engine.decode()
                except Exception as err:  # noqa: BLE001 - any engine failure must end the waiting requests
                    log.exception("engine step failed; failing the requests in flight and resetting the engine")
                    self._fail_all(f"the engine failed ({type(err).__name__}: {err}); the request was dropped")
                    continue
                self._publish()
            elif self.stopping.is_set() and self.inbox.empty():
                return

    def _publish(self) -> None:
        now, clock = time.monotonic(), time.perf_counter()
        live = {r.request_id for r in self.engine.running.values()}
        finished = [rid for rid in self.jobs if rid in self.engine.done]
        for rid in [*live, *finished]:
            job = self.jobs.get(rid)
            if job is None:
                continue
            request = job.request
            new = len(request.token_ids) - job.seen_tokens
            if new > 0:
                self.m_tokens.inc(new)
                self._recent.append((now, new))
                gaps = new
                if job.seen_tokens == 0 and request.first_token_s is not None:
                    self.m_ttft.observe(request.first_token_s - request.submitted_s)
                    job.seen_s, gaps = request.first_token_s, new - 1
                for _ in range(gaps):
                    self.m_itl.observe((clock - job.seen_s) / gaps)
                job.seen_s = clock
            job.seen_tokens = len(request.token_ids)
            update = self._update(job)
            if update is not None:
                job.tokens.put(update)
        for rid in finished:
            job, request = self.jobs.pop(rid), self.engine.done.pop(rid)
            status = "200"
            if request.finish_reason == "error":
                job.error, job.status, status = request.error, 400, "400"
            self.m_requests.labels(status, request.finish_reason).inc()
            if request.finished_s is not None:
                self.m_e2e.observe(request.finished_s - request.submitted_s)
            if request.accepted:
                self.m_tau.observe(request.tau)
                acc = np.asarray(request.accepted)
                self._accept_counts += np.array([np.sum(acc > i) for i in range(len(self._accept_counts))])
                self._accept_steps += len(acc)
                for i, c in enumerate(self._accept_counts):
                    self.m_accept.labels(str(i + 1)).set(c / self._accept_steps)
            job.tokens.put(None)
        self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        self.m_tps.set(sum(n for _, n in self._recent) / 10.0)
        self._count_compiles()

    @staticmethod
    def _update(job: Job) -> JobUpdate | None:
        """The job's newly stable part, or None when nothing became stable."""
        request = job.request
        end, text = request.stable_tokens, request.stable_text
        if end <= job.sent_tokens and len(text) <= job.sent_text:
            return None
        start = job.sent_tokens
        update = JobUpdate(list(request.token_ids[start:end]), text[job.sent_text:],
                           list(request.token_logprobs[start:end]), list(request.top_logprobs[start:end]))
        job.sent_tokens, job.sent_text = max(end, start), max(len(text), job.sent_text)
        return update

    def _count_compiles(self) -> None:
        if self.engine.compiles > self._compiles_seen:
            self.m_compiles.inc(self.engine.compiles - self._compiles_seen)
            self._compiles_seen = self.engine.compiles

    def _fail_all(self, message: str) -> None:
        """End every request in flight with `message` (status 503) and give the engine a fresh state."""
        for job in self.jobs.values():
            job.error, job.status = message, 503
            self.m_requests.labels("503", "error").inc()
            job.tokens.put(None)
        self.jobs.clear()
        self.engine.reset()
        self._count_compiles()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Take no more requests; the engine thread finishes the ones in flight, then ends (joined here)."""
        self.stopping.set()
        self.thread.join(timeout)


__all__ = ["EngineWorker", "Job", "JobUpdate", "ShuttingDown"]
