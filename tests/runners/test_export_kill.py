"""`glmconv export` killed with SIGKILL mid-run never leaves something transformers would load in OUT.

The export runs in a subprocess whose shard writes are slowed (a sleep before each shard is started, injected by
the test's wrapper, not by glmconv), so that kills at fixed delays after the run took its lock land while
shards are being written. A last kill lands inside publish, after an old OUT was moved aside and before the
new one is moved in (the one window where OUT does not exist). After each kill: OUT is absent (no index, no
shards), the torch_dist source is byte-for-byte unchanged, and `export --force` then succeeds with a round
trip byte-identical to the HF checkpoint the source was converted from.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.bad_input import sha256_tree
from helpers.hf_helpers import raw_tensors

from glmconv.lock import lock_path
from glmconv.runners import convert as convert_mod
from glmconv.runners import ranks as runner
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROOT = Path(__file__).resolve().parents[2]
SHARD = "100KB"  # the tiny fixture (1.19 MB) becomes 12+ shards
FLUSH_S = 0.3  # per shard: 3.6 s or more of writing

# `glmconv export ...` with a sleep before every shard is started; argv[1] is the sleep.
SLOW = """
import sys, time
import glmconv.io.safetensors.writer as hf_writer
pause = float(sys.argv.pop(1))
open_shard = hf_writer.PlannedShardWriter._open_shard
def slow_open_shard(self, no):
    time.sleep(pause)
    open_shard(self, no)
hf_writer.PlannedShardWriter._open_shard = slow_open_shard
from glmconv_cli.main import main
sys.argv[0] = "glmconv"
main()
"""

# `glmconv export ... --force` that stops inside publish right after the old OUT was moved aside; argv[1] is
# a marker file it creates at that moment.
IN_PUBLISH = """
import os, sys, time
marker = sys.argv.pop(1)
def and_stop(move):
    def moved(src, dst):
        move(src, dst)
        if str(dst).endswith(".glmconv-old"):
            open(marker, "w").close()
            time.sleep(120)
    return moved
os.replace, os.rename = and_stop(os.replace), and_stop(os.rename)
from glmconv_cli.main import main
sys.argv[0] = "glmconv"
main()
"""


@pytest.fixture(scope="module")
def mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export-kill") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


def _wait_for(cond, what: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"export ended (rc {proc.returncode}) before {what}: {err.decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _kill(proc: subprocess.Popen) -> None:
    assert proc.poll() is None, "the export finished before the kill: the delays no longer land mid-run"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _transformers_would_load(out: Path) -> bool:
    return (out / "model.safetensors.index.json").exists() or any(out.glob("*.safetensors"))


def _rerun_and_check(mc: Path, tiny_ckpt: Path, out: Path, before: dict[str, str]) -> None:
    res = CliRunner().invoke(cli, ["export", str(mc), str(out), "--force", "--json", "--max-shard-size", SHARD])
    assert res.exit_code == 0, res.stderr
    assert raw_tensors(out) == raw_tensors(tiny_ckpt), "the round trip is not byte-identical"
    assert sha256_tree(mc) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "staging, lock or old OUT left behind"


@pytest.mark.parametrize("delay", [0.0, 0.4, 1.2, 2.5])
def test_kill_while_writing_shards_leaves_no_output(delay: float, mc: Path, tiny_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = sha256_tree(mc)
    proc = subprocess.Popen([sys.executable, "-c", SLOW, str(FLUSH_S), "export", str(mc), str(out), "--json",
                             "--max-shard-size", SHARD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        _wait_for(lambda: lock_path(out).is_file(), "the export to take its lock", proc)
        time.sleep(delay)
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not out.exists(), f"OUT exists after a kill at {delay}s: {sorted(p.name for p in out.iterdir())}"
    assert sha256_tree(mc) == before, "the source was modified"
    left = sorted(p.name for p in tmp_path.iterdir())
    allowed = {"out.glmconv-staging", "out.glmconv-staging.glmconv-run", "out.glmconv-lock"}  # none loads as OUT
    assert set(left) <= allowed, left
    _rerun_and_check(mc, tiny_ckpt, out, before)


def test_kill_inside_publish_leaves_no_half_output(mc: Path, tiny_ckpt: Path, tmp_path: Path) -> None:
    """--force over an old OUT, killed between moving the old OUT aside and moving the new one in."""
    out, marker = tmp_path / "out", tmp_path / "marker"
    res = CliRunner().invoke(cli, ["export", str(mc), str(out), "--json"])
    assert res.exit_code == 0, res.stderr
    before = sha256_tree(mc)
    proc = subprocess.Popen([sys.executable, "-c", IN_PUBLISH, str(marker), "export", str(mc), str(out), "--force",
                             "--json", "--max-shard-size", SHARD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    try:
        _wait_for(marker.exists, "publish to move the old OUT aside", proc)
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    marker.unlink()
    assert not out.exists() or not _transformers_would_load(out)
    assert not out.exists()
    staged = runner.staging_dir(out)
    assert (staged / "model.safetensors.index.json").exists(), "the verified new export waits in staging"
    assert sha256_tree(mc) == before
    _rerun_and_check(mc, tiny_ckpt, out, before)
