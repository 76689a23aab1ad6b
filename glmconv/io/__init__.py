"""Checkpoint I/O: `safetensors/` (HF side) and `torch_dist/` (Megatron side); the format-neutral pieces here.

File names (`file_names`), the dtype table (`dtypes`), FP8 blocks (`fp8`, `fp8_exact`), byte copies (`byte_copy`),
capped JSON (`jsonfile`), the one symlink rule for input files (`checkpoint_files`) and `--check-finite` (`finite`).
"""
