"""`dflash train` on 2 processes (`jax.distributed` on localhost, 1 simulated CPU device each) ends with the
same state as 1 process with 2 devices: same mesh size, same global batch, each host reading its Grain shard. With
`train.eval_every`, the 2-process run measures real τ (process 0 decodes with the gathered drafter while the other
waits) and keeps `best/`, which `dflash export --step best` and `dflash eval --step best` read; a run without `best/`
falls back to its newest checkpoint, saying so."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash.launch.cli import main
from dflash.train.checkpoint import Checkpointer
from dflash.train.metrics import read_metrics

pytestmark = pytest.mark.heavy  # compiles a model's engine or train step: not in `bin/test --fast`


ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
DIST_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _background(args: list[str], devices: int, log: Path, **dist: str) -> subprocess.Popen:
    """`dflash ARGS` in the background on `devices` simulated CPU devices (the JAX_* variables of `dist` join it to
    a distributed run); output to `log`.out/.err."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu", **dist}
    cmd = [sys.executable, "-m", "dflash.launch.cli", *args]
    # Files, not pipes: a process blocked on a full pipe would stall its peer inside a collective.
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err)


def _start(run_dir: Path, devices: int, log: Path, *extra: str, **dist: str) -> subprocess.Popen:
    """`dflash train --config tiny` in the background (`_background`)."""
    return _background(["train", "--config", "tiny", "--no-progress", f"train.run_dir={run_dir}",
                        f"train.steps={STEPS}", "train.save_every=2", "train.log_every=1", "train.wandb=disabled",
                        "train.batch_size=4", *extra],  # 2 rows per host: the hosts' blocks must assemble in order
                       devices, log, **dist)


def _wait(procs: dict[str, subprocess.Popen], logs: Path, timeout: float = 600) -> dict[str, tuple[str, str]]:
    """Wait for every process; once one fails (or time runs out) kill the rest and show each one's stderr."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()):
                break  # a peer of a dead process would wait in a collective until the coordinator gives up
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = {name: ((logs / f"{name}.out").read_text(), (logs / f"{name}.err").read_text()) for name in procs}
    failed = {name: proc.returncode for name, proc in procs.items() if proc.returncode != 0}
    assert not failed, "\n\n".join(f"{name} exited {code}:\n{texts[name][1][-3000:]}" for name, code in failed.items())
    return texts


def _final(run_dir: Path) -> tuple[object, dict]:
    """(state as host arrays, data state) of the last checkpoint, read onto this process's device whatever
    topology wrote it."""
    ckpt = Checkpointer(run_dir / "checkpoints", {})
    try:
        assert ckpt.all_steps() == [2, STEPS], ckpt.all_steps()
        state, data_state, _ = ckpt.restore_raw(STEPS)
    finally:
        ckpt.close()
    return jax.device_get(state), data_state


@pytest.mark.slow
@pytest.mark.e2e
def test_two_processes_train_like_one_process_with_the_same_devices(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    procs = {f"multi{i}": _start(tmp_path / "multi", 1, logs / f"multi{i}", JAX_COORDINATOR_ADDRESS=address,
                                 JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)}
    procs["single"] = _start(tmp_path / "single", 2, logs / "single")
    texts = _wait(procs, logs)

    for i in range(2):
        out, err = texts[f"multi{i}"]
        assert f"process {i}/2" in err, err[-2000:]
        assert f"(to step {STEPS})" in out, out
    assert "process 0/1" in texts["single"][1]

    # Final checkpoints: the same tree, and the same values (summation order may differ across processes).
    want, want_data = _final(tmp_path / "single")
    got, got_data = _final(tmp_path / "multi")
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
    for (path, a), (_, b) in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))

    # The data state is process 0's; it counts batches, so it is every process's (and the 1-process run's).
    assert got_data == want_data, (got_data, want_data)

    # The held-out evaluation covers the same examples whatever the process count.
    want_eval = [r for r in read_metrics(tmp_path / "single") if "eval/loss" in r]
    got_eval = [r for r in read_metrics(tmp_path / "multi") if "eval/loss" in r]
    assert len(got_eval) == len(want_eval) == 1
    np.testing.assert_allclose(got_eval[0]["eval/loss"], want_eval[0]["eval/loss"], rtol=1e-5)

    # One metrics log, written by process 0 alone: each step once, losses those of the 1-process run.
    assert sorted(p.name for p in (tmp_path / "multi").glob("metrics*")) == ["metrics.jsonl"]
    got_metrics = [r for r in read_metrics(tmp_path / "multi") if "loss" in r]
    want_metrics = {r["step"]: r for r in read_metrics(tmp_path / "single") if "loss" in r}
    assert [r["step"] for r in got_metrics] == list(range(1, STEPS + 1))
    for r in got_metrics:
        np.testing.assert_allclose(r["loss"], want_metrics[r["step"]]["loss"], rtol=1e-5, err_msg=f"step {r['step']}")
    assert len(list((tmp_path / "multi" / "tensorboard").glob("events.out.tfevents.*"))) == 1


EVAL = ("train.eval_every=2", "train.eval_prompts=1", "train.eval_tokens=8", "train.eval_sets=[gsm8k]")


@pytest.fixture(scope="module")
def two_process_run_with_real_tau(tmp_path_factory) -> Path:
    """A 2-process run of the tiny recipe that measures real τ at steps 2 and 4 (its run dir)."""
    root = tmp_path_factory.mktemp("realtau")
    logs = root / "logs"
    logs.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    procs = {f"p{i}": _start(root / "run", 1, logs / f"p{i}", *EVAL, JAX_COORDINATOR_ADDRESS=address,
                             JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)}
    texts = _wait(procs, logs)
    assert "waiting for process 0's real-τ evaluation" in texts["p1"][1], texts["p1"][1][-2000:]
    assert "real τ" in texts["p0"][1] and "real τ" not in texts["p1"][1].replace("real-τ", ""), texts["p1"][1][-2000:]
    return root / "run"


@pytest.mark.e2e
def test_a_two_process_run_keeps_best_from_real_tau_and_export_reads_it(two_process_run_with_real_tau, tmp_path,
                                                                         capsys):
    from dflash.export.cli import main as export_main
    from dflash.models.drafter_io import best_or_latest, load_drafter
    from dflash.models.registry import known_target

    run = two_process_run_with_real_tau
    logged = {r["step"]: r["eval/tau"] for r in read_metrics(run) if "eval/tau" in r}
    assert sorted(logged) == [2, STEPS] and all(1.0 <= t <= 8 for t in logged.values())  # process 0 logged each once
    best = json.loads((run / "best" / "best.json").read_text())
    assert best["step"] == max(logged, key=lambda s: (logged[s], -s)) and best["tau"] == logged[best["step"]]

    # best/ holds the gathered drafter of that step: every parameter equals that checkpoint's (the state was sharded
    # over the two processes' devices).
    cfg = known_target("smollm2").cfg
    got = jax.tree_util.tree_leaves(jax.device_get(_params(load_drafter(run, cfg, step="best"))))
    want = jax.tree_util.tree_leaves(jax.device_get(_params(load_drafter(run, cfg, step=best["step"]))))
    assert len(got) == len(want) > 0
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want, strict=True))

    # The documented export reads it; without best/ it takes the newest checkpoint and says so.
    assert export_main([str(run), "--step", "best", "--format", "zlab", "--out", str(tmp_path / "best")]) == 0
    assert f"{run / 'best'} (step {best['step']})" in capsys.readouterr().out
    assert (tmp_path / "best" / "config.json").is_file()
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("best"))
    step, note = best_or_latest(bare, "best")
    assert step is None and f"using its newest checkpoint, step {STEPS}, instead of --step best" in note
    assert best_or_latest(run, "best") == ("best", "") and best_or_latest(bare, 2) == (2, "")
    assert export_main([str(bare), "--step", "best", "--format", "zlab", "--out", str(tmp_path / "latest")]) == 0
    out = capsys.readouterr().out
    assert f"note: {bare} has no best/" in out and f"(step {STEPS})" in out


@pytest.mark.slow  # ~1 min of servers: nightly; the fallback rule itself is checked in the test above
@pytest.mark.e2e
def test_the_documented_eval_reads_best_of_the_two_process_run(two_process_run_with_real_tau, tmp_path, caplog):
    run = two_process_run_with_real_tau
    args = ["eval", "--config", "tiny", "--drafter", str(run), "--sets", "gsm8k", "--limit", "1",
            "--max-new-tokens", "8", "--no-progress"]
    assert main([*args, "--step", "best", "--out", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["headline"]["mismatches"] == 0
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("best"))
    assert main([*args[:4], str(bare), *args[5:], "--step", "best", "--out", str(tmp_path / "eval2")]) == 0
    assert "using its newest checkpoint" in caplog.text


def _params(drafter):
    from flax import nnx

    return nnx.state(drafter, nnx.Param)


@pytest.mark.parametrize(("env", "message"), [
    ({"JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS must be host:port of process 0"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID one in [0, JAX_NUM_PROCESSES)"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_ID": "0"}, "received '' and '0'"),
])
def test_inconsistent_distributed_environment_is_refused(monkeypatch, capsys, env, message):
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--config", "tiny"]) == 2
    assert message in capsys.readouterr().err


def _regenerate(data_dir: Path, devices: int, log: Path, replicas: int, **dist: str) -> subprocess.Popen:
    """`dflash data regenerate --config tiny` in the background (`_background`)."""
    return _background(["data", "regenerate", "--config", "tiny", f"data.dir={data_dir}", "data.max_prompts=6",
                        "data.regen.max_new_tokens=12", f"data.regen.replicas={replicas}"], devices, log, **dist)


@pytest.mark.slow  # ~40 s on 2 cores: nightly; test_data_regenerate's topology test (1 device, 4 replicas, two
@pytest.mark.e2e   # shares of 2 replicas merged) keeps the property in the default tier
def test_two_processes_of_two_devices_regenerate_what_one_device_does(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    procs = {f"multi{i}": _regenerate(tmp_path / "multi", 2, logs / f"multi{i}", 2, JAX_COORDINATOR_ADDRESS=address,
                                      JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)}
    procs["single"] = _regenerate(tmp_path / "single", 1, logs / "single", 1)
    texts = _wait(procs, logs)
    for i in range(2):
        out, err = texts[f"multi{i}"]
        assert f"process {i}/2" in err and "2 engine replica(s)" in err, err[-2000:]
        assert f"[process {i}/2] this process answers" in err, err[-2000:]
    single = (tmp_path / "single" / "regenerated.jsonl").read_bytes()
    assert single == (tmp_path / "multi" / "regenerated.jsonl").read_bytes()  # merged by process 0, sorted by id
    assert len(single.splitlines()) == 6 and not (tmp_path / "multi" / "regenerated.jsonl.parts").exists()


def _capture(data_dir: Path, devices: int, log: Path, replicas: int, **dist: str) -> subprocess.Popen:
    """`dflash data capture --config tiny` (8 rows, shards of 2) in the background (`_background`)."""
    return _background(["data", "capture", "--config", "tiny", f"data.dir={data_dir}", "data.max_examples=8",
                        "data.samples_per_shard=2", f"data.capture_replicas={replicas}", "--no-progress"],
                       devices, log, **dist)


@pytest.mark.slow  # ~40 s on 2 cores: nightly; test_data_pipeline's shares test (two shares of 2 replicas, then
@pytest.mark.e2e   # merged, equal to one device) and test_data_shards' replicas test keep the property
def test_two_processes_of_two_devices_capture_what_one_device_does(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    procs = {f"multi{i}": _capture(tmp_path / "multi", 2, logs / f"multi{i}", 2, JAX_COORDINATOR_ADDRESS=address,
                                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)) for i in range(2)}
    procs["single"] = _capture(tmp_path / "single", 1, logs / "single", 1)
    texts = _wait(procs, logs)
    for i in range(2):
        out, err = texts[f"multi{i}"]
        assert f"[process {i}/2] capture: 2 replica(s)" in err and f"shards i with i % 2 == {i}" in err, err[-2000:]
        assert "captured 2 shards (0 kept from an earlier run)" in out and "7 samples" in out, out
    single, multi = tmp_path / "single" / "shards", tmp_path / "multi" / "shards"
    one, both = (json.loads((d / "manifest.json").read_text()) for d in (single, multi))
    assert {**one, "created": {}} == {**both, "created": {}} and both["complete"] and both["num_shards"] == 4
    for entry in one["shards"]:
        assert (single / entry["file"]).read_bytes() == (multi / entry["file"]).read_bytes()
    assert not (multi / "parts").exists()
