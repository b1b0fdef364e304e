"""The package's warnings, such as a damaged checkpoint passed over at resume, reach train.py's console
as one `train.py: warning:` line; Python's other warnings keep their own format."""

import warnings

import pytest

from megamamba.checkpoint import CheckpointWarning
from megamamba.observe import console_log


def test_a_checkpoint_warning_is_one_train_py_warning_line(monkeypatch, capsys):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    console_log.configure()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn(
            "runs/x/latest is missing; resuming from the newest complete checkpoint step_000002",
            CheckpointWarning,
            stacklevel=1,
        )
    out, err = capsys.readouterr()
    assert (
        out == "train.py: warning: runs/x/latest is missing; resuming from the newest complete checkpoint step_000002\n"
    )
    assert err == ""


def test_other_warnings_stay_python_warnings(monkeypatch, capsys):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    console_log.configure()
    with pytest.warns(DeprecationWarning, match="a library's own warning"):
        warnings.warn("a library's own warning", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().out == ""
