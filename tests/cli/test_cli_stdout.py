"""glmconv's stdout is glmconv's alone: a library's prints land on stderr, and every `--json` is strict JSON.

The command line runs in a subprocess (`main()` is what reserves stdout; click's CliRunner does not), with a
stand-in "library" inside the command that prints the ways tilelang and compilers do: Python's `print`,
`sys.stdout.write`, a write to file descriptor 1, a child process that inherits descriptor 1.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import glmconv
from glmconv.compare.report import to_json
from glmconv.io.torch_dist.common_state import read_common_state
from glmconv.text import MAX_JSON_DEPTH, json_text
from glmconv.version import __version__
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
REPO = Path(__file__).resolve().parents[2]
LIBRARY_LINES = ["LIB print", "LIB sys.stdout.write", "LIB os.write(1)", "LIB child process"]

# `fixture make`'s writer, replaced by one that prints every way a library does, then writes the fixture and
# keeps what the command will print (its result) in RESULT, for the test to compare with stdout.
NOISY_FIXTURE = textwrap.dedent("""
    import json, os, subprocess, sys
    import glmconv_cli.fixture_cmd as command
    from glmconv_cli.main import main

    real = command.write_fixture

    def noisy(*args, **kwargs):
        print("LIB print")
        sys.stdout.write("LIB sys.stdout.write\\n")
        sys.stdout.flush()
        os.write(1, b"LIB os.write(1)\\n")
        subprocess.run([sys.executable, "-c", "print('LIB child process')"], check=True)
        info = real(*args, **kwargs)
        with open(os.environ["RESULT"], "w") as fh:
            json.dump(info.as_json(), fh)
        return info

    command.write_fixture = noisy
    sys.argv = ["glmconv", *sys.argv[1:]]
    main()
""")


def _run(script: str, *args: str, tmp_path: Path, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "RESULT": str(tmp_path / "result.json")}
    return subprocess.run([sys.executable, "-c", script, *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=REPO, timeout=300)


def _glmconv(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return _run("import sys; from glmconv_cli.main import main; sys.argv = ['glmconv', *sys.argv[1:]]; main()",
                *args, tmp_path=tmp_path)


def _strict(text: str) -> Any:
    """`text` parsed as RFC 8259 JSON: NaN and Infinity, which Python's parser accepts, are refused."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# ---- a library's output never reaches glmconv's stdout ------------------------------------------------------

def test_json_on_stdout_is_the_result_alone_while_the_librarys_lines_go_to_stderr(tmp_path: Path) -> None:
    res = _run(NOISY_FIXTURE, "fixture", "make", str(tmp_path / "f"), "--preset", "tiny", "--json",
               tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert _strict(res.stdout) == result
    assert (result["path"], result["preset"], result["tensors"]) == (str(tmp_path / "f"), "tiny", 246)
    assert res.stderr.splitlines() == LIBRARY_LINES


def test_a_plain_commands_human_output_still_reaches_stdout(tmp_path: Path) -> None:
    res = _run(NOISY_FIXTURE, "fixture", "make", str(tmp_path / "f"), "--preset", "tiny", tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr
    r = json.loads((tmp_path / "result.json").read_text())
    assert res.stdout == (f"{tmp_path / 'f'}: tiny bf16 seed 0, 246 tensors, {r['bytes']:,} bytes in "
                          f"{r['shards']} shards\n")
    assert res.stderr.splitlines() == LIBRARY_LINES


def test_version_is_on_stdout(tmp_path: Path) -> None:
    res = _glmconv("--version", tmp_path=tmp_path)
    assert (res.returncode, res.stdout, res.stderr) == (0, f"glmconv, version {__version__}\n", "")


@pytest.mark.parametrize("args", [["--help"], ["fixture", "make", "--help"]])
def test_help_is_on_stdout(args: list[str], tmp_path: Path) -> None:
    res = _glmconv(*args, tmp_path=tmp_path)
    assert (res.returncode, res.stderr) == (0, "")
    assert res.stdout.startswith(f"Usage: glmconv {' '.join(args[:-1])}{' ' if args[:-1] else ''}[OPTIONS]")


def test_a_usage_error_is_one_line_on_stderr_and_nothing_on_stdout(tmp_path: Path) -> None:
    res = _glmconv("fixture", "make", "--preset", "nope", str(tmp_path / "f"), tmp_path=tmp_path)
    assert (res.returncode, res.stdout) == (2, "")
    assert "Invalid value for '--preset'" in res.stderr and "Traceback" not in res.stderr


def test_a_reader_gone_before_the_output_exits_141_quietly(tmp_path: Path) -> None:
    read, write = os.pipe()
    os.close(read)  # `glmconv ... | head -c0`: nobody reads glmconv's stdout
    try:
        res = _run(NOISY_FIXTURE, "fixture", "make", str(tmp_path / "f"), "--json", tmp_path=tmp_path, stdout=write)
    finally:
        os.close(write)
    assert res.returncode == 141  # 128 + SIGPIPE, as any Unix tool
    assert res.stderr.splitlines() == LIBRARY_LINES  # the library's lines, then nothing: no traceback, no error


# ---- strict JSON -------------------------------------------------------------------------------------------

def test_non_finite_floats_are_strings() -> None:
    text = json_text({"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "x": 1.5, "list": [math.nan, 2.0]})
    assert _strict(text) == {"nan": "nan", "inf": "inf", "-inf": "-inf", "x": 1.5, "list": ["nan", 2.0]}


def test_values_json_has_no_type_for_are_their_repr() -> None:
    assert _strict(json_text({"set": {3}, "bytes": b"7", "path": Path("/a"), "tuple": (1, "b")})) == {
        "set": "{3}", "bytes": "b'7'", "path": "PosixPath('/a')", "tuple": [1, "b"]}


def test_an_integer_too_long_to_write_out_is_shown_by_its_size() -> None:
    huge = 10**5000  # beyond Python's 4,300-digit limit of int -> str
    assert _strict(json_text({"iteration": huge, huge: 1, "n": 10**20})) == {
        "iteration": "<an integer of 16,610 bits>", "<an integer of 16,610 bits>": 1, "n": 10**20}


def test_keys_become_strings() -> None:
    assert _strict(json_text({2: "a", None: "b", True: "c", 2.5: "d", (1, 2): "e"})) == {
        "2": "a", "null": "b", "true": "c", "2.5": "d", "(1, 2)": "e"}


def test_a_list_that_holds_itself_is_shown_not_followed() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert _strict(json_text({"loop": loop})) == {"loop": [1, "[1, [...]]"]}


def test_nesting_beyond_the_limit_is_shown_as_a_string() -> None:
    deep: list[Any] = []
    for _ in range(MAX_JSON_DEPTH + 10_000):  # deeper than Python's recursion limit
        deep = [deep]
    got = _strict(json_text(deep))
    for _ in range(MAX_JSON_DEPTH):
        got = got[0]
    assert got == "<a list nested too deep to show>"


def test_a_long_repr_is_cut_in_the_middle() -> None:
    got = _strict(json_text(set(range(10_000))))
    assert got.startswith("{0, 1, 2,") and got.endswith(", 9998, 9999}") and "characters)..." in got
    assert len(got) < 300


def test_the_parity_report_is_strict_json() -> None:
    assert _strict(to_json({"rel_err": math.nan, "kl": math.inf, "tokens": 64, "iteration": {3}})) == {
        "rel_err": "nan", "kl": "inf", "tokens": 64, "iteration": "{3}"}


# ---- relayout --json of a trainer's common state (issue 39) -------------------------------------------------

@pytest.fixture(scope="module")
def miles(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    out = tmp_path_factory.mktemp("stdout") / "miles"
    glmconv.convert(tiny_ckpt, out, layout="miles")
    return out


@pytest.mark.parametrize(("iteration", "shown"), [({1, 2}, "{1, 2}"), (b"7", "b'7'"), (math.nan, "nan"),
                                                  (math.inf, "inf")])
def test_relayout_json_of_a_common_pt_iteration_json_has_no_value_for(iteration: object, shown: object,
                                                                      miles: Path, tmp_path: Path) -> None:
    src = Path(shutil.copytree(miles, tmp_path / "trained"))
    common = read_common_state(src / "release")
    torch.save({**common, "iteration": iteration}, src / "release" / "common.pt")  # the legacy file, read first
    res = CliRunner().invoke(cli, ["relayout", str(src), str(tmp_path / "out"), "--to", "mcore", "--json"])
    assert res.exit_code == 0, res.output
    summary = _strict(res.stdout)
    assert (summary["iteration"], summary["to"]) == (shown, "mcore")
    assert (tmp_path / "out" / "release").is_dir()
