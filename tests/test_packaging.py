"""What `pip install` puts in site-packages: glmconv and glmconv_cli, never a top-level `cli` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_files import REAL_CONFIG, ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(out), str(ROOT)], check=True, capture_output=True)
    (built,) = out.glob("glmconv-*.whl")
    return built


def test_wheel_holds_glmconv_and_glmconv_cli_only(wheel: Path) -> None:
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"glmconv", "glmconv_cli"}
    entry = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                             if n.endswith("entry_points.txt"))).decode()
    assert "glmconv = glmconv_cli.main:main" in entry


def test_wheel_carries_the_real_config_the_real_cut_presets_read(wheel: Path) -> None:
    packed = zipfile.ZipFile(wheel).read("glmconv/fixtures/glm-5.3-flash.config.json")
    assert packed == REAL_CONFIG.read_bytes()
    assert not (ROOT / "fixtures").exists()  # one copy: the package's


def test_python_m_glmconv_works_beside_a_foreign_cli_package(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("raise ImportError('not glmconv')\n")
    (tmp_path / "cli" / "main.py").write_text("raise ImportError('not glmconv')\n")
    got = subprocess.run([sys.executable, "-m", "glmconv", "--version"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert got.returncode == 0 and "glmconv" in got.stdout, got.stderr
