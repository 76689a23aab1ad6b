"""safetensors checkpoints: header validation, the HF checkpoint (index, config), tensor reading, shard writing."""
