"""The GPU scripts run the tree in place on the device machine, where nothing is pip-installed: every package
setup.py installs under another name must be linked onto their PYTHONPATH (a missing data package there cost
a whole device run: every command failed on `glmconv_fixtures`)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from helpers.repo_files import ROOT

SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("gpu_*.sh") if p.name != "gpu_env.sh")


def renamed_packages() -> dict[str, str]:
    """setup.py's package_dir: installed name -> folder."""
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "package_dir":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no package_dir")


def test_link_packages_links_every_renamed_package(tmp_path: Path) -> None:
    subprocess.run(["bash", "-c", f'. benchmarks/gpu_env.sh && link_packages "{tmp_path}" "{ROOT}"'], cwd=ROOT,
                   check=True)
    linked = {p.name: p.resolve() for p in tmp_path.iterdir()}
    assert linked == {name: ROOT / folder for name, folder in renamed_packages().items()}


def test_every_gpu_script_links_the_packages() -> None:
    assert SCRIPTS, "no benchmarks/gpu_*.sh"
    for script in SCRIPTS:
        text = script.read_text()
        assert ". benchmarks/gpu_env.sh" in text and "link_packages /tmp/glmconv-cli" in text, script.name
