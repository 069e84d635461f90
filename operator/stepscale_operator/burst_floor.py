"""Burst floors: the capacity a burst faster than pod start-up asks the planner to keep.

A need that jumps by ``burst_ratio`` within one start-up horizon rose faster than
pods can start, when the arrivals behind it rose by more than the load windows'
sampling noise (:mod:`~stepscale_operator.demand_rise`). Prompts heavier than
before at the same arrivals move the need as much and are not a burst: a few long
prompts in one window are noise, and a heavier mix is what the mix memory holds
scale-down for (the shared trace on four seeds of five: a 25 s spike of prompt
tokens, 1.42x at unchanged arrivals, kept as a burst held 0.34 GPU-hours above
the need for 15 minutes; let go, seed 1 met the same 99.52%); its peak (counted from
the low point it rose from) is kept for ``burst_memory_s`` so a burst coming back
soon finds its capacity already there. A burst within that memory extends it: a
smaller one does not lower the floor while a bigger one's peak is in the memory.
What is kept is the peak's *demand*, sized again at every decision with the model
and the closed loop's correction as they are then (see :meth:`BurstMemory.floor`),
within the SLO itself, without the look-ahead headroom or the margin
(:func:`~stepscale_operator.capacity_need.remembered_need`): the headroom is for
a rise no measurement shows yet, and a remembered peak was measured (kept with
it, the memory held 5 replicas on silence-burst where its demand needs 4 and the
oracle 3-4); the margin is for the model's error on a load being served, and a
burst that returns gets it from the planner's own need at once. It is served as
the streams measure the fleet's serving at that decision
(:func:`~stepscale_operator.demand.with_fleet_of`): a peak read while its pods
joined carries the router's transient, not the demand's shape.
A burst is kept because one that ends as fast as it came may come back as fast.
The memory therefore watches how the latest burst's demand leaves the level it
held: once it is down from it by ``burst_ratio`` and by more than the noise (the
onset's rule reversed, on the demand alone), a fall that took longer than one
horizon lets the burst go. That was a level that faded (long context: a rise
faster than pods start, ten minutes up, then down over several; its peak held 12
replicas where 5-8 served), and the usual scale-down follows it; status says
when (``status.bursts.fadedSecondsAgo``). A fall within one horizon keeps the
peak as before. The same fall from a level no onset was seen for (it started
with the planner, or rose while the needs read high) is a burst seen from its
end, and its level is kept the same way. A faded burst still counts as an
onset for the period below: a level that comes at a period, faster than pods
start, needs its capacity a start-up ahead each time however slowly it leaves.
Once bursts come at a steady period (:mod:`~stepscale_operator.burst_recurrence`),
the next one's peak is provisioned one horizon before it is due, and nothing is
held between. Pure and deterministic, like the planner that owns it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from stepscale_operator.burst_recurrence import BurstRecurrence, RecurringBurst
from stepscale_operator.demand import with_fleet_of
from stepscale_operator.demand_rise import arrivals_rise_z, demand_ratio, demand_rise_z
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner_stages import BurstFloor


class BurstSettings(Protocol):
    """The settings :class:`BurstMemory` reads (``PlannerPolicy`` has them all)."""

    @property
    def burst_ratio(self) -> float:
        """A need this many times its recent low is a burst ..."""
        ...

    @property
    def burst_min_step(self) -> int:
        """... when it also rose by at least this many replicas."""
        ...

    @property
    def burst_min_z(self) -> float:
        """... and its demand rose by more than this many standard errors of noise."""
        ...

    @property
    def burst_memory_s(self) -> float:
        """How long a burst's peak is kept."""
        ...

    @property
    def lookahead_extra_s(self) -> float:
        """Added to a recurring burst's lead (one decision period at least)."""
        ...

    @property
    def recurring_bursts(self) -> int:
        """Onsets that confirm a period (0: no period learning)."""
        ...

    @property
    def burst_period_tolerance(self) -> float:
        """Gaps agree within this share of their mean."""
        ...


@dataclass(frozen=True)
class _Need:
    time: float
    replicas: int
    load: LoadEstimate  # the demand that needed them


@dataclass(frozen=True)
class _KeptPeak:
    """What the memory keeps at one decision."""

    memory: int  # the remembered peak's need now (0: none kept)
    remembered: bool  # the latest burst is within the memory's reach
    seen_s_ago: float | None  # the latest burst (None: none seen)
    faded_s_ago: float | None  # when it was let go as a level that faded


def _recurring_words(burst: RecurringBurst, now: float) -> str:
    """Why capacity waits for a recurring burst, in words."""
    due = burst.next_onset - now
    when = f"due in {due:.0f}s" if due >= 0.0 else f"due {-due:.0f}s ago"
    return (
        f"bursts recur every {burst.period_s:.0f}s (last {burst.bursts}); the next is "
        f"{when} and the recent ones needed {burst.peak_need}"
    )


class BurstMemory:
    """Remembers needs, detects bursts and learns their period; see the module docstring."""

    def __init__(self, settings: BurstSettings) -> None:
        self.settings = settings
        self._needs: list[_Need] = []  # need on the measured demand
        self._last_burst: float | None = None
        self._burst_began = 0.0  # when the last burst's rise began (its low point)
        # When the latest burst's own rise began, since when its demand has been
        # down from a level it held, and whether that fall has been judged yet
        # (see :meth:`_judge_the_fall`).
        self._latest_began = 0.0
        self._down_since: float | None = None
        self._fall_judged = False
        self._faded_at: float | None = None  # when the latest burst was let go
        # The latest burst was seen from its end (:meth:`_note_a_level_that_left`).
        self._seen_leaving = False
        self._recurrence = BurstRecurrence(
            settings.recurring_bursts, settings.burst_period_tolerance
        )

    def onsets(self) -> list[tuple[float, int]]:
        """The bursts the period is learned from: (onset, peak need)."""
        return self._recurrence.onsets()

    def restore(self, onsets: Sequence[tuple[float, int]]) -> None:
        """Start from bursts seen before (see :meth:`onsets`), on this clock."""
        self._recurrence.restore(onsets)

    def _fell_by_a_burst(self, high: _Need, low: _Need) -> bool:
        """``low``'s demand is a burst's fall from ``high``'s: down by ``burst_ratio``
        (arrivals or prompt tokens) and by more than the windows' sampling noise.

        Judged on the demand, not the need: a need recorded at a burst's onset
        carries the closed loop's onset correction, which decays once the fleet has
        caught up, so the recorded needs fall while the burst goes on (on
        silence-burst, 5 at the onset, 3-4 after). And a small fleet's burst ends
        in fewer replicas than ``burst_min_step`` (silence-burst: 16 -> 6 requests a
        second, 4 -> 2 replicas).
        """
        policy = self.settings
        return (
            demand_ratio(low.load, high.load) >= policy.burst_ratio
            and demand_rise_z(low.load, high.load) >= policy.burst_min_z
        )

    def _below_a_held_level(self, current: _Need, window_s: float) -> bool:
        """``current``'s demand is a burst's fall below a level the latest burst held
        for a whole load window (every reading in it). One reading is not a level:
        the onset's can be a draining backlog's overshoot (silence-burst: 25
        requests a second for 15 s, 16-19 after)."""
        run_began: float | None = None
        for r in self._needs:
            if r.time < self._latest_began:
                continue
            if not self._fell_by_a_burst(r, current):
                run_began = None
                continue
            run_began = r.time if run_began is None else run_began
            if r.time - run_began >= window_s:
                return True
        return False

    def _judge_the_fall(self, now: float, horizon: float) -> None:
        """Let the latest burst go if its demand came down over longer than one
        horizon. Judged once, when the demand has stayed a burst's fall below a
        level the burst held (:meth:`_below_a_held_level`) for one load window: a
        window that drew few prompts reads one low value. The fall was sharp if a
        demand a burst's fall above today's stood within one horizon before it
        began.
        """
        if self._fall_judged:
            return
        current = self._needs[-1]
        window_s = current.load.window_s
        if not self._below_a_held_level(current, window_s):
            self._down_since = None
            return
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since < window_s:
            return
        self._fall_judged = True
        since = self._down_since - horizon
        recent = [r for r in self._needs if since <= r.time < now]
        if not any(self._fell_by_a_burst(r, current) for r in recent):
            self._faded_at = now  # a level that faded, not a burst that went

    def floor(
        self,
        now: float,
        needed: int,
        horizon: float,
        first_decision: float | None,
        load: LoadEstimate,
        size: Callable[[LoadEstimate], int],
    ) -> BurstFloor:
        """The floor bursts ask for, and the recurring burst it prepares for (if so).

        Bursts at a period (see :mod:`~stepscale_operator.burst_recurrence`): from
        one look-ahead horizon (plus the period's jitter) before the next is due
        until it comes, the floor is the recent bursts' peak need; between bursts
        of a confirmed period there is none. Otherwise the floor is the highest
        need of the last ``burst_memory_s``, counted from the low point of the
        first of the bursts that came within ``burst_memory_s`` of each other (0
        once no burst has been seen for ``burst_memory_s``).

        The peak counts from the low point the burst rose from: a higher need met
        before the burst (an earlier daily peak) is not what a recurring burst
        needs, and keeping it would hold capacity no burst asked for.
        ``needed`` is sized on the demand ``load`` (served load corrected by the
        queue's growth or drain), so a backlog draining after the burst does not
        inflate it.

        The peak is the demand that needed the most replicas, sized again by
        ``size`` (the planner's count for a demand, as the model and its learned
        correction are now) at every decision. A count read at the onset carries
        the onset's transient: the realized latency of a swamped fleet over a load
        window of quiet seconds and the burst's first ones teaches the closed loop
        a correction that decays once the fleet has caught up (on silence-burst
        x1.68, and a peak of 8 replicas kept for 15 minutes where 3-4 served the
        burst). The same demand sized with the decayed correction needs what it
        needs, and a correction that stays (the model really under-predicts)
        keeps the count up. ``size`` leaves out the look-ahead headroom and the
        margin that ``needed`` (what bursts are judged on) includes.

        What the streams measure of the fleet rather than of the demand (how the
        router splits arrivals over the replicas, what a prefill pass spares of
        their decodes) is taken from ``load``, the decision's own estimate. The
        highest reading is often taken while the burst's pods join: a new
        replica takes most of the arrivals at first, so one replica's arrivals
        read clumpier than the fleet's (silence-burst: a replica's dispersion
        6-8 against the fleet's 3, then 1.2 once settled). Kept with the peak,
        that transient sized a demand the settled fleet serves with fewer.

        A burst whose demand came down from the level it held over longer than
        one horizon is let go (see :meth:`_judge_the_fall`).
        """
        keep = max(self.settings.burst_memory_s, horizon)
        self._needs.append(_Need(now, needed, load))
        self._needs = [r for r in self._needs if r.time >= now - keep]
        self._note_a_burst(now, needed, load, horizon, first_decision)
        self._note_a_level_that_left(now, horizon, first_decision)
        kept = self._kept_peak(now, load, size, keep, horizon)
        recurring = self._recurrence.expected(now)
        value: int = kept.memory
        prepared: RecurringBurst | None = None
        if recurring is not None:
            lead = horizon + max(recurring.jitter_s, self.settings.lookahead_extra_s)
            due_soon = now >= recurring.next_onset - lead
            if recurring.confirmed:
                value, prepared = (recurring.peak_need, recurring) if due_soon else (0, None)
            # A tentative period (one gap): prepare for the next burst, which costs
            # a start-up's worth of capacity if it does not come, but keep the
            # memory: one gap says nothing of what comes in between.
            elif due_soon and recurring.peak_need > kept.memory:
                value, prepared = recurring.peak_need, recurring
        return BurstFloor(
            value,
            prepared,
            kept.seen_s_ago,
            kept.faded_s_ago,
            self._seen_leaving,
            tuple(self._recurrence.onsets()),
            recurring,
            self._floor_words(now, kept, value, prepared),
        )

    def _note_a_burst(
        self,
        now: float,
        needed: int,
        load: LoadEstimate,
        horizon: float,
        first_decision: float | None,
    ) -> None:
        """Record a burst if ``needed`` rose from the last horizon's low point by
        ``burst_ratio`` and ``burst_min_step``, its demand beyond the noise."""
        policy = self.settings
        # The low point must be a need judged after one horizon on the model: over
        # the planner's first horizon the load estimate's window and the fleet's
        # batches are still filling, and the need rising with them is its own
        # warm-up, not a burst (on the Azure trace it held the start-up's need
        # for 15 minutes).
        first = first_decision if first_decision is not None else now
        warmed = first + horizon
        before = [r for r in self._needs if r.time >= max(now - horizon, warmed)]
        if not before:
            return
        # The low point: the latest of the lowest needs (the rise began after it).
        at_low = max(before, key=lambda r: (-r.replicas, r.time))
        low = at_low.replicas
        if not (
            needed - low >= policy.burst_min_step
            and needed >= policy.burst_ratio * max(low, 1)
            # A need that jumps while the arrivals did not rise beyond the windows'
            # sampling noise is the prompts' mix (a few long ones, or a heavier
            # stretch); keeping its peak would hold capacity no burst asked for.
            and arrivals_rise_z(at_low.load, load) >= policy.burst_min_z
        ):
            return
        # Since the last burst still remembered (None: none, or it faded).
        last = self._last_burst
        since_last = None if last is None or self._faded_at is not None else now - last
        # A burst within the memory of the last one extends it: a smaller burst
        # must not erase a bigger one's peak, which stays until it is
        # burst_memory_s old (on bursty code a 4-replica burst replaced a
        # 13-replica memory, the fleet walked down to 6 and the next cluster met
        # it: 99.18% -> 99.57% attainment for 2.3% more GPU-hours).
        if not self._remembers_a_burst(now):
            self._burst_began = at_low.time
        self._last_burst = now
        self._latest_began = at_low.time
        self._down_since = None
        self._fall_judged = False
        self._faded_at = None
        self._seen_leaving = False
        if since_last is None or since_last > horizon:
            # A new burst's beat: when the need crossed halfway up. The low point's
            # time wanders with the noise of the need before the burst (3, 4,
            # 3...), by up to a horizon; the halfway crossing is where the rise is
            # steep.
            halfway = min(r.time for r in before if 2 * r.replicas >= low + needed)
            self._recurrence.burst_began(halfway, needed)

    def _remembers_a_burst(self, now: float) -> bool:
        """A burst is in the memory: seen within ``burst_memory_s`` and not let go."""
        last = self._last_burst
        return (
            last is not None
            and self._faded_at is None
            and now - last <= self.settings.burst_memory_s
        )

    def _left_from(self, level: _Need, low: _Need) -> bool:
        """``low`` is a burst's fall from ``level`` in the arrivals themselves, as an
        onset's rise must be (see :meth:`_note_a_burst`): a few long prompts lift a
        load window's prompt tokens for one window, and their leaving it is the
        mix's, not a level that left."""
        return (
            self._fell_by_a_burst(level, low)
            and arrivals_rise_z(low.load, level.load) >= self.settings.burst_min_z
        )

    def _note_a_level_that_left(
        self, now: float, horizon: float, first_decision: float | None
    ) -> None:
        """Record a level that left faster than pods start as a burst seen from its end.

        The onset's rule sees a burst only if it rose within one horizon after the
        planner's warm-up, by ``burst_min_step`` from a low the needs' noise sets.
        Traffic that switches on and off can start during the warm-up, or come up
        while the needs read high (bursty code on seed 1: 10-15 requests a second
        for three minutes, then silence, then 31 a second; kept as a burst only when
        the needs' noise happened to read 2 before 6, and the fleet met the 31 with
        5 replicas, or with 2 when it did not). Its end says what its start did not:
        a demand that leaves faster than pods start may come back as fast, which is
        why a burst's peak is kept (and why one that faded over longer is let go).

        The same rules as a burst's fall (:meth:`_fell_by_a_burst`), in the arrivals
        too (:meth:`_left_from`), from a level held for a load window to a low held
        for one, within one horizon, and the onset's rule on the needs
        (``burst_min_step`` and ``burst_ratio``).
        Nothing is recorded while a burst is remembered: its own fall is judged.
        """
        if self._remembers_a_burst(now):
            return
        policy = self.settings
        window_s = self._needs[-1].load.window_s
        low_since = now - window_s
        lows = [r for r in self._needs if r.time >= low_since]
        low_need = max(r.replicas for r in lows)
        first = first_decision if first_decision is not None else now
        # The level is judged after the planner's warm-up, like a burst's low point.
        since = max(first + horizon, low_since - horizon)
        before = [r for r in self._needs if since <= r.time < low_since]
        # The needs' test first: it is cheap and rules out almost every decision.
        if not before or max(r.replicas for r in before) - low_need < policy.burst_min_step:
            return
        run: list[_Need] = []
        held: list[_Need] = []
        for r in before:
            if all(self._left_from(r, low) for low in lows):
                run.append(r)
                if run[-1].time - run[0].time >= window_s:
                    held = list(run)
            else:
                run = []
        if not held:
            return
        peak = max(r.replicas for r in held)
        if peak - low_need < policy.burst_min_step or peak < policy.burst_ratio * max(low_need, 1):
            return
        self._last_burst = held[-1].time
        self._burst_began = self._latest_began = held[0].time
        # Its fall is judged here: within one horizon by construction.
        self._down_since = now
        self._fall_judged = True
        self._faded_at = None
        self._seen_leaving = True

    def _kept_peak(
        self,
        now: float,
        load: LoadEstimate,
        size: Callable[[LoadEstimate], int],
        keep: float,
        horizon: float,
    ) -> _KeptPeak:
        """The remembered bursts' peak, sized as the model and the fleet are now,
        and how long ago the latest burst was seen (and let go, if it faded)."""
        age = math.inf if self._last_burst is None else now - self._last_burst
        # The latest burst is within the memory's reach (kept, or judged faded).
        remembered = age <= keep
        if remembered:
            self._judge_the_fall(now, horizon)
        seen = None if self._last_burst is None else age
        faded = None if self._faded_at is None else now - self._faded_at
        memory = 0
        if remembered and faded is None:
            since = [r for r in self._needs if r.time >= self._burst_began]
            top = max(since, key=lambda r: (r.replicas, r.time))
            # Sized again even at this decision: ``needed`` has the look-ahead, the
            # memory does not.
            peak = size(with_fleet_of(top.load, load))
            # The burst's peak, for the next one of a period (even without a memory);
            # a level seen only leaving had no onset there to size.
            if not self._seen_leaving:
                self._recurrence.burst_need(peak)
            if age <= self.settings.burst_memory_s:
                memory = peak
        return _KeptPeak(memory, remembered, seen, faded)

    def _floor_words(
        self, now: float, kept: _KeptPeak, value: int, prepared: RecurringBurst | None
    ) -> str:
        """Why the floor is ``value`` (for the recurring burst ``prepared``, if so)."""
        seen, faded = kept.seen_s_ago, kept.faded_s_ago
        if prepared is not None:
            return _recurring_words(prepared, now)
        if faded is not None and kept.remembered:
            return (
                f"the burst seen {seen:.0f}s ago faded over longer than a pod "
                f"start-up ({faded:.0f}s ago): a level that went, not a burst that "
                "may come back as fast, so its peak is not kept"
            )
        if value and seen is not None and self._seen_leaving:
            return (
                f"a demand left faster than pod start-up {seen:.0f}s ago and may come "
                f"back as fast; its level (needing {value} as the model is now) is kept "
                f"for {self.settings.burst_memory_s:.0f}s"
            )
        if value and seen is not None:
            return (
                f"a burst faster than pod start-up was seen {seen:.0f}s ago; the "
                f"highest demand of the bursts in the last "
                f"{self.settings.burst_memory_s:.0f}s "
                f"(needing {value} as the model is now) is kept"
            )
        return "no burst to prepare for"
