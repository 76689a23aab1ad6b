"""What a parity run is asked to do (the CLI's flags), and the verdict's rules that follow from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from glmconv import defaults as D
from glmconv.compare.metrics import Bound
from glmconv.compare.verdict import STREAM_FLOOR, Floors, Judge
from glmconv.errors import GlmconvError

DEFECTS_NEED_SELF_TEST = ("--defects picks the defects --self-test plants, and nothing is planted without it: add "
                          "--self-test, or drop --defects")


@dataclass(frozen=True)
class ParityOptions:
    """Everything a parity run is asked to do (the CLI's flags)."""

    hf_dir: Path
    mcore_dir: Path
    tokens: int = D.DEFAULT_TOKENS
    sequences: int = 1
    seed: int = D.DEFAULT_SEED
    prompt_file: Path | None = None
    mode: str = D.DEFAULT_MODE
    dtype: str = D.DEFAULT_PARITY_DTYPE
    device: str = D.DEFAULT_PARITY_DEVICE
    train_conventions: str = D.DEFAULT_TRAIN_CONVENTIONS
    overrides: tuple[str, ...] = ()
    threshold: float | None = None
    bounds: tuple[Bound, ...] = field(default_factory=tuple)
    progress: bool = True
    allow_different_weights: bool = False  # skip the check that MCORE_DIR is a conversion of HF_DIR
    kernels: str = D.DEFAULT_KERNELS  # train side: GPU kernels on CUDA (auto) or the torch references everywhere
    stream_layers: bool = False  # hold one layer's weights at a time (a full-size model on one GPU)
    replay: str = D.DEFAULT_REPLAY  # routing | indexer | both: the train side uses the serve side's selections
    replay_file: Path | None = None  # ... or those of a payload file instead (replay.load_replay_file)
    self_test: bool = False  # also run the planted-defect catalog (glmconv.compare.defects) in the same pass
    defects: str | None = None  # comma-separated catalog names for the self-test (None: all)
    train_backend: str = D.DEFAULT_TRAIN_BACKEND  # megatron: megatron-core's DSA attention and MoE modules

    @property
    def effective_threshold(self) -> float:
        """The stream floor: the smallest rel err a divergence needs, whatever the noise."""

        return STREAM_FLOOR if self.threshold is None else self.threshold


def check_self_test(self_test: bool, defects: str | None) -> None:
    """--defects without --self-test is refused (it would silently do nothing)."""
    if defects is not None and not self_test:
        raise GlmconvError(DEFECTS_NEED_SELF_TEST)


def judge_of(opts: ParityOptions) -> Judge:
    """The verdict's rules for this run: its stream floor, its mode, whether weights are compared."""
    return Judge(Floors(stream=opts.effective_threshold), propagated=opts.mode == "propagated",
                 check_weights=not opts.allow_different_weights)
