"""Fuzzing the mapping rules with random valid configs (hypothesis).

Configs: 1-6 layers, random attention / MLP / indexer schedules, small random dims within the config's
constraints, 0-2 shared experts, MTP 0/1, hyper-connections on or off, with or without a vision tower, nested
or flat. For each:

* the plan is a bijection: every HF tensor (FP8 scales included) sits in exactly one mapping, every Megatron
  tensor comes from exactly one, `_extra_state` keys are unique, every shape is positive;
* every mapping's transform round trips: random HF tensors -> forward -> the planned Megatron shapes and
  dtypes -> backward -> the same bytes (convert -> export identity at the rules level);
* a few real end-to-end runs: a random checkpoint written from the plan (safetensors, several shards),
  `convert` then `export`, byte-identical to what was written.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from helpers.fuzzing import fuzz
from helpers.hf_helpers import raw_tensors
from hypothesis import given
from hypothesis import strategies as st

from glmconv.config import DSA, parse_config
from glmconv.io.dtypes import torch_dtype
from glmconv.io.safetensors.writer import ShardWriter
from glmconv.plan import FP8, Plan, build_plan
from glmconv.rules import names
from glmconv.runners import convert as convert_mod
from glmconv.runners import export as export_mod

KDA_T, DSA_T = "linear_attention", "deepseek_sparse_attention"


@st.composite
def configs(draw: st.DrawFn, rich: bool = False) -> dict[str, Any]:
    """A random, valid GLM-5.3-Flash config dict at toy sizes; `rich`: every layer and part kind present."""
    n = draw(st.integers(3 if rich else 1, 6))
    attn = draw(st.lists(st.sampled_from([KDA_T, DSA_T]), min_size=n, max_size=n))
    mlp = draw(st.lists(st.sampled_from(["dense", "sparse"]), min_size=n, max_size=n))
    if rich:
        first, second = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True)))
        attn[first], attn[second] = KDA_T, DSA_T
        mlp[first], mlp[second] = "dense", "sparse"
    indexer = draw(st.lists(st.sampled_from(["full", "shared"]), min_size=n, max_size=n))
    dsa = [i for i in range(n) if attn[i] == DSA_T]
    if dsa:
        indexer[dsa[0]] = "full"  # the first DSA layer computes the top-k the shared ones reuse
    small = st.integers(1, 6)
    experts = draw(st.integers(1, 6))
    kpool = draw(st.integers(1, 4))
    heads = draw(st.integers(1, 3))
    text: dict[str, Any] = {
        "model_type": "glm5_next_text", "num_hidden_layers": n, "vocab_size": draw(st.integers(2, 24)),
        "hidden_size": draw(st.integers(2, 12)), "intermediate_size": draw(small),
        "moe_intermediate_size": draw(small), "num_attention_heads": heads, "q_lora_rank": draw(small),
        "kv_lora_rank": draw(small), "qk_nope_head_dim": draw(small), "qk_rope_head_dim": 0,
        "v_head_dim": draw(small), "index_n_heads": draw(st.integers(1, 3)), "index_head_dim": draw(small),
        "index_kpool": kpool, "index_topk": kpool * draw(st.integers(1, 3)), "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, experts)), "n_shared_experts": draw(st.integers(0, 2)),
        "linear_num_heads": draw(st.integers(1, 3)), "linear_head_dim": draw(small),
        "linear_conv_kernel_dim": draw(st.integers(1, 4)), "hc_mult": draw(st.integers(1, 4)),
        "num_nextn_predict_layers": draw(st.integers(1 if rich else 0, 1)), "mhc": draw(st.booleans()),
        "layer_types": attn, "mlp_layer_types": mlp, "indexer_types": indexer, "tie_word_embeddings": False,
    }
    if draw(st.booleans()):
        text["linear_attn_config"] = {"kda_layers": [i for i in range(n) if i not in dsa], "full_attn_layers": dsa}
    nested = rich or draw(st.booleans())
    if not nested:
        return text
    cfg: dict[str, Any] = {"model_type": "glm5_next", "text_config": text, "tie_word_embeddings": False}
    if rich or draw(st.booleans()):
        v_heads = draw(st.integers(1, 2))
        cfg["vision_config"] = {
            "depth": draw(st.integers(1, 2)), "hidden_size": v_heads * draw(st.integers(1, 4)),
            "num_heads": v_heads, "intermediate_size": draw(small), "patch_size": draw(st.integers(1, 2)),
            "temporal_patch_size": draw(st.integers(1, 2)), "spatial_merge_size": draw(st.integers(1, 2)),
            "out_hidden_size": draw(small), "projection_intermediate_size": draw(small),
            "in_channels": draw(st.integers(1, 3)),
        }
    return cfg


PLAN_OPTIONS = st.fixed_dictionaries({"fp8": st.booleans(), "mtp": st.booleans(), "vision": st.booleans(),
                                      "text_prefix": st.sampled_from([names.HF_TEXT_PREFIX, names.HF_FLAT_PREFIX])})


# ---- the plan is a bijection ---------------------------------------------------------------------------

@fuzz(300)
@given(configs(), PLAN_OPTIONS)
def test_every_plan_is_a_bijection_with_positive_shapes(raw: dict[str, Any], opts: dict[str, Any]) -> None:
    config = parse_config(copy.deepcopy(raw))
    plan = build_plan(config, **opts)
    hf = Counter(t.name for m in plan.mappings for t in (*m.hf, *(s for s in m.scales if s)))
    mc = Counter(t.name for m in plan.mappings for t in m.mcore)
    assert [n for n, c in hf.items() if c > 1] == [] and [n for n, c in mc.items() if c > 1] == []
    assert set(hf) == set(plan.hf_index) == set(plan.mapping_of_hf)
    assert set(mc) == set(plan.mcore_index) == set(plan.mapping_of_mcore)
    objects = plan.mcore_objects()
    assert len(objects) == len(set(objects)) and not set(objects) & set(mc)
    for m in plan.mappings:
        assert m.hf and m.mcore and len(m.scales) == len(m.hf)
        for t in (*m.hf, *m.mcore, *(s for s in m.scales if s)):
            assert t.shape and all(type(d) is int and d >= 1 for d in t.shape), (t.name, t.shape)
        assert [t.shape for t in m.mcore] == m.rule.transform.mcore_shapes([t.shape for t in m.hf], len(m.mcore))
        for t, s in zip(m.hf, m.scales):
            assert (s is not None) == (t.dtype == FP8) == (plan.fp8 and m.rule.fp8)
    _check_coverage(plan, config)


def _check_coverage(plan: Plan, config: Any) -> None:
    """Each decoder layer has its attention and MLP tensors; optional parts appear exactly when asked."""
    for i, attn in enumerate(config.attn_types):
        layer = [n for n in plan.mcore_index if n.startswith(names.mcore_layer(i))]
        kind = "self_attention.kda." if attn != DSA else "self_attention.linear_q_down_proj."
        assert any(kind in n for n in layer), (i, attn)
        has_indexer = any(n.endswith("self_attention.wk.weight") for n in layer)
        assert has_indexer == (attn == DSA and config.indexer_full[i])
        assert any("_hyper_connection." in n for n in layer) == bool(config.text.get("mhc", True))
    assert any(n.startswith("mtp.") for n in plan.mcore_index) == plan.mtp == (
        plan.mtp and config.num_mtp_layers > 0)
    assert any(n.startswith("vision_model.") for n in plan.mcore_index) == plan.vision


# ---- transforms round trip -----------------------------------------------------------------------------

def _random(shape: tuple[int, ...], dtype: str, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(torch_dtype(dtype))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


@fuzz(200)
@given(configs(), st.integers(0, 2**32 - 1))
def test_every_transform_round_trips_bytes(raw: dict[str, Any], seed: int) -> None:
    plan = build_plan(parse_config(raw))
    g = torch.Generator().manual_seed(seed)
    for m in plan.mappings:
        hf = [_random(t.shape, t.dtype, g) for t in m.hf]
        mcore = m.rule.transform.forward([t.clone() for t in hf], len(m.mcore))
        assert [tuple(t.shape) for t in mcore] == [s.shape for s in m.mcore], m.rule.hf
        assert [t.dtype for t in mcore] == [torch_dtype(s.dtype) for s in m.mcore], m.rule.hf
        back = m.rule.transform.backward(mcore, [t.shape for t in m.hf])
        assert len(back) == len(hf)
        for spec, a, b in zip(m.hf, hf, back):
            assert tuple(b.shape) == spec.shape and b.dtype == a.dtype and _bits(a) == _bits(b), spec.name


# ---- end to end: convert -> export on random checkpoints -----------------------------------------------

def write_random_checkpoint(out: Path, raw: dict[str, Any], seed: int) -> Path:
    """Every HF tensor of the full plan, random, in planned dtypes, in a few shards; plus config.json."""
    plan = build_plan(parse_config(copy.deepcopy(raw)))
    g = torch.Generator().manual_seed(seed)
    total = sum(t.nbytes for t in plan.hf_index.values())
    with ShardWriter(out, max_shard_bytes=max(1, total // 3)) as writer:
        for name, spec in plan.hf_index.items():
            writer.add(name, _random(spec.shape, spec.dtype, g))
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


@fuzz(3)
@given(configs(rich=True), st.integers(0, 2**32 - 1))
def test_convert_then_export_is_byte_identical_on_random_configs(raw: dict[str, Any], seed: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        src = write_random_checkpoint(root / "hf", raw, seed)
        convert_mod.convert(convert_mod.prepare(src, root / "mc"), convert_mod.RunOptions(progress=False))
        job = export_mod.prepare(root / "mc", root / "out", max_shard_bytes=4096)
        export_mod.export(job, export_mod.ExportOptions(progress=False))
        got, want = raw_tensors(root / "out"), raw_tensors(src)
        assert len(want) == len(build_plan(parse_config(copy.deepcopy(raw))).hf_index) and got == want
        assert json.loads((root / "out" / "config.json").read_text()) == raw
        assert sorted(p.name for p in root.iterdir()) == ["hf", "mc", "out"]
        shutil.rmtree(root / "mc")
