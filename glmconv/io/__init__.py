"""Checkpoint I/O: safetensors reading and writing, FP8 block (de)quantisation."""
