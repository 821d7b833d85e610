"""The pod rehearsal (tools/pod_smoke.py --local, issue 58): regenerate, capture, train (one worker SIGTERMed mid-run
and the run restarted), eval and export on 2 processes x 4 CPU devices joined by `jax.distributed`, on the tiny
Qwen3-MoE target laid out as the `qwen3_30b_a3b` pod recipe (train mesh data 1 x fsdp 2 x tensor 4, a regeneration
replica per device, a capture replica per host's 4 devices, its chat-template variables). Every stage prints what
each host's devices hold (`memory per device`), and every output is where the next stage and the user look."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.heavy, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "DFLASH_DISTRIBUTED", "XLA_FLAGS")
MEMORY = r"memory per device: max \d+\.\d+ (GiB|MiB) \(device \d+\), min \d+\.\d+ (GiB|MiB) \(device \d+\)"
PROMPTS, STEPS, KILL_AT, EVAL_PROMPTS = 24, 8, 3, 2


@pytest.mark.slow  # minutes of 2-process runs: nightly. Each piece stays in the default tier: test_target_families (a
# MoE target's sharded forward, engine and z-lab layout), test_placement (4-device memory bounds of every stage),
# test_multiprocess (2-process training), test_train_resume (SIGTERM then resume), test_launch_pods (the launchers)
def test_the_pod_rehearsal_runs_every_stage_on_two_processes_of_four_devices(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "pod_smoke.py"), "--work", str(tmp_path),
                           "--prompts", str(PROMPTS), "--steps", str(STEPS), "--save-every", "2", "--eval-every", "4",
                           "--kill-at", str(KILL_AT), "--eval-prompts", str(EVAL_PROMPTS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-4000:]

    # every stage printed each host's memory line (the eval's server runs on one host)
    for stage, hosts in (("regenerate", 2), ("capture", 2), ("train", 2), ("eval", 1)):
        for host in range(hosts):
            assert re.search(rf"^# {stage}, host {host}: .*(regenerate|capture|train|serve): {MEMORY}", out,
                             re.MULTILINE), (stage, host, out[-4000:])
    # the recipe's layout reached each stage: the train mesh, 4 regeneration replicas and 1 capture replica a host
    logs = tmp_path / "logs"
    train_log = (logs / "train-0.log").read_text()
    assert "train mesh data=1 x fsdp=2 x tensor=4 over 8 devices of 2 process(es)" in train_log, train_log[-3000:]
    assert "regeneration: 4 engine replica(s)" in (logs / "regenerate-1.log").read_text()
    assert "[process 1/2] capture: 1 replica(s)" in (logs / "capture-1.log").read_text()
    assert 'chat template variables {"enable_thinking": false}' in (logs / "eval-0.log").read_text()

    # the outputs: regenerated data, capture shards, checkpoints and best/, eval results, the export
    data = tmp_path / "data"
    errors = data / "regenerated.jsonl.errors.jsonl"
    answered = len((data / "regenerated.jsonl").read_text().splitlines())
    assert answered > 0 and answered + (len(errors.read_text().splitlines()) if errors.is_file() else 0) == PROMPTS
    manifest = json.loads((data / "shards" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["num_shards"] >= 2
    assert all((data / "shards" / s["file"]).is_file() for s in manifest["shards"])
    run = tmp_path / "run"
    assert str(STEPS) in {p.name for p in (run / "checkpoints").iterdir()}
    assert json.loads((run / "best" / "best.json").read_text())["step"] in (4, STEPS)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["headline"]["mismatches"] == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "export").iterdir()}

    # the SIGTERM: every worker stopped at one checkpointed step with exit 42, and the restart resumed from it
    kill = next(line for line in out.splitlines() if line.strip().startswith("5 kill"))
    stopped = re.search(r"every worker checkpointed step (\d+) and exited 42; restarted, resumed from step (\d+)", kill)
    assert stopped and stopped.group(1) == stopped.group(2) and KILL_AT <= int(stopped.group(1)) < STEPS, kill
    assert re.search(r"^pod smoke \(--local, recipe tiny\): \d+ s$", out, re.MULTILINE)
    print(out[out.index("\npod smoke ("):])  # the summary table, with the wall time (pytest -s shows it)
