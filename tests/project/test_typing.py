"""mypy's configuration keeps the core strict: the config says so, and mypy refuses an untyped def planted there."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRICT_FLAGS = ("disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls",
                "disallow_any_generics", "warn_return_any", "no_implicit_reexport")
STRICT_SCOPE = ("glmconv.rules.*", "glmconv.io.*", "glmconv.runners.*", "glmconv.api", "glmconv.numerics.*")


def _strict_patterns() -> set[str]:
    """The module patterns of every mypy.ini section that turns on all of STRICT_FLAGS."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "mypy.ini")
    found: set[str] = set()
    for name in cfg.sections():
        if name.startswith("mypy-") and all(cfg.getboolean(name, f, fallback=False) for f in STRICT_FLAGS):
            found.update(p.strip() for p in name.removeprefix("mypy-").split(","))
    return found


def test_core_packages_are_strict() -> None:
    assert set(STRICT_SCOPE) <= _strict_patterns()


def test_no_global_ignore_missing_imports() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "mypy.ini")
    assert not cfg.getboolean("mypy", "ignore_missing_imports", fallback=False)


@pytest.mark.skipif(shutil.which("mypy", path=str(Path(sys.executable).parent)) is None, reason="mypy not installed")
def test_untyped_def_in_strict_module_fails(tmp_path: Path) -> None:
    """A copy of a small strict module (glmconv/rules/roles.py) with an untyped function planted is refused."""
    pkg = tmp_path / "glmconv" / "rules"
    pkg.mkdir(parents=True)
    (tmp_path / "glmconv" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    text = (ROOT / "glmconv" / "rules" / "roles.py").read_text()
    (pkg / "roles.py").write_text(text + "\n\ndef planted(x):\n    return x\n")
    cmd = [str(Path(sys.executable).parent / "mypy"), "--config-file", str(ROOT / "mypy.ini"), "--no-incremental",
           "--follow-imports=silent", "-m", "glmconv.rules.roles"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "MYPYPATH": str(tmp_path)})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "planted" in run.stdout or "Function is missing a type annotation" in run.stdout
    assert "no-untyped-def" in run.stdout
