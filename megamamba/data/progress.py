"""A one-line progress display on stderr: fraction done, rate, elapsed time and ETA."""
import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """`update(done_bytes, documents)` redraws at most every `interval` seconds; `close()` draws the final line."""

    def __init__(self, total_bytes: int, label: str, stream=sys.stderr, interval: float = 0.5):
        self.total = max(total_bytes, 1)
        self.label = label
        self.stream = stream
        self.interval = interval
        self.start = self._last = time.monotonic()
        self.done = self.documents = 0

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = _clock(eta) if eta != float("inf") else "?"
        return (f"{self.label}: {100 * self.done / self.total:5.1f}% | {self.documents} docs | "
                f"{rate / 1e6:.2f} MB/s, {self.documents / elapsed:.0f} docs/s | "
                f"elapsed {_clock(elapsed)} | ETA {eta_text}")

    def update(self, done_bytes: int, documents: int) -> None:
        self.done, self.documents = done_bytes, documents
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r" + self.line() + "\n")
        self.stream.flush()
