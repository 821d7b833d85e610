"""A newcomer's editor resolves every `dflash.<folder>` import (docs/development.md "Editors").

There is no dflash/ folder: the namespace exists only as the editable install's tree of links in the project venv
(docs/decisions.md D67), so a static tool resolves `dflash.*` only when it reads that venv. pyproject.toml's
[tool.pyright] points pyright and basedpyright at it, whatever interpreter an editor hands them. Checked with the
project's basedpyright (the dev extra) as an editor runs it: from the repository root, configured by
pyproject.toml alone, and handed the venv's base Python (a Python without dflash, as a system Python or an editor's
own pick would be), on one generated file that imports every module of the package folders. One run, about 10 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT

# A module of the namespace that does not exist: the run must report it, or the check could not fail.
CONTROL = "dflash.serve.no_such_module"


def namespace_modules() -> list[str]:
    """`dflash.<folder>` and `dflash.<folder>.<module>` for every .py file of the package folders."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = []
    for package, folder in package_dir.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules.append(".".join([package, *parts]))
    return modules


def base_python() -> Path:
    """The interpreter this venv was made from: no dflash on its path (checked), so only the config can help."""
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert python.is_file(), f"the venv's base Python must exist to play the editor's interpreter; received {python}"
    probe = subprocess.run([str(python), "-I", "-c", "import dflash.serve"], capture_output=True)
    assert probe.returncode != 0, (f"{python} imports dflash itself, so it cannot show that pyproject's [tool.pyright] "
                                   "is what resolves the imports; run the tests from a venv made by bin/setup")
    return python


@pytest.fixture(scope="module")
def unresolved(tmp_path_factory) -> tuple[list[str], list[str]]:
    """(the modules imported, those basedpyright reports unresolved), from one run on one generated file."""
    venv = (ROOT / ".venv").resolve()
    assert Path(sys.prefix).resolve() == venv, (
        f"pyproject's [tool.pyright] points editors at {venv} (bin/setup's default); this suite runs from "
        f"{sys.prefix} (DFLASH_VENV?); run it from the default venv, or the check would read another venv's files")
    modules = [*namespace_modules(), CONTROL]
    source = tmp_path_factory.mktemp("lsp") / "imports_every_module.py"
    source.write_text("".join(f"import {m}\n" for m in modules))
    run = subprocess.run(
        [sys.executable, "-m", "basedpyright", "--outputjson", "--pythonpath", str(base_python()), str(source)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"basedpyright must print its JSON report; received rc {run.returncode}, stdout "
                             f"{run.stdout[-2000:]!r}, stderr {run.stderr[-2000:]!r}") from None
    assert report["summary"]["filesAnalyzed"] == 1, f"basedpyright analysed {report['summary']}; expected the one file"
    missing = [modules[d["range"]["start"]["line"]] for d in report["generalDiagnostics"]
               if d.get("rule") == "reportMissingImports"]
    return modules, missing


def test_every_dflash_module_resolves(unresolved):
    modules, missing = unresolved
    not_found = [m for m in missing if m != CONTROL]
    assert len(modules) > 50, f"the package folders hold {len(modules) - 1} modules; expected all of them (~90)"
    assert not not_found, (
        f"{len(not_found)} of {len(modules) - 1} dflash modules do not resolve for a language server: "
        f"{not_found}; check pyproject's [tool.pyright] (venvPath/venv) and that bin/setup made .venv's editable "
        "install (a module added since needs bin/setup again)")


def test_a_missing_module_is_reported(unresolved):
    _, missing = unresolved
    assert missing.count(CONTROL) == 1, (f"basedpyright must report {CONTROL} (which does not exist) unresolved; "
                                         f"received unresolved {missing}")
