"""Run the serve and train models side by side, sub-block by sub-block, and measure each step at once.

Only the current hc streams of each side are held (plus both logits at the end), so memory is the models'
own per-layer weights plus a few [T, hc, H] tensors. Two modes:
  propagated: each side runs on its own from its own embedding (the error that reaches the logits);
  isolated:   every sub-block of both sides gets the SERVE side's input streams (the error each one adds).
Each side also runs as its fp32 torch-reference twin on the same path (`serve_precise`, `train_precise`): the
distance of each side from its twin is the noise the verdict (glmconv.compare.verdict) weighs the train-vs-serve
error against, the twins' distance from each other the difference of weights and conventions alone. Both sides'
weights of every sub-block are compared bit for bit as they are held (glmconv.compare.weight_diff), and at the
first divergence the differing switches' shares are measured (glmconv.compare.attribution).
When the train side runs GPU kernels, `twin` is the same train model on the torch references in the run dtype:
each attention sub-block also runs there on the train side's own input. The twin is correct code, so its distance
from the fp32 twin is the train side's rounding noise (`noise_train`), apart from the kernels; every kernel call is
judged on its own against its reference on the same input (`kernels`: glmconv.kernels.check), and the kernels'
effect on the streams (`kernel_rel_err`, the twin against the kernel path) counts as noise only while every
kernel of the sub-block is within its bound (`noise_kernel`).
With `replay` (glmconv.compare.replay) the train side's MoE layers run the serve side's expert ids and its DSA
layers attend over the serve side's token ids (each twin the ids of its own serve twin); the records' overlaps
stay the train side's OWN selections against the serve side's (the selection disagreement).
`variants`: more train sides (planted defects, glmconv.compare.defects) run in the same pass over the layers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

from glmconv.compare import metrics, weight_diff
from glmconv.compare.attribution import shapley
from glmconv.compare.inputs import Batch
from glmconv.compare.records import SELECTIONS, KernelResult, SelectionMeasure, SubBlockRecord
from glmconv.compare.replay import Replay
from glmconv.compare.verdict import Judge
from glmconv.defaults import DEFAULT_MODE, PARITY_MODES
from glmconv.errors import GlmconvError
from glmconv.kernels.check import KernelCheck
from glmconv.models.conventions import Conventions, Sides, acting_at_sub_block
from glmconv.models.weights import AttentionWeights, MlpWeights, WeightSource
from glmconv.progress import StepProgress as StepProgress  # parity's bar, re-exported (glmconv.compare imports it)

if TYPE_CHECKING:
    import torch


ATTENTION, MLP = "attention", "mlp"


class Model(Protocol):
    """What parity needs of a model (glmconv.models.model.GlmModel, or a test double)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def attn_types(self) -> tuple[str, ...] | list[str]: ...
    @property
    def mlp_types(self) -> tuple[str, ...] | list[str]: ...
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    # `replay` (the ids to use instead of the own selection) is passed only when replaying
    def attention(self, layer: int, x: torch.Tensor, cu_seqlens: torch.Tensor,
                  replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
    def mlp(self, layer: int, x: torch.Tensor,
            replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
    def head(self, x: torch.Tensor) -> torch.Tensor: ...


class WeightedModel(Model, Protocol):
    """A model whose weights parity compares bit for bit (GlmModel; a test double may have none: `_weighted`)."""

    @property
    def weights(self) -> WeightSource: ...
    def sub_block_weights(self, layer: int, sub_block: str) -> AttentionWeights | MlpWeights: ...


@dataclass
class Side:
    """One train side run against the serve side: its models, its streams, and what it measured.

    `precise`: the same side in fp32 on the torch references (None where the model already is one); `twin`: the
    kernels' reference twin in the run dtype (None without kernels); `sites`: the (layer, sub-block)s where this
    side differs from the clean side (a planted defect; None for the clean side itself, which runs everywhere).
    """

    name: str
    model: Model
    conventions: Conventions = field(default_factory=Conventions.serve)
    precise: Model | None = None
    twin: Model | None = None
    sites: frozenset[tuple[int, str]] | None = None
    judge: Judge = field(default_factory=Judge)
    records: list[SubBlockRecord] = field(default_factory=list)
    weight_diffs: list[dict[str, Any]] = field(default_factory=list)
    attribution: dict[str, Any] | None = None
    x: torch.Tensor | None = None  # its own streams (propagated), run dtype and fp32
    x_ref: torch.Tensor | None = None
    apart: bool = False  # propagated: runs on its own streams since its first differing site

    def streams(self) -> torch.Tensor:
        """Its own streams: set from the embedding on, except in isolated mode before its first sub-block."""
        if self.x is None:
            raise AssertionError(f"side {self.name}: no streams of its own yet (isolated mode runs on serve's)")
        return self.x

    def computes(self, layer: int, sub_block: str, isolated: bool) -> bool:
        """Whether this sub-block must be run for this side (else the clean side's record holds for it)."""
        if self.sites is None or (layer, sub_block) in self.sites:
            self.apart = True
            return True
        return self.apart and not isolated


@dataclass
class Capture:
    """Per sub-block records (forward order) and the logit comparison, and every side's verdict."""

    layers: list[SubBlockRecord] = field(default_factory=list)
    logits: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    sides: list[Side] = field(default_factory=list)
    weight_diffs: list[dict[str, Any]] = field(default_factory=list)  # the clean pair's, embedding and head too
    weights_checked: bool = False
    noise_measured: bool = False


Step = Callable[[str], None]
Result = tuple["torch.Tensor", dict[str, "torch.Tensor"]]  # a sub-block's streams and its aux (selections)
SelectionState = tuple["torch.Tensor | None", "torch.Tensor | None"] | None  # GlmModel.selection_state()


@dataclass
class _Serve:
    """The serve side's models and streams."""

    model: Model
    precise: Model | None
    conventions: Conventions
    x: torch.Tensor | None = None
    x_ref: torch.Tensor | None = None

    def streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams in the run dtype and the fp32 twin's: set from the embedding on."""
        if self.x is None or self.x_ref is None:
            raise AssertionError("the serve side has no streams before its embedding")
        return self.x, self.x_ref


def capture(serve: Model, train: Model, batch: Batch, mode: str = DEFAULT_MODE,
            on_step: Step | None = None, twin: Model | None = None, replay: Replay | None = None, *,
            serve_precise: Model | None = None, train_precise: Model | None = None,
            conventions: Sides | None = None, judge: Judge | None = None,
            variants: Sequence[Side] = ()) -> Capture:
    """Run both models over `batch`; `on_step(label)` is called after each of the 2L + 1 steps.

    `serve_precise` / `train_precise`: the sides' fp32 reference twins, whose distance from each side is the
    noise the verdict is measured against; `variants`: more train sides (planted defects) run in the same pass.
    """
    import torch

    if mode not in PARITY_MODES:
        raise GlmconvError(f"--mode {mode!r}: choose from {', '.join(PARITY_MODES)}")
    _check_same_shape(serve, train)
    conv = conventions or Sides(Conventions.serve(), Conventions.serve())
    clean = Side("clean", train, conv.train, train_precise, twin, judge=judge or Judge(propagated=mode == "propagated"))
    out = Capture(sides=[clean, *variants], noise_measured=serve_precise is not None or train_precise is not None)
    s = _Serve(serve, serve_precise, conv.serve)
    run = _Run(s, out, batch, mode == "isolated", replay or Replay())
    step = on_step or (lambda label: None)
    start = time.monotonic()
    with torch.inference_mode():
        run.embed()
        for layer in range(serve.num_layers):
            for sub_block in (ATTENTION, MLP):
                with _timed(out, serve, train):
                    run.sub_block(layer, sub_block)
                step(f"layer {layer} {sub_block}")
        out.logits = run.logits()
        step("logits")
    out.layers = clean.records
    out.elapsed_s = time.monotonic() - start
    return out


@dataclass
class _Run:
    """One pass over the layers: the serve side once per sub-block, then every train side against it."""

    serve: _Serve
    out: Capture
    batch: Batch
    isolated: bool
    replay: Replay

    @property
    def clean(self) -> Side:
        return self.out.sides[0]

    def embed(self) -> None:
        s, ids = self.serve, self.batch.ids
        s.x = s.model.embed(ids)
        s.x_ref = s.x.float() if s.precise is not None else s.x  # what the twin's embed gives: the rows, cast
        xt = self.clean.model.embed(ids)
        for side in self.out.sides:  # every side embeds with the clean side's table (defects plant in layers)
            side.x = xt if not self.isolated else None
            side.x_ref = xt.float() if side.precise is not None and not self.isolated else side.x
        self.out.weights_checked = _has_weights(s.model, self.clean.model)

    def sub_block(self, layer: int, sub_block: str) -> None:
        s = self.serve
        x, x_ref = s.streams()
        ys, aux_s = _call(s.model, sub_block, layer, x, self.batch.cu_seqlens)
        xr = x.float() if self.isolated else x_ref
        if s.precise is not None:
            ysr, aux_sr = _call(s.precise, sub_block, layer, xr, self.batch.cu_seqlens)
        else:
            xr, ysr, aux_sr = x, ys, aux_s
        serve_out = _Out(ys, aux_s, ysr, aux_sr, xr, x)
        for side in self.out.sides:
            self._measure(side, layer, sub_block, serve_out)
        s.x, s.x_ref = ys, ysr

    def _measure(self, side: Side, layer: int, sub_block: str, so: _Out) -> None:
        switches = _switches(self.serve, side, layer, sub_block)
        if side is not self.clean and not side.computes(layer, sub_block, self.isolated):
            rec = self.clean.records[-1].replace(diverged=None, why=None, cause=None)
            side.x, side.x_ref = self.clean.x, self.clean.x_ref
            side.records.append(side.judge(rec, switches)[0])
            return
        before = _selection_state(side.precise if side.precise is not None else side.model)  # for the attribution
        x_in = so.x if self.isolated else side.streams()
        ids = self.replay.ids(sub_block, layer, so.aux)
        yt, aux_t = _call(side.model, sub_block, layer, x_in, self.batch.cu_seqlens, ids)
        rec = _record(self.serve.model, layer, sub_block, yt, so.y, _impl(side.model, layer, sub_block))
        if ids is not None:
            rec = rec.replace(replayed="topk" if sub_block == ATTENTION else "experts")
        yk, aux_k = yt, aux_t  # the train side's code on the references: itself, unless it runs kernels
        if side.twin is not None and sub_block == ATTENTION:
            checks = _take_checks(side.model)
            yk, aux_k = _call(side.twin, ATTENTION, layer, x_in, self.batch.cu_seqlens, ids)
            rec = _with_kernels(rec, checks, (yt, aux_t), (yk, aux_k))
        xr_in = so.x_ref if self.isolated else side.x_ref
        ytr, aux_tr = yk, aux_k
        if side.precise is not None:
            ytr, aux_tr = _call(side.precise, sub_block, layer, xr_in if xr_in is not None else x_in.float(),
                                self.batch.cu_seqlens, self.replay.ids(sub_block, layer, so.aux_ref))
        rec = _with_noise(rec, (yt, aux_t), (yk, aux_k), (so.y, so.aux), (ytr, aux_tr), (so.y_ref, so.aux_ref),
                          self.serve.precise is not None, side.precise is not None)
        rec = self._weights(side, layer, sub_block, rec)
        rec, first = side.judge(rec, switches)
        if first and switches:
            side.attribution = self._attribute(side, layer, sub_block, so, switches, before)
        side.records.append(rec)
        side.x, side.x_ref = yt, ytr

    def _weights(self, side: Side, layer: int, sub_block: str, rec: SubBlockRecord) -> SubBlockRecord:
        """Compare both sides' weights of the sub-block (the clean side's status holds where a side equals it)."""
        serve, train = self.serve.model, side.model
        if not (_weighted(serve) and _weighted(train)):
            return rec
        diffs = list(weight_diff.structure_diffs(serve.sub_block_weights(layer, sub_block),
                                                 train.sub_block_weights(layer, sub_block)))
        named = [d.as_dict(layer, sub_block, serve.weights, train.weights) for d in diffs]
        side.weight_diffs += named
        return rec.replace(weights=weight_diff.status(diffs),
                           weight_diffs=tuple(named[:WEIGHT_DIFFS_PER_RECORD]) if named else None)

    def _attribute(self, side: Side, layer: int, sub_block: str, so: _Out, switches: list[str],
                   state: SelectionState) -> dict[str, Any] | None:
        """Shapley shares of the differing switches at this sub-block, rerun on the fp32 references."""

        base = side.precise if side.precise is not None else side.model
        if not hasattr(base, "variant"):
            return None
        train = side.conventions
        ids = self.replay.ids(sub_block, layer, so.aux_ref)

        def evaluate(on: frozenset[str]) -> float:
            conv = train.with_overrides([f"{s.split('=')[0]}=serve" for s in switches if s not in on])
            model = base.variant(conv, patch=getattr(base, "weight_patch", None))
            if state is not None:
                model.adopt_selection(state)
            y, _ = _call(model, sub_block, layer, so.x_ref, self.batch.cu_seqlens, ids)
            return metrics.rel_err(y, so.y_ref)

        att = shapley(switches, evaluate)
        return {"layer": layer, "sub_block": sub_block, **att}

    def logits(self) -> dict[str, Any]:
        s, clean = self.serve, self.clean
        x, _ = s.streams()
        logits_s = s.model.head(x)
        logits_t = clean.model.head(x if self.isolated else clean.streams())
        serve, train = s.model, clean.model
        if _weighted(serve) and _weighted(train):  # out.weights_checked
            # the embedding's every row, not only the batch's: a defect is a defect
            for role, d in weight_diff.model_wide_diffs(serve.weights, train.weights):
                self.out.weight_diffs.append(d.as_dict(None, role, serve.weights, train.weights))
        return metrics.logit_stats(logits_t, logits_s, self.batch.ids, self.batch.cu_seqlens).summary()


WEIGHT_DIFFS_PER_RECORD = 8  # named in the record; the report's `weight_diffs` has them all


@dataclass
class _Out:
    """The serve side's results for one sub-block: run dtype, fp32 reference, and their inputs."""

    y: torch.Tensor
    aux: dict[str, torch.Tensor]
    y_ref: torch.Tensor
    aux_ref: dict[str, torch.Tensor]
    x_ref: torch.Tensor  # the fp32 reference's input (the attribution reruns on it)
    x: torch.Tensor  # the serve side's input


def _weighted(model: Model) -> TypeGuard[WeightedModel]:
    return hasattr(model, "sub_block_weights") and hasattr(model, "weights")


def _has_weights(*models: Model) -> bool:
    return all(_weighted(m) for m in models)


def _selection_state(model: Model | None) -> SelectionState:
    return model.selection_state() if model is not None and hasattr(model, "selection_state") else None


def _switches(serve: _Serve, side: Side, layer: int, sub_block: str) -> list[str]:
    return acting_at_sub_block(serve.conventions, side.conventions, sub_block, serve.model.attn_types[layer] == "dsa")


def _with_noise(rec: SubBlockRecord, t: Result, k: Result, s: Result, tr: Result, sr: Result, serve_ref: bool,
                train_ref: bool) -> SubBlockRecord:
    """Each side's distance from its fp32 reference twin, measured on correct code (t: train, k: the train side's
    code on the references, s: serve, tr / sr: the fp32 twins' results), the kernels' share where they are within
    bounds, and the twins' distance from each other."""
    allow = rec.kernels_within is not False
    sels: dict[str, SelectionMeasure] = {}
    for sel in SELECTIONS:
        name = sel.name
        if not _has(s[1], t[1], name):
            continue
        noise = (1.0 - metrics.selection_overlap(s[1][name], sr[1][name])) if serve_ref else 0.0
        noise += (1.0 - metrics.selection_overlap(k[1][name], tr[1][name])) if train_ref else 0.0
        noise += (1.0 - metrics.selection_overlap(t[1][name], k[1][name])) if allow else 0.0
        sels[name] = SelectionMeasure(metrics.selection_overlap(t[1][name], s[1][name]), noise,
                                      metrics.selection_overlap(tr[1][name], sr[1][name]))
    return rec.replace(noise_serve=metrics.rel_err(s[0], sr[0]) if serve_ref else 0.0,
                       noise_train=metrics.rel_err(k[0], tr[0]) if train_ref else 0.0,
                       ref_rel_err=metrics.rel_err(tr[0], sr[0]),
                       noise_kernel=(rec.kernel_rel_err or 0.0) if allow else 0.0, **sels)


@contextmanager
def _timed(out: Capture, *models: Model) -> Iterator[None]:
    """Add to the step's record its wall time and the part of it spent loading weights (both sides)."""
    start, loaded = time.monotonic(), _load_s(models)
    yield
    records = out.sides[0].records
    records[-1] = records[-1].replace(wall_s=round(time.monotonic() - start, 4),
                                      load_s=round(_load_s(models) - loaded, 4))


def _load_s(models: tuple[Model, ...]) -> float:
    caches = {id(c): c for c in (getattr(m, "cache", None) for m in models) if c is not None}
    total: float = sum(c.load_s for c in caches.values())  # WeightCache.load_s (the models' `cache`, untyped here)
    return total


def steps(model: Model) -> int:
    """How many times `capture` calls `on_step`."""
    return 2 * model.num_layers + 1


def _check_same_shape(serve: Model, train: Model) -> None:
    if (serve.num_layers, tuple(serve.attn_types), tuple(serve.mlp_types)) != (
            train.num_layers, tuple(train.attn_types), tuple(train.mlp_types)):
        raise GlmconvError(f"the two checkpoints describe different models: serve has {serve.num_layers} layers "
                           f"{tuple(serve.attn_types)}/{tuple(serve.mlp_types)}, train has {train.num_layers} "
                           f"{tuple(train.attn_types)}/{tuple(train.mlp_types)}")


def _call(model: Model, sub_block: str, layer: int, x: torch.Tensor, cu_seqlens: torch.Tensor,
          replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    kw = {} if replay is None else {"replay": replay}
    if sub_block == ATTENTION:
        return model.attention(layer, x, cu_seqlens, **kw)
    return model.mlp(layer, x, **kw)


def _record(model: Model, layer: int, sub_block: str, train: torch.Tensor, serve: torch.Tensor,
            impl: str | None) -> SubBlockRecord:
    if train.shape != serve.shape:
        raise GlmconvError(f"layer {layer} {sub_block}: train streams {tuple(train.shape)} but serve "
                           f"{tuple(serve.shape)}")
    return SubBlockRecord(layer, sub_block, model.attn_types[layer], model.mlp_types[layer],
                          metrics.rel_err(train, serve), metrics.max_abs(train, serve), impl=impl)


def _impl(model: Model, layer: int, sub_block: str) -> str | None:
    """Which code ran the sub-block, for a train side that says (a backend of more than one implementation)."""
    impl = getattr(model, "impl", None)
    return impl(layer, sub_block) if impl is not None else None


def _take_checks(model: Model) -> list[KernelCheck]:
    take = getattr(model, "take_kernel_checks", None)
    return take() if take is not None else []


def _with_kernels(rec: SubBlockRecord, checks: list[KernelCheck], t: Result, k: Result) -> SubBlockRecord:
    """The kernels' part of a record: each check, whether all are within bounds, their effect on the streams."""
    topk = metrics.selection_overlap(t[1]["topk"], k[1]["topk"]) if _has(t[1], k[1], "topk") else None
    return rec.replace(kernels=tuple(KernelResult.of(c) for c in checks), kernels_within=all(c.within for c in checks),
                       kernel_rel_err=metrics.rel_err(t[0], k[0]), kernel_topk_overlap=topk)


def _has(aux_s: dict[str, torch.Tensor] | None, aux_t: dict[str, torch.Tensor] | None, key: str) -> bool:
    return bool(aux_s and aux_t and aux_s.get(key) is not None and aux_t.get(key) is not None)
