"""The output side never harms the user's data (issue 9, items 1, 2, 3, 5, 8 and the output cases of 7).

Policy under test (glmconv/io/output.py, docs/errors.md "Output directory and interruption"): OUT is resolved
(symlinks, `..`) and written through; it may not be, contain or sit inside an input; --force replaces only
a directory glmconv published (its `glmconv.json` says `written_by: glmconv`) and an empty one is used as
is; staging and backup directories carry the run marker `.glmconv-run` and are deleted only when marked and
unused; every file glmconv creates is O_EXCL|O_NOFOLLOW; `--workers` children die with their parent and
never publish; SIGINT/SIGTERM print `interrupted` and exit 130/143 with nothing left behind.

Refusals are checked the way tests/io/test_bad_input.py checks them: one `error:` line, exit 2, every input's
sha256 unchanged, the listing of OUT's parent unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers.bad_input import assert_refused, invoke, listing, sha256_tree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glmconv.errors import GlmconvError
from glmconv.io import output
from glmconv.lock import lock_path
from glmconv.runners import convert as convert_mod
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROOT = Path(__file__).resolve().parents[2]
TRACKER = "latest_checkpointed_iteration.txt"
OUTSIDE = r"; choose an output directory outside every input$"


@pytest.fixture(scope="module")
def mc(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("output-safety") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


@pytest.fixture
def src(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny HF checkpoint (an input that a bug could damage)."""
    d = tmp_path / "src"
    shutil.copytree(tiny_ckpt, d)
    return d


def _published(src: Path, out: Path) -> None:
    res = invoke(["convert", str(src), str(out), "--json"])
    assert res.exit_code == 0, res.stderr


# ---- 1. OUT overlapping an input --------------------------------------------------------------------------

def test_convert_into_its_own_input_is_refused(src: Path) -> None:
    assert_refused(["convert", str(src), str(src), "--force"], [src], src,
                   rf"{src}: OUT is the same path as the input {src}{OUTSIDE}")


def test_convert_into_a_directory_holding_the_input_is_refused(src: Path) -> None:
    parent = src.parent
    assert_refused(["convert", str(src), str(parent), "--force"], [src], parent,
                   rf"{parent}: OUT contains the input {src}{OUTSIDE}")


def test_convert_into_a_directory_inside_the_input_is_refused(src: Path) -> None:
    out = src / "sub"
    assert_refused(["convert", str(src), str(out)], [src], out, rf"{out}: OUT is inside the input {src}{OUTSIDE}")


def test_convert_into_a_symlink_to_the_input_is_refused(src: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(src, target_is_directory=True)
    assert_refused(["convert", str(src), str(link), "--force"], [src], link, r"OUT is the same path as the input")
    assert link.is_symlink() and os.readlink(link) == str(src)


def test_staging_path_on_an_input_is_refused(src: Path, tmp_path: Path) -> None:
    """OUT's staging path is the input (OUT = SRC minus the suffix): the input would be deleted as stale."""
    staged = tmp_path / ("in" + output.STAGING_SUFFIX)
    src.rename(staged)
    out = tmp_path / "in"
    assert_refused(["convert", str(staged), str(out)], [staged], out,
                   rf"OUT's glmconv-staging path {staged} is the same path as the input")


def test_export_into_its_own_input_is_refused(mc: Path, tmp_path: Path) -> None:
    copy = tmp_path / "mc"
    shutil.copytree(mc, copy)
    assert_refused(["export", str(copy), str(copy), "--force"], [copy], copy, r"OUT is the same path as the input")


def test_export_into_the_like_directory_is_refused(mc: Path, src: Path) -> None:
    assert_refused(["export", str(mc), str(src), "--like", str(src), "--force"], [mc, src], src,
                   rf"{src}: OUT is the same path as the --like directory {src}{OUTSIDE}")


def test_export_into_the_directory_of_its_config_file_is_refused(mc: Path, tmp_path: Path) -> None:
    out = tmp_path / "cfg"
    out.mkdir()
    shutil.copy(mc / "config.json", out / "config.json")
    assert_refused(["export", str(mc), str(out), "--config", str(out / "config.json"), "--force"], [mc, out], out,
                   rf"OUT contains the --config file {out / 'config.json'}{OUTSIDE}")


RELATIONS = ["same", "inside", "deep-inside", "contains", "symlink", "symlink-inside", "dotdot", "symlink-parent",
             "symlink-chain"]


def _out_for(relation: str, target: Path, root: Path) -> Path:
    """An OUT path standing in `relation` to `target` (root: the example's scratch directory)."""
    link = root / "link"
    if relation == "same":
        return target
    if relation == "inside":
        return target / "out"
    if relation == "deep-inside":
        return target / "a" / ".." / "b" / "out"
    if relation == "contains":
        return target.parent
    if relation == "dotdot":
        return target / "x" / ".."
    if relation == "symlink-chain":
        link.symlink_to(target, target_is_directory=True)
        (root / "link2").symlink_to(link, target_is_directory=True)
        return root / "link2"
    link.symlink_to(target.parent if relation == "symlink-parent" else target, target_is_directory=True)
    return {"symlink": link, "symlink-inside": link / "out", "symlink-parent": link}[relation]


def _spell(out: Path, spelling: str) -> str:
    """The same OUT written another way: relative to the current directory, with `.` segments, a trailing `/.`."""
    if spelling == "relative":
        return os.path.relpath(out)
    if spelling == "dotted":
        return f"{out.parent}/./{out.name}"
    if spelling == "trailing-dot":
        return f"{out}/."
    return str(out)


@settings(derandomize=True, deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(command=st.sampled_from(["convert", "export", "export-like"]), relation=st.sampled_from(RELATIONS),
       force=st.booleans(), spelling=st.sampled_from(["absolute", "relative", "dotted", "trailing-dot"]))


def test_output_overlapping_any_input_never_changes_it(tiny_ckpt: Path, mc: Path, command: str, relation: str,
                                                       force: bool, spelling: str) -> None:
    """Property: whatever the path relation, OUT overlapping an input is refused and the inputs stay intact."""
    with tempfile.TemporaryDirectory(prefix="glmconv-overlap-") as tmp:
        root = Path(tmp)
        hf = root / "in" / "hf"
        shutil.copytree(tiny_ckpt, hf)
        if command == "convert":
            target, args = hf, ["convert", str(hf)]
        else:
            mcc = root / "in" / "mc"
            shutil.copytree(mc, mcc)
            target = hf if command == "export-like" else mcc
            args = ["export", str(mcc)] + (["--like", str(hf)] if command == "export-like" else [])
        out = _out_for(relation, target, root)
        args = args[:2] + [_spell(out, spelling)] + args[2:] + (["--force"] if force else [])
        assert_refused(args, [root / "in"], out, OUTSIDE)


FOREIGN = r"already exists and is not empty, and glmconv did not publish it \(no glmconv\.json written by glmconv\)"
EMPTY_IT = r": choose another OUT, or empty it$"


def test_force_refuses_a_directory_glmconv_did_not_publish(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert_refused(["convert", str(src), str(out), "--force"], [src], out,
                   rf"^error: {out}: {FOREIGN}; --force replaces only a directory glmconv published{EMPTY_IT}")


@pytest.mark.parametrize("command", ["convert", "export", "relayout", "fixture"])
def test_a_folder_glmconv_did_not_make_is_never_told_to_pass_force(command: str, src: Path, tmp_path: Path) -> None:
    """Without --force, a non-empty OUT glmconv did not publish gets the next step that works (another OUT, or
    empty it), never `pass --force`, which would then be refused (issue 40)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    mc = tmp_path / "mc"
    _published(src, mc)
    args = {"convert": ["convert", str(src), str(out)], "export": ["export", str(mc), str(out)],
            "relayout": ["relayout", str(mc), str(out), "--to", "mcore"], "fixture": ["fixture", "make", str(out)]}
    line = assert_refused(args[command], [src, mc], out, rf"^error: {out}: {FOREIGN}{EMPTY_IT}")
    assert "--force" not in line
    (out / "thesis.tex").unlink()  # the advice works: emptied, the same command publishes into it
    assert invoke(args[command]).exit_code == 0 and output.published_by_glmconv(out)


def test_a_folder_glmconv_published_is_told_to_pass_force_and_force_works(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _published(src, out)
    assert_refused(["convert", str(src), str(out)], [src], out,
                   rf"^error: {out}: already exists and is not empty; pass --force to replace it$")
    assert invoke(["convert", str(src), str(out), "--force"]).exit_code == 0


def test_fixture_make_force_refuses_a_directory_glmconv_did_not_publish(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert_refused(["fixture", "make", str(out), "--force"], [out], out, rf"{out}: {FOREIGN}; --force")


def test_force_refuses_a_foreign_glmconv_json(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "glmconv.json").write_text('{"source": "somewhere"}')
    assert_refused(["convert", str(src), str(out), "--force"], [src], out, FOREIGN)


def test_empty_output_directory_is_used_without_force(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    _published(src, out)
    assert (out / TRACKER).read_text() == "release"
    assert json.loads((out / "glmconv.json").read_text())["written_by"] == "glmconv"
    assert listing(tmp_path) == ["out", "src"]


def test_force_replaces_what_glmconv_published(mc: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    for _ in range(2):
        res = invoke(["export", str(mc), str(out), "--force", "--json"])
        assert res.exit_code == 0, res.stderr
    assert json.loads((out / "glmconv.json").read_text())["written_by"] == "glmconv"
    assert listing(tmp_path) == ["hf"] and not [p for p in out.iterdir() if p.name.startswith(".")]


# ---- 2. only delete what glmconv created ---------------------------------------------------------------------

def test_user_directory_named_like_the_staging_directory_is_refused(src: Path, tmp_path: Path) -> None:
    mine = tmp_path / ("out" + output.STAGING_SUFFIX)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, mine], tmp_path / "out",
                   rf"{mine}: in the way of glmconv's staging directory and not made by glmconv \(no \.glmconv-run "
                   r"marker\); remove or rename it yourself$")


def test_user_directory_named_like_the_backup_is_refused(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _published(src, out)
    mine = tmp_path / ("out" + output.OLD_SUFFIX)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert_refused(["convert", str(src), str(out), "--force"], [src, mine], out,
                   rf"{mine}: in the way of glmconv's backup directory and not made by glmconv")


def test_empty_unmarked_staging_directory_is_removed(src: Path, tmp_path: Path) -> None:
    """A run killed between creating the staging directory and its marker leaves it empty: nothing to lose."""
    (tmp_path / ("out" + output.STAGING_SUFFIX)).mkdir()
    _published(src, tmp_path / "out")
    assert listing(tmp_path) == ["out", "src"]


def _marker(d: Path, pid: int = 999_999_999, run: str = "dead-run") -> Path:
    d.mkdir(exist_ok=True)
    body = {"written_by": "glmconv", "state": "staging", "run": run, "pid": pid, "host": "h", "started": 0}
    output.marker_of(d).write_text(json.dumps(body))
    return output.marker_of(d)


def test_stale_staging_of_a_dead_run_is_removed(src: Path, tmp_path: Path) -> None:
    stage = tmp_path / ("out" + output.STAGING_SUFFIX)
    _marker(stage)
    (stage / "release").mkdir()
    (stage / "release" / "__0_0.distcp").write_bytes(b"half written")
    _published(src, tmp_path / "out")
    assert listing(tmp_path) == ["out", "src"]


def test_staging_still_used_by_a_live_process_is_refused(src: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A process (an orphaned worker) holding the marker's flock keeps its staging directory alive."""
    monkeypatch.setattr(output, "STALE_WAIT_S", 0.2)
    stage = tmp_path / ("out" + output.STAGING_SUFFIX)
    fd = os.open(_marker(stage, pid=4242), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert_refused(["convert", str(src), str(tmp_path / "out")], [src, stage], tmp_path / "out",
                       rf"{stage}: left by glmconv pid 4242 on h, which still uses it; wait for that process to end$")
    finally:
        os.close(fd)


def test_old_out_left_by_a_killed_publish_is_put_back(src: Path, tmp_path: Path) -> None:
    """Killed between moving the old OUT aside and the new one in: the next run restores the old OUT first."""
    out = tmp_path / "out"
    _published(src, out)
    before = sha256_tree(out)
    old = tmp_path / ("out" + output.OLD_SUFFIX)
    out.rename(old)
    _marker(old)
    res = invoke(["convert", str(src), str(out)])
    assert res.exit_code == 2 and res.stderr == f"error: {out}: already exists and is not empty; pass --force to " \
                                               f"replace it\n"
    assert sha256_tree(out) == {k.replace(str(out), str(out)): v for k, v in before.items()}
    assert listing(tmp_path) == ["out", "src"]


# ---- 3. symlinks and foreign files on the output side ------------------------------------------------------

def test_lock_file_symlink_is_refused_and_its_target_untouched(src: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock_path(tmp_path / "out").symlink_to(victim)
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, victim], tmp_path / "out",
                   rf"{tmp_path / 'out.glmconv-lock'}: is a symlink; glmconv never writes through one: remove it$")
    assert victim.read_text() == "precious"


def test_lock_file_hard_linked_to_a_user_file_is_refused(src: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, lock_path(tmp_path / "out"))
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, victim], tmp_path / "out",
                   r"out\.glmconv-lock: is a hard link to another file, not glmconv's lock file: remove it$")


def test_lock_file_with_foreign_content_is_refused(src: Path, tmp_path: Path) -> None:
    lock = lock_path(tmp_path / "out")
    lock.write_text("not a pid\n")
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, lock], tmp_path / "out",
                   r"out\.glmconv-lock: holds something other than a glmconv pid, not glmconv's lock file: remove it$")
    assert lock.read_text() == "not a pid\n"


def test_lock_file_that_is_a_fifo_is_refused_without_blocking(src: Path, tmp_path: Path) -> None:
    os.mkfifo(lock_path(tmp_path / "out"))
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                   r"out\.glmconv-lock: is not a regular file, not glmconv's lock file: remove it$")


def test_stale_staging_path_that_is_a_file_is_refused(src: Path, tmp_path: Path) -> None:
    stage = tmp_path / ("out" + output.STAGING_SUFFIX)
    stage.write_text("a file")
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, stage], tmp_path / "out",
                   rf"{stage}: in the way of glmconv's staging directory and not made by glmconv \(not a directory\); "
                   r"remove it yourself$")


def test_stale_staging_path_that_is_a_symlink_is_refused(src: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _marker(elsewhere)  # even a directory that looks like ours is never reached through a link
    stage = tmp_path / ("out" + output.STAGING_SUFFIX)
    stage.symlink_to(elsewhere, target_is_directory=True)
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, elsewhere], tmp_path / "out",
                   rf"{stage}: in the way of glmconv's staging directory and not made by glmconv \(a symlink\)")


def test_created_files_never_follow_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "config.json").symlink_to(victim)
    with pytest.raises(GlmconvError, match="a symlink is in the way; glmconv never writes through one"):
        output.write_new(tmp_path / "config.json", "{}")
    assert victim.read_text() == "precious"


def test_created_files_never_overwrite_a_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("theirs")
    with pytest.raises(GlmconvError, match="something is already there"):
        output.write_new(tmp_path / "config.json", "{}")
    assert (tmp_path / "config.json").read_text() == "theirs"


def test_out_symlink_to_an_empty_directory_is_written_through(src: Path, tmp_path: Path) -> None:
    """The "output on the big disk" setup: the link stays, its target gets the output, staging sits beside it."""
    big = tmp_path / "big"
    (big / "target").mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(big / "target", target_is_directory=True)
    _published(src, link)
    assert link.is_symlink() and os.readlink(link) == str(big / "target")
    assert (big / "target" / TRACKER).read_text() == "release"
    assert listing(big) == ["target"] and listing(tmp_path) == ["big", "out", "src"]


def test_out_symlink_to_a_published_directory_is_replaced_inside_its_target(src: Path, tmp_path: Path) -> None:
    target = tmp_path / "big" / "ckpt"
    target.parent.mkdir()
    _published(src, target)
    (target / "stale.txt").write_text("from before")
    link = tmp_path / "out"
    link.symlink_to(target, target_is_directory=True)
    res = invoke(["convert", str(src), str(link), "--force", "--json"])
    assert res.exit_code == 0, res.stderr
    assert link.is_symlink() and not (target / "stale.txt").exists() and (target / TRACKER).exists()
    assert listing(target.parent) == ["ckpt"]


def test_dangling_out_symlink_creates_its_target(src: Path, tmp_path: Path) -> None:
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "made-later", target_is_directory=True)
    _published(src, link)
    assert (tmp_path / "made-later" / TRACKER).exists() and link.is_symlink()


# ---- 7. output paths and disk full -----------------------------------------------------------------------

def test_out_that_is_a_mount_point_is_refused_before_writing(src: Path, tmp_path: Path,
                                                             mount_tmpfs: Callable) -> None:
    """Staging beside a mount point would fill the wrong disk and fail at the final rename: refused at once."""
    mnt = mount_tmpfs("size=4m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here")
    assert_refused(["convert", str(src), str(mnt)], [src], mnt,
                   rf"{mnt}: is a mount point; glmconv stages beside OUT and renames it into place, which cannot "
                   rf"cross filesystems: name a directory inside it, e\.g\. {mnt / 'ckpt'}$")


def test_out_dot_in_an_empty_directory_publishes_there(src: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    res = invoke(["convert", str(src), ".", "--json"])
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "here" / TRACKER).read_text() == "release"
    assert listing(tmp_path) == ["here", "src"]


def test_out_dot_dot_naming_the_directory_of_the_input_is_refused(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "x" / ".."
    assert_refused(["convert", str(src), str(out), "--force"], [src], tmp_path / "x", r"OUT contains the input")


def test_out_as_the_filesystem_root_is_refused(src: Path) -> None:
    before = sha256_tree(src)
    res = invoke(["convert", str(src), "/", "--force"])  # not assert_refused: it would hash all of /
    assert (res.exit_code, res.stderr) == (
        2, "error: /: cannot write the output over the filesystem root; name a directory below it\n")
    assert sha256_tree(src) == before


def _to_dev_full(monkeypatch: pytest.MonkeyPatch, names: set[str]) -> None:
    """Files named in `names` are created for real, but their writes go to /dev/full (ENOSPC)."""
    create = output.create_new

    def full(path: Path, mode: int = 0o644) -> int:
        fd = create(path, mode)
        if Path(path).name in names:
            dev = os.open("/dev/full", os.O_WRONLY)
            os.dup2(dev, fd)
            os.close(dev)
        return fd

    monkeypatch.setattr(output, "create_new", full)


@pytest.mark.parametrize("name", ["config.json", "glmconv.json"])
def test_disk_full_while_writing_a_convert_sidecar(name: str, src: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _to_dev_full(monkeypatch, {name})
    stage = tmp_path / ("out" + output.STAGING_SUFFIX)
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                   rf"^error: {stage / name}: cannot write \(No space left on device\)$")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "glmconv.json"])
def test_disk_full_while_writing_an_export_sidecar(name: str, mc: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _to_dev_full(monkeypatch, {name})
    assert_refused(["export", str(mc), str(tmp_path / "out")], [mc], tmp_path / "out",
                   rf"{name}: cannot write \(No space left on device\)$")


def test_disk_full_while_writing_the_lock(src: Path, tmp_path: Path, mount_tmpfs: Callable) -> None:
    """A real full tmpfs: the lock file can be created (an inode) but not written; it is removed again."""
    mnt = mount_tmpfs("size=64k")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here; test_lock_write_failure_is_one_line covers it")
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert_refused(["convert", str(src), str(mnt / "out"), "--no-space-check"], [src], mnt / "out",
                   rf"^error: {mnt / 'out.glmconv-lock'}: cannot write the lock file \(No space left on device\)$")


def test_lock_write_failure_is_one_line(src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.lock as lock_mod

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_mod, "_write_all", full)
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                   r"out\.glmconv-lock: cannot write the lock file \(No space left on device\)$")


# ---- 5 and 8: workers and signals (real processes) -----------------------------------------------------------

# Every source tensor read waits for GATE to exist; each process that reaches a read leaves GATE.pid-<pid>.
# It lives in sitecustomize so that the spawned --workers children are gated too.
SITECUSTOMIZE = textwrap.dedent("""
    import os
    gate = os.environ.get("GLMCONV_TEST_GATE")
    if gate:
        import time
        import glmconv.io.safetensors.reader as hf_reader
        entry = hf_reader.HfTensorSource.entry
        def wait():
            mark = f"{gate}.pid-{os.getpid()}"
            if not os.path.exists(mark):
                open(mark, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        def gated(self, *a, **k):
            wait()
            return entry(self, *a, **k)
        hf_reader.HfTensorSource.entry = gated
        if os.environ.get("GLMCONV_TEST_GATE_AUDIT"):  # stall earlier: while the source is audited
            import glmconv.runners.audit as audit
            load_side = audit.load_side
            def gated_audit(*a, **k):
                wait()
                return load_side(*a, **k)
            audit.load_side = gated_audit
""")


def _start_gated(src: Path, out: Path, tmp_path: Path, *extra: str,
                 audit: bool = False) -> tuple[subprocess.Popen, Path]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    gate = tmp_path / "site" / "gate"
    env = {**os.environ, "GLMCONV_TEST_GATE": str(gate), "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
           "GLMCONV_TEST_GATE_AUDIT": "1" if audit else ""}
    proc = subprocess.Popen([sys.executable, "-m", "glmconv", "convert", str(src), str(out), "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
                            start_new_session=True)  # its own process group, as a shell gives a foreground job
    return proc, gate


def _reading_pids(gate: Path) -> list[int]:
    return [int(p.name.rsplit("-", 1)[1]) for p in gate.parent.glob(gate.name + ".pid-*")]


def _wait(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_die_with_their_killed_parent_and_never_publish(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = sha256_tree(src)
    proc, gate = _start_gated(src, out, tmp_path, "--workers", "2")
    try:
        _wait(lambda: len(_reading_pids(gate)) == 2, "both workers to start reading")
        workers = _reading_pids(gate)
        assert proc.pid not in workers
        proc.kill()
        proc.wait()
        gate.touch()  # were a worker still alive, it would now run to the end
        _wait(lambda: not any(_alive(p) for p in workers), "the orphaned workers to die", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(1.0)
    assert not out.exists(), "an orphaned worker published"
    assert sha256_tree(src) == before
    _published(src, out)  # the rerun takes over the stale lock and staging directory
    assert listing(tmp_path) == ["out", "site", "src"]


def _stop_when_reading(proc: subprocess.Popen, gate: Path, readers: int,
                       send: Callable[[], None]) -> tuple[list[int], str]:
    """Once `readers` processes read the source, `send` the signal; (their pids, the run's stderr)."""
    try:
        _wait(lambda: len(_reading_pids(gate)) == readers, "the run to start reading")
        pids = _reading_pids(gate)
        send()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return pids, err.decode()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_signal_during_a_write_is_one_line_and_cleans_up(sig: signal.Signals, code: int, workers: str, src: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, gate = _start_gated(src, out, tmp_path, "--workers", workers)
    readers, err = _stop_when_reading(proc, gate, int(workers), lambda: proc.send_signal(sig))
    assert (proc.returncode, err) == (code, "interrupted\n")
    assert listing(tmp_path) == ["site", "src"], "staging, lock or OUT left behind"
    assert not any(_alive(p) for p in readers)


def test_ctrl_c_to_the_whole_process_group_is_one_line(src: Path, tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the parent and every worker: still one line, from the parent only."""
    proc, gate = _start_gated(src, tmp_path / "out", tmp_path, "--workers", "2")
    readers, err = _stop_when_reading(proc, gate, 2, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert (proc.returncode, err) == (130, "interrupted\n")
    assert listing(tmp_path) == ["site", "src"]
    assert not any(_alive(p) for p in readers)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_before_the_run_starts_is_one_line(sig: signal.Signals, code: int, src: Path, tmp_path: Path) -> None:
    """Stopped while the source is still being audited: nothing was written, the same one line."""
    proc, gate = _start_gated(src, tmp_path / "out", tmp_path, audit=True)
    _, err = _stop_when_reading(proc, gate, 1, lambda: proc.send_signal(sig))
    assert (proc.returncode, err) == (code, "interrupted\n")
    assert listing(tmp_path) == ["site", "src"]


def test_interrupt_wrapped_by_torch_is_still_an_interruption(src: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save turns an exception raised in its write callback into a RuntimeError: still `interrupted`."""
    import glmconv.io.torch_dist.writer as dw
    from glmconv.interrupt import Interrupted

    def interrupted_inside_torch(*a: object, **k: object) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except Interrupted:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None

    monkeypatch.setattr(dw, "_write_group_file", interrupted_inside_torch)
    res = CliRunner().invoke(cli, ["convert", str(src), str(tmp_path / "out")])
    assert (res.exit_code, res.stderr) == (130, "interrupted\n")
    assert listing(tmp_path) == ["src"]


def test_a_worker_refuses_a_staging_directory_of_another_run(tmp_path: Path) -> None:
    stage = output.open_stage(tmp_path / "out")
    try:
        with pytest.raises(GlmconvError, match="staging directory belongs to another run; nothing written"):
            output.join_stage(stage.path, "some-other-run")
        os.close(output.join_stage(stage.path, stage.run))
    finally:
        output.discard(stage)
    assert listing(tmp_path) == []


def test_out_inside_a_bind_mount_of_the_input_is_refused(src: Path, tmp_path: Path) -> None:
    """Two paths, one directory: overlap is decided by inode too, not only by path."""
    view = tmp_path / "view"
    view.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        assert_refused(["convert", str(src), str(view / "out")], [src], view / "out",
                       rf"{view / 'out'}: OUT is inside the input {src}{OUTSIDE}")
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True)
