"""Shared helpers for tests that load checkpoints through megatron-core on CPU.

Workers are spawned processes in a gloo group (megatron's `dist_checkpointing.load` works on CPU; its
save and its fully-parallel load wrapper need CUDA). Sharded state dicts come from megatron-core's own
layers (`MLP`, `SequentialMLP`) and helpers, so the layouts tested are the ones a trainer requests.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glmconv.mcore_layout import (  # noqa: F401 (the tests' names for them)
    Piece,
    Ranks,
    Sharding,
    object_request,
    parse_object_key,
    plan_pieces,
    ranks_from_parallel_state,
    shard_pieces,
    sharding,
)


def free_port() -> int:
    """A TCP port nobody listens on right now (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Callable[..., None], *args: Any, nprocs: int = 2) -> None:
    """Run `fn(rank, *args)` in `nprocs` fresh processes of one gloo group; a worker's exception fails the caller."""
    mp.spawn(_worker, args=(fn, nprocs, free_port(), args), nprocs=nprocs, join=True)


def _worker(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        _teardown()


def _teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def init_parallel(tp: int = 1, ep: int = 1) -> None:
    """megatron-core's parallel_state on the gloo world (works on CPU for TP and EP)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def transformer_config(hidden: int, ffn: int, moe_ffn: int, experts: int, heads: int,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
    """A CPU-initialised TransformerConfig for gated (SwiGLU) MLPs without biases, like GLM's."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_ffn_hidden_size=moe_ffn, gated_linear_unit=True, add_bias_linear=False,
        use_cpu_initialization=True, perform_initialization=False, params_dtype=dtype,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())


def dense_mlp(config: Any) -> Any:
    """megatron-core's MLP with column-parallel fc1 (SwiGLU factory) and row-parallel fc2."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return MLP(config, sub, ffn_hidden_size=config.ffn_hidden_size)


def routed_experts(config: Any) -> Any:
    """megatron-core's SequentialMLP (on disk interchangeable with TEGroupedMLP) for this rank's experts."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return SequentialMLP(local, config, sub, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def te_norm(local: Any) -> type:
    """The local norm as TE's TENorm saves it: with an `_extra_state` (`torch.empty(0, dtype=torch.uint8)` when no
    FP8 recipe is set, transformer_engine/pytorch/ops/op.py `get_extra_state`)."""
    from megatron.core.transformer.spec_utils import build_module

    class TENormStandIn(torch.nn.Module):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__()
            norm = build_module(local, *args, **kw)
            for name, p in list(norm.named_parameters(recurse=False)):  # its weights as this module's own
                self.register_parameter(name, p)

        def get_extra_state(self) -> torch.Tensor:
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state: Any) -> None:
            pass

    return TENormStandIn


def replicated(key: str, like: torch.Tensor) -> Any:
    """A replicated ShardedTensor (norms, biases, routers) the way megatron's layers make one."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    return make_sharded_tensor_for_checkpoint(torch.empty_like(like), key)


def load(sharded_state_dict: dict[str, Any], ckpt_dir: str, **kwargs: Any) -> dict[str, Any]:
    """megatron-core's own `dist_checkpointing.load` (plain strategy, access-integrity validation on)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state_dict, ckpt_dir, **kwargs)


def load_into(module: torch.nn.Module, prefix: str, ckpt_dir: str) -> dict[str, Any]:
    """Load `module` through its own `sharded_state_dict(prefix)`, then `load_state_dict(strict=True)`."""
    loaded = load(module.sharded_state_dict(prefix=prefix), ckpt_dir)  # also holds the common state's keys
    module.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items() if k.startswith(prefix)},
                           strict=True)
    return loaded


def tp_rows(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    """This TP rank's slice of `t` along `dim` (column-parallel: dim 0, row-parallel: dim 1)."""
    return t.chunk(size, dim=dim)[rank]


def swiglu_rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This TP rank's fc1 rows: its share of the gate half, then its share of the up half."""
    gate, up = t.chunk(2, dim=0)
    return torch.cat([tp_rows(gate, rank, size), tp_rows(up, rank, size)])


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-exact equality (compared as raw integers, so -0.0 and NaN payloads count), dtype included."""
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{name}: values differ"


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


# ---- an independent HF -> Megatron reference (the mapping table re-spelled, independently of glmconv/rules) ----
# Used by the convert proofs: what every Megatron tensor must hold, computed from the HF files with plain torch
# and safetensors, never through glmconv's plan, transforms, reader or FP8 code. Only another layout's names
# (`reference_mcore(layout=...)`) are taken from glmconv's plan of that layout: its values are still these.

FP8_BLOCK = 128
KDA, DSA = "linear_attention", "deepseek_sparse_attention"
_KDA_PROJ = ("q", "k", "v", "b", "f_a", "f_b", "g_a", "g_b", "o")
_DSA = {"q_a_proj.weight": "linear_q_down_proj.weight", "q_a_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
        "q_b_proj.weight": "linear_q_up_proj.weight", "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
        "kv_a_layernorm.weight": "linear_kv_up_proj.layer_norm_weight", "kv_b_proj.weight": "linear_kv_up_proj.weight",
        "o_proj.weight": "linear_proj.weight"}
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
            "index_kpool_compress_gate", "index_kpool_compress_ape")
_HC_SITES = {"attn": "self_attention", "ffn": "mlp"}
_GATE_UP = {"gate_proj.weight": 0, "up_proj.weight": 1}
F32_HF_SUFFIXES = ("_fn", "_base", "_scale", ".A_log", ".dt_bias", ".e_score_correction_bias",
                   ".index_kpool_compress_ape")


def read_safetensors(ckpt_dir: Any) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory exactly as stored (safetensors' own reader, all shards)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(ckpt_dir).glob("*.safetensors")):
        for name, t in load_file(str(shard)).items():
            assert name not in out, f"{name} stored twice"
            out[name] = t
    return out


def read_dcp(root: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint root and of its `glmconv_kept/` sidecar, at its stored dtype and global
    shape (torch's DCP reader)."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict[str, torch.Tensor] = {}
    release = Path(root) / "release"
    for ckpt in (release, release / "glmconv_kept"):  # the sidecar of kept tensors is a DCP of its own
        if not (ckpt / ".metadata").is_file():
            continue
        md = dcp.FileSystemReader(str(ckpt)).read_metadata()
        part = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}
        dcp.load(part, checkpoint_id=str(ckpt), no_dist=True)
        out.update(part)
    return out


def dequant_reference(fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp8.float() * scale_inv[i, j] on each 128x128 block (edge blocks cropped), then bf16: a plain loop."""
    rows, cols = fp8.shape
    assert scale_inv.shape == (-(-rows // block), -(-cols // block)) and scale_inv.dtype == torch.float32
    out = torch.empty(rows, cols, dtype=torch.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            blk = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[blk] = fp8[blk].to(torch.float32) * scale_inv[i, j]
    return out.to(torch.bfloat16)


def reference_mcore(ckpt_dir: Any, *, mtp: bool = True, vision: bool = True,
                    mtp_inner: str = "transformer_layer.", layout: str = "miles") -> dict[str, torch.Tensor]:
    """Every Megatron tensor a conversion of `ckpt_dir` (`convert --layout layout`) must write, computed from the
    HF files alone.

    Each HF tensor is routed to exactly one Megatron tensor (slot) of the miles layout; an unknown name, a slot
    filled twice or a scale without its weight fails. FP8 weights are dequantised by `dequant_reference`.
    `mtp_inner` is the one name taken as given (whether megatron-core keys it so is test_convert_mcore_keys'
    business). Another layout's names are the plan's (`_relaid`): only the values are computed here.
    """
    import json
    from pathlib import Path

    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    raw = read_safetensors(ckpt_dir)
    slots: dict[str, dict[Any, torch.Tensor]] = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            assert name.removesuffix("_scale_inv") in raw, f"{name} without its weight"
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequant_reference(t, raw[name + "_scale_inv"])
        for mc, slot, value in _route(name, t, text, mtp_inner):
            if (mc.startswith("mtp.") and not mtp) or (mc.startswith("vision_model.") and not vision):
                continue
            assert slot not in slots.setdefault(mc, {}), f"{mc} slot {slot} filled twice"
            slots[mc][slot] = value
    miles = {mc: _assemble(parts) for mc, parts in slots.items()}
    return miles if layout == "miles" else _relaid(miles, cfg, layout)


def _relaid(miles: dict[str, torch.Tensor], cfg: dict[str, Any], layout: str) -> dict[str, torch.Tensor]:
    """The miles reference under `layout`'s names, by glmconv's plan of that layout (`Mapping.key`: the miles
    names of each mapping; `Mapping.mcore`: the layout's, homeless ones under `glmconv_kept.`). One miles tensor
    per layout tensor is renamed; one miles tensor for several is their dim-0 concatenation, in order (the
    miles layout's packed q/k/v conv)."""
    from glmconv.config import parse_config
    from glmconv.plan import build_plan

    plan = build_plan(parse_config(cfg), layout=layout)
    left, out = dict(miles), {}
    for m in plan.mappings:
        present = [k in left for k in m.key]
        if not any(present):
            continue  # a part left out of the reference (mtp=False, vision=False)
        assert all(present), f"{m.key}: only part of the mapping in the reference"
        values = [left.pop(k) for k in m.key]
        if len(values) == 1 and len(m.mcore) > 1:
            values = list(torch.split(values[0], [t.shape[0] for t in m.mcore]))
        assert len(values) == len(m.mcore), f"{m.key} -> {[t.name for t in m.mcore]}: no reference relayout"
        for t, v in zip(m.mcore, values):
            assert tuple(v.shape) == t.shape, f"{t.name}: reference {tuple(v.shape)} != planned {t.shape}"
            out[t.name] = v
    assert not left, f"reference tensors the {layout} plan has no mapping for: {sorted(left)[:5]}"
    return out


def _megatron_dtype(hf_name: str) -> torch.dtype:
    return torch.float32 if hf_name.endswith(F32_HF_SUFFIXES) else torch.bfloat16


def _route(name: str, t: torch.Tensor, text: dict[str, Any], mtp_inner: str) -> list[tuple[str, Any, torch.Tensor]]:
    """(Megatron name, slot, value) for one HF tensor; slot None is the whole tensor."""
    t = t.to(_megatron_dtype(name))
    if name.startswith("model.visual."):
        return [("vision_model." + name.removeprefix("model.visual."), None, t)]
    if name == "lm_head.weight":
        return [("output_layer.weight", None, t)]
    prefix = "model.language_model." if name.startswith("model.language_model.") else "model."
    rest = name.removeprefix(prefix)
    if rest == "embed_tokens.weight":
        return [("embedding.word_embeddings.weight", None, t)]
    if rest == "norm.weight":
        return [("decoder.final_layernorm.weight", None, t)]
    head, layer_s, local = rest.split(".", 2)
    assert head == "layers", name
    layer, n = int(layer_s), text["num_hidden_layers"]
    if layer < n:
        return _route_layer(f"decoder.layers.{layer}.", local, t, text["layer_types"][layer],
                            text["mlp_layer_types"][layer])
    outer = f"mtp.layers.{layer - n}."
    mtp_own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "shared_head.norm.weight": "final_layernorm.weight"}
    if local in mtp_own:
        return [(outer + mtp_own[local], None, t)]
    return _route_layer(outer + mtp_inner, local, t, DSA, "sparse")


def _route_layer(p: str, local: str, t: torch.Tensor, attn: str, mlp: str) -> list[tuple[str, Any, torch.Tensor]]:
    import re

    if local == "input_layernorm.weight":
        return [(p + local, None, t)]
    if local == "post_attention_layernorm.weight":
        return [(p + ("mlp.linear_fc1.layer_norm_weight" if mlp == "dense" else "pre_mlp_layernorm.weight"), None, t)]
    m = re.fullmatch(r"hc_(attn|ffn)_(fn|base|scale)", local)
    if m:
        site = f"{p}{_HC_SITES[m.group(1)]}_hyper_connection."
        if m.group(2) == "scale":
            return [(site + f"alpha_{a}", None, t[i:i + 1].clone()) for i, a in enumerate(("pre", "post", "res"))]
        return [(site + ("mapping_proj.weight" if m.group(2) == "fn" else "bias"), None, t)]
    if local.startswith("self_attn."):
        return [_route_attn(p, local.removeprefix("self_attn."), t, attn)]
    if local.startswith("mlp."):
        return [_route_mlp(p, local.removeprefix("mlp."), t, mlp)]
    raise AssertionError(f"{p}{local}: no Megatron counterpart in the reference table")


def _route_attn(p: str, a: str, t: torch.Tensor, attn: str) -> tuple[str, Any, torch.Tensor]:
    if attn == KDA:
        proj = a.removesuffix("_proj.weight")
        if a.endswith("_proj.weight") and proj in _KDA_PROJ:
            return (f"{p}self_attention.kda.{a}", None, t)
        if a.endswith("_conv1d.weight"):
            return (f"{p}self_attention.kda.conv1d.weight", ("cat", "qkv".index(a[0])), t)
        assert a in ("A_log", "dt_bias", "o_norm.weight"), a
        return (f"{p}self_attention.kda.{a}", None, t)
    assert attn == DSA, attn
    if a in _DSA:
        return (f"{p}self_attention.{_DSA[a]}", None, t)
    assert a.startswith("indexer.") and a.removeprefix("indexer.") in _INDEXER, a
    return (f"{p}self_attention.{a.removeprefix('indexer.')}", None, t)


def _route_mlp(p: str, a: str, t: torch.Tensor, mlp: str) -> tuple[str, Any, torch.Tensor]:
    if mlp == "dense":
        if a in _GATE_UP:
            return (f"{p}mlp.linear_fc1.weight", ("cat", _GATE_UP[a]), t)
        assert a == "down_proj.weight", a
        return (f"{p}mlp.linear_fc2.weight", None, t)
    if a == "gate.weight":
        return (f"{p}mlp.router.weight", None, t)
    if a == "gate.e_score_correction_bias":
        return (f"{p}mlp.router.expert_bias", None, t)
    if a.startswith("shared_experts."):
        w = a.removeprefix("shared_experts.")
        if w in _GATE_UP:
            return (f"{p}mlp.shared_experts.linear_fc1.weight", ("cat", _GATE_UP[w]), t)
        assert w == "down_proj.weight", a
        return (f"{p}mlp.shared_experts.linear_fc2.weight", None, t)
    experts, e, w = a.split(".", 2)
    assert experts == "experts", a
    if w in _GATE_UP:
        return (f"{p}mlp.experts.experts.linear_fc1.weight", ("expert", int(e), _GATE_UP[w]), t)
    assert w == "down_proj.weight", a
    return (f"{p}mlp.experts.experts.linear_fc2.weight", ("expert", int(e), 0), t)


def _assemble(parts: dict[Any, torch.Tensor]) -> torch.Tensor:
    """One slot: the tensor. ("cat", i): concatenated on dim 0 in i order. ("expert", e, i): per expert e the
    concat of its parts, stacked on a new expert axis (fc1 per expert: gate rows, then up rows)."""
    if set(parts) == {None}:
        return parts[None]
    kind = {k[0] for k in parts}
    assert len(kind) == 1, parts.keys()
    if kind == {"cat"}:
        n = len(parts)
        assert set(parts) == {("cat", i) for i in range(n)}, sorted(parts)
        return torch.cat([parts[("cat", i)] for i in range(n)])
    experts = 1 + max(k[1] for k in parts)
    per = len(parts) // experts
    assert set(parts) == {("expert", e, i) for e in range(experts) for i in range(per)}, "experts missing"
    return torch.stack([torch.cat([parts[("expert", e, i)] for i in range(per)]) for e in range(experts)])


def rewrite_dcp(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                common: Callable[[dict[str, Any]], dict[str, Any]] = lambda c: c,
                keep: tuple[str, ...] = ("config.json",),
                objects: Callable[[str], bool] = lambda key: True) -> Path:
    """A copy of a torch_dist checkpoint as a trainer might leave it: tensors and common state edited, written by
    glmconv's own writer in one DCP (no sidecar), with the objects `objects` keeps; the files and folders named in
    `keep` copied beside it."""
    import io
    import shutil

    from glmconv.io.file_names import COMMON_STATE_KEY
    from glmconv.io.torch_dist.common_state import read_common_state
    from glmconv.io.torch_dist.reader import DcpReader, read_bytes_entry
    from glmconv.io.torch_dist.writer import DcpWriter

    reader = DcpReader(src)
    tensors = edit({n: reader.read(n) for n in reader.names()})
    kept = {k: torch.load(io.BytesIO(read_bytes_entry(reader.iter_dir, k)), weights_only=True)[0]
            for k in reader.ckpt.objects if k != COMMON_STATE_KEY and objects(k)}
    writer = DcpWriter(dst)
    writer.write(tensors)
    writer.write_objects(kept)
    writer.finish(common(read_common_state(reader.iter_dir)))
    for name in keep:
        (shutil.copytree if (src / name).is_dir() else shutil.copyfile)(src / name, dst / name)
    return dst
