"""The package layers hold (docs/architecture.md): every import, lazy ones inside functions included, points
down the order below, and the module graph has no cycle.

    files  ->  configs.schema  ->  section configs (<pkg>/config.py)  ->  configs.recipe  ->  models  ->  serve
    ->  data  ->  train  ->  eval  ->  export  ->  launch  ->  benchmarks

A module may import a module of a lower layer, or one of its own package in the same layer. Section configs
may import each other (a section may embed another's dataclass), but nothing heavier than configs.schema.
`files` (durable writes, pure stdlib) is the base module: importable by everything, it imports nothing of
the project.
Modules are named here without the installed namespace (`train.loop` is `dflash.train.loop`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = ("files",)  # modules directly under dflash/, below every package
PACKAGES = ("configs", "models", "serve", "data", "train", "eval", "export", "launch", "benchmarks")
CONFIG_LEAVES = {f"{p}.config" for p in PACKAGES}
ORDER = ("models", "serve", "data", "train", "eval", "export", "launch", "benchmarks")


def layer(module: str) -> int:
    """0 the base modules, 1 schema, 2 section configs, 3 the recipe, then 4.. by ORDER."""
    if module in BASE:
        return 0
    if module == "configs.schema":
        return 1
    if module in CONFIG_LEAVES:
        return 2
    if module.startswith("configs"):
        return 3
    return 4 + ORDER.index(module.split(".")[0])


def project_modules() -> dict[str, Path]:
    modules = {name: ROOT / "dflash" / f"{name}.py" for name in BASE}
    for package in PACKAGES:
        base = ROOT if package == "benchmarks" else ROOT / "dflash"
        for path in (base / package).rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports anywhere in its body (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            name = name.removeprefix("dflash.")
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in (*BASE, *PACKAGES) and name not in ("configs", *ORDER):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def test_every_import_points_down_the_layers():
    bad = []
    for module, deps in sorted(graph().items()):
        for dep in sorted(deps):
            same_package = dep.split(".")[0] == module.split(".")[0]
            ok = layer(dep) < layer(module) or (layer(dep) == layer(module) and (same_package or layer(dep) == 2))
            if not ok:
                bad.append(f"{module} (layer {layer(module)}) imports {dep} (layer {layer(dep)})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_the_module_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return [*trail, node, dep]
            if dep not in state and (cycle := visit(dep, [*trail, node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start, [])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_violation(tmp_path):
    """The walk finds lazy imports inside functions and names the edge."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from dflash.train.loop import run_training\n    from dflash.serve import engine\n")
    modules = project_modules()
    assert imports_of(path, modules) == {"train.loop", "serve.engine"}
    assert layer("train.loop") > layer("serve.engine") > layer("models.drafter") > layer("configs.recipe")
    assert layer("configs.schema") > layer("files") == 0
    path.write_text("from dflash.files import fsync_path\nfrom dflash import files\n")
    assert imports_of(path, modules) == {"files"}


def test_loading_a_recipe_imports_neither_engine_nor_trainer_nor_jax():
    code = ("import sys; from dflash.configs.recipe import load_recipe; load_recipe('tiny'); "
            "print(sorted(m for m in sys.modules if m.removeprefix('dflash.').split('.')[0] in "
            "('serve', 'train', 'data', 'models', 'jax', 'flax') and not m.endswith('.config') "
            "and m.removeprefix('dflash.') not in ('serve', 'train', 'data', 'models')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
