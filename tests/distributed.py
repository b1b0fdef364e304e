"""Run a function on N freshly spawned ranks forming a gloo group, as the deepspeed launcher would.

    results = run_ranks(check_something, world_size=4, args=(seed,))

Each rank is a new process with the caller's environment plus the launcher's (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT on a port free at
start-up), one torch thread, and, unless `init_process_group=False`, the default process group
already initialised with gloo. Ranks are forked from a server process that has imported torch and
DeepSpeed once (`PRELOAD`), rather than each importing them again. `fn` must be a top-level function
of an importable module (a test module is); its picklable return values come back in rank order. The
first rank's exception to arrive is re-raised in the caller with that rank's traceback attached (the
other ranks, often blocked in a collective, are then stopped); a run that does not finish within
`timeout` seconds is killed and fails, naming the ranks still running. Ranks run in strict mode
(tests/strict_collectives.py: host tensors in collectives and large object collectives fail as they
would under NCCL) unless `strict=False`."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import strict_collectives

# Imported once by the server the ranks are forked from. A rank spawned afresh spent about 4 s of CPU importing
# these: torch, DeepSpeed, and the TorchDynamo and Inductor modules that DeepSpeed's ZeRO optimizer check and a
# meta-device model build import; a suite starts hundreds of ranks on two cores.
PRELOAD = ["torch", "torch.distributed", "deepspeed", "torch._dynamo", "torch._inductor.compile_fx"]


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the cause of the re-raised exception."""

    def __str__(self) -> str:
        return self.args[0]


class RankFailed(RuntimeError):
    """A rank raised an exception that cannot be pickled, or died without reporting."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, args, env, rank, world_size, port, init_process_group, timeout, strict, results):
    os.environ.clear()  # the forkserver's environment is the caller's as it was when the server started
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if strict:
            strict_collectives.install()
        else:
            strict_collectives.uninstall()
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            payload = ("ok", pickle.dumps(fn(*args)))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        text = traceback.format_exc()
        try:
            payload = ("error", pickle.dumps(exc), text)
        except Exception:  # noqa: BLE001 - unpicklable exception: send its text
            payload = ("error", None, text)
    results.put((rank, payload))


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def _peer_gone(traceback_text: str) -> bool:
    return any(marker in traceback_text for marker in _PEER_GONE)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    init_process_group: bool = True,
    strict: bool = True,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` ranks; return their results in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    port = free_port()
    env = {**os.environ, strict_collectives.ENV: "1" if strict else "0"}  # read by processes a rank starts
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, tuple(args), env, r, world_size, port, init_process_group, timeout, strict, results),
            name=f"rank{r}",
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            failed = [r for r, o in outcome.items() if o[0] == "error"]
            # After one rank fails the others usually block in a collective: give them a moment.
            wait = min(deadline - time.monotonic(), 5.0 if failed else 1.0)
            if wait <= 0:
                break
            try:
                rank, payload = results.get(timeout=wait)
                outcome[rank] = payload
            except queue.Empty:
                if failed:
                    break
                silent = [r for r, p in enumerate(procs) if r not in outcome and not p.is_alive()]
                if silent:
                    time.sleep(0.5)  # a result put just before exit may still be in the pipe
                    while not results.empty():
                        rank, payload = results.get()
                        outcome[rank] = payload
                    silent = [r for r in silent if r not in outcome]
                    if silent:
                        raise RankFailed(
                            f"rank(s) {silent} exited with codes "
                            f"{[procs[r].exitcode for r in silent]} without reporting a result"
                        ) from None
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
    # In order of arrival, but a rank that failed only because a peer's process went away (its
    # gloo connection reset) reports a consequence, not the cause: those go last.
    errors = sorted(((r, o) for r, o in outcome.items() if o[0] == "error"), key=lambda e: _peer_gone(e[1][2]))
    if errors:
        rank, (_, pickled, text) = errors[0]
        others = f" (then ranks {[r for r, _ in errors[1:]]} failed too)" if len(errors) > 1 else ""
        cause = RemoteTraceback(f"\n--- rank {rank} of {world_size}{others} ---\n{text}")
        if pickled is not None:
            raise pickle.loads(pickled) from cause
        raise RankFailed(f"rank {rank} failed{others}") from cause
    missing = [r for r in range(world_size) if r not in outcome]
    if missing:
        raise TimeoutError(
            f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
            f"(running {fn.__module__}.{fn.__qualname__})"
        )
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def group_members(group) -> list[int]:
    """Global ranks in `group`, found by communicating over it (so the group is real)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    mine = torch.tensor([dist.get_rank()])
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return [int(p) for p in parts]
