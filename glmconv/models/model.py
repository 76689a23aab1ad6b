"""GLM-5.3-Flash's text forward, one sub-block at a time, on any weight source and set of conventions.

The layer-wise API is what parity drives: `embed` -> for each layer `attention` then `mlp` (each returns
the new hc streams [T, hc_mult, H] and an aux dict) -> `head`. Weights are read one sub-block at a time and
held resident, or with `stream` one layer at a time, the embedding by the batch's rows and the head by row
windows (glmconv/models/residency.py): a full-size model then needs one layer of memory. MTP is not run.
dtype fp32 or bf16: bf16 runs weights and activations in bf16 while the parts the reference keeps in fp32
stay fp32 (hc coefficients, KDA gate/state/conv, router, indexer scores, attention softmax).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from glmconv.config import GlmConfig
from glmconv.errors import GlmconvError
from glmconv.kernels import OpSet, op_set, reference_ops
from glmconv.kernels.check import KernelCheck, checked
from glmconv.models.conventions import Conventions
from glmconv.models.residency import LoadedBank, WeightCache
from glmconv.models.weights import AttentionWeights, ExpertBank, HcSite, MlpWeights, WeightSource
from glmconv.ops import rms_norm
from glmconv.ops.dsa import DsaParams, dsa_layer
from glmconv.ops.kda import KdaParams, kda_layer
from glmconv.ops.kpool import KpoolParams, token_params
from glmconv.ops.mhc import HcParams, hc_post, hc_pre, head_learned, head_mean
from glmconv.ops.moe import RouterParams, replay_route, route, routed, swiglu_limit
from glmconv.ops.moe import mlp as swiglu_mlp
from glmconv.rules import roles as R

if TYPE_CHECKING:
    import torch


DTYPES = ("float32", "bfloat16")  # torch dtype names a model runs in
ATTN, MLP = "attention", "mlp"  # the two sub-blocks of a layer
# A weight defect planted in memory: (sub_block, layer, prepared weights, read another layer) -> weights to run.
WeightPatch = Callable[[str, int, Any, Callable[[int], Any]], Any]
# Tensors kept in fp32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict, plus hc fn/ape).
_FP32_FIELDS = {"fn", "base", "scale", "conv", "a_log", "dt_bias", "expert_bias", "compress_ape"}


class GlmModel:
    """The text model; `weights` decides serve or train, `conventions` the numerics, `kernels` the ops.

    kernels="auto" runs KDA, DSA attention and the kpool indexer through glmconv.kernels on CUDA (the
    references elsewhere); "reference" runs the torch references everywhere; "emulated" the kernel path with
    the references standing in (`ops` hands in any op set, a planted kernel defect's). One forward code.
    With `check_kernels()` every kernel call is also judged against its reference on the same input.
    With conventions.indexer_kpool "off" (megatron-core's token-level indexer) the same ops run pools of one
    token without the compress tensors (the triton kernel too).
    stream=True holds one layer's weights at a time (see `WeightCache`), with the same results.
    """

    def __init__(self, config: GlmConfig, weights: WeightSource, conventions: Conventions,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 kernels: str = "reference", stream: bool = False, ops: OpSet | None = None) -> None:
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if str(dtype).removeprefix("torch.") not in DTYPES:
            raise GlmconvError(f"model dtype {dtype}: choose torch.float32 or torch.bfloat16")
        self.config, self.weights, self.conventions = config, weights, conventions
        self.dtype, self.device = dtype, torch.device(device)
        self._limit = swiglu_limit(conventions.swiglu_clamp, float(config.text.get("swiglu_limit", 10.0)))
        if conventions.output_contraction == "learned" and weights.hc_head() is None:
            raise GlmconvError("output_contraction=learned needs the hc_head_fn, hc_head_base and hc_head_scale "
                               "tensors, which this checkpoint does not have (GLM-5.3-Flash contracts by mean)")
        self._params(config.text)
        self.kernels = kernels
        self.ops = ops if ops is not None else op_set(kernels, self.device, self.kpool_p.width)
        self._run = self.ops  # what runs: the ops, or the ops each checked against its reference
        self.kernel_checks: list[KernelCheck] = []
        self._kpool = conventions.indexer_kpool == "learned"
        self._index_p = self.kpool_p if self._kpool else token_params(self.kpool_p)
        self.cache = WeightCache(stream)
        self._source: GlmModel | None = None  # a model whose prepared weights this one casts (precise_twin)
        self.weight_patch: WeightPatch | None = None  # planted in memory over the prepared weights (self-test)
        self._last_topk: torch.Tensor | None = None  # the last DSA layer's own selection
        self._last_used: torch.Tensor | None = None  # and the ids it attended over (replayed or its own)

    def _params(self, t: dict[str, Any]) -> None:
        self.eps = float(t["rms_norm_eps"])
        self.hc = HcParams(t["hc_mult"], self.eps, float(t.get("hc_eps", 1e-6)), int(t.get("hc_sinkhorn_iters", 20)))
        lac = t.get("linear_attn_config") or {}
        bound = lac.get("gate_lower_bound", t.get("linear_lower_bound", -5.0))  # transformers' precedence
        if bound is None and lac.get("safe_gate", True):
            bound = -5.0
        if bound is None:
            raise GlmconvError("linear_lower_bound is null: only the safe-gate KDA (GLM-5.3) is implemented")
        self.kda_p = KdaParams(t["linear_num_heads"], t["linear_head_dim"], float(bound), self.eps)
        self.dsa_p = DsaParams(t["num_attention_heads"], t["qk_nope_head_dim"], t["v_head_dim"], self.eps)
        self.kpool_p = KpoolParams(t["index_n_heads"], t["index_head_dim"], t["index_topk"], t["index_kpool"],
                                   bool(t.get("index_kpool_always_select_tail", True)))
        self.router_p = RouterParams(t["num_experts_per_tok"], float(t.get("routed_scaling_factor", 2.5)),
                                     int(t.get("n_group") or 1), int(t.get("topk_group") or 1),
                                     bool(t.get("norm_topk_prob", True)))

    # ---- the parity API ----------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def attn_types(self) -> tuple[str, ...]:
        return self.config.attn_types

    @property
    def mlp_types(self) -> tuple[str, ...]:
        return self.config.mlp_types

    @property
    def stream(self) -> bool:
        return self.cache.stream

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hc streams [T, hc_mult, H] (the embedding replicated on every stream)."""
        if self._source is not None:
            return self._source.embed(input_ids).to(self.dtype)
        if self.stream:
            rows = self.weights.gather_rows(R.EMBED, input_ids)
        else:
            table = self.cache.get(("embed", -1), self.weights.embedding)
            rows = table[input_ids.to(table.device)]
        x = rows.to(self.device, self.dtype)
        return x.unsqueeze(1).expand(-1, self.hc.hc_mult, -1).contiguous()

    def attention(self, layer: int, x: torch.Tensor, cu_seqlens: torch.Tensor,
                  replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Streams after layer `layer`'s attention sub-block; aux `topk` [T, W] on DSA layers.

        `replay` [T, W] (indexer replay, DSA layers): attend over these token ids; aux `topk` stays the own selection.
        """
        w = self._attention_weights(layer)
        post, comb, collapsed = self._pre(w.hc, x, layer)
        a = rms_norm(collapsed, w.norm, self.eps)
        aux: dict[str, torch.Tensor] = {}
        if w.kda is not None:
            y = kda_layer(a, w.kda, self.kda_p, cu_seqlens, conv=self._run.short_conv, core=self._run.kda_core)
        else:
            y, aux["topk"] = self._dsa(layer, a, w, cu_seqlens, replay)
        return hc_post(y, x, post, comb, self.conventions.hc_mix), aux

    def mlp(self, layer: int, x: torch.Tensor,
            replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Streams after layer `layer`'s MLP sub-block; aux `experts` [T, k] on MoE layers.

        `replay` [T, k] (routing replay, MoE layers): route to these experts, gate weights from this router's own
        scores at them; aux `experts` stays the own choice.
        """
        w = self._mlp_weights(layer)
        post, comb, collapsed = self._pre(w.hc, x, layer)
        h = rms_norm(collapsed, w.norm, self.eps)
        aux: dict[str, torch.Tensor] = {}
        if w.dense is not None:
            y = swiglu_mlp(h, w.dense.gate, w.dense.up, w.dense.down, self._limit)
        else:
            y, aux["experts"] = self._moe(h, w, replay)
        return hc_post(y, x, post, comb, self.conventions.hc_mix), aux

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Streams -> fp32 logits [T, V]: contraction (mean or learned), final norm, lm_head."""
        norm, hc_head = self._head_weights()
        if self.conventions.output_contraction == "mean":
            h = head_mean(x)
        elif hc_head is None:  # build_models refuses output_contraction=learned without hc_head_* tensors
            raise AssertionError("output_contraction=learned with no hc_head weights")
        else:
            h = head_learned(x, hc_head.fn, hc_head.base, hc_head.scale, self.eps, self.hc.hc_eps,
                             self.conventions.proj_rms)
        return self._logits(rms_norm(h, norm, self.eps))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """h @ lm_head^T in fp32, by row windows of the head (streamed: each read, used and dropped)."""
        import torch
        import torch.nn.functional as F

        windows = self.weights.row_windows(R.LM_HEAD)
        out = torch.empty((h.shape[0], windows[-1][1]), dtype=torch.float32, device=h.device)
        full = None if self.stream else self.cache.get(("lm_head", -1), lambda: self._cast(self.weights.lm_head()))
        for a, b in windows:
            w = self._cast(self.weights.row_range(R.LM_HEAD, a, b)) if full is None else full[a:b]
            out[:, a:b] = F.linear(h, w)
        return out

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits [T, V] of packed sequences, every layer in order."""
        x = self.embed(input_ids)
        for layer in range(self.num_layers):
            x, _ = self.attention(layer, x, cu_seqlens)
            x, _ = self.mlp(layer, x)
        return self.head(x)

    __call__ = forward

    def kernel_twin(self) -> GlmModel | None:
        """The same model (planted weights too) on the torch references in this dtype: the rounding noise of
        correct code, apart from the kernels'. None without kernels."""
        if self.ops.is_reference:
            return None
        return self.variant(patch=self.weight_patch)

    def check_kernels(self) -> None:
        """From now on judge every kernel call against its reference on the same input (`take_kernel_checks`)."""
        if not self.ops.is_reference:
            self._run = checked(self.ops, reference_ops(), self.kernel_checks.append)

    def take_kernel_checks(self) -> list[KernelCheck]:
        """The checks of the kernel calls since the last take (one sub-block's, as parity takes them)."""
        out, self.kernel_checks[:] = list(self.kernel_checks), []
        return out

    def variant(self, conventions: Conventions | None = None, patch: WeightPatch | None = None,
                kernels: str = "reference", ops: OpSet | None = None) -> GlmModel:
        """This model with other conventions, planted weights or ops: the same weights, held once."""
        twin = GlmModel(self.config, self.weights, conventions or self.conventions, self.dtype, self.device,
                        kernels=kernels, ops=ops)
        twin.cache, twin._source, twin.weight_patch = self.cache, self._source, patch
        return twin

    def precise_twin(self) -> GlmModel | None:
        """This model in fp32 on the torch references, casting this one's prepared weights (no second read): the
        reference its own rounding and kernel error is measured against. None when this model already is one."""
        import torch

        if self.dtype == torch.float32 and self.ops.is_reference:
            return None
        twin = GlmModel(self.config, self.weights, self.conventions, torch.float32, self.device, kernels="reference",
                        stream=self.stream)
        twin._source, twin.weight_patch = self, self.weight_patch
        return twin

    def selection_state(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The DSA selection carried to the next layer (a shared-indexer layer reuses the previous top-k)."""
        return self._last_topk, self._last_used

    def adopt_selection(self, state: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """Carry another model's `selection_state` (a rerun of one sub-block starts where that model stood)."""
        self._last_topk, self._last_used = state

    def sub_block_weights(self, layer: int, sub_block: str) -> AttentionWeights | MlpWeights:
        """The prepared weights (model dtype, on the device) that `attention` / `mlp` of `layer` runs with."""
        return self._attention_weights(layer) if sub_block == ATTN else self._mlp_weights(layer)

    # ---- pieces -------------------------------------------------------------------------------------------

    def _pre(self, hc: HcSite | None, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hc is None:
            raise GlmconvError(f"layer {layer}: no hyper-connection tensors (only the mHC model is implemented)")
        return hc_pre(x, hc.fn, hc.base, hc.scale, self.hc, self.conventions.proj_rms)

    def _dsa(self, layer: int, a: torch.Tensor, w: AttentionWeights, cu_seqlens: torch.Tensor,
             replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out, own top-k); a shared-indexer layer reuses the earlier layer's own top-k and what it attended."""
        assert w.dsa is not None
        shared = w.dsa.indexer is None
        if shared and self._last_topk is None:
            raise GlmconvError(f"layer {layer} reuses the indexer top-k of an earlier DSA layer; run that first")
        if shared and replay is None:
            replay = self._last_used
        y, topk = dsa_layer(a, w.dsa, self.dsa_p, self._index_p, cu_seqlens, self.conventions.indexer_query,
                            topk=self._last_topk if shared else None, indexer=self._run.indexer,
                            attend=self._run.sparse_mla, replay=replay)
        self._last_topk, self._last_used = topk, topk if replay is None else replay
        return y, topk

    def _moe(self, h: torch.Tensor, w: MlpWeights,
             replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out, own expert choice); with `replay` the experts run are the replayed ones."""
        assert w.moe is not None
        if replay is None:
            weights, ids = route(h, w.moe.router, w.moe.expert_bias, self.router_p)
            own = ids
        else:
            weights, own = replay_route(h, w.moe.router, w.moe.expert_bias, self.router_p, replay)
            ids = replay.to(own.device, own.dtype)
        bank = w.moe.experts
        y = routed(h, weights, ids, lambda e: self._expert(bank, e), self._limit)
        if w.moe.shared is not None:
            s = w.moe.shared
            y = y + swiglu_mlp(h, s.gate, s.up, s.down, self._limit)
        return y, own

    def _expert(self, bank: ExpertBank, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = bank.get(e)
        return self._cast(s.gate), self._cast(s.up), self._cast(s.down)

    # ---- weights: one sub-block at a time, cast to the model's device and dtype -----------------------------

    def _attention_weights(self, layer: int) -> AttentionWeights:
        self._check_layer(layer)
        key = ("attention" if self._kpool else "attention-token-indexer", layer)
        w: AttentionWeights = self._patched(ATTN, layer,
                                            self.cache.get(key, lambda: self._prepare(self._read(layer, ATTN))))
        return w

    def _mlp_weights(self, layer: int) -> MlpWeights:
        self._check_layer(layer)
        w: MlpWeights = self._patched(MLP, layer,
                                      self.cache.get((MLP, layer), lambda: self._prepare(self._read(layer, MLP))))
        return w

    def _read(self, layer: int, sub_block: str) -> Any:
        """A sub-block's weights: from the checkpoint, or the source model's prepared ones (cast by `_prepare`)."""
        if self._source is not None:
            return self._source.variant(self.conventions).sub_block_weights(layer, sub_block)
        if sub_block == MLP:
            return self.weights.mlp(layer)
        return self.weights.attention(layer, **({} if self._kpool else {"kpool": False}))  # off: no gate/ape read

    def _patched(self, sub_block: str, layer: int, w: Any) -> Any:
        """`w`, or the planted defect's copy of it where this model carries one for (`sub_block`, `layer`)."""
        if self.weight_patch is None:
            return w
        return self.weight_patch(sub_block, layer, w, lambda other: self._read_aside(other, sub_block))

    def _read_aside(self, layer: int, sub_block: str) -> Any:
        """Another layer's weights read from the checkpoint past every cache (streaming holds one layer at a time;
        a planted layer swap needs two)."""
        plain = GlmModel(self.config, self.weights, self.conventions, self.dtype, self.device, kernels="reference")
        return plain.sub_block_weights(layer, sub_block)

    def _head_weights(self) -> tuple[torch.Tensor, HcSite | None]:
        def load() -> tuple[torch.Tensor, HcSite | None]:
            hc_head = self.weights.hc_head()
            return self._cast(self.weights.final_norm()), self._prepare(hc_head) if hc_head is not None else None

        head: tuple[torch.Tensor, HcSite | None] = self.cache.get(("head", -1), load)
        return head

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise GlmconvError(f"layer {layer}: the model has layers 0..{self.num_layers - 1}")

    def _prepare(self, obj: Any) -> Any:
        """A weight structure with every tensor on the device, in the model dtype or kept fp32 (experts: stored)."""
        import torch

        if obj is None or (isinstance(obj, ExpertBank) and obj.on_device):  # cast one expert at a time, at use
            return obj
        if isinstance(obj, ExpertBank):
            return LoadedBank(obj, self.device)
        changes = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            changes[f.name] = self._cast(v, f.name in _FP32_FIELDS) if isinstance(v, torch.Tensor) else self._prepare(v)
        return replace(obj, **changes)

    def _cast(self, t: torch.Tensor, keep_fp32: bool = False) -> torch.Tensor:
        import torch

        return t.to(self.device, torch.float32 if keep_fp32 else self.dtype)

