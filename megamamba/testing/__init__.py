"""What the tests and the benchmarks share to check the kernels and the model: the numerical rule
(`numerics`), Triton's interpreter made to compute bf16 as a GPU does (`interpreter_bf16`) and
mamba_ssm loaded from its source release to run beside ours (`mamba_ssm_release`). The trainer
never imports it."""
