"""The architecture holds by contract (docs/architecture.md): layers that only import downward, no import cycle,
late imports only of the heavy packages, and one definition of every default and choice list."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from helpers.repo_files import ROOT

PACKAGES = {"glmconv": ROOT / "glmconv", "glmconv_cli": ROOT / "cli"}
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
# What a function may import late: torch and the packages only the GPU paths, the report's plot or a real
# trainer need (each costs seconds, or is an optional extra). Nothing of glmconv's own, but one module:
LATE_OK = {"torch", "numpy", "safetensors", "transformers", "megatron", "fla", "triton", "tilelang", "matplotlib"}
LATE_OK_OWN = {"glmconv.kernels.kpool",  # a triton module: its kernels are compiled when it is imported
               # the package's calls (glmconv/__init__.py) and the parity stack (glmconv/api.py's parity and
               # hf_weights), on first use: every run's start is Python, torch and its own command's modules
               "glmconv.api", "glmconv.compare", "glmconv.compare.metrics", "glmconv.compare.report",
               "glmconv.weight_sync",
               # each command's runner, in its call of glmconv.api: a convert's start loads no other command's
               "glmconv.runners.convert", "glmconv.runners.export", "glmconv.runners.relayout",
               "glmconv.runners.verify"}
DEFAULTS = "glmconv.defaults"


def _modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path, ast.parse(path.read_text())


def _target(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    """The names an import statement loads: `from X import y` loads X.y when that is a module, else X."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" for a in node.names]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it sits: `module`, `type_checking` or `late` (in a function or class)."""
    def walk(body: list[ast.stmt], where: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, where
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from walk(node.body, "late")
            elif _is_type_checking(node) and where == "module":
                yield from walk(node.body, "type_checking")
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        yield from walk([child], where)
    yield from walk(tree.body, "module")


def _resolved(module: str, node: ast.Import | ast.ImportFrom, is_package: bool, own: set[str]) -> set[str]:
    """The modules an import statement loads: glmconv's by full name, any other package by its top-level name."""
    out = set()
    for target in _target(module, node, is_package):
        if target.split(".")[0] not in PACKAGES:
            out.add(target.split(".")[0])
            continue
        while target and target not in own:  # a name defined in a module: the module
            target = target.rpartition(".")[0]
        if target and target != module:
            out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the glmconv modules it imports, wherever the import statement sits."""
    found = list(_modules())
    own = {m for m, _, _ in found}
    return {module: {t for node, _ in _imports(tree) for t in _resolved(module, node, path.name == "__init__.py", own)
                     if t in own} for module, path, tree in found}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layer_contract_holds() -> None:
    got = _lint_imports(ROOT)
    assert got.returncode == 0, got.stdout[-3000:]
    assert "0 broken" in got.stdout


def test_an_upward_import_inside_a_function_breaks_the_layer_contract(tmp_path: Path) -> None:
    for package, folder in PACKAGES.items():
        shutil.copytree(folder, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    assert _lint_imports(tmp_path, env).returncode == 0  # the copy is what is linted, and it holds as is
    config = tmp_path / "glmconv" / "config.py"
    planted = "\n\ndef _planted() -> None:\n    from glmconv.runners import convert  # noqa: F401\n"
    config.write_text(config.read_text() + planted)
    got = _lint_imports(tmp_path, env)
    assert got.returncode == 1
    assert "glmconv.config -> glmconv.runners.convert" in got.stdout


def test_no_import_cycle_counting_function_level_imports() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = _graph()
    graph["glmconv.errors"].add("glmconv.runners.convert")  # runners.convert imports errors: a cycle now
    assert any({"glmconv.errors", "glmconv.runners.convert"} <= set(c) for c in _cycles(graph))


def test_functions_import_late_only_torch_and_the_gpu_packages() -> None:
    found = list(_modules())
    own = {m for m, _, _ in found}
    late = {t for module, path, tree in found for node, where in _imports(tree) if where == "late"
            for t in _resolved(module, node, path.name == "__init__.py", own)}
    assert late - LATE_OK - LATE_OK_OWN == set()
    assert late >= {"torch", *LATE_OK_OWN}  # the check sees function-level imports at all


def test_type_checking_blocks_hide_no_import_of_glmconv() -> None:
    hidden = [(module, ast.unparse(node)) for module, _, tree in _modules() for node, where in _imports(tree)
              if where == "type_checking" and "glmconv" in ast.unparse(node)]
    assert hidden == []


def _assigned_names(tree: ast.Module) -> Iterator[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        for t in targets:
            yield from (e.id for e in ast.walk(t) if isinstance(e, ast.Name))


def test_every_default_and_choice_list_is_defined_in_the_defaults_module() -> None:
    elsewhere = sorted((module, name) for module, _, tree in _modules() if module != DEFAULTS
                       for name in _assigned_names(tree) if name.startswith("DEFAULT_") or name.endswith("_CHOICES"))
    assert elsewhere == []


def test_the_command_line_spells_no_choice_list_of_its_own() -> None:
    literal = [(module, node.lineno) for module, _, tree in _modules() if module.startswith("glmconv_cli")
               for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "click.Choice"
               and isinstance(node.args[0], (ast.List, ast.Tuple))]
    assert literal == []
