"""End to end through the real entry point (`dflash …`) on the tiny preset."""

import json
import re
import subprocess
import sys

import pytest

from dflash.launch.cli import main
from dflash.models.registry import shipped_drafter_path


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_runs_on_the_tiny_preset(capsys, tmp_path):
    argv = ["demo", "--config", "tiny", "--no-progress", "--prompt", "What is 2+2?", f"train.run_dir={tmp_path}",
            "train.batch_size=8",  # the test process has 8 devices; the batch must divide over them
            "target.max_seq_len=512"]  # the evaluation's HumanEval and MATH-500 prompts need more than tiny's 256
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "loaded SmolLM2-135M-Instruct.Q4_1.gguf (llama, 30 layers, hidden 576)" in out
    assert "trained steps 0..8" in out and "held-out teacher-forced acceptance length" in out
    assert (tmp_path / "checkpoints" / "8").is_dir()
    assert ">>> What is 2+2?" in out
    assert "decode tokens/s (the steps that compiled nothing)" in out
    assert "identical to AR: yes" in out and "identical to AR: NO" not in out
    lines = out.strip().splitlines()
    # the demo evaluates the drafter shipped for the target (at its training K), not the 8-step one
    shipped_k = json.loads((shipped_drafter_path("smollm2") / "config.json").read_text())["block_size"]
    assert re.fullmatch(rf"DFlash vs AR: [\d.]+x tokens/s \(median of 15 paired requests, timing noise \+-\d+%"
                        rf"(: too noisy to trust)?; tau [\d.]+, K={shipped_k}\)", lines[-1]), lines[-3:]
    assert lines[-2] == f"report: {tmp_path / 'eval' / 'report.md'}" and (tmp_path / "eval" / "results.json").is_file()


@pytest.mark.e2e
def test_chat_reads_prompts_and_reports_throughput(capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hello.\n\n"))
    assert main(["chat", "--config", "tiny", "sampling.max_new_tokens=4"]) == 0
    out = capsys.readouterr().out
    assert ">>> Say hello." in out and "tokens/s" in out and "4 new tokens" in out


def test_config_prints_the_resolved_recipe(capsys):
    assert main(["config", "--config", "tiny", "sampling.temperature=0.5"]) == 0
    out = capsys.readouterr().out
    assert "temperature: 0.5" in out and "max_seq_len: 256" in out


def test_bad_config_exits_2_naming_the_field(capsys):
    assert main(["config", "--config", "tiny", "target.nope=1"]) == 2
    assert "unknown key(s) ['target.nope']" in capsys.readouterr().err


def test_console_script_is_installed():
    """`dflash --help` works as a process (the console entry point exists and imports cleanly)."""
    proc = subprocess.run([sys.executable, "-m", "dflash.launch.cli", "--help"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and "demo" in proc.stdout and "chat" in proc.stdout


def test_overrides_may_follow_options(capsys):
    assert main(["config", "--config", "tiny", "sampling.top_k=3", "--config", "tiny", "sampling.top_p=0.5"]) == 0
    out = capsys.readouterr().out
    assert "top_k: 3" in out and "top_p: 0.5" in out
    with pytest.raises(SystemExit):
        main(["config", "--config", "tiny", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_export_is_a_subcommand_sharing_dflash_exports_arguments():
    """`dflash export --help` works as a process; its arguments are dflash-export's, defined once."""
    proc = subprocess.run([sys.executable, "-m", "dflash.launch.cli", "export", "--help"], capture_output=True,
                          text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for part in ("usage: dflash export", "RUN_DIR", "--format {zlab,speculators}", "--push-to-hub REPO",
                 "--config NAME|PATH", "exported for"):
        assert part in proc.stdout
    from dflash.export.cli import build_parser as export_parser
    from dflash.launch.cli import build_parser

    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command").choices["export"]
    options = lambda p: {s for a in p._actions for s in a.option_strings} | {a.dest for a in p._actions}  # noqa: E731
    assert options(sub) == options(export_parser()) - {"-v", "--verbose", "verbose"}


@pytest.mark.parametrize("argv", [["demo"], ["chat"], ["train"], ["data", "regenerate"], ["data", "capture"],
                                  ["data", "walk"], ["data", "inspect"], ["serve"], ["eval"],
                                  ["launch", "xpk", "train"], ["launch", "compile"], ["config"], ["export", "RUN"]])
def test_every_subcommand_takes_config_and_overrides(argv):
    from dflash.launch.cli import build_parser

    args, extra = build_parser().parse_known_args([*argv, "--config", "tiny", "sampling.top_k=3"]
                                                  + (["--cluster", "c", "--tpu-type", "v5p-8", "--run-dir", "gs://b/r"]
                                                     if argv[:2] == ["launch", "xpk"] else [])
                                                  + (["--format", "zlab"] if argv[0] == "export" else []))
    assert args.config == "tiny" and [*args.overrides, *extra] == ["sampling.top_k=3"]
