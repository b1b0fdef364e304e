"""Session-wide test environment.

Without a GPU, Triton kernels run under its interpreter; the variable is read when
`@triton.jit` runs, so it is set here, before any test module imports a kernel. Each
virtual environment gets its own torch-extension cache (DeepSpeed JIT-builds an op on
`init_distributed`), so two environments never rebuild it for each other.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
