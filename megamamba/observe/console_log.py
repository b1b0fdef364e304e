"""The trainer's console: library modules log through `logging`, and `configure()` shows each
record as `train.py: message`, `train.py: warning: message` (both on stdout) or
`train.py: error: rank R: message` (stderr), one write per line so that ranks sharing a pipe
never interleave within a line. Warnings of the package (`MegamambaWarning`) become such warning lines
too; Python's other warnings keep their own format."""

import logging
import sys
import warnings

import torch.distributed as dist

from megamamba.errors import MegamambaWarning

PROGRAM = "train.py"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Console(logging.Handler):
    """Writes to the current sys.stdout / sys.stderr (not the ones of when it was made)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            stream, line = sys.stderr, f"{PROGRAM}: error: rank {_rank()}: {message}"
        elif record.levelno >= logging.WARNING:
            stream, line = sys.stdout, f"{PROGRAM}: warning: {message}"
        else:
            stream, line = sys.stdout, f"{PROGRAM}: {message}"
        stream.write(line + "\n")
        stream.flush()


def show(text: str) -> None:
    """Write `text` (lines without the prefix, such as a table) as it is, with its newline in one write:
    the launcher runs ranks unbuffered, where print's separate newline lets lines of ranks sharing a
    pipe run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _ShowWarning:
    """`warnings.showwarning` that logs a MegamambaWarning as one console line and hands any other warning
    to the function it replaced."""

    def __init__(self, python_show):
        self.python_show = python_show

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        if issubclass(category, MegamambaWarning):
            logging.getLogger("megamamba").warning(str(message))
        else:
            self.python_show(message, category, filename, lineno, file, line)


def configure() -> None:
    """Route the package's records (logger `megamamba`, INFO and up) and its warnings to the console, once."""
    logger = logging.getLogger("megamamba")
    logger.handlers = [h for h in logger.handlers if not isinstance(h, _Console)] + [_Console()]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    if not isinstance(warnings.showwarning, _ShowWarning):
        warnings.showwarning = _ShowWarning(warnings.showwarning)
