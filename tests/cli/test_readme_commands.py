"""Every command the README shows runs as written, twice in a row in one fresh directory, and prints what the
README says it prints.

The Quick start's console transcript is checked line by line (`...` stands for a path or a time); the Commands
block's commands must exit 0; the Quick start's transformers example runs in a fresh interpreter of the project's
environment (no GPU needed). Left out: `make` lines (they build the environment the tests run in) and shells that
are not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.repo_files import ROOT

from glmconv import fla_guard
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def transcript() -> list[tuple[str, list[str]]]:
    """The Quick start's `$ command` lines, each with the output lines shown under it."""
    steps: list[tuple[str, list[str]]] = []
    for line in _blocks(_section("Quick start"), "console")[0].splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line)
    return steps


def command_lines() -> list[str]:
    """The Commands section's glmconv lines, comments dropped."""
    lines = [line.split("  #")[0].strip() for block in _blocks(_section("Commands"), "bash")
             for line in block.splitlines()]
    return [line for line in lines if line.startswith("glmconv ")]


def _run_glmconv(command: str) -> tuple[int, str]:
    args = shlex.split(command)
    assert args[0] == "glmconv", command
    res = CliRunner(env={"COLUMNS": "500"}).invoke(cli, args[1:])  # the README shows lines unwrapped
    return res.exit_code, res.stdout


def _shown(expected: str) -> re.Pattern[str]:
    """A README output line as a pattern: `...` is any text, the rest literal."""
    return re.compile(".*".join(re.escape(part) for part in expected.split("...")))


def _check_transcript() -> None:
    for command, shown in transcript():
        code, out = _run_glmconv(command)
        assert code == 0, (command, out)
        got = out.strip().splitlines()
        assert len(got) == len(shown), (command, got, shown)
        for line, expected in zip(got, shown):
            assert _shown(expected).fullmatch(line), (command, line, expected)


def test_the_quick_start_transcript_prints_what_the_readme_shows_twice_in_a_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        _check_transcript()


def test_the_commands_section_runs_twice_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert len(command_lines()) == 13
    for _ in range(2):
        gates = []
        for command in command_lines():
            code, out = _run_glmconv(command)
            assert code == 0, (command, out)
            gates += [line for line in out.splitlines() if line.startswith("PASSED")]
        assert gates == ["PASSED (the verdict and the self-test)", "PASSED (the verdict)",
                         "PASSED (the verdict and the self-test)", "PASSED (the --fail-on bounds)"]
        assert (tmp_path / "rep" / "report.json").is_file()


def test_the_quick_start_transformers_example_runs_on_a_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for command, _ in transcript()[:4]:  # fixture, convert, verify, export: hf2 is there
        assert _run_glmconv(command)[0] == 0, command
    example = _blocks(_section("Quick start"), "python")[0]
    shown = re.search(r"# (Glm5Next\S+ \(.*\))$", example.strip()).group(1)  # type: ignore[union-attr]
    env = {k: v for k, v in os.environ.items() if k not in (fla_guard.ENV, "TRITON_INTERPRET")}
    for _ in range(2):
        got = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, env=env, timeout=300)
        assert got.returncode == 0, got.stderr[-2000:]
        assert got.stdout.strip().splitlines()[-1] == shown
        assert got.stderr == ""  # was: a 26-row UNEXPECTED table and "flash-linear-attention is not installed"


def test_what_the_transformers_example_keeps_quiet_is_what_the_readme_says(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At transformers' default verbosity the example reports the MTP weights as UNEXPECTED (the README's count of
    rows) and the torch KDA fallback, and nothing else."""
    monkeypatch.chdir(tmp_path)
    for command, _ in transcript()[:4]:
        assert _run_glmconv(command)[0] == 0, command
    example = _blocks(_section("Quick start"), "python")[0]
    loud = "\n".join(line for line in example.splitlines() if not line.startswith("transformers.logging."))
    env = {k: v for k, v in os.environ.items() if k not in (fla_guard.ENV, "TRITON_INTERPRET")}
    got = subprocess.run([sys.executable, "-c", loud], capture_output=True, text=True, env=env, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    rows = [line.split("|")[0].strip() for line in got.stderr.splitlines() if "| UNEXPECTED |" in line]
    assert rows and all(row.startswith("model.language_model.layers.4.") for row in rows)  # tiny: 4 layers + MTP
    assert f"every\nMTP weight as `UNEXPECTED` ({len(rows)} rows on `tiny`)" in _section("Quick start")
    assert "MISSING" not in got.stderr
    assert "because `flash-linear-attention` is not installed" in got.stderr


def test_the_readme_shell_completion_line_for_bash_runs(tmp_path: Path) -> None:
    line = next(line.split("  #")[0].strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith('eval "$(_GLMCONV_COMPLETE=bash_source glmconv)"'))
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    got = subprocess.run(["bash", "-c", f"{line} && complete -p glmconv"], capture_output=True, text=True,
                         env={**os.environ, "PATH": path}, cwd=tmp_path, timeout=120)
    assert got.returncode == 0 and "glmconv" in got.stdout, got.stderr


def test_make_install_names_the_venv_entry_point() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(["make", "-n", "install", "BINDIR=/nonexistent/bin"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert f"ln -sf {ROOT}/.venv/bin/glmconv /nonexistent/bin/glmconv" in dry.stdout
