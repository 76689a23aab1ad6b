"""Hostile common states (issue 39): every command that reads one does bounded work and memory.

A torch_dist checkpoint's common state (a legacy `common.pt`, or the DCP entry `common_state/shard_0_1`) is
untrusted input. Three KB of pickle can describe a list shared at every level (`x = [x, x]`, 64 times: 2**64
paths for any walk), nesting 100,000 deep (past every recursion limit), a tuple nested so deep that hashing it
as a dict key overflows the C stack, or a memo index that makes C's unpickler allocate gigabytes. Each case is
written as such raw pickle opcodes where torch.save cannot write it (`raw`), planted in a copy of a converted
checkpoint, and run through export, relayout, verify and audit-names in a child process under an address-space
limit (tests/helpers/bounded_cli.py): each run exits 0 or 2 (one `error:` line naming the file and what was expected),
within a time and an RSS bound, leaves no staging directory or lock, and prints strict JSON when it exits 0.
audit-names never reads the common state: it exits 0 on every case.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers.checkpoints import repoint
from helpers.fuzzing import fuzz
from hypothesis import event, given
from hypothesis import strategies as st

import glmconv
from glmconv.config import parse_config
from glmconv.errors import CheckpointError
from glmconv.fixtures import preset_config
from glmconv.io.file_names import COMMON_PT_NAME, COMMON_STATE_KEY, RELEASE
from glmconv.io.torch_dist.common_state import (
    MAX_DEPTH,
    load_common_state,
    pickle_module_for,
    read_common_state,
)
from glmconv.io.torch_dist.pickle_bounds import PickleOutOfBounds, check_pickle_bounds
from glmconv.megatron_args import check_stored_args, relaid_common_state
from glmconv_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = parse_config(preset_config("tiny"))
CHILD = Path(__file__).resolve().parents[1] / "helpers" / "bounded_cli.py"
ADDRESS_SPACE = 4 << 30  # the child's RLIMIT_AS: torch and glmconv take ~0.7 GB of it
MAX_RSS_MB = 1500  # the child's peak resident memory (a healthy run of all four commands: ~0.4 GB)
MAX_SECONDS = 20  # one command on the tiny checkpoint (a healthy run: ~1 s)
EXTRA_STATE = "decoder.final_layernorm._extra_state/shard_0_1"  # a stored object export, verify, relayout load
MEMO = 1000  # memo indices of the raw opcodes: past the few hundred torch.save's pickle of a tiny state uses


# ---- hostile values as raw pickle opcodes --------------------------------------------------------------------

def _put(i: int) -> bytes:
    return b"r" + (MEMO + i).to_bytes(4, "little")  # LONG_BINPUT


def _get(i: int) -> bytes:
    return b"j" + (MEMO + i).to_bytes(4, "little")  # LONG_BINGET


RAW_OPS = {  # kind -> n -> opcodes that push one value
    "shared-list": lambda n: b"]" + _put(0) + b"0" + (b"(" + _get(0) + _get(0) + b"l" + _put(0) + b"0") * n + _get(0),
    "deep-list": lambda n: b"]" * n + b"a" * (n - 1),  # [[[...]]], n deep
    "deep-dict": lambda n: b"}" + b"K\x00}" * (n - 1) + b"s" * (n - 1),  # {0: {0: ...}}, n deep
    "deep-tuple-key": lambda n: b"}" + b")" + b"\x85" * n + b"K\x01s",  # {((...),): 1}, n + 1 deep
    "shared-appends": lambda n: (b"](]" + _put(0) + b"".join(b"]" + _put(i) + b"(" + _get(i - 1) + _get(i - 1) + b"e"
                                                         for i in range(1, n + 1)) + b"e"),  # the same, in opcodes
    # torch's weights-only unpickler reads: [x0, x1, ...], x(i) = [x(i-1), x(i-1)]
    "cycle": lambda n: b"]" + _put(1) + b"0" + _get(1) + _get(1) + b"a",  # x = [x]
    "shared-text": lambda n: (b"X" + n.to_bytes(4, "little") + b"A" * n + _put(2) + b"0("  # one string of n
                              + _get(2) * 1000 + b"l"),  # characters, 1000 times in a list
    "text-long": lambda n: b"L" + b"7" * n + b"L\n",  # an int written in n decimal digits
    "wide-long": lambda n: b"\x8b" + n.to_bytes(4, "little") + b"\x7f" * n,  # an int of 8n bits
    "memo-bomb": lambda n: b"Nr" + n.to_bytes(4, "little"),  # None, memoized at index n
}
_PLACEHOLDER = re.compile(rb"X(.{4})\x00raw:([a-z-]+):(\d+)\x00", re.S)


def raw(kind: str, n: int) -> str:
    """A placeholder string that `archive` replaces by RAW_OPS[kind](n)."""
    return f"\x00raw:{kind}:{n}\x00"


def archive(obj: Any) -> bytes:
    """torch.save(obj), each `raw` placeholder in its pickle replaced by its opcodes (records stored, as torch's)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        records = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    if not any(_PLACEHOLDER.search(data) for name, data in records if name.endswith("/data.pkl")):
        return buf.getvalue()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, data in records:
            if name.endswith("/data.pkl"):
                data = _PLACEHOLDER.sub(lambda m: RAW_OPS[m.group(2).decode()](int(m.group(3))), data)
            z.writestr(name, data)
    return out.getvalue()


def plant(mc: Path, state: Any, where: str) -> str:
    """`state` as `mc`'s common state (a legacy common.pt, read first as megatron does, or the DCP entry), or as
    the stored object `where` (EXTRA_STATE); returns what an error about it names."""
    if where == COMMON_PT_NAME:
        (mc / RELEASE / COMMON_PT_NAME).write_bytes(archive(state))
        return str(mc / RELEASE / COMMON_PT_NAME)
    repoint(mc, where, archive([state]))
    return where


# ---- running every command that reads a common state -------------------------------------------------------------

def commands(hf: Path, mc: Path) -> dict[str, list[str]]:
    return {"audit-names": ["audit-names", str(mc), "--json"],
            "export": ["export", str(mc), str(mc.parent / f"{mc.name}-export"), "--json"],
            "relayout": ["relayout", str(mc), str(mc.parent / f"{mc.name}-relayout"), "--to", "mcore", "--json"],
            "verify": ["verify", str(hf), str(mc), "--json"]}


def _strict(text: str) -> Any:
    """`text` as RFC 8259 JSON: NaN and Infinity, which Python's parser accepts, are refused."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def run_bounded(cases: dict[str, Path], hf: Path, scratch: Path, timeout: float) -> dict[tuple[str, str], Any]:
    """Every command on every case in one child process (tests/helpers/bounded_cli.py); (case, command) -> its result.
    A child killed on the timeout or by a signal fails the test naming the run it was in."""
    runs: list[dict[str, Any]] = [{"case": case, "command": command, "args": args}
            for case, mc in cases.items() for command, args in commands(hf, mc).items()]
    spec = scratch / "runs.json"
    spec.write_text(json.dumps({"address_space": ADDRESS_SPACE, "runs": runs}))
    try:
        proc = subprocess.run([sys.executable, str(CHILD), str(spec)], capture_output=True, text=True,
                              timeout=timeout)
        stdout, died = proc.stdout, (f"exit {proc.returncode}: {proc.stderr[-2000:]}" if proc.returncode else "")
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        died = f"still running after {timeout} s"
    (scratch / "runs.out").write_text(stdout)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if died:
        started = [line for line in lines if "start" in line]
        pytest.fail(f"{started[-1] if started else 'before any run'}: {died}")
    by_args = {tuple(r["args"]): (r["case"], r["command"]) for r in runs}
    return {by_args[tuple(line["args"])]: line for line in lines if "code" in line}


def assert_bounded(result: Any, named: str, left_in: Path) -> None:
    """One run: exit 0 or 2 (one `error:` line naming the file), in time and memory, nothing left behind, strict
    JSON on exit 0."""
    where = f"{result['case']} {result['command']}"
    assert result["exception"] is None, (where, result["exception"])
    assert result["code"] in (0, 2), (where, result["code"], result["stderr"][-2000:])
    assert result["seconds"] < MAX_SECONDS and result["rss_mb"] < MAX_RSS_MB, (where, result)
    if result["code"] == 0:
        _strict(result["stdout"])
    else:
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (where, result["stderr"])
        assert named in lines[0] or str(left_in) in lines[0], (where, lines[0])
    assert not [p.name for p in left_in.parent.iterdir() if "glmconv-lock" in p.name or "staging" in p.name], where


@pytest.fixture(scope="module")
def miles(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("common") / "miles"
    glmconv.convert(tiny_ckpt, out, layout="miles")
    return out


@pytest.fixture(scope="module")
def base(miles: Path) -> dict[str, Any]:
    return read_common_state(miles / RELEASE)


def _with(base: dict[str, Any], changes: dict[Any, Any]) -> dict[Any, Any]:
    """`base` with top-level entries changed; `"args_NAME": value` sets an attribute of its args."""
    state: dict[Any, Any] = dict(base)
    args = argparse.Namespace(**vars(state["args"]))
    for key, value in changes.items():
        if isinstance(key, str) and key.startswith("args_"):
            setattr(args, key[len("args_"):], value)
        else:
            state[key] = value
    state["args"] = args
    return state


def _namespace(attributes: dict[Any, Any]) -> argparse.Namespace:
    """A namespace with any attribute names (pickle's BUILD sets them so; argparse's repr fails on a non-string)."""
    ns = argparse.Namespace()
    ns.__dict__.update(attributes)
    return ns


def _nested_tuple(n: int) -> Any:
    t: Any = ()
    for _ in range(n):
        t = (t,)
    return t


# case -> (where, what to change (the object itself, for EXTRA_STATE), the refusal export/relayout/verify print;
# None: all exit 0)
NAMED: dict[str, tuple[str, dict[Any, Any], str | None]] = {
    "shared-64": (COMMON_PT_NAME, {"rng_state": raw("shared-list", 64)},
                  "common state reaches more than 1,000,000 values (a shared one counted each time it is reached; "),
    "shared-64-in-dcp": (COMMON_STATE_KEY, {"rng_state": raw("shared-list", 64)},
                         "common state reaches more than 1,000,000 values"),
    "shared-64-beside-a-tensor": (COMMON_STATE_KEY, {"rng_state": [torch.arange(3), raw("shared-appends", 64)]},
                                  "common state reaches more than 1,000,000 values"),
    "deep-100000": (COMMON_PT_NAME, {"rng_state": raw("deep-list", 100_000)},
                    f"common state nests more than {MAX_DEPTH} levels deep at rng_state[0][0][...94 more...][0][0][0], "
                    f"expected at most {MAX_DEPTH} in a Megatron common state"),
    "deep-dict": (COMMON_PT_NAME, {"iteration": raw("deep-dict", 5000)},
                  f"common state nests more than {MAX_DEPTH} levels deep at iteration[0][0][...94 more...][0][0][0]"),
    "deep-tuple-key": (COMMON_PT_NAME, {"rng_state": raw("deep-tuple-key", 1_000_000)},
                       "common state nests tuples more than 100 deep (at byte"),
    "cycle": (COMMON_PT_NAME, {"args_seed": raw("cycle", 1)},
              f"common state nests more than {MAX_DEPTH} levels deep at args.seed[0][...94 more...][0][0][0]"),
    "memo-bomb": (COMMON_PT_NAME, {"rng_state": raw("memo-bomb", 10**8)},
                  "common state puts memo entry 100,000,000 (at byte"),
    "shared-text": (COMMON_PT_NAME, {"rng_state": raw("shared-text", 100_000)},
                    "common state reaches more than 16,777,216 characters of text"),
    "huge-int": (COMMON_PT_NAME, {"rng_state": [1, 2**20000]},
                 "common state holds an integer of 20,001 bits at rng_state[1], expected at most 14,000 bits"),
    "int-of-5000-digits": (COMMON_PT_NAME, {"iteration": raw("text-long", 5000)},
                           "common state is not a readable torch archive"),
    "namespace-attribute-1": (COMMON_PT_NAME, {"iteration": _namespace({1: "a"})},
                              "common state holds a namespace with an attribute named 1 at iteration, expected string "
                              "names"),
    "deep-tuple-key-in-extra-state": (EXTRA_STATE, {"": raw("deep-tuple-key", 1_000_000)},
                                      f"{EXTRA_STATE}: stored object is not loadable by torch.load (PickleOutOfBounds: "
                                      "nests tuples more than 100 deep (at byte"),
    "sets-and-bytes": (COMMON_STATE_KEY, {"iteration": {1, 2}, "rng_state": {"s": {1, (4, 5)}, "b": b"\x00\xff",
                                                                            "ba": bytearray(b"x")},
                                        "args_extra": {b"k", 2.5}}, None),
    "nan-and-wide-ints": (COMMON_PT_NAME, {"iteration": math.nan,
                                             "rng_state": [math.nan, math.inf, -math.inf, 2**10000, -(2**13000)],
                                             "args_seed": 2**64}, None),
    "odd-keys-and-tuples": (COMMON_PT_NAME, {7: "seven", "rng_state": {(1, (2, (3,))): "t", None: 1, 2.5: 2,
                                                                       b"k": 3, _nested_tuple(90): 5},
                                             "args_nested": _nested_tuple(90)}, None),
}


def test_every_command_is_bounded_on_the_hostile_common_states_of_issue_39(
        miles: Path, base: dict[str, Any], tiny_ckpt: Path, tmp_path: Path) -> None:
    cases = {case: Path(shutil.copytree(miles, tmp_path / case)) for case in NAMED}
    named = {case: plant(cases[case], changes[""] if where == EXTRA_STATE else _with(base, changes), where)
             for case, (where, changes, _) in NAMED.items()}
    results = run_bounded(cases, tiny_ckpt, tmp_path, timeout=240)
    for case, (*_, refusal) in NAMED.items():
        for command in ("audit-names", "export", "relayout", "verify"):
            result = results[(case, command)]
            assert_bounded(result, named[case], tmp_path / case)
            if command == "audit-names" or refusal is None:
                assert result["code"] == 0, (case, command, result["stderr"])
            else:
                assert result["code"] == 2 and refusal in result["stderr"], (case, command, result["stderr"])
        if refusal is None:  # relayout carried every value over as it was read
            got = read_common_state(tmp_path / f"{case}-relayout" / RELEASE)
            want = read_common_state(tmp_path / case / RELEASE)
            assert canonical(got["rng_state"]) == canonical(want["rng_state"]), case
            assert got["args"].mtp_num_layers is None and got["glmconv"] == {"layout": "mcore"}


def canonical(value: Any) -> Any:
    """`value` comparable across processes and reads: sets sorted (their order follows str hashes, which differ
    from process to process), NaN as a string, namespaces and dicts as item lists."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, argparse.Namespace):
        return ("namespace", canonical(vars(value)))
    if isinstance(value, dict):
        return (type(value).__name__, [(canonical(k), canonical(v)) for k, v in value.items()])
    if isinstance(value, list | tuple):
        return (type(value).__name__, [canonical(v) for v in value])
    if isinstance(value, set | frozenset):
        return (type(value).__name__, sorted((canonical(v) for v in value), key=repr))
    return value


# ---- drawn hostile states --------------------------------------------------------------------------------------

def _hashables(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.tuples(inner, inner), st.frozensets(inner, max_size=3))


HASHABLE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**200), 2**200), st.floats(), st.text(max_size=6),
              st.binary(max_size=6)), _hashables, max_leaves=6)
RAW = st.sampled_from([raw("shared-list", 64), raw("shared-list", 12), raw("shared-appends", 64),
                       raw("shared-appends", 10), raw("deep-list", 100_000),
                       raw("deep-list", 99), raw("deep-tuple-key", 100_000), raw("deep-tuple-key", 98),
                       raw("deep-dict", 3000), raw("cycle", 1), raw("wide-long", 2000), raw("wide-long", 1000),
                       raw("text-long", 4300), raw("memo-bomb", 3 << 30), raw("shared-text", 20_000)])
def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(HASHABLE, inner, max_size=4),
        st.sets(HASHABLE, max_size=4), st.frozensets(HASHABLE, max_size=3),
        st.dictionaries(st.text(max_size=4), inner, max_size=3).map(OrderedDict),
        st.dictionaries(st.one_of(st.from_regex(r"[a-z]{1,6}", fullmatch=True), HASHABLE), inner,
                        max_size=3).map(_namespace))


VALUES = st.recursive(
    st.one_of(HASHABLE, RAW, st.integers(-(2**16000), 2**16000), st.binary(max_size=64).map(bytearray)),
    _containers, max_leaves=12)
PLACES = ["iteration", "rng_state", "args_num_layers", "args_moe_layer_freq", "args_extra", "args", "glmconv",
          "checkpoint_version", 7, "the state"]


def hostile(base: dict[str, Any], place: Any, value: Any) -> Any:
    """`base` with `value` at `place` (PLACES)."""
    if place == "the state":
        return value
    return _with(base, {place: value})


@given(drawn=st.lists(st.tuples(st.sampled_from(PLACES), VALUES, st.sampled_from([COMMON_PT_NAME, COMMON_STATE_KEY])),
                      min_size=3, max_size=3))
@fuzz(3)
def test_every_command_is_bounded_on_drawn_hostile_common_states(
        miles: Path, base: dict[str, Any], tiny_ckpt: Path, drawn: list[tuple[Any, Any, str]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        scratch, cases, named = Path(d), {}, {}
        for i, (place, value, where) in enumerate(drawn):
            mc = Path(shutil.copytree(miles, scratch / f"drawn{i}"))
            cases[mc.name], named[mc.name] = mc, plant(mc, hostile(base, place, value), where)
        results = run_bounded(cases, tiny_ckpt, scratch, timeout=180)
        for (case, _), result in results.items():
            assert_bounded(result, named[case], cases[case])
        assert len(results) == 4 * len(cases)


@given(place=st.sampled_from(PLACES), value=VALUES)
@fuzz(100)
def test_reading_and_writing_back_a_drawn_common_state_is_bounded(
        base: dict[str, Any], place: Any, value: Any) -> None:
    """What the commands do with a common state, in process: read it, check its args, carry it to the other layout
    and pickle it back (relayout), read that again. Each step either refuses it (one CheckpointError line) or
    finishes; what relayout writes reads back the same."""
    data = archive(hostile(base, place, value))
    try:
        state = load_common_state(data, source="common.pt")
    except CheckpointError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("common.pt: common state"), str(exc)
        event(f"refused: {' '.join(str(exc).split()[3:6])}")
        return
    event("read")
    str(state.get("iteration"))  # export's summary shows it
    try:
        check_stored_args(state.get("args"), TINY, "common.pt")
    except CheckpointError as exc:
        assert str(exc).startswith("common.pt: the stored Megatron args say ") and "\n" not in str(exc), str(exc)
    relaid = relaid_common_state(state, TINY, "mcore")
    buf = io.BytesIO()
    torch.save([relaid], buf, pickle_module=pickle_module_for(relaid))
    again = load_common_state(buf.getvalue(), source="again")
    assert canonical(again) == canonical(relaid)


# ---- bounds checked before anything is unpickled ------------------------------------------------------------------

def test_a_tuple_nested_past_the_c_stack_is_refused_before_it_is_unpickled() -> None:
    deep_key = b"\x80\x02}" + RAW_OPS["deep-tuple-key"](1_000_000)[1:] + b"."  # {((...)): 1}: SIGSEGV when loaded
    with pytest.raises(PickleOutOfBounds, match=r"^nests tuples more than 100 deep \(at byte 103\)$"):
        check_pickle_bounds(deep_key)


def test_a_memo_index_past_the_pickles_size_is_refused_before_it_is_unpickled() -> None:
    bomb = b"\x80\x02" + RAW_OPS["memo-bomb"](10**8) + b"."  # 9 bytes that make C's unpickler take 1.5 GB
    with pytest.raises(PickleOutOfBounds, match=r"^puts memo entry 100,000,000 \(at byte 3\), past the 1,042 a "
                                                r"pickle of 9 bytes may use$"):
        check_pickle_bounds(bomb)


@pytest.mark.parametrize("protocol", range(6))
def test_tuples_nested_100_deep_pass_and_101_are_refused_at_every_protocol(protocol: int) -> None:
    import pickle

    t = _nested_tuple(99)  # (((),),): the empty tuple is one level
    check_pickle_bounds(pickle.dumps([{t: [t, t]}, OrderedDict(a=t), argparse.Namespace(x=t)], protocol=protocol))
    with pytest.raises(PickleOutOfBounds, match="nests tuples more than 100 deep"):
        check_pickle_bounds(pickle.dumps({(t,): 1}, protocol=protocol))


# ---- a refused global is named, never advised -----------------------------------------------------------------

@pytest.mark.parametrize("where", [COMMON_PT_NAME, COMMON_STATE_KEY, "extra-state"])
def test_a_refused_global_is_named_and_never_advised(where: str, miles: Path, base: dict[str, Any],
                                                      tmp_path: Path) -> None:
    mc = Path(shutil.copytree(miles, tmp_path / "mc"))
    if where == "extra-state":
        plant(mc, eval, EXTRA_STATE)
        expected = (f"{EXTRA_STATE}: stored object is not loadable by torch.load (refusing to unpickle "
                    "builtins.eval: not on the allow-list, and glmconv never unpickles a global outside it)")
    else:
        plant(mc, _with(base, {"rng_state": eval}), where)
        expected = ("common state holds the disallowed global builtins.eval; refusing to unpickle it (not on the "
                    "allow-list, and glmconv never unpickles a global outside it)")
    res = CliRunner().invoke(cli, ["export", str(mc), str(tmp_path / "out")])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].endswith(expected), res.stderr
    assert "safe_globals" not in res.stderr and "weights_only" not in res.stderr
    assert not (tmp_path / "out").exists()


# ---- the DCP .metadata and the tensor chunks: the same bounds, before any unpickler runs -------------------------

MEMO_BOMB = b"\x80\x02" + RAW_OPS["memo-bomb"](10**8) + b"."  # 9 bytes that make C's unpickler take 1.5 GB
DEEP_KEY = b"\x80\x02}" + RAW_OPS["deep-tuple-key"](1_000_000)[1:] + b"."  # {((...)): 1}: SIGSEGV when loaded


def _first_chunk_pickle(mc: Path) -> tuple[Path, int]:
    """The data file of the checkpoint's first tensor chunk and the offset of that archive's data.pkl bytes."""
    from glmconv.io.torch_dist.reader import read_metadata
    from glmconv.io.torch_dist.zip_records import record_start

    md = read_metadata(mc / RELEASE)
    index, info = next((k, v) for k, v in md.storage_data.items() if k.fqn != COMMON_STATE_KEY and k.offset)
    path = mc / RELEASE / info.relative_path
    archive = io.BytesIO(path.read_bytes()[info.offset:info.offset + info.length])
    with zipfile.ZipFile(archive) as z:
        (pkl,) = [i for i in z.infolist() if i.filename.endswith("/data.pkl")]
    start = record_start(archive, 0, info.length, pkl)
    assert start is not None and pkl.file_size > len(MEMO_BOMB), index
    return path, info.offset + start


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(data)


def test_every_command_is_bounded_on_a_hostile_metadata_or_tensor_chunk(miles: Path, tiny_ckpt: Path,
                                                                       tmp_path: Path) -> None:
    cases = {case: Path(shutil.copytree(miles, tmp_path / case))
             for case in ("metadata-memo-bomb", "metadata-deep-key", "chunk-memo-bomb")}
    (cases["metadata-memo-bomb"] / RELEASE / ".metadata").write_bytes(MEMO_BOMB)
    (cases["metadata-deep-key"] / RELEASE / ".metadata").write_bytes(DEEP_KEY)
    data_file, at = _first_chunk_pickle(cases["chunk-memo-bomb"])
    _overwrite(data_file, at, MEMO_BOMB)  # what follows the pickle's STOP is never read
    named = {"metadata-memo-bomb": ".metadata", "metadata-deep-key": ".metadata", "chunk-memo-bomb": data_file.name}
    refusal = {"metadata-memo-bomb": ".metadata: refusing to unpickle: it puts memo entry 100,000,000",
               "metadata-deep-key": ".metadata: refusing to unpickle: it nests tuples more than 100 deep",
               "chunk-memo-bomb": "puts memo entry 100,000,000"}
    results = run_bounded(cases, tiny_ckpt, tmp_path, timeout=240)
    for case in cases:
        for command in ("audit-names", "export", "relayout", "verify"):
            result = results[(case, command)]
            assert_bounded(result, named[case], tmp_path / case)
            if case.startswith("chunk") and command == "audit-names":  # names only: no tensor is read
                assert result["code"] == 0, (case, command, result["stderr"])
            else:
                assert result["code"] == 2 and refusal[case] in result["stderr"], (case, command, result["stderr"])
