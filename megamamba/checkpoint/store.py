"""A save directory of checkpoints that a crash at any moment cannot corrupt.

Staging, fsync, rename, `latest` switched atomically, pruning; `find_latest`, `resolve_load` and
`resolve_model_folder` turn what the user gave into a verified checkpoint. One job writes a save
directory at a time (lock.py). The commit order and its one crash window: docs/checkpoints.md.
"""

import logging
import os
import re
import secrets
import shutil
import socket
import warnings
from typing import Optional

from megamamba.checkpoint import files
from megamamba.checkpoint.files import CheckpointError
from megamamba.checkpoint.lock import pid_alive
from megamamba.checkpoint.manifest import MANIFEST, verify, write_manifest
from megamamba.checkpoint.model_folder import CONFIG_FILE
from megamamba.errors import MegamambaWarning

LATEST = "latest"
STAGING_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
_TAG = re.compile(r"step_(\d+)")
# names this job's staging folders ("<pid>-<random>-<host>"; lock.py records it)
JOB_TOKEN = f"{os.getpid()}-{secrets.token_hex(3)}-{socket.gethostname()}"

log = logging.getLogger(__name__)


class NoCheckpointError(CheckpointError):
    """No complete checkpoint exists where one was asked for."""


class CheckpointWarning(MegamambaWarning):
    """A damaged checkpoint or `latest` was passed over."""


def tag_for(step: int) -> str:
    """The directory name of the checkpoint after `step` optimizer steps."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: must be an integer >= 0")
    return f"step_{step:06d}"


def step_of(tag: str) -> Optional[int]:
    """The step a checkpoint tag names, None when `tag` is not a checkpoint name."""
    m = _TAG.fullmatch(tag)
    return int(m.group(1)) if m else None


def check_save_dir(save_dir: str) -> None:
    """Create `save_dir` if needed and prove it writable (write, fsync, delete a probe file).

    Call at start-up, before training, so an unusable --save fails in seconds, not at the first save.
    """
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise CheckpointError(f"--save {save_dir}: not a directory; choose a directory you can write")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"--save {save_dir}: cannot create it ({e.strerror}); choose a directory you can write"
        ) from None
    probe = os.path.join(save_dir, f".write-test-{os.getpid()}")
    try:
        files.write_bytes(probe, b"megamamba\n")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"--save {save_dir}: not writable ({e.strerror}); fix its permissions or choose another directory"
        ) from None


def staging_dir(save_dir: str, tag: str) -> str:
    """Where this job stages the checkpoint `tag` (`stage`)."""
    return os.path.join(save_dir, f"{STAGING_PREFIX}{tag}-{JOB_TOKEN}")


def stage(save_dir: str, tag: str) -> str:
    """A new, empty staging directory for the checkpoint `tag` (beside its final place)."""
    staging = staging_dir(save_dir, tag)
    if os.path.exists(staging):
        files.remove_tree(staging)
    os.mkdir(staging)
    files.sync_dir(save_dir)
    return staging


def read_latest(save_dir: str) -> Optional[str]:
    """The tag in `<save_dir>/latest`, None when there is no such file; CheckpointError when malformed."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace").strip()
    if step_of(text) is None:
        raise CheckpointError(f"{path}: holds {text[:60]!r}, not a checkpoint tag like 'step_000123'")
    return text


def set_latest(save_dir: str, tag: str) -> None:
    """Point `latest` at `tag` atomically."""
    tmp = os.path.join(save_dir, LATEST + ".tmp")
    if os.path.exists(tmp):
        os.remove(tmp)
    files.write_bytes(tmp, (tag + "\n").encode())
    files.rename(tmp, os.path.join(save_dir, LATEST))


def checkpoint_tags(save_dir: str) -> list:
    """Tags of the checkpoint directories in `save_dir` (complete or not), newest step first."""
    tags = [n for n in os.listdir(save_dir) if step_of(n) is not None and os.path.isdir(os.path.join(save_dir, n))]
    return sorted(tags, key=step_of, reverse=True)


def commit(
    save_dir: str,
    staging: str,
    tag: str,
    step: int,
    keep_last: Optional[int],
    known: Optional[dict] = None,
    protect: Optional[str] = None,
) -> str:
    """Finish a save staged in `staging`: manifest (`known`: files hashed by their writers), rename to
    `<save_dir>/<tag>`, `latest`, retention (`protect`: a tag retention keeps). A failure before `latest`
    names the new checkpoint puts back what was there (the caller removes the staging folder); one after it
    (removing older checkpoints) is logged, the save kept."""
    write_manifest(staging, tag, step, known)
    final = os.path.join(save_dir, tag)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(save_dir, f"{ASIDE_PREFIX}{tag}-{JOB_TOKEN}")
        if os.path.exists(aside):
            files.remove_tree(aside)
        files.rename(final, aside)
    try:
        files.rename(staging, final)
        set_latest(save_dir, tag)
    except (OSError, CheckpointError):  # a full disk, say; a crash leaves it to find_latest and prune
        _put_back(final, staging, aside)
        raise
    try:
        if aside is not None:
            files.remove_tree(aside)
        prune(save_dir, keep_last, tag, protect)
    except OSError as e:  # the save is committed: what is left to remove is removed after the next one
        log.warning(f"saved {final}, but removing older checkpoints failed ({e}); the next save retries")
    return final


def _put_back(final: str, staging: str, aside: Optional[str]) -> None:
    """Undo the renames of a commit that failed before `latest` named it: the new checkpoint back to its
    staging folder, the one it replaced back in place."""
    if not os.path.exists(staging) and os.path.exists(final):
        files.rename(final, staging)
    if aside is not None and os.path.exists(aside):
        files.rename(aside, final)


def discard(save_dir: str, tag: str) -> None:
    """Remove this job's staging folder of the checkpoint `tag` (a failed or abandoned save), as far as it can."""
    shutil.rmtree(staging_dir(save_dir, tag), ignore_errors=True)


def check_keep_last(keep_last: Optional[int]) -> None:
    """ValueError unless keep_last is None (keep all) or a positive integer."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}: must be a positive integer or None (keep every checkpoint)")


def _leftover(name: str) -> bool:
    """Whether a staging or aside folder `name` belongs to this job or to a dead job on this host."""
    if name.endswith(f"-{JOB_TOKEN}"):
        return True
    parts = name.split("-", 4)  # ".tmp", "<tag>", "<pid>", "<random>", "<host>"
    if len(parts) != 5 or not parts[2].isdigit():
        return False
    return parts[4] == socket.gethostname() and not pid_alive(int(parts[2]))


def remove_leftovers(save_dir: str) -> list:
    """Delete the staging and aside folders of interrupted saves of this job or of dead jobs on this host;
    their names. Live or other hosts' jobs' folders are not touched."""
    names = sorted(n for n in os.listdir(save_dir) if n.startswith((STAGING_PREFIX, ASIDE_PREFIX)) and _leftover(n))
    for name in names:
        files.remove_tree(os.path.join(save_dir, name))
    return names


def _complete(path: str) -> bool:
    try:
        verify(path, hashes=False)
        return True
    except CheckpointError:
        return False


def prune(save_dir: str, keep_last: Optional[int], current: str, protect: Optional[str] = None) -> None:
    """Keep `current`, `protect` and the keep_last - 1 newest complete checkpoints before `current`;
    delete older complete ones and the leftovers of interrupted saves of this job or of dead jobs
    on this host. Checkpoints after `current` (left by an abandoned run), damaged ones and live or
    other hosts' jobs' staging folders are not touched. keep_last None keeps every checkpoint."""
    check_keep_last(keep_last)
    remove_leftovers(save_dir)
    if keep_last is None:
        return
    older = [t for t in checkpoint_tags(save_dir) if step_of(t) < step_of(current)]
    complete = [t for t in older if _complete(os.path.join(save_dir, t))]
    for tag in complete[keep_last - 1 :]:
        if tag != protect:
            files.remove_tree(os.path.join(save_dir, tag))


def find_latest(save_dir: str, hashes: bool = True) -> str:
    """The path of the checkpoint to resume from under `save_dir` (`--load auto`), verified.

    The one `latest` names when complete; otherwise, with a CheckpointWarning, the newest complete one.
    NoCheckpointError when there is none.
    """
    if not os.path.isdir(save_dir):
        raise NoCheckpointError(f"{save_dir}: no such directory, so no checkpoint to resume from")
    latest_file = os.path.join(save_dir, LATEST)
    try:
        latest = read_latest(save_dir)
        problem = f"{latest_file} is missing"
    except CheckpointError as e:
        latest, problem = None, str(e)
    if latest is not None:
        try:
            verify(os.path.join(save_dir, latest), hashes)
            return os.path.join(save_dir, latest)
        except CheckpointError as e:
            problem = f"{latest_file} names {latest}, which is unusable: {e}"
    rejected = []
    for tag in checkpoint_tags(save_dir):
        if tag == latest:
            continue
        try:
            verify(os.path.join(save_dir, tag), hashes)
        except CheckpointError as e:
            rejected.append(str(e))
            continue
        warnings.warn(f"{problem}; resuming from the newest complete checkpoint {tag}", CheckpointWarning, stacklevel=2)
        return os.path.join(save_dir, tag)
    if not checkpoint_tags(save_dir):
        rejected.append("it holds no step_* checkpoint")
    raise NoCheckpointError(f"no complete checkpoint under {save_dir}: {'; '.join([problem] + rejected)}")


def resolve_load(load: str, save_dir: Optional[str] = None, hashes: bool = True, flag: str = "--load") -> str:
    """The verified checkpoint path a `--load` value names (`flag`: the option named in errors).

    "auto": `find_latest(save_dir)`. A checkpoint directory (step_N, holding manifest.json): itself.
    A save directory: the checkpoint its `latest` names (CheckpointError when `latest` is missing).
    """
    if load == "auto":
        if not save_dir:
            raise CheckpointError("--load auto: resumes from the newest checkpoint under --save, but --save is not set")
        return find_latest(save_dir, hashes)
    if not os.path.isdir(load):
        raise CheckpointError(f"{flag} {load}: no such directory")
    if os.path.isfile(os.path.join(load, MANIFEST)) or step_of(os.path.basename(os.path.normpath(load))) is not None:
        verify(load, hashes)
        return load
    latest = read_latest(load)
    if latest is None:
        found = checkpoint_tags(load)
        hint = f" (it holds {', '.join(found[:3])}{', ...' if len(found) > 3 else ''})" if found else ""
        raise CheckpointError(
            f"{flag} {load}: no '{LATEST}' file{hint}; name a checkpoint directory such as "
            f"{os.path.join(load, found[0] if found else 'step_000100')}, or pass --load auto "
            "with --save to take the newest complete one"
        )
    path = os.path.join(load, latest)
    try:
        verify(path, hashes)
    except CheckpointError as e:
        raise CheckpointError(
            f"{flag} {load}: '{LATEST}' names {latest}: {e}; --load auto takes the newest complete checkpoint instead"
        ) from None
    return path


def resolve_model_folder(path: str, flag: str = "--checkpoint", hashes: bool = True) -> tuple:
    """(folder, verified): a checkpoint (it holds manifest.json or is named step_N) or a save directory
    (its `latest`) gives the checkpoint, every size (and with `hashes` every sha256) verified; a folder
    holding config.json without a manifest is a plain model folder, returned unverified."""
    plain = os.path.isfile(os.path.join(path, CONFIG_FILE)) and not os.path.isfile(os.path.join(path, MANIFEST))
    if plain and step_of(os.path.basename(os.path.normpath(path))) is None:
        return path, False
    return resolve_load(path, hashes=hashes, flag=flag), True
