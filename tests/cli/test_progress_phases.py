"""Progress that tells the truth: bytes counted once written, every phase said on a terminal, a first line at once."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.terminal import drain

from glmconv.io.torch_dist.writer import Chunk, DcpWriter
from glmconv.progress import Progress
from glmconv_cli.main import cli

GLMCONV = Path(sys.executable).with_name("glmconv")
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


def _on_a_terminal(args: list[str]) -> tuple[str, str]:
    """Run glmconv with stderr on a pseudo-terminal: (stderr without escape codes, stdout)."""
    main, sub = pty.openpty()
    proc = subprocess.Popen([str(GLMCONV), *args], stdout=subprocess.PIPE, stderr=sub, stdin=subprocess.DEVNULL)
    os.close(sub)
    seen = drain(main)
    out = proc.communicate(timeout=120)[0].decode()
    os.close(main)
    assert proc.returncode == 0, seen.decode(errors="replace")
    return ANSI.sub("", seen.decode()).replace("\r", "\n"), out


def test_terminal_says_each_phase_in_order_and_the_summarys_tensor_count(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    err, out = _on_a_terminal(["convert", str(tiny_fp8_ckpt), str(tmp_path / "mc")])
    lines = [line.strip() for line in err.splitlines() if line.strip()]
    assert lines[0] == f"convert: plan reading and auditing {tiny_fp8_ckpt}"
    said = [line.split()[1] for line in lines if re.match(r"convert: \w+( |$)", line) and "━" not in line]
    assert said == ["plan", "copy", "flush", "verify", "publish"]
    megatron = int(re.search(r"-> (\d+) Megatron tensors", out).group(1))  # the FP8 set: 185
    flush = next(line for line in lines if line.startswith("convert: flush ("))
    assert re.fullmatch(rf"convert: flush \(copy done: 0\.001 GB, {megatron} tensors, \d+\.\ds, \d+ MB/s\)", flush)
    assert f" {megatron}/{megatron} " in err  # the bar's last count: the summary's


def test_the_first_line_needs_no_torch() -> None:
    code = "import sys, glmconv.progress, glmconv_cli.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout == "False\n"


def test_bytes_count_when_written_not_when_queued(tmp_path: Path) -> None:
    prog = Progress("convert", 3 * 64, 2, enabled=False)
    seen_while_queueing = []

    def chunks():
        for c in (Chunk("a", torch.ones(4, 4)), Chunk("b", torch.ones(2, 4), row=0, shape=(4, 4)),
                  Chunk("b", torch.ones(2, 4), row=2, shape=(4, 4))):
            seen_while_queueing.append((prog.done_bytes, prog.done_items))
            yield c

    DcpWriter(tmp_path / "ck", progress=prog).write_stream(chunks(), group_bytes=1 << 30)  # one group, at the end
    assert seen_while_queueing == [(0, 0), (0, 0), (0, 0)]
    assert (prog.done_bytes, prog.done_items) == (64 + 32 + 32, 2)  # "b" counts once, with its last rows


def test_piped_stderr_gets_no_progress_at_all(tiny_fp8_ckpt: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["convert", str(tiny_fp8_ckpt), str(tmp_path / "mc")])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""  # no phases, no bar, no periodic line (tests/cli/test_progress_terminal.py: a slow one)


@pytest.mark.parametrize("phase", ["copy", "verify"])
def test_progress_says_nothing_when_not_on_a_terminal(phase: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("export", 10, 1) as prog:
        prog.phase(phase, "detail")
    assert capsys.readouterr().err == ""
