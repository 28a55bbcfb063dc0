"""A rate-limited logger: servers log each bad request, refused peer or failed request (with its
traceback when it is a bug of ours) under one limit, so a flood of them cannot fill the log or
slow the server down."""
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
        return self._log(logging.WARNING, message, args, exc_info=False)

    def exception(self, message: str, *args: object) -> bool:
        """Log `message % args` as an error with the traceback of the exception being handled,
        under the same limit; True when logged."""
        return self._log(logging.ERROR, message, args, exc_info=True)

    def _log(self, level: int, message: str, args: tuple, exc_info: bool) -> bool:
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
        self.logger.log(level, message, *args, exc_info=exc_info or None, stacklevel=3)
        return True
