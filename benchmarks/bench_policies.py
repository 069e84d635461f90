"""Compare scaling policies on the shared trace and on synthetic bursts (one command).

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/bench_policies.py

Same seed, same start, same run for every policy: ours, static-peak, HPA-style,
Dynamo-style and the oracle. Prints the table, the planner's prediction accuracy
(predicted vs simulated TTFT/ITL at the replica counts it ran) and the simulator's
speed; writes ``results/bench_policies.json`` and ``results/policies_timeline.png``.
The Azure trace is read from ``../shared/traces/`` when present; without it only
the synthetic scenario runs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from stepscale_operator.planner import EngineLimits, PlannerPolicy, SloTargets
from stepscale_operator.simulator.fleet import Fleet, FleetConfig
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B
from stepscale_operator.simulator.policies import PlannerDrivenPolicy, ScalingSetup, StaticPolicy
from stepscale_operator.simulator.report import (
    RunSummary,
    format_table,
    plot_timeline,
    request_latencies,
)
from stepscale_operator.simulator.scenario import POLICY_NAMES, PolicyRun, run_policies
from stepscale_operator.simulator.traffic import Traffic, load_azure_csv, synthetic

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
SLO = SloTargets(ttft_ms=1000.0, itl_ms=40.0)
SETUP = ScalingSetup(slo=SLO, limits=EngineLimits(), startup_s=60.0, max_replicas=64)


def prediction_accuracy(run: PolicyRun, window_s: float = 30.0) -> dict[str, float]:
    """Median relative error of the planner's predictions against the simulation.

    For each decision where the ready count did not change over the estimator's
    window, compare the prediction for the measured load with the requests that
    arrived in that window.
    """
    policy = run.policy
    if not isinstance(policy, PlannerDrivenPolicy):
        return {}
    lat = request_latencies(run.result)
    arrival = run.result.traffic.arrival_s
    errors: dict[str, list[float]] = {
        "ttft_mean": [],
        "itl_mean": [],
        "ttft_p99": [],
        "itl_p99": [],
    }
    history: list[tuple[float, int]] = []
    for check in policy.checks:
        history.append((check.time, check.replicas))
        recent = [n for t, n in history if t >= check.time - window_s]
        if len(recent) < window_s / policy.interval_s or len(set(recent)) != 1:
            continue
        lo, hi = np.searchsorted(arrival, [check.time - window_s, check.time])
        ttft = lat.ttft_ms[lo:hi]
        itl = lat.itl_ms[lo:hi]
        itl = itl[np.isfinite(itl) & (itl > 0)]
        ttft = ttft[np.isfinite(ttft)]
        if ttft.size < 50 or itl.size < 50:
            continue
        pairs = {
            "ttft_mean": (check.ttft_mean_ms, float(ttft.mean())),
            "itl_mean": (check.itl_mean_ms, float(itl.mean())),
            "ttft_p99": (check.ttft_ms, float(np.percentile(ttft, 99))),
            "itl_p99": (check.itl_ms, float(np.percentile(itl, 99))),
        }
        for key, (pred, sim) in pairs.items():
            errors[key].append(abs(pred - sim) / sim)
    out = {f"median_error_{k}": float(np.median(v)) for k, v in errors.items() if v}
    out["windows"] = float(len(errors["itl_mean"]))
    return out


def speed_check(trace: Traffic | None) -> dict[str, float]:
    """One hour of ~5 req/s on 20 replicas (the issue's speed target: under 60 s)."""
    traffic = trace if trace is not None else synthetic("flat", 3600.0, 5.4, seed=0)
    began = time.perf_counter()
    result = Fleet(traffic, StaticPolicy(20), FleetConfig(initial_replicas=20)).run()
    return {
        "requests": float(len(traffic)),
        "simulated_s": traffic.duration_s,
        "passes": float(result.steps),
        "wall_s": time.perf_counter() - began,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-scale", type=float, default=20.0, help="Azure trace rate scale")
    parser.add_argument("--duration-s", type=float, default=None, help="cut the trace")
    parser.add_argument("--burst-rps", type=float, default=40.0)
    parser.add_argument("--burst-duration-s", type=float, default=1800.0)
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    scenarios: list[tuple[str, Traffic]] = []
    raw_trace: Traffic | None = None
    if TRACE.exists():
        raw_trace = load_azure_csv(TRACE)
        scaled = raw_trace.scaled(
            rate_scale=args.rate_scale, duration_s=args.duration_s, seed=args.seed
        )
        scenarios.append((f"azure-conv-x{args.rate_scale:g}", scaled))
    else:
        print(f"(no trace at {TRACE}: synthetic scenario only)", file=sys.stderr)
    bursts = synthetic("bursts", args.burst_duration_s, args.burst_rps, seed=args.seed)
    scenarios.append(("synthetic-bursts", bursts))

    rows: list[RunSummary] = []
    accuracy: dict[str, dict[str, float]] = {}
    plotted: list[PolicyRun] = []
    began = time.perf_counter()
    for name, traffic in scenarios:
        print(
            f"{name}: {len(traffic)} requests, {traffic.duration_s:.0f} s, "
            f"{len(traffic) / traffic.duration_s:.1f} req/s",
            file=sys.stderr,
        )
        runs = run_policies(
            traffic,
            POLICY_NAMES,
            SETUP,
            name,
            profile=H100_LLAMA_8B,
            planner_policy=PlannerPolicy(),
            seed=args.seed,
        )
        for run in runs:
            print(
                f"  {run.summary.policy:<7} {run.summary.wall_s:6.1f} s wall, "
                f"attainment {run.summary.attainment:.2%}, GPU-h {run.summary.gpu_hours:.2f}",
                file=sys.stderr,
            )
            rows.append(run.summary)
            if run.summary.policy == "ours":
                accuracy[name] = prediction_accuracy(run)
        if not plotted:
            plotted = runs
    speed = speed_check(raw_trace)

    oracle = {r.scenario: r.gpu_hours for r in rows if r.policy == "oracle"}
    print()
    print(f"SLO: TTFT <= {SLO.ttft_ms:.0f} ms and ITL <= {SLO.itl_ms:.0f} ms per request")
    print(format_table(rows, oracle))
    print()
    print("Planner prediction accuracy (median relative error, predicted vs simulated):")
    for name, acc in accuracy.items():
        parts = ", ".join(
            f"{k.removeprefix('median_error_')} {v:.1%}" for k, v in acc.items() if k != "windows"
        )
        print(f"  {name}: {parts} over {acc.get('windows', 0):.0f} windows")
    print(
        f"Speed: {speed['simulated_s']:.0f} s of {speed['requests']:.0f} requests on 20 replicas "
        f"({speed['passes']:.0f} passes) simulated in {speed['wall_s']:.1f} s"
    )
    print(f"Total benchmark time {time.perf_counter() - began:.0f} s")

    payload = {
        "slo": asdict(SLO),
        "setup": {"startup_s": SETUP.startup_s, "limits": asdict(SETUP.limits)},
        "planner_policy": asdict(PlannerPolicy()),
        "runs": [
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in r.to_dict().items()
            }
            for r in rows
        ],
        "oracle_gpu_hours": oracle,
        "prediction_accuracy": accuracy,
        "speed": speed,
    }
    (out / "bench_policies.json").write_text(json.dumps(payload, indent=2))
    if plotted:
        plot_timeline(
            [r.result for r in plotted],
            SLO,
            str(out / "policies_timeline.png"),
            title=plotted[0].summary.scenario,
        )
    print(f"wrote {out / 'bench_policies.json'} and {out / 'policies_timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
