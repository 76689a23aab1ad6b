"""fixtures/release-tensors.json is every tensor of the real FP8 release: the plan of the real config must give it.

Regenerate after a deliberate mapping change: `python -m glmconv.fixtures.golden --write`, and review the diff.
"""

from __future__ import annotations

import json

import pytest
from helpers.repo_files import RELEASE_TENSORS

from glmconv.fixtures.golden import main, release_tensors, render

Index = dict[str, tuple[tuple[int, ...], str]]
REGENERATE = "python -m glmconv.fixtures.golden --write"


def _index(tensors: list[dict]) -> Index:
    return {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in tensors}


def moved(golden: Index, planned: Index, shown: int = 20) -> list[str]:
    """What differs, by tensor name: the first `shown` missing, new and changed names of each kind."""
    gone, new = sorted(golden.keys() - planned.keys()), sorted(planned.keys() - golden.keys())
    changed = sorted(n for n in golden.keys() & planned.keys() if golden[n] != planned[n])
    return ([f"no longer planned ({len(gone)}): {gone[:shown]}"] if gone else []) + \
        ([f"newly planned ({len(new)}): {new[:shown]}"] if new else []) + \
        ([f"shape/dtype changed ({len(changed)}): " + ", ".join(f"{n} {golden[n]} -> {planned[n]}"
                                                               for n in changed[:shown])] if changed else [])


@pytest.fixture(scope="module")
def golden() -> Index:
    return _index(json.loads(RELEASE_TENSORS.read_text()))


@pytest.fixture(scope="module")
def planned() -> list[dict]:
    return release_tensors()


def test_the_real_configs_plan_is_the_golden_release_index(golden: Index, planned: list[dict]) -> None:
    assert moved(golden, _index(planned)) == [], f"the release's tensor set moved; if meant: {REGENERATE}"


def test_the_golden_file_is_the_rendering_byte_for_byte(planned: list[dict]) -> None:
    assert RELEASE_TENSORS.read_text() == render(planned), f"regenerate: {REGENERATE}"


def test_the_golden_index_holds_the_releases_76108_keys_with_347_vision_ones(golden: Index) -> None:
    assert len(golden) == 76_108
    assert sum(n.startswith("model.visual.") for n in golden) == 347


@pytest.mark.parametrize("name,shape,dtype", [
    ("model.language_model.layers.0.hc_attn_fn", (24, 16384), "F32"),
    ("model.language_model.layers.0.self_attn.q_conv1d.weight", (8192, 1, 4), "BF16"),
    ("model.language_model.layers.3.self_attn.q_a_proj.weight", (1536, 4096), "F8_E4M3"),
    ("model.language_model.layers.3.self_attn.q_a_proj.weight_scale_inv", (12, 32), "F32"),
    ("model.language_model.layers.3.self_attn.kv_b_proj.weight", (32768, 512), "BF16"),
    ("model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape", (4, 128), "F32"),
    ("model.language_model.layers.45.eh_proj.weight", (4096, 8192), "BF16"),
    ("model.language_model.layers.45.mlp.experts.287.down_proj.weight_scale_inv", (32, 16), "F32"),
])


def test_the_golden_index_agrees_with_the_releases_documented_tensors(golden: Index, name: str,
                                                                    shape: tuple[int, ...], dtype: str) -> None:
    assert golden[name] == (shape, dtype)


def test_the_golden_index_has_no_scale_for_a_bf16_tensor(golden: Index) -> None:
    assert "model.language_model.layers.3.self_attn.kv_b_proj.weight_scale_inv" not in golden
    assert "model.language_model.layers.0.self_attn.q_proj.weight_scale_inv" not in golden


def test_moved_names_each_tensor_that_left_arrived_or_changed() -> None:
    golden = {"a": ((1,), "F32"), "b": ((2,), "BF16"), "c": ((3,), "BF16")}
    planned = {"b": ((2,), "F32"), "c": ((3,), "BF16"), "d": ((4,), "BF16")}
    assert moved(golden, planned) == ["no longer planned (1): ['a']", "newly planned (1): ['d']",
                                      "shape/dtype changed (1): b ((2,), 'BF16') -> ((2,), 'F32')"]


def test_regeneration_refuses_to_write_outside_the_repository_root(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--write"]) == 2
    assert "no fixtures/ here: run from the repository root" in capsys.readouterr().err
