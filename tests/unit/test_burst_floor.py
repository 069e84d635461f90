"""Which rises the burst memory keeps (burst_floor), judged on the demand as well as the need."""

from __future__ import annotations

from stepscale_operator.burst_floor import BurstMemory
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner_policy import PlannerPolicy
from tests.unit.test_demand_rise import window

HORIZON = 70.0


def _rise(low_rps: float, high_rps: float) -> bool:
    """Whether a need rising from 10 to 17 replicas in 20 s, on arrivals rising from
    ``low_rps`` to ``high_rps``, is kept as a burst."""
    memory = BurstMemory(PlannerPolicy())

    def size(load: LoadEstimate) -> int:
        return 17 if load.prefill_requests_per_s >= high_rps else 10

    t = 0.0
    for t in range(100, 200, 5):  # steady, past the first horizon
        memory.floor(float(t), 10, HORIZON, 0.0, window(low_rps), size)
    kept = memory.floor(float(t) + 20.0, 17, HORIZON, 0.0, window(high_rps), size)
    return kept.seen_s_ago == 0.0 and kept.floor == 17


def test_a_need_that_outruns_its_demand_is_followed_but_not_kept() -> None:
    # Near the SLO the need rises faster than the demand (the more so the truer
    # the latency model): the shared trace's arrivals rising 1.5x took the need
    # 1.7x, and kept for 15 minutes it held capacity no burst asked for. Both
    # rises are far beyond the windows' noise; only the demand's ratio differs.
    assert not _rise(120.0, 180.0)
    assert _rise(120.0, 200.0)
    assert _rise(0.5, 40.0)  # silence, then a burst
