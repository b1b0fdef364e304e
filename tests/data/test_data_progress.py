"""The progress printer redraws one line on a terminal and prints plain lines elsewhere (no '\\r' in logs)."""

import io

from megamamba.data.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _drive(stream, interval):
    progress = Progress(1000, "work", stream=stream, interval=interval)
    for done in range(100, 1001, 100):
        progress.update(done, done // 10)
    progress.close()
    return stream.getvalue()


def test_a_terminal_gets_one_line_redrawn_in_place():
    text = _drive(Terminal(), interval=0)
    assert text.count("\r") == 11 and text.count("\n") == 1 and text.endswith("\n")
    assert text.split("\r")[-1].startswith("work: 100.0% | 100 docs |")


def test_a_log_gets_plain_lines_and_no_carriage_return():
    text = _drive(io.StringIO(), interval=0)
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 11
    assert lines[0].startswith("work:  10.0% | 10 docs |") and lines[-1].startswith("work: 100.0% | 100 docs |")


def test_a_log_by_default_gets_a_line_at_most_every_30_seconds_and_the_final_one():
    progress = Progress(1000, "work", stream=io.StringIO())
    assert not progress.terminal and progress.interval == 30.0
    assert Progress(1000, "work", stream=Terminal()).interval == 0.5
    lines = _drive(io.StringIO(), interval=None).splitlines()
    assert len(lines) == 1 and "ETA" in lines[0]
