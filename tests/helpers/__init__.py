"""Helpers the tests share (not tests): checkpoints, goldens, terminals, megatron-core workers, fuzzing profiles."""
