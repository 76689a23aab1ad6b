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
    return Capture(layers=layers, logits=logits, elapsed_s=0.25)


def _report(errs: list[float], bounds: tuple[str, ...] = (), overlaps: bool = True, **kw: object) -> dict:
    opts = ParityOptions(hf_dir=Path("hf"), mcore_dir=Path("mc"), bounds=tuple(parse_bound(b) for b in bounds),
                         **kw)  # type: ignore[arg-type]
    conv = {"serve": {"proj_rms": "reference", "hc_mix": "fp32"}, "train": {"proj_rms": "megatron", "hc_mix": "fp32"}}
    return build_report(_capture(errs, overlaps), opts, random_batch(512, 64, 2, 0), conv)


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


def test_json_is_strict_with_nan_and_inf(tmp_path: Path) -> None:
    r = _report([1e-7, math.nan, math.inf, 0.0, 0.0, 0.0, 0.0, 0.0])
    text = to_json(r)

    def refuse(name: str) -> float:
        raise AssertionError(f"non-standard JSON constant {name}")

    loaded = json.loads(text, parse_constant=refuse)
    assert loaded["layers"][1]["rel_err"] == "nan" and loaded["first_divergence"]["sub_block"] == "mlp"
    write_report(r, tmp_path)  # the plot copes with NaN/inf too


def test_terminal_table_names_first_divergence() -> None:
    from rich.console import Console

    buf = io.StringIO()
    print_table(_report(ERRS, bounds=("kl>1e-6",)), Console(file=buf, width=140, color_system=None))
    out = buf.getvalue()
    assert "mlp <- first" in out and "first divergence: layer 2 mlp" in out
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
