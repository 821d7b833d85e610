"""`dflash launch gcluster <stage>`: a pipeline stage on a TPU slice of a GKE cluster as a Cluster Toolkit job
(`gcluster job submit`, which deploys a Kubernetes JobSet with Kueue), beside `dflash launch xpk` (xpk, which Google
is deprecating in favour of Cluster Toolkit). Both render the same `launch.pod.PodStage`: image, command, environment,
mounts and restart policy; docs/pods.md has the flag mapping.

    gcluster job submit --cluster C --location L [--project P] --name NAME --image IMAGE --compute-type v5p-128
        --command "dflash <stage> --config R train.run_dir=/gcs/B/run data.dir=/gcs/B/data ..."
        --restarts R --restart-on-exit-codes 42,134,137,139,143 --grace-period 300s --priority medium
        --mount gs://B:/gcs/B:rw --env DFLASH_DISTRIBUTED=auto --env ... [--env KEY=VALUE ...]

Flags as documented in Cluster Toolkit's reference (`gcluster job submit`): `--name` is required and at most 28
characters (Kubernetes/GCE resource name limits); `--compute-type` is required (a TPU slice such as `v5p-128`, the
nodes per slice calculated from its topology); `--mount SRC:DEST[:MODE]` mounts a gs:// bucket with the GCS FUSE CSI
driver (MODE `ro` by default, so `rw` is given); `--restart-on-exit-codes` lists the codes that restart the JobSet,
any other one fails it; `--grace-period` is the pod's termination grace period; `--env KEY=VALUE` sets a container
variable. A Cluster Toolkit job has no multislice environment (MEGASCALE_*) in its JobSet: `--num-slices` above 1 is
refused here (use `dflash launch xpk`); spot capacity is a property of the cluster's node pool, not of the job.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from dflash.configs.schema import ConfigError, require
from dflash.launch.pod import K8S_NAME, MOUNT_ROOT, RESTART_EXIT_CODES, PodStage, check_cluster, mask

MAX_NAME = 28  # gcluster job submit refuses longer workload names


@dataclasses.dataclass(frozen=True, kw_only=True)
class GclusterLaunch(PodStage):
    """One stage (`PodStage`) as a Cluster Toolkit job on GKE cluster `cluster` in `location` (a zone or region)."""

    cluster: str
    name: str = ""
    location: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cluster(self.cluster)
        if self.name:
            require(bool(K8S_NAME.fullmatch(self.name)) and len(self.name) <= MAX_NAME, "--name", self.name,
                    f"be at most {MAX_NAME} lowercase letters, digits and '-', starting with a letter "
                    "(gcluster job submit's limit)")
        require(self.num_slices == 1, "--num-slices", self.num_slices,
                "be 1 with gcluster (its JobSet sets no multislice MEGASCALE_* environment); use dflash launch xpk "
                "for several slices")

    @property
    def job_name(self) -> str:
        """--name, or `<recipe>-<stage>-<run dir's last part>` made a valid name of at most 28 characters."""
        return self.name or self.default_name(MAX_NAME)

    def mounts(self) -> list[str]:
        """`--mount` values: every bucket read-write at /gcs/<bucket> (GCS FUSE)."""
        return [f"gs://{bucket}:{MOUNT_ROOT}/{bucket}:rw" for bucket in self.buckets]

    def gcluster_command(self, gcluster: str = "gcluster", *, hide: bool = False) -> list[str]:
        """The `gcluster job submit` command line (`hide`: credentials' values hidden, for printing)."""
        cmd = [gcluster, "job", "submit", "--cluster", self.cluster]
        if self.location:
            cmd += ["--location", self.location]
        if self.project:
            cmd += ["--project", self.project]
        cmd += ["--name", self.job_name, "--image", self.image, "--compute-type", self.tpu.name,
                "--command", shlex.join(self.worker_command()), "--restarts", str(self.max_restarts),
                "--restart-on-exit-codes", ",".join(map(str, RESTART_EXIT_CODES)),
                "--grace-period", f"{self.grace_seconds}s", "--priority", self.priority]
        for mount in self.mounts():
            cmd += ["--mount", mount]
        for key, value in self.worker_env().items():
            cmd += ["--env", f"{key}={mask(key, value) if hide else value}"]
        return cmd

    def describe(self, gcluster: str = "gcluster") -> str:
        """What --dry-run prints: the gcluster command, then the job it submits."""
        hosts = self.hosts
        lines = [
            f"# stage {self.stage} of recipe {self.recipe} on {self.tpu.name} ({self.tpu.chips} chips, {hosts} "
            f"host{'s' if hosts > 1 else ''}, topology {self.tpu.topology}); Cluster Toolkit job {self.job_name} "
            f"on cluster {self.cluster}",
            "# gcluster command:",
            shlex.join(self.gcluster_command(gcluster, hide=True)),
            "",
            *self.describe_workload({b: "gcluster --mount, GCS FUSE CSI driver" for b in self.buckets}),
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
    if manifest:
        done = subprocess.run([*plan.gcluster_command(exe), "--dry-run-out", manifest], capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            return done.returncode
        print(f"# JobSet manifest written to {manifest}")
        return 0
    if dry_run:
        return 0
    return subprocess.run(plan.gcluster_command(exe)).returncode


__all__ = ["MAX_NAME", "GclusterLaunch", "find_gcluster", "launch"]
