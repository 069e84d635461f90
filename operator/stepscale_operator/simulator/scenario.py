"""Run several scaling policies over the same traffic with the same seed.

Shared by ``stepscale simulate`` and ``benchmarks/bench_policies.py``: builds each
policy from one :class:`ScalingSetup`, starts every fleet at the same size (what
the first minutes need, so no policy pays for a cold start), and summarises.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stepscale_engine.wire import ForwardPassMetrics
from stepscale_operator.planner import Planner, PlannerPolicy
from stepscale_operator.simulator.fleet import Fleet, FleetConfig, ScalingPolicy, SimResult
from stepscale_operator.simulator.ground_truth import StepTimeProfile
from stepscale_operator.simulator.policies import (
    DynamoPolicy,
    HpaPolicy,
    OraclePolicy,
    PlannerDrivenPolicy,
    ScalingSetup,
    StaticPolicy,
    needed_replicas_series,
)
from stepscale_operator.simulator.report import RunSummary, summarise
from stepscale_operator.simulator.traffic import Traffic

POLICY_NAMES = ("ours", "static", "hpa", "dynamo", "oracle")


@dataclass
class PolicyRun:
    """One policy's run: the raw result, its summary and the policy object."""

    result: SimResult
    summary: RunSummary
    policy: ScalingPolicy


def build_policy(
    name: str,
    traffic: Traffic,
    setup: ScalingSetup,
    profile: StepTimeProfile,
    planner_policy: PlannerPolicy,
) -> ScalingPolicy:
    """The named policy (see ``POLICY_NAMES``) for this traffic and setup."""
    if name == "ours":
        return PlannerDrivenPolicy(setup, planner=Planner(planner_policy))
    if name == "static":
        peak = needed_replicas_series(traffic, setup, profile, planner_policy).max()
        return StaticPolicy(int(peak))
    if name == "hpa":
        return HpaPolicy(setup)
    if name == "dynamo":
        return DynamoPolicy(setup, profile, policy=planner_policy)
    if name == "oracle":
        return OraclePolicy(traffic, setup, profile, planner_policy)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")


def initial_replicas(
    traffic: Traffic, setup: ScalingSetup, profile: StepTimeProfile, policy: PlannerPolicy
) -> int:
    """What the traffic needs over its first start-up time (+10 s): the common start."""
    needs = needed_replicas_series(traffic, setup, profile, policy)
    slots = max(1, int((setup.startup_s + 10.0) // 10.0) + 1)
    return int(needs[:slots].max())


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
    fpm_tap: Callable[[Sequence[tuple[float, ForwardPassMetrics]]], None] | None = None,
) -> list[PolicyRun]:
    """Simulate each named policy on ``traffic``; same seed, same start for all."""
    planner_policy = planner_policy or PlannerPolicy()
    start = initial_replicas(traffic, setup, profile, planner_policy)
    runs: list[PolicyRun] = []
    for name in names:
        policy = build_policy(name, traffic, setup, profile, planner_policy)
        config = FleetConfig(
            initial_replicas=start,
            startup_s=setup.startup_s,
            limits=setup.limits,
            profile=profile,
            seed=seed,
        )
        fleet = Fleet(traffic, policy, config, fpm_tap=fpm_tap)
        began = time.perf_counter()
        tick: Callable[[float], None] | None = None
        if progress is not None:
            tick = functools.partial(progress, name)
        result = fleet.run(progress=tick)
        wall = time.perf_counter() - began
        runs.append(PolicyRun(result, summarise(result, setup.slo, scenario, wall), policy))
    return runs
