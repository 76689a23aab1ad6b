"""What convert records so that export needs no --like: the source's sidecar files (stored in `hf_sidecars/`,
listed in glmconv.json with their sha256) and its dtypes; --like wins; an edited record is refused, named."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from glmconv.errors import CheckpointError
from glmconv.io.file_names import MANIFEST_NAME
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOKENIZER, TEMPLATE, GENERATION = b'{"model": "tiny"}\n', b"{{ messages }}\n", "generation_config.json"
HC_FN = "model.language_model.layers.0.hc_attn_fn"


def _export(mc: Path, out: Path, **kw: Any) -> dict[str, Any]:
    job = export_mod.prepare(mc, out, **kw)
    return export_mod.export(job, export_mod.ExportOptions(progress=False))


def _edit_manifest(mc: Path, out: Path, edit: Any) -> Path:
    """A copy of the converted checkpoint whose glmconv.json went through `edit`."""
    shutil.copytree(mc, out)
    data = json.loads((out / MANIFEST_NAME).read_text())
    edit(data)
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    return out


def _hf_dtype(ckpt: Path, name: str) -> str:
    from safetensors import safe_open

    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            if name in f.keys():
                return f.get_slice(name).get_dtype()
    raise KeyError(name)


@pytest.fixture(scope="module")
def source(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with a tokenizer and a chat template beside its generation config."""
    out = tmp_path_factory.mktemp("sidecars") / "hf"
    shutil.copytree(tiny_ckpt, out)
    (out / "tokenizer.json").write_bytes(TOKENIZER)
    (out / "chat_template.jinja").write_bytes(TEMPLATE)
    return out


@pytest.fixture(scope="module")
def mc(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sidecars") / "mc"
    convert_mod.convert(convert_mod.prepare(source, out), convert_mod.RunOptions(progress=False))
    return out


def test_convert_stores_the_sidecars_byte_for_byte_with_their_sha256(source: Path, mc: Path) -> None:
    listed = json.loads((mc / MANIFEST_NAME).read_text())["sidecars"]
    assert sorted(listed) == ["chat_template.jinja", GENERATION, "tokenizer.json"]
    for name, digest in listed.items():
        assert (mc / "hf_sidecars" / name).read_bytes() == (source / name).read_bytes()
        assert digest == hashlib.sha256((source / name).read_bytes()).hexdigest()


def test_export_without_like_restores_the_sidecars(source: Path, mc: Path, tmp_path: Path) -> None:
    summary = _export(mc, tmp_path / "hf")
    assert (summary["sidecars_from"], summary["sidecars"]) == (
        "converted checkpoint", ["chat_template.jinja", GENERATION, "tokenizer.json"])
    for name in ("chat_template.jinja", GENERATION, "tokenizer.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes()
    assert json.loads((tmp_path / "hf" / MANIFEST_NAME).read_text())["sidecars_from"] == "converted checkpoint"


def test_with_like_the_like_files_win(source: Path, mc: Path, tmp_path: Path) -> None:
    like = tmp_path / "like"
    shutil.copytree(source, like)
    (like / "tokenizer.json").write_bytes(b'{"model": "other"}\n')
    (like / "chat_template.jinja").unlink()
    summary = _export(mc, tmp_path / "hf", like=like)
    assert (summary["sidecars_from"], summary["dtypes_from"]) == ("--like", "--like")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == b'{"model": "other"}\n'
    assert not (tmp_path / "hf" / "chat_template.jinja").exists()


def test_a_sidecar_changed_after_convert_is_refused_and_nothing_published(mc: Path, tmp_path: Path) -> None:
    bad = _edit_manifest(mc, tmp_path / "mc", lambda d: None)
    (bad / "hf_sidecars" / "tokenizer.json").write_bytes(b"{}")
    result = CliRunner().invoke(_cli(), ["export", str(bad), str(tmp_path / "hf")])
    assert result.exit_code == 2 and not (tmp_path / "hf").exists()
    assert result.output == (f"error: {bad}/hf_sidecars/tokenizer.json: sha256 differs from the one glmconv.json "
                             "records; the file was changed after convert (restore it, or pass --like)\n")


def test_a_listed_sidecar_that_is_missing_is_refused(mc: Path, tmp_path: Path) -> None:
    bad = _edit_manifest(mc, tmp_path / "mc", lambda d: None)
    (bad / "hf_sidecars" / GENERATION).unlink()
    with pytest.raises(CheckpointError, match=f"^{bad}/hf_sidecars/{GENERATION}: listed in glmconv.json but missing$"):
        export_mod.prepare(bad, tmp_path / "hf")


def test_a_listed_sidecar_name_that_is_a_path_is_refused(mc: Path, tmp_path: Path) -> None:
    bad = _edit_manifest(mc, tmp_path / "mc", lambda d: d["sidecars"].update({"../config.json": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"glmconv.json: sidecars lists '../config.json', which is not an HF "
                                              r"sidecar file name$"):
        export_mod.prepare(bad, tmp_path / "hf")


def test_a_record_giving_a_dtype_the_rule_does_not_accept_is_refused(mc: Path, tmp_path: Path) -> None:
    bad = _edit_manifest(mc, tmp_path / "mc", lambda d: d["hf_dtypes"]["exceptions"].update({HC_FN: "F16"}))
    with pytest.raises(CheckpointError, match=f"glmconv.json: hf_dtypes gives {HC_FN} the dtype 'F16'; expected "
                                              "F32 or BF16$"):
        export_mod.prepare(bad, tmp_path / "hf")


def test_a_record_naming_a_tensor_outside_the_plan_is_refused(mc: Path, tmp_path: Path) -> None:
    bad = _edit_manifest(mc, tmp_path / "mc", lambda d: d["hf_dtypes"]["exceptions"].update({"x.weight": "F32"}))
    with pytest.raises(CheckpointError, match="glmconv.json: hf_dtypes lists x.weight, which is not in the export "
                                              "plan$"):
        export_mod.prepare(bad, tmp_path / "hf")


def test_the_record_restores_bf16_hc_fn_without_like(mc: Path, tmp_path: Path) -> None:
    bf16_fn = _edit_manifest(mc, tmp_path / "mc", lambda d: d["hf_dtypes"]["exceptions"].update({HC_FN: "BF16"}))
    summary = _export(bf16_fn, tmp_path / "hf")
    assert (summary["dtypes_from"], _hf_dtype(tmp_path / "hf", HC_FN)) == ("converted checkpoint", "BF16")


def test_a_checkpoint_converted_by_an_older_glmconv_exports_as_before(mc: Path, tmp_path: Path) -> None:
    def forget(d: dict[str, Any]) -> None:
        del d["hf_dtypes"], d["sidecars"]

    old = _edit_manifest(mc, tmp_path / "mc", forget)
    shutil.rmtree(old / "hf_sidecars")
    summary = _export(old, tmp_path / "hf")
    assert (summary["dtypes_from"], summary["sidecars_from"], summary["sidecars"]) == ("plan", None, [])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir() if not p.name.startswith("model-")) == [
        "config.json", MANIFEST_NAME, "model.safetensors.index.json"]


def _cli() -> Any:
    from glmconv_cli.main import cli

    return cli


@pytest.fixture(scope="module")
def templated(source: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The source with transformers' folder of named chat templates beside its default one, and its conversion."""
    out = tmp_path_factory.mktemp("templates")
    shutil.copytree(source, out / "hf")
    (out / "hf" / "chat_templates").mkdir()
    (out / "hf" / "chat_templates" / "tool_use.jinja").write_bytes(TEMPLATE + b"{# tools #}\n")
    convert_mod.convert(convert_mod.prepare(out / "hf", out / "mc"), convert_mod.RunOptions(progress=False))
    return out / "hf", out / "mc"


def test_convert_carries_the_chat_templates_folder(templated: tuple[Path, Path]) -> None:
    src, mc = templated
    listed = json.loads((mc / MANIFEST_NAME).read_text())["sidecars"]
    assert "chat_templates/tool_use.jinja" in listed
    assert (mc / "hf_sidecars" / "chat_templates" / "tool_use.jinja").read_bytes() == (
        src / "chat_templates" / "tool_use.jinja").read_bytes()


@pytest.mark.parametrize("like", [False, True])
def test_export_restores_the_chat_templates_folder(templated: tuple[Path, Path], like: bool, tmp_path: Path) -> None:
    src, mc = templated
    summary = _export(mc, tmp_path / "hf", like=src) if like else _export(mc, tmp_path / "hf")
    assert "chat_templates/tool_use.jinja" in summary["sidecars"]
    assert (tmp_path / "hf" / "chat_templates" / "tool_use.jinja").read_bytes() == (
        src / "chat_templates" / "tool_use.jinja").read_bytes()


def test_a_file_named_chat_templates_is_refused(source: Path, tmp_path: Path) -> None:
    shutil.copytree(source, tmp_path / "hf")
    (tmp_path / "hf" / "chat_templates").write_text("x")
    with pytest.raises(CheckpointError, match=r"chat_templates: not a directory; transformers keeps named chat "
                                              r"templates in one$"):
        convert_mod.prepare(tmp_path / "hf", tmp_path / "mc")
