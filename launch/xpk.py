"""`dflash launch xpk <stage>`: run a pipeline stage on a TPU slice of a GKE cluster as an xpk workload.

One Docker image (`docker/Dockerfile`: the locked dependency set plus jax[tpu]) serves every stage; each stage
is the same `dflash` entry point it is on one machine. What a workload is:

    xpk workload create --cluster C --workload W --tpu-type v5p-128 --num-slices N --docker-image IMAGE
        --command "dflash <stage> --config R --no-progress train.run_dir=/gcs/B/run data.dir=/gcs/B/data ..."
        --env DFLASH_DISTRIBUTED=auto --env JAX_COMPILATION_CACHE_DIR=... --storage S --max-restarts R

- **Every worker runs the same command.** `DFLASH_DISTRIBUTED=auto` makes `dflash` call
  `jax.distributed.initialize()` with no arguments, which on GKE TPU pods reads the coordinator, process count and
  id from the environment the TPU webhook and JobSet set (`TPU_WORKER_HOSTNAMES`, `TPU_WORKER_ID`,
  `MEGASCALE_*` across slices). Elsewhere `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`
  still work (`launch.cli._init_distributed`).
- **gs:// directories** are Cloud Storage buckets mounted in every pod with GCS FUSE by an xpk storage
  (`xpk storage attach NAME --type=gcsfuse ...`, once per cluster and bucket): `gs://B/path` is the local path
  `/gcs/B/path` there, which Orbax, Grain, ArrayRecord, metrics.jsonl and TensorBoard all write and read as
  files (docs/decisions.md D21 says why a mount and not gs:// URLs).
- **Preemption**: on SIGTERM `dflash train` checkpoints the step in flight and exits 42
  (`train.preemption.PREEMPTED_EXIT_CODE`), one of xpk's default restartable exit codes (with 127-255, the deaths by
  signal); the JobSet restarts the workload (`--max-restarts`) and `dflash train` resumes from the latest checkpoint
  in its run dir (bit-identical to an uninterrupted run). A config error (exit 2) or a NaN (exit 1) is not restarted.
- **One host or many**: `train` uses every host of every slice (one `jax.distributed` run); `regenerate`,
  `capture` and `eval` run the engine on one host, so they need a single-host slice (e.g. v5p-8).

`--dry-run` prints the xpk command and the workload (image, environment, command per worker, mounts) and runs
nothing; it needs neither xpk nor the network.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from dflash.configs.schema import ConfigError, require
from dflash.launch.pod import MULTI_HOST_STAGES, STAGES
from dflash.launch.tpus import TpuType

ROOT = Path(__file__).resolve().parents[2]  # the repository: xpk's own venv lives beside .venv
MOUNT_ROOT = "/gcs"
XPK_VENV = ROOT / ".venv-xpk"
DEFAULT_MAX_RESTARTS = 10
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # xpk's workload / storage names, at most 40 characters


@dataclasses.dataclass(frozen=True)
class XpkLaunch:
    """One stage as an xpk workload. `run_dir` / `data_dir` are gs:// URIs (`data_dir` default: run_dir/data)."""

    stage: str
    recipe: str
    cluster: str
    tpu: TpuType
    run_dir: str
    image: str
    num_slices: int = 1
    data_dir: str = ""
    overrides: tuple[str, ...] = ()
    stage_args: tuple[str, ...] = ()
    workload: str = ""
    project: str = ""
    zone: str = ""
    max_restarts: int = DEFAULT_MAX_RESTARTS
    priority: str = "medium"
    spot: bool = False

    def __post_init__(self) -> None:
        require(self.stage in STAGES, "stage", self.stage, f"be one of {list(STAGES)}")
        require(self.num_slices >= 1, "--num-slices", self.num_slices, "be >= 1")
        require(bool(_NAME.fullmatch(self.cluster)), "--cluster", self.cluster,
                "be a GKE cluster name (lowercase letters, digits and '-', starting with a letter)")
        for flag, uri in (("--run-dir", self.run_dir), ("--data-dir", self.data_dir)):
            if uri:
                split_gcs(uri, flag)
        require(self.max_restarts >= 0, "--max-restarts", self.max_restarts, "be >= 0")
        require(self.priority in ("very-low", "low", "medium", "high", "very-high"), "--priority", self.priority,
                "be one of very-low, low, medium, high, very-high")
        if self.stage not in MULTI_HOST_STAGES:
            require(self.tpu.hosts == 1 and self.num_slices == 1, "--tpu-type", self.tpu.name,
                    f"be a single-host slice for `{self.stage}` (it runs the engine on one host), e.g. "
                    f"{self.tpu.gen.xpk}-{self.tpu.gen.cores_per_chip * self.tpu.gen.chips_per_host}, with "
                    f"--num-slices 1; {self.tpu.name} has {self.tpu.hosts} hosts")
        if self.workload:
            require(bool(_NAME.fullmatch(self.workload)) and len(self.workload) <= 40, "--workload", self.workload,
                    "be at most 40 lowercase letters, digits and '-', starting with a letter")

    @property
    def workload_name(self) -> str:
        """--workload, or `<recipe>-<stage>-<run dir's last part>` made a valid name (at most 40 characters)."""
        if self.workload:
            return self.workload
        tail = self.run_dir.rstrip("/").rsplit("/", 1)[-1]
        name = re.sub(r"[^a-z0-9-]+", "-", f"{self.recipe}-{self.stage}-{tail}".lower()).strip("-")
        name = re.sub(r"-+", "-", name)
        name = name if name[:1].isalpha() else f"d-{name}"
        return name[:40].rstrip("-")

    @property
    def run_path(self) -> str:
        return mount_path(self.run_dir)

    @property
    def data_path(self) -> str:
        return mount_path(self.data_dir) if self.data_dir else f"{self.run_path}/data"

    @property
    def buckets(self) -> list[str]:
        found = [split_gcs(uri, "")[0] for uri in (self.run_dir, self.data_dir) if uri]
        return list(dict.fromkeys(found))

    def worker_command(self) -> list[str]:
        """The stage's `dflash` command, run by every worker of the workload (paths on the GCS FUSE mounts)."""
        paths = [f"train.run_dir={self.run_path}", f"data.dir={self.data_path}"]
        common = ["--config", self.recipe, "--no-progress"]
        if self.stage == "train":
            cmd = ["dflash", "train", *common]
        elif self.stage in ("regenerate", "capture"):
            cmd = ["dflash", "data", self.stage, *common]
        else:
            cmd = ["dflash", "eval", *common, "--drafter", self.run_path, "--step", "best",
                   "--out", f"{self.run_path}/eval"]
        return [*cmd, *self.stage_args, *paths, *self.overrides]

    def worker_env(self) -> dict[str, str]:
        """Environment of every worker: how `dflash` joins the distributed run, where compiled programs are
        cached between restarts, unbuffered logs."""
        return {
            "DFLASH_DISTRIBUTED": "auto",
            "JAX_COMPILATION_CACHE_DIR": f"{self.run_path}/jax_cache",
            "PYTHONUNBUFFERED": "1",
        }

    def storage_names(self) -> list[str]:
        return [storage_name(bucket) for bucket in self.buckets]

    def xpk_command(self, xpk: str = "xpk") -> list[str]:
        """The `xpk workload create` command line."""
        cmd = [xpk, "workload", "create", "--cluster", self.cluster, "--workload", self.workload_name,
               "--tpu-type", self.tpu.name, "--num-slices", str(self.num_slices), "--docker-image", self.image,
               "--command", shlex.join(self.worker_command()), "--max-restarts", str(self.max_restarts),
               "--priority", self.priority]
        for key, value in self.worker_env().items():
            cmd += ["--env", f"{key}={value}"]
        for name in self.storage_names():
            cmd += ["--storage", name]
        if self.project:
            cmd += ["--project", self.project]
        if self.zone:
            cmd += ["--zone", self.zone]
        if self.spot:
            cmd.append("--spot")
        return cmd

    def storage_setup(self, xpk: str = "xpk") -> list[list[str]]:
        """The one-time `xpk storage attach` per bucket that mounts it at /gcs/<bucket> in every workload."""
        out = []
        for bucket in self.buckets:
            cmd = [xpk, "storage", "attach", storage_name(bucket), "--type", "gcsfuse", "--bucket", bucket,
                   "--cluster", self.cluster, "--mount-point", f"{MOUNT_ROOT}/{bucket}", "--auto-mount", "false",
                   "--readonly", "false", "--size", "1000", "--mount-options", "implicit-dirs,rename-dir-limit=200000"]
            if self.project:
                cmd += ["--project", self.project]
            if self.zone:
                cmd += ["--zone", self.zone]
            out.append(cmd)
        return out

    def describe(self, xpk: str = "xpk") -> str:
        """What --dry-run prints: the xpk command, then the workload it creates."""
        slices = f"{self.num_slices} x " if self.num_slices > 1 else ""
        hosts = self.tpu.hosts * self.num_slices
        lines = [
            f"# stage {self.stage} of recipe {self.recipe} on {slices}{self.tpu.name} "
            f"({self.tpu.chips * self.num_slices} chips, {hosts} host{'s' if hosts > 1 else ''}, topology "
            f"{self.tpu.topology}); workload {self.workload_name} on cluster {self.cluster}",
            "# xpk command:",
            shlex.join(self.xpk_command(xpk)),
            "",
            f"# workload: {hosts} pod{'s' if hosts > 1 else ''} (one per host), image {self.image}, each running:",
            "#   " + shlex.join(self.worker_command()),
            "# environment:",
            *[f"#   {k}={v}" for k, v in self.worker_env().items()],
            "# storage (GCS FUSE mounts):",
            *[f"#   gs://{b} -> {MOUNT_ROOT}/{b} (xpk storage {storage_name(b)})" for b in self.buckets],
            f"# restarts: up to {self.max_restarts} (preemption: the stage resumes from {self.run_dir})",
            "# one-time storage setup per cluster and bucket:",
            *[f"#   {shlex.join(cmd)}" for cmd in self.storage_setup(xpk)],
        ]
        return "\n".join(lines)


def split_gcs(uri: str, flag: str) -> tuple[str, str]:
    """('bucket', 'path') of gs://bucket/path; ConfigError naming `flag` otherwise."""
    m = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/.*)?", uri.rstrip("/"))
    if m is None:
        raise ConfigError(f"{flag or 'a directory'} must be a gs://BUCKET/PATH Cloud Storage URI (pods read and "
                          f"write it through a GCS FUSE mount); received {uri!r}")
    return m.group(1), (m.group(2) or "").lstrip("/")


def mount_path(uri: str) -> str:
    """gs://bucket/path -> /gcs/bucket/path (where the xpk storage mounts the bucket in every pod)."""
    bucket, path = split_gcs(uri, "")
    return f"{MOUNT_ROOT}/{bucket}" + (f"/{path}" if path else "")


def storage_name(bucket: str) -> str:
    """The xpk storage that mounts `bucket`: `gcs-<bucket>` made a valid name."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"gcs-{bucket}".lower()).strip("-")
    return name[:40].rstrip("-")


def find_xpk(explicit: str | None = None) -> str:
    """The xpk executable: `explicit`, $XPK, .venv-xpk/bin/xpk (tools/setup_xpk.sh), or `xpk` on PATH."""
    for candidate in (explicit, os.environ.get("XPK"), str(XPK_VENV / "bin" / "xpk")):
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("xpk")
    if found:
        return found
    raise ConfigError("xpk was not found: run tools/setup_xpk.sh (a separate venv in .venv-xpk), or pass --xpk PATH")


def launch(plan: XpkLaunch, *, dry_run: bool, xpk: str | None = None, manifest: str | None = None) -> int:
    """Print the plan; unless `dry_run`, create the workload with xpk. `manifest`: also have xpk render the JobSet
    it would apply into that file (xpk's own --dry-run; needs xpk, --project and --zone, no cluster access)."""
    exe = find_xpk(xpk) if (not dry_run or manifest) else (xpk or "xpk")
    print(plan.describe(exe), flush=True)
    if manifest:
        require(bool(plan.project and plan.zone), "--manifest", manifest,
                "come with --project and --zone (xpk asks gcloud for them otherwise)")
        cmd = [*plan.xpk_command(exe), "--dry-run", "--skip-validation", "--output-manifest-file", manifest]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            return done.returncode
        print(f"# JobSet manifest written to {manifest}")
    if dry_run:
        return 0
    return subprocess.run(plan.xpk_command(exe)).returncode


__all__ = ["MOUNT_ROOT", "STAGES", "XpkLaunch", "find_xpk", "launch", "mount_path", "split_gcs", "storage_name"]
