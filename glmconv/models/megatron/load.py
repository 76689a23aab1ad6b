"""megatron-core's DSA attention and MoE modules loaded from a converted mcore-layout checkpoint the way a trainer
loads them: `dist_checkpointing.load` of the modules' own `sharded_state_dict()`, then `load_state_dict(strict)`.

Strict both ways: every key a module requests is in the checkpoint, and every checkpoint key under a module's
prefix is requested. The kpool compression (no megatron-core parameter) is in the `glmconv_kept/` sidecar beside
the DCP, which megatron-core never reads; everything else of the checkpoint (KDA, mHC, norms, embedding, head)
is glmconv's to read. Runs in the current process group (TP1: one gloo process of its own, made here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.config import DSA, MOE, GlmConfig
from glmconv.defaults import MCORE
from glmconv.errors import GlmconvError
from glmconv.io.torch_dist.metadata import resolve_iter_dir
from glmconv.models.megatron import build, standins
from glmconv.quiet import quiet
from glmconv.rules.modules import attention_prefix, mlp_prefix

if TYPE_CHECKING:
    import torch

SHOWN = 5  # keys named in a refusal


@dataclass
class MegatronModules:
    """The DSA attention and MoE modules of a checkpoint, in one dtype on one device. All are loaded at once, or,
    streaming, one layer's at a time as that layer runs (the memory of the largest layer, never of the model: the
    real-cut4 MoE layer alone is 14.5 GB in bf16 and its fp32 twin 29 GB)."""

    config: GlmConfig
    dtype: torch.dtype
    device: torch.device
    ckpt: Path | None = None  # the DCP folder the modules load from
    stream: bool = False
    hadamard: str = ""  # which Hadamard transform the DSA indexer runs
    source: MegatronModules | None = None  # a precise twin's: its modules are these, cast to fp32
    _held: dict[str, tuple[int, Any]] = field(default_factory=dict)  # prefix -> (layer, module)
    _cfg: Any = None
    _precise: MegatronModules | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.config.num_layers) if self.config.attn_types[i] == DSA)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.config.num_layers) if self.config.mlp_types[i] == MOE)

    def attention(self, layer: int) -> Any:
        """Layer `layer`'s AbsorbedMLASelfAttention, loaded (streaming: now, the other layers' dropped)."""
        return self._module(attention_prefix(layer), layer)

    def moe(self, layer: int) -> Any:
        """Layer `layer`'s MoELayer, loaded (streaming: now, the other layers' dropped)."""
        return self._module(mlp_prefix(layer), layer)

    def prefixed(self) -> dict[str, Any]:
        """Each module held now by its state-dict prefix (all of them unless streaming)."""
        return {prefix: module for prefix, (_, module) in self._held.items()}

    def every_prefix(self) -> dict[str, int]:
        """Each module's state-dict prefix and its layer."""
        return {**{attention_prefix(i): i for i in self.attention_layers},
                **{mlp_prefix(i): i for i in self.moe_layers}}

    def names(self) -> tuple[str, str]:
        """The classes that run a DSA attention (module+core attention) and a MoE layer, read from the specs."""
        with quiet():
            return build.class_names(self.transformer_config())

    def transformer_config(self) -> Any:
        import torch

        if self._cfg is None:
            ensure_parallel_state()  # the config reads the TP/EP sizes of the process group
            with quiet(), standins.cuda_device_query(self.device):
                self._cfg = build.transformer_config(self.config, self.dtype, rotate=self.dtype == torch.bfloat16)
        return self._cfg

    def precise(self) -> MegatronModules:
        """The same modules in fp32 (each cast from this set's): megatron-core's fp32 path, the Hadamard rotation off
        (its `rotate_activation` asserts bf16; the rotation is orthonormal on both q and k, so scores keep their
        value)."""
        import torch

        if self.dtype == torch.float32:
            return self
        if self._precise is None:
            self._precise = MegatronModules(self.config, torch.float32, self.device, stream=self.stream,
                                            hadamard=self.hadamard, source=self)
            if not self.stream:
                self._precise.load_all()
        return self._precise

    def load_all(self) -> MegatronModules:
        """Every module loaded now (one `dist_checkpointing.load`, or cast from the source's)."""
        built = {prefix: (layer, self._built(prefix, layer)) for prefix, layer in self.every_prefix().items()}
        self._fill({prefix: module for prefix, (_, module) in built.items()})
        self._held = {prefix: (layer, module.to(self.device)) for prefix, (layer, module) in built.items()}
        return self

    def _module(self, prefix: str, layer: int) -> Any:
        if prefix not in self._held:
            if self.stream:  # one layer's modules at a time
                self._held = {p: held for p, held in self._held.items() if held[0] == layer}
            module = self._built(prefix, layer)
            self._fill({prefix: module})
            self._held[prefix] = (layer, module.to(self.device))
        return self._held[prefix][1]

    def _built(self, prefix: str, layer: int) -> Any:
        """`prefix`'s module, unloaded, in eval mode, on the CPU."""
        with quiet(), standins.cuda_device_query(self.device):
            cfg = self.transformer_config()
            if prefix == attention_prefix(layer):
                if not self.config.indexer_full[layer]:
                    raise GlmconvError(f"layer {layer}: a DSA layer that reuses another layer's top-k (indexer_types "
                                       "'shared') is not run by the megatron train backend yet; use "
                                       "--train-backend glmconv")
                module = build.dsa_attention(cfg, layer)
            else:
                module = build.moe_layer(cfg, layer)
        return module.eval()

    def _fill(self, modules: dict[str, Any]) -> None:
        """Load `modules`' weights: the source's, cast (a precise twin), or the checkpoint's (strict)."""
        if self.source is not None:
            for prefix, module in modules.items():
                # copied into the fp32 parameters one by one (load_state_dict casts): no second fp32 copy at once
                module.load_state_dict(self.source._module(prefix, self.every_prefix()[prefix]).state_dict(),
                                       strict=True)
                if self.stream:  # the bf16 module has run: off the device before its twin goes on (real-cut4's
                    self.source._held.pop(prefix)  # MoE: 14.5 + 29 GB at once, else), loaded again if needed
            return
        assert self.ckpt is not None
        load_from(modules, self.ckpt)


def load_modules(config: GlmConfig, mcore_dir: str | Path, layout: str, dtype: torch.dtype,
                 device: torch.device, stream: bool = False) -> MegatronModules:
    """The modules, loaded from `mcore_dir` through megatron-core's `dist_checkpointing.load` (all now; streaming,
    each layer's as it runs)."""
    if layout != MCORE:
        raise GlmconvError(f"{mcore_dir} is in the {layout} layout: --train-backend megatron loads megatron-core's "
                           f"own modules, which read the mcore layout; run `glmconv relayout {mcore_dir} OUT "
                           "--to mcore` and pass OUT")
    ckpt = resolve_iter_dir(Path(mcore_dir))[0]
    with quiet():  # megatron-core's import-time warnings too
        modules = MegatronModules(config, dtype, device, ckpt=ckpt, stream=stream,
                                  hadamard=standins.install_hadamard())
        return modules if stream else modules.load_all()


def load_from(modules: dict[str, Any], ckpt: Path) -> None:
    """`modules` (by prefix) loaded from the DCP folder `ckpt` as a trainer loads them: `dist_checkpointing.load`
    of their own `sharded_state_dict()`, strict for what lies under their prefixes."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    request: dict[str, Any] = {}
    for prefix, module in modules.items():
        request.update(module.sharded_state_dict(prefix=prefix))
    with quiet():
        loaded, unrequested, absent = dist_checkpointing.load(request, str(ckpt), strict=StrictHandling.RETURN_ALL)
    check_strict(set(absent), set(unrequested), tuple(modules), str(ckpt))
    for prefix, module in modules.items():
        module.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items() if k.startswith(prefix)},
                               strict=True)


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


def ensure_parallel_state() -> None:
    """megatron-core's parallel state: the caller's (a trainer's ranks), else TP1 in a gloo group of this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
