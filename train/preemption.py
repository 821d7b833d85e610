"""Preemption that loses nothing: SIGTERM (what GKE sends a pod before it takes the host away) makes the trainer
finish the step it is in, checkpoint it, and exit with PREEMPTED_EXIT_CODE, which the launchers restart on
(`launch.pod.RESTART_EXIT_CODES`); the restarted run resumes from that checkpoint, bit-identical to a run never
stopped (tests/test_train_resume.py).

Which step: with one process, the first step boundary after the signal. With several (a pod slice), every host must
save the same step, though the notice may reach one host only: JAX's preemption sync manager (started by
`jax.distributed.initialize`, it catches SIGTERM itself) agrees on the step after the latest any host has reached,
and `multihost_utils.reached_preemption_sync_point(step)` is true there on every host at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

# The exit status of a run stopped by SIGTERM after checkpointing: 42, the code xpk restarts a workload on by default
# (beside 127-255, the deaths by signal); Cluster Toolkit jobs list it in --restart-on-exit-codes.
PREEMPTED_EXIT_CODE = 42


class Preempted(Exception):  # noqa: N818 - an outcome, not an error: the CLI exits PREEMPTED_EXIT_CODE on it
    """Training stopped at `step` on SIGTERM, with that step checkpointed."""

    def __init__(self, step: int):
        super().__init__(f"stopped by SIGTERM at step {step}, which is checkpointed; exit {PREEMPTED_EXIT_CODE} "
                         "(the launchers restart on it; the run resumes from that step)")
        self.step = step


class PreemptionWatch:
    """`with PreemptionWatch() as watch: ... if watch.stop_at(step): <checkpoint step, stop>`.

    One process: a SIGTERM handler (installed on entry from the main thread, the previous one restored on exit)
    records the notice, and `stop_at` is true at the first step boundary after it. Several processes: `stop_at`
    asks JAX's preemption sync point (every host calls it at every step, from the same start step)."""

    def __init__(self) -> None:
        import jax  # here, so that the launchers read PREEMPTED_EXIT_CODE without importing JAX

        self.notice = False
        self._previous: signal.Handlers | None = None
        self._multi = jax.process_count() > 1

    def __enter__(self) -> PreemptionWatch:
        if not self._multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.notice:
            log.warning("SIGTERM: checkpointing at the end of this step, then exiting %d", PREEMPTED_EXIT_CODE)
        self.notice = True

    def stop_at(self, step: int) -> bool:
        """Whether to checkpoint `step` and stop (see the class)."""
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.notice


__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionWatch"]
