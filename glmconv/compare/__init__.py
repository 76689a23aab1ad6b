"""`glmconv parity`: layerwise train-vs-serve parity of an HF checkpoint and its torch_dist conversion.

The serve model reads HF_DIR with HF/sglang conventions, the train model reads MCORE_DIR (in its Megatron
layout, miles or mcore: glmconv.checkpoint_layout) with Megatron conventions (each switch settable; the defaults
follow the layout: the mcore layout's trainer runs the token-level DSA indexer, `indexer_kpool=off`); both run
the same packed tokens and every sub-block is compared.

The verdict (glmconv.compare.verdict) is calibrated in the run itself: each side also runs as its fp32
torch-reference twin, so every sub-block carries the noise its dtype and kernels make on that very input, and
the train-vs-serve difference of weights and conventions alone. A sub-block diverges when its weights differ,
when that reference difference exceeds the floor (`--threshold`, default 1e-5 relative), or when the observed
error exceeds twice the measured noise; without `--fail-on` a named divergence fails the run.
`--self-test` also plants each defect of the catalog (glmconv.compare.defects) in memory and reports, per
defect, whether the verdict names it, in the same pass over the layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from glmconv.compare import defects
from glmconv.compare.capture import Side, StepProgress, capture, steps
from glmconv.compare.catalog import select
from glmconv.compare.fingerprint import check_same_weights
from glmconv.compare.inputs import Batch, load_prompt_file, random_batch
from glmconv.compare.memory import check_resident_fits, peak_memory, start_peak
from glmconv.compare.options import ParityOptions, check_self_test, judge_of
from glmconv.compare.replay import Replay, load_replay_file
from glmconv.compare.report import build_report
from glmconv.config import GlmConfig
from glmconv.defaults import DEFAULT_LAYOUT, DEFAULT_TOKENS, MEGATRON_BACKEND, PARITY_DTYPES, TRAIN_CONVENTIONS
from glmconv.errors import GlmconvError
from glmconv.io.checkpoint_files import check_checkpoint_dir, optional_file
from glmconv.io.config_file import load_config
from glmconv.io.file_names import CONFIG_NAME
from glmconv.mistakes import check_same_config
from glmconv.models.conventions import Conventions, Sides
from glmconv.models.megatron import megatron_model
from glmconv.models.model import GlmModel
from glmconv.models.weights import HfWeights, MegatronWeights

__all__ = ["DEFAULT_TOKENS", "ParityOptions", "run_parity"]


def run_parity(opts: ParityOptions) -> dict[str, Any]:
    """Build both models, run them over the batch, and return the report (see `report.build_report`)."""
    import torch

    if opts.dtype not in PARITY_DTYPES:
        raise GlmconvError(f"--dtype {opts.dtype!r}: choose from {', '.join(PARITY_DTYPES)}")
    check_self_test(opts.self_test, opts.defects)
    config = load_config(opts.hf_dir)
    _check_same_config(config, opts.mcore_dir)
    replay = Replay.parse(opts.replay)
    batch = make_batch(opts, config.dim("vocab_size"))
    if opts.replay_file is not None:
        replay = load_replay_file(Path(opts.replay_file), replay, config, batch.cu_seqlens)
    device = torch.device(check_device(opts.device))
    start_peak(device)
    serve, train, conventions = build_models(config, opts)
    judge = judge_of(opts)
    serve_precise, train_precise = (getattr(m, "precise_twin", lambda: None)() for m in (serve, train))
    variants, skipped = self_test_sides(config, train, train_precise, conventions, opts) if opts.self_test else ([], [])
    with StepProgress("parity", steps(serve), enabled=opts.progress) as progress:
        twin = kernel_path(train)
        cap = capture(serve, train, batch.to(opts.device), opts.mode, progress, twin=twin, replay=replay,
                      serve_precise=serve_precise, train_precise=train_precise, conventions=conventions,
                      judge=judge, variants=variants)
    layout = getattr(getattr(train, "weights", None), "layout", None)  # the train side's Megatron layout
    report = build_report(cap, opts, batch, conventions, train_layout=layout, skipped=skipped)
    report["serve_rounded_to_bf16"] = len(getattr(getattr(serve, "weights", None), "rounded", ()))
    report["peak_memory"] = peak_memory(device)
    return report


def kernel_path(model: GlmModel) -> GlmModel | None:
    """The twin of a model that runs kernels (the same model on the references), its kernels checked from now
    on against those references (glmconv.kernels.check); None for a model on the references."""
    twin = getattr(model, "kernel_twin", lambda: None)()
    if twin is not None:
        model.check_kernels()
    return twin


NO_KERNEL_PATH = ("the train side runs the torch references (--kernels reference, or auto off CUDA): there is no "
                  "kernel path to plant it in (--kernels emulated runs the kernel path on the references)")


def self_test_sides(config: GlmConfig, train: GlmModel, train_precise: GlmModel | None,
                    conventions: Sides, opts: ParityOptions) -> tuple[list[Side], list[dict[str, str]]]:
    """One train side per applicable catalog defect, planted in memory over the train side's weights, conventions
    or kernel path; and the defects that cannot be planted here, each with the reason."""

    train_conv = conventions.train
    sides, skipped = [], []
    for defect in select(opts.defects):
        planted = defects.plant(defect, config, train_conv)
        if planted is None:
            continue
        if defect.kind == "kernel" and train.ops.is_reference:
            skipped.append({"defect": defect.name, "kind": defect.kind, "why": NO_KERNEL_PATH})
            continue
        why = getattr(train, "cannot_plant", lambda *_: None)(defect, planted.sites)  # the megatron backend
        if why:
            skipped.append({"defect": defect.name, "kind": defect.kind, "why": why})
            continue
        conv = planted.conventions or train_conv
        model = train.variant(conv, patch=planted.patch if defect.kind == "weights" else None,
                              kernels=train.kernels, ops=planted.ops(train.ops) if defect.kind == "kernel" else
                              train.ops)
        precise = model.precise_twin()
        if precise is not None and train_precise is not None:
            precise.cache = train_precise.cache  # fp32 casts of the clean weights, shared (patches apply after)
        sides.append(Side(defect.name, model, conv, precise, twin=kernel_path(model),
                          sites=frozenset(planted.sites), judge=judge_of(opts)))
    return sides, skipped


def make_batch(opts: ParityOptions, vocab: int) -> Batch:
    """Random tokens from --seed, or the ids of --prompt-file."""

    if opts.prompt_file is not None:
        return load_prompt_file(opts.prompt_file, vocab)
    return random_batch(vocab, opts.tokens, opts.sequences, opts.seed)


def build_models(config: GlmConfig, opts: ParityOptions) -> tuple[GlmModel, GlmModel, Sides]:
    """(serve model, train model, both sides' conventions); tests replace this with fakes."""
    import torch

    device = check_device(opts.device)
    dtype = torch.float32 if opts.dtype == "fp32" else torch.bfloat16
    if not opts.stream_layers:
        check_resident_fits(config, dtype, torch.device(device))
    serve_w, train_w = HfWeights(opts.hf_dir, device=device), MegatronWeights(opts.mcore_dir)
    serve_w.round_like(train_w)  # a `convert --dtype bf16` pair: serve runs the BF16 weights the train side holds
    if not opts.allow_different_weights:
        check_same_weights(serve_w, train_w, opts.hf_dir, opts.mcore_dir)
    has_hc_head = train_w.hc_head() is not None
    serve_conv, train_conv = resolve_conventions(opts, has_hc_head, train_w.layout)
    if train_conv.output_contraction == "learned" and not has_hc_head:  # fail before the run, not at its head
        raise GlmconvError(f"--train-convention output_contraction=learned: {opts.mcore_dir} has no hc_head_* "
                           "tensors (GLM-5.3-Flash contracts its streams by mean)")
    stream = opts.stream_layers
    serve = GlmModel(config, serve_w, serve_conv, dtype=dtype, device=device, stream=stream)
    train = GlmModel(config, train_w, train_conv, dtype=dtype, device=device, kernels=opts.kernels, stream=stream)
    if opts.train_backend == MEGATRON_BACKEND:  # its DSA attention and MoE: megatron-core's own modules
        train = megatron_model(config, train_w, opts.mcore_dir, train_conv, dtype, device, opts.kernels, stream)
    return serve, train, Sides(serve_conv, train_conv)


def resolve_conventions(opts: ParityOptions, has_hc_head: bool = False,
                        layout: str | None = None) -> tuple[Conventions, Conventions]:
    """Serve conventions, and the train side's: the Megatron defaults of the checkpoint's `layout` (or serve's),
    then each KEY=VALUE override."""

    if opts.train_conventions not in TRAIN_CONVENTIONS:
        raise GlmconvError(f"--train-conventions {opts.train_conventions!r}: choose from "
                           f"{', '.join(TRAIN_CONVENTIONS)}")
    base = (Conventions.serve() if opts.train_conventions == "serve"
            else Conventions.train_default(has_hc_head, layout or DEFAULT_LAYOUT))
    try:
        train = base.with_overrides(list(opts.overrides))
    except GlmconvError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise GlmconvError(f"--train-convention: {exc}") from None
    return Conventions.serve(), train


def check_device(device: str) -> str:
    """A torch device string that exists here (a missing GPU is a user error, not a traceback)."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise GlmconvError(f"--device {device!r}: {exc}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise GlmconvError(f"--device {device}: no such CUDA device here")
    return device


def _check_same_config(config: GlmConfig, mcore_dir: Path) -> None:
    """A converted checkpoint carries its config.json: refuse a pair that describes different models."""

    path = optional_file(check_checkpoint_dir(Path(mcore_dir)), CONFIG_NAME)
    if path is None:
        return  # the train side's weights say more (MegatronWeights finds the config or refuses)
    check_same_config(config, load_config(path), "the HF config", mcore_dir)
