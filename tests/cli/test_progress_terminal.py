"""What a terminal 80 columns wide shows of a run, and what a log file gets (issue 40): the bar says what is known
before the first write, its first ETA is near the truth, every line fits 80 columns, verify counts what its
summary counts, Ctrl-C leaves only `interrupted`, parity's bar has an ETA, and a stderr that is no terminal gets no
progress line at all."""

from __future__ import annotations

import io
import re
import shutil
import types
from pathlib import Path

import pytest
from helpers.terminal import on_a_terminal, screen
from rich.console import Console

from glmconv import progress as progress_mod
from glmconv.compare.capture import StepProgress
from glmconv.progress import Progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")


class Clock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _text(screen_io: io.StringIO) -> list[str]:
    return [line for line in re.split(r"[\r\n]", ANSI.sub("", screen_io.getvalue())) if line.strip()]


def _console(out: io.StringIO) -> Console:
    return Console(file=out, width=80, force_terminal=True)


# ---- the bar before the first write, and its ETA ----------------------------------------------------------------

def test_before_the_first_write_the_bar_says_starting_then_what_was_read() -> None:
    """Was `0.00/1.00 GB 0/306 0 MB/s ETA ?` for the ~2 s before the first write."""
    out = io.StringIO()
    with Progress("convert", 10**9, 306, console=_console(out)) as prog:
        prog.phase("copy")
        prog._rich.refresh()  # type: ignore[union-attr]
        first = _text(out)[-1]
        prog.queued(450_000_000)
        prog._rich.refresh()  # type: ignore[union-attr]
        reading = _text(out)[-1]
    assert first.endswith(" 0.00/1.00 GB 0/306 starting") and "MB/s" not in first, first
    assert reading.endswith(" 0.00/1.00 GB 0/306 reading 0.45 GB"), reading


def _shown_eta(prog: Progress) -> float | None:
    """The ETA the bar shows, in seconds (None for `?`)."""
    text = prog._eta()
    return None if text == "?" else float(text.rstrip("s"))


def _simulate(clock: Clock, groups: int, setup_s: float = 1.2, read_s: float = 13.5, write_s: float = 4.0,
              chunks: int = 16) -> list[tuple[float, float | None]]:
    """A DCP writer's run as convert does it (`groups` groups of `chunks` chunks of 1/16 GB: each read into memory
    in `read_s`, then written in `write_s`; the bench fixture's pace, 10x slower), after `setup_s` of imports:
    (true seconds left, the ETA shown) at each write."""
    size = 10**9 // chunks
    prog = Progress("convert", groups * chunks * size, groups * chunks, enabled=False)
    clock.now += setup_s
    seen: list[tuple[float, float | None]] = []
    for _ in range(groups):
        for _ in range(chunks):
            clock.now += read_s / chunks
            getattr(prog, "queued", lambda n: None)(size)  # what DcpWriter.write_stream reports as a group fills
        for _ in range(chunks):
            clock.now += write_s / chunks
            prog.advance(size)
            seen.append((clock.now, _shown_eta(prog)))
    return [(clock.now - t, eta) for t, eta in seen]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """glmconv.progress's clock, moved by hand."""
    fake = Clock()
    monkeypatch.setattr(progress_mod, "time", types.SimpleNamespace(monotonic=fake))
    return fake


@pytest.mark.parametrize("groups", [1, 4, 12])
def test_the_first_eta_shown_is_within_a_quarter_of_the_truth(groups: int, clock: Clock) -> None:
    """Was 4x to 10x too long: the rate counted torch's import and the whole first read against the first write
    (one group: ETA 224s with 3.75s left)."""
    seen = _simulate(clock, groups)
    left, eta = next((left, eta) for left, eta in seen if eta is not None)
    assert eta == pytest.approx(left, rel=0.25, abs=1), (left, eta)
    assert all(eta is None or eta == pytest.approx(left, rel=0.25, abs=1) for left, eta in seen)


def test_without_a_group_the_eta_is_the_pace_of_the_writes(clock: Clock) -> None:
    """export and verify write as they read (no `queued`): the time between writes is the pace; the first write's
    wait (imports, the first read) is no part of it."""
    prog = Progress("export", 100, 10, enabled=False)
    clock.now = 5.0  # imports
    for _ in range(5):
        clock.now += 1.0
        prog.advance(10)
    assert _shown_eta(prog) == 5.0


# ---- 80 columns: every line fits, none wraps; verify counts what it reports; Ctrl-C -----------------------------

@pytest.fixture(scope="module")
def mc(cut8_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("progress-terminal") / "mc"
    run = on_a_terminal(["convert", str(cut8_ckpt), str(out)])
    assert run.returncode == 0, run.raw
    return out


def test_convert_on_80_columns_leaves_one_line_per_phase_none_wrapped(cut8_ckpt: Path, tmp_path: Path) -> None:
    """Was: `convert: flush (copy done: ... Megatron tensors in 1.0s (2` and `MB/s))` on two rows."""
    out = tmp_path / "mc"
    run = on_a_terminal(["convert", str(cut8_ckpt), str(out)])
    assert run.returncode == 0, run.raw
    paths = ("convert: plan ", "convert: publish ")  # lines naming a path wrap where the path is long: as any would
    assert max(len(line) for line in run.drawn() if not line.startswith(paths)) <= 80, run.drawn()
    rows = [row for row in screen(run.raw) if row]
    said = rows[next(i for i, row in enumerate(rows) if row.startswith("convert: copy ")):]
    assert said[0] == "convert: copy 0.002 GB in 306 Megatron tensors", rows
    assert re.fullmatch(r"convert: flush \(copy done: 0\.002 GB, 306 tensors, \d+\.\ds, \d+ MB/s\)", said[1]), rows
    assert said[2] == "convert: verify" and "".join(said[3:]) == f"convert: publish {out}", rows
    assert not any(re.search(r"0 MB/s ETA \?", line) for line in run.drawn())  # never a rate before a write


def test_verify_counts_the_tensors_its_summary_reports(cut8_ckpt: Path, mc: Path) -> None:
    """Was: the bar counted mappings (`0/274`) and the summary 306 Megatron tensors."""
    run = on_a_terminal(["verify", str(cut8_ckpt), str(mc)])
    assert run.returncode == 0, run.raw
    reported = int(re.search(r"equal bit for bit: (\d+) Megatron tensors", run.stdout).group(1))  # type: ignore
    counts = [m.group(1, 2) for line in run.drawn() if (m := re.search(r" GB (\d+)/(\d+) ", line))]
    assert counts and {total for _, total in counts} == {str(reported)}, counts
    assert counts[-1] == (str(reported), str(reported))
    plan = f"verify: plan reading and checking {cut8_ckpt} and {mc}"
    wrapped = [plan[i:i + 80].rstrip() for i in range(0, len(plan), 80)]
    assert [row for row in screen(run.raw) if row] == wrapped  # the bar is gone: the plan line alone stays


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glmconv.fixtures import make_fixture

    return make_fixture(tmp_path_factory.mktemp("progress-bench") / "hf", "bench", size=300 * 10**6, seed=0)


def test_ctrl_c_with_workers_leaves_interrupted_alone_on_its_line(bench: Path, tmp_path: Path) -> None:
    """Was: the killed worker's bar stayed, `interrupted` written after it on the same row."""
    run = on_a_terminal(["convert", str(bench), str(tmp_path / "mc"), "--workers", "2"],
                        interrupt_when=r"convert \[0/2\].*━")  # the worker's bar is up
    assert run.signalled and run.returncode == 130, run.raw
    rows = [row for row in screen(run.raw) if row]
    assert rows[-1] == "interrupted", rows
    assert not any(re.search(r"━|starting$|reading [\d.]+ GB$|ETA ", row) for row in rows), rows  # no bar left anywhere
    assert run.raw.endswith("\x1b[?25hinterrupted\r\n") or "\x1b[?25h" in run.raw  # the cursor is shown again
    assert not (tmp_path / "mc").exists()


# ---- parity's bar ----------------------------------------------------------------------------------------------

def test_paritys_bar_has_an_eta_and_fits_80_columns() -> None:
    """Was: `parity ━━━ 3/17 layer 1 attention 0:00:12`, no ETA."""
    out, clock = io.StringIO(), Clock()
    with StepProgress("parity", 17, console=_console(out), clock=clock) as steps:
        for step in ("layer 0 attention", "layer 0 mlp", "layer 1 attention with a very long name indeed"):
            clock.now += 2.0
            steps(step)
        steps._rich.refresh()  # type: ignore[union-attr]
    last = _text(out)[-1]
    assert re.search(r" 3/17 layer 1 attention wit\.\.\. 0:00:\d\d ETA 28s$", last), last  # 6 s for 3 steps
    assert max(len(line) for line in _text(out)) <= 80


# ---- a stderr that is not a terminal: nothing ------------------------------------------------------------------

def test_a_log_file_gets_no_progress_line_from_parity(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Was: a plain `parity: 1/17 steps (layer 0 attention)` every 5 s into logs."""
    now = [0.0]

    def late() -> float:
        now[0] += 10.0  # every look at the clock: 10 s later
        return now[0]

    monkeypatch.setattr(progress_mod.time, "monotonic", late)
    with StepProgress("parity", 3) as steps:
        for step in ("layer 0 attention", "layer 0 mlp", "logits"):
            steps(step)
    assert capsys.readouterr().err == ""


def test_a_log_file_gets_a_long_conversions_line_every_30_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    """A conversion of minutes logged to a file (a cluster job) shows it moving: one plain line each 30 s, not
    one per write."""
    clock = Clock()
    with Progress("convert", 100, 4, clock=clock) as prog:
        for _ in range(4):
            clock.now += 20.0
            prog.advance(25)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == ["convert:  50.0% 0.00/0.00 GB", "convert: 100.0% 0.00/0.00 GB"]
    assert [line.split(", ")[1] for line in lines] == ["2/4 tensors", "4/4 tensors"]


@pytest.mark.parametrize("command", ["convert", "verify", "parity"])
def test_a_command_with_stderr_in_a_file_writes_only_its_own_lines(command: str, cut8_ckpt: Path, mc: Path,
                                                                   tmp_path: Path) -> None:
    import subprocess

    from helpers.terminal import GLMCONV

    args = {"convert": [str(cut8_ckpt), str(tmp_path / "out")], "verify": [str(cut8_ckpt), str(mc)],
            "parity": [str(cut8_ckpt), str(mc), "--tokens", "16", "--train-conventions", "serve"]}[command]
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        got = subprocess.run([str(GLMCONV), command, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                             timeout=300)
    assert got.returncode == 0, log.read_text()
    assert log.read_text() == "", log.read_text()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
