"""The Python API refuses what the command line refuses, with one GlmconvError line, before reading anything.

Every check runs on paths that do not exist: a refusal that names the option proves it came first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import glmconv
from glmconv import arguments
from glmconv.errors import GlmconvError
from glmconv_cli.main import cli

NOWHERE = "/nonexistent/glmconv-test"
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
                      st.lists(st.integers(), max_size=2))


def _refusal(fn: Any, *args: Any, **kw: Any) -> str:
    with pytest.raises(GlmconvError) as exc:
        fn(*args, **kw)
    return str(exc.value)


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "--workers 0: expected a count from 1 to 256, or auto"),
    ({"workers": -3}, "--workers -3: expected a count from 1 to 256, or auto"),
    ({"workers": 1.5}, "--workers 1.5: expected a count from 1 to 256, or auto"),
    ({"workers": "lots"}, "--workers lots: expected a count from 1 to 256, or auto"),
    ({"workers": True}, "--workers True: expected a count from 1 to 256, or auto"),
    ({"read_threads": -1}, "--read-threads -1: expected a whole number from 0 to 64"),
    ({"group_bytes": 0}, "--group-size 0: expected a size from 1 byte to 1PiB (1125899906842624 bytes)"),
    ({"dtype": "fp8"}, "--dtype fp8: choose from keep, bf16, fp32"),
    ({"device": "tpu"}, "--device tpu: choose from auto, cpu, cuda"),
    ({"layout": "nemo"}, "--layout nemo: choose from miles, mcore"),
    ({"force": "yes"}, "--force yes: expected True or False"),
])


def test_convert_refuses_what_the_cli_refuses(kw: dict[str, Any], message: str) -> None:
    assert _refusal(glmconv.convert, NOWHERE, NOWHERE + "-out", **kw) == message


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "--workers 0: expected a count from 1 to 256, or auto"),
    ({"read_threads": 65}, "--read-threads 65: expected a whole number from 0 to 64"),
    ({"max_shard_bytes": 0}, "--max-shard-size 0: expected a size from 1 byte to 1PiB (1125899906842624 bytes)"),
    ({"like": 3}, "--like 3: expected a path (a str or pathlib.Path)"),
])


def test_export_refuses_what_the_cli_refuses(kw: dict[str, Any], message: str) -> None:
    assert _refusal(glmconv.export, NOWHERE, NOWHERE + "-out", **kw) == message


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "--workers 0: expected a count from 1 to 256, or auto"),
    ({"read_threads": 65}, "--read-threads 65: expected a whole number from 0 to 64"),
    ({"device": "tpu"}, "--device tpu: choose from auto, cpu, cuda"),
    ({"progress": "yes"}, "--progress yes: expected True or False"),
])


def test_verify_refuses_what_the_cli_refuses(kw: dict[str, Any], message: str) -> None:
    assert _refusal(glmconv.verify, NOWHERE, NOWHERE + "-mc", **kw) == message


@pytest.mark.parametrize("command", ["convert", "export", "verify"])
def test_the_shared_read_threads_option_refuses_what_the_api_refuses(command: str) -> None:
    res = CliRunner().invoke(cli, [command, NOWHERE, NOWHERE + "-2", "--read-threads", "65"])
    assert res.exit_code == 2 and "65 is not in the range 0<=x<=64" in res.output
    with pytest.raises(GlmconvError):
        arguments.read_threads(65)


def test_relayout_refuses_an_unknown_target_layout() -> None:
    assert _refusal(glmconv.relayout, NOWHERE, NOWHERE + "-out", to="nemo") == "--to nemo: choose from miles, mcore"


def test_audit_refuses_zero_layers() -> None:
    assert _refusal(glmconv.audit, NOWHERE, layers=0) == "--layers 0: expected a whole number of at least 1"


@pytest.mark.parametrize("fn", [glmconv.convert, glmconv.export, glmconv.relayout, glmconv.verify, glmconv.audit,
                                glmconv.parity])


def test_an_unknown_keyword_is_a_glmconv_error_naming_it(fn: Any) -> None:
    required = {"to": "mcore"} if fn is glmconv.relayout else {}
    message = _refusal(fn, NOWHERE, NOWHERE, bogus=1, **required)
    assert message.startswith(f"glmconv.{fn.__name__}(): ") and "'bogus'" in message


def test_a_missing_argument_is_a_glmconv_error() -> None:
    assert _refusal(glmconv.verify, NOWHERE) == "glmconv.verify(): missing a required argument: 'mcore_dir'"


def test_parity_refuses_an_unknown_option_listing_the_known_ones() -> None:
    message = _refusal(glmconv.parity, NOWHERE, NOWHERE, train_convention="serve")
    assert message.startswith("glmconv.parity(): unknown keyword 'train_convention' (the options are: ")
    assert "train_conventions" in message


def test_parity_reads_a_string_fail_on_as_one_bound() -> None:
    assert arguments.fail_on("logprob_abs_diff.max>1e-4") == ("logprob_abs_diff.max>1e-4",)


def test_parity_reads_a_sequence_fail_on_as_its_bounds() -> None:
    assert arguments.fail_on(["kl>1e-6", "top1_agreement<0.99"]) == ("kl>1e-6", "top1_agreement<0.99")


def test_parity_string_fail_on_is_parsed_whole_before_any_model_is_built() -> None:
    # a bad metric inside a one-string bound is named whole (not letter by letter), before the missing paths
    assert _refusal(glmconv.parity, NOWHERE, NOWHERE, fail_on="bogus>1") == (
        "--fail-on 'bogus>1': unknown metric 'bogus' (choose from " + _metrics() + ")")


def _metrics() -> str:
    from glmconv.compare.metrics import BOUND_METRICS

    return ", ".join(BOUND_METRICS)


@given(ANY_VALUE)
def test_workers_accepts_exactly_counts_1_to_256_and_auto(value: object) -> None:
    ok = value == "auto" or (type(value) is int and 1 <= value <= 256)
    try:
        assert arguments.workers(value) == value and ok
    except GlmconvError:
        assert not ok


@given(st.text(alphabet="0123456789 auto-x.", max_size=5))
def test_workers_text_is_read_as_the_cli_reads_it(text: str) -> None:
    cli_result = CliRunner().invoke(cli, ["convert", NOWHERE, NOWHERE + "-out", "--workers", text, "--dry-run"])
    cli_refused = "Invalid value for '--workers'" in cli_result.output
    try:
        arguments.workers(text)
        api_refused = False
    except GlmconvError:
        api_refused = True
    assert cli_refused == api_refused


@given(ANY_VALUE)
def test_read_threads_accepts_exactly_ints_0_to_64(value: object) -> None:
    ok = type(value) is int and 0 <= value <= 64
    try:
        assert arguments.read_threads(value) == value and ok
    except GlmconvError:
        assert not ok


@given(ANY_VALUE)
def test_sizes_accept_exactly_ints_from_1_byte_to_1_pib(value: object) -> None:
    ok = type(value) is int and 1 <= value <= 2**50
    try:
        assert arguments.size("--group-size", value) == value and ok
    except GlmconvError:
        assert not ok


@given(ANY_VALUE)
def test_fail_on_accepts_a_string_or_a_list_of_strings_only(value: object) -> None:
    ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    try:
        got = arguments.fail_on(value)
        assert ok and got == ((value,) if isinstance(value, str) else tuple(value))  # type: ignore[arg-type]
    except GlmconvError:
        assert not ok


def test_audit_returns_what_json_prints(tiny_ckpt: Path) -> None:
    report = glmconv.audit(tiny_ckpt)
    printed = CliRunner().invoke(cli, ["audit-names", str(tiny_ckpt), "--json"]).output
    assert json.loads(json.dumps(report)) == json.loads(printed)
    assert report["ok"] is True and report["findings"] == []
