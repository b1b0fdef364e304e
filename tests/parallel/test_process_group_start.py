"""Starting the process group (`megamamba.parallel.groups.init_distributed`): a slow start says what it waits
for on each node's first rank, a quick one says nothing. DeepSpeed's start is replaced by a wait, so no group
is made."""

import logging
import time

import pytest

from megamamba.parallel import groups


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def start_taking(monkeypatch):
    """init_distributed with DeepSpeed's start taking the given seconds; the messages it logged."""
    records = Records()
    groups.log.addHandler(records)
    monkeypatch.setattr(groups.log, "level", logging.INFO)
    monkeypatch.setattr(groups, "SLOW_START_S", 0.05)
    monkeypatch.setattr(groups.dist, "barrier", lambda: None)
    monkeypatch.setattr(groups.dist, "get_rank", lambda: 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    def run(seconds: float) -> list:
        monkeypatch.setattr(groups.deepspeed, "init_distributed", lambda **kwargs: time.sleep(seconds))
        groups.init_distributed()
        return records.messages

    yield run
    groups.log.removeHandler(records)


def test_a_slow_process_group_start_says_deepspeed_builds_its_cpu_op(start_taking):
    (message,) = start_taking(0.5)
    assert message.startswith("still starting the process group after 0 s: DeepSpeed builds its CPU communication")


def test_a_quick_process_group_start_says_nothing(start_taking):
    messages = start_taking(0.0)
    time.sleep(0.1)  # past the notice's time: it was cancelled, not late
    assert messages == []
