"""The planted-defect catalog is data (fixtures/defects.json), checked on load: a bad entry is named, never guessed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.repo_files import DEFECTS

from glmconv.compare.catalog import CATALOG, NAMES, CatalogError, Defect, parse_catalog

WEIGHTS = {"name": "norm-offset", "kind": "weights", "site": "dsa", "sub_block": "attention",
           "path": ["dsa", "q_a_norm"], "damage": "plus-one", "summary": "q_a_norm stored as w + 1"}
CONVENTION = {"name": "convention-hc_mix", "kind": "convention", "convention": "hc_mix=bf16",
              "summary": "train convention hc_mix=bf16 alone"}
KERNEL = {"name": "kernel-sparse-mla-scale", "kind": "kernel", "site": "dsa", "op": "sparse_mla",
          "damage": "scale-x0.75", "summary": "scale 25% low"}


def _text(*entries: Any) -> str:
    return json.dumps({"defects": list(entries)})


def test_the_installed_catalog_is_the_repository_file_in_its_order() -> None:
    assert CATALOG == parse_catalog(DEFECTS.read_text())
    assert NAMES == ("kda-q-rows-permuted", "experts-swapped", "fc1-mis-split", "fp8-scale-block", "norm-offset",
                     "layers-swapped", "conv-reversed", "decay-sign", "router-bias", "hc-mix-split",
                     "shared-rows-zero", "kv-heads-permuted", "convention-proj_rms", "convention-hc_mix",
                     "convention-swiglu_clamp", "convention-indexer_query", "convention-indexer_kpool",
                     "kernel-kda-dt-bias-dropped", "kernel-kda-lower-bound", "kernel-kda-beta-sigmoid-twice",
                     "kernel-conv-no-silu", "kernel-sparse-mla-scale", "kernel-sparse-mla-ids-off-by-one",
                     "kernel-indexer-ids-off-by-one", "kernel-indexer-truncated", "kernel-indexer-unsorted")


def test_the_kernel_defects_cover_every_kernel_op_with_a_damage_each() -> None:
    from glmconv.compare.kernel_defects import KERNEL_DAMAGES
    from glmconv.kernels import OpSet

    kernel = [d for d in CATALOG if d.kind == "kernel"]
    assert {d.op for d in kernel} == set(OpSet.OPS) and len({d.damage for d in kernel}) >= 6
    assert all(d.damage in KERNEL_DAMAGES and d.site in ("kda", "dsa") for d in kernel)


def test_a_kernel_entry_becomes_a_kernel_defect() -> None:
    assert parse_catalog(_text(KERNEL)) == (Defect("kernel-sparse-mla-scale", "scale 25% low", kind="kernel",
                                                   site="dsa", op="sparse_mla", damage="scale-x0.75"),)


def test_a_weights_entry_becomes_a_defect_with_its_path_as_a_tuple() -> None:
    assert parse_catalog(_text(WEIGHTS)) == (Defect("norm-offset", "q_a_norm stored as w + 1", site="dsa",
                                                    path=("dsa", "q_a_norm"), damage="plus-one"),)


def test_a_convention_entry_becomes_a_convention_defect() -> None:
    assert parse_catalog(_text(CONVENTION)) == (Defect("convention-hc_mix", "train convention hc_mix=bf16 alone",
                                                       kind="convention", convention="hc_mix=bf16"),)


@pytest.mark.parametrize("entry,message", [
    ({**WEIGHTS, "sub_blok": "mlp"}, r"entry 0 \(norm-offset\): unknown key\(s\) sub_blok \(a weights entry has"),
    ({k: v for k, v in WEIGHTS.items() if k != "damage"}, r"entry 0 \(norm-offset\): missing key\(s\) damage"),
    ({**CONVENTION, "site": "dsa"}, r"entry 0 \(convention-hc_mix\): unknown key\(s\) site"),
    ({**WEIGHTS, "path": "dsa.q_a_norm"}, r"entry 0 \(norm-offset\): path must be a list, not 'dsa.q_a_norm'"),
    ({**WEIGHTS, "path": ["dsa", 1]}, r"path must be a list of strings"),
    ({**WEIGHTS, "summary": ""}, r"summary must be a non-empty string"),
    ({**WEIGHTS, "kind": "weight"},
     r"entry 0 \(norm-offset\): kind must be one of weights, convention, kernel, not 'weight'"),
    ({**KERNEL, "op": "flash_attn"}, r"op must be one of short_conv, kda_core, indexer, sparse_mla, not 'flash_attn'"),
    ({**KERNEL, "site": "moe"}, r"a kernel defect's site must be kda or dsa"),
    ({**KERNEL, "damage": "scale-x2"}, r"entry 0 \(kernel-sparse-mla-scale\): damage must be one of .*not 'scale-x2'"),
    ({**KERNEL, "path": []}, r"unknown key\(s\) path \(a kernel entry has"),
    ({**WEIGHTS, "site": "mla"}, r"site must be kda, dsa, dense or moe \(optionally :N\)"),
    ({**WEIGHTS, "sub_block": "ffn"}, r"sub_block attention or mlp, not 'dsa' / 'ffn'"),
    ({**CONVENTION, "convention": "hc_mix"}, r"convention must be KEY=VALUE, not 'hc_mix'"),
    (["norm-offset"], r"entry 0: expected an object, got list"),
])


def test_a_bad_entry_is_refused_naming_it_and_its_fault(entry: Any, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        parse_catalog(_text(entry))


def test_a_name_given_twice_is_refused() -> None:
    with pytest.raises(CatalogError, match="defect names given twice: norm-offset"):
        parse_catalog(_text(WEIGHTS, {**WEIGHTS, "site": "kda"}))


@pytest.mark.parametrize("text,message", [
    ("{", r"x.json: not valid JSON"),
    ('[{"name": "a"}]', r'x.json: expected an object with one key, "defects"'),
    ('{"defects": [], "extra": 1}', r'x.json: expected an object with one key, "defects"'),
])


def test_a_file_of_the_wrong_shape_is_refused_naming_the_file(text: str, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        parse_catalog(text, "x.json")
