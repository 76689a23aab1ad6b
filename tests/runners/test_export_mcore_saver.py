"""Export reads what megatron-core's OWN saver writes: TP=2 split chunks of MLP, SequentialMLP and router.

Two gloo processes on CPU build megatron-core modules (MLP with the SwiGLU fc1 factory, SequentialMLP,
TopKRouter) at TP=2, give them known weights and save them with `dist_checkpointing.save` under the plan's
keys. On CPU that save calls `torch.cuda.synchronize()` and `torch.cuda.current_device()`
(docs/torch_dist.md (e)): both are stubbed. Export then reads those mappings back and must give the HF
tensors the modules held: gate/up split, experts unstacked, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import mcore_helpers as mh

from glmconv.config import parse_config
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import TRACKER_NAME
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.plan import Mapping, Plan, build_plan
from glmconv.rules import names
from glmconv.rules.ops import Concat, StackExperts
from glmconv.runners.backward import export_mappings

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CONFIG = dict(
    model_type="glm5_next_text", vocab_size=256, hidden_size=16, num_hidden_layers=4, intermediate_size=24,
    moe_intermediate_size=6, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=16, index_head_dim=8,
    index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2, first_k_dense_replace=1,
    num_nextn_predict_layers=1, max_position_embeddings=4096,
)
DENSE, MOE, TP, ITERATION = 0, 1, 2, 7


def _plan() -> Plan:
    return build_plan(parse_config(dict(CONFIG)))


def _one(plan: Plan, layer: int, suffix: str) -> Mapping:
    """The mapping of `layer` whose (first) Megatron tensor ends with `suffix`."""
    head = names.mcore_layer(layer)
    (hit,) = [m for m in plan.mappings if m.mcore[0].name.startswith(head) and m.mcore[0].name.endswith(suffix)]
    return hit


def _saved(plan: Plan) -> dict[str, Mapping]:
    """What the modules hold: dense fc1 (+ its norm) and fc2, routed experts, router weight and bias, MoE norm."""
    picks = {"fc1": (DENSE, "mlp.linear_fc1.weight"), "norm": (DENSE, "mlp.linear_fc1.layer_norm_weight"),
             "fc2": (DENSE, "mlp.linear_fc2.weight"), "efc1": (MOE, "mlp.experts.experts.linear_fc1.weight"),
             "efc2": (MOE, "mlp.experts.experts.linear_fc2.weight"), "router": (MOE, "mlp.router.weight"),
             "bias": (MOE, "mlp.router.expert_bias"), "pre_norm": (MOE, "pre_mlp_layernorm.weight")}
    return {k: _one(plan, layer, suffix) for k, (layer, suffix) in picks.items()}


def _source(plan: Plan) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {k: torch.randn(m.mcore[0].shape, generator=g).to(torch_dtype(m.mcore[0].dtype))
            for k, m in _saved(plan).items()}


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value)


def _save_worker(rank: int, root: str, src_file: str) -> None:
    """Build megatron-core modules at TP=2, load this rank's slices of the source, save with megatron's saver."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # filesystem_async.py
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")  # state_dict_saver.py, router buffers
        src, m = torch.load(src_file), _saved(_plan())
        mh.init_parallel(tp=TP)
        tp = parallel_state.get_tensor_model_parallel_rank()
        t = CONFIG
        conf = mh.transformer_config(t["hidden_size"], t["intermediate_size"], t["moe_intermediate_size"],
                                     t["n_routed_experts"], t["num_attention_heads"])
        conf.moe_router_enable_expert_bias, conf.moe_router_score_function, conf.moe_router_topk = True, "sigmoid", 2
        mlp, experts = mh.dense_mlp(conf), mh.routed_experts(conf)
        router = TopKRouter(conf, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        _set(mlp.linear_fc1.weight, mh.swiglu_rows(src["fc1"], tp, TP))
        _set(mlp.linear_fc2.weight, mh.tp_rows(src["fc2"], tp, TP, dim=1))
        for e, expert in enumerate(experts.local_experts):
            _set(expert.linear_fc1.weight, mh.swiglu_rows(src["efc1"][e], tp, TP))
            _set(expert.linear_fc2.weight, mh.tp_rows(src["efc2"][e], tp, TP, dim=1))
        _set(router.weight, src["router"])
        _set(router.expert_bias, src["bias"])
        sd = mlp.sharded_state_dict(prefix=m["fc1"].mcore[0].name.removesuffix("linear_fc1.weight"))
        sd.update(experts.sharded_state_dict(prefix=m["efc1"].mcore[0].name.removesuffix("experts.linear_fc1.weight")))
        sd.update(router.sharded_state_dict(prefix=m["router"].mcore[0].name.removesuffix("weight")))
        for k in ("norm", "pre_norm"):
            sd[k] = make_sharded_tensor_for_checkpoint(src[k], m[k].mcore[0].name)
        sd["iteration"] = ITERATION  # not a sharded tensor: goes to the common state
        iter_dir = Path(root) / f"iter_{ITERATION:07d}"
        if rank == 0:
            iter_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(sd, str(iter_dir))
        if rank == 0:
            (Path(root) / TRACKER_NAME).write_text(str(ITERATION))  # what Megatron-LM's trainer writes last


@pytest.fixture(scope="module")
def megatron_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("mcore_saver")
    src = _source(_plan())
    torch.save(src, tmp / "src.pt")
    mh.spawn(_save_worker, str(tmp / "ckpt"), str(tmp / "src.pt"))
    return tmp / "ckpt", src


def test_megatron_saver_writes_tp_split_chunks(megatron_saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """The layout under test really is TP-split: fc1 in 4 row blocks (w/v per rank), fc2 in 2 column blocks."""
    root, _ = megatron_saved
    reader = DcpReader(root)
    m = _saved(_plan())
    assert reader.ckpt.iteration == str(ITERATION) and reader.iter_dir.name == f"iter_{ITERATION:07d}"
    chunks = {k: reader.chunks(m[k].mcore[0].name) for k in ("fc1", "fc2", "efc1", "efc2")}
    assert sorted(off[0] for off, _ in chunks["fc1"]) == [0, 12, 24, 36]
    assert sorted(off[1] for off, _ in chunks["fc2"]) == [0, 12]
    assert len(chunks["efc1"]) == 4 * 2 * TP and len(chunks["efc2"]) == 4 * TP
    assert sorted(reader.names()) == sorted(t.name for mp in m.values() for t in mp.mcore)


def test_export_of_megatron_saved_mappings_gives_the_modules_weights(
        megatron_saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, src = megatron_saved
    m = _saved(_plan())
    got = dict(export_mappings(DcpReader(root), list(m.values()), chunk_bytes=1))  # one expert at a time
    assert sorted(got) == sorted(t.name for mp in m.values() for t in mp.hf)
    assert isinstance(m["fc1"].rule.transform, Concat) and isinstance(m["efc1"].rule.transform, StackExperts)
    inter, experts = CONFIG["intermediate_size"], CONFIG["n_routed_experts"]
    gate, up = m["fc1"].hf
    mh.assert_same(gate.name, got[gate.name], src["fc1"][:inter])
    mh.assert_same(up.name, got[up.name], src["fc1"][inter:])
    moe = CONFIG["moe_intermediate_size"]
    for e in range(experts):
        mh.assert_same(m["efc1"].hf[e].name, got[m["efc1"].hf[e].name], src["efc1"][e][:moe])
        mh.assert_same(m["efc1"].hf[experts + e].name, got[m["efc1"].hf[experts + e].name], src["efc1"][e][moe:])
        mh.assert_same(m["efc2"].hf[e].name, got[m["efc2"].hf[e].name], src["efc2"][e])
    for k in ("fc2", "norm", "router", "bias", "pre_norm"):
        (spec,) = m[k].hf
        mh.assert_same(spec.name, got[spec.name], src[k])
    assert got[m["bias"].hf[0].name].dtype == torch.float32
