"""A job's state across runs: saving and loading checkpoints, resuming, and starting from existing weights."""
