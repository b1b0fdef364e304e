"""The Mamba language model in plain PyTorch: its layer list, blocks, mixers and norms."""
