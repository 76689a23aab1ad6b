"""The README's Python API example runs as written, and `import glmconv` lists the API without importing torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo_files import ROOT


def _example(which: int = 0) -> str:
    """The `which`-th python block of the README's Python API section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[which]


def test_readme_python_example_runs_twice_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run finds the first one's directories and replaces them
        exec(compile(_example(), "README.md", "exec"), {})
        out = capsys.readouterr().out
        assert out.splitlines() == ["185 Megatron tensors", "demo/no-such-dir: no such file or directory"]
    assert (tmp_path / "demo" / "hf2" / "model.safetensors.index.json").is_file()


def test_readme_weight_sync_example_runs_twice_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        exec(compile(_example(1), "README.md", "exec"), {})
        assert "decoder.layers.0.bogus.weight: not a Megatron parameter" in capsys.readouterr().out


def test_import_glmconv_lists_the_api_without_torch() -> None:
    code = ("import sys, glmconv; assert 'torch' not in sys.modules, 'torch imported';"
            "print(sorted(glmconv.__all__))")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0, got.stderr
    for name in ("convert", "export", "audit", "verify", "parity", "hf_weights", "load_config", "build_plan",
                 "GlmconvError"):
        assert f"'{name}'" in got.stdout


def test_api_functions_have_docstrings() -> None:
    import glmconv

    assert all(getattr(glmconv, n).__doc__ for n in ("convert", "export", "audit", "verify", "parity", "hf_weights",
                                                     "load_config", "build_plan"))
