"""A job's save directory at start-up: its lock taken, dead jobs' leftovers removed, its free space checked.

Under the lock no other job writes the directory, so the staging and aside folders of dead jobs on this
host (store.py) can go before anything else, and the free space is measured once they are gone. A
directory short of one checkpoint's size (space.py) is refused before training, with the lock released.
"""

import logging

from megamamba.checkpoint.lock import SaveDirLock
from megamamba.checkpoint.space import CheckpointSize, check_room
from megamamba.checkpoint.store import remove_leftovers

log = logging.getLogger(__name__)


def open_save_dir(lock: SaveDirLock, size: CheckpointSize, world_size: int):
    """Take `lock`, remove leftovers, check the room for a checkpoint of `size` saved by `world_size` ranks;
    what `SaveDirLock.acquire` returns. CheckpointError (the lock released) when there is no room."""
    previous = lock.acquire()
    try:
        removed = remove_leftovers(lock.save_dir)
        if removed:
            log.info(f"removed what interrupted saves of dead jobs left in {lock.save_dir}: {', '.join(removed)}")
        check_room(lock.save_dir, size, world_size)
    except BaseException:
        lock.release()
        raise
    return previous
