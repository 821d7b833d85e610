"""What a stage on a TPU pod is, whichever launcher starts it: `launch.xpk` (an xpk workload) or `launch.gcluster` (a
Cluster Toolkit job, `gcluster job submit`). Both render the same `PodStage`: one Docker image, the stage's `dflash`
command run by every worker on the GCS FUSE paths of its gs:// directories, the same environment, the same restart
policy; only the launcher's command line differs (docs/pods.md has the flag mapping).

- **Environment**: `--env KEY=VALUE`, or `--env KEY` which takes the value from the launching machine's environment
  at launch; `--secret NAME=projects/P/secrets/S[/versions/V]` passes a Secret Manager *reference* (as
  `DFLASH_SECRET_<NAME>`), which `dflash` resolves into `NAME` in the pod at start (`launch.secrets`), so the value
  never appears in the workload's manifest. `HF_TOKEN` (gated targets) and `WANDB_API_KEY` (`train.wandb=online`)
  reach the pods this way; a launch that needs one and passes neither is refused.
- **Restarts**: `--max-restarts` restarts of the whole workload on RESTART_EXIT_CODES: 42 (`dflash train` stopped
  by SIGTERM after checkpointing the step in flight, `train.preemption`) and the deaths by signal (SIGABRT 134,
  SIGKILL 137, SIGSEGV 139, SIGTERM 143); any other code (2 a configuration error, 1 a NaN) fails it. xpk restarts
  on 42 and 127-255 by default; a Cluster Toolkit job is given the list. `--grace-period` is the time a pod has
  between SIGTERM and SIGKILL: one step and a checkpoint write for `train`.

- **Machines**: each launcher names the slice in its own tool's terms (`slice_form`) and reads back the chips and
  hosts the tool makes of that name; a name the tool reads otherwise than dflash plans (`launch.tpus.TpuType`) is
  refused. Regeneration through an OpenAI-compatible server (`data.regen.endpoint.url`) only sends HTTP: it runs on
  one CPU node (`cpu_type`), no TPU requested.
- **Names**: the default workload name is `<recipe>-<stage>-<run dir's last part>` cut to the tool's limit, then a
  6-hex hash of the whole run directory, recipe and stage, so runs that share a prefix get distinct names.

`check_on_slice(recipe, stage, tpu, num_slices)` holds the rules that otherwise fail only on the pod, once every host
has started: the train mesh must fit the slice's chips, the global batch must split over the mesh's batch axes and
over the hosts (`train.loop.build_run`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from typing import Any

from dflash.configs.schema import ConfigError, require
from dflash.launch.secrets import SECRET_PREFIX
from dflash.launch.tpus import TpuType
from dflash.models.registry import BUCKET_MOUNT_ROOT, is_bucket_path
from dflash.train.config import mesh_shape
from dflash.train.preemption import PREEMPTED_EXIT_CODE

MOUNT_ROOT = BUCKET_MOUNT_ROOT  # gs://BUCKET is /gcs/BUCKET in every pod
STAGES = ("regenerate", "capture", "train", "eval")
MULTI_HOST_STAGES = ("train", "regenerate", "capture")
DEFAULT_MAX_RESTARTS = 10
RESTART_EXIT_CODES = (PREEMPTED_EXIT_CODE, 134, 137, 139, 143)
GRACE_SECONDS = {"train": 300}  # SIGTERM to SIGKILL; other stages: DEFAULT_GRACE_SECONDS
DEFAULT_GRACE_SECONDS = 30
PRIORITIES = ("very-low", "low", "medium", "high", "very-high")
LAUNCHER_ENV = ("DFLASH_DISTRIBUTED", "JAX_COMPILATION_CACHE_DIR", "PYTHONUNBUFFERED")  # set by the launcher itself
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
K8S_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # GKE clusters', xpk workloads' and gcluster jobs' names
SECRET_REF = re.compile(r"projects/[^/\s]+/secrets/[A-Za-z0-9_-]+(/versions/([0-9]+|latest))?")
_SENSITIVE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
GATED_TARGETS = ("meta-llama/",)  # Hub organisations whose models need HF_TOKEN (the llama31 recipes' targets)


def split_gcs(uri: str, flag: str) -> tuple[str, str]:
    """('bucket', 'path') of gs://bucket/path; ConfigError naming `flag` otherwise."""
    m = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/.*)?", uri.rstrip("/"))
    if m is None:
        raise ConfigError(f"{flag or 'a directory'} must be a gs://BUCKET/PATH Cloud Storage URI (pods read and "
                          f"write it through a GCS FUSE mount); received {uri!r}")
    return m.group(1), (m.group(2) or "").lstrip("/")


def mount_path(uri: str) -> str:
    """gs://bucket/path -> /gcs/bucket/path (where the bucket is mounted in every pod)."""
    bucket, path = split_gcs(uri, "")
    return f"{MOUNT_ROOT}/{bucket}" + (f"/{path}" if path else "")


def parse_env(items: list[str] | tuple[str, ...],
              environ: Mapping[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    """`--env KEY=VALUE` / `--env KEY` (the value of KEY in `environ`, default this process's environment, read now)
    as ((KEY, VALUE), ...); ConfigError naming the item and the rule otherwise."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        require(bool(_ENV_KEY.fullmatch(key)), "--env", item,
                "be KEY=VALUE or KEY (a variable of this environment), KEY a letter or _ then letters, digits and _")
        require(key not in LAUNCHER_ENV, "--env", item, f"not set {key}, which the launcher sets itself")
        require(not key.startswith(SECRET_PREFIX), "--env", item, f"not name {SECRET_PREFIX}*; use --secret")
        if not eq:
            require(key in environ, "--env", item, f"name a variable set in this environment, or give KEY=VALUE "
                                                   f"({key} is not set here)")
            value = environ[key]
        require(key not in out, "--env", item, f"set {key} once")
        out[key] = value
    return tuple(out.items())


def parse_secrets(items: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """`--secret NAME=projects/P/secrets/S[/versions/V]` as ((NAME, reference), ...) (version `latest` when not
    given); ConfigError naming the item and the rule otherwise."""
    out: dict[str, str] = {}
    for item in items:
        name, _, ref = item.partition("=")
        require(bool(_ENV_KEY.fullmatch(name)) and bool(SECRET_REF.fullmatch(ref)), "--secret", item,
                "be NAME=projects/PROJECT/secrets/SECRET[/versions/VERSION], NAME the environment variable the pods "
                "get (e.g. HF_TOKEN=projects/my-project/secrets/hf-token/versions/latest)")
        require(name not in out and name not in LAUNCHER_ENV, "--secret", item, f"set {name} once, not a launcher's")
        out[name] = ref if "/versions/" in ref else f"{ref}/versions/latest"
    return tuple(out.items())


def mask(key: str, value: str) -> str:
    """`value` as a dry run prints it: the value of a variable whose name says it is a credential is hidden (a
    `--secret` reference is not a credential: it is shown)."""
    hidden = _SENSITIVE.search(key) and value and not key.startswith(SECRET_PREFIX)
    return f"<{len(value)} characters, hidden>" if hidden else value


def plural(n: int, noun: str) -> str:
    """`1 host`, `8 hosts`."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def target_bucket(source: str) -> str:
    """The bucket of a target source on a bucket mount (/gcs/BUCKET/...), which the pods must mount; '' otherwise."""
    return source.split("/")[2] if is_bucket_path(source) else ""


@dataclasses.dataclass(frozen=True)
class SliceForm:
    """A stage's machines as one launcher names them (`flags`, e.g. `--tpu-type v5p-64`) and what `tool` (the
    launcher at the version whose source this reading follows, e.g. `xpk 1.16.0`) makes of the name: `hosts` pods
    (VMs) per slice holding `chips` TPU chips in all (0 on a CPU node)."""

    flags: tuple[str, ...]
    hosts: int
    chips: int
    tool: str


def parse_version(text: str, pattern: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of the first match of `pattern` (three groups) in a tool's version output, or None."""
    m = re.search(pattern, text)
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def check_tool_version(cmd: list[str], pattern: str, minimum: tuple[int, int, int], name: str) -> str:
    """Run `cmd` (a tool's version command) and refuse a version below `minimum` (ConfigError naming both and what
    to do); returns a note for the output: the version found, or that none could be read (the launch goes on)."""
    need = ".".join(map(str, minimum))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        out = done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        out = f"({type(err).__name__}: {err})"
    found = parse_version(out, pattern)
    if found is None:
        return (f"# note: `{shlex.join(cmd)}` printed no version ({out.strip()[-200:]!r}); this launcher renders for "
                f"{name} {need} or newer")
    require(found >= minimum, name, ".".join(map(str, found)),
            f"be {need} or newer: the flags and TPU names rendered here were checked against {name} {need}'s source "
            f"(`{shlex.join(cmd)}`); upgrade it")
    return f"# {name} {'.'.join(map(str, found))} (`{shlex.join(cmd)}`): {need} or newer, as rendered for"


def check_cluster(cluster: str) -> None:
    """`--cluster` of either launcher: a GKE cluster's name."""
    require(bool(K8S_NAME.fullmatch(cluster)), "--cluster", cluster,
            "be a GKE cluster name (lowercase letters, digits and '-', starting with a letter)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodStage:
    """One pipeline stage on a TPU slice, as every launcher renders it. `run_dir` / `data_dir` are gs:// URIs
    (`data_dir` default: run_dir/data); `env` and `secrets` are `parse_env` / `parse_secrets` results;
    `grace_period` the seconds from SIGTERM to SIGKILL (0: GRACE_SECONDS of the stage). `tpu` None: the stage runs
    on one CPU node of machine type `cpu_type` (endpoint regeneration, which only sends HTTP). `model_buckets`: the
    buckets the target is read from (`read_only` unless also the run's: gcluster mounts them so).
    `chat_template_kwargs`: the JSON object of chat-template variables the eval stage passes (`dflash eval
    --chat-template-kwargs`; the recipe's `data.regen.template_kwargs`)."""

    stage: str
    recipe: str
    tpu: TpuType | None
    run_dir: str
    image: str
    num_slices: int = 1
    data_dir: str = ""
    overrides: tuple[str, ...] = ()
    stage_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    secrets: tuple[tuple[str, str], ...] = ()
    max_restarts: int = DEFAULT_MAX_RESTARTS
    grace_period: int = 0
    project: str = ""
    priority: str = "medium"
    cpu_type: str = ""
    model_buckets: tuple[str, ...] = ()
    chat_template_kwargs: str = ""

    def __post_init__(self) -> None:
        require(self.stage in STAGES, "stage", self.stage, f"be one of {list(STAGES)}")
        require(self.num_slices >= 1, "--num-slices", self.num_slices, "be >= 1")
        if self.tpu is None:
            require(self.stage == "regenerate" and bool(self.cpu_type), "--tpu-type", None,
                    f"name the TPU slice of `{self.stage}` (only regeneration through an endpoint runs on a CPU node)")
            require(self.num_slices == 1, "--num-slices", self.num_slices, "be 1 on a CPU node")
        else:
            form = self.slice_form()
            require(form.chips == self.tpu.chips and form.hosts == self.tpu.hosts, "--tpu-type", self.tpu.name,
                    f"be a slice {form.tool} reads as dflash plans it ({self.tpu.chips} chips on "
                    f"{plural(self.tpu.hosts, 'host')}); `{' '.join(form.flags)}` makes {form.chips} chips on "
                    f"{plural(form.hosts, 'host')} there: pick a slice both read alike (docs/pods.md)")
        if self.chat_template_kwargs:
            try:
                kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError:
                kwargs = None
            require(isinstance(kwargs, dict), "chat_template_kwargs", self.chat_template_kwargs, "be a JSON object")
        for flag, uri in (("--run-dir", self.run_dir), ("--data-dir", self.data_dir)):
            if uri:
                split_gcs(uri, flag)
        require(self.max_restarts >= 0, "--max-restarts", self.max_restarts, "be >= 0")
        require(self.grace_period >= 0, "--grace-period", self.grace_period, "be >= 0 seconds (0: the stage's default)")
        require(self.priority in PRIORITIES, "--priority", self.priority, f"be one of {', '.join(PRIORITIES)}")
        if self.stage not in MULTI_HOST_STAGES and self.tpu is not None:
            require(self.tpu.hosts == 1 and self.num_slices == 1, "--tpu-type", self.tpu.name,
                    f"be a single-host slice for `{self.stage}` (it runs the engine on one host), e.g. "
                    f"{self.tpu.gen.xpk}-{self.tpu.gen.cores_per_chip * self.tpu.gen.chips_per_host}, with "
                    f"--num-slices 1; {self.tpu.name} has {self.tpu.hosts} hosts")
        shared = {k for k, _ in self.env} & {k for k, _ in self.secrets}
        require(not shared, "--env", sorted(shared), "not set a variable --secret also sets")

    def default_name(self, limit: int) -> str:
        """`<recipe>-<stage>-<run dir's last part>` made a valid Kubernetes name, cut to leave room for `-` and 6 hex
        digits of a hash of the whole run dir, recipe and stage: at most `limit` characters, and two runs whose names
        share a prefix (`...-lr6e-4`, `...-lr3e-4`) or whose run dirs share their last part get distinct names."""
        tail = self.run_dir.rstrip("/").rsplit("/", 1)[-1]
        name = re.sub(r"[^a-z0-9-]+", "-", f"{self.recipe}-{self.stage}-{tail}".lower()).strip("-")
        name = re.sub(r"-+", "-", name)
        name = name if name[:1].isalpha() else f"d-{name}"
        digest = hashlib.sha256(f"{self.run_dir.rstrip('/')}\n{self.recipe}\n{self.stage}".encode()).hexdigest()[:6]
        return f"{name[:limit - 7].rstrip('-')}-{digest}"

    def slice_form(self) -> SliceForm:
        """How this stage's launcher names `tpu` and what its tool reads from that name (each launcher's own)."""
        raise NotImplementedError

    @property
    def hosts(self) -> int:
        return 1 if self.tpu is None else self.tpu.hosts * self.num_slices

    @property
    def grace_seconds(self) -> int:
        return self.grace_period or GRACE_SECONDS.get(self.stage, DEFAULT_GRACE_SECONDS)

    @property
    def run_path(self) -> str:
        return mount_path(self.run_dir)

    @property
    def data_path(self) -> str:
        return mount_path(self.data_dir) if self.data_dir else f"{self.run_path}/data"

    @property
    def buckets(self) -> list[str]:
        """Every bucket the pods mount: the run's and the data's (read-write), then the target's."""
        found = [split_gcs(uri, "")[0] for uri in (self.run_dir, self.data_dir) if uri]
        return list(dict.fromkeys([*found, *self.model_buckets]))

    def read_only(self, bucket: str) -> bool:
        """Whether `bucket` only needs reading: the target's, written to by nothing of the run."""
        return bucket in self.model_buckets and bucket not in [split_gcs(u, "")[0] for u in (self.run_dir,
                                                                                          self.data_dir) if u]

    @property
    def template_kwargs_args(self) -> list[str]:
        """The eval stage's `--chat-template-kwargs JSON` (the recipe's template variables), unless --args sets one."""
        if self.stage != "eval" or not self.chat_template_kwargs or "--chat-template-kwargs" in self.stage_args:
            return []
        return ["--chat-template-kwargs", self.chat_template_kwargs]

    def worker_command(self) -> list[str]:
        """The stage's `dflash` command, run by every worker of the workload (paths on the GCS FUSE mounts). The eval
        stage evaluates the run's best drafter by real τ (`--step best`), or its newest checkpoint where the run kept
        no `best/` (a message says so)."""
        paths = [f"train.run_dir={self.run_path}", f"data.dir={self.data_path}"]
        common = ["--config", self.recipe]  # no terminal in a pod: every stage logs progress lines (data/progress.py)
        if self.stage == "train":
            cmd = ["dflash", "train", *common]
        elif self.stage in ("regenerate", "capture"):
            cmd = ["dflash", "data", self.stage, *common]
        else:
            cmd = ["dflash", "eval", *common, "--drafter", self.run_path, "--step", "best",
                   "--out", f"{self.run_path}/eval", *self.template_kwargs_args]
        return [*cmd, *self.stage_args, *paths, *self.overrides]

    def worker_env(self) -> dict[str, str]:
        """Environment of every worker: how `dflash` joins the distributed run, where compiled programs are cached
        between restarts, unbuffered logs; then `--env`, then each `--secret` as its reference (DFLASH_SECRET_NAME).
        On a CPU node (no TPU) the stage is one process: DFLASH_DISTRIBUTED=off."""
        env = {
            "DFLASH_DISTRIBUTED": "auto" if self.tpu is not None else "off",
            "JAX_COMPILATION_CACHE_DIR": f"{self.run_path}/jax_cache",
            "PYTHONUNBUFFERED": "1",
        }
        env.update(self.env)
        env.update({f"{SECRET_PREFIX}{name}": ref for name, ref in self.secrets})
        return env

    def passes(self, name: str) -> bool:
        """Whether the pods get environment variable `name` (by --env or --secret)."""
        return any(k == name for k, _ in (*self.env, *self.secrets))

    def describe_workload(self, mounts: Mapping[str, str] | None = None) -> list[str]:
        """The launcher-independent part of a dry run: pods, image, the command, environment (credentials hidden),
        mounts (`mounts`: how the launcher names each bucket's mount), restarts."""
        mounts = mounts or {}
        hosts = self.hosts
        env = self.worker_env()
        kwargs = self.template_kwargs_args
        return [
            f"# workload: {hosts} pod{'s' if hosts > 1 else ''} (one per host), image {self.image}, each running:",
            "#   " + shlex.join(self.worker_command()),
            *([f"# chat-template variables of the eval (the recipe's data.regen.template_kwargs): {kwargs[1]}"]
              if kwargs else []),
            "# environment:",
            *[f"#   {k}={mask(k, v)}" for k, v in env.items()],
            *(["# secrets (resolved from Secret Manager in each pod by dflash at start, into the variable named): "
               + ", ".join(f"{name} <- {ref}" for name, ref in self.secrets)] if self.secrets else []),
            "# storage (GCS FUSE mounts):",
            *[f"#   gs://{b} -> {MOUNT_ROOT}/{b}" + (" (the target's)" if b in self.model_buckets else "")
              + (f" ({mounts[b]})" if b in mounts else "") for b in self.buckets],
            f"# restarts: up to {self.max_restarts} on exit codes {', '.join(map(str, RESTART_EXIT_CODES))} "
            f"(42: preempted after checkpointing; the stage resumes from {self.run_dir}); grace period "
            f"{self.grace_seconds} s from SIGTERM to SIGKILL",
        ]


def check_on_slice(recipe: Any, stage: str, tpu: TpuType | None, num_slices: int) -> None:
    """Refuse (ConfigError naming the field, the value and the rule) a recipe whose `stage` cannot run on
    `num_slices` x `tpu`: for `train`, `train.mesh` must multiply to the slices' chips (one JAX device each) and
    `train.batch_size` must be a multiple of mesh data x fsdp and of the host count."""
    if stage != "train" or tpu is None:
        return
    chips, hosts = tpu.chips * num_slices, tpu.hosts * num_slices
    where = f"{num_slices} x {tpu.name}" if num_slices > 1 else tpu.name
    try:
        data, fsdp, _ = mesh_shape(recipe.train.mesh, chips)
    except ValueError as err:
        raise type(err)(f"{err} (on {where}: {chips} chips)") from None
    batch = recipe.train.batch_size
    require(batch % (data * fsdp) == 0, "train.batch_size", batch,
            f"be a multiple of mesh data x fsdp = {data * fsdp} on {where} ({chips} chips)")
    require(batch % hosts == 0, "train.batch_size", batch,
            f"be a multiple of the host count {hosts} of {where} (each host reads its rows of every batch)")


def check_credentials(recipe: Any, plan: PodStage) -> list[str]:
    """The credentials the recipe's pods need: `train.wandb=online` (train) needs WANDB_API_KEY, a gated Hub target
    (GATED_TARGETS) HF_TOKEN, and regeneration through an endpoint with `data.regen.endpoint.api_key_env` that
    variable, each passed by --env or --secret (ConfigError naming both ways otherwise). Returns notes for the dry run
    (a Hub target without HF_TOKEN: fine unless the model is gated; an endpoint on the pod's own loopback)."""
    how = "--env {0} (its value here) or --secret {0}=projects/P/secrets/S/versions/V"
    if plan.stage == "train" and recipe.train.wandb == "online":
        require(plan.passes("WANDB_API_KEY"), "train.wandb", "online",
                "come with WANDB_API_KEY for the pods: pass " + how.format("WANDB_API_KEY"))
    source = recipe.target.source
    hub = "/" in source and not source.startswith(("/", ".", "~", MOUNT_ROOT))
    if hub and source.startswith(GATED_TARGETS):
        require(plan.passes("HF_TOKEN"), "target.source", source,
                "come with HF_TOKEN for the pods (a gated model): pass " + how.format("HF_TOKEN"))
    notes = []
    endpoint = recipe.data.regen.endpoint
    if plan.stage == "regenerate" and endpoint.url and endpoint.api_key_env:
        name = endpoint.api_key_env
        require(plan.passes(name), "data.regen.endpoint.api_key_env", name,
                "be passed to the pods, which send the endpoint's API key from it: pass " + how.format(name))
    if plan.stage == "regenerate" and re.match(r"https?://(localhost|127\.|\[::1\])", endpoint.url):
        notes.append(f"# note: data.regen.endpoint.url {endpoint.url} is the pod's own loopback, not this machine's: "
                     "give the server's address as the pods reach it (a Service or an internal IP)")
    if hub and not plan.passes("HF_TOKEN"):
        notes.append(f"# note: HF_TOKEN is not passed; {source} is fetched from the Hub anonymously (a gated or "
                     f"private model needs {how.format('HF_TOKEN')})")
    return notes


__all__ = ["DEFAULT_MAX_RESTARTS", "GATED_TARGETS", "K8S_NAME", "MOUNT_ROOT", "MULTI_HOST_STAGES", "PodStage",
           "RESTART_EXIT_CODES", "SECRET_PREFIX", "STAGES", "SliceForm", "check_cluster", "check_credentials",
           "check_on_slice", "check_tool_version", "mask", "mount_path", "parse_env", "parse_secrets", "parse_version",
           "plural", "split_gcs", "target_bucket"]
