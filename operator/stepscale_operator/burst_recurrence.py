"""Recurring bursts: when the next burst is due, and what it will need.

A burst that rises faster than pods start cannot be served by reacting to it.
After one, the planner keeps the burst's peak for ``burst_memory_s`` so that a
burst coming back soon finds its capacity. That memory knows nothing of *when*
the next one comes: bursts every ten minutes hold the peak through every gap,
and bursts every hour (a cron job, a batch pipeline, an hourly sync) outlive it
and hit an unprepared fleet each time.

Two onsets give a period to prepare for: the planner provisions the peak need
one pod start-up before the next onset is due. That is cheap when wrong (the
capacity waits a little, then goes). Letting capacity go between bursts is not:
the memory is dropped only once the gaps between the last few onsets agree, and
the bursts are known to recur at that period. A burst that comes off the beat
(early, or not at all) breaks the pattern and the planner falls back to the
memory until a steady period shows again.

Pure and deterministic: onsets and needs in, a :class:`RecurringBurst` out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RecurringBurst:
    """The next burst of a pattern."""

    period_s: float  # mean gap between the recent onsets
    next_onset: float  # when the next burst is due (last onset + period)
    # How early or late it may come: the spread of the recent gaps, or, with one
    # gap, the tolerance.
    jitter_s: float
    peak_need: int  # replicas the recent bursts needed at most
    bursts: int  # onsets the pattern rests on
    confirmed: bool  # as many onsets as required, at gaps that agree


@dataclass
class _Burst:
    onset: float
    peak_need: int


class BurstRecurrence:
    """The last ``bursts`` burst onsets and their peak needs.

    Two onsets give a tentative period; ``bursts`` of them at gaps that agree within
    ``tolerance`` of their mean confirm it. ``bursts`` < 2 disables it.
    """

    def __init__(self, bursts: int = 3, tolerance: float = 0.1) -> None:
        self.required = bursts
        self.tolerance = tolerance
        self._bursts: deque[_Burst] = deque(maxlen=max(bursts, 2))

    def burst_began(self, onset: float, need: int) -> None:
        """A new burst, rising from ``onset``; ``need`` is its need so far."""
        if self._bursts and onset <= self._bursts[-1].onset:
            return  # the same burst seen again
        self._bursts.append(_Burst(onset, need))

    def onsets(self) -> list[tuple[float, int]]:
        """The remembered bursts, oldest first: (onset, peak need)."""
        return [(b.onset, b.peak_need) for b in self._bursts]

    def restore(self, onsets: Sequence[tuple[float, int]]) -> None:
        """Remember these bursts (from :meth:`onsets`, e.g. before a restart) instead."""
        self._bursts.clear()
        for onset, peak in sorted(onsets):
            self.burst_began(onset, peak)

    def burst_need(self, need: int) -> None:
        """The current burst needs ``need`` now (its peak is the most of these)."""
        if self._bursts:
            self._bursts[-1].peak_need = max(self._bursts[-1].peak_need, need)

    def expected(self, now: float) -> RecurringBurst | None:
        """The next burst, if the recent onsets are evenly spaced and it is not overdue.

        Overdue: later than the period's tolerance past its due time. A burst that
        did not come ends the pattern (the planner falls back to its memory).
        """
        if self.required < 2 or len(self._bursts) < 2:
            return None
        onsets = [b.onset for b in self._bursts]
        gaps = [b - a for a, b in zip(onsets, onsets[1:], strict=False)]
        period = sum(gaps) / len(gaps)
        spread = max(gaps) - min(gaps)
        if period <= 0.0 or spread > self.tolerance * period:
            return None
        due = onsets[-1] + period
        if now > due + self.tolerance * period:
            return None
        jitter = spread if len(gaps) > 1 else self.tolerance * period
        peak = max(b.peak_need for b in self._bursts)
        confirmed = len(onsets) >= self.required
        return RecurringBurst(period, due, jitter, peak, len(onsets), confirmed)
