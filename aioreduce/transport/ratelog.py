"""Rate-limited warnings: a flood of hostile connections must not become a flood of log
writes (each one a syscall, and a full stderr pipe blocks the whole process)."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most ``burst`` warnings per ``window`` seconds on ``logger``, then one line counting
    the ones left out."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window: float = 10.0) -> None:
        self.logger, self.burst, self.window = logger, burst, window
        self._start = -window
        self._count = 0
        self._suppressed = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._start >= self.window:
            if self._suppressed:
                self.logger.warning("... and %d more like it in the last %.0f s",
                                    self._suppressed, self.window)
            self._start, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count <= self.burst:
            self.logger.warning(msg, *args)
        else:
            self._suppressed += 1
