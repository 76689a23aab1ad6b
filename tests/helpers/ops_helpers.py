"""Shared helpers of the op and model tests: transformers' GLM-5.3 modules with fresh random weights."""

from __future__ import annotations

import math
from typing import Any

import torch

from glmconv.fixtures.configs import preset_config
from glmconv.ops.kpool import IndexerTensors, KpoolParams


def text_config(**overrides: Any) -> Any:
    """transformers' text config of the `tiny` preset (fp32, eager attention), with overrides."""
    from transformers import Glm5NextTextConfig

    raw = {**preset_config("tiny")["text_config"], **overrides}
    cfg = Glm5NextTextConfig(**raw)
    cfg._attn_implementation = "eager"
    return cfg


def _value(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return (torch.rand(shape, generator=g) * 15 + 1).log()
    if leaf == "dt_bias":
        dt = (torch.rand(shape, generator=g) * math.log(100) + math.log(1e-3)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if leaf in ("base", "index_kpool_compress_ape"):
        return torch.randn(shape, generator=g) * 0.5
    if leaf == "scale":
        return torch.rand(shape, generator=g) + 0.5
    if leaf == "fn":
        return torch.randn(shape, generator=g) * 0.02
    if leaf in ("bias", "e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.05
    if len(shape) == 1:  # norm weights
        return 1 + 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])  # fan-in (a conv [C, 1, W]: its width)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter and float buffer drawn afresh (never the zeros/ones of an init), fp32, eval mode."""
    g = torch.Generator().manual_seed(seed)
    module.float().eval()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_floating_point():
            t.copy_(_value(name, tuple(t.shape), g))
    return module


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error ||got - want|| / ||want|| in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def cu(*lengths: int) -> torch.Tensor:
    """cu_seqlens for packed sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)


def indexer_tensors(ix) -> IndexerTensors:  # type: ignore[no-untyped-def]
    """The weights of transformers' Glm5NextTextIndexer `ix` as glmconv's kpool indexer takes them."""
    return IndexerTensors(wq_b=ix.wq_b.weight, wk=ix.wk.weight, k_norm_weight=ix.k_norm.weight,
                          k_norm_bias=ix.k_norm.bias, weights_proj=ix.weights_proj.weight,
                          compress_gate=ix.index_kpool_compress_gate, compress_ape=ix.index_kpool_compress_ape)


def kpool_params(cfg) -> KpoolParams:  # type: ignore[no-untyped-def]
    """The kpool indexer's parameters of transformers' text config `cfg`."""
    return KpoolParams(cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_kpool,
                       cfg.index_kpool_always_select_tail)
