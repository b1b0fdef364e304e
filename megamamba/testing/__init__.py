"""What the tests and the benchmarks share to check the kernels and the model: the numerical rule
(`numerics`). The trainer never imports it."""
