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
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
