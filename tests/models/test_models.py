"""The serve and train models on the tiny and cut8 fixtures.

serve (HfWeights, Conventions.serve()) vs transformers' Glm5NextForConditionalGeneration: logits, fp32,
norm-wise relative error <= 1e-5 (measured ~1e-6), sequences several times longer than index_topk (16).
train (MegatronWeights of a `glmconv convert`, conventions aligned) vs serve: every sub-block <= 1e-6
(in practice bit-identical). Each single divergent convention first shows (> 1e-4) at its expected sub-block
with everything before it <= 1e-6.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers.ops_helpers import cu, rel

from glmconv.errors import GlmconvError
from glmconv.models.conventions import ConventionError, Conventions
from glmconv.models.model import GlmModel
from glmconv.models.weights import ExpertBank, HfWeights, MegatronWeights

TOL_HF = 1e-5
TOL_SAME = 1e-6
DIVERGED = 1e-4
PRESETS = ("tiny", "cut8")


@pytest.fixture(scope="module")
def ckpts(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """preset -> (HF dir, converted torch_dist dir), converted once per module on first use."""
    from glmconv_cli.main import cli

    done: dict[str, tuple[Path, Path]] = {}

    def get(preset: str) -> tuple[Path, Path]:
        if preset not in done:
            hf = request.getfixturevalue(f"{preset}_ckpt")
            out = tmp_path_factory.mktemp("models") / f"mc-{preset}"
            res = CliRunner().invoke(cli, ["convert", str(hf), str(out)])
            assert res.exit_code == 0, res.output
            done[preset] = (hf, out)
        return done[preset]
    return get


def _serve(hf: Path, **kw: Any) -> GlmModel:
    w = HfWeights(hf)
    return GlmModel(w.config, w, Conventions.serve(), **kw)


def _train(mc: Path, conventions: Conventions) -> GlmModel:
    w = MegatronWeights(mc)
    return GlmModel(w.config, w, conventions)


def _ids(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


Step = tuple[Any, str, float, dict, dict]


def _walk(a: GlmModel, b: GlmModel, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> list[Step]:
    """Propagated run of both models: (layer, sub-block, rel err of b vs a, aux a, aux b) per step, then logits."""
    out = []
    with torch.inference_mode():
        xa, xb = a.embed(ids), b.embed(ids)
        for layer in range(a.num_layers):
            xa, aux_a = a.attention(layer, xa, cu_seqlens)
            xb, aux_b = b.attention(layer, xb, cu_seqlens)
            out.append((layer, "attention", rel(xb, xa), aux_a, aux_b))
            xa, aux_a = a.mlp(layer, xa)
            xb, aux_b = b.mlp(layer, xb)
            out.append((layer, "mlp", rel(xb, xa), aux_a, aux_b))
        out.append(("logits", "", rel(b.head(xb), a.head(xa)), {}, {}))
    return out


# ---- conventions ----------------------------------------------------------------------------------------------

def test_conventions_defaults_and_overrides() -> None:
    serve, train = Conventions.serve(), Conventions.train_default()
    assert serve.as_dict() == {"proj_rms": "reference", "indexer_query": "normed", "swiglu_clamp": "10",
                               "output_contraction": "mean", "hc_mix": "fp32", "indexer_kpool": "learned"}
    assert train.as_dict() == {"proj_rms": "megatron", "indexer_query": "raw", "swiglu_clamp": "off",
                               "output_contraction": "mean", "hc_mix": "bf16", "indexer_kpool": "learned"}
    assert Conventions.train_default(has_hc_head=True).output_contraction == "learned"
    assert Conventions.train_default(layout="mcore") == train.with_overrides(["indexer_kpool=off"])
    assert train.with_overrides(["serve"]) == serve
    assert train.with_overrides(["proj_rms=reference", "hc_mix=serve"]).diverging() == [
        "indexer_query", "swiglu_clamp"]
    for bad, match in (["nope=1"], "KEY=VALUE"), (["proj_rms"], "KEY=VALUE"), (["proj_rms=rsqrt"], "proj_rms"):
        with pytest.raises(ConventionError, match=match):
            serve.with_overrides(bad)
    assert issubclass(ConventionError, GlmconvError)


def test_every_text_rule_has_a_unique_role() -> None:
    from glmconv.config import parse_config
    from glmconv.fixtures.configs import preset_config
    from glmconv.models.weights import role_index
    from glmconv.plan import build_plan

    plan = build_plan(parse_config(preset_config("cut8")), mtp=False, vision=False)
    assert len(role_index(plan.mappings)) == len(plan.mappings)


# ---- serve vs transformers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_serve_logits_equal_transformers(preset: str, ckpts: Any) -> None:
    from transformers import Glm5NextForConditionalGeneration

    hf, _ = ckpts(preset)
    ref = Glm5NextForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    model = _serve(hf)
    for n in (9, 70):  # shorter than index_topk (16), and four pools' worth longer
        ids = _ids(n, seed=n)
        with torch.inference_mode():
            want = ref(input_ids=ids[None]).logits[0]
            assert rel(model.forward(ids, cu(n)), want) <= TOL_HF, n


def test_packed_batch_equals_each_sequence_alone(ckpts: Any) -> None:
    hf, _ = ckpts("tiny")
    model = _serve(hf)
    a, b = _ids(37, 1), _ids(53, 2)
    with torch.inference_mode():
        packed = model.forward(torch.cat([a, b]), cu(37, 53))
        assert rel(packed[:37], model.forward(a, cu(37))) <= TOL_SAME
        assert rel(packed[37:], model.forward(b, cu(53))) <= TOL_SAME
        x = model.embed(torch.cat([a, b]))
        for layer in range(model.num_layers):  # the aux ids of the packed run point into their own sequence
            x, aux = model.attention(layer, x, cu(37, 53))
            if "topk" in aux:
                top = aux["topk"]
                assert bool(((top < 37) | (top == -1))[:37].all()) and bool(((top >= 37) | (top == -1))[37:].all())


# ---- train vs serve -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESETS)
def test_aligned_train_model_equals_serve_at_every_sub_block(preset: str, ckpts: Any) -> None:
    hf, mc = ckpts(preset)
    steps = _walk(_serve(hf), _train(mc, Conventions.serve()), _ids(70, 3), cu(70))
    assert all(err <= TOL_SAME for _, _, err, _, _ in steps), [(layer, s, e) for layer, s, e, _, _ in steps]
    for _, _, _, aux_s, aux_t in steps:
        assert aux_s.keys() == aux_t.keys() and all(torch.equal(aux_s[k], aux_t[k]) for k in aux_s)
    assert {k for _, _, _, aux, _ in steps for k in aux} == {"topk", "experts"}


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, ExpertBank):
        assert a.num == b.num, where
        for e in range(a.num):
            _same(a.get(e), b.get(e), f"{where} expert {e}")
    elif is_dataclass(a):
        for f in fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a is None and b is None, where


def test_megatron_layout_is_read_natively_into_the_same_tensors(ckpts: Any) -> None:
    hf, mc = ckpts("cut8")
    s, t = HfWeights(hf), MegatronWeights(mc)
    for get in ("embedding", "final_norm", "lm_head"):
        _same(getattr(s, get)(), getattr(t, get)(), get)
    for layer in range(s.config.num_layers):
        _same(s.attention(layer), t.attention(layer), f"layer {layer} attention")
        _same(s.mlp(layer), t.mlp(layer), f"layer {layer} mlp")


@pytest.mark.parametrize("preset, override, first", [
    ("tiny", "proj_rms=megatron", (0, "attention")),
    ("tiny", "hc_mix=bf16", (0, "attention")),
    ("tiny", "swiglu_clamp=off", (0, "mlp")),
    ("tiny", "indexer_query=raw", (3, "attention")),  # the first DSA layer, once the sequence outgrows index_topk
    ("cut8", "indexer_query=raw", (3, "attention")),
    ("cut8", "proj_rms=megatron", (0, "attention")),
])


def test_each_divergence_first_shows_where_expected(preset: str, override: str, first: tuple[int, str],
                                                    ckpts: Any) -> None:
    """On the default (realistic) fixtures as made: streams at RMS ~2e-3, where the proj-RMS eps form matters, and
    hot gate units past the SwiGLU clamp in every MLP (--init unit would need both planted by hand)."""
    hf, mc = ckpts(preset)
    serve = _serve(hf)
    train = _train(mc, Conventions.serve().with_overrides([override]))
    steps = _walk(serve, train, _ids(70, 4), cu(70))
    errs = [((layer, sub), err) for layer, sub, err, _, _ in steps]
    at = next(i for i, (_, err) in enumerate(errs) if err > DIVERGED)
    assert errs[at][0] == first, errs
    assert all(err <= TOL_SAME for _, err in errs[:at]), errs


def test_learned_contraction_needs_hc_head_tensors(ckpts: Any) -> None:
    _, mc = ckpts("tiny")
    with pytest.raises(GlmconvError, match="hc_head_fn, hc_head_base and hc_head_scale"):
        _train(mc, Conventions.serve().with_overrides(["output_contraction=learned"]))  # refused before any layer


# ---- streaming, dtypes, sources -------------------------------------------------------------------------------

class _Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def attention(self, layer: int) -> Any:
        self.calls.append(("attention", layer))
        return self.inner.attention(layer)

    def mlp(self, layer: int) -> Any:
        self.calls.append(("mlp", layer))
        return self.inner.mlp(layer)


def test_layers_stream_one_sub_block_at_a_time(ckpts: Any) -> None:
    hf, _ = ckpts("tiny")
    src = _Counting(HfWeights(hf))
    model = GlmModel(src.config, src, Conventions.serve())
    with torch.inference_mode():
        model.forward(_ids(20), cu(20))
    assert src.calls == [(sub, layer) for layer in range(4) for sub in ("attention", "mlp")]
    with pytest.raises(GlmconvError, match="layers 0..3"):
        model.attention(4, model.embed(_ids(3)), cu(3))


def test_bf16_model_keeps_the_fp32_parts(ckpts: Any) -> None:
    hf, _ = ckpts("tiny")
    model = _serve(hf, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.forward(_ids(30), cu(30))
    assert logits.dtype == torch.float32 and bool(logits.isfinite().all())
    w = model._attention_weights(0)
    assert w.hc.fn.dtype == torch.float32 and w.kda.conv.dtype == torch.float32 and w.kda.a_log.dtype == torch.float32
    assert w.kda.q_proj.dtype == torch.bfloat16 and w.norm.dtype == torch.bfloat16
    with pytest.raises(GlmconvError, match="dtype"):
        GlmModel(model.config, model.weights, Conventions.serve(), dtype=torch.float16)


def test_fp8_source_is_dequantised_to_bf16(tiny_fp8_ckpt: Path, tiny_ckpt: Path) -> None:
    fp8, ref = HfWeights(tiny_fp8_ckpt), HfWeights(tiny_ckpt)
    got, want = fp8.mlp(3).moe.experts.get(1), ref.mlp(3).moe.experts.get(1)
    assert got.gate.dtype == torch.bfloat16 and rel(got.gate, want.gate) < 0.1
    model = GlmModel(fp8.config, fp8, Conventions.serve())
    with torch.inference_mode():
        assert rel(model.forward(_ids(20), cu(20)), _serve(tiny_ckpt).forward(_ids(20), cu(20))) < 0.2
