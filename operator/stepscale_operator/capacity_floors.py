"""The floors stage: the capacity need raised by everything that is not the model's need.

The backlog's drain allowance, a recurring burst due within a start-up, and a
sustained measured miss raise what scale-up aims for; the burst memory raises
what scale-down may leave. Scale-down never leaves fewer than scale-up would
restore on the same data (no down-then-up): at least what scale-up aims for, and
enough serving replicas that the queue is no backlog, or its drain allowance.
Each floor says whether it bound, so the decision's reason names it. Pure.
"""

from __future__ import annotations

from stepscale_operator.closed_loop import Feedback
from stepscale_operator.planner_stages import BurstFloor, CapacityNeed, Demand, FleetNow, Floors


def apply_floors(
    need: CapacityNeed,
    demand: Demand,
    bursts: BurstFloor,
    feedback: Feedback,
    fleet: FleetNow,
) -> Floors:
    """The need with the backlog allowance, the burst floor and a sustained measured
    miss; the scale-down floor."""
    # What the stabilization window remembers: the measured load's floor (and a
    # burst's peak). The forecast's need counts for the decision at hand only:
    # remembered, the window's maximum of a noisy look-ahead would add its
    # headroom on top of the look-ahead's own (on the Azure trace the held count
    # sat 1-2 replicas above what any measured window needed).
    measured_floor = max(need.down_ok, bursts.floor)
    down_ok = max(need.down_ok, need.needed)
    load_floor = max(down_ok + fleet.timed_out, fleet.low)
    down_ok = max(down_ok, bursts.floor)
    needed = min(need.needed + demand.backlog_replicas, need.search_high)
    # A recurring burst due within a start-up: its peak is needed now.
    for_burst = bursts.prepared is not None and bursts.floor > needed
    if for_burst:
        needed = min(bursts.floor, need.search_high)
    # The realized latency missed the SLO for a while: more, whatever the model says.
    for_miss = feedback.floor > needed
    if for_miss:
        needed = min(feedback.floor, need.search_high)
    # Scale-down leaves what scale-up aims for: the demo went 4 -> 3 -> 4 in 3 s
    # with 485 prompts queued, the drain allowance counted by scale-up alone. And a
    # queue that is no backlog at this size can be one at a smaller size (the
    # trigger is per serving replica): there scale-up would add the allowance back.
    backlog_floor = min(
        demand.backlog_free_at, need.needed + demand.backlog_drain_replicas, need.search_high
    )
    floor = max(down_ok, needed, backlog_floor)
    # Whether the queue is what holds scale-down (the decision's reason says so).
    for_backlog = floor > down_ok and (demand.backlog_replicas > 0 or backlog_floor > needed)
    return Floors(needed, for_burst, for_miss, floor, for_backlog, measured_floor, load_floor)
