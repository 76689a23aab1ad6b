"""The findings of `--train-backend megatron`, measured sub-block by sub-block (run inside a megatron-core
process: tests/models/test_megatron_backend.py's worker). Each finding is measured twice: megatron-core's module
against glmconv's serve reference (the divergence), and against glmconv's own model with the switch(es) that
reproduce it (the divergence understood: equal to fp32 noise).

Inputs are the serve side's streams at each layer (isolated), fp32, `SEQUENCES` packed sequences longer than
index_topk (where the token-level and the kpool indexer part ways).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

EPS_MEGATRON = 1e-5  # megatron-core's indexer k-norm eps: config.layernorm_epsilon (= the config's rms_norm_eps)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@contextmanager
def k_norm_eps(eps: float) -> Iterator[None]:
    """glmconv's indexer k-norm eps set to `eps` (no convention switch sets it: the reference's constant)."""
    import glmconv.ops.kpool as kp

    real = kp.K_NORM_EPS
    kp.K_NORM_EPS = eps
    try:
        yield
    finally:
        kp.K_NORM_EPS = real


def measure(hf: str, mc: str, tokens: int, sequences: int) -> dict[str, Any]:
    from glmconv.compare.inputs import random_batch
    from glmconv.io.config_file import load_config
    from glmconv.models.conventions import Conventions
    from glmconv.models.megatron import megatron_model
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights, MegatronWeights

    config = load_config(hf)
    batch = random_batch(config.dim("vocab_size"), tokens, sequences, 0)
    serve_conv = Conventions.serve()
    serve = GlmModel(config, HfWeights(hf), serve_conv)
    train_w = MegatronWeights(mc)
    mc_model = megatron_model(config, train_w, mc, serve_conv, torch.float32, "cpu")
    token = GlmModel(config, train_w, serve_conv.with_overrides(["indexer_kpool=off"]))
    out: dict[str, Any] = {"dsa": {}, "moe": {}}
    x = serve.embed(batch.ids)
    with torch.no_grad():
        for layer in range(config.num_layers):
            if config.attn_types[layer] == "dsa":
                out["dsa"][layer] = _dsa(layer, x, batch.cu_seqlens, serve, mc_model, token)
                out["dsa"][layer]["planted_rel"] = _planted_dsa(layer, x, batch.cu_seqlens, mc_model, config)
            x, _ = serve.attention(layer, x, batch.cu_seqlens)
            if config.mlp_types[layer] == "moe":
                out["moe"][layer] = _moe(layer, x, serve, mc_model, train_w, config)
            x, _ = serve.mlp(layer, x)
    return out


def _dsa(layer: int, x: torch.Tensor, cu: torch.Tensor, serve: Any, mc_model: Any, token: Any) -> dict[str, Any]:
    from megatron.core.transformer.experimental_attention_variant import dsa

    from glmconv.compare.metrics import selection_overlap
    from glmconv.models.megatron.model import spied

    seen: list[Any] = []
    with spied(dsa, "fused_qk_topk_naive", seen):
        y_m, aux_m = mc_model.attention(layer, x, cu)
    scores_m = seen[-1][0][0]  # [T, T]: -inf where not visible
    y_s, aux_s = serve.attention(layer, x, cu)
    visible = torch.isfinite(scores_m)
    found: dict[str, Any] = {"serve_rel": rel(y_m, y_s),
                             "serve_topk_overlap": selection_overlap(aux_m["topk"], aux_s["topk"])}
    for name, eps, query in (("token_eps_glmconv", None, "normed"), ("token_eps_megatron", EPS_MEGATRON, "normed"),
                             ("token_eps_megatron_raw_query", EPS_MEGATRON, "raw")):
        with k_norm_eps(eps) if eps is not None else nullcontext():
            scores_g = _token_scores(token, layer, x, cu, query)
            model = token.variant(token.conventions.with_overrides([f"indexer_query={query}"]))
            y_g, aux_g = model.attention(layer, x, cu)
            y_r, _ = model.attention(layer, x, cu, replay=aux_m["topk"])
        found[name] = {"score_max_abs": float((scores_g - scores_m).abs()[visible].max()),
                       "rel": rel(y_m, y_g), "replayed_rel": rel(y_m, y_r),
                       "topk_overlap": selection_overlap(aux_m["topk"], aux_g["topk"]),
                       "differs_only_at_ties": _ties_only(aux_m["topk"], aux_g["topk"], scores_m)}
    return found


def _planted_dsa(layer: int, x: torch.Tensor, cu: torch.Tensor, mc_model: Any, config: Any) -> dict[str, float]:
    """How far each of the catalog's DSA weight defects planted at this layer (the first DSA layer), in
    megatron-core's module, moves its output."""
    from glmconv.compare import defects
    from glmconv.compare.catalog import select

    y, _ = mc_model.attention(layer, x, cu)
    out = {}
    for defect in select("kv-heads-permuted,norm-offset,fp8-scale-block"):
        planted = defects.plant(defect, config, mc_model.conventions)
        if (layer, "attention") not in planted.sites:
            continue
        y_p, _ = mc_model.variant(patch=planted.patch).attention(layer, x, cu)
        out[defect.name] = rel(y_p, y)
    y_again, _ = mc_model.attention(layer, x, cu)
    out["restored"] = rel(y_again, y)
    return out


def _token_scores(model: Any, layer: int, x: torch.Tensor, cu: torch.Tensor, query: str) -> torch.Tensor:
    """glmconv's token-level indexer scores [T, T] of the layer's input (NaN where a query cannot see a token)."""
    import torch.nn.functional as F

    from glmconv.ops import rms_norm
    from glmconv.ops.kpool import selection_scores

    w = model._attention_weights(layer)
    _, _, collapsed = model._pre(w.hc, x, layer)
    a = rms_norm(collapsed, w.norm, model.eps)
    q_raw = F.linear(a, w.dsa.q_a)
    q = rms_norm(q_raw, w.dsa.q_a_norm, model.eps) if query == "normed" else q_raw
    everyone = torch.arange(x.shape[0]).expand(x.shape[0], -1)
    (scores,) = selection_scores(a, q, w.dsa.indexer, model._index_p, cu, everyone)
    return scores


def _ties_only(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> bool:
    """Each row's two selections differ only among tokens scored exactly the row's k-th best (a tie torch.topk
    breaks by position, differently for glmconv's and megatron-core's score layouts)."""
    for row in range(a.shape[0]):
        sa, sb = set(a[row].tolist()) - {-1}, set(b[row].tolist()) - {-1}
        if sa == sb:
            continue
        kth = scores[row, list(sa)].min()
        if not all(bool(scores[row, i] == kth) for i in sa ^ sb):
            return False
    return True


def _moe(layer: int, x: torch.Tensor, serve: Any, mc_model: Any, train_w: Any, config: Any) -> dict[str, Any]:
    from glmconv.models.conventions import Conventions
    from glmconv.models.model import GlmModel

    y_m, aux_m = mc_model.mlp(layer, x)
    y_s, aux_s = serve.mlp(layer, x)
    unclamped = GlmModel(config, train_w, Conventions.serve().with_overrides(["swiglu_clamp=off"]))
    y_u, _ = unclamped.mlp(layer, x)
    return {"serve_rel": rel(y_m, y_s), "experts_equal": bool(torch.equal(aux_m["experts"].sort(-1).values,
                                                                         aux_s["experts"].sort(-1).values)),
            "swiglu_clamp_off_rel": rel(y_m, y_u)}
