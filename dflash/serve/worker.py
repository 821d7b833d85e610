"""The engine on its own thread: `EngineWorker` takes requests from any thread and streams their tokens back.

    worker = EngineWorker(engine).start()
    job = worker.submit(prompt_ids, max_tokens, seed=0, sampling=GREEDY, stop_strings=())
    while (ids := job.tokens.get()) is not None: ...      # new token ids per step; then job.request, job.error
    worker.shutdown()                                      # finishes the requests in flight

It keeps the Prometheus metrics served at /metrics (`registry`). No HTTP here: `serve.http` is the transport.
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

from dflash.serve.engine import Completion, Engine
from dflash.serve.sampling import GREEDY, SamplingConfig

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """`EngineWorker.submit` after `shutdown` began: the request is not taken."""


@dataclasses.dataclass
class Job:
    """One submitted request and its results, shared between a caller's thread and the engine thread.

    tokens: lists of new ids as the engine emits them, then None once the request ended; request: the
    engine's `Completion` (set as it runs); error: why the engine refused or dropped the request, with
    engine_failed True when the engine itself failed (a server error) rather than refusing the request."""

    prompt_ids: Sequence[int]
    max_tokens: int
    seed: int
    stop_strings: tuple[str, ...]
    sampling: SamplingConfig = GREEDY
    request: Completion | None = None
    tokens: queue.Queue = dataclasses.field(default_factory=queue.Queue)
    error: str | None = None
    engine_failed: bool = False
    cancelled: bool = False  # the client went away: the engine thread ends the request and frees its slot


class EngineWorker:
    """Runs the engine on its own thread; `submit` and `cancel` are safe to call from any thread.

    The engine thread admits submitted requests between steps and, after every step, publishes each
    request's new tokens on its job's queue (then None when it finished), and updates the Prometheus
    metrics in `registry`.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.stop_ids: tuple[int, ...] = ()  # the tokenizer's, set by the server
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.jobs: dict[int, Job] = {}
        self.sent: dict[int, int] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        registry = CollectorRegistry()
        self.registry = registry
        self.m_tokens = Counter("dflash_generated_tokens", "Generated tokens", registry=registry)
        self.m_requests = Counter("dflash_requests", "Finished requests", ["finish_reason"], registry=registry)
        self.m_queue = Gauge("dflash_queue_depth", "Requests waiting for a slot", registry=registry)
        self.m_running = Gauge("dflash_running_requests", "Requests decoding", registry=registry)
        self.m_tau = Histogram("dflash_tau", "Tokens per verify step per request (acceptance length)",
                               buckets=[1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32, 64], registry=registry)
        self.m_accept = Gauge("dflash_accept_rate", "Share of steps whose draft at this position was accepted",
                              ["position"], registry=registry)
        self.m_tps = Gauge("dflash_tokens_per_second", "Generated tokens per second (last 10 s)", registry=registry)
        self._accept_counts = np.zeros(max(engine.k - 1, 1))
        self._accept_steps = 0
        self._recent: list[tuple[float, int]] = []

    def start(self) -> EngineWorker:
        self.thread.start()
        return self

    def submit(self, prompt_ids: Sequence[int], max_tokens: int, *, seed: int = 0, sampling: SamplingConfig = GREEDY,
               stop_strings: tuple[str, ...] = ()) -> Job:
        """Queue a request for the engine thread (`Engine.submit`'s arguments); its results arrive on the job.
        Raises `ShuttingDown` once `shutdown` began."""
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        job = Job(prompt_ids, max_tokens, seed, stop_strings, sampling)
        self.inbox.put(job)
        return job

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
            try:
                job = self.inbox.get(timeout=0.01 if self.engine.busy else 0.2)
            except queue.Empty:
                job = None
            while job is not None:
                try:
                    rid = self.engine.submit(job.prompt_ids, job.max_tokens, self.stop_ids, seed=job.seed,
                                             sampling=job.sampling, stop_strings=job.stop_strings)
                    self.jobs[rid], self.sent[rid] = job, 0
                except ValueError as err:
                    job.error = str(err)
                    job.tokens.put(None)
                try:
                    job = self.inbox.get_nowait()
                except queue.Empty:
                    job = None
            self._cancel_gone()
            if self.engine.busy:
                try:
                    self.engine.step()
                except Exception as err:  # noqa: BLE001 - any engine failure must end the waiting requests
                    log.exception("engine step failed; failing the requests in flight and resetting the engine")
                    self._fail_all(f"the engine failed ({type(err).__name__}: {err}); the request was dropped")
                    continue
                self._publish()
            elif self.stopping.is_set() and self.inbox.empty():
                return

    def _publish(self) -> None:
        live = {r.request_id: r for r in self.engine.running.values()}
        finished = [rid for rid in list(self.jobs) if rid in self.engine.done]
        for rid, request in list(live.items()) + [(rid, self.engine.done[rid]) for rid in finished]:
            job = self.jobs[rid]
            job.request = request
            new = request.token_ids[self.sent[rid]:]
            if new:
                self.sent[rid] += len(new)
                job.tokens.put(list(new))
                self.m_tokens.inc(len(new))
                self._recent.append((time.monotonic(), len(new)))
        for rid in finished:
            job, request = self.jobs.pop(rid), self.engine.done.pop(rid)
            del self.sent[rid]
            self.m_requests.labels(request.finish_reason).inc()
            if request.accepted:
                self.m_tau.observe(request.tau)
                acc = np.asarray(request.accepted)
                self._accept_counts += np.array([np.sum(acc > i) for i in range(len(self._accept_counts))])
                self._accept_steps += len(acc)
                for i, c in enumerate(self._accept_counts):
                    self.m_accept.labels(str(i + 1)).set(c / self._accept_steps)
            job.tokens.put(None)
        now = time.monotonic()
        self._recent = [(t, n) for t, n in self._recent if now - t <= 10.0]
        self.m_tps.set(sum(n for _, n in self._recent) / 10.0)
        self.m_queue.set(len(self.engine.queue))
        self.m_running.set(len(self.engine.running))

    def _fail_all(self, message: str) -> None:
        """End every request in flight with `message` (engine_failed) and give the engine a fresh state."""
        for job in self.jobs.values():
            job.error, job.engine_failed = message, True
            job.tokens.put(None)
        self.jobs.clear()
        self.sent.clear()
        self.engine.reset()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Take no more requests; the engine thread finishes the ones in flight, then ends (joined here)."""
        self.stopping.set()
        self.thread.join(timeout)


__all__ = ["EngineWorker", "Job", "ShuttingDown"]
