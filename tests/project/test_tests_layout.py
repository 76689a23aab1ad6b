"""tests/ is laid out like the package: one folder per layer it tests, the shared helpers in tests/helpers.

A new test lands in the folder of the layer it tests (glmconv/<layer>/, or cli/ for the command line); a test of a
repository-wide contract lands in project/. pytest imports the test modules in its default "prepend" mode: each
folder's own path goes on sys.path, so the folders hold no __init__.py (a tests/io package would shadow the
standard library's `io`) and every test module's name is unique in the whole tree. Shared code is imported from
tests/helpers (`from helpers.checkpoints import write_hf`), never from another test module.
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers.repo_files import ROOT

TESTS = ROOT / "tests"
# folder -> what it tests: a package layer of glmconv/ (or the CLI), or something beside the layers
LAYERS = {
    "cli": "cli",  # the command line (cli/, installed as glmconv_cli), the API's checks, help, progress, README
    "compare": "glmconv/compare",  # parity: metrics, verdict, report and schema, self-test, replay
    "fixtures": "glmconv/fixtures",  # test checkpoints and the goldens
    "io": "glmconv/io",  # safetensors, torch_dist, output and publishing, untrusted input
    "kernels": "glmconv/kernels",
    "models": "glmconv/models",  # the models, transformers' reference, the megatron backend
    "numerics": "glmconv/numerics",  # FP8, dequantisation, the NaN/Inf check
    "ops": "glmconv/ops",
    "rules": "glmconv/rules",  # the mapping rules, the plan, the config, the layouts' names
    "runners": "glmconv/runners",  # convert, export, relayout, verify, audit, workers, torchrun, weight sync
}
OTHERS = {
    "project": "repository-wide contracts: architecture, typing, packaging, fixed cost, GPU scripts, this layout",
    "gpu": "the tests that need a GPU (run on the device machine)",
    "helpers": "the modules the tests share (not tests)",
}
IGNORED = {"__pycache__"}


def _folders() -> list[Path]:
    return sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name not in IGNORED and not p.name.startswith("."))


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_no_test_module_sits_directly_in_tests() -> None:
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"put these in the folder of the layer they test ({', '.join(sorted(LAYERS))}), " \
                      f"or project/, or helpers/ if they are not tests: {loose}"


def test_every_folder_of_tests_is_a_declared_one() -> None:
    undeclared = sorted(p.name for p in _folders() if p.name not in LAYERS and p.name not in OTHERS)
    assert not undeclared, f"tests/ folders not declared in {Path(__file__).name}: {undeclared}"


def test_each_layer_folder_names_a_package_of_the_repository() -> None:
    missing = sorted(f"tests/{name} -> {where}" for name, where in LAYERS.items() if not (ROOT / where).is_dir())
    assert not missing, missing


def test_the_folders_are_flat_and_hold_only_tests() -> None:
    problems = []
    for folder in _folders():
        nested = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in IGNORED)
        problems += [f"tests/{folder.name}/{n}/: a folder inside a folder" for n in nested]
        if folder.name in LAYERS or folder.name == "project":
            problems += [f"tests/{folder.name}/{p.name}: not a test module (shared code goes in tests/helpers)"
                         for p in sorted(folder.glob("*.py")) if not p.name.startswith("test_")]
    assert not problems, "\n".join(problems)


def test_only_helpers_is_a_package() -> None:
    """The prepend import mode puts each test folder on sys.path: an __init__.py would make `io` or `ops` a package
    of that name (shadowing the standard library's `io`) and change every test module's import name."""
    packages = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("__init__.py"))
    assert packages == ["helpers/__init__.py"], packages


def test_test_module_names_are_unique() -> None:
    seen: dict[str, list[str]] = {}
    for p in _test_modules():
        seen.setdefault(p.name, []).append(str(p.relative_to(TESTS)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


def test_no_test_module_imports_another() -> None:
    """A test module found through another folder's sys.path entry imports only when that folder was collected
    first: shared code lives in tests/helpers."""
    pattern = re.compile(r"^\s*(?:from\s+test_\w+\s+import|import\s+test_\w+)", re.M)
    offenders = sorted(str(p.relative_to(TESTS)) for p in [*_test_modules(), *TESTS.rglob("helpers/*.py"),
                                                          TESTS / "conftest.py"]
                       if pattern.search(p.read_text()))
    assert not offenders, offenders
