"""Tensor and sequence parallelism: the TP group, its layers and collectives, and how shards map to full tensors."""
