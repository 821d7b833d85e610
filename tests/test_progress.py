"""Progress without a terminal (data/progress.py): every long stage logs done/total, tokens/s and ETA at a fixed
interval when its output is not a TTY, a bar when it is; the train loop's reporting goes through it."""

from __future__ import annotations

import io

import pytest

from dflash.data.progress import Progress, choose_mode, duration, interval_s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_at_a_fixed_interval_with_rate_tokens_and_eta(monkeypatch) -> None:
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    clock, out = Clock(), io.StringIO()
    bar = Progress(100, initial=20, desc="regenerate", unit="conv", interval=30, stream=out, clock=clock)
    assert bar.mode == "lines"
    clock.t += 10
    bar.update(10, tokens=5000)  # 10 s in: before the interval, nothing written
    assert out.getvalue() == ""
    clock.t += 30
    bar.set_postfix(ok=29, err=1)
    bar.update(10, tokens=3000)  # 40 s, 20 done since the start (the 20 resumed ones are not speed)
    (line,) = out.getvalue().splitlines()
    assert line == ("regenerate: 40/100 conv (40.0%) | 0.50 conv/s | 200 tokens/s | elapsed 40s | ETA 2m00s | "
                    "ok=29 err=1")
    clock.t += 5
    bar.update(1)  # 5 s after the last line: none
    assert len(out.getvalue().splitlines()) == 1
    bar.close()
    bar.close()  # once
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("regenerate: 41/100 conv (41.0%)")


def test_token_units_unknown_totals_and_durations(monkeypatch) -> None:
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    clock, out = Clock(), io.StringIO()
    with Progress(10_000, desc="capture", unit="tok", interval=1, stream=out, clock=clock) as bar:
        clock.t += 4
        bar.update(2000)
    assert out.getvalue().splitlines()[0] == "capture: 2000/10000 tok (20.0%) | 500 tokens/s | elapsed 4s | ETA 16s"
    out = io.StringIO()
    with Progress(None, desc="stream", unit="item", interval=1, stream=out, clock=clock) as bar:
        clock.t += 2
        bar.update(30)
    assert out.getvalue().splitlines()[0] == "stream: 30 item | 15 item/s | elapsed 2s"
    assert [duration(s) for s in (0, 59.4, 387, 7500, 190000, float("inf"))] == ["0s", "59s", "6m27s", "2h05m",
                                                                                   "2d04h", "?"]


def test_mode_follows_the_terminal_the_switch_and_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    assert choose_mode(True, io.StringIO()) == "lines"  # a pod's log, a file, a pipe
    assert choose_mode(True, Tty()) == "bar"
    assert choose_mode(False, Tty()) == "off"  # --no-progress
    monkeypatch.setenv("DFLASH_PROGRESS", "lines")
    assert choose_mode(True, Tty()) == "lines"
    monkeypatch.setenv("DFLASH_PROGRESS", "loud")
    with pytest.raises(ValueError, match=r"DFLASH_PROGRESS must be one of \['bar', 'lines', 'off'\]; received 'loud'"):
        choose_mode(True, Tty())
    monkeypatch.delenv("DFLASH_PROGRESS")
    out = Tty()
    with Progress(3, desc="walk", unit="row", stream=out) as bar:
        bar.update(3)
    assert "walk: 100%" in out.getvalue() and "3/3" in out.getvalue()  # tqdm's bar
    silent = io.StringIO()
    with Progress(3, desc="walk", unit="row", stream=silent, enabled=False) as bar:
        bar.update(3)
    assert silent.getvalue() == ""
    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL", "5")
    assert interval_s() == 5.0
    for bad in ("0", "soon", "-1", "nan"):
        monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL", bad)
        with pytest.raises(ValueError, match=rf"DFLASH_PROGRESS_INTERVAL must be a number of seconds > 0; "
                                             rf"received '{bad}'"):
            interval_s()


def test_the_train_loop_reports_lines_without_a_terminal(monkeypatch, capsys) -> None:
    import jax.numpy as jnp

    from dflash.train.config import TrainConfig
    from dflash.train.loop import StepMetrics

    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    monkeypatch.setenv("DFLASH_PROGRESS_INTERVAL", "0.000001")

    class Writer:
        def write(self, step, metrics) -> None:
            pass

    steps = StepMetrics(TrainConfig(steps=4, log_every=1), Writer(), block_tokens=64, start=0, show=True)
    for step in range(1, 5):
        steps.push(step, {"loss": jnp.float32(2.0), "acceptance_length": jnp.float32(1.5)})
    steps.flush()
    steps.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train: ")]
    assert lines and lines[-1].startswith("train: 4/4 step (100.0%) | ")
    assert "tokens/s" in lines[-1] and "ETA 0s" in lines[-1] and "loss=2.000 tau=1.50" in lines[-1]
