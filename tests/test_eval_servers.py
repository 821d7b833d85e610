"""`eval.servers.wait_healthy`: a server that keeps logging (precompiling) is waited for past the timeout; a silent
one fails after it, naming its log; one that exits fails at once with its log's tail."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from dflash.eval.client import ServerError
from dflash.eval.servers import free_port, wait_healthy


def _process(code: str, log) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)


def test_a_logging_server_is_waited_for_and_a_silent_one_is_not(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    log = tmp_path / "busy.log"
    busy = _process("import time\nfor i in range(12):\n    print(i, flush=True); time.sleep(0.25)\nraise SystemExit(3)",
                    log)
    start = time.time()
    with pytest.raises(ServerError, match="exited with code 3 before it was ready") as err:
        wait_healthy(url, busy, log, timeout=1.0)  # 3 s of logging: longer than the timeout, waited for
    assert time.time() - start > 2.5 and "11" in str(err.value)
    quiet = tmp_path / "quiet.log"
    silent = _process("import time\nprint('started', flush=True)\ntime.sleep(30)", quiet)
    try:
        start = time.time()
        with pytest.raises(ServerError, match=f"was not ready: its log {quiet} silent for 1 s"):
            wait_healthy(url, silent, quiet, timeout=1.0)
        assert time.time() - start < 10
    finally:
        silent.kill()
        silent.wait()
