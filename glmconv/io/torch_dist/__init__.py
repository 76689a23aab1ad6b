"""Megatron-core torch_dist checkpoints: metadata, tensor reading, DCP writing, torch.save records, common state."""
