"""Pure-PyTorch reference ops: the CPU path of training and the tests' oracle."""
