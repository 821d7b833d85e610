#!/usr/bin/env python3
"""Pod smoke run (issue 51 item 6): the documented pod path end to end at a small size, to run first on a new slice.

    1 image       build docker/Dockerfile (and push it, --pod)
    2 regenerate  the target's answers to --prompts prompts (100)
    3 train       --steps steps (50) on a multi-host slice, real τ every --eval-every steps (best/)
    4 kill        one worker mid-run (SIGTERM, what GKE sends a preempted pod): every worker must stop at one
                  checkpointed step with exit 42; the restarted run resumes from it
    5 eval        the best drafter on --eval-prompts prompts (8) against AR through the served engine
    6 export      the best drafter in the z-lab layout

--local (the default): CPU processes on this machine, the `tiny` recipe (the embedded SmolLM2 target). Steps 2-6 run
for real; the two "hosts" of step 3 are two `dflash train` processes joined by `jax.distributed` on localhost (one
CPU device each), and step 4 signals one of them as GKE would; step 1 runs only with --build (it needs Docker and
the network; skipped otherwise, and said so).

--pod xpk|gcluster: the same through `dflash launch` on a GKE cluster (--cluster, --run-dir gs://..., --image;
training on --slice, v5p-16 = 2 hosts, the other stages on --host-tpu), after `dflash launch compile` has checked the
train step fits that slice at --train-overrides; it waits for each JobSet with kubectl and kills a worker with
`kubectl delete pod` (SIGTERM). It has not run on a TPU yet: it prints every command before running it, and stops at
the first that fails.

Writes nothing outside --work (local) or --run-dir (pod); prints a summary table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash.eval.servers import free_port
from dflash.train.metrics import read_metrics
from dflash.train.preemption import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
DFLASH = [sys.executable, "-m", "dflash.launch.cli"]


def say(text: str) -> None:
    print(text, flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    say("$ " + shlex.join(cmd))
    done = subprocess.run(cmd, cwd=ROOT, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"pod_smoke: `{shlex.join(cmd[:4])} ...` exited {done.returncode}")
    return done


def metrics_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


# ---------------------------------------------------------------------------------------------------- local



def _workers(args: argparse.Namespace, train: list[str], logs: Path, tag: str) -> list[subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(args.hosts):
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
               "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(args.hosts), "JAX_PROCESS_ID": str(i)}
        with open(logs / f"{tag}-{i}.log", "w") as log:  # files: a full pipe would stall a collective
            procs.append(subprocess.Popen(train, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    say(f"$ {shlex.join(train)}   # x{args.hosts} processes, logs {logs}/{tag}-*.log")
    return procs


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    return [p.poll() for p in procs]


def local(args: argparse.Namespace) -> list[tuple[str, str]]:
    work = Path(args.work).resolve()
    logs, run_dir, data_dir = work / "logs", work / "run", work / "data"
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    if args.build:
        run(["docker", "build", "-f", "docker/Dockerfile", "-t", args.image, "."])
        results.append(("1 image", f"built {args.image}"))
    else:
        results.append(("1 image", "skipped (--build builds docker/Dockerfile here; needs Docker and the network)"))

    common = ["--config", args.config, "--no-progress", f"data.dir={data_dir}", f"train.run_dir={run_dir}"]
    run([*DFLASH, "data", "regenerate", *common, f"data.max_prompts={args.prompts}"])
    answers = sum(1 for _ in (data_dir / "regenerated.jsonl").open())
    results.append(("2 regenerate", f"{answers} answers in {data_dir / 'regenerated.jsonl'}"))

    train = [*DFLASH, "train", *common, "data.source=regenerated", f"train.steps={args.steps}",
             f"train.save_every={args.save_every}", f"train.eval_every={args.eval_every}", "train.eval_prompts=1",
             "train.eval_tokens=16", "train.batch_size=4", "train.log_every=1", "train.wandb=disabled"]
    procs = _workers(args, train, logs, "train")
    while all(p.poll() is None for p in procs) and max(metrics_steps(run_dir), default=0) < args.kill_at:
        time.sleep(0.2)
    say(f"# step {max(metrics_steps(run_dir), default=0)} logged: SIGTERM to worker {args.hosts - 1}")
    procs[-1].send_signal(signal.SIGTERM)
    codes = _wait_all(procs, 600)
    stopped = max(metrics_steps(run_dir), default=0)
    if all(c == PREEMPTED_EXIT_CODE for c in codes):
        results.append(("3 train", f"{args.hosts} processes, stopped at step {stopped} of {args.steps}"))
        results.append(("4 kill", f"SIGTERM to one worker: every worker checkpointed step {stopped} and exited 42"))
    else:  # what the JobSet does when a pod fails: stop the others, restart them all
        for p in procs:
            if p.poll() is None:
                p.kill()
        results.append(("3 train", f"{args.hosts} processes, {stopped} steps logged before the kill"))
        results.append(("4 kill", f"SIGTERM to one worker: exit codes {codes} (not all 42): the rest killed"))
    procs = _workers(args, train, logs, "resumed")
    codes = _wait_all(procs, 1800)
    text = (logs / "resumed-0.log").read_text()
    resumed = [line.split("from step")[-1].strip() for line in text.splitlines() if " from step " in line]
    steps = metrics_steps(run_dir)
    if codes != [0] * args.hosts or steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"pod_smoke: the restarted run exited {codes}; steps logged {steps[:3]}...{steps[-3:]}")
    best = json.loads((run_dir / "best" / "best.json").read_text())
    results[-1] = (results[-1][0], results[-1][1] + f"; restarted, resumed from step {resumed[-1] if resumed else '?'}"
                   f", finished {args.steps} steps (each logged once); best/ from step {best['step']}, τ "
                   f"{best['tau']:.2f}")

    run([*DFLASH, "eval", "--config", args.config, "--drafter", str(run_dir), "--step", "best", "--sets", "gsm8k",
         "--limit", str(args.eval_prompts), "--max-new-tokens", "32", "--out", str(work / "eval"), "--no-progress"])
    head = json.loads((work / "eval" / "results.json").read_text())["headline"]
    results.append(("5 eval", f"{args.eval_prompts} prompts: τ {head['tau']:.2f}, {head['mismatches']} replies "
                              f"differing from AR, DFlash/AR speed {head['speedup']:.2f}x"))
    shutil.rmtree(work / "export", ignore_errors=True)
    run([*DFLASH, "export", str(run_dir), "--step", "best", "--format", "zlab", "--out", str(work / "export")])
    results.append(("6 export", f"{work / 'export'}: {sorted(p.name for p in (work / 'export').iterdir())}"))
    return results


# ---------------------------------------------------------------------------------------------------- pod


def pod(args: argparse.Namespace) -> list[tuple[str, str]]:
    for flag in ("cluster", "run_dir", "image"):
        if not getattr(args, flag):
            raise SystemExit(f"pod_smoke --pod: --{flag.replace('_', '-')} is required")
    name_flag = "--workload" if args.pod == "xpk" else "--name"
    place = [*(["--project", args.project] if args.project else []), *(["--zone", args.zone] if args.zone else [])]
    common = ["--config", args.config, "--cluster", args.cluster, "--run-dir", args.run_dir, "--image", args.image,
              *place, *sum((["--env", e] for e in args.env), []), *sum((["--secret", s] for s in args.secret), [])]
    metrics = f"{args.run_dir.rstrip('/')}/metrics.jsonl"

    def launch(stage: str, tpu: str, name: str, *extra: str) -> None:
        run([*DFLASH, "launch", args.pod, stage, *common, "--tpu-type", tpu, name_flag, name, *extra])

    def wait(name: str) -> None:
        run(["kubectl", "wait", "--for=condition=Completed", f"jobset/{name}", f"--timeout={args.timeout}s"])

    def logged_steps() -> list[int]:
        done = subprocess.run(["gcloud", "storage", "cat", metrics], capture_output=True, text=True)
        lines = done.stdout.splitlines() if done.returncode == 0 else []
        return [json.loads(x)["step"] for x in lines if '"loss"' in x]

    results = []
    run(["docker", "build", "-f", "docker/Dockerfile", "-t", args.image, "."])
    run(["docker", "push", args.image])
    results.append(("1 image", f"built and pushed {args.image}"))
    launch("regenerate", args.host_tpu, "smoke-regen", f"data.max_prompts={args.prompts}")
    wait("smoke-regen")
    results.append(("2 regenerate", f"{args.prompts} prompts on {args.host_tpu}"))
    shapes = ["data.source=regenerated", f"train.steps={args.steps}", f"train.save_every={args.save_every}",
              f"train.eval_every={args.eval_every}", *args.train_overrides]
    run([*DFLASH, "launch", "compile", "--config", args.config, "--topology", args.slice, *shapes])  # exit 3: no fit
    launch("train", args.slice, "smoke-train", *shapes)
    while max(logged_steps(), default=0) < args.kill_at:
        time.sleep(30)
    pods = run(["kubectl", "get", "pods", "-l", "jobset.sigs.k8s.io/jobset-name=smoke-train", "-o", "name"],
               capture_output=True, text=True).stdout.split()
    run(["kubectl", "delete", pods[-1]])  # SIGTERM, as a preemption: every worker checkpoints one step, exit 42
    wait("smoke-train")
    steps = logged_steps()
    results.append(("3 train", f"{args.steps} steps on {args.slice}: {len(steps)} logged, last {max(steps or [0])}"))
    results.append(("4 kill", f"deleted {pods[-1]} after step {args.kill_at}; the JobSet restarted and finished"))
    launch("eval", args.host_tpu, "smoke-eval", "--args", f"--sets gsm8k --limit {args.eval_prompts}")
    wait("smoke-eval")
    results.append(("5 eval", f"{args.run_dir}/eval/report.md"))
    local_best = Path(args.work).resolve() / "best-copy"
    shutil.rmtree(local_best, ignore_errors=True)
    local_best.mkdir(parents=True)
    run(["gcloud", "storage", "cp", "-r", f"{args.run_dir.rstrip('/')}/best", str(local_best)])
    run([*DFLASH, "export", str(local_best), "--step", "best", "--config", args.config, "--format", "zlab",
         "--out", str(Path(args.work).resolve() / "export")])
    results.append(("6 export", str(Path(args.work).resolve() / "export")))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pod", choices=("xpk", "gcluster"), default=None, help="run on a cluster (default: --local)")
    p.add_argument("--local", action="store_true", help="CPU processes on this machine (the default)")
    p.add_argument("--config", default=None, help="recipe (default: tiny locally, qwen3_8b on a pod)")
    p.add_argument("--work", default="runs/pod-smoke", help="local working directory (default runs/pod-smoke)")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--kill-at", type=int, default=23, help="signal a worker once this step is logged (default 23)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--hosts", type=int, default=2, help="local processes standing in for hosts (default 2)")
    p.add_argument("--build", action="store_true", help="--local: also build the image (needs Docker, network)")
    p.add_argument("--image", default=os.environ.get("DFLASH_IMAGE", "dflash-tpu:smoke"))
    p.add_argument("--cluster", default="")
    p.add_argument("--run-dir", default="", help="--pod: gs://BUCKET/PATH")
    p.add_argument("--project", default="")
    p.add_argument("--zone", default="", help="--pod: zone (xpk) or location (gcluster)")
    p.add_argument("--slice", default="v5p-16", help="--pod: the multi-host training slice (default v5p-16, 2 hosts)")
    p.add_argument("--host-tpu", default="v5p-8", help="--pod: the one-host slice of the other stages")
    p.add_argument("--env", action="append", default=[], help="--pod: passed to dflash launch (repeatable)")
    p.add_argument("--secret", action="append", default=[], help="--pod: passed to dflash launch (repeatable)")
    p.add_argument("--timeout", type=int, default=7200, help="--pod: seconds to wait for each JobSet")
    p.add_argument("--train-overrides", nargs="*", default=["train.batch_size=8", "data.seq_len=1024",
                                                             "train.num_anchors=128"],
                   help="--pod: overrides of the train stage, checked first by `dflash launch compile` on --slice "
                   "(default: a small batch for the small slice)")
    args = p.parse_args(argv)
    args.config = args.config or ("qwen3_8b" if args.pod else "tiny")
    start = time.time()
    results = pod(args) if args.pod else local(args)
    say(f"\npod smoke ({'--pod ' + args.pod if args.pod else '--local'}, recipe {args.config}): "
        f"{time.time() - start:.0f} s")
    for step, text in results:
        say(f"  {step:<13} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
