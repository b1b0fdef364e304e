"""The model's layer list as DeepSpeed runs it: pipeline stages, the pp = 1 module, the loss, the names."""
