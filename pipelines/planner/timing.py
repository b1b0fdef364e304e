"""The calibration's one clock (the median wall time of a call after warm-up runs, the device synchronized)
and its one way to time on several processes."""

import socket
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


def on_ranks(fn: Callable, world: int, *args):
    """What rank 0 of `world` spawned processes puts in its queue, each run as fn(rank, world, port, *args,
    queue) with `port` free on this host for their process group."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(fn, args=(world, port, *args, results), nprocs=world, start_method="spawn")
    return results.get()
