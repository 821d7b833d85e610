"""`dflash launch gcluster <stage>`: a pipeline stage on a TPU slice of a GKE cluster as a Cluster Toolkit job
(`gcluster job submit`, which deploys a Kubernetes JobSet with Kueue), beside `dflash launch xpk` (xpk, which Google
is deprecating in favour of Cluster Toolkit). Both render the same `launch.pod.PodStage`: image, command, environment,
mounts and restart policy; docs/pods.md has the flag mapping.

    gcluster job submit --cluster C --location L [--project P] --name NAME --image IMAGE
        --compute-type ct5p-hightpu-4t --topology 2x4x4
        --command "exec env DFLASH_DISTRIBUTED=auto ... KEY=VALUE dflash <stage> --config R train.run_dir=/gcs/B/..."
        --restarts R --restart-on-exit-codes 42,134,137,139,143 --grace-period 300s --priority medium
        --mount gs://B:/gcs/B:rw

**The Cluster Toolkit it renders for**: v1.95.0 (`GCLUSTER_VERSION`), read from its source: the job submit flags
(`cmd/job/submit.go`, and `--cluster`, `--location`, `--project` of `cmd/job/job.go`) and the TPU table
(`pkg/config/hardware.go`, used by `pkg/orchestrator/gke/gke_job_orchestrator.go` and `resource_resolver.go`). There:

- `--compute-type v5p-N` counts *chips* (`parseShorthand`), where xpk and Cloud TPU count TensorCores: `v5p-64` would
  be 64 chips on 16 hosts, not the 32 chips on 8 hosts dflash plans. So the slice is rendered as the GCE machine type
  of its hosts and an explicit topology (`--compute-type ct5p-hightpu-4t --topology 2x4x4`): the job gets
  topology-product / chips-per-VM nodes (`CalculateAcceleratorNodes`), which is the plan's host count. A slice whose
  machine type or topology that version does not take (`ValidateHardwareRequest`: e.g. a 2-chip slice) is refused.
- `gcluster job submit` has no `--env`, and runs `--command` as `/bin/bash -c COMMAND`
  (`pkg/orchestrator/gke/manifest_generator.go`): the environment is passed in the command, `exec env K=V ... dflash
  ...`, so `dflash` replaces the shell and receives the pod's SIGTERM itself (preemption checkpoints). The values
  sit in the JobSet as xpk's `--env` values do; `--secret` passes only references.
- `--name` is at most 28 characters; `--mount SRC:DEST[:MODE]` mounts a gs:// bucket with the GCS FUSE CSI driver
  (MODE `ro` by default, so `rw` is given for the run's buckets); `--restart-on-exit-codes` lists the codes that
  restart the JobSet, any other one fails it; `--grace-period` is the pod's termination grace period.
- A Cluster Toolkit job has no multislice environment (MEGASCALE_*) in its JobSet: `--num-slices` above 1 is refused
  here (use `dflash launch xpk`); spot capacity is a property of the cluster's node pool, not of the job.
- Regeneration through an endpoint runs on one CPU node: `--compute-type MACHINE` (a GCE machine type the cluster
  has a node pool of).

A launch (not a dry run) runs `gcluster --version` first and refuses a version older than GCLUSTER_VERSION (one whose
version it cannot read is launched with a note).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from dflash.configs.schema import ConfigError, require
from dflash.launch.pod import (
    K8S_NAME,
    MOUNT_ROOT,
    RESTART_EXIT_CODES,
    PodStage,
    SliceForm,
    check_cluster,
    check_tool_version,
    mask,
    plural,
)
from dflash.launch.tpus import TpuType

MAX_NAME = 28  # gcluster job submit refuses longer workload names
GCLUSTER_VERSION = (1, 95, 0)  # the Cluster Toolkit whose source the flags and the TPU reading below follow
TOOL = "Cluster Toolkit v" + ".".join(map(str, GCLUSTER_VERSION))
# pkg/config/hardware.go (v1.95.0): the TPU hosts' GCE machine types by generation (chips per VM in the `-Nt` suffix,
# AcceleratorShorthandMap's values), the topologies it takes for 2D generations, and for 3D ones the common shapes,
# besides which a 3D topology must have sides that are multiples of 4, non-decreasing, within a cube limit.
MACHINE_FAMILY = {"v5p": "ct5p-hightpu", "v4": "ct4p-hightpu", "v5litepod": "ct5lp-hightpu", "v6e": "ct6e-standard"}
MACHINE_TYPES = ("ct4p-hightpu-4t", "ct5p-hightpu-1t", "ct5p-hightpu-2t", "ct5p-hightpu-4t", "ct5lp-hightpu-1t",
                 "ct5lp-hightpu-4t", "ct5lp-hightpu-8t", "ct6e-standard-1t", "ct6e-standard-4t", "ct6e-standard-8t")
TOPOLOGIES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
TOPOLOGIES_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16", "8x16x16")
MAX_CUBES = {"ct4p": 64, "ct5p": 140}  # 4x4x4 cubes per slice


def gcluster_tpu_form(tpu: TpuType) -> SliceForm:
    """`--compute-type MACHINE --topology AxBxC` for `tpu` and the chips and nodes Cluster Toolkit v1.95.0 makes of
    them; ConfigError for a slice whose machine type or topology it does not take."""
    per_vm = tpu.chips if tpu.hosts == 1 else tpu.gen.chips_per_host
    machine, topology = f"{MACHINE_FAMILY[tpu.gen.xpk]}-{per_vm}t", tpu.topology
    sides = [int(d) for d in topology.split("x")]
    if len(sides) == 2:
        taken = topology in TOPOLOGIES_2D
    else:
        cubes = (sides[0] // 4) * (sides[1] // 4) * (sides[2] // 4)
        taken = topology in TOPOLOGIES_3D or (all(d >= 4 and d % 4 == 0 for d in sides) and sides == sorted(sides)
                                              and cubes <= MAX_CUBES[machine.split("-")[0]])
    require(machine in MACHINE_TYPES and taken, "--tpu-type", tpu.name,
            f"be a slice {TOOL} can request: {tpu.name} ({plural(tpu.chips, 'chip')}, topology {topology}, hosts "
            f"of machine type {machine}) is not one its TPU table takes (pkg/config/hardware.go)")
    return SliceForm(("--compute-type", machine, "--topology", topology), tpu.chips // per_vm, tpu.chips, TOOL)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GclusterLaunch(PodStage):
    """One stage (`PodStage`) as a Cluster Toolkit job on GKE cluster `cluster` in `location` (a zone or region)."""

    cluster: str
    name: str = ""
    location: str = ""
    service_account: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cluster(self.cluster)
        if self.name:
            require(bool(K8S_NAME.fullmatch(self.name)) and len(self.name) <= MAX_NAME, "--name", self.name,
                    f"be at most {MAX_NAME} lowercase letters, digits and '-', starting with a letter "
                    "(gcluster job submit's limit)")
        if self.service_account:
            require(bool(K8S_NAME.fullmatch(self.service_account)), "--service-account", self.service_account,
                    "be a Kubernetes service account name (lowercase letters, digits and '-')")
        require(self.num_slices == 1, "--num-slices", self.num_slices,
                "be 1 with gcluster (its JobSet sets no multislice MEGASCALE_* environment); use dflash launch xpk "
                "for several slices")

    @property
    def job_name(self) -> str:
        """--name, or `<recipe>-<stage>-<run dir's last part>-<hash>` made a valid name of at most 28 characters."""
        return self.name or self.default_name(MAX_NAME)

    def slice_form(self) -> SliceForm:
        """The slice as Cluster Toolkit v1.95.0 reads it (`gcluster_tpu_form`); a CPU machine type without a TPU."""
        if self.tpu is None:
            return SliceForm(("--compute-type", self.cpu_type), 1, 0, TOOL)
        return gcluster_tpu_form(self.tpu)

    def mounts(self) -> list[str]:
        """`--mount` values: every bucket at /gcs/<bucket> (GCS FUSE), read-write but the target's alone (`ro`)."""
        return [f"gs://{b}:{MOUNT_ROOT}/{b}:{'ro' if self.read_only(b) else 'rw'}" for b in self.buckets]

    def command(self, *, hide: bool = False) -> str:
        """`--command`: `exec env KEY=VALUE ... dflash ...` (gcluster has no --env; bash runs the command and exec
        makes `dflash` the process that gets the pod's SIGTERM). `hide`: credentials' values hidden."""
        env = [f"{k}={mask(k, v) if hide else v}" for k, v in self.worker_env().items()]
        return shlex.join(["exec", "env", *env, *self.worker_command()])

    def gcluster_command(self, gcluster: str = "gcluster", *, hide: bool = False) -> list[str]:
        """The `gcluster job submit` command line (`hide`: credentials' values hidden, for printing)."""
        cmd = [gcluster, "job", "submit", "--cluster", self.cluster]
        if self.location:
            cmd += ["--location", self.location]
        if self.project:
            cmd += ["--project", self.project]
        cmd += ["--name", self.job_name, "--image", self.image, *self.slice_form().flags,
                "--command", self.command(hide=hide), "--restarts", str(self.max_restarts),
                "--restart-on-exit-codes", ",".join(map(str, RESTART_EXIT_CODES)),
                "--grace-period", f"{self.grace_seconds}s", "--priority", self.priority]
        for mount in self.mounts():
            cmd += ["--mount", mount]
        if self.service_account:
            cmd += ["--service-account", self.service_account]
        return cmd

    def manifest_command(self, path: str, gcluster: str = "gcluster") -> list[str]:
        """The job submission that writes the JobSet to `path` instead of applying it (`--dry-run-out`)."""
        return [*self.gcluster_command(gcluster), "--dry-run-out", path]

    def describe(self, gcluster: str = "gcluster") -> str:
        """What --dry-run prints: the gcluster command, then the job it submits."""
        hosts, form = self.hosts, self.slice_form()
        where = (f"one {self.cpu_type} CPU node (no TPU: the stage only sends HTTP to data.regen.endpoint)"
                 if self.tpu is None else
                 f"{self.tpu.name} ({self.tpu.chips} chips, {hosts} host{'s' if hosts > 1 else ''}, topology "
                 f"{self.tpu.topology}; `{' '.join(form.flags)}`: {form.hosts} node{'s' if form.hosts > 1 else ''} "
                 f"of {self.tpu.chips // form.hosts} chips in {TOOL})")
        lines = [
            f"# stage {self.stage} of recipe {self.recipe} on {where}; Cluster Toolkit job {self.job_name} on "
            f"cluster {self.cluster}; rendered for {TOOL} or newer",
            "# gcluster command:",
            shlex.join(self.gcluster_command(gcluster, hide=True)),
            "",
            *self.describe_workload({b: f"gcluster --mount, GCS FUSE CSI driver, {'read-only' if self.read_only(b)
                                         else 'read-write'}" for b in self.buckets}),
        ]
        return "\n".join(lines)


def find_gcluster(explicit: str | None = None) -> str:
    """The gcluster executable: `explicit`, $GCLUSTER, or `gcluster` on PATH."""
    for candidate in (explicit, os.environ.get("GCLUSTER")):
        if candidate and Path(candidate).is_file():
            return candidate
    found = shutil.which("gcluster")
    if found:
        return found
    raise ConfigError("gcluster was not found: install Cluster Toolkit (its `gcluster` binary, "
                      "https://cloud.google.com/cluster-toolkit/docs/setup/configure-environment), put it on PATH or "
                      "pass --gcluster PATH")


def launch(plan: GclusterLaunch, *, dry_run: bool, gcluster: str | None = None, manifest: str | None = None,
           notes: list[str] | tuple[str, ...] = ()) -> int:
    """Print the plan; unless `dry_run`, submit the job with gcluster. `manifest`: have gcluster write the JobSet it
    would apply into that file instead of applying it (its `--dry-run-out`; needs gcluster and the cluster)."""
    exe = find_gcluster(gcluster) if (not dry_run or manifest) else (gcluster or "gcluster")
    print(plan.describe(exe), flush=True)
    for note in notes:
        print(note, flush=True)
    if not dry_run or manifest:
        print(check_tool_version([exe, "--version"], r"gcluster version v?(\d+)\.(\d+)\.(\d+)", GCLUSTER_VERSION,
                                 "Cluster Toolkit (gcluster)"), flush=True)
    if manifest:
        done = subprocess.run(plan.manifest_command(manifest, exe), capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            return done.returncode
        print(f"# JobSet manifest written to {manifest}")
        return 0
    if dry_run:
        return 0
    return subprocess.run(plan.gcluster_command(exe)).returncode


__all__ = ["GCLUSTER_VERSION", "MAX_NAME", "GclusterLaunch", "find_gcluster", "gcluster_tpu_form", "launch"]
