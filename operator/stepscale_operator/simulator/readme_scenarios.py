"""The scenarios and policy names of the README's policy table, defined once.

``stepscale simulate`` and ``benchmarks/bench_policies.py`` both build their
synthetic traffic, SLO and fleet setup from here, so the CLI reproduces the
README's tables with the same definitions the benchmark measured them with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.simulator.policies import ScalingSetup
from stepscale_operator.simulator.traffic import BURST_PERIOD_S, Traffic, synthetic

SLO = SloTargets(ttft_ms=1000.0, itl_ms=40.0)
"""The README's SLO: TTFT <= 1 s and ITL <= 40 ms per request."""
STARTUP_S = 60.0
SETUP = ScalingSetup(slo=SLO, limits=EngineLimits(), startup_s=STARTUP_S, max_replicas=64)
"""The simulated fleet of the README: H100 engines, pods that start in 60 s, up to 64."""
TRACE_RATE_SCALE = 20.0
"""The Azure conversation trace is replayed at 20x its rate in the README."""


@dataclass(frozen=True)
class SyntheticScenario:
    """A synthetic load as the README's table names it."""

    name: str  # the scenario column of the table
    kind: str  # see ``traffic.SYNTHETIC_KINDS``
    base_rps: float
    duration_s: float
    burst_period_s: float = BURST_PERIOD_S

    def traffic(
        self, duration_s: float | None = None, base_rps: float | None = None, seed: int = 0
    ) -> Traffic:
        """The requests of this scenario (its own length and rate unless given)."""
        traffic = synthetic(
            self.kind,
            duration_s or self.duration_s,
            base_rps or self.base_rps,
            seed=seed,
            burst_period_s=self.burst_period_s,
        )
        return Traffic(
            traffic.arrival_s,
            traffic.prompt_tokens,
            traffic.output_tokens,
            traffic.duration_s,
            self.name,
        )


BURSTS = SyntheticScenario("synthetic-bursts", "bursts", 40.0, 1800.0)
"""Bursts every 10 min from 40 to 100 req/s, 30 min."""
SLOW_BURSTS = SyntheticScenario(
    "synthetic-bursts-20min", "bursts", 40.0, 5400.0, burst_period_s=1200.0
)
"""The same bursts every 20 min (slower than the planner's burst memory lasts), 90 min."""

SYNTHETIC_SCENARIOS: dict[str, SyntheticScenario] = {
    "flat": SyntheticScenario("synthetic-flat", "flat", 40.0, 1800.0),
    "diurnal": SyntheticScenario("synthetic-diurnal", "diurnal", 40.0, 1800.0),
    "bursts": BURSTS,
    "bursts-20min": SLOW_BURSTS,
    "steps": SyntheticScenario("synthetic-steps", "steps", 40.0, 1800.0),
}
"""``stepscale simulate --synthetic NAME``: the README's bursts and three other shapes
at the same base rate."""

BASE_POLICIES = ("ours", "static", "hpa", "dynamo", "oracle", "oracle+window", "hindsight")
DYNAMO_SWEEP = ("dynamo@0.2", "dynamo@0.4", "dynamo@0.6")
"""The Dynamo-style baseline at more headroom (aiming 20/40/60% below the SLO), so it
is compared with ours at equal attainment."""
BURSTS_ONLY = ("ours@memory",)
"""Ours with the burst memory only (no learned period): differs from ours only on bursts."""
README_POLICIES = (*BASE_POLICIES, *BURSTS_ONLY, *DYNAMO_SWEEP)
"""Every policy the README's tables name (``--policy all``)."""

_DYNAMO = re.compile(r"dynamo@(0(\.\d+)?|\.\d+)")


def check_policy_name(name: str) -> str:
    """``name`` if it is a policy the simulator can build, else ``ValueError``:
    one of :data:`README_POLICIES`, or ``dynamo@H`` for any headroom 0 <= H < 1."""
    if name in README_POLICIES or _DYNAMO.fullmatch(name):
        return name
    raise ValueError(
        f"unknown policy {name!r}; expected one of {', '.join(README_POLICIES)}, "
        "dynamo@H (headroom 0 <= H < 1) or all"
    )
