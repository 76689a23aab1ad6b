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


def _carried_kernel_cache(tmp_path: Path, file: str) -> None:
    """tmp_path/tree/out/gpu/kernel-cache.tar.xz holding `file` ("old"), as an earlier lease packed it; tmp_path/back
    the empty $OUT it packs into."""
    (tmp_path / "old" / file).parent.mkdir(parents=True)
    (tmp_path / "old" / file).write_text("old")
    carried = tmp_path / "tree" / "out" / "gpu"
    carried.mkdir(parents=True)
    subprocess.run(["tar", "-cJf", str(carried / "kernel-cache.tar.xz"), "-C", str(tmp_path / "old"), "."], check=True)
    (tmp_path / "back").mkdir()


def test_the_kernel_cache_is_seeded_once_from_the_carried_archive_and_packed_whole(tmp_path: Path) -> None:
    """A lease starts from the kernels an earlier one compiled (out/gpu/kernel-cache.tar.xz) and hands its own back."""
    _carried_kernel_cache(tmp_path, "k/kernel.autotune.json")
    script = (f'. "{ROOT}/benchmarks/gpu_env.sh" && export TRITON_CACHE_DIR="{tmp_path}/cache" && kernel_cache && '
              'touch -d @0 "$TRITON_CACHE_DIR/.seeded" && '  # seeded before the run: a file's time is coarse
              'echo new > "$TRITON_CACHE_DIR/k/kernel.autotune.json" && kernel_cache && '
              f'echo "$TRITON_CACHE_AUTOTUNING" && save_kernel_cache "{tmp_path}/back"')
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path / "tree", check=True, capture_output=True, text=True)
    assert run.stdout.splitlines()[0] == "1"
    listed = subprocess.run(["tar", "-tJf", str(tmp_path / "back" / "kernel-cache.tar.xz")], check=True,
                            capture_output=True, text=True).stdout.split()
    assert sorted(listed) == ["./", "./k/", "./k/kernel.autotune.json"]
    assert (tmp_path / "cache" / "k" / "kernel.autotune.json").read_text() == "new\n"


def test_a_seeded_kernel_cache_the_run_did_not_add_to_is_not_packed_again(tmp_path: Path) -> None:
    """Packing 251 MB with xz takes over a minute: a cache the carried archive already holds is left as it is."""
    _carried_kernel_cache(tmp_path, "kernel.json")
    script = (f'. "{ROOT}/benchmarks/gpu_env.sh" && export TRITON_CACHE_DIR="{tmp_path}/cache" && kernel_cache && '
              f'save_kernel_cache "{tmp_path}/back"')
    run = subprocess.run(["bash", "-c", script], cwd=tmp_path / "tree", check=True, capture_output=True, text=True)
    assert run.stdout == "kernel cache unchanged: out/gpu/kernel-cache.tar.xz holds it\n"
    assert list((tmp_path / "back").iterdir()) == []
