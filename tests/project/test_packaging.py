"""What `pip install` puts in site-packages: glmconv, glmconv_cli and the data package glmconv_fixtures, never a
top-level `cli` or `fixtures` package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.repo_files import DEFECTS, FIXTURES, REAL_CONFIG, ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the sources, as from a clean clone (a checkout's stale build/ is not read)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("setup.py", "setup.cfg", "README.md"):
        shutil.copy(ROOT / name, src)
    for name in ("glmconv", "cli", "fixtures"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(src)], check=True, capture_output=True)
    (built,) = out.glob("glmconv-*.whl")
    return built


def test_wheel_holds_glmconv_glmconv_cli_and_glmconv_fixtures_only(wheel: Path) -> None:
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"glmconv", "glmconv_cli", "glmconv_fixtures"}
    entry = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                             if n.endswith("entry_points.txt"))).decode()
    assert "glmconv = glmconv_cli.main:main" in entry


def test_wheel_carries_the_run_time_data_and_not_the_test_goldens(wheel: Path) -> None:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("glmconv_fixtures/")]
    assert sorted(names) == ["glmconv_fixtures/__init__.py", "glmconv_fixtures/defects.json",
                             "glmconv_fixtures/glm-5.3-flash.config.json"]
    assert zipfile.ZipFile(wheel).read("glmconv_fixtures/glm-5.3-flash.config.json") == REAL_CONFIG.read_bytes()
    assert zipfile.ZipFile(wheel).read("glmconv_fixtures/defects.json") == DEFECTS.read_bytes()


def test_the_data_has_one_copy_the_top_level_fixtures_folder(wheel: Path) -> None:
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("glmconv/") and n.endswith(".json")]
    assert sorted(p.name for p in (ROOT / "glmconv").rglob("*.json")) == []
    assert REAL_CONFIG.parent == FIXTURES and DEFECTS.parent == FIXTURES


def test_an_installed_wheel_reads_its_own_data_not_the_repository(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import glmconv_fixtures; from glmconv.fixtures.real import release_layers; "
             "from glmconv.compare.catalog import NAMES; "
             "print(glmconv_fixtures.__file__, release_layers(), len(NAMES))")
    got = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [str(site / "glmconv_fixtures" / "__init__.py"), "45", "26"]


def test_the_editable_install_reads_the_repository_folder() -> None:
    import glmconv_fixtures

    assert Path(glmconv_fixtures.__file__).parent == FIXTURES


def test_python_m_glmconv_works_beside_a_foreign_cli_package(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("raise ImportError('not glmconv')\n")
    (tmp_path / "cli" / "main.py").write_text("raise ImportError('not glmconv')\n")
    got = subprocess.run([sys.executable, "-m", "glmconv", "--version"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert got.returncode == 0 and "glmconv" in got.stdout, got.stderr
