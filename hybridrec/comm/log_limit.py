"""A rate-limited logger: servers log each bad request or refused peer as one line, but a flood of
them cannot fill the log or slow the server down."""
from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """At most `burst` lines per `period` seconds through `logger`; the count of lines held back
    is added to the next line that goes out."""

    def __init__(self, logger: logging.Logger, burst: int = 10, period: float = 60.0):
        self.logger, self.burst, self.period = logger, burst, period
        self._lock = threading.Lock()
        self._window_start = float("-inf")
        self._sent = 0
        self._held_back = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log `message % args` as one warning unless the limit is reached; True when logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self.period:
                self._window_start, self._sent = now, 0
            if self._sent >= self.burst:
                self._held_back += 1
                return False
            self._sent += 1
            held_back, self._held_back = self._held_back, 0
        if held_back:
            message += f" ({held_back} similar lines held back)"
        self.logger.warning(message, *args)
        return True
