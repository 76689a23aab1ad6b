"""Every option's default and every choice list, defined once: the CLI, the Python API and the runners read them
here, so `glmconv convert --help`, `glmconv.convert()` and a run can never disagree."""

from __future__ import annotations

import os

AUTO = "auto"

# ---- conversion: convert, export, relayout, verify ----------------------------------------------------
DEFAULT_GROUP_BYTES = 1 << 30  # tensors written per data file: the peak memory of one worker
GROUP_SIZE_TEXT = "1GB"  # DEFAULT_GROUP_BYTES as --group-size shows it
DEFAULT_SHARD_BYTES = 5 * 10**9  # export: bytes per safetensors shard without --like or --max-shard-size
DEFAULT_CHUNK_BYTES = 256 << 20  # stacked experts are moved in steps of at most this many bytes
DEFAULT_AHEAD_BYTES = 1 << 30  # bytes of steps made ahead of a worker's writer, at most
READ_BUFFER_BYTES = 2 * DEFAULT_CHUNK_BYTES  # CPU buffers a reader thread keeps for reuse (glmconv/io/read_buffers.py)
DEFAULT_WORKERS = 1
MAX_WORKERS = 256
DEFAULT_THREADS = 2  # reader/dequantiser threads per worker, ahead of its writer
READ_THREADS_RANGE = (0, 64)
DEFAULT_DEVICE = AUTO
DEVICE_CHOICES = (AUTO, "cpu", "cuda")  # where FP8 weights are dequantised
KEEP, TO_BF16, TO_FP32 = "keep", "bf16", "fp32"
DEFAULT_DTYPE = KEEP
DTYPE_CHOICES = (KEEP, TO_BF16, TO_FP32)  # convert --dtype: what Megatron gets
MILES, MCORE = "miles", "mcore"
DEFAULT_LAYOUT = MILES
LAYOUT_CHOICES = (MILES, MCORE)  # the Megatron layouts (glmconv.rules.layouts describes each)
EMIT_CHOICES = ("hf", "mcore")  # audit-names --emit: the side whose expected tensor list is printed
ARGS_FORMAT_CHOICES = ("lines", "shell", "json")  # megatron-args --format: for a launcher, a script, a program
DEFAULT_ARGS_FORMAT = ARGS_FORMAT_CHOICES[0]
ZERO_COPY_ENV = "GLMCONV_ZERO_COPY"  # "0": never copy bytes file to file, always read through torch.load
# --workers N on one machine: a run reading less than this gets one worker (glmconv/runners/workers.py says why);
# GLMCONV_WORKER_MIN_BYTES=0 lets any run have its N (the tests' worker processes)
WORKER_MIN_BYTES = 100 * 10**9
WORKER_MIN_BYTES_ENV = "GLMCONV_WORKER_MIN_BYTES"

# ---- parity -----------------------------------------------------------------------------------------
DEFAULT_TOKENS = 128
DEFAULT_SEED = 0  # of the random tokens
DEFAULT_MODE = "propagated"
PARITY_MODES = (DEFAULT_MODE, "isolated")
DEFAULT_PARITY_DTYPE = "fp32"
PARITY_DTYPES = (DEFAULT_PARITY_DTYPE, "bf16")
DEFAULT_PARITY_DEVICE = "cpu"
DEFAULT_TRAIN_CONVENTIONS = "default"  # Megatron's own for the checkpoint's layout
TRAIN_CONVENTIONS = (DEFAULT_TRAIN_CONVENTIONS, "serve")
REFERENCE, EMULATED = "reference", "emulated"
DEFAULT_KERNELS = AUTO
# auto: the GPU kernels on CUDA, the torch references elsewhere; emulated: the kernel path (checks included) with
# the references standing in for the kernels
KERNEL_CHOICES = (AUTO, REFERENCE, EMULATED)
DEFAULT_REPLAY = "none"
REPLAY_CHOICES = (DEFAULT_REPLAY, "routing", "indexer", "both")
GLMCONV_BACKEND, MEGATRON_BACKEND = "glmconv", "megatron"
DEFAULT_TRAIN_BACKEND = GLMCONV_BACKEND
# parity's train side: glmconv's own model, or megatron-core's own DSA attention and MoE modules within it
TRAIN_BACKENDS = (DEFAULT_TRAIN_BACKEND, MEGATRON_BACKEND)


# ---- fixtures ---------------------------------------------------------------------------------------
DEFAULT_PRESET = "tiny"
DEFAULT_BENCH_BYTES = 10**9  # the bench preset's size without --size
DEFAULT_INIT = "realistic"
INIT_CHOICES = (DEFAULT_INIT, "unit")  # the real model's statistics, or every residual stream at RMS ~1


def worker_min_bytes() -> int:
    """The input a run needs before --workers N may start more than one worker (GLMCONV_WORKER_MIN_BYTES)."""
    value = os.environ.get(WORKER_MIN_BYTES_ENV, "")
    return int(value) if value.isdigit() else WORKER_MIN_BYTES


def zero_copy() -> bool:
    """Whether bytes that only move are copied file to file (unless GLMCONV_ZERO_COPY=0)."""
    return os.environ.get(ZERO_COPY_ENV, "1") != "0"
