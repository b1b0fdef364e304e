"""The error of a dataset that cannot be used as it is (its own module: indexed.py and the record modules
both raise it, and the record modules are imported by indexed.py)."""

from megamamba.errors import MegamambaError


class DatasetError(MegamambaError, ValueError):
    """A .bin/.idx pair (or its record) that cannot be used as it is; the message names the file and the problem."""
