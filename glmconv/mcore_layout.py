"""How a Megatron trainer shards each tensor of the plan, as `ShardedTensor.from_rank_offsets` requests.

megatron-core's own modules (MLA, MLP, MoE, embedding, output, MTP eh_proj) are followed as their TE spec does
it (q/kv down projections are TELinear "duplicated"); for modules megatron-core does not have (KDA, the DSA
indexer, hyper-connections, vision) the usual column-in / row-out convention is assumed. Whatever the choice,
a torch_dist checkpoint of global tensors must serve it: the load proofs (tests/test_convert_mcore_load.py,
benchmarks/multirank_roundtrip.py) request every tensor this way. megatron-core is imported only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

COLUMN_SUFFIXES = (".linear_q_up_proj.weight", ".linear_kv_up_proj.weight", ".eh_proj.weight", ".kda.A_log",
                   ".kda.dt_bias", *(f".kda.{p}_proj.weight" for p in ("q", "k", "v", "b", "f_b", "g_b")))
ROW_SUFFIXES = (".linear_proj.weight", ".kda.o_proj.weight", ".mlp.linear_fc2.weight",
                ".shared_experts.linear_fc2.weight")
SWIGLU_SUFFIXES = (".mlp.linear_fc1.weight", ".shared_experts.linear_fc1.weight")
DOWN_PROJ_SUFFIXES = (".linear_q_down_proj.weight", ".linear_kv_down_proj.weight")
EXPERT_FC1, EXPERT_FC2 = ".experts.experts.linear_fc1.weight", ".experts.experts.linear_fc2.weight"
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class Ranks:
    """This process's place in a megatron layout (dense TP x DP; experts EP x ETP x expert-DP)."""

    tp: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0
    edp_rank: int = 0


def ranks_from_parallel_state() -> Ranks:
    from megatron.core import parallel_state as ps

    return Ranks(tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                 dp_rank=ps.get_data_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
                 ep_rank=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_world_size(),
                 etp_rank=ps.get_expert_tensor_parallel_rank(), edp_rank=ps.get_expert_data_parallel_rank())


@dataclass(frozen=True)
class Piece:
    """One local shard request: `index` into the global tensor is the data this rank must get."""

    key: str
    index: tuple[Any, ...]
    rank_offsets: tuple[tuple[int, int, int], ...]
    replica_id: tuple[int, ...]
    prepend: int = 0

    def request(self, global_shape: tuple[int, ...], dtype: torch.dtype, data: torch.Tensor | None = None,
                device: str = "cpu") -> Any:
        """The ShardedTensor to load into (an empty local tensor) or, given `data`, to save."""
        from megatron.core.dist_checkpointing import ShardedTensor

        local = torch.empty(global_shape, device="meta")[self.index].shape
        if data is None:
            data = torch.empty(local, dtype=dtype, device=device)
        return ShardedTensor.from_rank_offsets(self.key, data, *self.rank_offsets,
                                               replica_id=self.replica_id, prepend_axis_num=self.prepend)


def tp_layout(name: str, down_proj: str = "duplicated") -> str:
    """replicated | column | row | swiglu | conv3 | expert_fc1 | expert_fc2, as a trainer shards `name`."""
    if name.endswith(EXPERT_FC1):
        return "expert_fc1"
    if name.endswith(EXPERT_FC2):
        return "expert_fc2"
    if name.endswith(SWIGLU_SUFFIXES):
        return "swiglu"
    if name.endswith(".kda.conv1d.weight"):
        return "conv3"
    if name in VOCAB_PARALLEL or name.endswith(COLUMN_SUFFIXES):
        return "column"
    if name.endswith(DOWN_PROJ_SUFFIXES):
        return "column" if down_proj == "column" else "replicated"
    if name.endswith(ROW_SUFFIXES):
        return "row"
    return "replicated"


def shard_pieces(name: str, shape: tuple[int, ...], r: Ranks, down_proj: str = "duplicated") -> list[Piece]:
    """The local shard requests of this rank for the global tensor `name` of `shape`."""
    kind = tp_layout(name, down_proj)
    all_ = slice(None)
    if kind == "replicated":
        return [Piece(name, (), (), (0, r.tp_rank, r.dp_rank))]
    rep = (0, 0, r.dp_rank)
    if kind == "column":
        n = shape[0] // r.tp
        return [Piece(name, (slice(r.tp_rank * n, (r.tp_rank + 1) * n),), ((0, r.tp_rank, r.tp),), rep)]
    if kind == "row":
        n = shape[1] // r.tp
        return [Piece(name, (all_, slice(r.tp_rank * n, (r.tp_rank + 1) * n)), ((1, r.tp_rank, r.tp),), rep)]
    if kind in ("swiglu", "conv3"):
        parts = 2 if kind == "swiglu" else 3
        part, n = shape[0] // parts, shape[0] // parts // r.tp
        return [Piece(name, (slice(j * part + r.tp_rank * n, j * part + (r.tp_rank + 1) * n),),
                      ((0, j * r.tp + r.tp_rank, parts * r.tp),), rep) for j in range(parts)]
    experts = shape[0]
    local = experts // r.ep
    erep = (0, 0, r.edp_rank)
    pieces = []
    for e in range(r.ep_rank * local, (r.ep_rank + 1) * local):
        if kind == "expert_fc1":
            half, n = shape[1] // 2, shape[1] // 2 // r.etp
            pieces += [Piece(name, (e, slice(j * half + r.etp_rank * n, j * half + (r.etp_rank + 1) * n)),
                             ((0, e, experts), (1, j * r.etp + r.etp_rank, 2 * r.etp)), erep, prepend=1)
                       for j in range(2)]
        else:
            n = shape[2] // r.etp
            pieces.append(Piece(name, (e, all_, slice(r.etp_rank * n, (r.etp_rank + 1) * n)),
                                ((0, e, experts), (2, r.etp_rank, r.etp)), erep, prepend=1))
    return pieces


def parse_object_key(unique_key: str) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """`X._extra_state/shard_0_1` -> (key, global_offset, global_shape), the inverse of ShardedObject.unique_key."""
    key, shard = unique_key.rsplit("/", 1)
    offset, shape = shard.removeprefix("shard_").split("_")
    return key, tuple(int(x) for x in offset.split(".")), tuple(int(x) for x in shape.split("."))


def object_request(unique_key: str, r: Ranks) -> Any | None:
    """The ShardedObject this rank asks for (experts: only its own experts), or None."""
    from megatron.core.dist_checkpointing import ShardedObject

    key, offset, shape = parse_object_key(unique_key)
    if shape == (1,):
        return ShardedObject(key, None, shape, offset, replica_id=(0, r.tp_rank, r.dp_rank))
    local = shape[0] // r.ep
    if not r.ep_rank * local <= offset[0] < (r.ep_rank + 1) * local:
        return None
    return ShardedObject(key, None, shape, offset, replica_id=(0, r.etp_rank, r.edp_rank))
