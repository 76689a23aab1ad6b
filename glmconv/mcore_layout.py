"""How a Megatron trainer shards each tensor of the plan, as `ShardedTensor.from_rank_offsets` requests.

The shard kind is data: a tensor's role (`glmconv.rules.roles`, `Mapping.rule.role`) says whether its module is
column-parallel, row-parallel or replicated (`SHARDING`); the mapping's transform says how the Megatron tensor is
packed (gate ++ up, or miles' q ++ k ++ v conv: each part is split across ranks on its own; experts stacked on a
leading axis: each rank takes its own experts). No Megatron name is matched here, so both layouts
(`glmconv.rules.layouts`) are served by the same table: in the mcore layout the three conv tensors are each
column-split (its transform is a rename), in the miles layout the packed conv is split per part. Tensors the
layout's trainer has no parameter for (`Mapping.homeless`) are not requested at all.

megatron-core's own modules (MLA, MLP, MoE, embedding, output, MTP eh_proj) are followed as their TE spec does
it (q/kv down projections are TELinear "duplicated"). KDA follows Megatron-Bridge's glm5_next bridge (q/k/v/b/
f_b/g_b projections, convs, A_log and dt_bias column-parallel; f_a/g_a and o_norm replicated; o_proj
row-parallel), the same in miles' plugin; the DSA indexer linears are TE `linear()` (duplicated: replicated).
Hyper-connections and vision are replicated. Whatever the choice, a torch_dist checkpoint of global tensors must
serve it: the load proofs (tests/runners/test_convert_mcore_load.py, benchmarks/multirank_roundtrip.py) request every
tensor this way. megatron-core is imported only when asked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from glmconv.plan import Mapping, Plan, TensorSpec
from glmconv.rules import roles as R
from glmconv.rules.ops import Concat, StackExperts

REPLICATED, COLUMN, ROW, DOWN_PROJ = "replicated", "column", "row", "down_proj"
EXPERT_COLUMN, EXPERT_ROW = "expert_column", "expert_row"

_COLUMN = (R.EMBED, R.LM_HEAD, *(R.KDA_PROJ[p] for p in ("q", "k", "v", "b", "f_b", "g_b")), R.KDA_CONV,
           R.KDA_A_LOG, R.KDA_DT_BIAS, R.DSA_Q_B, R.DSA_KV_B, R.DENSE_FC1, R.MOE_SHARED_FC1, R.MOE_EXPERTS_FC1,
           R.MTP_EH_PROJ)
_ROW = (R.KDA_PROJ["o"], R.DSA_O_PROJ, R.DENSE_FC2, R.MOE_SHARED_FC2, R.MOE_EXPERTS_FC2)
_DOWN_PROJ = (R.DSA_Q_A, R.DSA_KV_A)  # TE spec: duplicated TELinear; megatron's local spec: column-parallel
_REPLICATED = (R.FINAL_NORM, R.ATTN_NORM, R.MLP_NORM, *R.HC_FN, *R.HC_BASE, *R.HC_SCALE, R.KDA_PROJ["f_a"],
               R.KDA_PROJ["g_a"], R.KDA_O_NORM, R.DSA_Q_A_NORM, R.DSA_KV_A_NORM, R.INDEXER_WQ_B, R.INDEXER_WK,
               R.INDEXER_WEIGHTS_PROJ, R.INDEXER_K_NORM_WEIGHT, R.INDEXER_K_NORM_BIAS, R.INDEXER_COMPRESS_GATE,
               R.INDEXER_COMPRESS_APE, R.MOE_ROUTER, R.MOE_EXPERT_BIAS, R.MTP_ENORM, R.MTP_HNORM, R.MTP_FINAL_NORM,
               R.VISION_NORM, R.VISION_BIAS, R.VISION_MATRIX)
SHARDING: dict[str, str] = {**{r: COLUMN for r in _COLUMN}, **{r: ROW for r in _ROW},
                            **{r: DOWN_PROJ for r in _DOWN_PROJ}, **{r: REPLICATED for r in _REPLICATED}}
"""role -> how its module is tensor-parallel, in every layout (the transform says how the tensor is packed)."""


@dataclass(frozen=True)
class Sharding:
    """How one Megatron tensor is split: `kind` (replicated | column | row | expert_column | expert_row) and
    `parts`, the equal dim-0 blocks (dim 1 for experts) it packs, each split across the ranks on its own."""

    kind: str
    parts: int = 1

    @property
    def label(self) -> str:
        return self.kind if self.parts == 1 else f"{self.kind}/{self.parts}"


@dataclass(frozen=True)
class Ranks:
    """This process's place in a megatron layout (dense TP x DP; experts EP x ETP x expert-DP)."""

    tp: int = 1  # tensor-parallel size of the dense layers
    tp_rank: int = 0
    dp_rank: int = 0  # data-parallel rank (the dense layers' replicas)
    ep: int = 1  # expert-parallel size: each rank holds num_experts / ep experts
    ep_rank: int = 0
    etp: int = 1  # expert tensor-parallel size
    etp_rank: int = 0
    edp_rank: int = 0  # the experts' data-parallel rank


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


def sharding(mapping: Mapping, down_proj: str = "duplicated") -> Sharding | None:
    """How a trainer splits each Megatron tensor of `mapping`; None where it requests none (homeless).

    `down_proj`: "duplicated" (TE spec) or "column" (megatron-core's local spec) for the MLA down projections.
    """
    if mapping.homeless:
        return None
    rule = mapping.rule
    if rule.role not in SHARDING:
        raise KeyError(f"{mapping.key[0]}: role {rule.role!r} has no entry in glmconv.mcore_layout.SHARDING")
    kind = SHARDING[rule.role]
    if kind == DOWN_PROJ:
        kind = COLUMN if down_proj == "column" else REPLICATED
    if kind == REPLICATED:
        return Sharding(REPLICATED)
    t = rule.transform
    if rule.per_expert:
        if not isinstance(t, StackExperts) or (kind == ROW and t.parts != 1):
            raise ValueError(f"{mapping.key[0]}: experts are sharded as stacked by StackExperts, not {t!r}")
        return Sharding(EXPERT_COLUMN if kind == COLUMN else EXPERT_ROW, t.parts)
    parts = 1
    if isinstance(t, Concat) and len(mapping.mcore) == 1:  # packed: each HF tensor's rows split on their own
        parts = len(mapping.hf)
        if parts > 1 and (kind != COLUMN or t.dim != 0):
            raise ValueError(f"{mapping.key[0]}: a {kind} tensor packed by {t!r} has no known split")
    return Sharding(kind, parts)


def shard_pieces(spec: TensorSpec, mapping: Mapping, r: Ranks, down_proj: str = "duplicated") -> list[Piece]:
    """The local shard requests of this rank for `spec`, one Megatron tensor of `mapping` (none: homeless)."""
    how = sharding(mapping, down_proj)
    if how is None:
        return []
    name, shape, parts = spec.name, spec.shape, how.parts
    all_ = slice(None)
    if how.kind == REPLICATED:
        return [Piece(name, (), (), (0, r.tp_rank, r.dp_rank))]
    rep = (0, 0, r.dp_rank)
    if how.kind == ROW:
        n = shape[1] // r.tp
        return [Piece(name, (all_, slice(r.tp_rank * n, (r.tp_rank + 1) * n)), ((1, r.tp_rank, r.tp),), rep)]
    if how.kind == COLUMN:
        part, n = shape[0] // parts, shape[0] // parts // r.tp
        return [Piece(name, (slice(j * part + r.tp_rank * n, j * part + (r.tp_rank + 1) * n),),
                      ((0, j * r.tp + r.tp_rank, parts * r.tp),), rep) for j in range(parts)]
    experts = shape[0]
    local = experts // r.ep
    erep = (0, 0, r.edp_rank)
    pieces = []
    for e in range(r.ep_rank * local, (r.ep_rank + 1) * local):
        if how.kind == EXPERT_COLUMN:
            part, n = shape[1] // parts, shape[1] // parts // r.etp
            pieces += [Piece(name, (e, slice(j * part + r.etp_rank * n, j * part + (r.etp_rank + 1) * n)),
                             ((0, e, experts), (1, j * r.etp + r.etp_rank, parts * r.etp)), erep, prepend=1)
                       for j in range(parts)]
        else:
            n = shape[2] // r.etp
            pieces.append(Piece(name, (e, all_, slice(r.etp_rank * n, (r.etp_rank + 1) * n)),
                                ((0, e, experts), (2, r.etp_rank, r.etp)), erep, prepend=1))
    return pieces


def plan_pieces(plan: Plan, r: Ranks, down_proj: str = "duplicated") -> Iterator[tuple[TensorSpec, list[Piece]]]:
    """Every Megatron tensor a trainer of `plan`'s layout requests, with this rank's pieces of it (homeless
    tensors are left out: no trainer asks for them)."""
    for m in plan.mappings:
        for spec in m.mcore:
            pieces = shard_pieces(spec, m, r, down_proj)
            if pieces:
                yield spec, pieces


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
