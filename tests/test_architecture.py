"""The package layers hold (docs/architecture.md): every import, lazy ones inside functions included, points
down the order below, and the module graph has no cycle.

    configs.schema  ->  section configs (<pkg>/config.py)  ->  configs.recipe  ->  models  ->  serve
    ->  data  ->  train  ->  eval  ->  export  ->  launch  ->  benchmarks

A module may import a module of a lower layer, or one of its own package in the same layer. Section configs
may import each other (a section may embed another's dataclass), but nothing heavier than configs.schema.
Modules are named here without the installed namespace (`train.loop` is `dflash.train.loop`, the file
train/loop.py at the repository root: D67); every import names the namespace.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import PACKAGE_DIRS, ROOT

PACKAGES = (*PACKAGE_DIRS, "benchmarks")
CONFIG_LEAVES = {f"{p}.config" for p in PACKAGES}
ORDER = ("models", "serve", "data", "train", "eval", "export", "launch", "benchmarks")


def layer(module: str) -> int:
    """1 schema, 2 section configs, 3 the recipe, then 4.. by ORDER."""
    if module == "configs.schema":
        return 1
    if module in CONFIG_LEAVES:
        return 2
    if module.startswith("configs"):
        return 3
    return 4 + ORDER.index(module.split(".")[0])


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
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
            if name and name.split(".")[0] in PACKAGES and name not in ("configs", *ORDER):
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
    path.write_text("from dflash.data.files import fsync_path\nfrom dflash.data import files\n")
    assert imports_of(path, modules) == {"data.files"}


def test_loading_a_recipe_imports_neither_engine_nor_trainer_nor_jax():
    code = ("import sys; from dflash.configs.recipe import load_recipe; load_recipe('tiny'); "
            "print(sorted(m for m in sys.modules if m.removeprefix('dflash.').split('.')[0] in "
            "('serve', 'train', 'data', 'models', 'jax', 'flax') and not m.endswith('.config') "
            "and m.removeprefix('dflash.') not in ('serve', 'train', 'data', 'models')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def bypassing_imports(path) -> list[str]:
    """Imports in `path` that reach a package folder without the `dflash.` namespace (`import train.loop`,
    `from serve import engine`) or relatively (`from . import x`): either loads a second copy of the module."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bad += [alias.name for alias in node.names if alias.name.split(".")[0] in PACKAGE_DIRS]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                bad.append("." * node.level + (node.module or ""))
            elif node.module and node.module.split(".")[0] in PACKAGE_DIRS:
                bad.append(node.module)
    return bad


def test_every_import_names_the_namespace(tmp_path):
    """With the repository root on sys.path (`python -m pytest`, a benchmark script), `import train` would load
    train/ a second time as a top-level package, apart from `dflash.train`: every file imports through `dflash.`."""
    files = [p for folder in (*PACKAGE_DIRS, "tests", "benchmarks", "tools") for p in (ROOT / folder).rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in bypassing_imports(p)]
    assert not bad, "imports that bypass the dflash namespace (write `from dflash.<folder>...`):\n" + "\n".join(bad)
    probe = tmp_path / "m.py"
    probe.write_text("import train.loop\nfrom serve import engine\nfrom . import x\nfrom dflash.data import files\n")
    assert bypassing_imports(probe) == ["train.loop", "serve", "."]


def test_every_package_folder_is_installed():
    """pyproject lists each package explicitly (a mapped namespace cannot be found by setuptools' `find`): a new
    sub-package must be added there, or it is missing from the wheel and the editable tree."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {"dflash." + ".".join(init.parent.relative_to(ROOT).parts)
               for folder in PACKAGE_DIRS for init in (ROOT / folder).rglob("__init__.py")}
    assert on_disk == listed, f"packages on disk {sorted(on_disk)} != pyproject's packages {sorted(listed)}"


def test_imports_resolve_to_the_root_folders_from_the_repository_root():
    """Run from the repository root (sys.path[0] is the root), `dflash.<folder>` is the root folder's code, and
    importing the CLI and the engine leaves no stray top-level copy of a package folder in sys.modules."""
    code = ("import sys, dflash.launch.cli, dflash.serve.engine, dflash.train.loop; from pathlib import Path; "
            "print(Path(dflash.train.loop.__file__).resolve()); "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PACKAGE_DIRS!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    where, stray = out.stdout.strip().splitlines()
    assert where == str(ROOT / "train" / "loop.py")
    assert stray == "[]", stray


def test_the_wheel_holds_the_namespace(tmp_path):
    """A non-editable build (what the Docker image installs) puts each folder under dflash/ with its data files,
    and nothing else of the repository."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("dflash_tpu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("dflash/train/loop.py", "dflash/configs/smollm2.yaml", "dflash/data/files.py",
                 "dflash/data/assets/drafters/smollm2-dflash/model.safetensors"):
        assert name in names, name
    assert {n.split("/")[0] for n in names} == {"dflash", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "dflash/__init__.py" not in names


# ----------------------------------------------------------------------------- function sizes (issue 60)
MAX_PARAMETERS = 10  # more travel together: a typed frozen options value (`launch.serving.ServeOptions`, D107)
MAX_CLI_LINES = 80  # a command's arguments live beside its cmd_* (`add_<command>_args`), not in one long builder


def functions(path: Path) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method in a file, nested ones included."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(), str(path)), "")
    return found


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of a function: positional, keyword-only, *args and **kwargs each one; a leading self or cls
    not counted."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def long_parameter_lists(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{node.lineno} {name} takes {parameter_count(node)} parameters"
            for package in PACKAGE_DIRS for path in sorted((root / package).rglob("*.py"))
            for name, node in functions(path) if parameter_count(node) > MAX_PARAMETERS]


def test_no_product_function_takes_more_than_ten_parameters():
    """Parameters that travel together are one typed frozen value (issue 60, D107); tests, benchmarks and tools
    are not product code."""
    assert long_parameter_lists(ROOT) == []


def test_the_parameter_count_sees_a_long_list(tmp_path):
    (tmp_path / "serve").mkdir(parents=True)
    (tmp_path / "serve" / "m.py").write_text(
        "class C:\n    def __init__(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n"
        "def f(a, b, c, d, e, f, g, h, i, *args, k=1, **kwargs):\n    def inner(self, *, a, b, c, d, e, f, g, h, i, j,"
        " k):\n        pass\n")
    assert [r for r in long_parameter_lists(tmp_path)] == ["serve/m.py:4 f takes 12 parameters",
                                                             "serve/m.py:5 f.inner takes 11 parameters"]


def test_no_cli_function_is_longer_than_eighty_lines():
    cli = functions(ROOT / "launch" / "cli.py")
    sizes = {(name, node.lineno): node.end_lineno - node.lineno + 1 for name, node in cli}
    long = [f"launch/cli.py:{line} {name}: {n} lines" for (name, line), n in sizes.items() if n > MAX_CLI_LINES]
    assert long == []


# what builds an engine or a server and chooses a plan: `launch.serving.build_servers` alone among launch's modules
SERVING_NAMES = ("Engine", "plan_from", "Measured", "serve_in_process", "make_server")


def names_used(path: Path) -> set[str]:
    """The names a module imports or reads (bare and attribute names)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
    return found


def test_one_way_to_serve_a_recipe():
    """`dflash serve` and `dflash demo`'s evaluation serve through `launch.serving.build_servers` (issue 60): no
    other launch module builds an engine, a server or a plan, or chooses `auto` values; and no product code asks a
    plan whether it is AR by its class (`Plan.ar` says)."""
    others = {p.name: sorted(names_used(p) & set(SERVING_NAMES)) for p in sorted((ROOT / "launch").glob("*.py"))
              if p.name != "serving.py"}
    assert {name: used for name, used in others.items() if used} == {}
    assert "demo.py" in others and {"build_servers", "running"} <= names_used(ROOT / "launch" / "demo.py")
    by_class = [f"{path.relative_to(ROOT)}:{node.lineno}" for package in PACKAGE_DIRS
                for path in sorted((ROOT / package).rglob("*.py"))
                for node in ast.walk(ast.parse(path.read_text(), str(path)))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"
                and len(node.args) == 2 and getattr(node.args[1], "id", None) == "AR"]
    assert by_class == []
