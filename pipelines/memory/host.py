"""Host memory at start-up: freed tensors go back to the operating system.

glibc serves an allocation from the heap unless it is at least its mmap threshold, which starts at
128 KiB and rises to the size of every mapped block freed (up to 32 MiB). Building a tensor-parallel
shard or a pipeline stage draws full tensors and frees them (`megamamba.model.layers.build_layer`,
`pipelines.loop.engine.InitialState`), so the threshold rises and the stage's own parameters land in the
heap; when DeepSpeed then flattens them into one buffer, the freed originals stay resident in the
heap, one more copy of the stage at start-up's peak. A fixed threshold maps every tensor of
HOST_MMAP_THRESHOLD bytes or more on its own, and freeing it unmaps it. Measured on
mamba2-370m at (dp, tp, pp) = (1, 2, 2): peak RSS per rank 2.02 -> 1.66 GiB.

Only for start-up: in training every activation of a CPU step would be mapped, zero-filled page by
page and unmapped again (a Mamba-2 of d_model 256 at 4 x 512 tokens, one thread: a CPU step 0.34 -> 0.69 s,
system time 0.4 -> 2.8 s). `reuse_freed_tensors` then sets the thresholds glibc's dynamic rule
ends at, so the heap serves tensors below 32 MiB again.
"""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
HOST_MMAP_THRESHOLD = 1 << 20  # bytes; parameters, optimizer state and buffers are far larger
TRAINING_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for its dynamic threshold on 64-bit hosts


def _mallopt(*settings: tuple) -> None:
    """glibc's mallopt(parameter, value) for each setting; nothing without glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc
        return
    for parameter, value in settings:
        mallopt(parameter, value)


def unmap_freed_tensors() -> None:
    """Fix glibc's mmap threshold at HOST_MMAP_THRESHOLD until `reuse_freed_tensors`."""
    _mallopt((M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD))


def reuse_freed_tensors() -> None:
    """After start-up: the heap serves tensors below TRAINING_MMAP_THRESHOLD and keeps freed memory for reuse
    (trimmed above twice that), as glibc's dynamic threshold would once it had risen to its ceiling."""
    _mallopt((M_MMAP_THRESHOLD, TRAINING_MMAP_THRESHOLD), (M_TRIM_THRESHOLD, 2 * TRAINING_MMAP_THRESHOLD))
