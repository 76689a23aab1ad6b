"""Issue 14, fixed cost: the commands that need no tensor import no torch (its import alone is 1-6 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[1] / "glmconv" / "fixtures" / "glm-5.3-flash.config.json"
RUN = """
import runpy, sys
sys.argv = ["glmconv", *sys.argv[1:]]
try:
    runpy.run_module("glmconv", run_name="__main__")
except SystemExit as exc:
    code = exc.code
print("exit", code, "torch", "torch" in sys.modules, file=sys.stderr)
"""


def imports_torch(*args: str) -> tuple[int, bool]:
    """(exit code, whether torch was imported) of `glmconv ARGS` in a fresh interpreter."""
    res = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120)
    last = res.stderr.strip().splitlines()[-1].split()
    return int(last[1]), last[3] == "True"


@pytest.mark.parametrize("args", [["--help"], ["convert", "--help"], ["audit-names", str(CONFIG)]],
                         ids=["help", "convert-help", "audit-names-config"])
def test_help_and_a_config_audit_import_no_torch(args: list[str]) -> None:
    assert imports_torch(*args) == (0, False)


def test_audit_of_an_hf_directory_imports_no_torch(tiny_fp8_ckpt: Path) -> None:
    assert imports_torch("audit-names", str(tiny_fp8_ckpt)) == (0, False)


def test_a_dry_run_with_auto_workers_and_device_imports_no_torch(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    args = ["convert", str(tiny_fp8_ckpt), str(tmp_path / "out"), "--dry-run", "--workers", "auto", "--json"]
    assert imports_torch(*args) == (0, False)
    assert list(tmp_path.iterdir()) == []
