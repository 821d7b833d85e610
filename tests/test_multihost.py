"""Multi-host checks on localhost (docs/design.md §6): `jax.distributed` processes with simulated CPU devices, each
one a run of tests/multihost_worker.py.

- A checkpoint written by 2 processes (2 devices, the state sharded across them) restores into 1 process with 1
  device, and one written by that process restores into 2 processes: every shard equal to the state the reader
  computes itself, the data iterator state with it.
- Each host reads a disjoint part of the data through Grain, and the global batch assembled from the hosts' parts
  is the one-process global batch.
- A target read onto the mesh of 2 processes x 2 devices: each process reads only its devices' shards, and no device
  holds more than its share (plus its largest unsharded leaf and a slack).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "multihost_worker.py"
DIST_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "DFLASH_DISTRIBUTED")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(actions: list[str], processes: int, logs: Path, timeout: float = 300, devices: int = 1) -> list[str]:
    """Run the worker's `actions` (ACTION[:DIR]) on `processes` processes (`devices` CPU devices each); their
    stdouts, once all exit 0."""
    address = f"127.0.0.1:{_free_port()}"
    base = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    base |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    procs = []
    for i in range(processes):
        env = dict(base)
        if processes > 1:
            env |= {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(i)}
        name = f"{actions[0].partition(':')[0]}{len(list(logs.iterdir()))}-{processes}-{i}"
        out, err = logs / f"{name}.out", logs / f"{name}.err"
        with open(out, "w") as o, open(err, "w") as e:  # files, not pipes: a full pipe would stall a collective
            procs.append((subprocess.Popen([sys.executable, str(WORKER), *actions], cwd=ROOT, env=env,
                                           stdout=o, stderr=e), out, err))
    try:
        for proc, _, _ in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [f"process {i} exited {p.returncode}:\n{err.read_text()[-3000:]}"
              for i, (p, _, err) in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n\n".join(failed)
    return [out.read_text() for _, out, _ in procs]


@pytest.mark.slow  # ~40 s of worker processes: nightly; test_trainer's 8-vs-1-device and checkpoint tests stay
@pytest.mark.e2e
def test_checkpoints_move_between_process_counts_and_hosts_read_disjoint_data(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()

    two, one = tmp_path / "by_two" / "checkpoints", tmp_path / "by_one" / "checkpoints"

    # 2 processes: Grain shards -> the global batch; then the sharded state is written by both.
    outs = _run(["data", f"write:{two}"], 2, logs)
    for i, out in enumerate(outs):
        assert f"OK data process {i}/2 devices 2\nOK write process {i}/2 devices 2" in out, out
    assert sorted(p.name for p in two.iterdir()) == ["3"]

    # 1 process, 1 device: restores what 2 wrote, then writes its own.
    out = _run([f"read:{two}", f"write:{one}"], 1, logs)[0]
    assert "OK read process 0/1 devices 1" in out and "OK write process 0/1 devices 1" in out, out
    assert "checked " in out

    # 2 processes restore what 1 wrote, each its own shards.
    outs = _run([f"read:{one}"], 2, logs)
    for i, out in enumerate(outs):
        assert f"OK read process {i}/2 devices 2" in out, out


@pytest.mark.slow  # ~30 s of worker processes: nightly; tests/test_placement.py keeps the 4-device placement bounds
@pytest.mark.e2e
def test_each_process_reads_and_holds_only_its_devices_share_of_the_target(tmp_path):
    """2 processes x 2 devices, the target on an fsdp mesh of all 4 (tests/multihost_worker.py `place`): each process
    reads from the checkpoint only its devices' shards and each device holds at most 1/4 of the target plus its
    largest unsharded leaf plus a slack, for a safetensors target and for the default GGUF one."""
    logs = tmp_path / "logs"
    logs.mkdir()
    outs = _run(["place"], 2, logs, devices=2)
    for i, out in enumerate(outs):
        assert f"OK place process {i}/2 devices 4" in out, out
        assert "placed: read " in out
