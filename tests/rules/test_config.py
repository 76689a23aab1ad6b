"""Config: unwrap, validate, schedule, cut."""

import copy
import json

import pytest
from helpers.repo_files import REAL_CONFIG as REAL

from glmconv.config import DENSE, DSA, KDA, MOE, parse_config
from glmconv.errors import ConfigError
from glmconv.io.config_file import load_config


@pytest.fixture()
def real() -> dict:
    return json.loads(REAL.read_text())


def test_real_config_has_34_kda_and_11_dsa_layers_at_every_fourth(real):
    cfg = parse_config(real)
    assert cfg.attn_types.count(KDA) == 34
    assert [i for i, t in enumerate(cfg.attn_types) if t == DSA] == list(range(3, 45, 4))


def test_real_config_has_3_dense_then_42_moe_layers_and_one_mtp_layer_at_45(real):
    cfg = parse_config(real)
    assert cfg.mlp_types == (DENSE,) * 3 + (MOE,) * 42
    assert (cfg.num_mtp_layers, cfg.mtp_layer_index) == (1, 45)


def test_real_index_kpool_is_4_and_missing_key_takes_transformers_default_16(real):
    assert parse_config(real).dim("index_kpool") == 4
    del real["text_config"]["index_kpool"]
    assert parse_config(real).dim("index_kpool") == 16


def test_flat_text_config_is_accepted_without_vision(real):
    cfg = parse_config(real["text_config"])
    assert cfg.num_layers == 45 and cfg.vision is None and not cfg.nested


def test_schedule_falls_back_to_linear_attn_config_then_to_pattern(real):
    text = real["text_config"]
    del text["layer_types"]
    text["linear_attn_config"]["full_attn_layers"] = [0, 44]
    text["linear_attn_config"]["kda_layers"] = list(range(1, 44))
    cfg = parse_config(real)
    assert [i for i, t in enumerate(cfg.attn_types) if t == DSA] == [0, 44]
    del text["linear_attn_config"]
    assert parse_config(real).attn_types[:8] == (KDA, KDA, KDA, DSA, KDA, KDA, KDA, DSA)


def test_indexed_attention_spelling_of_transformers_means_dsa(real):
    real["text_config"]["layer_types"] = ["indexed_attention" if t != "linear_attention" else t
                                          for t in real["text_config"]["layer_types"]]
    assert parse_config(real).attn_types.count(DSA) == 11


def test_layer_types_disagreeing_with_linear_attn_config_is_an_error(real):
    real["text_config"]["layer_types"][0] = "deepseek_sparse_attention"
    with pytest.raises(ConfigError, match=r"disagree at layers \[0\]"):
        parse_config(real)


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3", None])
def test_other_model_types_are_refused(real, model_type):
    real["model_type"] = model_type
    with pytest.raises(ConfigError, match="is not glm5_next"):
        parse_config(real)


def test_layer_types_of_wrong_length_is_an_error(real):
    real["text_config"]["layer_types"] = real["text_config"]["layer_types"][:44]
    with pytest.raises(ConfigError, match="layer_types must list 45 entries"):
        parse_config(real)


def test_index_topk_not_divisible_by_kpool_is_an_error(real):
    real["text_config"]["index_topk"] = 2046
    with pytest.raises(ConfigError, match="not divisible by index_kpool 4"):
        parse_config(real)


def test_nonpositive_dimension_names_the_key(real):
    real["text_config"]["n_routed_experts"] = 0
    with pytest.raises(ConfigError, match="n_routed_experts must be a positive integer"):
        parse_config(real)


def test_cut_to_8_layers_is_the_training_cut(real):
    cut = parse_config(real).cut(8)
    assert cut.attn_types == (KDA, KDA, KDA, DSA, KDA, KDA, KDA, DSA)
    assert cut.mlp_types == (DENSE,) * 3 + (MOE,) * 5
    assert cut.mtp_layer_index == 8
    assert cut.raw["text_config"]["linear_attn_config"]["full_attn_layers"] == [3, 7]


def test_cut_does_not_modify_the_original(real):
    before = copy.deepcopy(real)
    parse_config(real).cut(4)
    assert real == before


def test_cut_out_of_range_is_an_error(real):
    with pytest.raises(ConfigError, match="between 1 and 45"):
        parse_config(real).cut(46)


def test_load_config_names_the_file_on_bad_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "glm5_next", ')
    with pytest.raises(ConfigError, match=r"config.json: not valid JSON"):
        load_config(bad)


def test_load_config_accepts_a_checkpoint_directory(tmp_path, real):
    (tmp_path / "config.json").write_text(json.dumps(real))
    assert load_config(tmp_path).num_layers == 45
