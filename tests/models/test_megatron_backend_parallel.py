"""`--train-backend megatron` at TP 2 and EP 2: the sharded load and the parallel forward equal TP 1's.

One group of 2 gloo processes on CPU runs three phases, megatron-core's parallel state re-initialised for each:
TP 1 (data parallel: each rank the whole model), TP 2 (sequence parallel, as AbsorbedMLASelfAttention requires at
TP > 1: each rank holds half the tokens and half of every column/row-parallel weight) and EP 2 (each rank 4 of
the 8 experts). Each phase loads megatron-core's modules from the converted `tiny` (mcore layout) through
`dist_checkpointing.load` and runs every sub-block of the megatron backend on the serve side's streams (two packed
sequences longer than index_topk); the outputs and the selections must equal TP 1's within fp32 noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import mcore_helpers as mh

pytestmark = pytest.mark.filterwarnings("ignore")
PHASES = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}
TOKENS, SEQUENCES = 48, 2


def _worker(rank: int, hf: str, mc: str, out: str) -> None:
    from megatron.core import parallel_state

    from glmconv.compare.inputs import random_batch
    from glmconv.io.config_file import load_config
    from glmconv.models.conventions import Conventions
    from glmconv.models.megatron import megatron_model
    from glmconv.models.model import GlmModel
    from glmconv.models.weights import HfWeights, MegatronWeights

    config = load_config(hf)
    batch = random_batch(config.dim("vocab_size"), TOKENS, SEQUENCES, 0)
    serve = GlmModel(config, HfWeights(hf), Conventions.serve())
    results: dict[str, Any] = {}
    for phase, (tp, ep) in PHASES.items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        mh.init_parallel(tp=tp, ep=ep)
        train = megatron_model(config, MegatronWeights(mc), mc, Conventions.serve(), torch.float32, "cpu")
        shapes = {p: {k: tuple(v.shape) for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
                  for p, m in train.modules.prefixed().items()}
        x, outs = serve.embed(batch.ids), []
        with torch.no_grad():
            for layer in range(config.num_layers):
                y, aux = train.attention(layer, x, batch.cu_seqlens)
                outs.append((train.impl(layer, "attention"), y, aux))
                x, _ = serve.attention(layer, x, batch.cu_seqlens)
                y, aux = train.mlp(layer, x)
                outs.append((train.impl(layer, "mlp"), y, aux))
                x, _ = serve.mlp(layer, x)
        results[phase] = {"outs": outs, "shapes": shapes}
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def phases(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from glmconv.runners.convert import RunOptions, convert, prepare

    root = tmp_path_factory.mktemp("parallel")
    convert(prepare(tiny_ckpt, root / "mc", layout="mcore"), RunOptions(progress=False))
    mh.spawn(_worker, str(tiny_ckpt), str(root / "mc"), str(root / "out"))
    return [torch.load(root / f"out.{rank}", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("phase", ["tp2", "ep2"])
def test_parallel_records_equal_tp1(phase: str, phases: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(phases):
        ran = 0
        for (impl, y1, aux1), (impl_p, yp, auxp) in zip(res["tp1"]["outs"], res[phase]["outs"]):
            assert impl == impl_p
            if impl == "glmconv":
                continue
            ran += 1
            rel = float((yp - y1).norm() / y1.norm())
            assert rel < 1e-6, (phase, rank, impl, rel)
            assert set(aux1) == set(auxp) and all(torch.equal(aux1[k], auxp[k]) for k in aux1), (phase, rank, impl)
        assert ran == 3  # tiny: one DSA attention, two MoE layers


def test_the_loads_were_sharded(phases: list[dict[str, Any]]) -> None:
    """TP 2: each rank holds half of a column-parallel weight; EP 2: half of the experts."""
    for res in phases:
        tp1, tp2, ep2 = (res[p]["shapes"] for p in PHASES)
        att = next(p for p in tp1 if "self_attention" in p)
        moe = next(p for p in tp1 if p.endswith("mlp."))
        q_up = "linear_q_up_proj.weight"
        assert tp2[att][q_up][0] * 2 == tp1[att][q_up][0]
        experts = [k for k in tp1[moe] if k.startswith("experts.local_experts.") and k.endswith("linear_fc1.weight")]
        assert experts and len([k for k in ep2[moe] if k in experts]) * 2 == len(experts)
