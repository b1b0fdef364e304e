"""The calibration's one clock: the median wall time of a call after warm-up runs, the device synchronized."""
import statistics
import time
from typing import Callable

import torch

REPEATS = 7
WARM_UP = 2  # the first runs compile Triton kernels and fill the allocator's caches


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median wall time of `fn` over REPEATS runs after WARM_UP runs."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(WARM_UP):
        fn()
    sync()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
