"""The train side on megatron-core's own modules: glmconv's GlmModel for everything megatron-core has no module
for (KDA, mHC, norms, dense MLPs, embedding, head), megatron-core's AbsorbedMLASelfAttention+DSAttention for each
DSA attention core and its MoELayer for each MoE core, fed the very tensors glmconv's own core would get.

Between glmconv and a module the streams are converted exactly (glmconv.models.megatron.streams): the input-normed
[T, hidden] goes in as [T, 1, hidden] with the packing in a PackedSeqParams (the DSA attention masks by it; the
MoE layer is token-wise and takes none), the module's [T, 1, hidden] comes back. The selections parity compares
are observed, not recomputed: the DSA top-k as megatron-core's `fused_qk_topk_naive` returns it, the experts from
the TopKRouter's routing map (a forward hook).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmconv.config import GlmConfig
from glmconv.errors import GlmconvError
from glmconv.kernels import OpSet
from glmconv.models.conventions import Conventions
from glmconv.models.megatron import plant, standins, streams
from glmconv.models.megatron.load import MegatronModules, load_modules
from glmconv.models.model import ATTN, MLP, GlmModel, WeightPatch
from glmconv.models.weights import AttentionWeights, MlpWeights, WeightSource
from glmconv.quiet import quiet

if TYPE_CHECKING:
    import torch

GLMCONV = "glmconv"
MEGATRON_CORE = "megatron-core"
NO_REPLAY = ("--replay {what} with --train-backend megatron: megatron-core's {module} has no way to take "
             "selections from outside; drop --replay or use --train-backend glmconv")


class MegatronModel(GlmModel):
    """A GlmModel whose DSA attention and MoE cores are megatron-core's modules (`modules`, already loaded)."""

    def __init__(self, config: GlmConfig, weights: WeightSource, conventions: Conventions, modules: MegatronModules,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu", kernels: str = "reference",
                 stream: bool = False, ops: OpSet | None = None) -> None:
        super().__init__(config, weights, conventions, dtype, device, kernels=kernels, stream=stream, ops=ops)
        if modules.dtype != self.dtype:
            raise GlmconvError(f"megatron-core's modules are {modules.dtype}, the model {self.dtype}")
        self.modules = modules
        self._names = modules.names()  # the classes that run its DSA attention and MoE cores
        self._layer = -1  # the MLP sub-block running (`_moe` is handed its weights, not its layer)
        self._clean: dict[tuple[str, int], Any] = {}  # the sub-block's weights before a planted defect

    # ---- which code runs ----------------------------------------------------------------------------------

    def impl(self, layer: int, sub_block: str) -> str:
        """The code that computes (`layer`, `sub_block`)'s core: a megatron-core module's name, or "glmconv"."""
        attention, moe = self._names
        if sub_block == ATTN and layer in self.modules.attention_layers:
            return f"{MEGATRON_CORE} {attention}"
        if sub_block == MLP and layer in self.modules.moe_layers:
            return f"{MEGATRON_CORE} {moe}"
        return GLMCONV

    def impls(self) -> dict[str, str]:
        """Each implementation and the sub-blocks it runs ("3.attention, 3.mlp", ...), for a report's header."""
        out: dict[str, list[str]] = {}
        for layer in range(self.num_layers):
            for sub_block in (ATTN, MLP):
                out.setdefault(self.impl(layer, sub_block), []).append(f"{layer}.{sub_block}")
        return {name: ", ".join(sites) for name, sites in out.items()}

    def cannot_plant(self, defect: Any, sites: Iterable[tuple[int, str]]) -> str | None:
        """Why a self-test defect (glmconv.compare.catalog.Defect) cannot act at `sites` here, or None. glmconv
        plants into its own weights, switches and kernel path; a megatron-core module runs none of them: its
        weights are what it loaded from the checkpoint, its numerics its own."""
        sites = list(sites)
        ran = [(layer, sub_block) for layer, sub_block in sites if self.impl(layer, sub_block) != GLMCONV]
        if not ran:
            return None
        layer, sub_block = ran[0]
        where = f"{self.impl(layer, sub_block)} runs layer {layer} {sub_block}"
        if defect.kind == "weights":
            return None  # in glmconv's weights, or for the call in the module's own (megatron.plant)
        if len(ran) < len(sites):
            return None  # it acts at glmconv's sub-blocks too
        return f"{where} with its own numerics: glmconv's {defect.kind} there is not run"

    # ---- the cores ----------------------------------------------------------------------------------------

    def _dsa(self, layer: int, a: torch.Tensor, w: AttentionWeights, cu_seqlens: torch.Tensor,
             replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.experimental_attention_variant import dsa

        if replay is not None:
            raise GlmconvError(NO_REPLAY.format(what="indexer", module="DSAttention"))
        seen: list[Any] = []
        with self._running():
            module = self.modules.attention(layer)  # streaming: loaded now
        with self._running(), self._plant(module, w, layer, ATTN), spied(dsa, "fused_qk_topk_naive", seen):
            y, _ = module(streams.to_module(a), None, packed_seq_params=streams.packed(cu_seqlens, a.device))
        topk = _token_ids(seen[-1][1], a.shape[0], self.kpool_p.topk) if seen else None
        if topk is None:
            raise GlmconvError(f"layer {layer}: megatron-core's DSAttention computed no top-k through its torch path")
        self._last_topk = self._last_used = topk
        return streams.from_module(y), topk

    def _moe(self, h: torch.Tensor, w: MlpWeights,
             replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if replay is not None:
            raise GlmconvError(NO_REPLAY.format(what="routing", module="MoELayer"))
        with self._running():
            module = self.modules.moe(self._layer)  # streaming: loaded now
        maps: list[Any] = []
        handle = module.router.register_forward_hook(lambda mod, inp, out: maps.append(out[1]))
        try:
            with self._running(), self._plant(module, w, self._layer, MLP):
                y, _ = module(streams.to_module(h))
        finally:
            handle.remove()
        ids = _expert_ids(streams.gather_rows(maps[-1]), self.router_p.top_k)
        return streams.from_module(y), ids

    def mlp(self, layer: int, x: torch.Tensor,
            replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self._layer = layer  # `_moe` is handed the weights only; the module is the layer's
        return super().mlp(layer, x, replay)

    def _patched(self, sub_block: str, layer: int, w: Any) -> Any:
        self._clean = {(sub_block, layer): w}  # the running sub-block's only (streaming drops the others)
        return super()._patched(sub_block, layer, w)

    def _plant(self, module: Any, w: Any, layer: int, sub_block: str) -> AbstractContextManager[None]:
        """The self-test's weight defect, where one is planted at this sub-block, in what the module runs."""
        clean, core = self._clean.get((sub_block, layer)), "dsa" if sub_block == ATTN else "moe"  # the module's part
        found = (plant.changes(getattr(clean, core), getattr(w, core))
                 if self.weight_patch is not None and clean is not None else [])
        return plant.planted(module, found, f"layer {layer} {sub_block}") if found else nullcontext()

    @contextmanager
    def _running(self) -> Iterator[None]:
        import torch

        with torch.no_grad(), standins.cuda_device_query(self.device), quiet():
            yield

    # ---- twins: the same modules (fp32 copies for the precise twin) ---------------------------------------

    def variant(self, conventions: Conventions | None = None, patch: WeightPatch | None = None,
                kernels: str = "reference", ops: OpSet | None = None) -> MegatronModel:
        twin = MegatronModel(self.config, self.weights, conventions or self.conventions, self.modules, self.dtype,
                             self.device, kernels=kernels, ops=ops)
        twin.cache, twin._source, twin.weight_patch = self.cache, self._source, patch
        return twin

    def precise_twin(self) -> MegatronModel | None:
        import torch

        if self.dtype == torch.float32 and self.ops.is_reference:
            return None
        twin = MegatronModel(self.config, self.weights, self.conventions, self.modules.precise(), torch.float32,
                             self.device, kernels="reference", stream=self.stream)
        twin._source, twin.weight_patch = self, self.weight_patch
        return twin


@contextmanager
def spied(owner: Any, name: str, seen: list[Any]) -> Iterator[None]:
    """Record what `owner.name` returns while the block runs (the function itself runs unchanged)."""
    real: Callable[..., Any] = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        seen.append(out)
        return out

    setattr(owner, name, spy)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _token_ids(topk: torch.Tensor, tokens: int, width: int) -> torch.Tensor:
    """megatron-core's top-k [B=1, T, min(topk, T)] (packed token ids, -1 = none) as glmconv's [T, width]."""
    import torch.nn.functional as F

    ids = streams.gather_rows(topk.squeeze(0)) if topk.shape[1] != tokens else topk.squeeze(0)
    return F.pad(ids.long(), (0, max(0, width - ids.shape[-1])), value=-1)[:, :width]


def _expert_ids(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """The router's routing map [T, E] (True where routed) as expert ids [T, k], ascending."""
    import torch

    ids = torch.nonzero(routing_map, as_tuple=True)[1]
    return ids.view(routing_map.shape[0], k)


def megatron_model(config: GlmConfig, weights: WeightSource, mcore_dir: str | Path, conventions: Conventions,
                   dtype: torch.dtype, device: str | torch.device, kernels: str = "reference",
                   stream: bool = False) -> MegatronModel:
    """The train side of `--train-backend megatron`: megatron-core's modules loaded from `mcore_dir` (refused
    unless in the mcore layout; `stream`: each layer's as it runs), within glmconv's model of the same checkpoint."""
    import torch

    modules = load_modules(config, mcore_dir, weights.layout, dtype, torch.device(device), stream=stream)
    return MegatronModel(config, weights, conventions, modules, dtype, device, kernels=kernels, stream=stream)
