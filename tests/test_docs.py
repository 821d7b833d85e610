"""The docs point at things that exist: every benchmark script that docs/benchmarks.md and the study pages name
runs `--help`; every relative link of README.md and docs/ resolves; every module, function and file path the
front page and the stage pages name in backticks exists in the tree; the study scripts write study pages."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PACKAGE_DIRS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "studies").glob("*.md"))]
# Pages that describe the code as it is now (the decision records and the dated studies are historical).
CURRENT = [ROOT / "README.md", *(DOCS / f"{name}.md" for name in (
    "design", "architecture", "training", "data", "serving", "evaluation", "export", "pods", "development",
    "benchmarks"))]
PACKAGES = PACKAGE_DIRS
FOLDERS = (*PACKAGES, "benchmarks", "tools", "tests", "bin", "docker")  # what a backticked repository path starts with
EXTERNAL = {"dflash/model.py"}  # z-lab's modelling file, in their repository (docs/export.md)


def _scripts() -> list[str]:
    """benchmarks/*.py scripts named in the benchmark and study pages (`benchmarks/x.py` or `-m benchmarks.x`)."""
    found = set()
    for page in [DOCS / "benchmarks.md", *sorted((DOCS / "studies").glob("*.md"))]:
        text = page.read_text()
        found |= {f"benchmarks/{m}.py" for m in re.findall(r"benchmarks/(\w+)\.py", text)}
        found |= {f"benchmarks/{m}.py" for m in re.findall(r"-m benchmarks\.(\w+)", text)}
    return sorted(found)


def test_every_benchmark_script_the_docs_name_exists_and_answers_help():
    scripts = _scripts()
    assert "benchmarks/engine_throughput.py" in scripts and "benchmarks/drafter_tau.py" in scripts
    missing = [s for s in scripts if not (ROOT / s).is_file()]
    assert not missing, f"docs name benchmark scripts that do not exist: {missing}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = {s: subprocess.Popen([sys.executable, s, "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for s in scripts}
    failed = {}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        if proc.returncode != 0 or "usage:" not in out:
            failed[script] = (proc.returncode, err[-500:])
    assert not failed, f"`python SCRIPT --help` failed: {failed}"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http(s), mailto
        where, _, anchor = target.partition("#")
        path = (page.parent / where).resolve() if where else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)} links to missing files or headings: {broken}"


def _top_level_names(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _config_fields() -> dict[str, set[str]]:
    from dflash.configs.recipe import Recipe

    return {f.name: {g.name for g in dataclasses.fields(f.default_factory())} for f in dataclasses.fields(Recipe)}


def _dangling_reference(ref: str, fields: dict[str, set[str]]) -> str | None:
    """Why `pkg.module[.name]` (optionally `dflash.`-prefixed) names nothing in the package folders, or None. A
    recipe key (`data.seq_len`, `train.mesh.fsdp`) is not a code reference."""
    parts = ref.removeprefix("dflash.").split(".")
    if parts[0] in fields and parts[1] in fields[parts[0]]:
        return None
    module = ROOT / parts[0] / f"{parts[1]}.py"
    if not module.is_file():
        return f"no module {parts[0]}/{parts[1]}.py"
    if len(parts) > 2 and parts[2] not in _top_level_names(module):
        return f"{parts[0]}/{parts[1]}.py defines no {parts[2]!r}"
    return None


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_the_docs_name_exists(page):
    """`serve.engine.decode`, `dflash.models.registry.known_target`, `train/sharding.py`, `tools/lock.sh`:
    each backticked module, name or repository path on a page about the current code must exist."""
    fields = _config_fields()
    bad = []
    for span in re.findall(r"`([^`\n]+)`", page.read_text()):
        for ref in re.findall(rf"(?<![\w./-])((?:dflash\.)?(?:{'|'.join(PACKAGES)})\.[a-z_]\w*(?:\.\w+)?)\b", span):
            if (why := _dangling_reference(ref, fields)) is not None:
                bad.append(f"{ref}: {why}")
        for path in re.findall(rf"(?<![\w./-])((?:{'|'.join(FOLDERS)})/[\w./-]*\w)", span):
            metric = path.split("/")[0] in PACKAGES and "." not in path.rsplit("/", 1)[1]  # `eval/tau`: a metric
            if path not in EXTERNAL and not metric and not any(c in span for c in "<*{") and not (ROOT / path).exists():
                bad.append(f"{path}: no such file or directory")
    assert not bad, f"{page.relative_to(ROOT)} names code that does not exist: {sorted(set(bad))}"


def test_the_code_reference_check_tells_code_from_recipe_keys():
    fields = _config_fields()
    for ref in ("serve.engine.decode", "dflash.models.registry.known_target", "data.seq_len", "train.mesh",
                "eval.client"):
        assert _dangling_reference(ref, fields) is None, ref
    assert _dangling_reference("serve.generate.decode_step", fields) == "no module serve/generate.py"
    assert "defines no 'speculative_generate'" in _dangling_reference("serve.speculative.speculative_generate", fields)


def test_study_scripts_write_dated_study_pages_and_performance_scripts_benchmarks_md(tmp_path, monkeypatch):
    from benchmarks import _report

    assert _report.DOC == DOCS / "benchmarks.md"
    monkeypatch.setattr(_report, "STUDIES", tmp_path)
    monkeypatch.setattr(_report, "INDEX", tmp_path / "README.md")
    (tmp_path / "README.md").write_text("# Studies\n\nPages added by the scripts:\n")
    page = _report.write_study("drafter_tau_a_b", "## Drafters on held-out prompts: a vs b\n\n| t |\n")
    assert page.parent == tmp_path and re.fullmatch(r"\d{4}-\d\d-\d\d-drafter-tau-a-b\.md", page.name)
    text = page.read_text()
    assert text.startswith(f"# {page.stem[:10]}: Drafters on held-out prompts: a vs b\n")
    assert "<!-- begin drafter_tau_a_b -->" in text
    assert (tmp_path / "README.md").read_text().endswith(
        f"- [{page.stem[:10]}: Drafters on held-out prompts: a vs b]({page.name})\n")
    # --page adds to an existing page, and a rerun replaces its section in place.
    _report.write_study("tau_vs_compute", "## Real τ\n\nfirst\n", page)
    _report.write_study("tau_vs_compute", "## Real τ\n\nsecond\n", page)
    text = page.read_text()
    assert "second" in text and "first" not in text and text.count("<!-- begin") == 2
    assert (tmp_path / "README.md").read_text().count("- [") == 1
    for script in ("drafter_tau", "training_study", "tau_vs_compute", "data_effect"):
        source = (ROOT / "benchmarks" / f"{script}.py").read_text()
        assert "write_study(" in source and "--page" in source and "write_section" not in source, script


def test_drafter_tau_refuses_a_baseline_measured_with_other_settings(tmp_path):
    """`benchmarks/drafter_tau.py --baseline` reuses rows only when the prompts, tokens and sampling match, and a
    mismatch fails naming the field before anything loads."""
    import json
    import subprocess
    import sys

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"sets": ["gsm8k"], "skip": 0, "per_set": 6, "tokens": 96, "temperature": 0.0,
                                   "top_p": 1.0, "seed": 0, "rows": []}))
    done = subprocess.run([sys.executable, "benchmarks/drafter_tau.py", "--drafter", "a=nowhere", "--sets", "gsm8k",
                           "--skip", "0", "--tokens", "64", "--baseline", str(earlier)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "measured with other settings: {'tokens': (96, 64)}" in done.stderr, done.stderr


def test_tau_vs_compute_draws_a_run_from_held_out_files_with_its_start_as_step_zero(tmp_path):
    """`benchmarks/tau_vs_compute.py` on a run trained without in-loop evaluations: rows NAME=RUN@STEP place that
    step, NAME=RUN the newest step and the `train.init_from` drafter step 0, one line per draft rule, a row shared
    by two files counts once, and files measured with other settings are refused naming the field. With an
    in-loop evaluation in metrics.jsonl it draws that alone."""
    import json

    start, run = tmp_path / "start", tmp_path / "arm"
    for step in (50, 150):
        meta = run / "checkpoints" / str(step) / "meta"
        meta.mkdir(parents=True)
        (meta / "metadata").write_text(json.dumps({"recipe": {
            "train": {"batch_size": 2, "num_anchors": 4, "loss": "kl", "init_from": str(start)},
            "drafter": {"block_size": 4, "num_layers": 1}}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 50, "loss": 1.0}) + "\n")
    settings = {"sets": ["gsm8k"], "skip": 0, "per_set": 2, "tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 0}

    def row(path: Path, step: str | None, rule: str, tau: float) -> dict:
        return {"name": "x", "path": str(path), "step": step, "draft_rule": rule, "tau": tau, "tau/gsm8k": tau,
                "accept_per_position": [0.5, 0.25, 0.0]}

    first, second, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({**settings, "rows": [row(start, None, "sample", 1.4), row(run, "50", "sample", 1.5),
                                                      row(start, None, "argmax", 1.3)]}))
    second.write_text(json.dumps({**settings, "rows": [row(run, None, "sample", 1.6), row(start, None, "sample", 1.4),
                                                       row(tmp_path / "elsewhere", None, "sample", 9.0)]}))
    other.write_text(json.dumps({**settings, "seed": 100, "rows": []}))

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "benchmarks/tau_vs_compute.py", str(run), "--out", str(tmp_path),
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    done = script("--held-out", str(first), "--held-out", str(second))
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("| arm")]
    assert table == ["| arm: 1 layers, K=4, kl | 0 | 0.00 | argmax | 1.30 | 1.30 | 0.50 0.25 0.00 |",
                     "| arm: 1 layers, K=4, kl | 0 | 0.00 | sample | 1.40 | 1.40 | 0.50 0.25 0.00 |",
                     "| arm: 1 layers, K=4, kl | 50 | 0.00 | sample | 1.50 | 1.50 | 0.50 0.25 0.00 |",
                     "| arm: 1 layers, K=4, kl | 150 | 0.00 | sample | 1.60 | 1.60 | 0.50 0.25 0.00 |"], done.stdout
    assert "In-loop" not in done.stdout and "T=1 (seed 0)" in done.stdout and (tmp_path / "tau_vs_compute.png").exists()
    refused = script("--held-out", str(first), "--held-out", str(other))
    assert refused.returncode == 1 and "other settings" in refused.stderr and "'seed': (0, 100)" in refused.stderr
    nothing = script()
    assert nothing.returncode == 1 and "no in-loop evaluations" in nothing.stderr
    (run / "metrics.jsonl").write_text(json.dumps({"step": 50, "eval/tau": 1.7, "eval/tau/gsm8k": 1.7}) + "\n")
    in_loop = script()
    assert in_loop.returncode == 0 and "In-loop" in in_loop.stdout, in_loop.stderr
    assert "| arm: 1 layers, K=4, kl | 50 | 0.00 | 1.70 | 1.70 |" in in_loop.stdout.splitlines()


def test_every_benchmarks_section_is_dated():
    """A measurement without its date cannot be told from a stale one: every section of docs/benchmarks.md names the
    day it was measured (YYYY-MM-DD; the scripts' `--write` puts it there)."""
    sections = re.split(r"(?m)^## ", (DOCS / "benchmarks.md").read_text())[1:]
    undated = [s.split("\n", 1)[0] for s in sections if not re.search(r"\b20\d\d-\d\d-\d\d\b", s)]
    assert sections and not undated, undated


def test_recipe_comments_quote_no_demo_numbers():
    """The demo's time, speed-up and τ are recorded in one place, the README's Quick start (what fresh runs print);
    a recipe comment that quoted them went stale (issue 60): recipes name no `N.NNx` ratio, no τ value and no
    minutes of the demo."""
    quoted = re.compile(r"\d\.\d+x|\b(?:tau|τ)\s*[=~]?\s*\d\.\d+|about \d+ minutes")
    for recipe in sorted((ROOT / "configs").glob("demo*.yaml")):
        comments = [line.split("#", 1)[1] for line in recipe.read_text().splitlines() if "#" in line]
        assert not [c for c in comments if quoted.search(c)], recipe.name
    assert re.search(r"DFlash vs AR: \d\.\d+x tokens/s", (ROOT / "README.md").read_text())
