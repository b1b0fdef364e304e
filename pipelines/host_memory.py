"""Host memory at start-up: freed tensors go back to the operating system.

glibc serves an allocation from the heap unless it is at least its mmap threshold, which starts at
128 KiB and rises to the size of every mapped block freed (up to 32 MiB). Building a tensor-parallel
shard or a pipeline stage draws full tensors and frees them (`megamamba.lm.build_piece`,
`pipelines.engine.InitialState`), so the threshold rises and the stage's own parameters land in the
heap; when DeepSpeed then flattens them into one buffer, the freed originals stay resident in the
heap, one more copy of the stage at start-up's peak. A fixed threshold maps every tensor of
HOST_MMAP_THRESHOLD bytes or more on its own, and freeing it unmaps it. Measured on
mamba2-370m at (dp, tp, pp) = (1, 2, 2): peak RSS per rank 2.02 -> 1.66 GiB.
"""
import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
HOST_MMAP_THRESHOLD = 1 << 20  # bytes; parameters, optimizer state and buffers are far larger


def unmap_freed_tensors() -> None:
    """Fix glibc's mmap threshold at HOST_MMAP_THRESHOLD (from now on in this process); nothing without glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc
        return
    mallopt(M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD)
