"""Checkpoint I/O, bytes and files only: `safetensors/` (HF side) and `torch_dist/` (Megatron side); the
format-neutral pieces here.

File names (`file_names`), the dtype table (`dtypes`), byte copies (`byte_copy`), capped JSON (`jsonfile`), config
files (`config_file`), the one symlink rule for input files (`checkpoint_files`), the NaN/Inf scan of bytes that are
only copied (`finite`), sidecars and atomic output (`output`). FP8 maths are `glmconv.numerics`'.
"""
