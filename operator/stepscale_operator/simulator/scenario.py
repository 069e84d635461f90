"""Run several scaling policies over the same traffic with the same seed.

Shared by ``stepscale simulate`` and ``benchmarks/bench_policies.py``: measures the
traffic's true needs once (ground-truth capacity by simulation), builds each
policy from one :class:`ScalingSetup`, starts every fleet at the same size (what
the first minutes truly need, so no policy pays for a cold start), and summarises.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from stepscale_operator.planner import Planner, PlannerPolicy
from stepscale_operator.simulator.capacity import (
    Calibration,
    CapacityCurve,
    calibrate_capacity_curve,
    fit_to_traffic,
    starting_replicas,
)
from stepscale_operator.simulator.fleet import Fleet, FpmTap, ScalingPolicy, SimResult
from stepscale_operator.simulator.ground_truth import StepTimeProfile
from stepscale_operator.simulator.policies import (
    DynamoPolicy,
    HindsightPolicy,
    HpaPolicy,
    OraclePolicy,
    PlannerDrivenPolicy,
    ScalingSetup,
    StaticPolicy,
    WindowedOraclePolicy,
    arrival_rate_series,
)
from stepscale_operator.simulator.report import RunSummary, summarise
from stepscale_operator.simulator.traffic import Traffic

POLICY_NAMES = ("ours", "static", "hpa", "dynamo", "oracle", "oracle+window", "hindsight")


@dataclass
class PolicyRun:
    """One policy's run: the raw result, its summary and the policy object."""

    result: SimResult
    summary: RunSummary
    policy: ScalingPolicy


@dataclass(frozen=True)
class GroundTruthSizing:
    """The traffic's true needs: capacity per fleet size measured by simulation, and
    the replicas each 10 s slot needs for its true arrival rate (shared by the
    oracle, the static peak and the common starting size)."""

    capacity: CapacityCurve
    fit_factor: float  # the fitted level over the one measured on steady stretches
    needs: npt.NDArray[np.int64]
    wall_s: float


def ground_truth_sizing(
    traffic: Traffic,
    setup: ScalingSetup,
    profile: StepTimeProfile,
    target: float = 0.99,
    seed: int = 0,
    calibration: Calibration | None = None,
) -> GroundTruthSizing:
    """Measure the capacity at each fleet size up to the traffic's peak rate, then fit
    its level so the oracle just meets the target on the traffic itself."""
    cal = calibration or Calibration()
    began = time.perf_counter()
    peak_rps = float(arrival_rate_series(traffic).max()) if len(traffic) else 0.0
    measured = calibrate_capacity_curve(traffic, setup, profile, peak_rps, cal, target, seed)
    capacity, factor = fit_to_traffic(
        measured, traffic, setup, profile, target, cal.fit_iterations, seed
    )
    oracle = OraclePolicy(traffic, setup, capacity)
    return GroundTruthSizing(capacity, factor, oracle.needs, time.perf_counter() - began)


def build_policy(
    name: str,
    traffic: Traffic,
    setup: ScalingSetup,
    profile: StepTimeProfile,
    planner_policy: PlannerPolicy,
    sizing: GroundTruthSizing | None = None,
) -> ScalingPolicy:
    """The named policy (see ``POLICY_NAMES``) for this traffic and setup."""
    if name in ("static", "oracle", "oracle+window", "hindsight") and sizing is None:
        sizing = ground_truth_sizing(traffic, setup, profile)
    if name == "ours":
        return PlannerDrivenPolicy(setup, planner=Planner(planner_policy))
    if name == "ours@memory":
        # Ours without preparing for recurring bursts: the burst memory alone.
        memory_only = replace(planner_policy, recurring_bursts=0)
        return PlannerDrivenPolicy(setup, planner=Planner(memory_only), name=name)
    if name == "static":
        assert sizing is not None
        return StaticPolicy(int(sizing.needs.max()))
    if name.startswith("static@"):
        # "static@12": a fixed fleet of 12 (the benchmark sweeps sizes beside the policies).
        return StaticPolicy(int(name.partition("@")[2]), name=name)
    if name == "hpa":
        return HpaPolicy(setup)
    if name == "dynamo" or name.startswith("dynamo@"):
        # "dynamo@0.4": the Dynamo-style baseline aiming 40% below the SLO.
        headroom = float(name.partition("@")[2] or 0.0)
        return DynamoPolicy(setup, profile, policy=planner_policy, headroom=headroom)
    if name == "oracle":
        assert sizing is not None
        return OraclePolicy(traffic, setup, sizing.capacity)
    if name == "oracle+window":
        assert sizing is not None
        return WindowedOraclePolicy(
            traffic, setup, sizing.capacity, planner_policy.scale_down_stabilization_s
        )
    if name == "hindsight":
        assert sizing is not None
        return HindsightPolicy(traffic, setup, sizing.capacity)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")


def run_policies(
    traffic: Traffic,
    names: Sequence[str],
    setup: ScalingSetup,
    scenario: str,
    *,
    profile: StepTimeProfile,
    planner_policy: PlannerPolicy | None = None,
    seed: int = 0,
    progress: Callable[[str, float], None] | None = None,
    fpm_tap: FpmTap | None = None,
    sizing: GroundTruthSizing | None = None,
    calibration: Calibration | None = None,
) -> list[PolicyRun]:
    """Simulate each named policy on ``traffic``; same seed, same start for all.

    ``fpm_tap`` sees the pods of one run only, ``ours`` when it is among ``names``
    (else the first): pods of different runs share names and addresses, and
    an operator watching them should see one fleet. It is closed when that run
    ends, so the published streams go stale rather than heartbeat on.
    """
    planner_policy = planner_policy or PlannerPolicy()
    if sizing is None:
        sizing = ground_truth_sizing(traffic, setup, profile, seed=seed, calibration=calibration)
    published = "ours" if "ours" in names else (names[0] if names else "")
    start = starting_replicas(sizing.needs, setup)
    runs: list[PolicyRun] = []
    for name in names:
        policy = build_policy(name, traffic, setup, profile, planner_policy, sizing)
        config = setup.fleet_config(profile, start, seed)
        tap = fpm_tap if name == published else None
        fleet = Fleet(traffic, policy, config, fpm_tap=tap)
        began = time.perf_counter()
        tick: Callable[[float], None] | None = None
        if progress is not None:
            tick = functools.partial(progress, name)
        try:
            result = fleet.run(progress=tick)
        finally:
            if tap is not None:
                tap.close()
        wall = time.perf_counter() - began
        runs.append(PolicyRun(result, summarise(result, setup.slo, scenario, wall), policy))
    return runs
