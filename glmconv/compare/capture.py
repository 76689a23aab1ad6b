"""Run the serve and train models side by side, sub-block by sub-block, and measure each step at once.

Only the current hc streams of each side are held (plus both logits at the end), so memory is the models'
own per-layer weights plus a few [T, hc, H] tensors. Two modes:
  propagated: each side runs on its own from its own embedding (the error that reaches the logits);
  isolated:   every sub-block of both sides gets the SERVE side's input streams (the error each one adds).
When the train side runs GPU kernels, `twin` is the same train model on the torch references: each attention
sub-block also runs there on the train side's own input, and its record gains the kernels' own error
(`kernel_rel_err` on the streams, `kernel_out_rel_err` on the sub-block's output, `kernel_topk_overlap` of
the kpool selections), so kernel numerics can be told from convention divergences.
With `replay` (glmconv.compare.replay) the train side's MoE layers run the serve side's expert ids and its DSA
layers attend over the serve side's token ids; the records' overlaps stay the train side's OWN selections
against the serve side's (the selection disagreement), their rel errs are the numerics under replay.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch

from glmconv.compare import metrics
from glmconv.compare.inputs import Batch
from glmconv.compare.replay import Replay
from glmconv.errors import GlmconvError
from glmconv.text import printable

MODES = ("propagated", "isolated")
ATTENTION, MLP = "attention", "mlp"


class Model(Protocol):
    """What parity needs of a model (glmconv.models.model.GlmModel, or a test double)."""

    num_layers: int
    attn_types: tuple[str, ...] | list[str]
    mlp_types: tuple[str, ...] | list[str]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    # `replay` (the ids to use instead of the own selection) is passed only when replaying
    def attention(self, layer: int, x: torch.Tensor, cu_seqlens: torch.Tensor,
                  replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]: ...
    def mlp(self, layer: int, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]: ...
    def head(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Capture:
    """Per sub-block records (forward order) and the logit comparison."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    logits: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0


Step = Callable[[str], None]


def capture(serve: Model, train: Model, batch: Batch, mode: str = "propagated",
            on_step: Step | None = None, twin: Model | None = None, replay: Replay | None = None) -> Capture:
    """Run both models over `batch`; `on_step(label)` is called after each of the 2L + 1 steps."""
    if mode not in MODES:
        raise GlmconvError(f"--mode {mode!r}: choose from {', '.join(MODES)}")
    _check_same_shape(serve, train)
    step = on_step or (lambda label: None)
    replay = replay or Replay()
    start = time.monotonic()
    out = Capture()
    with torch.inference_mode():
        xs = serve.embed(batch.ids)
        xt = xs if mode == "isolated" else train.embed(batch.ids)
        for layer in range(serve.num_layers):
            with _timed(out, serve, train):
                xs, xt = _attention(serve, train, layer, xs, xt, batch, out, mode, twin, replay)
            step(f"layer {layer} attention")
            with _timed(out, serve, train):
                xs, xt = _mlp(serve, train, layer, xs, xt, out, mode, replay)
            step(f"layer {layer} mlp")
        logits_s = serve.head(xs)
        logits_t = train.head(xs if mode == "isolated" else xt)
        out.logits = metrics.logit_stats(logits_t, logits_s, batch.ids, batch.cu_seqlens).summary()
        step("logits")
    out.elapsed_s = time.monotonic() - start
    return out


@contextmanager
def _timed(out: Capture, *models: Model) -> Iterator[None]:
    """Add to the step's record its wall time and the part of it spent loading weights (both sides)."""
    start, loaded = time.monotonic(), _load_s(models)
    yield
    out.layers[-1]["wall_s"] = round(time.monotonic() - start, 4)
    out.layers[-1]["load_s"] = round(_load_s(models) - loaded, 4)


def _load_s(models: tuple[Model, ...]) -> float:
    caches = {id(c): c for c in (getattr(m, "cache", None) for m in models) if c is not None}
    return sum(c.load_s for c in caches.values())


def steps(model: Model) -> int:
    """How many times `capture` calls `on_step`."""
    return 2 * model.num_layers + 1


def _check_same_shape(serve: Model, train: Model) -> None:
    if (serve.num_layers, tuple(serve.attn_types), tuple(serve.mlp_types)) != (
            train.num_layers, tuple(train.attn_types), tuple(train.mlp_types)):
        raise GlmconvError(f"the two checkpoints describe different models: serve has {serve.num_layers} layers "
                           f"{tuple(serve.attn_types)}/{tuple(serve.mlp_types)}, train has {train.num_layers} "
                           f"{tuple(train.attn_types)}/{tuple(train.mlp_types)}")


def _attention(serve: Model, train: Model, layer: int, xs: torch.Tensor, xt: torch.Tensor, batch: Batch,
               out: Capture, mode: str, twin: Model | None = None,
               replay: Replay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ys, aux_s = serve.attention(layer, xs, batch.cu_seqlens)
    x_in = xs if mode == "isolated" else xt
    ids = (replay or Replay()).token_ids(layer, aux_s)
    kw = {} if ids is None else {"replay": ids}
    yt, aux_t = train.attention(layer, x_in, batch.cu_seqlens, **kw)
    rec = _record(serve, layer, ATTENTION, yt, ys)
    if _has(aux_s, aux_t, "topk"):
        rec["topk_overlap"] = metrics.selection_overlap(aux_t["topk"], aux_s["topk"])
    if ids is not None:
        rec["replayed"] = "topk"
    if twin is not None:
        rec.update(_kernel_error(twin, layer, x_in, batch, yt, aux_t, kw))
    out.layers.append(rec)
    return ys, yt


def _mlp(serve: Model, train: Model, layer: int, xs: torch.Tensor, xt: torch.Tensor, out: Capture,
         mode: str, replay: Replay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    ys, aux_s = serve.mlp(layer, xs)
    ids = (replay or Replay()).expert_ids(layer, aux_s)
    kw = {} if ids is None else {"replay": ids}
    yt, aux_t = train.mlp(layer, xs if mode == "isolated" else xt, **kw)
    rec = _record(serve, layer, MLP, yt, ys)
    if _has(aux_s, aux_t, "experts"):
        rec["expert_overlap"] = metrics.selection_overlap(aux_t["experts"], aux_s["experts"])
    if ids is not None:
        rec["replayed"] = "experts"
    out.layers.append(rec)
    return ys, yt


def _record(model: Model, layer: int, sub_block: str, train: torch.Tensor, serve: torch.Tensor) -> dict[str, Any]:
    if train.shape != serve.shape:
        raise GlmconvError(f"layer {layer} {sub_block}: train streams {tuple(train.shape)} but serve "
                           f"{tuple(serve.shape)}")
    return {"layer": layer, "sub_block": sub_block, "attn_type": model.attn_types[layer],
            "mlp_type": model.mlp_types[layer], "rel_err": metrics.rel_err(train, serve),
            "max_abs": metrics.max_abs(train, serve)}


def _kernel_error(twin: Model, layer: int, x_in: torch.Tensor, batch: Batch, yt: torch.Tensor,
                  aux_t: dict, kw: dict | None = None) -> dict[str, Any]:
    """The train side with kernels against itself on the references, on the same input streams (and replay)."""
    yr, aux_r = twin.attention(layer, x_in, batch.cu_seqlens, **(kw or {}))
    rec: dict[str, Any] = {"kernel_rel_err": metrics.rel_err(yt, yr)}
    if _has(aux_r, aux_t, "out"):
        rec["kernel_out_rel_err"] = metrics.rel_err(aux_t["out"], aux_r["out"])
    if _has(aux_r, aux_t, "topk"):
        rec["kernel_topk_overlap"] = metrics.selection_overlap(aux_t["topk"], aux_r["topk"])
    return rec


def _has(aux_s: dict | None, aux_t: dict | None, key: str) -> bool:
    return bool(aux_s) and bool(aux_t) and aux_s.get(key) is not None and aux_t.get(key) is not None


class StepProgress:
    """Counts parity steps: a rich bar on a terminal, a plain line every few seconds otherwise, or nothing."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, every_s: float = 5.0) -> None:
        self.label, self.total, self.enabled, self.every_s = label, total, enabled, every_s
        self.done = 0
        self._rich: Any = None
        self._task: Any = None
        self._last = time.monotonic()

    def __enter__(self) -> StepProgress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[step]}", markup=False), TimeElapsedColumn(),
                                  console=Console(stderr=True), transient=True)
            self._rich.__enter__()
            self._task = self._rich.add_task(self.label, total=self.total, step="")
        return self

    def __call__(self, step: str) -> None:
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, step=printable(step))
        elif self.enabled and time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            print(printable(f"{self.label}: {self.done}/{self.total} steps ({step})"), file=sys.stderr, flush=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.__exit__(exc_type, exc, tb)
