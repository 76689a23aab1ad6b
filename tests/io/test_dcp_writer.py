"""The torch_dist writer: what it puts on disk, its refusals, and proof that megatron-core loads it.

The megatron tests spawn 2 gloo processes on CPU and load through megatron-core's own layers
(`MLP`, `SequentialMLP`) at TP=2 and at EP=2, comparing every local shard bit for bit.
"""

from __future__ import annotations

import fractions
import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import mcore_helpers as mh

from glmconv.config import GlmConfig, parse_config
from glmconv.errors import CheckpointError
from glmconv.io.dtypes import torch_dtype
from glmconv.io.file_names import (
    COMMON_PT_NAME,
    COMMON_STATE_KEY,
    DCP_METADATA_NAME,
    MCORE_METADATA_NAME,
    RELEASE,
    TRACKER_NAME,
)
from glmconv.io.torch_dist.common_state import load_common_state, read_common_state
from glmconv.io.torch_dist.reader import read_metadata
from glmconv.io.torch_dist.writer import BACKEND_CONFIG, Chunk, DcpWriter, empty_extra_state, stacked_chunks
from glmconv.megatron_args import build_common_state
from glmconv.plan import Plan, build_plan
from glmconv.rules import names
from glmconv.rules.names import sharded_object_key

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = dict(
    model_type="glm5_next_text", vocab_size=256, hidden_size=16, num_hidden_layers=4, intermediate_size=24,
    moe_intermediate_size=6, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=8, q_lora_rank=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=16, index_head_dim=8,
    index_n_heads=2, index_kpool=4, linear_head_dim=8, linear_num_heads=2, hc_mult=2, first_k_dense_replace=1,
    num_nextn_predict_layers=1, max_position_embeddings=4096,
)
DENSE_LAYER, MOE_LAYER = 0, 1


def _tiny() -> tuple[GlmConfig, Plan]:
    cfg = parse_config(dict(TINY))
    return cfg, build_plan(cfg)


def _source(plan: Plan, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype)) for n, s in plan.mcore_index.items()}


def _stacked(plan: Plan, name: str) -> bool:
    return plan.mapping_of_mcore[name].rule.per_expert


def _chunks(plan: Plan, src: dict[str, torch.Tensor], names_: list[str], per: int = 1) -> Iterator[Chunk]:
    """Whole tensors, except stacked experts, which come `per` experts at a time (never whole)."""
    for name in names_:
        t = src[name]
        if not _stacked(plan, name):
            yield Chunk(name, t)
            continue
        yield from stacked_chunks(name, tuple(t.shape), (expert.clone() for expert in t), per=per)


def _named(plan: Plan, layer: int, suffix: str) -> str:
    head = names.mcore_layer(layer)
    (hit,) = [n for n in plan.mcore_index if n.startswith(head) and n.endswith(suffix)]
    return hit


def _linears(plan: Plan) -> dict[str, str]:
    """The four linear weights the megatron tests load through real layers."""
    return {"fc1": _named(plan, DENSE_LAYER, ".mlp.linear_fc1.weight"),
            "fc2": _named(plan, DENSE_LAYER, ".mlp.linear_fc2.weight"),
            "efc1": _named(plan, MOE_LAYER, ".mlp.experts.experts.linear_fc1.weight"),
            "efc2": _named(plan, MOE_LAYER, ".mlp.experts.experts.linear_fc2.weight")}


def _extra_states(plan: Plan, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`_extra_state` ShardedObjects of those layers, keyed as megatron keys them (per expert for experts)."""
    out = {}
    for weight in _linears(plan).values():
        module = weight.removesuffix("weight") + "_extra_state"
        if _stacked(plan, weight):
            experts = src[weight].shape[0]
            out.update({sharded_object_key(module, (e,), (experts,)): empty_extra_state() for e in range(experts)})
        else:
            out[sharded_object_key(module)] = empty_extra_state()
    return out


def _write_all(root: Path, *, extra: bool = True, group_bytes: int = 2048,
               per: int = 1) -> tuple[Path, dict[str, torch.Tensor]]:
    cfg, plan = _tiny()
    src = _source(plan)
    w = DcpWriter(root, specs=plan.mcore_index)
    w.write_stream(_chunks(plan, src, list(plan.mcore_index), per=per), group_bytes=group_bytes)
    if extra:
        w.write_objects(_extra_states(plan, src))
    return w.finish(build_common_state(cfg)), src


def _dcp_load_all(ckpt: Path, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: torch.empty_like(t) for n, t in src.items()}
    dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    return out


# ---- format and contracts, single process ----

def test_common_state_carries_the_model_args() -> None:
    cfg, _ = _tiny()
    state = build_common_state(cfg)
    args = state["args"]
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 0 and "content_metadata" not in state
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (4, 16, 24, 2)
    assert (args.num_experts, args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size) == (4, 6, 6)
    assert (args.moe_router_topk, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim) == (2, 8, 8, 8)
    assert (args.qk_pos_emb_head_dim, args.v_head_dim, args.padded_vocab_size, args.mtp_num_layers) == (0, 8, 256, 1)
    assert args.moe_layer_freq == [0, 1, 1, 1]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)


def test_layout_on_disk_and_tracker_written_last(tmp_path: Path) -> None:
    cfg, plan = _tiny()
    src = _source(plan)
    w = DcpWriter(tmp_path, specs=plan.mcore_index)
    w.write_stream(_chunks(plan, src, list(plan.mcore_index)), group_bytes=4096)
    ckpt = tmp_path / RELEASE
    assert {p.name for p in ckpt.iterdir()} == {f"__0_{i}.distcp" for i in range(w.groups_written)}
    assert not (tmp_path / TRACKER_NAME).exists() and not (ckpt / MCORE_METADATA_NAME).exists()
    w.finish(build_common_state(cfg))
    assert (tmp_path / TRACKER_NAME).read_text() == RELEASE
    assert json.loads((ckpt / MCORE_METADATA_NAME).read_text()) == BACKEND_CONFIG
    md = read_metadata(ckpt)
    assert set(md.state_dict_metadata) == set(plan.mcore_index) | {COMMON_STATE_KEY}
    assert read_common_state(ckpt)["args"].num_layers == cfg.num_layers
    assert (tmp_path / TRACKER_NAME).stat().st_mtime_ns >= (ckpt / DCP_METADATA_NAME).stat().st_mtime_ns


def test_chunked_groups_load_the_same_as_whole_tensors(tmp_path: Path) -> None:
    cfg, plan = _tiny()
    src = _source(plan)
    whole = DcpWriter(tmp_path / "whole")
    for name, t in src.items():
        whole.write({name: t})
    whole.finish(build_common_state(cfg))
    chunked, _ = _write_all(tmp_path / "chunked", group_bytes=512, per=3)  # 4 experts: chunks of 3 and 1
    a, b = _dcp_load_all(tmp_path / "whole" / RELEASE, src), _dcp_load_all(chunked, src)
    for name, t in src.items():
        mh.assert_same(name, a[name], t)
        mh.assert_same(name, b[name], t)
    efc1 = _linears(plan)["efc1"]
    assert [c.sizes[0] for c in read_metadata(chunked).state_dict_metadata[efc1].chunks] == [1, 1, 1, 1]  # a row each
    assert len(read_metadata(tmp_path / "whole" / RELEASE).state_dict_metadata[efc1].chunks) == 1


def test_stream_holds_one_group_at_a_time(tmp_path: Path) -> None:
    """After a group is flushed the writer keeps no reference to its tensors."""
    alive: list[weakref.ref[torch.Tensor]] = []

    def pieces() -> Iterator[Chunk]:
        for i in range(12):
            t = torch.full((4, 8), float(i))  # 128 bytes
            alive.append(weakref.ref(t))
            gc.collect()
            assert sum(r() is not None for r in alive) <= 3, "more than one group + one chunk alive"
            yield Chunk("stack", t, row=4 * i, shape=(48, 8))
            del t

    w = DcpWriter(tmp_path)
    assert w.write_stream(pieces(), group_bytes=256) == 6
    w.finish({"iteration": 0})
    got = {"stack": torch.empty(48, 8)}
    dcp.load(got, checkpoint_id=str(tmp_path / RELEASE), no_dist=True)
    assert torch.equal(got["stack"], torch.arange(12.0).repeat_interleave(4)[:, None].expand(48, 8))


def test_refusals_leave_nothing_published(tmp_path: Path) -> None:
    cfg, plan = _tiny()
    src = _source(plan)
    efc1 = _linears(plan)["efc1"]
    rest = [n for n in src if n != efc1]
    w = DcpWriter(tmp_path / "a", specs=plan.mcore_index)
    with pytest.raises(CheckpointError, match="does not fit"):
        w.write_chunks([Chunk(efc1, src[efc1][:1, :3], row=0, shape=tuple(src[efc1].shape))])
    with pytest.raises(CheckpointError, match="the plan says"):
        w.write({efc1: src[efc1].float()})
    with pytest.raises(CheckpointError, match="not a tensor of the plan"):
        w.write({"decoder.layers.0.bogus.weight": torch.zeros(1)})
    w.write_stream(_chunks(plan, src, list(src)), group_bytes=4096)
    with pytest.raises(CheckpointError, match="does not fit"):  # a failed write is never forgotten
        w.finish(build_common_state(cfg))
    w = DcpWriter(tmp_path / "b", specs=plan.mcore_index)
    w.write_stream(_chunks(plan, src, rest), group_bytes=4096)
    with pytest.raises(CheckpointError, match="a group holds the same chunk twice"):  # rows 0-1 and 1-3: row 1
        w.write_chunks([Chunk(efc1, src[efc1][:2], row=0, shape=tuple(src[efc1].shape)),
                        Chunk(efc1, src[efc1][1:], row=1, shape=tuple(src[efc1].shape))])
    w = DcpWriter(tmp_path / "d", specs=plan.mcore_index)
    w.write_stream(_chunks(plan, src, rest), group_bytes=4096)
    w.write_chunks([Chunk(efc1, src[efc1][:2], row=0, shape=tuple(src[efc1].shape))])  # in two groups
    with pytest.raises(CheckpointError, match=rf"{efc1}: chunk at \[1, 0, 0\] written twice"):
        w.write_chunks([Chunk(efc1, src[efc1][1:], row=1, shape=tuple(src[efc1].shape))])
    w = DcpWriter(tmp_path / "c", specs=plan.mcore_index)
    w.write_stream(_chunks(plan, src, rest), group_bytes=4096)
    with pytest.raises(CheckpointError, match="1 planned tensors were never written"):
        w.finish(build_common_state(cfg))
    for d in "abcd":
        assert not (tmp_path / d / TRACKER_NAME).exists()
        assert not (tmp_path / d / RELEASE / MCORE_METADATA_NAME).exists()
        assert not (tmp_path / d / RELEASE / DCP_METADATA_NAME).exists()
    with pytest.raises(CheckpointError, match="not empty"):
        DcpWriter(tmp_path / "c")


def test_refuses_to_overwrite_a_published_checkpoint(tmp_path: Path) -> None:
    w = DcpWriter(tmp_path)
    w.write({"x": torch.zeros(2)})
    ckpt = w.finish({"iteration": 0})
    with pytest.raises(CheckpointError, match="already called"):
        w.finish({"iteration": 0})
    with pytest.raises(CheckpointError, match="already finished"):
        w.write({"y": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="already holds a published checkpoint"):
        DcpWriter(tmp_path)
    assert (tmp_path / TRACKER_NAME).read_text() == RELEASE and ckpt.is_dir()


def test_common_state_reader_allows_only_the_allow_list(tmp_path: Path) -> None:
    w = DcpWriter(tmp_path)
    w.finish({"args": fractions.Fraction(1, 3), "iteration": 0})
    with pytest.raises(CheckpointError, match=r"disallowed global fractions\.Fraction; refusing") as err:
        read_common_state(tmp_path / RELEASE)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="not a readable torch archive"):
        load_common_state(b"not a torch file", source="x")
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save({"args": build_common_state(_tiny()[0])["args"], "iteration": 7}, legacy / COMMON_PT_NAME)
    assert read_common_state(legacy)["iteration"] == 7


# ---- megatron-core loads it: 2 gloo processes on CPU ----

def _write_share(rank: int, root: str, src: dict[str, torch.Tensor]) -> None:
    """Rank 0 writes the whole tensors, rank 1 the stacked experts 2 at a time and the extra states."""
    cfg, plan = _tiny()
    w = DcpWriter(root, specs=plan.mcore_index, group=dist.group.WORLD)
    mine = [n for n in src if _stacked(plan, n) == (rank == 1)]
    w.write_stream(_chunks(plan, src, mine, per=2), group_bytes=1024)
    if rank == 1:
        w.write_objects(_extra_states(plan, src))
    w.finish(build_common_state(cfg) if w.is_coordinator else None)


def _check_load(rank: int, ckpt: str, src: dict[str, torch.Tensor], tp: int, ep: int) -> None:
    """Load through megatron-core's layers at (tp, ep) and compare every local shard with the source."""
    from megatron.core import dist_checkpointing, parallel_state

    cfg, plan = _tiny()
    lin, t = _linears(plan), cfg.text
    mh.init_parallel(tp=tp, ep=ep)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    conf = mh.transformer_config(t["hidden_size"], t["intermediate_size"], t["moe_intermediate_size"],
                                 t["n_routed_experts"], t["num_attention_heads"])
    mlp = mh.dense_mlp(conf)
    mh.load_into(mlp, lin["fc1"].removesuffix("linear_fc1.weight"), ckpt)
    mh.assert_same("fc1", mlp.linear_fc1.weight.data, mh.swiglu_rows(src[lin["fc1"]], tp_rank, tp))
    mh.assert_same("fc2", mlp.linear_fc2.weight.data, mh.tp_rows(src[lin["fc2"]], tp_rank, tp, dim=1))
    experts = mh.routed_experts(conf)
    mh.load_into(experts, lin["efc1"].removesuffix("experts.linear_fc1.weight"), ckpt)
    for i, expert in enumerate(experts.local_experts):
        e = ep_rank * len(experts.local_experts) + i
        mh.assert_same(f"expert {e} fc1", expert.linear_fc1.weight.data,
                       mh.swiglu_rows(src[lin["efc1"]][e], tp_rank, tp))
        mh.assert_same(f"expert {e} fc2", expert.linear_fc2.weight.data,
                       mh.tp_rows(src[lin["efc2"]][e], tp_rank, tp, dim=1))
    slab = _slab_request(lin["efc2"], src[lin["efc2"]], rank)  # one request spanning several stored chunks
    mh.assert_same("expert slab", mh.load({"slab": slab}, ckpt)["slab"], src[lin["efc2"]].chunk(2)[rank])
    replicated = [_named(plan, MOE_LAYER, s) for s in ("pre_mlp_layernorm.weight", "router.expert_bias", "A_log")]
    loaded = mh.load({n: mh.replicated(n, src[n]) for n in replicated}, ckpt)
    for n in replicated:  # BF16 norm, F32 expert bias and A_log
        mh.assert_same(n, loaded[n], src[n])
    if rank == 0:
        assert dist_checkpointing.load_common_state_dict(ckpt)["args"].num_layers == cfg.num_layers


def _slab_request(key: str, like: torch.Tensor, rank: int) -> object:
    from megatron.core.dist_checkpointing import ShardedTensor

    local = torch.empty_like(like.chunk(2)[rank])
    return ShardedTensor.from_rank_offsets(key, local, (0, rank, 2), replica_id=0)


def _tp2_worker(rank: int, root: str, src_file: str) -> None:
    src = torch.load(src_file)
    _write_share(rank, root, src)
    _check_load(rank, str(Path(root) / RELEASE), src, tp=2, ep=1)


def _ep2_worker(rank: int, ckpt: str, no_extra: str, src_file: str) -> None:
    src = torch.load(src_file)
    _check_load(rank, ckpt, src, tp=1, ep=2)
    conf = mh.transformer_config(16, 24, 6, 4, 2)
    mlp = mh.dense_mlp(conf)
    prefix = _linears(_tiny()[1])["fc1"].removesuffix("linear_fc1.weight")
    try:  # DCP raises CheckpointException, a BaseException
        mh.load(mlp.sharded_state_dict(prefix=prefix), no_extra)
    except BaseException as exc:  # noqa: B036
        assert "Missing key in checkpoint state_dict" in str(exc) and "_extra_state/shard_0_1" in str(exc), exc
    else:
        raise AssertionError("megatron-core loaded layers whose _extra_state the checkpoint lacks")


def test_megatron_loads_a_two_process_write_at_tp2(tmp_path: Path) -> None:
    _, plan = _tiny()
    torch.save(_source(plan), tmp_path / "src.pt")
    mh.spawn(_tp2_worker, str(tmp_path / "out"), str(tmp_path / "src.pt"))
    md = read_metadata(tmp_path / "out" / RELEASE)
    files = {info.relative_path for info in md.storage_data.values()}
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)


def test_megatron_loads_chunked_experts_at_ep2_and_needs_extra_states(tmp_path: Path) -> None:
    ckpt, src = _write_all(tmp_path / "full", group_bytes=300)
    no_extra, _ = _write_all(tmp_path / "no_extra", extra=False)
    torch.save(src, tmp_path / "src.pt")
    mh.spawn(_ep2_worker, str(ckpt), str(no_extra), str(tmp_path / "src.pt"))


# ---- stacked tensors are stored an expert a chunk --------------------------------------------------------------

def _stacked_rows_written(tmp_path: Path, tensor: torch.Tensor | object) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    from glmconv.io.torch_dist.reader import DcpReader
    from glmconv.io.torch_dist.writer import Chunk, DcpWriter

    writer = DcpWriter(tmp_path / "ck")
    writer.write_chunks([Chunk("experts", tensor, 2, (6, 3))])  # rows 2..5 of a (6, 3) stacked tensor, in one
    writer.write_chunks([Chunk("experts", torch.zeros(2, 3, dtype=torch.bfloat16), 0, (6, 3))])
    writer.finish({"iteration": 0})
    reader = DcpReader(tmp_path / "ck")
    return [offsets for offsets, _ in sorted(reader.chunks("experts"))], reader.read("experts", (2, 6))


def test_a_chunk_of_stacked_rows_is_stored_a_row_each(tmp_path: Path) -> None:
    """Megatron's own saves store each expert apart, and torch's reader loads a whole stored chunk per expert a
    trainer requests: a chunk of 4 experts would be read 4 times."""
    rows = torch.arange(12, dtype=torch.bfloat16).view(4, 3)
    offsets, back = _stacked_rows_written(tmp_path, rows)
    assert offsets == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert torch.equal(back, rows)


def test_a_file_tensor_of_stacked_rows_is_stored_a_row_each_from_the_same_bytes(tmp_path: Path) -> None:
    from glmconv.io.byte_copy import Extent
    from glmconv.io.torch_dist.torch_save import FileTensor

    rows = torch.arange(12, dtype=torch.bfloat16).view(4, 3)
    src = tmp_path / "src.bin"
    raw = rows.view(torch.uint8).numpy().tobytes()
    src.write_bytes(b"head" + raw[:10] + b"gap" + raw[10:])  # two extents, split inside row 1
    tensor = FileTensor(rows.shape, rows.dtype, (Extent(str(src), 4, 10), Extent(str(src), 17, len(raw) - 10)))
    assert torch.equal(tensor.rows(1, 3).materialize(), rows[1:3])
    offsets, back = _stacked_rows_written(tmp_path, tensor)
    assert offsets == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert torch.equal(back, rows)


def test_a_stacked_chunks_rows_are_saved_over_their_own_bytes_without_a_copy() -> None:
    """Each expert of a stacked chunk is stored alone (as Megatron stores it); torch.save writes a view's whole
    storage, so each row gets a storage of exactly its bytes, sharing them: the archive a copy would give, no copy."""
    import io

    from glmconv.io.torch_dist.writer import Chunk

    stacked = torch.randn(3, 4, 6).to(torch.bfloat16)
    rows = Chunk("experts", stacked, row=3, shape=(6, 4, 6)).per_row()
    assert [(r.row, tuple(r.tensor.shape)) for r in rows] == [(3, (1, 4, 6)), (4, (1, 4, 6)), (5, (1, 4, 6))]
    for i, r in enumerate(rows):
        assert r.tensor.data_ptr() == stacked[i].data_ptr()  # the chunk's own memory
        assert r.tensor.untyped_storage().nbytes() == 4 * 6 * 2  # nothing of the other rows
        saved, copied = io.BytesIO(), io.BytesIO()
        torch.save(r.tensor, saved)
        torch.save(stacked[i:i + 1].clone(), copied)
        assert saved.getvalue() == copied.getvalue()
