"""Progress of a long stage (regenerate, capture, walk, train, eval), on a terminal or without one.

    with Progress(total=len(items), desc="regenerate", unit="conv") as bar:
        for item in items:
            ...
            bar.update(1, tokens=generated)         # done += 1; tokens feed the tokens/s
            bar.set_postfix(ok=ok, err=errors)      # shown on the bar and in the lines

Where the output goes decides the form (docs/data.md "Progress"):
- a terminal (the stream, stderr by default, is a TTY): a tqdm bar, as before;
- no terminal (a pod's log, a file, a pipe): one line every `DFLASH_PROGRESS_INTERVAL` seconds (default 30), and
  a last one at the end, e.g.
  `regenerate: 1200/8000 conv (15.0%) | 3.1 conv/s | 2410 tokens/s | elapsed 6m27s | ETA 36m33s | ok=1198 err=2`.
  Rates are measured since this process started the stage (resumed work in `initial` is not counted as speed).
- `DFLASH_PROGRESS=bar|lines|off` forces a form; `enabled=False` (the CLI's `--no-progress`) is `off`.

Thread-safe (eval updates it from its request threads). Imports nothing of the project: data, train and eval use it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

INTERVAL_ENV = "DFLASH_PROGRESS_INTERVAL"
MODE_ENV = "DFLASH_PROGRESS"
DEFAULT_INTERVAL_S = 30.0
MODES = ("bar", "lines", "off")


def interval_s() -> float:
    """Seconds between progress lines: DFLASH_PROGRESS_INTERVAL, else DEFAULT_INTERVAL_S."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0; received {raw!r}")
    return value


def choose_mode(enabled: bool, stream: TextIO) -> str:
    """'off' when disabled, else DFLASH_PROGRESS if set, else 'bar' on a terminal and 'lines' without one."""
    if not enabled:
        return "off"
    forced = os.environ.get(MODE_ENV, "").strip()
    if forced:
        if forced not in MODES:
            raise ValueError(f"{MODE_ENV} must be one of {list(MODES)}; received {forced!r}")
        return forced
    isatty = getattr(stream, "isatty", None)
    return "bar" if callable(isatty) and isatty() else "lines"


def duration(seconds: float) -> str:
    """A short human duration: 45s, 6m27s, 3h05m, 2d04h."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


class Progress:
    """done/total, rate, tokens/s and ETA of one stage: a bar on a terminal, lines at a fixed interval without one.

    total: units of work (None: unknown, no percentage or ETA). initial: units done by an earlier run (resume).
    unit: what one unit is ('conv', 'step', 'tok', ...); with unit 'tok' the rate is the tokens/s.
    interval: seconds between lines (default: `interval_s()`); stream: where both forms write (default stderr);
    clock: the time source (tests pass a fake one).
    """

    def __init__(self, total: float | None, *, desc: str, unit: str = "it", initial: float = 0, enabled: bool = True,
                 interval: float | None = None, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, unit_scale: bool = False):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream if stream is not None else sys.stderr
        self.mode = choose_mode(enabled, self.stream)
        self.interval = interval if interval is not None else interval_s()
        self.clock = clock
        self.n = initial
        self.tokens = 0
        self.postfix: dict[str, Any] = {}
        self.lines_written = 0
        self._initial = initial
        self._start = self._last = clock()
        self._lock = threading.Lock()
        self._closed = False
        self._bar = (tqdm(total=total, initial=initial, unit=unit, desc=desc, dynamic_ncols=True, file=self.stream,
                          unit_scale=unit_scale) if self.mode == "bar" else None)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: float = 1, *, tokens: int = 0) -> None:
        """`n` more units done, `tokens` more tokens made (for tokens/s)."""
        with self._lock:
            self.n += n
            self.tokens += tokens
            if self._bar is not None:
                self._bar.update(n)
            elif self.mode == "lines" and self.clock() - self._last >= self.interval:
                self._emit()

    def set_postfix(self, fields: dict[str, Any] | None = None, refresh: bool = False, **kwargs: Any) -> None:
        """Extra fields shown after the numbers (loss, errors, ...)."""
        with self._lock:
            self.postfix = {**(fields or {}), **kwargs}
            if self._bar is not None:
                self._bar.set_postfix(self.postfix, refresh=refresh)

    def write(self, message: str) -> None:
        """A message that does not break the bar."""
        if self.mode == "bar":
            tqdm.write(message, file=self.stream)
        elif self.mode == "lines":
            print(message, file=self.stream, flush=True)

    def line(self) -> str:
        """The progress line as it reads now."""
        elapsed = self.clock() - self._start
        done = self.n - self._initial
        parts = [f"{self.desc}: {_count(self.n)}" + (f"/{_count(self.total)}" if self.total is not None else "")
                 + f" {self.unit}" + (f" ({100 * self.n / self.total:.1f}%)" if self.total else "")]
        rate = done / elapsed if elapsed > 0 else 0.0
        if self.unit == "tok":
            parts.append(f"{rate:.0f} tokens/s")
        else:
            parts.append(f"{rate:.2f} {self.unit}/s" if rate < 10 else f"{rate:.0f} {self.unit}/s")
            if self.tokens:
                parts.append(f"{self.tokens / elapsed if elapsed > 0 else 0.0:.0f} tokens/s")
        parts.append(f"elapsed {duration(elapsed)}")
        if self.total is not None:
            left = self.total - self.n
            parts.append("ETA " + (duration(left / rate) if rate > 0 else ("0s" if left <= 0 else "?")))
        if self.postfix:
            parts.append(" ".join(f"{k}={v}" for k, v in self.postfix.items()))
        return " | ".join(parts)

    def _emit(self) -> None:
        print(self.line(), file=self.stream, flush=True)
        self.lines_written += 1
        self._last = self.clock()

    def close(self) -> None:
        """End the bar, or write the last line (always one at the end, whatever the interval)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            elif self.mode == "lines":
                self._emit()


__all__ = ["DEFAULT_INTERVAL_S", "INTERVAL_ENV", "MODE_ENV", "Progress", "choose_mode", "duration", "interval_s"]
