"""A logger wrapper that emits at most one record per key per interval."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Logs each key at most once per ``interval_s``, reporting how many were suppressed.

    Bad input can arrive thousands of times a second; we count every occurrence
    but only write a line now and then so the log stays readable.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> bool:
        """Log ``msg`` under ``key`` unless one was logged within the interval; True if logged."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = now
        if suppressed:
            msg = msg + " (%d similar messages suppressed)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args)
        return True
