"""`dflash launch xpk`: the dry run of every stage prints the xpk command and the workload, and the command each
worker runs is a valid `dflash` command line on the GCS FUSE paths; single-host stages refuse multi-host slices;
`DFLASH_DISTRIBUTED=auto` joins the pod's run through `jax.distributed.initialize()`; the Docker image installs
the lock plus jax[tpu] at the locked jax version; TPU slice types."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import PACKAGE_DIRS

from dflash.configs.recipe import load_recipe
from dflash.configs.schema import ConfigError
from dflash.launch.cli import build_parser, main
from dflash.launch.tpus import parse_tpu_type
from dflash.launch.xpk import XpkLaunch, mount_path

ROOT = Path(__file__).resolve().parents[1]
RUN = "gs://team-bucket/runs/qwen3-8b-a"
DATA = "gs://data-bucket/qwen3"


def _dry_run(capsys, stage: str, tpu: str, *extra: str) -> tuple[list[str], str]:
    """(the printed xpk command's argv, the whole output) of `dflash launch xpk STAGE ... --dry-run`."""
    code = main(["launch", "xpk", stage, "--config", "qwen3_8b", "--cluster", "tpu-cluster", "--tpu-type", tpu,
                 "--run-dir", RUN, "--data-dir", DATA, "--image", "us-docker.pkg.dev/p/r/dflash-tpu:abc",
                 "--dry-run", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    return shlex.split(lines[lines.index("# xpk command:") + 1]), out


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


@pytest.mark.parametrize(("stage", "tpu", "slices", "hosts", "expected"), [
    ("train", "v5p-128", "2", 32, ["dflash", "train"]),
    ("regenerate", "v5p-8", "1", 1, ["dflash", "data", "regenerate"]),
    ("regenerate", "v5p-64", "2", 16, ["dflash", "data", "regenerate"]),  # every host answers its share
    ("capture", "v5p-8", "1", 1, ["dflash", "data", "capture"]),
    ("eval", "v5p-8", "1", 1, ["dflash", "eval"]),
])
def test_dry_run_prints_the_xpk_command_and_workload_of_every_stage(capsys, stage, tpu, slices, hosts, expected):
    argv, out = _dry_run(capsys, stage, tpu, "--num-slices", slices, "train.lr=3e-4")
    assert argv[:3] == ["xpk", "workload", "create"]
    assert _flag(argv, "--cluster") == ["tpu-cluster"]
    assert _flag(argv, "--tpu-type") == [tpu] and _flag(argv, "--num-slices") == [slices]
    assert _flag(argv, "--docker-image") == ["us-docker.pkg.dev/p/r/dflash-tpu:abc"]
    assert int(_flag(argv, "--max-restarts")[0]) > 0  # preemption restarts the workload, which resumes
    (name,) = _flag(argv, "--workload")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40 and stage in name
    env = dict(e.split("=", 1) for e in _flag(argv, "--env"))
    assert env["DFLASH_DISTRIBUTED"] == "auto"
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/gcs/team-bucket/runs/qwen3-8b-a/jax_cache"
    assert sorted(_flag(argv, "--storage")) == ["gcs-data-bucket", "gcs-team-bucket"]

    # Every worker runs the stage's own dflash command on the mounted paths, and dflash parses it.
    (command,) = _flag(argv, "--command")
    worker = shlex.split(command)
    assert worker[:len(expected)] == expected
    assert "train.run_dir=/gcs/team-bucket/runs/qwen3-8b-a" in worker and "data.dir=/gcs/data-bucket/qwen3" in worker
    assert worker[-1] == "train.lr=3e-4" and worker[worker.index("--config") + 1] == "qwen3_8b"
    args, extra = build_parser().parse_known_args(worker[1:])
    assert args.config == "qwen3_8b" and not args.no_progress  # no terminal in a pod: the stage logs progress lines
    assert args.func.__name__ == {"train": "cmd_train", "eval": "cmd_eval"}.get(stage, "cmd_data")
    assert all("=" in a for a in extra)  # overrides that argparse left over (main appends them)
    if stage == "eval":
        assert args.drafter == "/gcs/team-bucket/runs/qwen3-8b-a" and args.step == "best"
        assert args.out == "/gcs/team-bucket/runs/qwen3-8b-a/eval"

    # The workload as the dry run describes it.
    assert f"# workload: {hosts} pod" in out and "#   " + command in out
    assert "gs://team-bucket -> /gcs/team-bucket (xpk storage gcs-team-bucket)" in out
    assert "xpk storage attach gcs-data-bucket --type gcsfuse --bucket data-bucket" in out


def test_single_host_stages_refuse_multi_host_slices_and_bad_input_is_named(capsys):
    base = ["launch", "xpk", "eval", "--config", "qwen3_8b", "--cluster", "c1", "--run-dir", RUN, "--dry-run"]
    assert main([*base, "--tpu-type", "v5p-128"]) == 2
    assert "be a single-host slice for `eval`" in capsys.readouterr().err
    assert main([*base, "--tpu-type", "v5p-8", "--num-slices", "2"]) == 2
    assert "--num-slices 1" in capsys.readouterr().err
    assert main(["launch", "xpk", "capture", *base[3:], "--tpu-type", "v5p-64"]) == 0  # shares of the shards
    capsys.readouterr()
    bad_dir = ["launch", "xpk", "train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128",
               "--run-dir", "/local/run", "--dry-run"]
    assert main(bad_dir) == 2
    assert "--run-dir must be a gs://BUCKET/PATH" in capsys.readouterr().err
    assert main([*bad_dir[:-3], "--run-dir", RUN]) == 2  # a real launch needs an image
    assert "--image (or DFLASH_IMAGE) must name the image" in capsys.readouterr().err
    assert main([*bad_dir[:-3], "--run-dir", RUN, "--dry-run", "train.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--tpu-type must be <generation>-<size>"):
        parse_tpu_type("h100-8")
    with pytest.raises(ConfigError, match="power of two"):
        parse_tpu_type("v5p-96")


POD_RECIPES = ("qwen3_8b", "qwen3_4b", "llama31_8b", "llama31_8b_widek", "qwen3_8b_dflash2")


def test_the_tpu_slice_is_a_typed_recipe_field_checked_when_the_recipe_loads(capsys):
    """`launch.tpu_type` names the slice a recipe is sized for: the pod recipes set it (the default slice
    of `dflash launch compile`), an override changes it, and a bad value stops the load with an
    error naming the field, the value and the rule, before any launcher code runs."""
    for name in POD_RECIPES:
        assert load_recipe(name).launch.tpu_type == "v5p-128"
        assert parse_tpu_type(load_recipe(name).launch.tpu_type, "launch.tpu_type").chips == 64
    assert load_recipe("tiny").launch.tpu_type is None and load_recipe("smollm2").launch.tpu_type is None
    assert load_recipe("qwen3_8b", ["launch.tpu_type=v5p-256"]).launch.tpu_type == "v5p-256"
    with pytest.raises(ConfigError, match=r"^launch\.tpu_type must be <generation>-<size> .*; received 'h100-8'$"):
        load_recipe("qwen3_8b", ["launch.tpu_type=h100-8"])
    with pytest.raises(ConfigError, match=r"^launch\.tpu_type 'v5p-96': the size must be a power of two"):
        load_recipe("tiny", ["launch.tpu_type=v5p-96"])
    with pytest.raises(ConfigError, match=r"^launch\.tpu_type must be one of \['str', 'NoneType'\]; received 128$"):
        load_recipe("tiny", ["launch.tpu_type=128"])
    # With no --topology, compile takes the field; a recipe without one is refused by name.
    assert main(["launch", "compile", "--config", "tiny"]) == 2
    assert "recipe 'tiny' sets no launch.tpu_type" in capsys.readouterr().err
    assert main(["launch", "compile", "--config", "qwen3_8b", "launch.tpu_type=v5p-100"]) == 2
    assert "launch.tpu_type 'v5p-100': the size must be a power of two" in capsys.readouterr().err


def test_workload_name_and_paths():
    plan = XpkLaunch(stage="train", recipe="llama31_8b_widek", cluster="c1", tpu=parse_tpu_type("v5p-128"),
                     run_dir="gs://bk1/runs/2026_11/Llama_Run.long-name-for-a-workload", image="img")
    assert re.fullmatch(r"llama31-8b-widek-train-llama-run-[0-9a-f]{6}", plan.workload_name)  # cut at '-', hash
    assert len(plan.workload_name) <= 40
    assert plan.data_path == "/gcs/bk1/runs/2026_11/Llama_Run.long-name-for-a-workload/data"
    assert mount_path("gs://bk1") == "/gcs/bk1"
    with pytest.raises(ConfigError, match="gs://BUCKET/PATH"):
        mount_path("gs://b")  # bucket names have 3 characters at least


@pytest.mark.parametrize(("name", "chips", "hosts", "topology"), [
    ("v5p-8", 4, 1, "2x2x1"), ("v5p-128", 64, 16, "4x4x4"), ("v5p-256", 128, 32, "4x4x8"),
    ("v5litepod-8", 8, 1, "2x4"), ("v5e-16", 16, 4, "4x4"), ("v6e-256", 256, 64, "16x16"), ("v4-32", 16, 4, "2x2x4"),
])
def test_tpu_types(name, chips, hosts, topology):
    tpu = parse_tpu_type(name)
    assert (tpu.chips, tpu.hosts, tpu.topology) == (chips, hosts, topology)


def test_dflash_distributed_auto_calls_jax_distributed_initialize_without_arguments(monkeypatch, capsys):
    import jax

    from dflash.launch import cli

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DFLASH_DISTRIBUTED", "auto")
    cli._init_distributed()
    assert calls == [((), {})]  # on GKE, jax reads TPU_WORKER_HOSTNAMES / TPU_WORKER_ID / MEGASCALE_* itself
    monkeypatch.setenv("DFLASH_DISTRIBUTED", "yes")
    assert main(["train", "--config", "tiny"]) == 2
    assert "DFLASH_DISTRIBUTED must be 'auto'" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH_DISTRIBUTED", "off")
    cli._init_distributed()
    assert len(calls) == 1


def test_the_image_installs_the_lock_and_jax_tpu_at_the_locked_version():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pip install -r requirements.lock" in dockerfile
    assert "-c requirements.lock -r tpu-requirements.txt" in dockerfile
    lock = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    tpu_reqs = [line for line in (ROOT / "docker" / "tpu-requirements.txt").read_text().splitlines()
                if line and not line.startswith("#")]
    assert tpu_reqs == [f"jax[tpu]=={lock['jax']}"]
    # Every package folder (installed as dflash.<folder>, pyproject's package-dir) is copied into the image.
    copied = set(re.findall(r"^COPY (\w+) \1$", dockerfile, flags=re.M))
    assert set(PACKAGE_DIRS) <= copied, f"docker/Dockerfile must COPY {sorted(set(PACKAGE_DIRS) - copied)}"
    setup = (ROOT / "tools" / "setup_xpk.sh").read_text()
    assert ".venv-xpk" in setup and "xpk==" in setup
    assert (ROOT / "tools" / "setup_xpk.sh").stat().st_mode & 0o111
