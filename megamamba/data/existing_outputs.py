"""A command replaces a user's files only when asked: the refusal of outputs that exist already.

Tokenizer training and preprocessing check their output files before any work, so a refused
command leaves every file as it was; with `--overwrite` they skip the check and replace them.
"""

import os

from megamamba.errors import MegamambaError


class OutputExistsError(MegamambaError):
    """An output file of the command exists and --overwrite was not given."""


def refuse_existing(flag: str, value: str, paths: list[str]) -> None:
    """OutputExistsError naming those of `paths` (the outputs `flag value` chose) that exist."""
    existing = [path for path in paths if os.path.lexists(path)]
    if len(existing) == 1:
        raise OutputExistsError(
            f"{flag} {value}: {existing[0]} exists; choose another {flag} or pass --overwrite to replace it"
        )
    if existing:
        raise OutputExistsError(
            f"{flag} {value}: {', '.join(existing)} exist; choose another {flag} or pass --overwrite to replace them"
        )
