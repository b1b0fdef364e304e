"""A progress display on stderr: fraction done, rate, elapsed time and ETA.

On a terminal one line is redrawn in place ('\\r'); elsewhere (a log file, a pipe, a launcher
collecting output) periodic plain lines are printed instead, so logs hold no carriage returns.
"""

import sys
import time
from typing import Optional


def clock(seconds: float) -> str:
    """h:mm:ss of a duration."""
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """`update(done_bytes, documents)` redraws at most every `interval` seconds (default: 0.5 s on a
    terminal, a plain line every 30 s elsewhere); `close()` draws the final line."""

    def __init__(self, total_bytes: int, label: str, stream=sys.stderr, interval: Optional[float] = None):
        self.total = max(total_bytes, 1)
        self.label = label
        self.stream = stream
        self.terminal = _is_terminal(stream)
        self.interval = interval if interval is not None else 0.5 if self.terminal else 30.0
        self.start = self._last = time.monotonic()
        self.done = self.documents = 0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = clock(eta) if eta != float("inf") else "?"
        return (
            f"{self.label}: {100 * self.done / self.total:5.1f}% | {self.documents} docs | "
            f"{rate / 1e6:.2f} MB/s, {self.documents / elapsed:.0f} docs/s | "
            f"elapsed {clock(elapsed)} | ETA {eta_text}"
        )

    def _draw(self, final: bool) -> None:
        if self.terminal:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def update(self, done_bytes: int, documents: int) -> None:
        self.done, self.documents = done_bytes, documents
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._draw(final=False)

    def close(self) -> None:
        self._draw(final=True)
