"""A launched rank that runs only the start-up placement check, the way launch/train.py calls it.

    deepspeed ... tests/multinode/placement_entry.py <tensor-parallel size> <pipeline-parallel size>

Prints the report on global rank 0 and exits 0, or prints `placement_entry.py: error: <message>`
on every rank and exits 2. No model is built, so a launch costs only the launcher's start-up.
"""

import os
import sys

from megamamba.parallel.groups import init_distributed, shutdown_distributed, topology
from megamamba.parallel.placement import PlacementError, check_placement


def main(tp: int, pp: int) -> None:
    init_distributed()  # as launch/train.py: DeepSpeed's, then its /dev/shm buffer name released
    world = int(os.environ["WORLD_SIZE"])
    try:
        check_placement(topology(tp, pp, world // (tp * pp)))
    except PlacementError as e:
        print(f"placement_entry.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    shutdown_distributed()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(int(args[0]), int(args[1]))
