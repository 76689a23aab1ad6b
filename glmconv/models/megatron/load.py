"""megatron-core's DSA attention and MoE modules loaded from a converted mcore-layout checkpoint the way a trainer
loads them: `dist_checkpointing.load` of the modules' own `sharded_state_dict()`, then `load_state_dict(strict)`.

Strict both ways: every key a module requests is in the checkpoint, and every checkpoint key under a module's
prefix is requested. The kpool compression (no megatron-core parameter) is in the `glmconv_kept/` sidecar beside
the DCP, which megatron-core never reads; everything else of the checkpoint (KDA, mHC, norms, embedding, head)
is glmconv's to read. Runs in the current process group (TP1: one gloo process of its own, made here).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.config import DSA, MOE, GlmConfig
from glmconv.defaults import MCORE
from glmconv.errors import GlmconvError
from glmconv.io.torch_dist.metadata import resolve_iter_dir
from glmconv.models.megatron import build, standins
from glmconv.rules.modules import attention_prefix, mlp_prefix

if TYPE_CHECKING:
    import torch

SHOWN = 5  # keys named in a refusal


@dataclass
class MegatronModules:
    """The modules of every DSA attention and MoE sub-block, in one dtype on one device."""

    config: GlmConfig
    dtype: torch.dtype
    device: torch.device
    attention: dict[int, Any] = field(default_factory=dict)
    moe: dict[int, Any] = field(default_factory=dict)
    hadamard: str = ""  # which Hadamard transform the DSA indexer runs
    _precise: MegatronModules | None = None

    def prefixed(self) -> dict[str, Any]:
        """Each module by its state-dict prefix."""
        return {**{attention_prefix(i): m for i, m in self.attention.items()},
                **{mlp_prefix(i): m for i, m in self.moe.items()}}

    def precise(self) -> MegatronModules:
        """The same modules in fp32 (built once): megatron-core's fp32 path, the Hadamard rotation off (its
        `rotate_activation` asserts bf16; the rotation is orthonormal on both q and k, so scores keep their value)."""
        import torch

        if self.dtype == torch.float32:
            return self
        if self._precise is None:
            twin = build_modules(self.config, torch.float32, self.device)
            for prefix, module in twin.prefixed().items():
                state = self.prefixed()[prefix].state_dict()
                module.load_state_dict({k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                       for k, v in state.items()})
            self._precise = twin
        return self._precise


def build_modules(config: GlmConfig, dtype: torch.dtype, device: torch.device) -> MegatronModules:
    """Every DSA attention and MoE module of `config`, unloaded, in eval mode on `device`."""
    import torch

    ensure_parallel_state()
    out = MegatronModules(config, dtype, device, hadamard=standins.install_hadamard())
    with standins.cuda_device_query(device):
        cfg = build.transformer_config(config, dtype, rotate=dtype == torch.bfloat16)
        for layer in range(config.num_layers):
            if config.attn_types[layer] == DSA:
                if not config.indexer_full[layer]:
                    raise GlmconvError(f"layer {layer}: a DSA layer that reuses another layer's top-k (indexer_types "
                                       "'shared') is not run by the megatron train backend yet; use "
                                       "--train-backend glmconv")
                out.attention[layer] = build.dsa_attention(cfg, layer)
            if config.mlp_types[layer] == MOE:
                out.moe[layer] = build.moe_layer(cfg, layer)
    for module in out.prefixed().values():
        module.to(device).eval()
    return out


def load_modules(config: GlmConfig, mcore_dir: str | Path, layout: str, dtype: torch.dtype,
                 device: torch.device) -> MegatronModules:
    """Build the modules and load them from `mcore_dir` through megatron-core's `dist_checkpointing.load`."""
    if layout != MCORE:
        raise GlmconvError(f"{mcore_dir} is in the {layout} layout: --train-backend megatron loads megatron-core's "
                           f"own modules, which read the mcore layout; run `glmconv relayout {mcore_dir} OUT "
                           "--to mcore` and pass OUT")
    with quiet():
        return _load(config, mcore_dir, dtype, device)


def _load(config: GlmConfig, mcore_dir: str | Path, dtype: torch.dtype, device: torch.device) -> MegatronModules:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    modules = build_modules(config, dtype, device)
    request: dict[str, Any] = {}
    for prefix, module in modules.prefixed().items():
        request.update(module.sharded_state_dict(prefix=prefix))
    ckpt = str(resolve_iter_dir(Path(mcore_dir))[0])
    loaded, unrequested, absent = dist_checkpointing.load(request, ckpt, strict=StrictHandling.RETURN_ALL)
    check_strict(set(absent), set(unrequested), tuple(modules.prefixed()), ckpt)
    for prefix, module in modules.prefixed().items():
        module.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items() if k.startswith(prefix)},
                               strict=True)
    return modules


def check_strict(absent: set[str], unrequested: set[str], prefixes: tuple[str, ...], where: str) -> None:
    """Nothing a module requests is missing from the checkpoint; nothing stored under a module is left unread.
    (megatron-core's words: `unexpected_keys` requested but not stored, `missing_keys` stored but not requested.)"""
    if absent:
        raise GlmconvError(f"{where}: megatron-core's modules request {len(absent)} key(s) the checkpoint does not "
                           f"have, e.g. {', '.join(sorted(absent)[:SHOWN])}")
    left = sorted(k for k in unrequested if k.startswith(prefixes))
    if left:
        raise GlmconvError(f"{where}: {len(left)} stored key(s) under megatron-core's modules that no module "
                           f"requests, e.g. {', '.join(left[:SHOWN])}")


@contextmanager
def quiet() -> Iterator[None]:
    """megatron-core's import- and load-time warnings (no Transformer Engine, no Apex, DCP deprecations) are about
    its training paths, not what parity runs: kept off the user's terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def ensure_parallel_state() -> None:
    """megatron-core's parallel state: the caller's (a trainer's ranks), else TP1 in a gloo group of this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
