"""glmconv: move GLM-5.3-Flash between HF checkpoints and Megatron-core torch_dist, and prove parity."""

__version__ = "0.1.0"
