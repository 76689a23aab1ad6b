"""The one spelling of every file name glmconv reads or writes in a checkpoint, and of the common-state entry.

Tensor names are the rules' business (`glmconv.rules.names`).
"""

# HF safetensors checkpoints
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"  # an unsharded checkpoint: one file, no index
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"  # .format(i, n), i from 1

# Megatron-core torch_dist checkpoints
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # an iteration number or "release"; written last
RELEASE = "release"  # the iteration directory the tracker's "release" names
MCORE_METADATA_NAME = "metadata.json"  # {"sharded_backend": "torch_dist", ...} in the iteration directory
DCP_METADATA_NAME = ".metadata"  # torch.distributed.checkpoint's pickled Metadata
COMMON_PT_NAME = "common.pt"  # the common state of checkpoints older than megatron-core 0.19
COMMON_STATE = "common_state"  # megatron-core 0.19.2's ShardedObject key of the common state ...
COMMON_STATE_KEY = f"{COMMON_STATE}/shard_0_1"  # ... and its DCP entry (`ShardedObject.unique_key`)

# glmconv's own
MANIFEST_NAME = "glmconv.json"  # in every directory glmconv publishes; `written_by` marks it as glmconv's
KEPT_DIR = "glmconv_kept"  # in the iteration directory: a DCP of the tensors no trainer loads (`.metadata` its own)
SIDECAR_DIR = "hf_sidecars"  # in a converted checkpoint: the HF source's tokenizer and generation files
