"""Issue 37's DSA finding at the release's dims, on a CPU host (the GPU runs measure it, this explains it):
real-cut4's layer-3 DSA attention as megatron-core's module (fp32, its torch path, loaded as the megatron backend
loads it) against glmconv's serve reference on the serve side's own stream into layer 3 (isolated), and the same
serve attention with megatron-core's selection replayed into it. If the replayed output equals megatron-core's to
fp32 noise, the whole divergence is which tokens the indexer picks (finding #1), nothing in the attention itself.

Usage: python benchmarks/megatron_real_dims.py HF_DIR MCORE_DIR LENGTH... (packed sequences; one longer than
index_topk, 2048, so that the two indexers can part)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main(hf: str, mc: str, lengths: list[int]) -> dict[str, Any]:
    from glmconv.compare.inputs import random_batch
    from glmconv.compare.metrics import selection_overlap
    from glmconv.io.config_file import load_config
    from glmconv.models.conventions import Conventions
    from glmconv.models.megatron import megatron_model
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights, MegatronWeights

    start = time.monotonic()
    config = load_config(hf)
    batch = random_batch(config.dim("vocab_size"), sum(lengths), len(lengths), 0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=batch.cu_seqlens.dtype)
    serve = GlmModel(config, HfWeights(hf), Conventions.serve())
    mc_model = megatron_model(config, MegatronWeights(mc), mc, Conventions.serve(), torch.float32, "cpu", stream=True)
    layer = next(i for i in range(config.num_layers) if config.attn_types[i] == "dsa")
    out: dict[str, Any] = {"layer": layer, "lengths": lengths, "index_topk": config.dim("index_topk")}
    with torch.no_grad():
        x = serve.embed(batch.ids)
        for i in range(layer):  # the serve side's stream into the first DSA layer
            x, _ = serve.attention(i, x, cu)
            x, _ = serve.mlp(i, x)
        y_m, aux_m = mc_model.attention(layer, x, cu)
        y_s, aux_s = serve.attention(layer, x, cu)
        y_r, _ = serve.attention(layer, x, cu, replay=aux_m["topk"])
    out.update(megatron_vs_serve=rel(y_m, y_s), topk_overlap=selection_overlap(aux_m["topk"], aux_s["topk"]),
               megatron_vs_serve_with_megatrons_selection=rel(y_m, y_r), seconds=round(time.monotonic() - start, 1))
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], [int(n) for n in sys.argv[3:]]), indent=2))
