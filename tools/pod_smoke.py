#!/usr/bin/env python3
"""Pod smoke run (issue 51 item 6) and pod rehearsal (issue 58): the documented pod path end to end at a small size,
to run first on a new slice, and here before that.

    1 image       build docker/Dockerfile (and push it, --pod)
    2 regenerate  the target's answers to --prompts prompts (100)
    3 capture     (--local) the target's features of those answers, every host its shards
    4 train       --steps steps (50) on a multi-host slice, real τ every --eval-every steps (best/)
    5 kill        one worker mid-run (SIGTERM, what GKE sends a preempted pod): every worker must stop at one
                  checkpointed step with exit 42; the restarted run resumes from it
    6 eval        the best drafter on --eval-prompts prompts (8) against AR through the served engine
    7 export      the best drafter in the z-lab layout

--local (the default), the rehearsal: --hosts CPU processes (2) of --devices CPU devices each (4), joined by
`jax.distributed` on localhost, stand in for the slice's hosts and chips. The target is a tiny Qwen3-MoE
(tools/tiny_moe.py: 4 layers, 8 experts) and the recipe `tiny` laid out as the pod recipe --like (qwen3_30b_a3b):
its train mesh axes (data 1 x fsdp -1 x tensor 4: fsdp 2 x tensor 4 over the 8 devices), its regeneration and
capture replica sizes (1 device per regeneration replica, a host's 4 per capture replica), its feature mode and its
chat-template variables. Steps 2-7 run for real: regeneration, capture and training on every process, the kill a
SIGTERM to one of them as GKE would, the eval on one host's devices (`dflash eval --devices 0`: the server over all
of them, as the recipe serves), the export. Each stage's `memory per device` line (what every device holds before
its first step) is printed for every host. Step 1 runs only with --build (it needs Docker and the network; skipped
otherwise, and said so).

--pod xpk|gcluster: the same through `dflash launch` on a GKE cluster (--cluster, --run-dir gs://..., --image;
training on --slice, v5p-16 = 2 hosts, the other stages on --host-tpu), after `dflash launch compile` has checked the
train step fits that slice at --train-overrides; it waits for each JobSet with kubectl and kills a worker with
`kubectl delete pod` (SIGTERM). It has not run on a TPU yet: it prints every command before running it, and stops at
the first that fails (no capture: the pod recipes train online).

Writes nothing outside --work (local) or --run-dir (pod); prints a summary table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools.tiny_moe, run as a script

from dflash.eval.servers import free_port  # noqa: E402
from dflash.train.metrics import read_metrics  # noqa: E402
from dflash.train.preemption import PREEMPTED_EXIT_CODE  # noqa: E402
from tools.tiny_moe import MASK_TOKEN_ID, tiny_moe_dir  # noqa: E402

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

MEMORY = "memory per device"


def rehearsal_overrides(like: str, target: Path, devices: int) -> list[str]:
    """The `tiny` recipe on the tiny MoE `target` (tools/tiny_moe.py) with the pod recipe `like`'s layout: its train
    mesh axes, regeneration and capture replica sizes (and as many replicas as a host of `devices` holds, as on a
    TPU host; on CPU devices the default is one), feature mode and chat-template variables."""
    from dflash.configs.recipe import load_recipe

    pod = load_recipe(like)
    mesh, data = pod.train.mesh, pod.data
    regen, capture = data.regen.devices_per_replica, data.capture_devices_per_replica
    return [f"target.source={target}", "target.max_seq_len=128", "data.regen.max_len=128",  # fewer engine shapes
            f"drafter.mask_token_id={MASK_TOKEN_ID}", "drafter.block_size=4",
            "drafter.layer_ids=[0,2]", f"train.mesh.data={mesh.data}", f"train.mesh.fsdp={mesh.fsdp}",
            f"train.mesh.tensor={mesh.tensor}", f"data.features={data.features}",
            f"data.regen.devices_per_replica={regen}", f"data.regen.replicas={max(devices // regen, 1)}",
            f"data.capture_devices_per_replica={capture}", f"data.capture_replicas={max(devices // capture, 1)}",
            f"data.regen.template_kwargs={json.dumps(data.regen.template_kwargs)}"]


def _env(args: argparse.Namespace, work: Path, address: str = "", index: int = 0) -> dict[str, str]:
    """A local "host": `args.devices` CPU devices, joined to the others by `jax.distributed` on `address`; compiled
    programs cached under `work` as the pods cache them under the run dir (a restart compiles nothing again)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                                                            "JAX_PROCESS_ID", "DFLASH_DISTRIBUTED")}
    env |= {"XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}", "JAX_PLATFORMS": "cpu"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(work / "jax_cache"))
    if address:
        env |= {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(args.hosts), "JAX_PROCESS_ID": str(index)}
    return env


def _workers(args: argparse.Namespace, cmd: list[str], work: Path, tag: str) -> list[subprocess.Popen]:
    """`cmd` on `args.hosts` processes of `args.devices` CPU devices each, one `jax.distributed` run; logs in
    work/logs/TAG-i.log."""
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(args.hosts):
        with open(work / "logs" / f"{tag}-{i}.log", "w") as log:  # files: a full pipe would stall a collective
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(args, work, address, i), stdout=log,
                                          stderr=subprocess.STDOUT))
    say(f"$ {shlex.join(cmd)}   # x{args.hosts} processes of {args.devices} devices, logs {work}/logs/{tag}-*.log")
    return procs


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    return [p.poll() for p in procs]


def _finish(procs: list[subprocess.Popen], logs: list[Path], what: str, timeout: float = 1800) -> None:
    """Wait for every process; any exit but 0 stops the rehearsal with the failing log's tail (the others killed)."""
    codes = _wait_all(procs, timeout)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if codes != [0] * len(procs):
        bad = next(i for i, c in enumerate(codes) if c != 0)
        raise SystemExit(f"pod_smoke: {what} exited {codes}; {logs[bad]}:\n{logs[bad].read_text()[-3000:]}")


def memory_lines(log: Path) -> list[str]:
    """The `[process i/n] STAGE: memory per device: ...` lines a log holds, without the logger's prefix."""
    text = log.read_text() if log.is_file() else ""
    return [m.group(0) for m in re.finditer(r"(\[process \d+/\d+\] )?[\w-]+: " + MEMORY + r": [^\n]*", text)]


def _memory(stage: str, logs: list[Path]) -> str:
    """Print each log's memory line and return them for the summary (the rehearsal fails without one)."""
    found = []
    for i, log in enumerate(logs):
        lines = memory_lines(log)
        if not lines:
            raise SystemExit(f"pod_smoke: {stage} logged no '{MEMORY}' line in {log}")
        for line in lines:
            say(f"# {stage}, host {i}: {line}")
        found.append(f"host {i}: {lines[0].split(MEMORY + ': ')[-1]}")
    return "; ".join(found)


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

    target = work / "target"
    shutil.rmtree(target, ignore_errors=True)
    tiny_moe_dir("qwen3_moe", target)
    overrides = rehearsal_overrides(args.like, target, args.devices)
    say(f"# the tiny Qwen3-MoE target in {target}, laid out as {args.like}: {shlex.join(overrides[6:])}")
    common = ["--config", args.config, "--no-progress", f"data.dir={data_dir}", f"train.run_dir={run_dir}", *overrides]

    def stage_logs(tag: str) -> list[Path]:
        return [logs / f"{tag}-{i}.log" for i in range(args.hosts)]

    regen = [*DFLASH, "data", "regenerate", *common, f"data.max_prompts={args.prompts}"]
    _finish(_workers(args, regen, work, "regenerate"), stage_logs("regenerate"), "regeneration")
    answers = sum(1 for _ in (data_dir / "regenerated.jsonl").open())
    results.append(("2 regenerate", f"{answers} answers in {data_dir / 'regenerated.jsonl'}; memory per device "
                                    f"{_memory('regenerate', stage_logs('regenerate'))}"))

    capture = [*DFLASH, "data", "capture", *common, "data.source=regenerated", f"data.max_examples={args.prompts}"]
    _finish(_workers(args, capture, work, "capture"), stage_logs("capture"), "capture")
    manifest = json.loads((data_dir / "shards" / "manifest.json").read_text())
    memory = _memory("capture", stage_logs("capture"))
    results.append(("3 capture", f"{manifest['num_shards']} shards, {manifest['num_samples']} samples in "
                                 f"{data_dir / 'shards'}; memory per device {memory}"))

    train = [*DFLASH, "train", *common, "data.source=regenerated", f"train.steps={args.steps}",
             f"train.save_every={args.save_every}", f"train.eval_every={args.eval_every}", "train.eval_prompts=1",
             "train.eval_tokens=16", "train.eval_sets=[gsm8k]", "train.batch_size=4", "train.log_every=1",
             "train.wandb=disabled"]
    procs = _workers(args, train, work, "train")
    if args.kill_at:
        while all(p.poll() is None for p in procs) and max(metrics_steps(run_dir), default=0) < args.kill_at:
            time.sleep(0.2)
        say(f"# step {max(metrics_steps(run_dir), default=0)} logged: SIGTERM to worker {args.hosts - 1}")
        procs[-1].send_signal(signal.SIGTERM)
        codes = _wait_all(procs, 600)
        stopped = max(metrics_steps(run_dir), default=0)
        if all(c == PREEMPTED_EXIT_CODE for c in codes):
            kill = f"SIGTERM to one worker: every worker checkpointed step {stopped} and exited 42"
        else:  # what the JobSet does when a pod fails: stop the others, restart them all
            for p in procs:
                if p.poll() is None:
                    p.kill()
            kill = f"SIGTERM to one worker: exit codes {codes} (not all 42): the rest killed"
        memory = _memory("train", stage_logs("train"))
        procs = _workers(args, train, work, "resumed")
        _finish(procs, stage_logs("resumed"), "the restarted training")
        text = stage_logs("resumed")[0].read_text()
        resumed = [line.split("from step")[-1].strip() for line in text.splitlines() if " from step " in line]
        kill += f"; restarted, resumed from step {resumed[-1] if resumed else '?'}"
    else:
        _finish(procs, stage_logs("train"), "training")
        memory, kill = _memory("train", stage_logs("train")), "skipped (--kill-at 0)"
    steps = metrics_steps(run_dir)
    if steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"pod_smoke: training logged steps {steps[:3]}...{steps[-3:]}, not 1..{args.steps} once each")
    best = json.loads((run_dir / "best" / "best.json").read_text())
    results.append(("4 train", f"{args.hosts} processes x {args.devices} devices, {args.steps} steps (each logged "
                               f"once); best/ from step {best['step']}, τ {best['tau']:.2f}; memory per device "
                               f"{memory}"))
    results.append(("5 kill", kill))

    shutil.rmtree(work / "eval", ignore_errors=True)
    evaluate = [*DFLASH, "eval", *common, "--drafter", str(run_dir), "--step", "best", "--devices", "0", "--sets",
                "gsm8k", "--limit", str(args.eval_prompts), "--max-new-tokens", "32", "--out", str(work / "eval")]
    with open(logs / "eval-0.log", "w") as log:
        say(f"$ {shlex.join(evaluate)}   # one host of {args.devices} devices, log {logs}/eval-0.log")
        done = subprocess.run(evaluate, cwd=ROOT, env=_env(args, work), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"pod_smoke: eval exited {done.returncode}; {logs / 'eval-0.log'}:\n"
                         f"{(logs / 'eval-0.log').read_text()[-3000:]}")
    head = json.loads((work / "eval" / "results.json").read_text())["headline"]
    results.append(("6 eval", f"{args.eval_prompts} prompts over the host's {args.devices} devices: τ "
                              f"{head['tau']:.2f}, {head['mismatches']} replies differing from AR, DFlash/AR speed "
                              f"{head['speedup']:.2f}x; memory per device (the server) "
                              f"{_memory('eval', [work / 'eval' / 'server.log'])}"))
    shutil.rmtree(work / "export", ignore_errors=True)
    run([*DFLASH, "export", str(run_dir), "--step", "best", "--format", "zlab", "--out", str(work / "export")])
    results.append(("7 export", f"{work / 'export'}: {sorted(p.name for p in (work / 'export').iterdir())} (the "
                                "drafter alone: no target read, no memory line)"))
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
    results.append(("3 capture", "skipped: the pod recipes train online (the rehearsal, --local, runs it)"))
    results.append(("4 train", f"{args.steps} steps on {args.slice}: {len(steps)} logged, last {max(steps or [0])}"))
    results.append(("5 kill", f"deleted {pods[-1]} after step {args.kill_at}; the JobSet restarted and finished"))
    launch("eval", args.host_tpu, "smoke-eval", "--args", f"--sets gsm8k --limit {args.eval_prompts}")
    wait("smoke-eval")
    results.append(("6 eval", f"{args.run_dir}/eval/report.md"))
    local_best = Path(args.work).resolve() / "best-copy"
    shutil.rmtree(local_best, ignore_errors=True)
    local_best.mkdir(parents=True)
    run(["gcloud", "storage", "cp", "-r", f"{args.run_dir.rstrip('/')}/best", str(local_best)])
    run([*DFLASH, "export", str(local_best), "--step", "best", "--config", args.config, "--format", "zlab",
         "--out", str(Path(args.work).resolve() / "export")])
    results.append(("7 export", str(Path(args.work).resolve() / "export")))
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
    p.add_argument("--kill-at", type=int, default=23,
                   help="signal a worker once this step is logged (default 23; 0 --local: no kill)")
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--hosts", type=int, default=2, help="--local: processes standing in for hosts (default 2)")
    p.add_argument("--devices", type=int, default=4, help="--local: CPU devices of each process (default 4)")
    p.add_argument("--like", default="qwen3_30b_a3b",
                   help="--local: the pod recipe whose mesh axes, replica sizes and template variables the rehearsal "
                   "takes (default qwen3_30b_a3b)")
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
