"""Pipeline-parallel stages for DeepSpeed."""
