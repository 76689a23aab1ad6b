"""What `pip install` puts in site-packages: glmconv and glmconv_cli, never a top-level `cli` package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from repo_files import ROOT


def test_wheel_holds_glmconv_and_glmconv_cli_only(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("glmconv-*.whl")
    tops = {name.split("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"glmconv", "glmconv_cli"}
    entry = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                             if n.endswith("entry_points.txt"))).decode()
    assert "glmconv = glmconv_cli.main:main" in entry


def test_python_m_glmconv_works_beside_a_foreign_cli_package(tmp_path: Path) -> None:
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("raise ImportError('not glmconv')\n")
    (tmp_path / "cli" / "main.py").write_text("raise ImportError('not glmconv')\n")
    got = subprocess.run([sys.executable, "-m", "glmconv", "--version"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert got.returncode == 0 and "glmconv" in got.stdout, got.stderr
