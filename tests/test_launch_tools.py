"""What `dflash launch gcluster|xpk` renders, checked against the tools as they are (issue 58 item 2), not against a
documentation page: tests/data/pod_tools.json holds the flag names and TPU tables read from

- Cluster Toolkit v1.95.0 (github.com/GoogleCloudPlatform/cluster-toolkit, tag v1.95.0): `gcluster job submit`'s flags
  from cmd/job/submit.go and cmd/job/job.go, the TPU table from pkg/config/hardware.go;
- xpk 1.16.0 (PyPI, tools/setup_xpk.sh's pin): the flags its argument parser builds for `workload create` and
  `storage attach` (xpk/parser/*.py), its TPU and CPU types from xpk/core/system_characteristics.py.

Every flag rendered must be one the tool defines; every slice rendered must be one the tool reads as the chips and
hosts dflash plans (`launch.tpus.TpuType`), reproduced here from the tool's own table; a launch checks the tool's
version first."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from dflash.configs.schema import ConfigError
from dflash.launch import gcluster, xpk
from dflash.launch.cli import main
from dflash.launch.pod import parse_env, parse_secrets
from dflash.launch.tpus import GENERATIONS, parse_tpu_type

ROOT = Path(__file__).resolve().parents[1]
TOOLS = json.loads((ROOT / "tests" / "data" / "pod_tools.json").read_text())
GC, XPK = TOOLS["gcluster"], TOOLS["xpk"]
RUN = "gs://team-bucket/runs/qwen3-8b-a"


def _plans(cls, **launcher):
    """One plan per kind of stage the launchers render: every stage on a slice, endpoint regeneration on a CPU node,
    a target on a bucket, every optional value set."""
    common = dict(recipe="qwen3_8b", cluster="c1", run_dir=RUN, data_dir="gs://data-bucket/q", image="img",
                  env=parse_env(["A=1"]), secrets=parse_secrets(["HF_TOKEN=projects/p/secrets/hf"]), project="p",
                  model_buckets=("model-bucket",), **launcher)
    plans = [cls(stage=stage, tpu=parse_tpu_type(tpu), **common) for stage, tpu in
             [("train", "v5p-128"), ("regenerate", "v5p-64"), ("capture", "v5p-8"), ("eval", "v5p-8")]]
    plans.append(cls(stage="eval", tpu=parse_tpu_type("v5p-8"), chat_template_kwargs='{"enable_thinking": false}',
                     **common))
    return [*plans, cls(stage="regenerate", tpu=None, cpu_type="n2-standard-32", **common)]


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")} - {argv[i + 1] for i, a in enumerate(argv) if a == "--command"}


def _product(topology: str) -> int:
    out = 1
    for side in topology.split("x"):
        out *= int(side)
    return out


def test_the_versions_rendered_for_are_the_ones_the_fixture_was_read_from():
    assert "v" + ".".join(map(str, gcluster.GCLUSTER_VERSION)) == GC["version"] == "v1.95.0"
    assert ".".join(map(str, xpk.XPK_VERSION)) == XPK["version"]
    setup = (ROOT / "tools" / "setup_xpk.sh").read_text()
    assert f"XPK_VERSION=${{XPK_VERSION:-{XPK['version']}}}" in setup  # the pin tools/setup_xpk.sh installs


def test_gcluster_renders_only_flags_cluster_toolkit_v1_95_defines():
    defined = {*GC["job submit flags"]["flags"], *GC["job persistent flags"]["flags"]}
    assert "--env" not in defined  # why the environment travels in --command (test_launch_pods)
    for plan in _plans(gcluster.GclusterLaunch, location="us-east5", service_account="dflash-pods"):
        for argv in (plan.gcluster_command(), plan.manifest_command("/tmp/m.yaml")):
            assert argv[:3] == ["gcluster", "job", "submit"]
            assert _flags(argv) <= defined, _flags(argv) - defined
            assert {"--name", "--compute-type", "--command"} <= _flags(argv)  # MarkFlagRequired in submit.go
    assert GC["command"]["runs as"] == ["/bin/bash", "-c"]  # so `exec env K=V ... dflash` is a shell command


def test_xpk_renders_only_flags_xpk_1_16_defines():
    create, attach = XPK["workload create flags"], XPK["storage attach flags"]
    for plan in _plans(xpk.XpkLaunch, zone="us-east5-a", spot=True):
        for argv in (plan.xpk_command(), plan.manifest_command("/tmp/m.yaml")):
            assert argv[:3] == ["xpk", "workload", "create"]
            assert _flags(argv) <= set(create["flags"]), _flags(argv) - set(create["flags"])
            assert argv[argv.index("--priority") + 1] in create["--priority choices"]
        for argv in plan.storage_setup():
            assert argv[:3] == ["xpk", "storage", "attach"]
            assert _flags(argv) <= set(attach["flags"]), _flags(argv) - set(attach["flags"])
            assert argv[argv.index("--type") + 1] in attach["--type choices"]
    one_vm = XPK["cpu device types with one VM"]["types"]
    assert sorted(f"{cpu}-1" for cpu in xpk.XPK_CPU_TYPES) == sorted(one_vm)


def _gcluster_reading(machine: str, topology: str) -> tuple[int, int] | None:
    """(chips, nodes) Cluster Toolkit v1.95.0 makes of `--compute-type MACHINE --topology TOPOLOGY`, from the
    fixture's hardware.go tables (ValidateHardwareRequest, CalculateAcceleratorNodes); None when it refuses them."""
    tpu = GC["tpu"]
    if machine not in tpu["shorthand machine types (AcceleratorShorthandMap, TPU mappings)"].values():
        return None
    sides = [int(s) for s in topology.split("x")]
    if len(sides) == 2:
        valid = topology in tpu["allowed2DTopologies"].values()
    else:
        (limit,) = [n for prefix, n in tpu["maxCubes (tpu3DConstraintsMap, by machine type prefix)"].items()
                    if machine.startswith(prefix)]  # getMaxCubes: strings.HasPrefix
        valid = topology in tpu["common3DTopologies"].values() or (
            all(s >= 4 and s % 4 == 0 for s in sides) and sides == sorted(sides)
            and (sides[0] // 4) * (sides[1] // 4) * (sides[2] // 4) <= limit)
    per_vm = int(machine.rsplit("-", 1)[1].rstrip("t"))
    return (_product(topology), _product(topology) // per_vm) if valid else None


SIZES = [1 << i for i in range(0, 12)]


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_cluster_toolkit_reads_every_rendered_slice_as_dflash_plans_it(gen):
    g = GENERATIONS[gen]
    accepted = 0
    for chips in SIZES:
        tpu = parse_tpu_type(f"{gen}-{chips * g.cores_per_chip}")
        try:
            form = gcluster.gcluster_tpu_form(tpu)
        except ConfigError as err:
            machine = f"{gcluster.MACHINE_FAMILY[gen]}-{tpu.chips if tpu.hosts == 1 else g.chips_per_host}t"
            assert _gcluster_reading(machine, tpu.topology) is None, (tpu.name, str(err))
            continue
        flag, machine, top_flag, topology = form.flags
        assert (flag, top_flag) == ("--compute-type", "--topology")
        assert _gcluster_reading(machine, topology) == (tpu.chips, tpu.hosts) == (form.chips, form.hosts), tpu.name
        accepted += 1
    assert accepted >= 6  # every slice from one host to 64 hosts at least


def test_v5p_64_is_8_hosts_in_cluster_toolkit_and_the_chip_count_form_was_not():
    form = gcluster.gcluster_tpu_form(parse_tpu_type("v5p-64"))
    assert form.flags == ("--compute-type", "ct5p-hightpu-4t", "--topology", "2x4x4") and form.hosts == 8
    assert gcluster.gcluster_tpu_form(parse_tpu_type("v5p-8")).flags[-1] == "2x2x1"  # the eval host: 1 node
    # The negative control: `--compute-type v5p-64` alone, whose suffix hardware.go's parseShorthand counts as
    # chips, resolves to common3DTopologies[64] = 4x4x4: 64 chips on 16 hosts, not dflash's 32 on 8.
    resolved = GC["tpu"]["common3DTopologies"]["64"]
    assert _gcluster_reading("ct5p-hightpu-4t", resolved) == (64, 16) != (32, 8)
    assert _gcluster_reading("ct5p-hightpu-4t", GC["tpu"]["common3DTopologies"]["4"]) == (4, 1)  # v5p-8: 2 hosts
    assert GC["tpu"]["common3DTopologies"]["8"] == "2x2x2"  # ... where `v5p-8` was 8 chips, 2 hosts


@pytest.mark.parametrize("name", sorted(XPK["tpu types"]["types"]))
def test_xpk_reads_every_rendered_slice_as_dflash_plans_it_or_it_is_refused(name):
    table = XPK["tpu types"]["types"][name]
    tpu = parse_tpu_type(name)
    if table is None:  # no such TPU type in xpk 1.16.0
        with pytest.raises(ConfigError, match=f"be a slice xpk 1.16.0 has a TPU type for .* {name} has"):
            xpk.xpk_tpu_form(tpu)
        return
    form = xpk.xpk_tpu_form(tpu)
    assert form.flags == ("--tpu-type", name)
    assert (form.chips, form.hosts) == (_product(table["topology"]), table["vms"]) == (tpu.chips, table["vms"])
    plan = dict(stage="train", recipe="qwen3_8b", cluster="c1", tpu=tpu, run_dir=RUN, image="img")
    if table["vms"] == tpu.hosts:
        assert xpk.XpkLaunch(**plan).hosts == table["vms"]
    else:  # an 8-chip v5e / v6e slice: one host for dflash (and GKE's -8t machines), two 4-chip VMs for xpk
        assert tpu.chips == 8 and tpu.hosts == 1 and table["vms"] == 2
        with pytest.raises(ConfigError, match=r"reads as dflash plans it \(8 chips on 1 host\); `--tpu-type .*-8` "
                                              r"makes 8 chips on 2 hosts there"):
            xpk.XpkLaunch(**plan)


@pytest.mark.parametrize(("launcher", "good", "old"), [
    ("gcluster", "gcluster version v1.95.0", "gcluster version v1.94.0"),
    ("xpk", "[XPK] xpk_version: 1.16.0", "[XPK] xpk_version: 1.13.1"),
])
def test_a_launch_checks_the_tools_version_first(tmp_path, capsys, launcher, good, old):
    """Not a dry run: the tool's version command runs first; an older version stops the launch before anything is
    submitted (exit 2 naming both versions), one that prints no version gets a note and the launch goes on."""
    record = tmp_path / "argv.txt"
    base = ["launch", launcher, "train", "--config", "qwen3_8b", "--cluster", "c1", "--tpu-type", "v5p-128",
            "--run-dir", RUN, "--image", "img"]
    for printed, code in ((old, 2), (good, 0), ("a tool build with no version", 0)):
        fake = tmp_path / launcher
        fake.write_text(f"#!{sys.executable}\nimport sys, json\n"
                        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\nprint({printed!r})\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        record.unlink(missing_ok=True)
        assert main([*base, f"--{launcher}", str(fake)]) == code
        out, err = capsys.readouterr()
        calls = [json.loads(line)[:2] for line in record.read_text().splitlines()]
        version_call = ["--version"] if launcher == "gcluster" else ["version"]
        if code == 2:
            assert calls == [version_call]  # nothing submitted
            assert f"must be {good.rsplit(' ', 1)[1].lstrip('v')} or newer" in err and "upgrade it" in err
        else:
            assert calls[0] == version_call and len(calls) == 2
            assert ("or newer, as rendered for" in out) == (printed == good)
            assert ("printed no version" in out) == (printed != good)
