"""The Python API refuses what the command line refuses, with one GlmconvError line, before reading anything.

Every check runs on paths that do not exist: a refusal that names the option proves it came first.
"""

from __future__ import annotations

import dataclasses
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


SIZE = "expected a number of bytes, an int from 1 to 1125899906842624 (1 PiB)"


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "workers=0: expected an int from 1 to 256, or 'auto'"),
    ({"workers": -3}, "workers=-3: expected an int from 1 to 256, or 'auto'"),
    ({"workers": 1.5}, "workers=1.5: expected an int from 1 to 256, or 'auto'"),
    ({"workers": "lots"}, "workers='lots': expected an int from 1 to 256, or 'auto'"),
    ({"workers": True}, "workers=True: expected an int from 1 to 256, or 'auto'"),
    ({"read_threads": -1}, "read_threads=-1: expected an int from 0 to 64"),
    ({"group_bytes": 0}, f"group_bytes=0: {SIZE}"),
    ({"group_bytes": "1GB"}, f"group_bytes='1GB': {SIZE}; text such as '1GB' is the command line's spelling only"),
    ({"dtype": "fp8"}, "dtype='fp8': choose from keep, bf16, fp32"),
    ({"device": "tpu"}, "device='tpu': choose from auto, cpu, cuda"),
    ({"layout": "nemo"}, "layout='nemo': choose from miles, mcore"),
    ({"force": "yes"}, "force='yes': expected True or False"),
])


def test_convert_refuses_naming_its_keyword(kw: dict[str, Any], message: str) -> None:
    """Was `--group-size 1GB: expected a size ...`: a CLI flag named to a Python caller (issue 40)."""
    assert _refusal(glmconv.convert, NOWHERE, NOWHERE + "-out", **kw) == "glmconv.convert(): " + message


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "workers=0: expected an int from 1 to 256, or 'auto'"),
    ({"read_threads": 65}, "read_threads=65: expected an int from 0 to 64"),
    ({"max_shard_bytes": 0}, f"max_shard_bytes=0: {SIZE}"),
    ({"like": 3}, "like=3: expected a path (a str or pathlib.Path)"),
])


def test_export_refuses_naming_its_keyword(kw: dict[str, Any], message: str) -> None:
    assert _refusal(glmconv.export, NOWHERE, NOWHERE + "-out", **kw) == "glmconv.export(): " + message


@pytest.mark.parametrize(("kw", "message"), [
    ({"workers": 0}, "workers=0: expected an int from 1 to 256, or 'auto'"),
    ({"read_threads": 65}, "read_threads=65: expected an int from 0 to 64"),
    ({"device": "tpu"}, "device='tpu': choose from auto, cpu, cuda"),
    ({"progress": "yes"}, "progress='yes': expected True or False"),
])


def test_verify_refuses_naming_its_keyword(kw: dict[str, Any], message: str) -> None:
    assert _refusal(glmconv.verify, NOWHERE, NOWHERE + "-mc", **kw) == "glmconv.verify(): " + message


@pytest.mark.parametrize("command", ["convert", "export", "verify"])
def test_the_shared_read_threads_option_refuses_what_the_api_refuses(command: str) -> None:
    res = CliRunner().invoke(cli, [command, NOWHERE, NOWHERE + "-2", "--read-threads", "65"])
    assert res.exit_code == 2 and "65 is not in the range 0<=x<=64" in res.output
    with pytest.raises(GlmconvError):
        arguments.read_threads(65)


def test_relayout_refuses_an_unknown_target_layout() -> None:
    assert _refusal(glmconv.relayout, NOWHERE, NOWHERE + "-out", to="nemo") == (
        "glmconv.relayout(): to='nemo': choose from miles, mcore")


def test_audit_refuses_zero_layers() -> None:
    assert _refusal(glmconv.audit, NOWHERE, layers=0) == "glmconv.audit(): layers=0: expected an int of at least 1"


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
    assert message.startswith("glmconv.parity(): unknown keyword 'train_convention' (the keywords are: hf_dir, ")
    assert "train_conventions" in message and len(message.splitlines()) == 1


def test_parity_spells_out_every_option_a_user_sets() -> None:
    """Each ParityOptions field is a keyword of glmconv.parity (bounds: its fail_on), so none hides in **options."""
    import inspect

    from glmconv.compare import ParityOptions

    keywords = inspect.signature(glmconv.parity).parameters
    assert not [p for p in keywords.values() if p.kind is p.VAR_KEYWORD]
    assert {f.name for f in dataclasses.fields(ParityOptions)} - {"bounds"} <= set(keywords)


def test_parity_reads_a_string_fail_on_as_one_bound() -> None:
    assert arguments.fail_on("logprob_abs_diff.max>1e-4") == ("logprob_abs_diff.max>1e-4",)


def test_parity_reads_a_sequence_fail_on_as_its_bounds() -> None:
    assert arguments.fail_on(["kl>1e-6", "top1_agreement<0.99"]) == ("kl>1e-6", "top1_agreement<0.99")


def test_parity_string_fail_on_is_parsed_whole_before_any_model_is_built() -> None:
    # a bad metric inside a one-string bound is named whole (not letter by letter), before the missing paths
    assert _refusal(glmconv.parity, NOWHERE, NOWHERE, fail_on="bogus>1") == (
        "--fail-on 'bogus>1': unknown metric 'bogus' (choose from " + _metrics() + ")")


def _metrics() -> str:
    from glmconv.compare.metric_table import bound_names

    return ", ".join(bound_names())


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


# ---- every public function: a wrong type or value is one GlmconvError naming the parameter (issue 40) --------

def _public_calls() -> dict[str, tuple[Any, tuple[Any, ...], dict[str, Any]]]:
    """Each public function of glmconv.api and of `glmconv.__all__`, with arguments it accepts (paths that do not
    exist: every check must come before anything is read)."""
    from glmconv import api

    config = glmconv.load_config(Path(__file__).resolve().parents[2] / "fixtures" / "glm-5.3-flash.config.json")
    return {"convert": (api.convert, (NOWHERE, NOWHERE + "-out"), {}),
            "export": (api.export, (NOWHERE, NOWHERE + "-out"), {}),
            "relayout": (api.relayout, (NOWHERE, NOWHERE + "-out"), {"to": "mcore"}),
            "verify": (api.verify, (NOWHERE, NOWHERE + "-mc"), {}),
            "audit": (api.audit, (NOWHERE,), {}), "audit_report": (api.audit_report, (NOWHERE,), {}),
            "parity": (api.parity, (NOWHERE, NOWHERE), {}),
            "hf_weights": (api.hf_weights, ([], NOWHERE), {}),
            "load_config": (glmconv.load_config, (NOWHERE,), {}),
            "build_plan": (glmconv.build_plan, (config,), {})}


def _wrong_values(default: Any) -> list[Any]:
    """Values of the wrong type for a parameter with this default: anything for all, then the near misses."""
    near: list[Any] = ([1, "yes", None] if isinstance(default, bool) else [1.5, True, "1GB"] if isinstance(default, int)
                       else [5] if isinstance(default, str) else [])
    return [object(), *near]


def _cases() -> list[tuple[str, str, Any]]:
    import inspect

    cases = []
    for fname, (fn, _, _) in _public_calls().items():
        for p in inspect.signature(fn).parameters.values():
            default = None if p.default is p.empty else p.default
            cases += [(fname, p.name, v) for v in _wrong_values(default)]
    return cases


@pytest.mark.parametrize(("fname", "param", "value"), _cases(),
                         ids=lambda x: x if isinstance(x, str) else type(x).__name__)
def test_every_public_function_names_the_parameter_of_a_wrong_type(fname: str, param: str, value: Any) -> None:
    """Was: `hf_weights(5, cfg)` a TypeError, `build_plan('.../config.json')` an AttributeError."""
    import inspect

    fn, args, kwargs = _public_calls()[fname]
    names = list(inspect.signature(fn).parameters)
    if param in names and names.index(param) < len(args):
        args = tuple(value if i == names.index(param) else a for i, a in enumerate(args))
    else:
        kwargs = {**kwargs, param: value}
    try:
        result = fn(*args, **kwargs)
        if inspect.isgenerator(result):
            list(result)
    except GlmconvError as exc:
        message = str(exc)
    else:
        pytest.fail(f"glmconv.{fname}({param}={value!r}) was accepted")
    assert message.startswith(f"glmconv.{fname}(): {param}="), message
    assert len(message.splitlines()) == 1


def test_a_trainers_pairs_that_are_no_pairs_are_named() -> None:
    config = glmconv.load_config(Path(__file__).resolve().parents[2] / "fixtures" / "glm-5.3-flash.config.json")
    assert _refusal(lambda: list(glmconv.hf_weights([5], config))) == (
        "glmconv.hf_weights(): params[0]=5: expected a (Megatron name, tensor) pair")


def test_parity_checks_the_command_line_shares_name_both_spellings() -> None:
    """The CLI reaches these through glmconv.parity: the flag for its user, the keyword for a Python caller."""
    assert _refusal(glmconv.parity, NOWHERE, NOWHERE, prompt_file=NOWHERE, tokens=8) == (
        "--prompt-file sets the tokens and sequences (prompt_file, in Python); drop --tokens and --sequences "
        "(tokens, sequences)")
    assert _refusal(glmconv.parity, NOWHERE, NOWHERE, threshold=0) == (
        "--threshold 0 (threshold, in Python): must be positive")
