"""Issues 14 and 27, fixed cost: the commands that need no tensor import no torch (its import alone is 1-6 s):
every --help, audit-names, and the dry runs of convert, export and relayout. A convert imports torch but not
torch.distributed.checkpoint (its package pulls torch.distributed.tensor and sympy: 0.6-0.9 s), and neither do the
commands that read a torch_dist checkpoint's tensors (export, verify)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.repo_files import REAL_CONFIG as CONFIG

RUN = """
import runpy, sys
sys.argv = ["glmconv", *sys.argv[1:]]
try:
    runpy.run_module("glmconv", run_name="__main__")
except SystemExit as exc:
    code = exc.code
stack = ("glmconv.compare", "glmconv.models", "glmconv.weight_sync", "glmconv.kernels", "glmconv_cli.parity_cmd")
parity = sorted({m for m in sys.modules for p in stack if m == p or m.startswith(p + ".")})
runners = sorted(r for r in ("convert", "export", "relayout", "verify") if "glmconv.runners." + r in sys.modules)
print("exit", code, "torch", "torch" in sys.modules, "dcp", "torch.distributed.checkpoint" in sys.modules,
      "parity", ",".join(parity) or "-", "runners", ",".join(runners) or "-", file=sys.stderr)
"""


def _run(*args: str) -> list[str]:
    res = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120)
    return res.stderr.strip().splitlines()[-1].split()


def imports_torch(*args: str) -> tuple[int, bool]:
    """(exit code, whether torch was imported) of `glmconv ARGS` in a fresh interpreter."""
    last = _run(*args)
    return int(last[1]), last[3] == "True"


def parity_modules(*args: str) -> tuple[int, str]:
    """(exit code, the modules of the parity stack imported, comma-separated, or "-") of `glmconv ARGS`."""
    last = _run(*args)
    return int(last[1]), last[7]


def command_runners(*args: str) -> tuple[int, str]:
    """(exit code, the commands' runners imported among convert, export, relayout and verify, comma-separated)."""
    last = _run(*args)
    return int(last[1]), last[9]


def imports_dcp(*args: str) -> tuple[int, bool]:
    """(exit code, whether torch.distributed.checkpoint was imported) of `glmconv ARGS` in a fresh interpreter."""
    last = _run(*args)
    return int(last[1]), last[5] == "True"


EVERY_HELP = """
import sys
import click
from glmconv_cli.main import cli

def paths(cmd, prefix):
    yield prefix
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from paths(cmd.get_command(ctx, name), [*prefix, name])

for path in paths(cli, []):
    try:
        cli.main([*path, "--help"], standalone_mode=False, prog_name="glmconv")
    except SystemExit:
        pass
    print(" ".join(["glmconv", *path]), "torch" in sys.modules, file=sys.stderr)
"""


def test_every_help_imports_no_torch() -> None:
    res = subprocess.run([sys.executable, "-c", EVERY_HELP], capture_output=True, text=True, timeout=120)
    seen = dict(line.rsplit(" ", 1) for line in res.stderr.strip().splitlines())
    assert {"glmconv", "glmconv convert", "glmconv export", "glmconv verify", "glmconv fixture make"} <= set(seen)
    assert [cmd for cmd, torch in seen.items() if torch != "False"] == []


def test_a_config_audit_imports_no_torch() -> None:
    assert imports_torch("audit-names", str(CONFIG)) == (0, False)


def test_audit_of_an_hf_directory_imports_no_torch(tiny_fp8_ckpt: Path) -> None:
    assert imports_torch("audit-names", str(tiny_fp8_ckpt)) == (0, False)


def test_a_dry_run_with_auto_workers_and_device_imports_no_torch(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    args = ["convert", str(tiny_fp8_ckpt), str(tmp_path / "out"), "--dry-run", "--workers", "auto", "--json"]
    assert imports_torch(*args) == (0, False)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def tiny_mc(tiny_fp8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glmconv.runners import convert

    out = tmp_path_factory.mktemp("fixed") / "mc"
    convert.convert(convert.prepare(tiny_fp8_ckpt, out), convert.RunOptions(progress=False))
    return out


def test_an_export_dry_run_imports_no_torch(tiny_fp8_ckpt: Path, tiny_mc: Path, tmp_path: Path) -> None:
    args = ["export", str(tiny_mc), str(tmp_path / "out"), "--dry-run", "--fp8", "--like", str(tiny_fp8_ckpt)]
    assert imports_torch(*args) == (0, False)


def test_a_relayout_dry_run_imports_no_torch(tiny_mc: Path, tmp_path: Path) -> None:
    assert imports_torch("relayout", str(tiny_mc), str(tmp_path / "out"), "--to", "mcore", "--dry-run") == (0, False)


def test_audit_of_a_torch_dist_checkpoint_imports_no_torch(tiny_mc: Path) -> None:
    assert imports_torch("audit-names", str(tiny_mc)) == (0, False)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_convert_writes_its_metadata_without_importing_dcp(tiny_fp8_ckpt: Path, tmp_path: Path, workers: str) -> None:
    out = tmp_path / "out"
    assert imports_dcp("convert", str(tiny_fp8_ckpt), str(out), "--workers", workers) == (0, False)
    assert (out / "release" / ".metadata").is_file()


def test_an_export_reads_its_checkpoint_without_importing_dcp(tiny_mc: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert imports_dcp("export", str(tiny_mc), str(out), "--fp8") == (0, False)
    assert (out / "model.safetensors.index.json").is_file()


def test_a_verify_reads_both_checkpoints_without_importing_dcp(tiny_fp8_ckpt: Path, tiny_mc: Path) -> None:
    assert imports_dcp("verify", str(tiny_fp8_ckpt), str(tiny_mc)) == (0, False)


def test_convert_export_and_verify_import_none_of_the_parity_stack(tiny_fp8_ckpt: Path, tiny_mc: Path,
                                                                    tmp_path: Path) -> None:
    """Each command imports what it runs (glmconv_cli.main's COMMANDS, glmconv's lazy names): the start of a run
    on a machine with slow imports is Python, torch and the command's own modules."""
    assert parity_modules("convert", str(tiny_fp8_ckpt), str(tmp_path / "mc")) == (0, "-")
    assert parity_modules("export", str(tiny_mc), str(tmp_path / "hf"), "--fp8") == (0, "-")
    assert parity_modules("verify", str(tiny_fp8_ckpt), str(tiny_mc)) == (0, "-")


def test_convert_and_export_import_no_other_commands_runner(tiny_fp8_ckpt: Path, tiny_mc: Path,
                                                            tmp_path: Path) -> None:
    """glmconv.api imports a command's runner in its call: a convert's start loads no export, relayout or verify."""
    assert command_runners("convert", str(tiny_fp8_ckpt), str(tmp_path / "mc")) == (0, "convert")
    assert command_runners("export", str(tiny_mc), str(tmp_path / "hf"), "--fp8") == (0, "export")
