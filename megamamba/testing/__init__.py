"""What the tests and the benchmarks share to check the kernels, the model and the trainer: the
numerical rule (`numerics`), Triton's interpreter made to compute bf16 as a GPU does
(`interpreter_bf16`), mamba_ssm loaded from its source release to run beside ours
(`mamba_ssm_release`) and commands run with a log and a hard timeout (`processes`). The trainer
never imports it."""
