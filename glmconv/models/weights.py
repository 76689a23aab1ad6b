"""Per-layer weight sources: the HF checkpoint (serve) and the converted torch_dist checkpoint (train).

Both hand out one sub-block's weights at a time (layer streaming: a full-size parity run fits one GPU) in
one common structure. Tensors are found through the plan by rule role, never by spelling names. The
Megatron side reads Megatron's own layout natively (fc1 = gate rows then up rows, experts sliced from the
stacked [E, 2F, H] / [E, H, F] tensors, the q/k/v conv (one fused tensor in miles, three in mcore, concatenated
in the mapping's order), alpha_pre/post/res, router expert_bias) and never calls the rules' `backward`, so a
convert bug that a symmetric backward would undo is still caught. Its plan is built in the checkpoint's
Megatron layout (glmconv.checkpoint_layout: what glmconv.json records, checked against the names).
Tensors come back in their stored dtype (FP8 dequantised to BF16); the model casts them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from glmconv.checkpoint_layout import checkpoint_layout
from glmconv.config import DSA, KDA, MOE, GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT
from glmconv.errors import CheckpointError
from glmconv.io.config_file import load_config
from glmconv.io.safetensors.checkpoint import inspect_hf_checkpoint
from glmconv.io.safetensors.reader import HfTensorSource
from glmconv.io.torch_dist.metadata import config_path, resolve_iter_dir
from glmconv.io.torch_dist.reader import DcpReader
from glmconv.ops.dsa import DsaTensors
from glmconv.ops.kda import KdaTensors
from glmconv.ops.kpool import IndexerTensors
from glmconv.plan import FP8, Mapping, TensorSpec, build_plan
from glmconv.rules import names
from glmconv.rules import roles as R

if TYPE_CHECKING:
    import torch


EXPERT_WINDOW_BYTES = 1 << 30  # stacked-expert rows read at once on the Megatron side
ROW_WINDOW_BYTES = 1 << 28  # embedding / head rows read at once when they are streamed


@dataclass(frozen=True)
class HcSite:
    """One hyper-connection site: fn [(2+n)n, nH], base [(2+n)n], scale [3] (pre, post, comb)."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class Swiglu:
    """A gated MLP's three matrices."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class ExpertBank(ABC):
    """Routed experts, read one at a time (a full-size layer's experts need not fit at once)."""

    num: int
    nbytes: int  # all experts as `get` returns them: what a loader holds, to bound what it reads ahead
    on_device = False  # True: `get` hands out tensors already on the model's device (a prepared bank)

    @abstractmethod
    def get(self, expert: int) -> Swiglu:
        """Expert `expert`'s matrices."""

    def groups(self) -> list[range]:
        """Experts in groups that `read` takes independently: a loader reads them on several threads."""
        return [range(e, e + 1) for e in range(self.num)]

    def read(self, experts: range) -> list[Swiglu]:
        """The experts of one group; safe to call from several threads at once."""
        return [self.get(e) for e in experts]


@dataclass(frozen=True)
class MoeWeights:
    """Router, its selection bias, the shared expert and the routed experts."""

    router: torch.Tensor
    expert_bias: torch.Tensor
    shared: Swiglu | None
    experts: ExpertBank


@dataclass(frozen=True)
class SubBlockWeights:
    """What every sub-block starts with: its hyper-connection site (None: no mHC) and its pre-norm."""

    hc: HcSite | None
    norm: torch.Tensor


@dataclass(frozen=True)
class AttentionWeights(SubBlockWeights):
    """Everything the attention sub-block of one layer needs."""

    kda: KdaTensors | None = None
    dsa: DsaTensors | None = None


@dataclass(frozen=True)
class MlpWeights(SubBlockWeights):
    """Everything the MLP sub-block of one layer needs."""

    dense: Swiglu | None = None
    moe: MoeWeights | None = None


# Where each tensor field of the common structure comes from: field -> rule role (the KDA conv is the cat of its
# mapping's tensors). Used to build the structures and to name a weight difference parity finds in one.
KDA_FIELDS = {"q_proj": R.KDA_PROJ["q"], "k_proj": R.KDA_PROJ["k"], "v_proj": R.KDA_PROJ["v"], "conv": R.KDA_CONV,
              "f_a": R.KDA_PROJ["f_a"], "f_b": R.KDA_PROJ["f_b"], "g_a": R.KDA_PROJ["g_a"], "g_b": R.KDA_PROJ["g_b"],
              "b_proj": R.KDA_PROJ["b"], "a_log": R.KDA_A_LOG, "dt_bias": R.KDA_DT_BIAS, "o_norm": R.KDA_O_NORM,
              "o_proj": R.KDA_PROJ["o"]}
DSA_FIELDS = {"q_a": R.DSA_Q_A, "q_a_norm": R.DSA_Q_A_NORM, "q_b": R.DSA_Q_B, "kv_a": R.DSA_KV_A,
              "kv_a_norm": R.DSA_KV_A_NORM, "kv_b": R.DSA_KV_B, "o_proj": R.DSA_O_PROJ}
INDEXER_FIELDS = {"wq_b": R.INDEXER_WQ_B, "wk": R.INDEXER_WK, "k_norm_weight": R.INDEXER_K_NORM_WEIGHT,
                  "k_norm_bias": R.INDEXER_K_NORM_BIAS, "weights_proj": R.INDEXER_WEIGHTS_PROJ,
                  "compress_gate": R.INDEXER_COMPRESS_GATE, "compress_ape": R.INDEXER_COMPRESS_APE}
HC_FIELDS = ("fn", "base", "scale")  # HcSite's fields, in the order of roles.HC[site]
SWIGLU_PARTS = {"gate": 0, "up": 1}  # halves of a gated fc1 (HF: gate_proj, up_proj; Megatron: rows of linear_fc1)


@dataclass(frozen=True)
class FieldSource:
    """The rule role a structure field is read through; `part`: which half of a gated fc1 (None: all of it)."""

    role: str
    part: int | None = None


def field_source(sub_block: str, path: tuple[str, ...]) -> FieldSource | None:
    """The source of the field at `path` (e.g. ("kda", "q_proj"), ("moe", "experts", "up")) of a sub-block."""
    head, leaf = path[0], path[-1]
    if head == "hc":
        return FieldSource(R.HC["attn" if sub_block == "attention" else "ffn"][HC_FIELDS.index(leaf)])
    if head == "norm":
        return FieldSource(R.ATTN_NORM if sub_block == "attention" else R.MLP_NORM)
    if head in ("kda", "dsa"):
        table = INDEXER_FIELDS if "indexer" in path else KDA_FIELDS if head == "kda" else DSA_FIELDS
        return FieldSource(table[leaf]) if leaf in table else None
    fc = {("dense",): (R.DENSE_FC1, R.DENSE_FC2), ("moe", "shared"): (R.MOE_SHARED_FC1, R.MOE_SHARED_FC2),
          ("moe", "experts"): (R.MOE_EXPERTS_FC1, R.MOE_EXPERTS_FC2)}.get(path[:-1])
    if fc is not None:
        return FieldSource(fc[1]) if leaf == "down" else FieldSource(fc[0], SWIGLU_PARTS[leaf])
    return {"router": FieldSource(R.MOE_ROUTER), "expert_bias": FieldSource(R.MOE_EXPERT_BIAS)}.get(leaf)


def role_index(mappings: list[Mapping]) -> dict[tuple[int | None, str], Mapping]:
    """(layer, rule role) -> mapping; a role must name one mapping per layer."""
    index: dict[tuple[int | None, str], Mapping] = {}
    for m in mappings:
        key = (m.layer, m.rule.role)
        if not m.rule.role or key in index:
            raise AssertionError(f"rule {m.rule.hf[0]}: role {m.rule.role!r} is empty or not unique in its layer")
        index[key] = m
    return index


class WeightSource(ABC):
    """Role lookups over the plan; subclasses read tensors in their side's native layout."""

    def __init__(self, config: GlmConfig, text_prefix: str | None = None, layout: str = DEFAULT_LAYOUT) -> None:
        self.config, self.layout = config, layout
        prefix = names.HF_TEXT_PREFIX if text_prefix is None else text_prefix
        self._roles = role_index(build_plan(config, mtp=False, vision=False, text_prefix=prefix,
                                            layout=layout).mappings)

    def mapping(self, layer: int | None, role: str) -> Mapping:
        m = self._roles.get((layer, role))
        if m is None:
            where = "the model" if layer is None else f"layer {layer}"
            raise CheckpointError(f"{where} has no {role} tensor in the plan")
        return m

    def has(self, layer: int | None, role: str) -> bool:
        return (layer, role) in self._roles

    @abstractmethod
    def read(self, name: str) -> torch.Tensor:
        """This side's tensor `name`, whole."""

    @abstractmethod
    def specs(self, m: Mapping) -> tuple[TensorSpec, ...]:
        """This side's tensors of `m`: its HF ones or its Megatron ones."""

    def tensor(self, layer: int | None, role: str) -> torch.Tensor:
        """The single tensor (HF side) or the Megatron tensor of a 1:1 role."""
        (t,) = self._tensors(layer, role)
        return t

    def _tensors(self, layer: int | None, role: str) -> list[torch.Tensor]:
        return [self.read(s.name) for s in self.specs(self.mapping(layer, role))]

    @abstractmethod
    def row_range(self, role: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a model-wide 1:1 role (embedding, head), read without the rest."""

    def num_rows(self, role: str) -> int:
        """Rows of a model-wide 1:1 role (the vocabulary, for the embedding and the head)."""
        (spec,) = self.specs(self.mapping(None, role))
        return spec.shape[0]

    @abstractmethod
    def hc_site(self, layer: int, site: str) -> HcSite:
        """The hyper-connection tensors of `site` ("attn" or "ffn")."""

    @abstractmethod
    def kda_conv(self, layer: int) -> torch.Tensor:
        """The depthwise conv over cat(q, k, v) channels [3C, 1, W]."""

    @abstractmethod
    def swiglu(self, layer: int, fc1: str, fc2: str) -> Swiglu:
        """A dense or shared-expert gated MLP."""

    @abstractmethod
    def experts(self, layer: int) -> ExpertBank:
        """The routed experts of an MoE layer."""

    def close(self) -> None:  # noqa: B027 - a source may hold nothing to release
        """Release open files."""

    def leading_rows(self, role: str, rows: int) -> torch.Tensor:
        """The first `rows` rows of a model-wide 1:1 role."""
        return self.row_range(role, 0, min(rows, self.num_rows(role)))

    def row_windows(self, role: str) -> list[tuple[int, int]]:
        """[start, stop) row windows of a model-wide role, each at most ROW_WINDOW_BYTES (at least one row)."""
        rows = self.num_rows(role)
        step = max(1, ROW_WINDOW_BYTES // max(1, self.row_bytes(role)))
        return [(a, min(a + step, rows)) for a in range(0, rows, step)]

    def row_bytes(self, role: str) -> int:
        (spec,) = self.mapping(None, role).hf
        return spec.nbytes // max(1, spec.shape[0])

    def gather_rows(self, role: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a model-wide role (the embedding of a batch), read window by window, never whole."""
        import torch

        ids = ids.to("cpu", torch.long)
        out: torch.Tensor | None = None
        for start, stop in self.row_windows(role):
            hit = (ids >= start) & (ids < stop)
            if not bool(hit.any()):
                continue
            rows = self.row_range(role, start, stop)
            if out is None:
                out = torch.empty((ids.numel(), *rows.shape[1:]), dtype=rows.dtype)
            out[hit] = rows[ids[hit] - start]
        if out is None or int(ids.min()) < 0 or int(ids.max()) >= self.num_rows(role):
            raise CheckpointError(f"token ids outside the {role} table's {self.num_rows(role)} rows")
        return out

    # ---- the common structure ---------------------------------------------------------------------------

    def embedding(self) -> torch.Tensor:
        return self.tensor(None, R.EMBED)

    def final_norm(self) -> torch.Tensor:
        return self.tensor(None, R.FINAL_NORM)

    def lm_head(self) -> torch.Tensor:
        return self.tensor(None, R.LM_HEAD)

    def hc_head(self) -> HcSite | None:
        """Learned output contraction tensors: GLM-5.3-Flash has none (its head is a plain mean)."""
        return None

    def attention(self, layer: int, kpool: bool = True) -> AttentionWeights:
        """`kpool` False: a DSA indexer without its compress gate/ape (the token-level indexer; never read)."""
        hc = self.hc_site(layer, "attn") if self.has(layer, R.HC["attn"][0]) else None
        norm = self.tensor(layer, R.ATTN_NORM)
        kind = self.config.attn_types[layer]
        if kind == KDA:
            return AttentionWeights(hc, norm, kda=self._kda(layer))
        if kind == DSA:
            return AttentionWeights(hc, norm, dsa=self._dsa(layer, kpool))
        raise CheckpointError(f"layer {layer}: unknown attention type {kind!r}")

    def mlp(self, layer: int) -> MlpWeights:
        hc = self.hc_site(layer, "ffn") if self.has(layer, R.HC["ffn"][0]) else None
        norm = self.tensor(layer, R.MLP_NORM)
        if self.config.mlp_types[layer] != MOE:
            return MlpWeights(hc, norm, dense=self.swiglu(layer, R.DENSE_FC1, R.DENSE_FC2))
        shared = self.swiglu(layer, R.MOE_SHARED_FC1, R.MOE_SHARED_FC2) if self.has(layer, R.MOE_SHARED_FC1) else None
        moe = MoeWeights(self.tensor(layer, R.MOE_ROUTER), self.tensor(layer, R.MOE_EXPERT_BIAS), shared,
                         self.experts(layer))
        return MlpWeights(hc, norm, moe=moe)

    def _kda(self, layer: int) -> KdaTensors:
        fields = {f: self.tensor(layer, role) for f, role in KDA_FIELDS.items() if role != R.KDA_CONV}
        return KdaTensors(**fields, conv=self.kda_conv(layer))

    def _dsa(self, layer: int, kpool: bool = True) -> DsaTensors:
        indexer = None
        if self.has(layer, R.INDEXER_WQ_B):
            def part(name: str) -> torch.Tensor:
                return self.tensor(layer, INDEXER_FIELDS[name])

            indexer = IndexerTensors(part("wq_b"), part("wk"), part("k_norm_weight"), part("k_norm_bias"),
                                     part("weights_proj"), part("compress_gate") if kpool else None,
                                     part("compress_ape") if kpool else None)
        return DsaTensors(**{f: self.tensor(layer, role) for f, role in DSA_FIELDS.items()}, indexer=indexer)


# ---- serve side: the HF checkpoint ---------------------------------------------------------------------------

class HfWeights(WeightSource):
    """The HF checkpoint through `HfTensorSource` (lazy, memory-mapped; FP8 dequantised to BF16)."""

    def __init__(self, hf_dir: str | Path, device: str | torch.device | None = None) -> None:
        """`device`: where FP8 weights are dequantised (a CUDA device does it faster, with the same bits)."""

        import torch

        ck = inspect_hf_checkpoint(hf_dir)
        if ck.text_prefix is None:
            raise CheckpointError(f"{hf_dir}: no text-model tensors under a known prefix")
        super().__init__(ck.config, ck.text_prefix)
        self._src = HfTensorSource(ck.tensor_files(), headers=ck.headers)
        self._fp8 = {n for n, t in ck.tensors.items() if t.dtype == FP8}
        self._f32 = {n for n, t in ck.tensors.items() if t.dtype == "F32"}
        self.rounded: frozenset[str] = frozenset()  # names read rounded to BF16 (`round_like`)
        self._device = None if device is None or torch.device(device).type == "cpu" else torch.device(device)

    def close(self) -> None:
        self._src.close()

    def read(self, name: str) -> torch.Tensor:
        """As stored, except FP8 weights, which come back dequantised to BF16 (what convert writes), and the
        `rounded` ones, which come back rounded to BF16."""
        import torch

        if name in self._fp8:
            return self._src.weight(name, torch.bfloat16, self._device)
        t = self._src.raw(name)
        return t.to(torch.bfloat16) if name in self.rounded else t

    def round_like(self, train: WeightSource) -> int:
        """Read rounded to BF16 every F32 tensor that `train` stores in BF16 (a `convert --dtype bf16` pair), so
        both sides run the weights the train side holds; how many tensors that is."""
        import torch

        dtypes = getattr(train, "stored_dtype", None)
        if dtypes is None:
            return 0
        names = set()
        for key, m in self._roles.items():
            other = train._roles.get(key)
            if other is not None and all(dtypes(s.name) == torch.bfloat16 for s in other.mcore):
                names |= {s.name for s in m.hf if s.name in self._f32}
        self.rounded = frozenset(names)
        return len(names)

    def row_range(self, role: str, start: int, stop: int) -> torch.Tensor:
        (spec,) = self.mapping(None, role).hf
        if spec.name in self._fp8 or spec.name in self.rounded:  # FP8 blocks span 128 rows: dequantise whole
            return self.read(spec.name)[start:stop]
        return self._src.raw(spec.name, (start, stop))

    def specs(self, m: Mapping) -> tuple[TensorSpec, ...]:
        return m.hf

    def hc_site(self, layer: int, site: str) -> HcSite:
        return HcSite(*(self.tensor(layer, role) for role in R.HC[site]))

    def kda_conv(self, layer: int) -> torch.Tensor:
        import torch

        return torch.cat(self._tensors(layer, R.KDA_CONV), dim=0)  # transformers' conv1d runs over cat(q, k, v)

    def swiglu(self, layer: int, fc1: str, fc2: str) -> Swiglu:
        gate, up = self._tensors(layer, fc1)
        return Swiglu(gate, up, self.tensor(layer, fc2))

    def experts(self, layer: int) -> ExpertBank:
        return _HfExperts(self, self.mapping(layer, R.MOE_EXPERTS_FC1), self.mapping(layer, R.MOE_EXPERTS_FC2))


class _HfExperts(ExpertBank):
    """Per-expert HF tensors, found through the stacking transform (expert e's gate and up, then its down)."""

    def __init__(self, src: HfWeights, fc1: Mapping, fc2: Mapping) -> None:
        self._src, self._fc1, self._fc2 = src, fc1, fc2
        self.num = len(fc2.hf)
        self.nbytes = sum(t.nbytes * (2 if t.dtype == FP8 else 1) for t in (*fc1.hf, *fc2.hf))  # FP8 read as BF16

    def get(self, expert: int) -> Swiglu:
        (gate, up), (down,) = (self._read(m, expert) for m in (self._fc1, self._fc2))
        return Swiglu(gate, up, down)

    def _read(self, m: Mapping, expert: int) -> list[torch.Tensor]:
        picks = m.rule.transform.hf_for_rows(range(expert, expert + 1), len(m.hf)) or []
        return [self._src.read(m.hf[i].name) for i in picks]


# ---- train side: the converted torch_dist checkpoint ----------------------------------------------------------

class MegatronWeights(WeightSource):
    """The torch_dist checkpoint read tensor by tensor (or by expert rows), in Megatron's own layout.

    `layout`: the Megatron layout to read it in; None: the one glmconv.json records, else the one its names are
    spelled in (glmconv.checkpoint_layout), any disagreement refused. `self.layout` says which.
    """

    def __init__(self, mcore_dir: str | Path, config: GlmConfig | None = None, layout: str | None = None) -> None:
        root = Path(mcore_dir)
        if config is None:
            config = load_config(config_path(root, resolve_iter_dir(root)[0]))
        reader = DcpReader(root)
        super().__init__(config, layout=checkpoint_layout(root, config, reader.names(), layout))
        self._reader = reader

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self._reader.read(name, rows)

    def stored_dtype(self, name: str) -> torch.dtype:
        return self._reader.dtype(name)

    def row_cuts(self, name: str) -> set[int]:
        """Rows where a stored chunk of `name` starts (chunks split along dim 0)."""
        return {offsets[0] for offsets, _ in self._reader.chunks(name) if offsets}

    def row_range(self, role: str, start: int, stop: int) -> torch.Tensor:
        (spec,) = self.mapping(None, role).mcore
        return self.read(spec.name, (start, stop))

    def specs(self, m: Mapping) -> tuple[TensorSpec, ...]:
        return m.mcore

    def hc_site(self, layer: int, site: str) -> HcSite:
        import torch

        fn_role, base_role, scale_role = R.HC[site]
        fn, base = self.tensor(layer, fn_role), self.tensor(layer, base_role)
        alpha_pre, alpha_post, alpha_res = self._tensors(layer, scale_role)
        return HcSite(fn, base, torch.cat([alpha_pre, alpha_post, alpha_res]))

    def kda_conv(self, layer: int) -> torch.Tensor:
        import torch

        return torch.cat(self._tensors(layer, R.KDA_CONV), dim=0)  # miles: already fused; mcore: q, k, v convs

    def swiglu(self, layer: int, fc1: str, fc2: str) -> Swiglu:
        gate, up = self.tensor(layer, fc1).chunk(2, dim=0)  # Megatron's gated fc1: gate rows, then up rows
        return Swiglu(gate, up, self.tensor(layer, fc2))

    def experts(self, layer: int) -> ExpertBank:
        fc1, fc2 = self.mapping(layer, R.MOE_EXPERTS_FC1).mcore[0], self.mapping(layer, R.MOE_EXPERTS_FC2).mcore[0]
        return _StackedExperts(self, fc1.name, fc2.name, fc2.shape[0], fc1.nbytes + fc2.nbytes)


def _gated(fc1: torch.Tensor, fc2: torch.Tensor) -> Swiglu:
    """One expert from its Megatron rows: fc1 [2F, H] is gate rows then up rows, fc2 [H, F] is down."""
    gate, up = fc1.chunk(2, dim=0)
    return Swiglu(gate, up, fc2)


class _StackedExperts(ExpertBank):
    """Experts sliced from [E, 2F, H] / [E, H, F], read in windows of rows (experts come in ascending order)."""

    def __init__(self, src: MegatronWeights, fc1: str, fc2: str, num: int, nbytes: int) -> None:
        self._src, self._fc1, self._fc2, self.num, self.nbytes = src, fc1, fc2, num, nbytes
        self._step = max(1, min(num, EXPERT_WINDOW_BYTES * num // max(nbytes, 1)))
        self._window: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def get(self, expert: int) -> Swiglu:
        if not 0 <= expert < self.num:
            raise CheckpointError(f"{self._fc1}: no expert {expert} (there are {self.num})")
        if self._window is None or not 0 <= expert - self._window[0] < self._window[1].shape[0]:
            rows = (expert, min(expert + self._step, self.num))
            self._window = (expert, self._src.read(self._fc1, rows), self._src.read(self._fc2, rows))
        start, fc1, fc2 = self._window
        return _gated(fc1[expert - start], fc2[expert - start])

    def groups(self) -> list[range]:
        """Runs of experts that start and end on a stored chunk boundary of both tensors: each chunk read once."""
        cuts = self._src.row_cuts(self._fc1) & self._src.row_cuts(self._fc2)
        edges = sorted(cuts | {0, self.num})
        return [range(a, b) for a, b in zip(edges, edges[1:]) if a < b]

    def read(self, experts: range) -> list[Swiglu]:
        rows = (experts.start, experts.stop)
        fc1, fc2 = self._src.read(self._fc1, rows), self._src.read(self._fc2, rows)
        return [_gated(fc1[i], fc2[i]) for i in range(len(experts))]
