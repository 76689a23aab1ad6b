"""Inputs glmconv reads: one symlink rule for every checkpoint file, special files, FP8 scales, weight fingerprint.

Every case runs the CLI and checks the contract of `assert_refused` (one `error:` line, exit 2, inputs
byte-identical, nothing published); the accepted layouts (links inside the directory, the HF hub cache) are
checked to convert and round-trip bit for bit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.bad_input import Q_B3, assert_refused, edit_tensor, invoke, sha256_tree, weight_map

from glmconv.io.file_names import CONFIG_NAME, INDEX_NAME
from glmconv.runners import convert as convert_mod

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SCALE = Q_B3 + "_scale_inv"  # F32 [1, 1] in the FP8 tiny fixture


@pytest.fixture(scope="module")
def mc_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("input-files") / "mc"
    convert_mod.convert(convert_mod.prepare(tiny_ckpt, out), convert_mod.RunOptions(progress=False))
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _link_out(ckpt: Path, name: str, outside: Path) -> None:
    """Move `name` out of the checkpoint and leave a symlink to it in its place."""
    shutil.move(ckpt / name, outside)
    (ckpt / name).symlink_to(outside)


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


# ---- symlinks: one rule for every file read from a checkpoint directory ------------------------------------

@pytest.mark.parametrize("command", ["convert", "audit-names"])
def test_config_symlinked_out_of_the_checkpoint_is_refused(command: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    src = _copy(tiny_ckpt, tmp_path / "src")
    _link_out(src, CONFIG_NAME, tmp_path / "elsewhere.json")
    out = tmp_path / "out"
    args = [command, str(src)] + ([str(out)] if command == "convert" else [])
    assert_refused(args, [src, tmp_path / "elsewhere.json"], out,
                   rf"{src / CONFIG_NAME}: resolves to {tmp_path / 'elsewhere.json'}, outside the checkpoint "
                   "directory$")


def test_index_symlinked_out_of_the_checkpoint_is_refused(tiny_ckpt: Path, tmp_path: Path) -> None:
    src = _copy(tiny_ckpt, tmp_path / "src")
    _link_out(src, INDEX_NAME, tmp_path / "index.json")
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src, tmp_path / "index.json"], tmp_path / "out",
                   r"model\.safetensors\.index\.json: resolves to .*index\.json, outside the checkpoint directory$")


@pytest.mark.parametrize("sidecar", ["tokenizer.json", "chat_template.jinja"])
def test_like_sidecar_symlinked_out_is_refused_and_never_copied(sidecar: str, tiny_ckpt: Path, mc_ckpt: Path,
                                                               tmp_path: Path) -> None:
    like = _copy(tiny_ckpt, tmp_path / "like")
    secret = tmp_path / "secret.txt"
    secret.write_text("private key material")
    (like / sidecar).symlink_to(secret)
    out = tmp_path / "out"
    assert_refused(["export", str(mc_ckpt), str(out), "--like", str(like)], [mc_ckpt, like, secret], out,
                   rf"{like / sidecar}: resolves to {secret}, outside the checkpoint directory$")


def test_torch_dist_tracker_symlinked_out_is_refused(mc_ckpt: Path, tmp_path: Path) -> None:
    mc = _copy(mc_ckpt, tmp_path / "mc")
    _link_out(mc, "latest_checkpointed_iteration.txt", tmp_path / "tracker.txt")
    assert_refused(["export", str(mc), str(tmp_path / "out")], [mc, tmp_path / "tracker.txt"], tmp_path / "out",
                   r"latest_checkpointed_iteration\.txt: resolves to .*tracker\.txt, outside the checkpoint")


def test_torch_dist_data_file_symlinked_out_is_refused(mc_ckpt: Path, tmp_path: Path) -> None:
    mc = _copy(mc_ckpt, tmp_path / "mc")
    data = sorted((mc / "release").glob("*.distcp"))[0]
    _link_out(mc / "release", data.name, tmp_path / "data.distcp")
    assert_refused(["export", str(mc), str(tmp_path / "out")], [mc, tmp_path / "data.distcp"], tmp_path / "out",
                   rf"\.metadata: data file '{data.name}' resolves to .*data\.distcp, outside the checkpoint")


def test_links_inside_the_checkpoint_are_followed(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A shard and the config linked to files elsewhere inside the same directory convert as usual."""
    src = _copy(tiny_ckpt, tmp_path / "src")
    (src / "blobs").mkdir()
    for name in (CONFIG_NAME, sorted(set(weight_map(src).values()))[0]):
        _link_out(src, name, src / "blobs" / name)
    got = invoke(["convert", str(src), str(tmp_path / "out"), "--json"])
    assert got.exit_code == 0, got.stderr


def _hub_cache(src: Path, root: Path) -> Path:
    """`src` laid out as the HF hub cache does: snapshots/REV/NAME -> ../../blobs/NAME."""
    repo = root / "models--zai-org--GLM-5.3-Flash"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        shutil.copyfile(f, repo / "blobs" / f.name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    return snap


def test_hf_hub_cache_snapshot_converts_and_round_trips(tiny_ckpt: Path, tmp_path: Path) -> None:
    snap = _hub_cache(tiny_ckpt, tmp_path / "hub")
    before = sha256_tree(snap)
    assert invoke(["convert", str(snap), str(tmp_path / "mc"), "--json"]).exit_code == 0
    got = invoke(["export", str(tmp_path / "mc"), str(tmp_path / "hf2"), "--like", str(snap), "--json"])
    assert got.exit_code == 0, got.stderr
    assert sha256_tree(snap) == before
    from safetensors.torch import load_file

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = tensors(snap), tensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_hub_cache_link_outside_blobs_is_refused(tiny_ckpt: Path, tmp_path: Path) -> None:
    snap = _hub_cache(tiny_ckpt, tmp_path / "hub")
    other = tmp_path / "hub" / "models--zai-org--GLM-5.3-Flash" / "other.json"
    shutil.copyfile(snap / CONFIG_NAME, other)
    (snap / CONFIG_NAME).unlink()
    (snap / CONFIG_NAME).symlink_to(other)
    assert_refused(["convert", str(snap), str(tmp_path / "out")], [snap, other], tmp_path / "out",
                   rf"{snap / CONFIG_NAME}: resolves to {other}, outside the checkpoint directory$")


# ---- special files where a checkpoint or one of its files belongs ------------------------------------------

@pytest.mark.parametrize("command", ["convert", "export", "audit-names"])
def test_fifo_given_as_checkpoint_directory_is_refused(command: str, tmp_path: Path) -> None:
    fifo = tmp_path / "ckpt"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    args = [command, str(fifo)] + ([str(out)] if command != "audit-names" else [])
    assert_refused(args, [], out, rf"{fifo}: not a directory \(a FIFO\); expected a checkpoint directory$")


def test_device_given_as_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    assert_refused(["convert", "/dev/null", str(tmp_path / "out")], [], tmp_path / "out",
                   r"/dev/null: not a directory \(a character device\); expected a checkpoint directory$")


@pytest.mark.parametrize("name", [CONFIG_NAME, INDEX_NAME, "shard"])
def test_fifo_in_place_of_a_checkpoint_file_is_refused(name: str, tiny_ckpt: Path, tmp_path: Path) -> None:
    """A FIFO would block the reader forever: it is refused before it is opened."""
    src = _copy(tiny_ckpt, tmp_path / "src")
    name = sorted(set(weight_map(src).values()))[1] if name == "shard" else name
    _fifo(src / name)
    assert_refused(["convert", str(src), str(tmp_path / "out")], [], tmp_path / "out",
                   rf"{src / name}: not a regular file \(a FIFO\)$")


def test_directory_in_place_of_the_dcp_metadata_is_refused(mc_ckpt: Path, tmp_path: Path) -> None:
    mc = _copy(mc_ckpt, tmp_path / "mc")
    (mc / "release" / ".metadata").unlink()
    (mc / "release" / ".metadata").mkdir()
    assert_refused(["export", str(mc), str(tmp_path / "out")], [mc], tmp_path / "out",
                   r"release/\.metadata: not a regular file \(a directory\)$")


# ---- FP8 block scales ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "shown"), [(0.0, "0"), (-0.0123, "-0.0123"), (1e-40, "9.999946e-41"),
                                              (float("nan"), "nan"), (float("inf"), "inf")])


def test_fp8_scale_that_is_not_positive_finite_normal_is_refused(value: float, shown: str, tiny_fp8_ckpt: Path,
                                                                 tmp_path: Path) -> None:
    src = _copy(tiny_fp8_ckpt, tmp_path / "src")
    edit_tensor(src, SCALE, lambda t: torch.full_like(t, value))
    assert_refused(["convert", str(src), str(tmp_path / "out")], [src], tmp_path / "out",
                   rf"{SCALE} \(model-0000\d-of-00004\.safetensors\): block \[0, 0\] has scale {shown}; expected a "
                   r"positive, finite, normal float32 \(block amax / 448\)$")


def test_fp8_scale_error_names_the_first_bad_block_and_counts_them(tmp_path: Path) -> None:
    from glmconv.numerics.fp8 import Fp8FormatError, check_scales

    scales = torch.ones(3, 4)
    scales[1, 2] = 0.0
    scales[2, 0] = -1.0
    with pytest.raises(Fp8FormatError, match=r"^w_scale_inv: block \[1, 2\] has scale 0; .* \(2 such blocks\)$"):
        check_scales(scales, "w_scale_inv")


def test_smallest_normal_fp8_scale_is_accepted() -> None:
    from glmconv.numerics.fp8 import check_scales

    check_scales(torch.tensor([[torch.finfo(torch.float32).tiny, 448.0]]), "w_scale_inv")


# ---- parity: the two checkpoints must be a conversion of each other ------------------------------------------

@pytest.fixture(scope="module")
def other_mc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glmconv.fixtures import make_fixture

    d = tmp_path_factory.mktemp("input-files-seed1")
    hf = make_fixture(d / "hf", "tiny", fp8=False, seed=1)
    out = d / "mc"
    convert_mod.convert(convert_mod.prepare(hf, out), convert_mod.RunOptions(progress=False))
    return out


def test_parity_refuses_checkpoints_that_are_not_a_conversion_of_each_other(tiny_ckpt: Path, other_mc: Path,
                                                                           tmp_path: Path) -> None:
    assert_refused(["parity", str(tiny_ckpt), str(other_mc), "--tokens", "16"], [tiny_ckpt, other_mc],
                   tmp_path / "none",
                   rf"{other_mc} is not a conversion of {tiny_ckpt}: their embed and lm_head weights differ in the "
                   r"first 8 rows almost everywhere \(embed: max abs diff [0-9.e+-]+; lm_head: max abs diff "
                   r"[0-9.e+-]+\); pass --allow-different-weights to compare them anyway$")


def test_parity_allow_different_weights_runs_and_reports_the_disagreement(tiny_ckpt: Path, other_mc: Path) -> None:
    got = invoke(["parity", str(tiny_ckpt), str(other_mc), "--tokens", "16", "--json", "--allow-different-weights"])
    assert got.exit_code == 1, got.stderr  # it runs and reports; the verdict names the divergence all the same
    import json

    report = json.loads(got.stdout)
    assert report["logits"]["top1_agreement"] < 0.5 and report["first_divergence"]["cause"] == "weights"
    assert "weights differ (the checkpoints hold different weights here (--allow-different-weights)): " in got.stderr


def test_allowed_different_weights_are_the_cause_where_they_differ(tiny_ckpt: Path, mc_ckpt: Path,
                                                                   tmp_path: Path) -> None:
    """A checkpoint trained further: one hc_attn_base value moved. The verdict names the weights, not numerics."""
    import json

    from helpers import mcore_helpers as mh

    bias = "decoder.layers.0.self_attention_hyper_connection.bias"

    def nudge(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ts[bias] = ts[bias].clone()
        ts[bias][0] += 0.5
        return ts

    trained = mh.rewrite_dcp(mc_ckpt, tmp_path / "trained", nudge, keep=("config.json", "glmconv.json"))
    got = invoke(["parity", str(tiny_ckpt), str(trained), "--tokens", "16", "--json", "--train-conventions", "serve",
                  "--allow-different-weights"])
    first = json.loads(got.stdout)["first_divergence"]
    assert got.exit_code == 1 and (first["layer"], first["sub_block"], first["cause"]) == (0, "attention", "weights")
    assert "numerics" not in got.stderr


def test_parity_accepts_its_own_conversion(tiny_ckpt: Path, mc_ckpt: Path) -> None:
    got = invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--tokens", "16", "--json",
                  "--train-conventions", "serve"])
    assert got.exit_code == 0, got.stderr


@pytest.mark.parametrize("where", ["mc", "mc/release", "hf", "parent-of-hf"])
def test_parity_report_dir_overlapping_an_input_is_refused(where: str, tiny_ckpt: Path, mc_ckpt: Path,
                                                           tmp_path: Path) -> None:
    """A converted checkpoint carries glmconv's manifest too: it is still no report directory."""
    hf, mc = _copy(tiny_ckpt, tmp_path / "hf"), _copy(mc_ckpt, tmp_path / "mc")
    report_dir = {"mc": mc, "mc/release": mc / "release", "hf": hf, "parent-of-hf": tmp_path}[where]
    assert_refused(["parity", str(hf), str(mc), "--tokens", "16", "--report-dir", str(report_dir)], [hf, mc],
                   tmp_path / "none", rf"{report_dir}: the report directory (is the same path as|is inside|contains) "
                   r"the (HF|torch_dist) checkpoint .*; choose one outside every input$")


def test_parity_report_dir_holding_the_replay_file_is_refused(tiny_ckpt: Path, mc_ckpt: Path, tmp_path: Path) -> None:
    """The replay payload is an input too: in a report directory glmconv wrote, the report would replace it."""
    from glmconv.io.output import claim_report_dir

    report_dir = tmp_path / "rep"
    claim_report_dir(report_dir, {})  # a report directory glmconv wrote, which a report may be written into
    payload = report_dir / "report.json"
    payload.write_text("{}")
    got = invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--tokens", "16", "--replay", "routing",
                  "--replay-file", str(payload), "--report-dir", str(report_dir)])
    assert got.exit_code == 2
    assert got.stderr.strip().endswith(f"contains the replay file {payload}; choose one outside every input")
    assert payload.read_text() == "{}"


def test_a_failed_parity_run_leaves_no_report_directory_it_made(tiny_ckpt: Path, mc_ckpt: Path,
                                                                 tmp_path: Path) -> None:
    """A bad prompt file is found after the report directory was claimed: what the run made goes with it."""
    (tmp_path / "prompt").write_text("1 two")
    report_dir = tmp_path / "new" / "rep"
    got = invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--prompt-file", str(tmp_path / "prompt"),
                  "--report-dir", str(report_dir)])
    assert got.exit_code == 2 and "'two' is not a token id" in got.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompt"]


def test_a_failed_parity_run_keeps_the_empty_directory_it_was_given(tiny_ckpt: Path, mc_ckpt: Path,
                                                                    tmp_path: Path) -> None:
    (tmp_path / "prompt").write_text("1 two")
    (tmp_path / "rep").mkdir()
    got = invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--prompt-file", str(tmp_path / "prompt"),
                  "--report-dir", str(tmp_path / "rep")])
    assert got.exit_code == 2 and list((tmp_path / "rep").iterdir()) == []


def test_a_failed_parity_run_leaves_an_earlier_report_as_it_was(tiny_ckpt: Path, mc_ckpt: Path,
                                                                tmp_path: Path) -> None:
    rep = tmp_path / "rep"
    assert invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--tokens", "16", "--train-conventions", "serve",
                   "--report-dir", str(rep)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in rep.iterdir()}
    (tmp_path / "prompt").write_text("1 two")
    got = invoke(["parity", str(tiny_ckpt), str(mc_ckpt), "--prompt-file", str(tmp_path / "prompt"),
                  "--report-dir", str(rep)])
    assert got.exit_code == 2 and {p.name: p.read_bytes() for p in rep.iterdir()} == before


# ---- a file of a checkpoint given where the checkpoint directory goes (issue 40) ------------------------------

FILES = {"shard": "model-00001-of-00004.safetensors", "index": INDEX_NAME, "config": CONFIG_NAME,
         "distcp": "release/__0_0.distcp", "metadata": "release/.metadata"}
DIR_ARGS = {  # every argument that takes a checkpoint directory: FILE stands for the file given there
    "convert SRC": ["convert", "FILE", "OUT"], "export MCORE_DIR": ["export", "FILE", "OUT"],
    "export --like": ["export", "MC", "OUT", "--like", "FILE"], "verify HF_DIR": ["verify", "FILE", "MC"],
    "verify MCORE_DIR": ["verify", "HF", "FILE"], "parity HF_DIR": ["parity", "FILE", "MC"],
    "parity MCORE_DIR": ["parity", "HF", "FILE"], "relayout MCORE_DIR": ["relayout", "FILE", "OUT", "--to", "mcore"],
    "relayout --like": ["relayout", "MC", "OUT", "--to", "mcore", "--like", "FILE"]}
CONFIG_ARGS = {  # arguments that take a config.json or a checkpoint directory holding one
    "audit-names SRC": ["audit-names", "FILE"], "audit-names --against": ["audit-names", "HF", "--against", "FILE"],
    "megatron-args CONFIG": ["megatron-args", "FILE"], "export --config": ["export", "MC", "OUT", "--config", "FILE"]}


def _given(file: str, tiny_ckpt: Path, mc_ckpt: Path) -> tuple[Path, Path]:
    """The file, and the checkpoint directory it is a file of."""
    holder = mc_ckpt if file in ("distcp", "metadata") else tiny_ckpt
    return holder / FILES[file], holder


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("where", DIR_ARGS)
def test_a_checkpoint_file_where_a_directory_goes_says_a_directory_is_expected(
        where: str, file: str, tiny_ckpt: Path, mc_ckpt: Path, tmp_path: Path) -> None:
    """Was: `not valid JSON (not UTF-8: byte 5963)` for a shard, `model_type None is not glm5_next` for the index."""
    given, holder = _given(file, tiny_ckpt, mc_ckpt)
    spell = {"FILE": str(given), "OUT": str(tmp_path / "out"), "MC": str(mc_ckpt), "HF": str(tiny_ckpt)}
    args = [spell.get(a, a) for a in DIR_ARGS[where]]
    line = assert_refused(args, [tiny_ckpt, mc_ckpt], tmp_path / "out", "")
    assert line == (f"error: {given}: not a directory (a regular file); expected a checkpoint directory (it is a "
                    f"file of the checkpoint directory {holder}: pass {holder})")


@pytest.mark.parametrize("file", [f for f in FILES if f != "config"])
@pytest.mark.parametrize("where", CONFIG_ARGS)
def test_a_checkpoint_file_where_a_config_goes_says_what_is_expected(
        where: str, file: str, tiny_ckpt: Path, mc_ckpt: Path, tmp_path: Path) -> None:
    given, holder = _given(file, tiny_ckpt, mc_ckpt)
    spell = {"FILE": str(given), "OUT": str(tmp_path / "out"), "MC": str(mc_ckpt), "HF": str(tiny_ckpt)}
    args = [spell.get(a, a) for a in CONFIG_ARGS[where]]
    line = assert_refused(args, [tiny_ckpt, mc_ckpt], tmp_path / "out", "")
    why = "no model_type" if file == "index" else "not JSON"
    assert line == (f"error: {given}: not a config.json ({why}); expected a config.json or a checkpoint directory "
                    f"(it is a file of the checkpoint directory {holder}: pass {holder})")


@pytest.mark.parametrize("file", FILES)
def test_the_api_says_a_directory_is_expected_too(file: str, tiny_ckpt: Path, mc_ckpt: Path, tmp_path: Path) -> None:
    import glmconv

    given, holder = _given(file, tiny_ckpt, mc_ckpt)
    expected = (f"{given}: not a directory (a regular file); expected a checkpoint directory (it is a file of the "
                f"checkpoint directory {holder}: pass {holder})")
    for call in (lambda: glmconv.convert(given, tmp_path / "out"), lambda: glmconv.verify(tiny_ckpt, given),
                 lambda: glmconv.export(given, tmp_path / "out"),
                 lambda: glmconv.relayout(given, tmp_path / "o", to="mcore"), lambda: glmconv.hf_weights(given)):
        with pytest.raises(glmconv.GlmconvError) as err:
            call()
        assert str(err.value) == expected
