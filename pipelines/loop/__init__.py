"""The training step: the DeepSpeed engines, the ranks' agreement, gradient clipping and fault handling."""
