"""Honest dependencies: every third-party module the code imports is declared in pyproject.toml, every declared
dependency is imported (or listed below with why it is needed anyway), and the two locks agree with the pins.

Runtime code (the package folders, `dflash.<folder>`) may import only `[project] dependencies`; tests, benchmarks and
tools may also import the `dev` extra. Imports are found with `ast` (module level and inside functions alike) and
mapped to distributions with `importlib.metadata.packages_distributions()`, so the venv this runs in must hold the
dev set (`bin/setup`).
"""

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from conftest import PACKAGE_DIRS

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Files not scanned: the golden-file generators run in a separate environment with torch and transformers
# (README "Golden files", docs/decisions.md D2), and the engines tier's helpers in .venv-engines (its own lock,
# requirements-engines.lock: docs/development.md), never in the project venv.
EXCLUDED = {
    "tools/golden_families.py": "torch + transformers environment (golden files)",
    "tools/golden_smollm2.py": "torch + transformers environment (golden files)",
    "tools/golden_speculators.py": "torch + transformers + speculators environment (golden files)",
    "tools/golden_tiny.py": "torch + transformers environment (golden files)",
    "tools/golden_zlab.py": "torch + transformers environment (golden files)",
    "tools/engines/hf_target.py": "the engines environment (.venv-engines: requirements-engines.lock)",
    "tools/engines/speculators_logits.py": "the engines environment (.venv-engines: requirements-engines.lock)",
    "tools/engines/vllm_loader.py": "the engines environment (.venv-engines: requirements-engines.lock)",
}
# a file importing these must be listed in EXCLUDED (they live in the golden-file and engines environments only)
TORCH_ENV_MODULES = {"torch", "transformers", "vllm", "speculators"}

# Declared dependencies that no scanned file imports, each with what uses it.
NOT_IMPORTED = {
    "jaxlib": "jax's compiled backend: jax imports it, and it is pinned with jax so the pair moves together",
    "ruff": "the linter, run as a command (`.venv/bin/ruff check .`)",
    "pytest-xdist": "a pytest plugin: bin/test runs the suite in 2 worker processes with it (`-n`)",
    "lm-eval": "run as `python -m lm_eval` in a subprocess by tests/test_server_compat.py",
    "guidellm": "run as its console script `guidellm benchmark` in a subprocess by tests/test_server_compat.py",
    "basedpyright": "run as `python -m basedpyright` in a subprocess by tests/test_language_server.py",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec).group(0))


def _pins(specs: list[str]) -> dict[str, str]:
    pins = {}
    for spec in specs:
        assert "==" in spec, f"dependency {spec!r} must be pinned with ==; received no == pin"
        pins[_requirement_name(spec)] = spec.split("==")[1].strip()
    return pins


RUNTIME = _pins(PYPROJECT["project"]["dependencies"])
DEV = _pins(PYPROJECT["project"]["optional-dependencies"]["dev"])


def _python_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if str(p.relative_to(ROOT)) not in EXCLUDED)


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in one file, at any depth (functions, `if TYPE_CHECKING`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _is_local(name: str, path: Path) -> bool:
    """The project itself, a repository folder (`benchmarks`), or, for a test or script (run with its folder on
    sys.path), a sibling module (`conftest`, `test_export`)."""
    if name == "dflash":
        return True
    in_package = any(path.is_relative_to(ROOT / folder) for folder in PACKAGE_DIRS)
    bases = [ROOT] if in_package else [ROOT, path.parent]
    return any((base / name).is_dir() or (base / f"{name}.py").is_file() for base in bases)


def _third_party(folders) -> dict[str, set[str]]:
    """Top-level third-party module -> files (relative) that import it."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in _python_files(folder):
            for name in _imports(path):
                if name in sys.stdlib_module_names or _is_local(name, path):
                    continue
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distributions(module: str) -> set[str]:
    return {_normalize(d) for d in _installed().get(module, [])}


def _undeclared(imports: dict[str, set[str]], allowed: set[str]) -> list[str]:
    problems = []
    for module, files in sorted(imports.items()):
        if not _distributions(module) & allowed:
            dists = sorted(set(_installed().get(module, [])))
            provided = f"provided by {', '.join(dists)}" if dists else "not installed here"
            problems.append(f"{module} ({provided}) imported by {', '.join(sorted(files))}")
    return problems


def test_runtime_code_imports_only_runtime_dependencies():
    problems = _undeclared(_third_party(PACKAGE_DIRS), set(RUNTIME))
    assert not problems, ("the packages import modules whose distribution is not in [project] dependencies; declare "
                          "each in pyproject.toml at its requirements.lock version:\n  " + "\n  ".join(problems))


def test_tests_benchmarks_and_tools_import_only_declared_dependencies():
    problems = _undeclared(_third_party(["tests", "benchmarks", "tools"]), set(RUNTIME) | set(DEV))
    assert not problems, ("tests/, benchmarks/ or tools/ import modules declared neither in [project] dependencies "
                          "nor in the dev extra; declare each (dev extra) or, for a torch-environment script, "
                          "list it in EXCLUDED:\n  " + "\n  ".join(problems))


def test_torch_environment_scripts_are_the_excluded_ones():
    for folder in (*PACKAGE_DIRS, "tests", "benchmarks", "tools"):
        for path in _python_files(folder):
            torch_env = _imports(path) & TORCH_ENV_MODULES
            assert not torch_env, (f"{path.relative_to(ROOT)} imports {sorted(torch_env)}, which live only in the "
                                   "golden-file or engines environment; list the file in EXCLUDED if it runs there")
    for name in EXCLUDED:
        assert (ROOT / name).is_file(), f"EXCLUDED lists {name}, which does not exist; remove it from the list"


def test_every_declared_dependency_is_imported_or_justified():
    runtime_used = {d for m in _third_party(PACKAGE_DIRS) for d in _distributions(m)}
    all_used = runtime_used | {d for m in _third_party(["tests", "benchmarks", "tools"]) for d in _distributions(m)}
    unused_runtime = sorted(set(RUNTIME) - runtime_used - set(NOT_IMPORTED))
    assert not unused_runtime, (f"[project] dependencies {unused_runtime} are imported by no package; "
                                "remove them (or move them to the dev extra), or list each in NOT_IMPORTED with why")
    unused_dev = sorted(set(DEV) - all_used - set(NOT_IMPORTED))
    assert not unused_dev, (f"dev dependencies {unused_dev} are imported by no test, benchmark or tool; remove them, "
                            "or list each in NOT_IMPORTED with why")
    stale = sorted(set(NOT_IMPORTED) - set(RUNTIME) - set(DEV))
    assert not stale, f"NOT_IMPORTED lists {stale}, which pyproject.toml does not declare; remove them from the list"


def _lock(name: str) -> dict[str, str]:
    lines = (ROOT / name).read_text().splitlines()
    return {_normalize(n): v for n, v in (line.split("==") for line in lines if line and not line.startswith("#"))}


def test_the_locks_hold_the_pins_runtime_and_dev_apart():
    runtime_lock, dev_lock = _lock("requirements.lock"), _lock("requirements-dev.lock")
    assert not set(runtime_lock) & set(dev_lock), (
        f"{sorted(set(runtime_lock) & set(dev_lock))} are in both locks; rerun tools/lock.sh")
    for name, version in RUNTIME.items():
        assert runtime_lock.get(name) == version, (
            f"{name}=={version} (pyproject) must be in requirements.lock; received {runtime_lock.get(name)}; "
            "rerun tools/lock.sh")
    union = runtime_lock | dev_lock
    for name, version in DEV.items():
        assert union.get(name) == version, (
            f"dev {name}=={version} (pyproject) must be in requirements-dev.lock or requirements.lock; received "
            f"{union.get(name)}; rerun tools/lock.sh")
    assert {"pytest", "ruff", "openai", "lm-eval"} <= set(dev_lock)  # none of them reaches the runtime lock


def test_the_image_installs_the_runtime_lock_only():
    instructions = [line for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines()
                    if not line.lstrip().startswith("#")]
    assert any("pip install -r requirements.lock" in line for line in instructions)
    dev = [line for line in instructions if "requirements-dev.lock" in line or ".[dev]" in line]
    assert not dev, f"docker/Dockerfile must install the runtime lock only; received {dev}"
