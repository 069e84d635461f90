"""What share of the passes sent over the load window reached the load estimate.

The load estimate sums the passes it ingested. A message that never reached it
(shed by an operator that cannot keep up, dropped at a ZMQ high-water mark)
shows as a sequence gap in its stream, counted as ``lost``; the estimate then
reads low by about that share. A low reading must never justify a scale-down,
so the planner is told the share (:attr:`PlannerInputs.load_seen_fraction`).

Pure: fed the autoscaler's cumulative counts once per decision round.
"""

from __future__ import annotations

from collections import deque


class IngestCoverage:
    """Received messages / (received + lost) over the last ``window_s`` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        # (time, cumulative messages received, cumulative messages lost)
        self._marks: deque[tuple[float, int, int]] = deque()

    def observe(self, now: float, messages: int, lost: int) -> float:
        """Record the cumulative counts at ``now``; returns the fraction seen over the
        window (1.0 while nothing was sent or lost in it).

        ``lost``: messages known not to have reached the estimate (the larger of
        the sequence gaps and the messages shed is a lower bound of that: shed
        messages show as gaps, except at the very start of a stream).
        """
        self._marks.append((now, int(messages), int(lost)))
        # Keep the newest mark at or before the window's start: the baseline.
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
            self._marks.popleft()
        _, messages_then, lost_then = self._marks[0]
        got = max(0, int(messages) - messages_then)
        missed = max(0, int(lost) - lost_then)
        if got + missed == 0:
            return 1.0
        return got / (got + missed)
