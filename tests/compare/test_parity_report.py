"""The parity report: required keys, strict JSON, Markdown, a readable PNG, the terminal table."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest

from glmconv.compare import ParityOptions
from glmconv.compare.capture import Capture
from glmconv.compare.inputs import random_batch
from glmconv.compare.metrics import parse_bound
from glmconv.compare.records import KernelResult, SubBlockRecord
from glmconv.compare.report import (
    JSON_NAME,
    MD_NAME,
    PNG_NAME,
    bound_lines,
    build_report,
    print_table,
    to_json,
    write_report,
)
from glmconv.models.conventions import Conventions, Sides

_TYPES = [("kda", "dense"), ("kda", "dense"), ("kda", "moe"), ("dsa", "moe")]


def _capture(errs: list[float], overlaps: bool = True) -> Capture:
    layers = []
    for i, err in enumerate(errs):
        layer, sub = divmod(i, 2)
        attn, mlp = _TYPES[layer]
        rec = {"layer": layer, "sub_block": ("attention", "mlp")[sub], "attn_type": attn, "mlp_type": mlp,
               "rel_err": err, "max_abs": err * 3}
        if sub == 1 and mlp == "moe" and overlaps:
            rec["expert_overlap"] = 0.875
        if sub == 0 and attn == "dsa" and overlaps:
            rec["topk_overlap"] = 0.5
        layers.append(rec)
    logits = {"logprob_abs_diff": {"mean": 1e-3, "p99": 5e-3, "max": 8e-3}, "top1_agreement": 0.96875,
              "kl": 2e-5, "positions": 64, "next_token_positions": 63}
    return Capture(layers=[SubBlockRecord.from_json(r) for r in layers], logits=logits, elapsed_s=0.25)


def _report(errs: list[float], bounds: tuple[str, ...] = (), overlaps: bool = True, cap: Capture | None = None,
            **kw: object) -> dict:
    opts = ParityOptions(hf_dir=Path("hf"), mcore_dir=Path("mc"), bounds=tuple(parse_bound(b) for b in bounds),
                         **kw)  # type: ignore[arg-type]
    conv = Sides(Conventions.serve(), Conventions(proj_rms="megatron"))
    return build_report(cap or _capture(errs, overlaps), opts, random_batch(512, 64, 2, 0), conv)


def _noisy(errs: list[float], noise: float = 1e-2, silent: tuple[int, ...] = (), kernels: bool = False) -> Capture:
    """A capture whose noise was measured (a bf16 run): `noise` at every record but those of `silent` (0 there)."""
    cap = _capture(errs)
    cap.noise_measured = True
    kda = KernelResult("chunk_kda", "fla chunk_kda", "bf16", {"rel_err": 2.5e-2}, "rel_err", 0.18, True, 4.6e-3)
    cap.layers = [rec.replace(noise_serve=0.0 if i in silent else noise, kernels=(kda,) if kernels else None)
                  for i, rec in enumerate(cap.layers)]
    return cap


ERRS = [1e-7, 2e-7, 3e-7, 4e-7, 1e-7, 5e-2, 6e-2, 0.0]


def test_report_keys_and_first_divergence() -> None:
    r = _report(ERRS)
    for key in ("layers", "logits", "first_divergence", "conventions", "mode", "dtype", "tokens", "seed",
                "threshold", "summary", "bounds", "passed"):
        assert key in r, key
    fd = r["first_divergence"]
    assert (fd["layer"], fd["sub_block"], fd["metric"], fd["value"]) == (2, "mlp", "rel_err", 5e-2)
    assert fd["cause"] == "conventions" and fd["switches"] == ["proj_rms=megatron"]
    assert r["threshold"] == 1e-5 and r["mode"] == "propagated" and r["dtype"] == "fp32"
    assert (r["tokens"], r["sequences"], r["seed"]) == (64, 2, 0)
    assert set(r["conventions"]) == {"serve", "train"}
    assert set(r["logits"]) >= {"logprob_abs_diff", "top1_agreement", "kl"}
    assert set(r["logits"]["logprob_abs_diff"]) == {"mean", "p99", "max"}
    rec = r["layers"][5]
    assert {"layer", "sub_block", "attn_type", "mlp_type", "rel_err", "max_abs", "expert_overlap"} <= set(rec)
    assert "topk_overlap" in r["layers"][6] and "expert_overlap" not in r["layers"][0]
    assert not r["passed"] and r["gate"] == "verdict" and r["bounds"] == []  # a named divergence fails by default
    assert r["summary"]["divergences"] == 3.0  # layer 2 mlp (rel err, experts), 3 attention (top-k), 3 mlp (experts)


def test_no_divergence_passes_by_default() -> None:
    r = _report([0.0] * 8, overlaps=False)
    assert r["first_divergence"] is None and r["passed"] and r["summary"]["divergences"] == 0.0


def test_the_floor_is_the_threshold_and_bounds_replace_the_verdict() -> None:
    r = _report(ERRS, dtype="bf16", bounds=("max_rel_err>0.01", "top1_agreement<0.9"))
    assert r["threshold"] == 1e-5 and r["first_divergence"]["layer"] == 2
    assert [b["broken"] for b in r["bounds"]] == [True, False] and not r["passed"] and r["gate"] == "bounds"
    lenient = _report(ERRS, bounds=("top1_agreement<0.9",))
    assert lenient["first_divergence"] is not None and lenient["passed"]
    assert _report(ERRS, threshold=0.1, overlaps=False)["first_divergence"] is None


def test_written_files(tmp_path: Path) -> None:
    import matplotlib.image

    r = _report(ERRS)
    paths = write_report(r, tmp_path / "out")
    assert [p.name for p in paths] == [JSON_NAME, MD_NAME, PNG_NAME]
    loaded = json.loads((tmp_path / "out" / JSON_NAME).read_text())
    assert loaded["first_divergence"]["sub_block"] == "mlp" and len(loaded["layers"]) == 8
    md = (tmp_path / "out" / MD_NAME).read_text()
    assert "first divergence: layer 2 mlp" in md and "| proj_rms | reference | megatron (differs) |" in md
    assert PNG_NAME in md
    img = matplotlib.image.imread(tmp_path / "out" / PNG_NAME)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def _strings_for_numbers(x: object) -> list[str]:
    """Every "nan"/"inf"/"-inf" string in a loaded JSON value: a number written as text."""
    if isinstance(x, dict):
        return [s for v in x.values() for s in _strings_for_numbers(v)]
    if isinstance(x, list):
        return [s for v in x for s in _strings_for_numbers(v)]
    return [x] if x in ("nan", "inf", "-inf") else []


def test_json_is_strict_with_nan_and_inf(tmp_path: Path) -> None:
    """NaN and infinity are null in report.json, each with `<field>_why` beside it: strict JSON (no NaN/Infinity
    constants), and a number field holds a number or null, never a string."""
    r = _report([1e-7, math.nan, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0])
    text = to_json(r)

    def refuse(name: str) -> float:
        raise AssertionError(f"non-standard JSON constant {name}")

    loaded = json.loads(text, parse_constant=refuse)
    nan_rec, inf_rec = loaded["layers"][1], loaded["layers"][2]
    assert nan_rec["rel_err"] is None and nan_rec["rel_err_why"] == (
        "NaN: rel err could not be computed (a side's streams or logits hold a NaN or infinity)")
    assert inf_rec["rel_err"] is None and inf_rec["rel_err_why"] == (
        "infinite: the serve side's streams are zero here and the train side's are not")
    assert loaded["summary"]["max_rel_err"] is None and loaded["summary"]["max_rel_err_why"] == (
        "NaN at layer 0 mlp: rel err could not be computed (a side's streams or logits hold a NaN or infinity)")
    fd = loaded["first_divergence"]
    assert fd["sub_block"] == "mlp" and fd["value"] is None and fd["value_why"].startswith("NaN: ")
    assert _strings_for_numbers(loaded) == []
    assert loaded == json.loads(json.dumps(r))  # the report itself holds no NaN or infinity either (the API's dict)
    write_report(r, tmp_path)  # the plot copes with them too


def test_an_error_over_a_noise_of_zero_is_null_with_its_reason_everywhere() -> None:
    """A bf16 run with one sub-block whose measured noise is exactly 0 (layer 2 mlp, rel err 5e-2): its excess is
    unbounded. Every place that carries it says so, as null with a reason, and `excess.max>4` fails naming where."""
    r = _report(ERRS, bounds=("excess.max>4",), cap=_noisy(ERRS, silent=(5,)), dtype="bf16")
    loaded = json.loads(to_json(r))
    why = "unbounded: rel err 5.000e-02 over a noise of 0"
    rec = loaded["layers"][5]
    assert rec["excess"] is None and rec["excess_why"] == why
    assert [x["excess"] for x in loaded["layers"][:5]] == pytest.approx([1e-5, 2e-5, 3e-5, 4e-5, 1e-5])
    assert loaded["first_divergence"]["excess"] is None and loaded["first_divergence"]["excess_why"] == why
    summary_why = "unbounded at layer 2 mlp: rel err 5.000e-02 over a noise of 0"
    assert loaded["summary"]["excess.max"] is None and loaded["summary"]["excess.max_why"] == summary_why
    assert loaded["summary"]["ref_rel_err.max"] is None  # a fake capture has no references
    bound = loaded["bounds"][0]
    assert (bound["value"], bound["value_why"], bound["broken"]) == (None, summary_why, True)
    assert bound_lines(r) == [f"FAILED: excess.max>4 (measured {summary_why})"]
    assert not r["passed"] and _strings_for_numbers(loaded) == []


def test_without_measured_noise_the_unbounded_excess_says_what_bounds_such_a_run() -> None:
    """An fp32 run on the references measures no noise: any error is unbounded in noise units."""
    from glmconv_cli.parity_cmd import failure

    r = _report(ERRS, bounds=("excess.max>4", "max_rel_err>1"))
    assert r["summary"]["excess.max_why"] == (
        "unbounded at layer 0 attention: rel err 1.000e-07 over a noise of 0; no noise measured in this run: both "
        "sides ran fp32 on the torch references, their own references (--dtype bf16 or a kernel path measures one; "
        "ref_rel_err.max and max_rel_err bound such a run)")
    assert r["layers"][0]["excess_why"] == (
        "unbounded: rel err 1.000e-07 over a noise of 0 (no noise measured in this run)")
    assert failure(r) == f"1 bound broken: excess.max>4 ({r['summary']['excess.max_why']})"
    assert _report([0.0] * 8, bounds=("excess.max>4",), overlaps=False)["passed"]  # 0 over 0: excess 0


def test_a_bound_on_a_metric_the_run_does_not_measure_is_refused_saying_why() -> None:
    from glmconv.errors import GlmconvError

    with pytest.raises(GlmconvError) as exc:
        _report(ERRS, bounds=("expert_excess.max>4",), overlaps=False)
    assert str(exc.value) == (
        "--fail-on expert_excess.max>4: expert_excess.max was not measured in this run: no MoE layer")
    r = _report(ERRS, overlaps=False)
    assert r["summary"]["topk_overlap_min"] is None
    assert r["summary"]["topk_overlap_min_why"] == "not measured in this run: no DSA layer"


def test_terminal_table_names_first_divergence() -> None:
    from rich.console import Console

    buf = io.StringIO()
    print_table(_report(ERRS, bounds=("kl>1e-6",)), Console(file=buf, width=140, color_system=None))
    out = buf.getvalue()
    assert "mlp <-" in out and "first divergence: layer 2 mlp" in out
    assert "FAILED: kl>1e-06" in out and "experts 0.875" in out and "top-k 0.500" in out


def test_passing_bound_prints_the_condition_that_holds() -> None:
    r = _report(ERRS, bounds=("logprob_abs_diff.max>1e-2", "top1_agreement<0.9", "kl>1e-6"))
    assert bound_lines(r) == ["ok: logprob_abs_diff.max <= 0.01 (measured 8.000e-03)",
                              "ok: top1_agreement >= 0.9 (measured 9.688e-01)",
                              "FAILED: kl>1e-06 (measured 2.000e-05)"]


def test_unwritable_report_dir(tmp_path: Path) -> None:
    from glmconv.errors import GlmconvError

    (tmp_path / "file").write_text("x")
    with pytest.raises(GlmconvError, match="cannot create the report directory"):
        write_report(_report(ERRS), tmp_path / "file" / "sub")


def test_rerun_replaces_its_own_report(tmp_path: Path) -> None:
    write_report(_report(ERRS), tmp_path / "rep")
    write_report(_report(ERRS, threshold=0.1, overlaps=False), tmp_path / "rep")
    assert json.loads((tmp_path / "rep" / JSON_NAME).read_text())["first_divergence"] is None


def test_a_symlinked_report_file_is_replaced_never_followed(tmp_path: Path) -> None:
    write_report(_report(ERRS), tmp_path / "rep")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "rep" / JSON_NAME).unlink()
    (tmp_path / "rep" / JSON_NAME).symlink_to(victim)
    write_report(_report(ERRS), tmp_path / "rep")
    assert victim.read_text() == "precious" and not (tmp_path / "rep" / JSON_NAME).is_symlink()


def test_a_directory_glmconv_did_not_write_is_refused(tmp_path: Path) -> None:
    from glmconv.errors import GlmconvError

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / MD_NAME).write_text("my notes")
    with pytest.raises(GlmconvError, match="not empty and not a report directory glmconv wrote"):
        write_report(_report(ERRS), tmp_path / "mine")
    assert (tmp_path / "mine" / MD_NAME).read_text() == "my notes"


# ---- goldens (fixtures/golden/): every rendering of one fixed report -------------------------------------------

def test_markdown_report_is_its_golden(golden) -> None:
    from glmconv.compare.report import to_markdown

    golden("parity-report.md", to_markdown(_report(ERRS, bounds=("kl>1e-6",))))


def test_json_report_is_its_golden_but_for_the_version(golden) -> None:
    from glmconv import __version__

    loaded = json.loads(to_json(_report(ERRS, bounds=("kl>1e-6",))))
    assert loaded["glmconv_version"] == __version__
    golden("parity-report.json", json.dumps({**loaded, "glmconv_version": "VERSION"}, indent=2) + "\n")


def test_terminal_table_is_its_golden(golden) -> None:
    from rich.console import Console

    buf = io.StringIO()
    print_table(_report(ERRS, bounds=("kl>1e-6",)), Console(file=buf, width=140, color_system=None))
    golden("parity-table.txt", buf.getvalue())


# ---- the terminal table at any width: numbers whole, columns left out (and said) before any is cut -------------

def _table_text(report: dict, width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    print_table(report, Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


@pytest.mark.parametrize("width", [160, 100, 80, 60, 46, 30])
def test_every_number_stays_whole_at_any_width(width: int) -> None:
    """bf16 with kernels: 10 columns, 127 wide. Rich cut numbers to `8.428…` at 80 columns; now columns are left
    out (the note names them), and under the narrowest table each record is lines of whole fields."""
    from glmconv.compare.report import _columns

    r = _report(ERRS, cap=_noisy(ERRS, kernels=True), dtype="bf16")
    out = _table_text(r, width)
    assert "…" not in out
    for rec in r["layers"]:
        assert f"{rec['rel_err']:.3e}" in out
    rows = [line for line in out.splitlines() if line.startswith(("┃", "│", "┏", "└", "layer ", "  "))]
    assert rows and max(len(line) for line in rows) <= width
    header = next((line for line in out.splitlines() if line.startswith("┃")), None)
    note = next((line for line in out.splitlines() if line.startswith("(left out to fit")), "")
    if header is None:  # stacked: every field of every record is there
        assert sum(line.startswith("layer ") for line in out.splitlines()) == 8
        assert "layer 2 mlp <-: moe,\n  rel err 5.000e-02,\n  noise 1.000e-02, 5x noise,\n  experts 0.875," in out
    else:
        cols = _columns(r)
        shown = [c.strip() for c in header.strip("┃").split("┃")]
        left = [c for c in cols if c not in shown]
        assert shown == [c for c in cols if c in shown]
        assert (note == "") == (left == [])
        if left:
            assert note.startswith(f"(left out to fit {width} columns: {', '.join(left)}; COLUMNS=127 ")


def test_the_table_leaves_out_columns_in_order_and_says_which() -> None:
    r = _report(ERRS, cap=_noisy(ERRS, kernels=True), dtype="bf16")
    assert "(left out" not in _table_text(r, 127)
    assert "(left out to fit 126 columns: kernel; COLUMNS=127 " in _table_text(r, 126)
    assert "(left out to fit 80 columns: type, noise, kernel; COLUMNS=127 " in _table_text(r, 80)
    assert "(left out to fit 70 columns: type, noise, weights, kernel; COLUMNS=127 " in _table_text(r, 70)


def test_a_pipe_lays_the_table_out_for_100_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from glmconv.text import PIPE_TABLE_WIDTH, console, table_width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_width(console()) == PIPE_TABLE_WIDTH == 100  # pytest captures stdout: not a terminal
    monkeypatch.setenv("COLUMNS", "150")
    assert table_width(console()) == 150  # a width asked for is the width


# ---- the plot: what it draws other than it is, it says ----------------------------------------------------------

def test_an_exact_zero_is_noted_on_the_plot_and_in_the_markdown() -> None:
    import matplotlib.pyplot as plt

    from glmconv.compare.report import figure, to_markdown

    r = _report(ERRS)  # layer 3 mlp: rel err exactly 0, drawn at 1e-12
    fig = figure(r)
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert legend[-1] == "an exact 0 is drawn at 1e-12 (a log scale has no 0)"
    assert "Plot note: an exact 0 is drawn at 1e-12 (a log scale has no 0)." in to_markdown(r)
    nonzero = _report([1e-7] * 8)
    fig = figure(nonzero)
    try:
        assert not any("exact 0" in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    finally:
        plt.close(fig)
    assert "Plot note" not in to_markdown(nonzero)


# ---- the gate's lines: the next step after a conventions divergence, a gate replaced by --fail-on ---------------

def test_a_conventions_divergence_on_equal_weights_names_train_conventions_serve() -> None:
    from glmconv.compare.report import next_step
    from glmconv_cli.parity_cmd import failure

    cap = _capture(ERRS)
    cap.weights_checked = True
    r = _report(ERRS, cap=cap)
    step = ("the weights are equal bit for bit (the conversion is exact) and the cause is the train conventions: by "
            "default they imitate a Megatron port (proj_rms=megatron act here); rerun with --train-conventions serve "
            "to check the conversion alone")
    assert next_step(r) == step and failure(r).endswith(f"proj_rms=megatron; {step}")
    assert next_step(_report(ERRS, bounds=("kl>1",))) is None  # the bounds gate: no verdict failure to explain
    assert next_step(_report([0.0] * 8, overlaps=False)) is None


def test_bounds_that_replace_the_gate_while_a_divergence_is_named_say_so() -> None:
    from glmconv.compare.report import gate_note

    assert gate_note(_report(ERRS, bounds=("kl>1",))) == (
        "--fail-on replaces the verdict's gate: its first divergence (layer 2 mlp, cause conventions) does not fail "
        "this run; add --fail-on 'divergences>0' to fail on it too")
    assert gate_note(_report(ERRS, bounds=("kl>1", "divergences>0"))) is None
    assert gate_note(_report(ERRS)) is None and gate_note(_report([0.0] * 8, bounds=("kl>1",), overlaps=False)) is None


def test_records_that_name_their_code_give_the_report_a_code_column_and_header_line() -> None:
    cap = _capture(ERRS)
    cap.layers = [r.replace(impl="megatron-core MoELayer" if r.mlp_type == "moe" and r.sub_block == "mlp"
                            else "glmconv") for r in cap.layers]
    r = _report(ERRS, cap=cap)
    assert r["train_impl"] == ["glmconv", "megatron-core MoELayer"]
    assert [rec["impl"] for rec in r["layers"]][4:6] == ["glmconv", "megatron-core MoELayer"]
    from rich.console import Console

    from glmconv.compare.report import to_markdown

    assert "- train side code: glmconv, megatron-core MoELayer" in to_markdown(r)
    out = io.StringIO()
    print_table(r, Console(file=out, width=250))
    assert "code" in out.getvalue() and "megatron-core MoELayer" in out.getvalue()
    assert "train_impl" not in _report(ERRS)
