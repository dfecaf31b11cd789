"""Search progress on a terminal: candidates evaluated and the best step time so far.

``SearchProgress`` is the callback ``autopar.planner.search.search(progress=...)`` accepts.
It redraws one status line on a TTY and prints nothing otherwise (pipes, CI logs, files),
so scripted output stays exactly the report.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class SearchProgress:
    """A callable progress display; ``close()`` clears the line when the search ends."""

    def __init__(self, stream: TextIO | None = None, *, enabled: bool | None = None,
                 min_interval_s: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled if enabled is not None else bool(isatty and isatty())
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._width = 0
        self.calls = 0

    def __call__(self, *, evaluated: int, total: int, best_s: float | None, candidate) -> None:
        self.calls += 1
        now = time.monotonic()
        if not self.enabled or (now - self._last < self.min_interval_s and evaluated < total):
            return
        self._last = now
        best = f"{best_s * 1e3:.3f} ms/step" if best_s is not None else "none fits yet"
        mesh = candidate.mesh
        line = (f"searching: {evaluated}/{total} candidates, best {best} "
                f"(last: {mesh.describe(' ')} {candidate.status})")
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0
