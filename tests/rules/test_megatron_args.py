"""`glmconv megatron-args` and the stored-args check: a training launch and a checkpoint describe one model."""

from __future__ import annotations

import argparse
import json
import typing
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers.repo_files import REAL_CONFIG

from glmconv.errors import CheckpointError
from glmconv.io.config_file import load_config
from glmconv.megatron_args import check_stored_args, command_line, layer_pattern, model_args
from glmconv_cli.main import cli

# The miles launcher's model arguments for GLM-5.3-Flash (its glm5_next model script), flag by flag.
MILES = {"--num-layers": 45, "--hidden-size": 4096, "--ffn-hidden-size": 12288, "--num-attention-heads": 64,
         "--q-lora-rank": 1536, "--kv-lora-rank": 512, "--qk-head-dim": 256, "--qk-pos-emb-head-dim": 0,
         "--v-head-dim": 256, "--num-experts": 288, "--moe-router-topk": 8, "--moe-ffn-hidden-size": 2048,
         "--moe-shared-expert-intermediate-size": 2048, "--moe-layer-freq": "([0]*3+[1]*42)",
         "--vocab-size": 154880, "--norm-epsilon": 1e-5, "--moe-router-score-function": "sigmoid",
         "--moe-router-topk-scaling-factor": 2.5, "--moe-router-enable-expert-bias": True,
         "--untie-embeddings-and-output-weights": True, "--activation-func-clamp-value": 10.0,
         "--multi-latent-attention": True, "--swiglu": True, "--normalization": "RMSNorm"}


def test_real_config_gives_the_miles_launchers_model_args() -> None:
    args = model_args(load_config(REAL_CONFIG))
    assert {flag: args.get(flag) for flag in MILES} == MILES


def test_a_cut_keeps_the_dims_and_cuts_the_layer_pattern() -> None:
    args = model_args(load_config(REAL_CONFIG).cut(8))
    assert args["--num-layers"] == 8 and args["--moe-layer-freq"] == "([0]*3+[1]*5)"
    assert args["--num-experts"] == 288 and args["--hidden-size"] == 4096


def test_layer_pattern_is_run_length_like_megatrons_own() -> None:
    assert layer_pattern([0, 0, 1, 1, 1, 0]) == "([0]*2+[1]*3+[0]*1)"


@pytest.fixture(scope="module")
def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's own argument parser (megatron.training, shipped in megatron-core's wheel)."""
    if not hasattr(typing, "override"):  # megatron.training imports typing.override (Python 3.12); a no-op here
        typing.override = lambda f: f  # type: ignore[attr-defined]
    arguments = pytest.importorskip("megatron.training.arguments")
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_megatron_lm_parses_every_printed_flag_to_the_configs_values(megatron_parser: argparse.ArgumentParser
                                                                      ) -> None:
    """The printed lines, split as a shell would, give Megatron-LM's parser exactly the config's model."""
    import shlex

    words = shlex.split(" ".join(command_line(model_args(load_config(REAL_CONFIG)))))
    ns, unknown = megatron_parser.parse_known_args(words)
    assert unknown == []
    shape = (ns.num_layers, ns.hidden_size, ns.num_experts, ns.moe_router_topk, ns.q_lora_rank)
    assert shape == (45, 4096, 288, 8, 1536)
    assert ns.moe_layer_freq == [0] * 3 + [1] * 42 and ns.qk_pos_emb_head_dim == 0 and ns.layernorm_epsilon == 1e-5
    assert ns.activation_func_clamp_value == 10.0 and ns.moe_router_enable_expert_bias and not ns.add_bias_linear
    assert ns.position_embedding_type == "none" and ns.untie_embeddings_and_output_weights


def test_cli_prints_one_flag_per_line_for_a_launcher(tiny_ckpt: Path) -> None:
    """The default, --format lines: no continuation backslash, no quotes (`$(glmconv megatron-args hf)` passed a
    literal `\\` and a quoted `'([0]*2+[1]*2)'` to the launcher)."""
    res = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "--num-layers 4" and lines[-1] == "--mtp-num-layers 1" and "--swiglu" in lines
    assert "--moe-layer-freq ([0]*2+[1]*2)" in lines
    assert not any("\\" in line or "'" in line for line in lines)


def test_cli_shell_format_is_a_script_continuation(tiny_ckpt: Path) -> None:
    res = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--format", "shell"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0] == "--num-layers 4 \\" and lines[-1] == "--mtp-num-layers 1"
    assert "--moe-layer-freq '([0]*2+[1]*2)' \\" in lines


def test_a_command_substitution_passes_the_flags_as_argv(tiny_ckpt: Path, tmp_path: Path) -> None:
    """What a launch script does with the default output: `torchrun ... $(glmconv megatron-args CKPT)`."""
    import shutil
    import subprocess
    import sys

    glmconv = Path(sys.executable).with_name("glmconv")
    script = 'set -f; for w in $("$1" megatron-args "$2"); do printf "%s\\n" "$w"; done'
    bash = shutil.which("bash") or "/bin/bash"
    words = subprocess.run([bash, "-c", script, "_", str(glmconv), str(tiny_ckpt)], capture_output=True, text=True,
                           cwd=tmp_path, check=True).stdout.splitlines()
    expected = [w for flag, value in model_args(load_config(tiny_ckpt)).items()
                for w in ([flag] if value is True else [flag, str(value)])]
    assert words == expected and "([0]*2+[1]*2)" in words


def test_megatron_lm_parses_the_launcher_lines_to_the_configs_values(megatron_parser: argparse.ArgumentParser
                                                                      ) -> None:
    from glmconv_cli.megatron_args_cmd import launcher_lines

    words = " ".join(launcher_lines(model_args(load_config(REAL_CONFIG)))).split()
    ns, unknown = megatron_parser.parse_known_args(words)
    assert unknown == [] and ns.moe_layer_freq == [0] * 3 + [1] * 42 and ns.num_experts == 288


def test_a_value_with_whitespace_is_refused_in_lines_format() -> None:
    from glmconv.errors import GlmconvError
    from glmconv_cli.megatron_args_cmd import launcher_lines

    with pytest.raises(GlmconvError) as exc:
        launcher_lines({"--num-layers": 4, "--normalization": "RMS Norm"})
    assert str(exc.value) == ("--normalization 'RMS Norm': a value with whitespace cannot be one word of --format "
                              "lines; --format shell or --format json keep it whole")


def test_json_and_another_format_are_refused(tiny_ckpt: Path) -> None:
    for fmt in ("shell", "lines"):
        res = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--json", "--format", fmt])
        assert res.exit_code == 2 and res.output.strip() == (
            f"error: --json is --format json: drop one of --json and --format {fmt}")
    same = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--format", "json"])
    flag = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--json"])
    assert json.loads(same.output) == json.loads(flag.output)


@pytest.fixture(scope="module")
def converted(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for layout in ("miles", "mcore"):
        out[layout] = tmp_path_factory.mktemp("margs") / layout
        res = CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(out[layout]), "--layout", layout])
        assert res.exit_code == 0, res.output
    return out


def test_a_checkpoint_in_the_mcore_layout_gets_no_mtp_flag(converted: dict[str, Path]) -> None:
    """`megatron-args MCORE_DIR` of `convert --layout mcore` printed --mtp-num-layers 1: its layout has no MTP
    module (its stored args say mtp_num_layers None). The checkpoint's own layout is now the default."""
    mcore = CliRunner().invoke(cli, ["megatron-args", str(converted["mcore"])])
    assert mcore.exit_code == 0, mcore.output
    assert not any(line.startswith("--mtp-num-layers") for line in mcore.output.splitlines())
    miles = CliRunner().invoke(cli, ["megatron-args", str(converted["miles"])])
    assert miles.output.splitlines()[-1] == "--mtp-num-layers 1"
    assert mcore.output.splitlines() == miles.output.splitlines()[:-1]
    wrong = CliRunner().invoke(cli, ["megatron-args", str(converted["mcore"]), "--layout", "miles"])
    assert wrong.exit_code == 2 and wrong.output.strip() == (
        f"error: {converted['mcore']}: --layout miles, but its tensors are named in the mcore layout")


def test_cli_json_and_a_bad_cut(tiny_ckpt: Path) -> None:
    res = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--layers", "3", "--json"])
    assert json.loads(res.output)["--num-layers"] == 3
    bad = CliRunner().invoke(cli, ["megatron-args", str(tiny_ckpt), "--layers", "5"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: --layers 5: must be between 1 and 4"


@pytest.mark.parametrize("field, value, said", [
    ("num_experts", 7, "the stored Megatron args say 7 routed experts (num_experts) but the config says 8"),
    ("num_layers", 5, "say 5 decoder layers (num_layers) but the config says 4"),
    ("hidden_size", 32, "say 32 hidden size (hidden_size) but the config says 64"),
    ("moe_layer_freq", [0, 0, 0, 1], "say 3 leading dense layers (dense_layers) but the config says 2"),
    ("vocab_size", 1024, "say 1024 vocabulary (vocab_size) but the config says 512"),
])


def test_stored_args_of_another_model_are_refused(tiny_ckpt: Path, field: str, value: object, said: str) -> None:
    from glmconv.megatron_args import build_args

    config = load_config(tiny_ckpt)
    args = build_args(config)
    check_stored_args(args, config, "ckpt")  # its own args pass
    setattr(args, field, value)
    with pytest.raises(CheckpointError, match=r"^ckpt: ") as exc:
        check_stored_args(args, config, "ckpt")
    assert said in str(exc.value)


def test_export_refuses_a_checkpoint_whose_stored_args_disagree(tiny_ckpt: Path, tmp_path: Path) -> None:
    """A legacy common.pt (read first, as Megatron does) saying 7 experts: export stops before any tensor."""
    from glmconv.megatron_args import build_common_state

    mc = tmp_path / "mc"
    assert CliRunner().invoke(cli, ["convert", str(tiny_ckpt), str(mc)]).exit_code == 0
    state = build_common_state(load_config(tiny_ckpt), num_experts=7)
    torch.save(state, mc / "release" / "common.pt")
    res = CliRunner().invoke(cli, ["export", str(mc), str(tmp_path / "hf")])
    assert res.exit_code == 2
    assert "the stored Megatron args say 7 routed experts (num_experts) but the config says 8" in res.output
    assert not (tmp_path / "hf").exists()


def test_stored_args_use_megatron_lms_own_attribute_names(megatron_parser: argparse.ArgumentParser) -> None:
    """A trainer reads `args.<dest>` back from the checkpoint (--use-checkpoint-args): every name convert stores
    is a destination of Megatron-LM's parser (virtual_pipeline_model_parallel_size is set by its validate_args)."""
    from glmconv.megatron_args import build_args

    dests = {a.dest for a in megatron_parser._actions} | {"virtual_pipeline_model_parallel_size"}
    assert sorted(set(vars(build_args(load_config(REAL_CONFIG)))) - dests) == []


def test_the_mcore_layout_trains_without_an_mtp_module() -> None:
    cfg = load_config(REAL_CONFIG)
    assert model_args(cfg)["--mtp-num-layers"] == 1
    assert "--mtp-num-layers" not in model_args(cfg, "mcore")
    assert {k: v for k, v in model_args(cfg).items() if k != "--mtp-num-layers"} == model_args(cfg, "mcore")
