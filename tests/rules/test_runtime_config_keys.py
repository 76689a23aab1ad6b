"""Config keys that change neither the model nor its numerics (`use_cache`, `output_router_logits`, ... as
transformers' `save_pretrained` writes them) never make "another model": verify and parity note them and go on.
Every key of transformers' own Glm5NextTextConfig is classified, so a key a new transformers adds fails here first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.hf_helpers import save_with_transformers

from glmconv import api
from glmconv.config import TEXT_SCHEMA
from glmconv.errors import CheckpointError
from glmconv.mistakes import MODEL_KEYS_UNREAD, RUNTIME_KEYS

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ADDED = {"use_cache": True, "output_router_logits": False, "output_hidden_states": False, "return_dict": True,
         "initializer_range": 0.5, "router_aux_loss_coef": 0.25, "attention_dropout": 0.1, "pad_token_id": 7,
         "transformers_version": "5.23.0"}


def test_every_key_of_transformers_text_config_is_either_the_models_or_runtime() -> None:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    keys = set(Glm5NextTextConfig().to_dict())
    model = set(TEXT_SCHEMA) | MODEL_KEYS_UNREAD
    assert sorted(keys - model - RUNTIME_KEYS) == []
    assert sorted(RUNTIME_KEYS & model) == []


@pytest.fixture(scope="module")
def mc_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runtime") / "mc"
    api.convert(tiny_ckpt, out)
    return out


@pytest.fixture(scope="module")
def patched(tiny_ckpt: Path, mc_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, tensors untouched, its config gaining the runtime keys save_pretrained writes."""
    out = tmp_path_factory.mktemp("runtime") / "hf"
    shutil.copytree(tiny_ckpt, out)
    raw = json.loads((out / "config.json").read_text())
    raw["text_config"].update(ADDED)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_verify_notes_runtime_keys_and_finds_the_weights_equal(patched: Path, mc_ckpt: Path) -> None:
    summary = api.verify(patched, mc_ckpt)
    assert summary["equal"] is True
    assert set(ADDED) <= set(summary["config_keys_ignored"])


def test_parity_notes_runtime_keys_and_passes(patched: Path, mc_ckpt: Path) -> None:
    report = api.parity(patched, mc_ckpt, tokens=16, train_conventions="serve")
    assert report["passed"] is True and set(ADDED) <= set(report["config_keys_ignored"])


def test_a_key_that_changes_the_numerics_is_still_another_model(tiny_ckpt: Path, mc_ckpt: Path,
                                                                tmp_path: Path) -> None:
    shutil.copytree(tiny_ckpt, tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw["text_config"].update(ADDED, rms_norm_eps=1e-3)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"is not a conversion of .*: another model \(rms_norm_eps: "):
        api.verify(tmp_path / "hf", mc_ckpt)


def test_a_checkpoint_transformers_saved_verifies_and_parities_against_its_conversion(tiny_ckpt: Path,
                                                                                    tmp_path: Path) -> None:
    saved = save_with_transformers(tiny_ckpt, tmp_path / "saved", "bfloat16")
    assert {"use_cache", "transformers_version"} & set(json.loads((saved / "config.json").read_text())["text_config"])
    api.convert(saved, tmp_path / "mc")
    assert api.verify(saved, tmp_path / "mc")["equal"] is True
    assert api.parity(saved, tmp_path / "mc", tokens=16, train_conventions="serve")["passed"] is True


def test_the_cli_notes_the_ignored_keys_on_stderr(patched: Path, mc_ckpt: Path) -> None:
    from click.testing import CliRunner

    from glmconv_cli.main import cli

    got = CliRunner().invoke(cli, ["verify", str(patched), str(mc_ckpt), "--json"])
    assert got.exit_code == 0 and json.loads(got.stdout)["equal"] is True
    assert "note: config.json keys that differ but change neither the model nor its numerics (ignored): " in got.stderr
    assert "output_router_logits" in got.stderr and got.stderr.strip().endswith("and 3 more")
