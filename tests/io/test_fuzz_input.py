"""Malformed files and options, fuzzed through the CLI: never a traceback, always one line.

Each property writes a hostile value where glmconv reads untrusted input (every JSON file it parses, each
config key, each size option), runs the command in this process (tests/io/test_bad_input.py's contract: one
`error:` line matching the case, exit 2, inputs byte-identical, nothing published), and asserts the line
names the file or key. Names read from files are checked never to reach the terminal raw, a format vote
to blame the minority tensor, and any unexpected exception to become the internal-error line (exit 3).
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from click.testing import CliRunner
from helpers.bad_input import add_tensor, assert_refused, edit_shard, invoke, weight_map
from helpers.fuzzing import fuzz
from hypothesis import assume, given
from hypothesis import strategies as st

from glmconv.config import LAC_SCHEMA, TEXT_SCHEMA, VISION_SCHEMA
from glmconv.errors import CheckpointError, GlmconvError
from glmconv.io.config_file import load_config
from glmconv.io.file_names import CONFIG_NAME, INDEX_NAME, RELEASE
from glmconv.plan import FP8, build_plan
from glmconv.progress import Progress
from glmconv.rules import names
from glmconv.text import printable
from glmconv_cli.main import cli
from glmconv_cli.sizes import MAX_SIZE, parse_size

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MANIFEST = "glmconv.json"
MCORE_METADATA = "metadata.json"


@contextmanager
def copy_of(src: Path) -> Iterator[Path]:
    """A scratch copy of a fixture (hypothesis examples cannot use pytest's function-scoped tmp_path)."""
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "src"
        shutil.copytree(src, dst)
        yield dst


# ---- hostile JSON in every file glmconv parses -----------------------------------------------------

DEPTHS = st.integers(10_000, 100_000)  # past any recursion limit hypothesis or python sets
HOSTILE_JSON = st.one_of(
    DEPTHS.map(lambda d: "[" * d + "]" * d),
    DEPTHS.map(lambda d: '{"a":' * d + "0" + "}" * d),
    st.integers(41, 12_000).map(lambda n: "9" * n),  # past a u64, and past Python's 4,300-digit int limit
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400"]),
)


def embed(doc: Any, path: list[str], payload: str) -> str:
    """`doc` as JSON with the value at `path` replaced by the raw `payload` text."""
    marker = "\u0000HOSTILE\u0000"
    target = doc
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = marker
    return json.dumps(doc).replace(json.dumps(marker), payload)


def _hf_config(src: Path, payload: str, whole: bool) -> str:
    cfg = json.loads((src / CONFIG_NAME).read_text())
    (src / CONFIG_NAME).write_text(payload if whole else embed(cfg, ["text_config", "hidden_size"], payload))
    return r"config\.json: not valid JSON \("


def _hf_index(src: Path, payload: str, whole: bool) -> str:
    index = json.loads((src / INDEX_NAME).read_text())
    (src / INDEX_NAME).write_text(payload if whole else embed(index, ["metadata", "total_size"], payload))
    return re.escape(f"{INDEX_NAME}: not valid JSON, truncated or corrupt (")


def _hf_header(src: Path, payload: str, whole: bool) -> str:
    shard = sorted(set(weight_map(src).values()))[0]
    data = (src / shard).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    blob = (payload if whole else embed(header, ["__metadata__", "format"], payload)).encode()
    (src / shard).write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
    return re.escape(f"{shard}: corrupt header: not valid UTF-8 JSON (")


def _mc_manifest(mc: Path, payload: str, whole: bool) -> str:
    doc = json.loads((mc / MANIFEST).read_text())
    (mc / MANIFEST).write_text(payload if whole else embed(doc, ["text_prefix"], payload))
    return re.escape(f"{MANIFEST}: not valid JSON (")


def _mc_metadata(mc: Path, payload: str, whole: bool) -> str:
    path = mc / RELEASE / MCORE_METADATA
    doc = json.loads(path.read_text())
    path.write_text(payload if whole else embed(doc, ["sharded_backend"], payload))
    return re.escape(f"{MCORE_METADATA}: not valid JSON (")


BREAKS: dict[str, tuple[str, str, Callable[[Path, str, bool], str]]] = {
    "config.json": ("convert", "hf", _hf_config),
    "index": ("convert", "hf", _hf_index),
    "shard header": ("convert", "hf", _hf_header),
    "glmconv.json": ("export", "mc", _mc_manifest),
    "metadata.json": ("export", "mc", _mc_metadata),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(BREAKS))
@fuzz(10)
@given(payload=HOSTILE_JSON, whole=st.booleans())
def test_hostile_json_is_one_line_naming_the_file(where: str, payload: str, whole: bool, tiny_ckpt: Path,
                                                  mc_ckpt: Path) -> None:
    command, source, breaks = BREAKS[where]
    with copy_of(tiny_ckpt if source == "hf" else mc_ckpt) as src:
        pattern = breaks(src, payload, whole)
        out = src.parent / "out"
        assert_refused([command, str(src), str(out)], [src], out, pattern)


@fuzz(6)
@given(payload=HOSTILE_JSON, lines=st.booleans())
def test_hostile_prompt_file_is_one_line_naming_it(payload: str, lines: bool, tiny_ckpt: Path,
                                                   mc_ckpt: Path) -> None:
    with tempfile.TemporaryDirectory() as d:
        prompt = Path(d) / "p.json"
        prompt.write_text(f"[1, 2]\n[3, {payload}]\n" if lines else f"[[1, 2], [3, {payload}]]")
        args = ["parity", str(tiny_ckpt), str(mc_ckpt), "--prompt-file", str(prompt)]
        assert_refused(args, [prompt, tiny_ckpt, mc_ckpt], Path(d) / "none", r"p\.json(:\d+)?: not valid JSON \(")


# ---- config values of the wrong type ---------------------------------------------------------------

WRONG_VALUES = st.one_of(
    st.text(max_size=6), st.booleans(), st.none(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.lists(st.integers(0, 3), max_size=3),
    st.lists(st.text(max_size=2), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
KEYS = st.sampled_from([("text_config", k, TEXT_SCHEMA[k]) for k in sorted(TEXT_SCHEMA)]
                       + [("text_config.linear_attn_config", k, LAC_SCHEMA[k]) for k in sorted(LAC_SCHEMA)]
                       + [("vision_config", k, VISION_SCHEMA[k]) for k in sorted(VISION_SCHEMA)])


@fuzz(40)
@given(key=KEYS, value=WRONG_VALUES)
def test_config_value_of_the_wrong_type_names_the_key(key: tuple[str, str, Any], value: Any,
                                                      tiny_ckpt: Path) -> None:
    where, name, spec = key
    assume(not spec.accepts(value))
    with copy_of(tiny_ckpt) as src:
        cfg = json.loads((src / CONFIG_NAME).read_text())
        target = cfg
        for part in where.split("."):
            target = target[part]
        target[name] = value
        (src / CONFIG_NAME).write_text(json.dumps(cfg))
        out = src.parent / "out"
        line = assert_refused(["convert", str(src), str(out)], [src], out,
                              re.escape(f"{where}.{name} must be {spec.expected()}, got "))
    assert line.startswith(f"error: {src / CONFIG_NAME}: ")


@pytest.mark.parametrize("key, value, found", [
    ("hidden_size", "64", "'64' (a string)"), ("hidden_size", 64.0, "64.0 (a number)"),
    ("hidden_size", True, "true (a boolean)"), ("num_hidden_layers", -4, "-4 (an integer)"),
    ("n_routed_experts", 0, "0 (an integer)"), ("layer_types", "linear_attention", "'linear_attention' (a string)"),
    ("mlp_layer_types", [["dense"]], "a list of 1 item"), ("rms_norm_eps", "1e-5", "'1e-5' (a string)"),
])


def test_config_type_error_says_expected_and_found(key: str, value: Any, found: str, tiny_ckpt: Path,
                                                   tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    cfg = json.loads((src / CONFIG_NAME).read_text())
    cfg["text_config"][key] = value
    (src / CONFIG_NAME).write_text(json.dumps(cfg))
    line = assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out", "")
    assert line == f"error: {src / CONFIG_NAME}: text_config.{key} must be {TEXT_SCHEMA[key].expected()}, got {found}"


def test_huge_dimension_is_refused_before_any_allocation(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    cfg = json.loads((src / CONFIG_NAME).read_text())
    cfg["text_config"]["num_hidden_layers"] = 10**12
    (src / CONFIG_NAME).write_text(json.dumps(cfg))
    assert_refused(["audit-names", str(src)], [src], tmp_path / "out",
                   re.escape("text_config.num_hidden_layers must be a positive integer up to 1024, got 1000000000000"))


# ---- size options ------------------------------------------------------------------------------------

@fuzz(300)
@given(st.text(max_size=12) | st.from_regex(r"[-+]?[0-9.]{0,6}([eE][-+]?[0-9]{1,4})?\s*[a-zA-Z]{0,4}", fullmatch=True))
def test_parse_size_returns_a_size_in_range_or_a_usage_error(text: str) -> None:
    try:
        size = parse_size(text)
    except click.BadParameter as exc:
        assert printable(exc.message) == exc.message
        return
    assert type(size) is int and 1 <= size <= MAX_SIZE


@pytest.mark.parametrize("text, reason", [
    ("1e999", "larger than the largest size"), (".", "expected a size"), ("-1", "expected a size"),
    ("0", "at least 1 byte"), ("nan", "expected a size"), ("inf", "expected a size"), ("0.1", "at least 1 byte"),
    ("1e30", "larger than the largest size"), ("5XB", "expected a size"), ("9" * 5000, "larger than the largest size"),
])


@pytest.mark.parametrize("command", ["convert --group-size", "export --max-shard-size"])
def test_bad_size_option_is_one_usage_line(command: str, text: str, reason: str, tmp_path: Path) -> None:
    name, option = command.split()
    src = tmp_path / "src"
    src.mkdir()
    line = assert_refused([name, option, text, str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                          re.escape(f"error: Invalid value for '{option}': "))
    assert reason in line and len(line) < 400


def test_exact_sizes() -> None:
    assert [parse_size(s) for s in ("1", "1.5KiB", "5GB", "1e3", "2 MiB", "1PiB")] == [
        1, 1536, 5 * 10**9, 1000, 2 * 2**20, 2**50]


# ---- the CLI guard: a bug is exit 3 with one line, never a traceback --------------------------------

@pytest.mark.parametrize("exc", [RuntimeError("boom\nsecond line"), ZeroDivisionError("division by zero"),
                                 RecursionError("maximum recursion depth exceeded"), KeyError("x"),
                                 MemoryError()])


def test_unexpected_exception_is_an_internal_error_line_exit_3(exc: Exception, monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    def boom(*_: object, **__: object) -> None:
        raise exc

    monkeypatch.setattr("glmconv.runners.convert.prepare", boom)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    res = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out")])
    assert res.exit_code == 3
    message = f": {printable(str(exc))}" if str(exc) else ""
    [saved] = tmp_path.glob("glmconv-internal-error-*.txt")
    assert res.stderr == (f"internal error: {type(exc).__name__}{message}; please report this on the glmconv issue "
                          f"tracker with the command line and the traceback in {saved}\n")
    assert "Traceback" not in res.output


def test_an_internal_error_saves_its_traceback_for_the_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("expected scalar type BFloat16 but found Float")

    monkeypatch.setattr("glmconv.runners.convert.prepare", boom)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out")])
    [saved] = tmp_path.glob("glmconv-internal-error-*.txt")
    text = saved.read_text()
    assert text.startswith("glmconv ") and "Traceback (most recent call last)" in text
    assert "in boom" in text and text.endswith("RuntimeError: expected scalar type BFloat16 but found Float\n")
    assert saved.stat().st_mode & 0o777 == 0o600


def test_an_internal_error_without_a_writable_temp_folder_is_still_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    def boom(*_: object, **__: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("glmconv.runners.convert.prepare", boom)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "absent"))
    res = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out")])
    assert (res.exit_code, res.stderr) == (3, "internal error: RuntimeError: boom; please report this on the glmconv "
                                              "issue tracker with the command line\n")


def test_glmconv_error_keeps_exit_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise CheckpointError("x.safetensors: bad")

    monkeypatch.setattr("glmconv.runners.convert.prepare", refuse)
    res = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out")])
    assert (res.exit_code, res.stderr) == (2, "error: x.safetensors: bad\n")


def test_keyboard_interrupt_is_not_an_internal_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def interrupt(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("glmconv.runners.convert.prepare", interrupt)
    res = CliRunner().invoke(cli, ["convert", str(tmp_path), str(tmp_path / "out")])
    assert res.exit_code != 3 and "internal error" not in res.output


# ---- names never reach the terminal raw --------------------------------------------------------------

HOSTILE_NAMES = st.lists(st.sampled_from(list("ab.[]/=\\") + ["\n", "\r", "\t", "\x1b", "\x07", "\u202e",
                                                               "\x85", "\u2028", "[bold]", "[/]", "\x1b[31m"]),
                         min_size=1, max_size=8).map(lambda parts: "x" + "".join(parts))


def raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


@fuzz(20)
@given(name=HOSTILE_NAMES)
def test_audit_table_shows_hostile_tensor_names_escaped(name: str, tiny_ckpt: Path) -> None:
    with copy_of(tiny_ckpt) as src:
        add_tensor(src, name, torch.zeros(2, dtype=torch.bfloat16))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("COLUMNS", "2000")  # rich folds cells at the terminal width; one line per row here
            got = invoke(["audit-names", str(src)])
    assert got.exit_code == 1
    assert raw_controls(got.stdout) == []
    assert printable(name) in got.stdout  # shown, escaped, and `[bold]` not eaten as markup


@fuzz(50)
@given(text=st.text())
def test_every_glmconv_error_message_is_printable(text: str) -> None:
    assert str(GlmconvError(text)).isprintable()


def test_progress_line_escapes_its_label() -> None:
    line = Progress("convert\n\x1b[2J", 10, 1, enabled=False).line()
    assert line.startswith("convert\\n\\x1b[2J: ") and line.isprintable()


# ---- the FP8/BF16 vote names the minority --------------------------------------------------------------

def fp8_weights(src: Path) -> list[str]:
    cfg = load_config(src)
    plan = build_plan(cfg, fp8=True, mtp=True, vision=True, text_prefix=names.HF_TEXT_PREFIX)
    return sorted(n for n, spec in plan.hf_index.items() if spec.dtype == FP8)


def _store(src: Path, flip: list[str], fp8: bool) -> None:
    """Store `flip` as F8_E4M3 (fp8) or as BF16 without their scales (not fp8), shard by shard."""
    wm = weight_map(src)
    for shard in sorted({wm[n] for n in flip}):
        here = [n for n in flip if wm[n] == shard]

        def edit(ts: dict[str, torch.Tensor], here: list[str] = here) -> dict[str, torch.Tensor]:
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            out = {k: v.to(dtype) if k in here else v for k, v in ts.items()}
            return out if fp8 else {k: v for k, v in out.items() if names.scale_owner(k) not in here}
        edit_shard(src, shard, edit)
    if not fp8:
        (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
            k: v for k, v in wm.items() if names.scale_owner(k) not in flip}}))


@pytest.mark.slow
@pytest.mark.parametrize("majority", ["bf16", "fp8"])
@fuzz(8)
@given(data=st.data())
def test_format_vote_blames_the_minority_tensors(majority: str, data: st.DataObject, tiny_ckpt: Path,
                                                 tiny_fp8_ckpt: Path) -> None:
    base = tiny_ckpt if majority == "bf16" else tiny_fp8_ckpt
    flip = data.draw(st.lists(st.sampled_from(fp8_weights(base)), min_size=1, max_size=3, unique=True))
    with copy_of(base) as src:
        _store(src, flip, fp8=majority == "bf16")
        out = src.parent / "out"
        line = assert_refused(["convert", str(src), str(out)], [src], out, "dtype: expected")
        audit = invoke(["audit-names", "--json", str(src)])
    culprit = line.removeprefix("error: ").split(" ", 1)[0]
    assert culprit in flip, line
    assert {f["tensor"] for f in json.loads(audit.stdout)["findings"]} == set(flip)


@pytest.mark.parametrize("seed", [str(2**64), str(-(2**63) - 1), "9" * 100])
def test_seed_out_of_range_is_a_usage_error(seed: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert_refused(["fixture", "make", str(out), "--seed", seed], [], out,
                   re.escape("error: Invalid value for '--seed': ") + r".*: expected a seed from -2\*\*63 to 2\*\*64-1")


def test_parity_seed_out_of_range_is_a_usage_error(tmp_path: Path) -> None:
    assert_refused(["parity", str(tmp_path), str(tmp_path), "--seed", str(2**64)], [], tmp_path / "none",
                   re.escape("error: Invalid value for '--seed': 18446744073709551616: expected a seed from -2**63 to "
                             "2**64-1"))


def test_schema_refuses_an_integer_too_large_for_a_float(tiny_ckpt: Path) -> None:
    """parse_config is also called on dicts built in code: a 400-digit int is refused, not an OverflowError."""
    from glmconv.config import parse_config
    from glmconv.errors import ConfigError

    raw = json.loads((tiny_ckpt / CONFIG_NAME).read_text())
    raw["text_config"]["rms_norm_eps"] = 10**400
    with pytest.raises(ConfigError, match=r"^text_config\.rms_norm_eps must be a number >= 0 up to 1, got 1000"):
        parse_config(raw)
