"""Running `python -m megamamba.checkpoint.convert` in-process from tests."""

import contextlib
import io
import re

import pytest

from megamamba.checkpoint.convert import main


def convert(*argv) -> None:
    main([str(a) for a in argv])


def refused(argv, match: str) -> str:
    """The one stderr line of a refusal with exit status 2."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as e, contextlib.redirect_stderr(err):
        convert(*argv)
    assert e.value.code == 2
    lines = [line for line in err.getvalue().splitlines() if not line.startswith("convert: note:")]
    assert len(lines) == 1 and lines[0].startswith("convert "), lines
    message = lines[0]
    assert re.search(match, message), message
    return message
