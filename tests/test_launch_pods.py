"""`dflash launch gcluster` beside `dflash launch xpk` (issue 51 item 3, issue 58): the dry run of every stage renders
a `gcluster job submit` command with Cluster Toolkit v1.95.0's flags (read from its cmd/job/submit.go into
tests/data/pod_tools.json; tests/test_launch_tools.py checks them and the TPU reading in full): a name of at most 28
characters, the hosts' machine type and the topology, image, location, restarts, the restart exit codes, GCS mounts,
the environment inside the command (that version has no --env), the same worker command and environment as the xpk
workload; both take `--env KEY[=VALUE]` and `--secret NAME=REF` (resolved in the pod by `dflash` itself), and a launch
whose pods need HF_TOKEN or WANDB_API_KEY without them is refused."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import stat
import sys
from pathlib import Path

import pytest

from dflash.configs.schema import ConfigError
from dflash.launch import secrets
from dflash.launch.cli import build_parser, main
from dflash.launch.pod import RESTART_EXIT_CODES, parse_env, parse_secrets
from dflash.train.preemption import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
TOOLS = json.loads((ROOT / "tests" / "data" / "pod_tools.json").read_text())
RUN = "gs://team-bucket/runs/qwen3-8b-a"
DATA = "gs://data-bucket/qwen3"
IMAGE = "us-docker.pkg.dev/p/r/dflash-tpu:abc"
STAGES = [("train", "v5p-128", ["dflash", "train"]), ("regenerate", "v5p-8", ["dflash", "data", "regenerate"]),
          ("capture", "v5p-8", ["dflash", "data", "capture"]), ("eval", "v5p-8", ["dflash", "eval"])]
# `gcluster job submit`'s flags in Cluster Toolkit v1.95.0 (cmd/job/submit.go and cmd/job/job.go, tests/data/
# pod_tools.json); every flag the launcher renders must be one of these.
GCLUSTER_FLAGS = {*TOOLS["gcluster"]["job submit flags"]["flags"], *TOOLS["gcluster"]["job persistent flags"]["flags"]}


def _dry_run(capsys, launcher: str, stage: str, tpu: str, *extra: str) -> tuple[list[str], str]:
    """(the printed launcher command's argv, the whole output) of `dflash launch LAUNCHER STAGE ... --dry-run`."""
    code = main(["launch", launcher, stage, "--config", "qwen3_8b", "--cluster", "tpu-cluster", "--tpu-type", tpu,
                 "--run-dir", RUN, "--data-dir", DATA, "--image", IMAGE, "--project", "proj", "--zone", "us-east5-a",
                 "--dry-run", *extra])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    return shlex.split(lines[lines.index(f"# {launcher} command:") + 1]), out


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


def _env(argv: list[str]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in _flag(argv, "--env"))


def _command_env(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the environment, the worker command) of gcluster's `--command 'exec env K=V ... dflash ...'`."""
    (command,) = _flag(argv, "--command")
    words = shlex.split(command)
    assert words[:2] == ["exec", "env"], words
    start = words.index("dflash")
    return dict(w.split("=", 1) for w in words[2:start]), words[start:]


@pytest.mark.parametrize(("stage", "tpu", "expected"), STAGES)
def test_gcluster_dry_run_renders_every_stage_with_the_documented_flags(capsys, stage, tpu, expected, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "local-wandb-key")
    argv, out = _dry_run(capsys, "gcluster", stage, tpu, "--env", "WANDB_API_KEY", "--env",
                         "XLA_FLAGS=--xla_dump_to=/t", "--secret", "HF_TOKEN=projects/proj/secrets/hf-token/versions/3",
                         "train.lr=3e-4")
    assert argv[:3] == ["gcluster", "job", "submit"]
    flags = {a for a in argv[3:] if a.startswith("--")} - {a for a in _flag(argv, "--command")}
    assert flags <= GCLUSTER_FLAGS, flags - GCLUSTER_FLAGS
    (name,) = _flag(argv, "--name")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 28 and stage in name
    assert _flag(argv, "--cluster") == ["tpu-cluster"] and _flag(argv, "--location") == ["us-east5-a"]
    assert _flag(argv, "--project") == ["proj"] and _flag(argv, "--image") == [IMAGE]
    assert _flag(argv, "--compute-type") == ["ct5p-hightpu-4t"]  # the hosts' machine type, 4 chips each
    assert _flag(argv, "--topology") == [{"v5p-128": "4x4x4", "v5p-8": "2x2x1"}[tpu]]  # 64 chips on 16, 4 on 1
    assert "--env" not in argv  # Cluster Toolkit v1.95.0 has none: the environment travels in the command
    assert int(_flag(argv, "--restarts")[0]) == 10
    codes = [int(c) for c in _flag(argv, "--restart-on-exit-codes")[0].split(",")]
    assert PREEMPTED_EXIT_CODE in codes and 137 in codes and 2 not in codes and 1 not in codes
    assert _flag(argv, "--grace-period") == ["300s" if stage == "train" else "30s"]
    assert sorted(_flag(argv, "--mount")) == ["gs://data-bucket:/gcs/data-bucket:rw",
                                              "gs://team-bucket:/gcs/team-bucket:rw"]
    env, worker = _command_env(argv)
    assert env["DFLASH_DISTRIBUTED"] == "auto" and env["PYTHONUNBUFFERED"] == "1"
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/gcs/team-bucket/runs/qwen3-8b-a/jax_cache"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/t"
    assert env["WANDB_API_KEY"] == "<15 characters, hidden>"  # a credential's value is never printed
    assert env["DFLASH_SECRET_HF_TOKEN"] == "projects/proj/secrets/hf-token/versions/3"  # a reference, shown
    assert "HF_TOKEN <- projects/proj/secrets/hf-token/versions/3" in out and "local-wandb-key" not in out

    assert worker[:len(expected)] == expected and worker[-1] == "train.lr=3e-4"
    assert "train.run_dir=/gcs/team-bucket/runs/qwen3-8b-a" in worker and "data.dir=/gcs/data-bucket/qwen3" in worker
    args, extra = build_parser().parse_known_args(worker[1:])
    assert args.config == "qwen3_8b" and all("=" in a for a in extra)

    # The xpk workload of the same stage: the same worker command and environment.
    xargv, _ = _dry_run(capsys, "xpk", stage, tpu, "--env", "WANDB_API_KEY", "--env", "XLA_FLAGS=--xla_dump_to=/t",
                        "--secret", "HF_TOKEN=projects/proj/secrets/hf-token/versions/3", "train.lr=3e-4")
    assert _flag(xargv, "--command") == [shlex.join(worker)] and _env(xargv) == env
    assert _flag(xargv, "--termination-grace-period-seconds") == [_flag(argv, "--grace-period")[0].rstrip("s")]
    assert _flag(xargv, "--max-restarts") == ["10"] and _flag(xargv, "--zone") == ["us-east5-a"]


def test_the_launchers_run_the_tools_with_the_real_values(tmp_path, monkeypatch, capsys):
    """Not a dry run: the tool (a stand-in recording its argv) gets the credentials' values, not their masks."""
    record = tmp_path / "argv.txt"
    versions = {"gcluster": "gcluster version v1.95.0", "xpk": "[XPK] xpk_version: 1.16.0"}
    for tool in ("gcluster", "xpk"):
        fake = tmp_path / tool
        fake.write_text(f"#!{sys.executable}\nimport sys, json\n"
                        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
                        f"print({versions[tool]!r})\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    base = ["train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128", "--run-dir", RUN,
            "--image", IMAGE, "--env", "HF_TOKEN"]
    assert main(["launch", "gcluster", *base, "--gcluster", str(tmp_path / "gcluster")]) == 0
    assert main(["launch", "xpk", *base, "--xpk", str(tmp_path / "xpk")]) == 0
    assert "hf_secret_value" not in capsys.readouterr().out
    runs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r[:2] for r in runs] == [["--version"], ["job", "submit"], ["version"], ["workload", "create"]]
    assert _command_env(runs[1])[0]["HF_TOKEN"] == _env(runs[3])["HF_TOKEN"] == "hf_secret_value"


def test_env_and_secret_arguments_are_checked(monkeypatch):
    monkeypatch.setenv("MY_VAR", "from-here")
    monkeypatch.delenv("NOT_SET_HERE", raising=False)
    assert parse_env(["A=1", "MY_VAR", "B="]) == (("A", "1"), ("MY_VAR", "from-here"), ("B", ""))
    with pytest.raises(ConfigError, match=r"--env must name a variable set in this environment.*NOT_SET_HERE"):
        parse_env(["NOT_SET_HERE"])
    with pytest.raises(ConfigError, match=r"--env must not set DFLASH_DISTRIBUTED, which the launcher sets"):
        parse_env(["DFLASH_DISTRIBUTED=off"])
    with pytest.raises(ConfigError, match=r"--env must be KEY=VALUE or KEY"):
        parse_env(["1BAD=x"])
    assert parse_secrets(["HF_TOKEN=projects/p/secrets/hf"]) == (("HF_TOKEN", "projects/p/secrets/hf/versions/latest"),)
    with pytest.raises(ConfigError, match=r"--secret must be NAME=projects/PROJECT/secrets/SECRET"):
        parse_secrets(["HF_TOKEN=hf_plaintext"])


@pytest.mark.parametrize("launcher", ["xpk", "gcluster"])
def test_pods_that_need_a_credential_are_not_launched_without_it(capsys, launcher, monkeypatch):
    base = ["launch", launcher, "train", "--cluster", "c1", "--tpu-type", "v5p-128", "--run-dir", RUN, "--dry-run"]
    assert main([*base, "--config", "qwen3_8b", "train.wandb=online"]) == 2
    assert "train.wandb must come with WANDB_API_KEY for the pods: pass --env WANDB_API_KEY" in capsys.readouterr().err
    assert main([*base, "--config", "qwen3_8b", "train.wandb=online", "--secret",
                 "WANDB_API_KEY=projects/p/secrets/wandb"]) == 0
    capsys.readouterr()
    assert main([*base, "--config", "llama31_8b"]) == 2  # meta-llama models are gated: HF_TOKEN
    assert "target.source must come with HF_TOKEN for the pods (a gated model)" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert main([*base, "--config", "llama31_8b", "--env", "HF_TOKEN"]) == 0
    assert main([*base, "--config", "qwen3_8b"]) == 0
    assert "note: HF_TOKEN is not passed; Qwen/Qwen3-8B is fetched from the Hub anonymously" in capsys.readouterr().out


def test_gcluster_names_and_slices(capsys):
    base = ["launch", "gcluster", "train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128",
            "--run-dir", "gs://bk1/runs/a-rather-long-run-directory-name", "--dry-run"]
    assert main(base) == 0
    name = _flag(shlex.split(capsys.readouterr().out.splitlines()[2]), "--name")[0]
    assert re.fullmatch(r"qwen3-8b-train-a-rath-[0-9a-f]{6}", name) and len(name) == 28
    assert main([*base, "--name", "x" * 29]) == 2
    assert "--name must be at most 28 lowercase letters" in capsys.readouterr().err
    assert main([*base, "--num-slices", "2"]) == 2
    assert "use dflash launch xpk for several slices" in capsys.readouterr().err
    assert main(["launch", "gcluster", "eval", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128",
                 "--run-dir", RUN, "--dry-run"]) == 2
    assert "be a single-host slice for `eval`" in capsys.readouterr().err


def test_restart_codes_are_the_preemption_code_and_deaths_by_signal():
    assert RESTART_EXIT_CODES[0] == PREEMPTED_EXIT_CODE == 42  # one of xpk's default restartable codes
    assert all(c > 128 for c in RESTART_EXIT_CODES[1:])


def test_secret_references_are_resolved_in_the_pod_before_the_stage_runs(monkeypatch, capsys):
    """`dflash` reads DFLASH_SECRET_<NAME> references from Secret Manager (the metadata server's token, then the
    access call) into NAME, leaving a NAME already set alone; a secret it cannot read stops it naming the reference."""
    calls = []

    def fake_get_json(url, headers):
        calls.append(url)
        if url == secrets.TOKEN_URL:
            assert headers == {"Metadata-Flavor": "Google"}
            return {"access_token": "tok"}
        assert headers == {"Authorization": "Bearer tok"}
        return {"payload": {"data": base64.b64encode(b"hf_from_secret_manager").decode()}}

    environ = {"DFLASH_SECRET_HF_TOKEN": "projects/p/secrets/hf/versions/2", "DFLASH_SECRET_WANDB_API_KEY": "x",
               "WANDB_API_KEY": "already-set"}
    assert secrets.resolve_secrets(environ, lambda ref: secrets.access_secret(ref, fake_get_json)) == ["HF_TOKEN"]
    assert environ["HF_TOKEN"] == "hf_from_secret_manager" and environ["WANDB_API_KEY"] == "already-set"
    assert calls == [secrets.TOKEN_URL,
                     "https://secretmanager.googleapis.com/v1/projects/p/secrets/hf/versions/2:access"]

    # Through the entry point: resolved before the command runs, and a failure is a configuration error (exit 2).
    monkeypatch.setattr(secrets, "_get_json", fake_get_json)
    monkeypatch.setenv("DFLASH_SECRET_MY_TOKEN", "projects/p/secrets/mine/versions/1")
    monkeypatch.delenv("MY_TOKEN", raising=False)
    assert main(["config", "--config", "tiny"]) == 0
    assert os.environ["MY_TOKEN"] == "hf_from_secret_manager"
    monkeypatch.delenv("MY_TOKEN")
    monkeypatch.setattr(secrets, "TRIES", 1)

    def refused(url, headers):
        raise OSError("metadata server unreachable")

    monkeypatch.setattr(secrets, "_get_json", refused)
    assert main(["config", "--config", "tiny"]) == 2
    assert "--secret projects/p/secrets/mine/versions/1 could not be read in this pod" in capsys.readouterr().err


def test_default_names_are_distinct_for_runs_that_share_a_prefix():
    """Issue 58: `qwen3-30b-a3b-lr6e-4` and `...-lr3e-4` rendered one gcluster name. The name's readable part is cut
    to leave room for a hash of the whole run dir, so they differ, stay valid GKE names within each tool's limit, and a
    relaunch of the same run gets the same name."""
    from dflash.launch.gcluster import MAX_NAME, GclusterLaunch
    from dflash.launch.pod import K8S_NAME
    from dflash.launch.tpus import parse_tpu_type
    from dflash.launch.xpk import XpkLaunch

    def plan(cls, run_dir, **kw):
        return cls(stage="train", recipe="qwen3_30b_a3b", cluster="c1", tpu=parse_tpu_type("v5p-64"), run_dir=run_dir,
                   image="img", **kw)

    runs = ["gs://bk1/runs/qwen3-30b-a3b-lr6e-4", "gs://bk1/runs/qwen3-30b-a3b-lr3e-4", "gs://bk2/runs/qwen3-30b-a3b-lr6e-4"]
    for cls, limit, attr in ((GclusterLaunch, MAX_NAME, "job_name"), (XpkLaunch, 40, "workload_name")):
        names = [getattr(plan(cls, run), attr) for run in runs]
        assert len(set(names)) == len(runs), names
        assert all(K8S_NAME.fullmatch(n) and len(n) <= limit for n in names), names
        assert getattr(plan(cls, runs[0] + "/"), attr) == names[0]  # the same run, the same name
    gc = [plan(GclusterLaunch, run).job_name for run in runs]
    assert len({n[:-7] for n in gc}) == 1  # the readable parts alone collide: the hash is what tells them apart


def test_endpoint_regeneration_runs_on_a_cpu_node_and_its_key_must_reach_the_pods(capsys, monkeypatch):
    """Regeneration through an OpenAI-compatible server only sends HTTP: no TPU is requested (xpk `--device-type
    n2-standard-32-1`, gcluster `--compute-type n2-standard-32`), the stage is one process, and the variable named by
    `data.regen.endpoint.api_key_env` must be passed (--env or --secret), else the launch is refused."""
    endpoint = ["data.regen.endpoint.url=http://10.0.0.7:8000/v1", "data.regen.endpoint.api_key_env=VLLM_KEY"]
    base = ["regenerate", "--config", "qwen3_8b", "--cluster", "c1", "--run-dir", RUN, "--dry-run", *endpoint]
    for launcher, slice_flags in (("xpk", ["--device-type", "n2-standard-32-1"]),
                                  ("gcluster", ["--compute-type", "n2-standard-32"])):
        assert main(["launch", launcher, *base]) == 2
        assert ("data.regen.endpoint.api_key_env must be passed to the pods, which send the endpoint's API key from "
                "it: pass --env VLLM_KEY") in capsys.readouterr().err
        assert main(["launch", launcher, *base, "--secret", "VLLM_KEY=projects/p/secrets/vllm"]) == 0
        out = capsys.readouterr().out
        argv = shlex.split(out.splitlines()[2])
        assert " ".join(slice_flags) in " ".join(argv)
        assert not {"--tpu-type", "--topology"} & set(argv)
        assert "CPU node (no TPU: the stage only sends HTTP to data.regen.endpoint)" in out
        assert "DFLASH_DISTRIBUTED=off" in out and "DFLASH_DISTRIBUTED=auto" not in out
        assert main(["launch", launcher, *base, "--secret", "VLLM_KEY=projects/p/secrets/vllm", "--tpu-type",
                     "v5p-8"]) == 2
        err = capsys.readouterr().err
        assert "--tpu-type must not be given for `regenerate` through data.regen.endpoint.url" in err
    assert main(["launch", "xpk", *base, "--secret", "VLLM_KEY=projects/p/secrets/vllm", "--cpu-type",
                 "e2-standard-8"]) == 2
    assert "--cpu-type must be a CPU machine type xpk 1.16.0 has one-VM device types for" in capsys.readouterr().err
    # Without an endpoint a slice is needed.
    assert main(["launch", "xpk", "regenerate", "--config", "qwen3_8b", "--cluster", "c1", "--run-dir", RUN,
                 "--dry-run"]) == 2
    assert "--tpu-type must name the TPU slice of `regenerate`" in capsys.readouterr().err


def test_a_target_on_a_bucket_is_launched_from_its_mount_and_gs_uris_name_it(capsys):
    """`target.source=/gcs/BUCKET/...` exists in the pods, not here: the launch passes it on, mounts its bucket (read-
    only for gcluster, which mounts per job), and leaves its architecture check to the pod; a local run still needs it
    to exist and says where such a path lives; `gs://...` is refused naming the mount path to pass."""
    from dflash.models.registry import check_target, resolve_source

    source = "target.source=/gcs/b/models/Qwen3-8B"
    argv, out = _dry_run(capsys, "xpk", "train", "v5p-64", source)
    assert source in shlex.split(_flag(argv, "--command")[0]) and "gcs-b" in _flag(argv, "--storage")
    assert "xpk storage attach gcs-b --type gcsfuse --bucket b" in out
    argv, _ = _dry_run(capsys, "gcluster", "train", "v5p-64", source)
    assert "gs://b:/gcs/b:ro" in _flag(argv, "--mount") and "gs://team-bucket:/gcs/team-bucket:rw" in _flag(argv,
                                                                                                          "--mount")
    assert "note: HF_TOKEN is not passed" not in capsys.readouterr().out  # nothing comes from the Hub

    assert main(["launch", "xpk", "train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-64",
                 "--run-dir", RUN, "--dry-run", "target.source=gs://b/models/Qwen3-8B"]) == 2
    err = capsys.readouterr().err
    assert "target.source must be a path the process reads as files, not a Cloud Storage URI" in err
    assert "pass its GCS FUSE mount path target.source=/gcs/b/models/Qwen3-8B" in err

    with pytest.raises(FileNotFoundError, match=r"'/gcs/b/models/Qwen3-8B' does not exist on this machine: /gcs/b is "
                                                r"where `dflash launch` mounts gs://b in its pods"):
        check_target("/gcs/b/models/Qwen3-8B")
    with pytest.raises(FileNotFoundError, match="does not exist on this machine"):
        resolve_source("/gcs/b/models/Qwen3-8B")
    assert check_target("/gcs/b/models/Qwen3-8B", unreachable_ok=True) is None  # the launch's check: the pod's
    with pytest.raises(FileNotFoundError, match="neither 'smollm2' nor an existing path"):  # elsewhere: as before
        check_target("/no/such/model", unreachable_ok=True)
    assert main(["chat", "--config", "qwen3_8b", "target.source=/gcs/b/models/Qwen3-8B", "--prompt", "hi"]) == 2
    assert "does not exist on this machine" in capsys.readouterr().err  # a run here stops before loading anything


@pytest.mark.parametrize("launcher", ["xpk", "gcluster"])
def test_the_eval_stage_carries_the_recipes_chat_template_variables(capsys, launcher):
    """Issue 58 item 4: the pod eval stage renders `--chat-template-kwargs` with the recipe's
    `data.regen.template_kwargs` (what the drafter was trained on) and the dry run prints it; `--args` may set it."""
    for recipe, expected in (("qwen3_8b", {"enable_thinking": False}),
                             ("gpt_oss_20b", {"reasoning_effort": "low", "strftime_now": "2026-12-06"})):
        code = main(["launch", launcher, "eval", "--config", recipe, "--cluster", "c1", "--tpu-type", "v5p-8",
                     "--run-dir", RUN, "--dry-run"])
        out = capsys.readouterr().out
        assert code == 0, out
        worker = shlex.split(out.split("#   ", 1)[1].splitlines()[0])  # the workload's command line
        args, _ = build_parser().parse_known_args(worker[1:])
        assert json.loads(args.chat_template_kwargs) == expected
        assert f"(the recipe's data.regen.template_kwargs): {json.dumps(expected, sort_keys=True)}" in out
    code = main(["launch", launcher, "eval", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-8",
                 "--run-dir", RUN, "--dry-run", "--args", "--chat-template-kwargs '{\"enable_thinking\": true}'",
                 "data.regen.template_kwargs={enable_thinking: false}"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("--chat-template-kwargs") == 2  # once in the command line, once in the workload
    assert "template_kwargs):" not in out  # the --args value is the one used; nothing else is claimed
    code = main(["launch", launcher, "train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128",
                 "--run-dir", RUN, "--dry-run"])
    assert code == 0 and "--chat-template-kwargs" not in capsys.readouterr().out  # train reads the recipe itself
