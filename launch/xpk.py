"""`dflash launch xpk <stage>`: run a pipeline stage on a TPU slice of a GKE cluster as an xpk workload.

One Docker image (`docker/Dockerfile`: the locked dependency set plus jax[tpu]) serves every stage; each stage
is the same `dflash` entry point it is on one machine. What a workload is:

    xpk workload create --cluster C --workload W --tpu-type v5p-128 --num-slices N --docker-image IMAGE
        --command "dflash <stage> --config R train.run_dir=/gcs/B/run data.dir=/gcs/B/data ..."
        --env DFLASH_DISTRIBUTED=auto --env JAX_COMPILATION_CACHE_DIR=... [--env KEY=VALUE ...] --storage S
        --max-restarts R --termination-grace-period-seconds G

What the workload runs, its environment (`--env`, `--secret`), mounts and restart policy are `launch.pod.PodStage`'s,
shared with the Cluster Toolkit launcher (`launch.gcluster`).

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
- **One host or many**: `train` uses every host of every slice (one `jax.distributed` run); so does `regenerate`:
  every host answers its share of the prompts (by item id) with an engine replica per chip, and host 0 merges the
  shares (`data.scaleout`); `capture` too: every host captures its share of the shards into the shared data
  dir and host 0 writes the manifest; `eval` runs the engine on one host, so it needs a single-host slice
  (e.g. v5p-8).

`--dry-run` prints the xpk command and the workload (image, environment, command per worker, mounts) and runs
nothing; it needs neither xpk nor the network.

**The xpk it renders for**: xpk 1.16.0 (`tools/setup_xpk.sh` pins it; `XPK_VERSION`), whose argument parser
(`xpk/parser/workload.py`, `xpk/parser/storage.py`, `xpk/parser/common.py`) defines every flag rendered here and whose
TPU table (`xpk/core/system_characteristics.py`) reads `v5p-N` as N TensorCores (N/2 chips) on N/8 hosts of 4 chips,
and v5e / v6e names as chips on hosts of 4 chips (so `v6e-8` is 2 hosts there; a single-host stage uses `v6e-4`).
A launch (not a dry run) runs `xpk version` first and refuses an older xpk. Regeneration through an endpoint runs on
one CPU node, `--device-type MACHINE-1`, for a machine type xpk's table has (`XPK_CPU_TYPES`).
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
from dflash.launch.pod import (
    K8S_NAME,
    MOUNT_ROOT,
    STAGES,
    PodStage,
    SliceForm,
    check_cluster,
    check_tool_version,
    mask,
    mount_path,
    plural,
    split_gcs,
)
from dflash.launch.tpus import TpuType

ROOT = Path(__file__).resolve().parents[2]  # the repository: xpk's own venv lives beside .venv
XPK_VENV = ROOT / ".venv-xpk"
XPK_VERSION = (1, 16, 0)  # the oldest xpk whose parser and TPU table this module renders for (tools/setup_xpk.sh)
TOOL = "xpk " + ".".join(map(str, XPK_VERSION))
# xpk 1.16.0's TPU table (xpk/core/system_characteristics.py): chips per slice it has names for, per generation; a
# slice of more than one chip is on VMs of 4 chips.
XPK_TPU_CHIPS = {"v5p": (4, 8192), "v4": (4, 4096), "v5litepod": (8, 256), "v6e": (1, 256)}
XPK_NO_TPU_CHIPS = {"v6e": (2,)}  # inside the range above, no name
XPK_CPU_TYPES = ("n2-standard-4", "n2-standard-32", "n2-standard-64", "m1-megamem-96")  # its CPU types with one VM


@dataclasses.dataclass(frozen=True, kw_only=True)
class XpkLaunch(PodStage):
    """One stage (`PodStage`) as an xpk workload on GKE cluster `cluster`."""

    cluster: str
    workload: str = ""
    zone: str = ""
    spot: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cluster(self.cluster)
        if self.workload:
            require(bool(K8S_NAME.fullmatch(self.workload)) and len(self.workload) <= 40, "--workload", self.workload,
                    "be at most 40 lowercase letters, digits and '-', starting with a letter")

    @property
    def workload_name(self) -> str:
        """--workload, or `<recipe>-<stage>-<run dir's last part>-<hash>` made a valid name (at most 40 characters)."""
        return self.workload or self.default_name(40)

    def slice_form(self) -> SliceForm:
        """`--tpu-type NAME` as xpk 1.16.0 reads it, or `--device-type MACHINE-1` (one CPU VM) without a TPU."""
        if self.tpu is None:
            require(self.cpu_type in XPK_CPU_TYPES, "--cpu-type", self.cpu_type,
                    f"be a CPU machine type {TOOL} has one-VM device types for: {', '.join(XPK_CPU_TYPES)}")
            return SliceForm(("--device-type", f"{self.cpu_type}-1"), 1, 0, TOOL)
        return xpk_tpu_form(self.tpu)

    def storage_names(self) -> list[str]:
        return [storage_name(bucket) for bucket in self.buckets]

    def xpk_command(self, xpk: str = "xpk", *, hide: bool = False) -> list[str]:
        """The `xpk workload create` command line (`hide`: credentials' values hidden, for printing)."""
        cmd = [xpk, "workload", "create", "--cluster", self.cluster, "--workload", self.workload_name,
               *self.slice_form().flags, "--num-slices", str(self.num_slices), "--docker-image", self.image,
               "--command", shlex.join(self.worker_command()), "--max-restarts", str(self.max_restarts),
               "--termination-grace-period-seconds", str(self.grace_seconds), "--priority", self.priority]
        for key, value in self.worker_env().items():
            cmd += ["--env", f"{key}={mask(key, value) if hide else value}"]
        for name in self.storage_names():
            cmd += ["--storage", name]
        if self.project:
            cmd += ["--project", self.project]
        if self.zone:
            cmd += ["--zone", self.zone]
        if self.spot:
            cmd.append("--spot")
        return cmd

    def manifest_command(self, path: str, xpk: str = "xpk") -> list[str]:
        """xpk's own dry run of the workload, writing the JobSet it would apply to `path` (no cluster access)."""
        return [*self.xpk_command(xpk), "--dry-run", "--skip-validation", "--output-manifest-file", path]

    def storage_setup(self, xpk: str = "xpk") -> list[list[str]]:
        """The one-time `xpk storage attach` per bucket that mounts it at /gcs/<bucket> in every workload, read-write
        (one storage per bucket, whichever stage or run uses it; the target's bucket too)."""
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
        hosts = self.hosts
        where = (f"one {self.cpu_type} CPU node (no TPU: the stage only sends HTTP to data.regen.endpoint)"
                 if self.tpu is None else
                 f"{slices}{self.tpu.name} ({self.tpu.chips * self.num_slices} chips, {hosts} host"
                 f"{'s' if hosts > 1 else ''}, topology {self.tpu.topology})")
        lines = [
            f"# stage {self.stage} of recipe {self.recipe} on {where}; workload {self.workload_name} on cluster "
            f"{self.cluster}; rendered for {TOOL} or newer",
            "# xpk command:",
            shlex.join(self.xpk_command(xpk, hide=True)),
            "",
            *self.describe_workload({b: f"xpk storage {storage_name(b)}" for b in self.buckets}),
            "# one-time storage setup per cluster and bucket:",
            *[f"#   {shlex.join(cmd)}" for cmd in self.storage_setup(xpk)],
        ]
        return "\n".join(lines)


def storage_name(bucket: str) -> str:
    """The xpk storage that mounts `bucket`: `gcs-<bucket>` made a valid name."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"gcs-{bucket}".lower()).strip("-")
    return name[:40].rstrip("-")


def xpk_tpu_form(tpu: TpuType) -> SliceForm:
    """`--tpu-type NAME` and the chips and hosts xpk 1.16.0's table reads from it: N/cores-per-chip chips, on one VM
    for a one-chip slice, else on VMs of 4 chips; ConfigError for a name its table does not have."""
    low, high = XPK_TPU_CHIPS[tpu.gen.xpk]
    require(low <= tpu.chips <= high and tpu.chips not in XPK_NO_TPU_CHIPS.get(tpu.gen.xpk, ()), "--tpu-type",
            tpu.name, f"be a slice {TOOL} has a TPU type for ({tpu.gen.xpk}: {low} to {high} chips, "
            f"{tpu.gen.cores_per_chip * low} to {tpu.gen.cores_per_chip * high} in the name); {tpu.name} has "
            f"{plural(tpu.chips, 'chip')} (xpk/core/system_characteristics.py)")
    per_vm = 1 if tpu.chips == 1 else 4
    return SliceForm(("--tpu-type", tpu.name), tpu.chips // per_vm, tpu.chips, TOOL)


def find_xpk(explicit: str | None = None) -> str:
    """The xpk executable: `explicit`, $XPK, .venv-xpk/bin/xpk (tools/setup_xpk.sh), or `xpk` on PATH."""
    for candidate in (explicit, os.environ.get("XPK"), str(XPK_VENV / "bin" / "xpk")):
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("xpk")
    if found:
        return found
    raise ConfigError("xpk was not found: run tools/setup_xpk.sh (a separate venv in .venv-xpk), or pass --xpk PATH")


def launch(plan: XpkLaunch, *, dry_run: bool, xpk: str | None = None, manifest: str | None = None,
           notes: list[str] | tuple[str, ...] = ()) -> int:
    """Print the plan; unless `dry_run`, create the workload with xpk. `manifest`: also have xpk render the JobSet
    it would apply into that file (xpk's own --dry-run; needs xpk, --project and --zone, no cluster access)."""
    exe = find_xpk(xpk) if (not dry_run or manifest) else (xpk or "xpk")
    print(plan.describe(exe), flush=True)
    for note in notes:
        print(note, flush=True)
    if not dry_run or manifest:
        print(check_tool_version([exe, "version"], r"xpk_version:\s*v?(\d+)\.(\d+)\.(\d+)", XPK_VERSION, "xpk"),
              flush=True)
    if manifest:
        require(bool(plan.project and plan.zone), "--manifest", manifest,
                "come with --project and --zone (xpk asks gcloud for them otherwise)")
        done = subprocess.run(plan.manifest_command(manifest, exe), capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            return done.returncode
        print(f"# JobSet manifest written to {manifest}")
    if dry_run:
        return 0
    return subprocess.run(plan.xpk_command(exe)).returncode


__all__ = ["MOUNT_ROOT", "STAGES", "XPK_CPU_TYPES", "XPK_VERSION", "XpkLaunch", "find_xpk", "launch", "mount_path",
           "split_gcs", "storage_name", "xpk_tpu_form"]
