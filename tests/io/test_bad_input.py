"""The bad-input matrix: every broken input gets one `error:` line, a non-zero exit, an untouched input, no output.

Each case copies a fixture, breaks the copy in one way, runs the command where the breakage matters (convert
for HF inputs, export for torch_dist inputs, audit-names where it reads the file too) through click's CliRunner
in this process, and checks:

* stderr is exactly one line, `error: ...`, matching the case's pattern (it names the tensor or file and what
  was expected); no traceback anywhere, and the command did not die of an exception;
* the exit code is 2 (bad input; audit-names exits 1 only for audit findings, which these are not);
* every input file has the sha256 it had before;
* nothing was published: the directory holding OUT lists exactly what it did before (no OUT, no staging
  directory, no lock file); where OUT existed it is byte for byte unchanged.

docs/errors.md is this table in prose. Output locations that refuse writes: we run as root, so permission bits
stop nothing; a read-only tmpfs (`mount -o ro`) and a full one (`mount -o size=200k`) are real ones. Where
mounting is not allowed the test says so and falls back: a path under /sys (sysfs refuses new files even to
root) and a simulated ENOSPC from the writer.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers.bad_input import (
    DOWN0,
    EMBED,
    EXPERTS_FC2,
    Q_B3,
    TEXT,
    absurd_length,
    add_tensor,
    assert_refused,
    cut_config_layers,
    drop_common_state,
    drop_tensor,
    edit_config,
    edit_metadata,
    edit_tensor,
    first_distcp,
    fp8_nan_code,
    garbage_header,
    invoke,
    listing,
    overwrite_header,
    set_first,
    set_mcore,
    set_text,
    shard_names,
    weight_map,
    write_index,
)
from helpers.mcore_helpers import rewrite_dcp as rewrite_torch_dist
from safetensors import safe_open

from glmconv.errors import GlmconvError
from glmconv.io.file_names import COMMON_STATE_KEY, CONFIG_NAME, DCP_METADATA_NAME, INDEX_NAME, RELEASE, TRACKER_NAME
from glmconv.runners import relayout as relayout_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---- the matrix --------------------------------------------------------------------------------------

@dataclass
class Case:
    """`source` is copied to `tmp/src`, `breaks(src, tmp)` breaks it and returns extra CLI arguments."""

    id: str
    command: str
    source: str  # "tiny", "tiny-fp8" (HF) or "mc" (tiny converted to torch_dist)
    breaks: Callable[[Path, Path], list[str] | None]
    pattern: str
    extra_inputs: list[str] = field(default_factory=list)  # files under tmp that must stay unchanged too


def _q(s: str) -> str:
    return re.escape(s)


def _shard(i: int) -> str:
    return f"model-0000{i}-of-00004.safetensors"


def _outside(src: Path, tmp: Path) -> str:
    shutil.copyfile(src / _shard(2), tmp / "outside.safetensors")
    return str(tmp / "outside.safetensors")


def _index_outside(src: Path, tmp: Path) -> None:
    _outside(src, tmp)
    write_index(src, {k: ("../outside.safetensors" if v == _shard(2) else v) for k, v in weight_map(src).items()})


def _index_absolute(src: Path, tmp: Path) -> None:
    target = _outside(src, tmp)
    write_index(src, {k: (target if v == _shard(2) else v) for k, v in weight_map(src).items()})


def _symlink_escape(src: Path, tmp: Path) -> None:
    target = _outside(src, tmp)
    (src / _shard(2)).unlink()
    (src / _shard(2)).symlink_to(target)


def _symlink_loop(name: str) -> Callable[[Path, Path], None]:
    """`name` replaced by a symlink to itself (ELOOP on every open)."""
    def breaks(src: Path, tmp: Path) -> None:
        (src / name).unlink(missing_ok=True)
        (src / name).symlink_to(name)
    return breaks


def _storage_a_list(md: object) -> None:
    md.storage_data = list(md.storage_data.values())  # type: ignore[attr-defined]


def _storage_offset_none(md: object) -> None:
    next(iter(md.storage_data.values())).offset = None  # type: ignore[attr-defined]


def _storage_attribute_renamed(md: object) -> None:
    info = next(iter(md.storage_data.values()))  # type: ignore[attr-defined]
    info.__dict__["lenght"] = info.__dict__.pop("length")


def _duplicate(src: Path, tmp: Path) -> None:
    wm = weight_map(src)
    other = next(s for s in shard_names(src) if s != wm[EMBED])
    with safe_open(str(src / wm[EMBED]), framework="pt") as f:
        t = f.get_tensor(EMBED)
    add_tensor(src, EMBED, t, shard=other, index=False)


def _wrong_shape(src: Path, tmp: Path) -> None:
    edit_tensor(src, DOWN0, lambda t: t[:, :128])


def _wrong_dtype(src: Path, tmp: Path) -> None:
    edit_tensor(src, DOWN0, lambda t: t.to(torch.float16))


def _scale_shape(src: Path, tmp: Path) -> None:
    edit_tensor(src, Q_B3 + "_scale_inv", lambda t: torch.ones(t.shape[0] + 1, t.shape[1]))


def _empty(src: Path, tmp: Path) -> None:
    shutil.rmtree(src)
    src.mkdir()


def _missing_distcp(mc: Path, tmp: Path) -> None:
    first_distcp(mc).unlink()


def _truncate(p: Path, keep: int) -> None:
    p.write_bytes(p.read_bytes()[:keep])


def _truncated_distcp(mc: Path, tmp: Path) -> None:
    p = first_distcp(mc)
    p.write_bytes(p.read_bytes()[:-64])


HF_CASES = [
    Case("missing-shard", "convert", "tiny", lambda s, t: (s / _shard(2)).unlink(),
         _q(f"{_shard(2)}: shard listed in {INDEX_NAME} is missing")),
    Case("truncated-shard", "convert", "tiny", lambda s, t: overwrite_header(s, _shard(3), lambda d: d[:-100]),
         _q(f"{_shard(3)}: truncated: header says ") + r"\d+ bytes of data, file has \d+"),
    Case("header-not-json", "convert", "tiny", lambda s, t: overwrite_header(s, _shard(1), garbage_header),
         _q(f"{_shard(1)}: corrupt header: not valid UTF-8 JSON")),
    Case("header-absurd-length", "convert", "tiny", lambda s, t: overwrite_header(s, _shard(1), absurd_length),
         _q(f"{_shard(1)}: corrupt header: header length {2**40} exceeds 100 MB")),
    Case("index-names-file-outside", "convert", "tiny", _index_outside,
         _q(f"{INDEX_NAME}: shard '../outside.safetensors' is outside the checkpoint directory"),
         ["outside.safetensors"]),
    Case("index-names-absolute-path", "convert", "tiny", _index_absolute,
         _q(f"{INDEX_NAME}: shard '/") + r".*outside\.safetensors' is outside the checkpoint directory",
         ["outside.safetensors"]),
    Case("symlinked-shard-escapes", "convert", "tiny", _symlink_escape,
         _q(f"{INDEX_NAME}: shard '{_shard(2)}' resolves to ") + r".*outside\.safetensors, outside the checkpoint",
         ["outside.safetensors"]),
    Case("index-not-json", "convert", "tiny", lambda s, t: (s / INDEX_NAME).write_text('{"weight_map": {'),
         _q(f"{INDEX_NAME}: not valid JSON, truncated or corrupt")),
    Case("duplicated-tensor", "convert", "tiny", _duplicate,
         _q(f"{EMBED} (") + r"model-0000\d-of-00004\.safetensors\): duplicate: expected stored once, found stored "
         r"twice: in model-0000\d-of-00004\.safetensors and model-0000\d-of-00004\.safetensors"),
    Case("tensor-missing", "convert", "tiny", lambda s, t: drop_tensor(s, DOWN0),
         _q(f"{DOWN0}: missing: expected BF16[64, 160], found absent")),
    Case("tensor-unexpected", "convert", "tiny",
         lambda s, t: add_tensor(s, TEXT + "layers.0.mystery.weight", torch.zeros(2, 3, dtype=torch.bfloat16)),
         _q(f"{TEXT}layers.0.mystery.weight (") + r"model-0000\d-of-00004\.safetensors\): unexpected: expected not "
         r"in the plan, found BF16\[2, 3\]"),
    Case("tensor-name-with-newline", "convert", "tiny",
         lambda s, t: add_tensor(s, "evil\nerror: forged line", torch.zeros(1, dtype=torch.bfloat16)),
         _q("evil\\nerror: forged line (") + r".*unexpected: expected not in the plan"),
    Case("wrong-shape", "convert", "tiny", _wrong_shape,
         _q(f"{DOWN0} (") + r"model-0000\d-of-00004\.safetensors\): shape: expected \[64, 160\], found \[64, 128\]"),
    Case("wrong-dtype", "convert", "tiny", _wrong_dtype,
         _q(f"{DOWN0} (") + r"model-0000\d-of-00004\.safetensors\): dtype: expected BF16 or F32, found F16"),
    Case("fp8-weight-without-scale", "convert", "tiny-fp8", lambda s, t: drop_tensor(s, Q_B3 + "_scale_inv"),
         _q(f"{Q_B3} (") + r"model-0000\d-of-00004\.safetensors\): fp8-scale-missing: expected "
         + _q(f"{Q_B3}_scale_inv F32[1, 1], found absent")),
    Case("fp8-scale-wrong-shape", "convert", "tiny-fp8", _scale_shape,
         _q(f"{Q_B3}_scale_inv (") + r"model-0000\d-of-00004\.safetensors\): scale-shape: expected \[1, 1\], "
         r"found \[2, 1\]"),
    Case("wrong-model-type", "convert", "tiny", lambda s, t: edit_config(s, lambda c: c.update(model_type="llama")),
         r"config\.json: model_type 'llama' is not glm5_next \(GLM-5\.3-Flash\)$"),
    Case("no-config", "convert", "tiny", lambda s, t: (s / CONFIG_NAME).unlink(),
         r"src: no config\.json \(not an HF checkpoint directory\)$"),
    Case("config-more-experts-than-checkpoint", "convert", "tiny",
         lambda s, t: edit_config(s, set_text(n_routed_experts=16)),
         _q(f"{TEXT}layers.2.mlp.gate.weight (") + r"model-0000\d-of-00004\.safetensors\): shape: expected \[16, 64\], "
         r"found \[8, 64\] \(and \d+ more; run `glmconv audit-names .*src`\)"),
    Case("config-fewer-layers-than-checkpoint", "convert", "tiny", lambda s, t: cut_config_layers(s, 3),
         _q(f"{TEXT}layers.3.") + r"\S+ \(model-0000\d-of-00004\.safetensors\): unexpected: expected not in the plan,"
         r" found .* \(and \d+ more; run `glmconv audit-names"),
    Case("config-vocab-differs", "convert", "tiny", lambda s, t: edit_config(s, set_text(vocab_size=640)),
         _q(f"{EMBED} (") + r"model-0000\d-of-00004\.safetensors\): shape: expected \[640, 64\], found \[512, 64\] "
         r"\(and 1 more"),
    Case("nan-weight-check-finite", "convert", "tiny",
         lambda s, t: (edit_tensor(s, DOWN0, set_first(float("nan"), (3, 17))), ["--check-finite"])[1],
         _q(f"{DOWN0} (") + r"model-0000\d-of-00004\.safetensors\): 1 non-finite value \(NaN/Inf\), the first nan "
         r"in block \[0, 0\] at index \[3, 17\]; glmconv refuses NaN/Inf weights$"),
    Case("nan-fp8-code", "convert", "tiny-fp8", lambda s, t: edit_tensor(s, DOWN0, fp8_nan_code),
         _q(f"{DOWN0} (") + r"model-0000\d-of-00004\.safetensors\): 1 non-finite value \(NaN/Inf\), the first FP8 "
         r"code 0x7F in block \[0, 0\] at index \[2, 9\]; glmconv refuses NaN/Inf weights$"),
    Case("empty-directory", "convert", "tiny", _empty, r"src: empty directory$"),
    Case("symlink-loop-shard", "convert", "tiny", _symlink_loop(_shard(2)),
         _q(f"{INDEX_NAME}: shard '{_shard(2)}' is a symlink loop")),
    Case("symlink-loop-sidecar", "convert", "tiny", _symlink_loop("tokenizer.json"),
         r"src/tokenizer\.json: is a symlink loop$"),
    Case("symlink-loop-config", "convert", "tiny", _symlink_loop(CONFIG_NAME), r"src/config\.json: is a symlink loop$"),
    Case("no-such-directory", "convert", "tiny", lambda s, t: shutil.rmtree(s), r"src: no such file or directory$"),
]

MCORE_CASES = [
    Case("tracker-points-nowhere", "export", "mc", lambda m, t: (m / TRACKER_NAME).write_text("7"),
         _q(f"{TRACKER_NAME}: points to iter_0000007, which is missing")),
    Case("tracker-garbage", "export", "mc", lambda m, t: (m / TRACKER_NAME).write_text("latest\n"),
         _q(f"{TRACKER_NAME}: expected an iteration number or 'release', got 'latest'")),
    Case("distcp-data-file-missing", "export", "mc", _missing_distcp,
         r"__0_0\.distcp: data file listed in \.metadata is missing from /\S+/src/release$"),  # which checkpoint
    Case("distcp-data-file-truncated", "export", "mc", _truncated_distcp,
         r"__0_0\.distcp: truncated: metadata needs \d+ bytes, file has \d+$"),
    Case("dcp-metadata-missing", "export", "mc", lambda m, t: (m / RELEASE / DCP_METADATA_NAME).unlink(),
         _q(f"{RELEASE}/{DCP_METADATA_NAME}: missing (checkpoint incomplete?)")),
    Case("dcp-metadata-truncated", "export", "mc",
         lambda m, t: _truncate(m / RELEASE / DCP_METADATA_NAME, 99),
         _q(f"{DCP_METADATA_NAME}: corrupt or truncated pickle")),
    Case("common-state-missing", "export", "mc", lambda m, t: edit_metadata(m, drop_common_state),
         r"release: common state missing: no common\.pt and no " + _q(COMMON_STATE_KEY) + r" entry in \.metadata"),
    Case("mcore-config-missing", "export", "mc", lambda m, t: (m / CONFIG_NAME).unlink(),
         r"src: torch_dist checkpoint has no config\.json next to it \(convert writes one there\): copy the "
         r"model's config\.json into .*src, or pass --config CONFIG$"),
    Case("mcore-config-vs-checkpoint-layers", "export", "mc", lambda m, t: cut_config_layers(m, 3),  # args first
         r"release: the stored Megatron args say 4 decoder layers \(num_layers\) but the config says 3: this "
         r"checkpoint is another model than its config\.json$"),
    Case("inf-weight-copied-bytes", "export", "mc",
         lambda m, t: (rewrite_torch_dist(m, t / "edited", set_mcore(EXPERTS_FC2, float("inf"), (5, 3, 7))),
                       shutil.rmtree(m), (t / "edited").rename(m), [])[3],
         _q(f"{TEXT}layers.3.mlp.experts.5.down_proj.weight (") + r".*release\): 1 non-finite value \(NaN/Inf\), "
         r"the first inf in block \[0, 0\] at index \[3, 7\]"),
    Case("empty-directory", "export", "mc", _empty,
         _q(f"src: not a torch_dist checkpoint (no {TRACKER_NAME} or metadata.json)")),
    Case("tracker-non-ascii-digit", "export", "mc", lambda m, t: (m / TRACKER_NAME).write_text("\u00b2"),
         _q(f"{TRACKER_NAME}: expected an iteration number or 'release', got '\u00b2'")),
    Case("symlink-loop-tracker", "export", "mc", _symlink_loop(TRACKER_NAME), _q(f"{TRACKER_NAME}: is a symlink loop")),
    Case("symlink-loop-distcp", "export", "mc", lambda m, t: _symlink_loop(first_distcp(m).name)(m / RELEASE, t),
         r"\.metadata: data file '__0_0\.distcp' is a symlink loop$"),
    Case("metadata-storage-a-list", "export", "mc", lambda m, t: edit_metadata(m, _storage_a_list),
         r"^error: \.metadata: storage_data is a list, expected dict or NoneType$"),
    Case("metadata-storage-offset-none", "export", "mc", lambda m, t: edit_metadata(m, _storage_offset_none),
         r"^error: \.metadata: storage of .*: _StorageInfo has no offset$"),  # a None field is not pickled
    Case("metadata-attribute-renamed", "export", "mc", lambda m, t: edit_metadata(m, _storage_attribute_renamed),
         r"^error: \.metadata: storage of .*: _StorageInfo has no length$"),
]

AUDIT_CASES = [  # audit-names exits 2 (not 1) when it cannot read its input at all
    Case("header-not-json", "audit-names", "tiny", lambda s, t: overwrite_header(s, _shard(1), garbage_header),
         _q(f"{_shard(1)}: corrupt header: not valid UTF-8 JSON")),
    Case("symlinked-shard-escapes", "audit-names", "tiny", _symlink_escape,
         _q(f"{INDEX_NAME}: shard '{_shard(2)}' resolves to ") + r".*, outside the checkpoint directory",
         ["outside.safetensors"]),
    Case("empty-directory", "audit-names", "tiny", _empty, r"src: empty directory$"),
    Case("symlink-loop-shard", "audit-names", "tiny", _symlink_loop(_shard(2)),
         _q(f"{INDEX_NAME}: shard '{_shard(2)}' is a symlink loop")),
    Case("metadata-storage-a-list", "audit-names", "mc", lambda m, t: edit_metadata(m, _storage_a_list),
         r"\.metadata: storage_data is a list, expected dict or NoneType$"),
    Case("dcp-metadata-truncated", "audit-names", "mc",
         lambda m, t: _truncate(m / RELEASE / DCP_METADATA_NAME, 99),
         _q(f"{DCP_METADATA_NAME}: corrupt or truncated pickle")),
]


@pytest.fixture
def sources(tiny_ckpt: Path, tiny_fp8_ckpt: Path, mc_ckpt: Path) -> dict[str, Path]:
    return {"tiny": tiny_ckpt, "tiny-fp8": tiny_fp8_ckpt, "mc": mc_ckpt}


def _run_case(case: Case, sources: dict[str, Path], tmp_path: Path) -> str:
    src = tmp_path / "src"
    shutil.copytree(sources[case.source], src)
    extra = case.breaks(src, tmp_path)
    extra = extra if isinstance(extra, list) else []  # a lambda's side effect may return a byte count
    out = tmp_path / "out"
    args = [case.command, str(src)] + ([str(out)] if case.command != "audit-names" else []) + extra
    inputs = [src] if src.exists() else []
    inputs += [tmp_path / f for f in case.extra_inputs]
    return assert_refused(args, inputs, out, case.pattern)


@pytest.mark.parametrize("case", HF_CASES + MCORE_CASES + AUDIT_CASES,
                         ids=lambda c: f"{c.command}:{c.id}")


def test_bad_input_is_one_error_line_and_nothing_published(case: Case, sources: dict[str, Path],
                                                           tmp_path: Path) -> None:
    _run_case(case, sources, tmp_path)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_non_finite_weight_whose_bytes_convert_only_copies_is_refused(value: float, dtype: str, tiny_ckpt: Path,
                                                                      tmp_path: Path) -> None:
    """No flag needed: the copied bytes are scanned as they pass (a BF16 or F32 source weight, one bad value)."""
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    stored = {"BF16": torch.bfloat16, "F32": torch.float32}[dtype]
    edit_tensor(src, DOWN0, lambda t: set_first(value, (3, 17))(t.to(stored)))
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                   rf"^error: {re.escape(DOWN0)} \(model-0000\d-of-00004\.safetensors\): 1 non-finite value "
                   rf"\(NaN/Inf\), the first {value} in block \[0, 0\] at index \[3, 17\]; glmconv refuses")


@pytest.fixture(scope="module")
def converted_pairs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nonfinite")
    for dtype in ("bf16", "fp32"):
        assert invoke(["convert", str(tiny_ckpt), str(root / dtype), "--dtype", dtype]).exit_code == 0
    return {"BF16": root / "bf16", "F32": root / "fp32"}


@pytest.mark.parametrize("command", ["export", "relayout", "verify"])
@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_a_non_finite_megatron_weight_is_refused_by_every_command(command: str, value: float, dtype: str,
                                                                 converted_pairs: dict[str, Path], tiny_ckpt: Path,
                                                                 tmp_path: Path) -> None:
    """A trainer's divergence in a torch_dist checkpoint: export (bytes copied), relayout (bytes copied) and
    verify refuse it, naming the tensor, its block and the count; nothing published."""
    edited, out = tmp_path / "edited", tmp_path / "out"
    rewrite_torch_dist(converted_pairs[dtype], edited, set_mcore("decoder.layers.0.mlp.linear_fc2.weight", value,
                                                                 (30, 130)))
    args = {"export": ["export", str(edited), str(out)], "relayout": ["relayout", str(edited), str(out), "--to",
                                                                      "mcore"],
            "verify": ["verify", str(tiny_ckpt), str(edited)]}[command]
    name = r"(model\.language_model\.layers\.0\.mlp\.down_proj|decoder\.layers\.0\.mlp\.linear_fc2)\.weight"
    assert_refused(args, [edited], out, rf"^error: {name} \(.*\): 1 non-finite value \(NaN/Inf\), the first "
                                        rf"{value} in block \[0, 1\] at index \[30, 130\]; glmconv refuses")



def test_relayout_names_a_bad_expert_value_by_its_index_in_the_whole_stacked_tensor(
        converted_pairs: dict[str, Path], tmp_path: Path) -> None:
    """Stacked experts copied one expert at a time: the refusal gives the index in the whole tensor, not the step."""
    edited, out = tmp_path / "edited", tmp_path / "out"
    rewrite_torch_dist(converted_pairs["BF16"], edited, set_mcore(EXPERTS_FC2, float("nan"), (5, 3, 7)))
    job = relayout_mod.prepare(edited, out, to="mcore")
    one_expert = 64 * 32 * 2  # [8, 64, 32] BF16: a step of one row
    with pytest.raises(GlmconvError, match=r"\): 1 non-finite value \(NaN/Inf\), the first nan in block "
                                             r"\[5, 0, 0\] at index \[5, 3, 7\]; glmconv refuses"):
        relayout_mod.relayout(job, relayout_mod.RelayoutOptions(chunk_bytes=one_expert, progress=False))
    assert not out.exists()

# ---- output locations that refuse writes -------------------------------------------------------------

def _input(case_source: str, sources: dict[str, Path]) -> tuple[str, Path]:
    return ("convert", sources["tiny"]) if case_source == "tiny" else ("export", sources["mc"])


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_read_only_output_location(source: str, sources: dict[str, Path], mount_tmpfs: Callable,
                                   tmp_path: Path) -> None:
    """A read-only filesystem (a real `mount -o ro` tmpfs): refused before anything is written."""
    command, src = _input(source, sources)
    mnt = mount_tmpfs("ro,size=1m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here; test_output_under_sysfs covers an unwritable location")
    line = assert_refused([command, str(src), str(mnt / "out")], [src], mnt / "out",
                          _q(f"{mnt}: not writable"))
    assert "error: " in line


@pytest.mark.parametrize("source", ["tiny", "mc"])
@pytest.mark.parametrize("shape, pattern", [
    ("one component of 300 bytes", r"a path component is longer than the filesystem's 255 bytes"),
    ("a name that the staging suffix pushes past 255 bytes", r"a path component is longer than the filesystem's"),
    ("a path past PATH_MAX", r"a path component is longer|the path is [\d,]+ bytes"),
    ("a path too long for the files below it", r"the path is [\d,]+ bytes; the files glmconv writes below it"),
])


def test_output_path_too_long(source: str, shape: str, pattern: str, sources: dict[str, Path],
                              tmp_path: Path) -> None:
    """Issue 25: an OUT the filesystem cannot name (ENAMETOOLONG) is the user's input, not an internal error."""
    command, src = _input(source, sources)
    out = {"one component of 300 bytes": tmp_path / ("x" * 300),
           "a name that the staging suffix pushes past 255 bytes": tmp_path / ("x" * 250),
           "a path past PATH_MAX": tmp_path.joinpath(*["y" * 200] * 22),
           "a path too long for the files below it": tmp_path.joinpath(*["y" * 200] * 19)}[shape]
    assert_refused([command, str(src), str(out)], [src], out, r"^error: .*\.\.\. \([\d,]+ characters\): " + pattern)


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_output_under_sysfs(source: str, sources: dict[str, Path], tmp_path: Path) -> None:
    """Root passes every permission check, but sysfs refuses new files even to root: the lock file cannot be made."""
    command, src = _input(source, sources)
    parent = Path("/sys")
    assert_refused([command, str(src), str(parent / "glmconv-test-out")], [src], parent / "glmconv-test-out",
                   r"/sys: (not writable|cannot create the lock file glmconv-test-out\.glmconv-lock \(.+\); is the "
                   r"output location writable\?)$")


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_output_parent_is_a_file(source: str, sources: dict[str, Path], tmp_path: Path) -> None:
    command, src = _input(source, sources)
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "out"
    assert_refused([command, str(src), str(out)], [src, tmp_path / "a-file"], tmp_path / "sentinel",
                   _q(f"{tmp_path / 'a-file'}: output parent directory is not a directory"))


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_output_parent_is_a_symlink_loop(source: str, sources: dict[str, Path], tmp_path: Path) -> None:
    command, src = _input(source, sources)
    (tmp_path / "loop").symlink_to("loop")
    assert_refused([command, str(src), str(tmp_path / "loop" / "out")], [src], tmp_path / "sentinel",
                   _q(f"{tmp_path / 'loop'}: output parent directory is a symlink loop"))


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_output_is_a_file(source: str, sources: dict[str, Path], tmp_path: Path) -> None:
    command, src = _input(source, sources)
    (tmp_path / "out").write_text("not a directory")
    assert_refused([command, str(src), str(tmp_path / "out"), "--force"], [src], tmp_path / "out",
                   _q(f"{tmp_path / 'out'}: exists and is not a directory"))


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_full_output_location(source: str, sources: dict[str, Path], mount_tmpfs: Callable,
                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ENOSPC part way through (a real 200 KB tmpfs; the outputs are ~1.2 MB; --no-space-check lets the run start):
    one line, staging removed."""
    command, src = _input(source, sources)
    mnt = mount_tmpfs("size=200k")
    if mnt is None:  # simulate: the writer's first write fails with ENOSPC
        mnt = tmp_path / "full"
        mnt.mkdir()
        _simulate_enospc(monkeypatch)
    line = assert_refused([command, str(src), str(mnt / "out"), "--no-space-check"], [src], mnt / "out",
                          r"(No space left on device|\[Errno 28\])")
    assert str(mnt / "out") in line
    assert listing(mnt) == []


@pytest.mark.parametrize("source", ["tiny", "mc"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_output_that_cannot_fit_is_refused_up_front(source: str, dry_run: bool, sources: dict[str, Path],
                                                    mount_tmpfs: Callable, tmp_path: Path) -> None:
    """A real 200 KB tmpfs and ~1.2 MB of output: refused before anything is written, naming both sizes."""
    command, src = _input(source, sources)
    mnt = mount_tmpfs("size=200k")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here; test_space_refusal_names_the_sizes simulates the free space")
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    assert_refused([command, str(src), str(mnt / "out"), *(["--dry-run"] if dry_run else [])], [src], mnt / "out",
                   rf"^error: {re.escape(str(mnt / 'out'))}: the output needs 0\.00\d GB but {re.escape(str(mnt))} "
                   rf"has {free / 1e9:.3f} GB free; free some space, choose another OUT, or pass --no-space-check "
                   r"to try anyway$")


@pytest.mark.parametrize("source", ["tiny", "mc"])
def test_space_refusal_names_the_sizes(source: str, sources: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                       tmp_path: Path) -> None:
    """statvfs says 1 MB free; the output (1,189,840 bytes of tensors + 1 % + 1 MiB) needs 2.250 MB."""
    import glmconv.space as space

    monkeypatch.setattr(space, "free_bytes", lambda path: 10**6)
    command, src = _input(source, sources)
    out = tmp_path / "new" / "out"  # parent missing: the nearest existing ancestor is tmp_path
    need = space.needed_bytes(1_189_840)
    assert need == 1_189_840 + 11_898 + 2**20
    assert_refused([command, str(src), str(out), "--dry-run"], [src], tmp_path / "new",
                   rf"^error: {re.escape(str(out))}: the output needs {need / 1e9:.3f} GB but "
                   rf"{re.escape(str(tmp_path))} has 0\.001 GB free; free some space, choose another OUT, or pass "
                   r"--no-space-check to try anyway$")
    got = invoke([command, str(src), str(tmp_path / "out"), "--no-space-check", "--json"])
    assert got.exit_code == 0, got.stderr


def _simulate_enospc(monkeypatch: pytest.MonkeyPatch) -> None:
    import glmconv.io.safetensors.writer as hw
    import glmconv.io.torch_dist.writer as dw

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dw, "_write_group_file", full)
    monkeypatch.setattr(hw.ShardWriter, "_flush", full)
    monkeypatch.setattr(hw.PlannedShardWriter, "_open_shard", full)


def test_existing_output_is_untouched_when_input_is_bad(tiny_ckpt: Path, tmp_path: Path) -> None:
    """With --force over a published OUT, a bad input leaves the old OUT exactly as it was."""
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    out = tmp_path / "out"
    assert invoke(["convert", str(src), str(out), "--json"]).exit_code == 0
    edit_tensor(src, DOWN0, set_first(float("inf"), (0, 0)))
    assert_refused(["convert", str(src), str(out), "--force", "--check-finite"], [src], out,
                   _q(f"{DOWN0} (") + r".*1 non-finite value \(NaN/Inf\), the first inf in block \[0, 0\] at index "
                   r"\[0, 0\]")


# ---- parity --train-backend megatron: what megatron-core's modules cannot run ----------------------------------------

@pytest.fixture(scope="module")
def mcore_mc(mc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bad-input-mcore") / "mc-mcore"
    relayout_mod.relayout(relayout_mod.prepare(mc_ckpt, out, to="mcore"), relayout_mod.RelayoutOptions(progress=False))
    return out


@pytest.mark.parametrize("case", ["miles layout", "replay routing", "replay indexer"])
def test_the_megatron_backend_refuses_what_megatron_core_cannot_run(case: str, tiny_ckpt: Path, mc_ckpt: Path,
                                                                    mcore_mc: Path, tmp_path: Path) -> None:
    common = ["parity", str(tiny_ckpt), "--train-backend", "megatron", "--tokens", "32", "--report-dir",
              str(tmp_path / "report")]
    if case == "miles layout":
        args, pattern = [*common[:2], str(mc_ckpt), *common[2:]], (
            rf"^error: {re.escape(str(mc_ckpt))} is in the miles layout: --train-backend megatron loads "
            rf"megatron-core's own modules, which read the mcore layout; run `glmconv relayout "
            rf"{re.escape(str(mc_ckpt))} OUT --to mcore` and pass OUT$")
    else:
        what = case.split()[1]
        args, pattern = [*common[:2], str(mcore_mc), *common[2:], "--replay", what], (
            rf"^error: --replay {what} with --train-backend megatron: megatron-core's \w+ has no way to take "
            r"selections from outside; drop --replay or use --train-backend glmconv$")
    assert_refused(args, [tiny_ckpt, mc_ckpt, mcore_mc], tmp_path / "report", pattern)
