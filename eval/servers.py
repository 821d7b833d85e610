"""Servers for an evaluation: `dflash serve` subprocesses on free loopback ports (logs kept), or servers in
this process over one loaded target (the demo's short eval)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dflash.eval.client import Client, ServerError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 600.0) -> None:
    """Block until `url`/health answers; a process that exits first is an error naming its log. `timeout`: seconds
    without progress, i.e. without the health check answering and, when `log` is given, without the log growing (a
    server precompiling logs each program: a cold start of many slots on a loaded CPU takes longer than any fixed
    limit while it is clearly working)."""
    client = Client(url, timeout=5.0)
    size = -1
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log and log.is_file() else ""
            raise ServerError(f"the server for {url} exited with code {proc.returncode} before it was ready "
                              f"(log: {log}):\n{tail}")
        try:
            client.get("/health")
            return
        except ServerError:
            time.sleep(0.5)
        grown = log.stat().st_size if log is not None and log.is_file() else size
        if grown != size:
            size, deadline = grown, time.time() + timeout
    silent = f"its log {log} silent" if log is not None else "no answer"
    raise ServerError(f"the server at {url} was not ready: {silent} for {timeout:.0f} s")


@contextlib.contextmanager
def _serve(args: Sequence[str], log: Path, slots: int, ar_port: bool, timeout: float = 600.0) -> Iterator[list[str]]:
    port = free_port()
    ports = [port, *([free_port()] if ar_port else [])]
    cmd = [sys.executable, "-m", "dflash.launch.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port),
           "--slots", str(slots), *(["--ar-port", str(ports[1])] if ar_port else [])]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url in urls:
            wait_healthy(url, proc, log, timeout)
        yield urls
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a server subprocess as a pod would: SIGTERM (it finishes what it is doing), then SIGKILL if it is still
    running `timeout` seconds later; nothing if it has exited."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_subprocess(args: Sequence[str], log: Path, slots: int) -> Iterator[str]:
    """`dflash serve ARGS --port <free> --slots SLOTS` as a subprocess (its output in `log`); yields its URL and
    stops it (SIGTERM, then SIGKILL after 30 s) on exit."""
    with _serve(args, log, slots, ar_port=False) as urls:
        yield urls[0]


@contextlib.contextmanager
def serve_pair_subprocess(args: Sequence[str], log: Path, slots: int,
                          timeout: float = 600.0) -> Iterator[tuple[str, str]]:
    """As `serve_subprocess` with `--ar-port <free>`: one process serving the drafter and the target alone (AR) over
    one copy of the weights, on one chip; yields (DFlash URL, AR URL) once both answer (within `timeout` seconds:
    the start includes the precompile)."""
    with _serve(args, log, slots, ar_port=True, timeout=timeout) as urls:
        yield urls[0], urls[1]


@contextlib.contextmanager
def serve_in_process(target: Any, drafter: Any, plan: Any = None, *, slots: int, max_len: int,
                     model_name: str = "dflash", precompile: bool = True) -> Iterator[str]:
    """A real HTTP server in a thread of this process over `target` and `drafter` by the decode `plan` (`serve.plan`;
    None: `default_plan`, AR without a drafter); yields its URL. precompile: compile every shape the engine can
    use first (`Engine.precompile`), so that no timed request compiles; the log-probability variants are left
    out, since the evaluation client never asks for them (a request that did would compile, and `dflash eval`
    would count it and fail)."""
    from dflash.serve.engine import Engine
    from dflash.serve.plan import Limits, default_plan

    plan = default_plan(drafter) if plan is None else plan
    engine = Engine(target.params, target.cfg, drafter, plan, Limits(slots=slots, max_len=max_len))
    if precompile:
        engine.precompile(logprobs=False)
    with serve_engine(engine, target.tokenizer, model_name) as url:
        yield url


@contextlib.contextmanager
def serve_engine(engine: Any, tokenizer: Any, model_name: str = "dflash") -> Iterator[str]:
    """A real HTTP server over `engine` (`serve.engine.Engine`) in a thread of this process; yields its URL (a free
    loopback port). Benchmarks that compare engines of other shapes over one loaded target build them and serve each
    this way."""
    from dflash.serve.http import make_server, running

    with running([make_server(engine, tokenizer, model_name, "127.0.0.1", 0)]) as (url,):
        yield url  # on exit: the requests in flight finish, the engine thread stops


__all__ = ["free_port", "serve_engine", "serve_in_process", "serve_pair_subprocess", "serve_subprocess", "stop_process",
           "wait_healthy"]
