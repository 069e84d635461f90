"""Compare scaling policies on the shared trace and on synthetic bursts (one command).

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/bench_policies.py

Same seed, same start, same run for every policy: ours, static-peak, HPA-style,
Dynamo-style and the oracle (sized by the ground-truth capacity the simulator
measures for the traffic, so it meets the target and bounds GPU-hours from below).
Two reference runs bound what any policy can do. ``hindsight`` sizes exactly to
all load seen so far (no margin) and never scales down: what it misses is the load
that rose faster than pods start before any burst like it had been seen.
``oracle+window`` knows the future like the oracle but scales down only after ours'
stabilization window (the issue's "scale down slowly"): no policy with that
window can use fewer GPU-hours.
The Dynamo-style baseline also runs with more headroom (``dynamo@0.2`` ...), so
"fewer GPU-hours at equal or better attainment" compares against the cheapest of
its settings that attains as much as ours, not against a cheap run that misses.
A third scenario has the same bursts every 20 minutes, more slowly than the
planner's burst memory lasts, so only learning their period prepares for them;
there ``ours@memory`` (ours without that) runs beside ours.
``--quick`` shortens the scenarios for iterating; ``--jobs`` (default 2) runs
policies in parallel processes. Prints the table, the planner's prediction accuracy
(predicted vs simulated TTFT/ITL at the replica counts it ran), PASS/FAIL for each
of the issue's targets per scenario, and the simulator's speed; writes
``results/bench_policies.json`` (``criteria`` holds the verdicts) and
``results/policies_timeline.png``.
The Azure trace is read from ``../shared/traces/`` when present; without it only
the synthetic scenario runs.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.planner import PlannerPolicy
from stepscale_operator.simulator import readme_scenarios as readme
from stepscale_operator.simulator.fleet import Fleet, FleetConfig, SimResult
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B
from stepscale_operator.simulator.policies import (
    PlannerDrivenPolicy,
    ScalingSetup,
    StaticPolicy,
    prediction_errors,
)
from stepscale_operator.simulator.report import (
    RunSummary,
    attainment_in_windows,
    format_table,
    plot_timeline,
    plot_title,
    replica_seconds,
)
from stepscale_operator.simulator.scenario import (
    POLICY_NAMES,
    GroundTruthSizing,
    PolicyRun,
    ground_truth_sizing,
    run_policies,
)
from stepscale_operator.simulator.traffic import (
    BURST_PERIOD_S,
    Traffic,
    TrafficShape,
    burst_windows,
    load_azure_csv,
    merged,
    rate_function,
    shaped_synthetic,
    synthetic,
)

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
# The scenarios, SLO and fleet are defined once, with ``stepscale simulate``.
SLO = readme.SLO
BURSTS = readme.BURSTS.name
# Bursts that recur more slowly than the planner's burst memory lasts (15 min).
SLOW_BURSTS = readme.SLOW_BURSTS.name
SLOW_BURST_PERIOD_S = readme.SLOW_BURSTS.burst_period_s
SETUP = readme.SETUP
# Long-context traffic is judged at a TTFT SLO it can mostly meet.
LONG_CONTEXT_SETUP = ScalingSetup(
    slo=SloTargets(ttft_ms=10_000.0, itl_ms=40.0),
    limits=EngineLimits(),
    startup_s=60.0,
    max_replicas=64,
)
# max_model_len of the simulated engine (Llama-3-8B's 128k context) less room to generate.
MAX_PROMPT = 126_000
TRACE_SCALES = (10.0, 20.0, 40.0)


def shaped_scenarios(duration_s: float, seed: int) -> list[tuple[str, Traffic, ScalingSetup]]:
    """Synthetic traffic with the shapes real traces show (see ``TrafficShape``): none
    is fitted to a trace; each stresses one shape the Poisson scenarios lack."""

    def rate(kind: str, base: float) -> Callable[[float], float]:
        return rate_function(kind, base, duration_s)

    def silence_then_burst(t: float) -> float:
        # Ten minutes of near silence, a burst at 40x that rate, then a middle level.
        third = duration_s / 3.0
        return 0.4 if t < third else (16.0 if t < 2.0 * third else 6.0)

    code = TrafficShape(
        cluster_mean=2.0,
        silent_share=0.5,
        mean_on_s=120.0,
        prompt_median=1500.0,
        prompt_sigma=1.0,
        output_median=60.0,
        short_output_share=0.35,
    )
    heavy = TrafficShape(
        cluster_mean=1.5, prompt_median=1000.0, prompt_sigma=1.5, max_prompt=MAX_PROMPT
    )
    burst = TrafficShape(cluster_mean=3.0, prompt_sigma=1.0, short_output_share=0.3)
    long_context = TrafficShape(
        cluster_mean=1.5,
        prompt_median=12_000.0,
        prompt_sigma=1.2,
        max_prompt=MAX_PROMPT,
        output_median=200.0,
    )
    # Added 2026-12-02 as held-out checks, run once before any change was judged
    # on them: a reasoning model's traffic (short prompts, outputs of about a
    # thousand tokens: the decode batch and its KV set the fleet, not prefill) and
    # retrieval-augmented prompts (6k-token documents, short answers) whose rate
    # steps up and down (x2, x0.5, x1.5) faster than pods start.
    decode_heavy = TrafficShape(
        cluster_mean=1.2,
        prompt_median=400.0,
        prompt_sigma=0.8,
        output_median=1200.0,
        output_sigma=0.6,
    )
    rag = TrafficShape(
        prompt_median=6000.0,
        prompt_sigma=0.5,
        max_prompt=30_000,
        output_median=80.0,
        output_sigma=0.8,
    )
    cases = [
        ("shaped-bursty-code", code, rate("diurnal", 14.0), SETUP),
        ("shaped-heavy-prompts", heavy, rate("diurnal", 6.0), SETUP),
        ("shaped-silence-burst", burst, silence_then_burst, SETUP),
        ("shaped-long-context", long_context, rate("diurnal", 1.2), LONG_CONTEXT_SETUP),
        ("shaped-decode-heavy", decode_heavy, rate("diurnal", 40.0), SETUP),
        ("shaped-rag-steps", rag, rate("steps", 12.0), SETUP),
    ]
    scenarios = [
        (name, shaped_synthetic(shape, fn, duration_s, seed=seed, name=name), setup)
        for name, shape, fn, setup in cases
    ]
    scenarios.append(("shaped-tenant-mix", tenant_mix(duration_s, seed), SETUP))
    return scenarios


def tenant_mix(duration_s: float, seed: int) -> Traffic:
    """Two tenants on one deployment (added 2026-12-03 as a held-out check, run once
    before any change was judged on it): a chat tenant on a diurnal rate, and a batch
    tenant that submits 6k-token documents for summaries in groups, on for two spells
    (a fifth of the run from 20%, a quarter from 60%). The request rate rises by a
    third while it is on; the prompt tokens about double. A scaler that counts
    requests sees little; the fleet has to follow the mix."""
    chat = TrafficShape(
        cluster_mean=1.5, prompt_median=600.0, prompt_sigma=1.0, output_median=180.0
    )
    batch = TrafficShape(
        cluster_mean=4.0,
        prompt_median=5000.0,
        prompt_sigma=0.6,
        max_prompt=30_000,
        output_median=250.0,
        output_sigma=0.5,
    )

    def batch_rate(t: float) -> float:
        share = t / duration_s
        return 3.0 if 0.2 <= share < 0.4 or 0.6 <= share < 0.85 else 0.0

    name = "shaped-tenant-mix"
    chat_rate = rate_function("diurnal", 10.0, duration_s)
    return merged(
        [
            shaped_synthetic(chat, chat_rate, duration_s, seed=seed, name=name),
            shaped_synthetic(batch, batch_rate, duration_s, seed=seed + 7_919, name=name),
        ],
        name,
    )


def static_sweep(sizing: GroundTruthSizing) -> list[str]:
    """Fixed fleet sizes to run beside the policies: quantiles of the true need."""
    needs = sizing.needs
    sizes = {int(np.ceil(np.quantile(needs, q))) for q in (0.5, 0.75, 0.9, 0.97, 1.0)}
    return [f"static@{n}" for n in sorted(sizes) if n > 0]


def prediction_accuracy(run: PolicyRun) -> dict[str, float]:
    """Median relative error of ours' predictions against the simulation (see
    :func:`~stepscale_operator.simulator.policies.prediction_errors`)."""
    if not isinstance(run.policy, PlannerDrivenPolicy):
        return {}
    return prediction_errors(run.policy, run.result)


@dataclass(frozen=True)
class Verdict:
    """One of the issue's acceptance criteria, judged on one scenario."""

    scenario: str
    criterion: str
    value: str  # what was measured, in words
    passed: bool | None  # None: not judged (a policy it needs did not run)


# The Dynamo-style baseline at more headroom than the definition (0): the
# GPU-hours it needs to reach a given attainment, for a comparison at equal attainment.
DYNAMO_SWEEP = readme.DYNAMO_SWEEP
ATTAINMENT_TARGET = 0.99
ORACLE_RATIO_LIMIT = 1.15
PREDICTION_ERROR_LIMIT = 0.10
# The rules every scenario is judged on (issue 14).
ORACLE_SLACK = 0.005  # attainment >= min(99%, oracle's - half a point)
WINDOW_RATIO_LIMIT = 1.2  # GPU-hours <= 1.2x oracle+window
P99_ERROR_LIMIT = 0.15  # predicted p99 TTFT and ITL: median error
P99_BIAS_LIMIT = 0.10  # ... and signed bias
SHARED_TRACE = "azure-conv-x20"  # the shared trace at its usual scale
SHARED_ATTAINMENT = 0.995


def judge(
    rows: list[RunSummary],
    accuracy: dict[str, dict[str, float]],
    per_burst: dict[str, dict[str, list[float]]] | None = None,
    confirmed: dict[str, dict[str, float]] | None = None,
) -> list[Verdict]:
    """The issue's targets, per scenario: PASS, FAIL, or not judged (references too).

    ``per_burst``: scenario -> policy -> attainment in each burst window, then
    after the first burst (see :func:`burst_attainment`); ``confirmed``: scenario ->
    policy -> replica-seconds over :func:`confirmed_span`.
    """
    verdicts: list[Verdict] = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        runs = {r.policy: r for r in rows if r.scenario == scenario}
        bursts = (per_burst or {}).get(scenario, {})
        verdicts.extend(
            _judge_scenario(
                scenario,
                runs,
                accuracy.get(scenario, {}),
                bursts,
                (confirmed or {}).get(scenario, {}),
            )
        )
        verdicts.extend(_shape_rules(scenario, runs, accuracy.get(scenario, {})))
    return verdicts


def _shape_rules(
    scenario: str, runs: dict[str, RunSummary], acc: dict[str, float]
) -> list[Verdict]:
    """The rules every scenario must meet (static sweep, oracle, window, prediction)."""
    ours = runs.get("ours")
    if ours is None:
        return []
    out: list[Verdict] = []

    def add(criterion: str, value: str, passed: bool | None) -> None:
        out.append(Verdict(scenario, criterion, value, passed))

    statics = [r for p, r in runs.items() if p.startswith("static")]
    better = [
        r for r in statics if r.attainment >= ours.attainment and r.gpu_hours < ours.gpu_hours
    ]
    add(
        "R1 no static size attains as much for fewer GPU-h",
        (
            "; ".join(f"{r.policy} {r.attainment:.2%} at {r.gpu_hours:.2f}" for r in better)
            or f"none of {len(statics)} sizes (ours {ours.attainment:.2%} at {ours.gpu_hours:.2f})"
        ),
        not better if statics else None,
    )
    oracle = runs.get("oracle")
    if oracle is not None:
        goal = min(ATTAINMENT_TARGET, oracle.attainment - ORACLE_SLACK)
        add(
            "R2 attainment >= min(99%, oracle - 0.5 pt)",
            f"{ours.attainment:.2%} vs {goal:.2%} (oracle {oracle.attainment:.2%})",
            ours.attainment >= goal,
        )
    window = runs.get("oracle+window")
    if window is not None and window.gpu_hours > 0.0:
        ratio = ours.gpu_hours / window.gpu_hours
        add(
            f"R3 GPU-h <= {WINDOW_RATIO_LIMIT}x oracle+window",
            f"{ours.gpu_hours:.2f} / {window.gpu_hours:.2f} = {ratio:.2f}x",
            ratio <= WINDOW_RATIO_LIMIT,
        )
    for metric in ("ttft", "itl"):
        err, bias = acc.get(f"median_error_{metric}_p99"), acc.get(f"median_bias_{metric}_p99")
        criterion = (
            f"R4-{metric.upper()} predicted p99: median error <= {P99_ERROR_LIMIT:.0%}, "
            f"bias within +-{P99_BIAS_LIMIT:.0%}"
        )
        if err is None or bias is None:
            add(criterion, "no steady window to compare", None)
            continue
        # What a window's size alone costs a perfect prediction (a floor; see
        # sample_p99_error): shown beside the error, not taken off it.
        floor = acc.get(f"sampling_error_{metric}_p99")
        floor_words = "" if floor is None else f" (a window's sample p99 alone: >= {floor:.1%})"
        add(
            criterion,
            f"error {err:.1%}{floor_words}, bias {bias:+.1%} over "
            f"{acc.get('windows', 0):.0f} windows",
            err <= P99_ERROR_LIMIT and abs(bias) <= P99_BIAS_LIMIT,
        )
    if scenario == SHARED_TRACE and oracle is not None and oracle.gpu_hours > 0.0:
        ratio = ours.gpu_hours / oracle.gpu_hours
        add(
            f"R5 shared trace: >= {SHARED_ATTAINMENT:.1%} and <= {ORACLE_RATIO_LIMIT}x oracle",
            f"{ours.attainment:.2%} at {ratio:.2f}x",
            ours.attainment >= SHARED_ATTAINMENT and ratio <= ORACLE_RATIO_LIMIT,
        )
    return out


def burst_attainment(result: SimResult, duration_s: float, period_s: float) -> list[float]:
    """Attainment in each burst of the synthetic bursts, then over everything after
    the first burst (the part a policy that has seen one burst can be judged on)."""
    windows = burst_windows(duration_s, period_s)
    if not windows:
        return []
    after_first = (windows[0][1], duration_s)
    return attainment_in_windows(result, SLO, [*windows, after_first])


def confirmed_span(duration_s: float, period_s: float) -> tuple[float, float] | None:
    """Whole periods from the end of the third burst: by then a policy can know
    the bursts recur (ours confirms a period on three onsets). None if none fit."""
    windows = burst_windows(duration_s, period_s)
    if len(windows) < 3:
        return None
    start = windows[2][1]
    periods = math.floor((duration_s - start) / period_s)
    return (start, start + periods * period_s) if periods >= 1 else None


def _judge_scenario(
    scenario: str,
    runs: dict[str, RunSummary],
    acc: dict[str, float],
    bursts: dict[str, list[float]],
    confirmed: dict[str, float],
) -> list[Verdict]:
    ours = runs.get("ours")
    out: list[Verdict] = []

    def add(criterion: str, value: str, passed: bool | None) -> None:
        out.append(Verdict(scenario, criterion, value, passed))

    if ours is None:
        return [Verdict(scenario, "all criteria", "ours did not run", None)]
    add(
        f"ours TTFT and ITL attainment >= {ATTAINMENT_TARGET:.0%}",
        f"TTFT {ours.ttft_attainment:.2%}, ITL {ours.itl_attainment:.2%}",
        min(ours.ttft_attainment, ours.itl_attainment) >= ATTAINMENT_TARGET,
    )
    hindsight = runs.get("hindsight")
    if hindsight is not None:
        # Not a criterion: what sizing exactly to all load seen so far reaches.
        add(
            "reference: hindsight (exact past load, no margin, never scales down)",
            f"{hindsight.attainment:.2%} at {hindsight.gpu_hours:.2f} GPU-h",
            None,
        )
    if len(bursts.get("ours", [])) > 2:
        # Not a criterion: the first burst rises faster than pods start and nothing
        # like it came before; every later one could be prepared for.
        add(
            "reference: attainment per burst, and after the first burst",
            "; ".join(
                f"{name} "
                + " / ".join(f"{share:.1%}" for share in bursts[name][:-1])
                + f", after {bursts[name][-1]:.2%}"
                for name in ("ours", "ours@memory", "hindsight", "oracle")
                if name in bursts
            ),
            None,
        )
    if confirmed.get("ours") and confirmed.get("oracle"):
        window = confirmed.get("oracle+window")
        add(
            "reference: replica-seconds over whole periods after the third burst "
            "(a period can be known)",
            f"ours {confirmed['ours'] / confirmed['oracle']:.2f}x oracle"
            + (f", {confirmed['ours'] / window:.2f}x oracle+window" if window else ""),
            None,
        )
    oracle = runs.get("oracle")
    if oracle is None or oracle.gpu_hours <= 0.0:
        add(f"GPU-hours <= {ORACLE_RATIO_LIMIT}x oracle", "oracle did not run", None)
    else:
        ratio = ours.gpu_hours / oracle.gpu_hours
        add(
            f"GPU-hours <= {ORACLE_RATIO_LIMIT}x oracle",
            f"{ours.gpu_hours:.2f} / {oracle.gpu_hours:.2f} = {ratio:.2f}x",
            ratio <= ORACLE_RATIO_LIMIT,
        )
        windowed = runs.get("oracle+window")
        if windowed is not None:
            # Not a criterion: the floor for any policy that scales down slowly.
            bound = windowed.gpu_hours / oracle.gpu_hours
            beyond = (
                f"; above {ORACLE_RATIO_LIMIT}x: no policy with the window meets that here"
                if bound > ORACLE_RATIO_LIMIT
                else ""
            )
            add(
                "bound: oracle+window (knows the future, no margin, scales down after "
                "ours' stabilization window)",
                f"{windowed.gpu_hours:.2f} GPU-h = {bound:.2f}x oracle at "
                f"{windowed.attainment:.2%}; ours {ours.gpu_hours / windowed.gpu_hours:.2f}x "
                f"of it{beyond}",
                None,
            )
    for name in ("hpa", "dynamo"):
        criterion = f"no {name} setting attains as much as ours with fewer GPU-hours"
        family = [r for p, r in runs.items() if p == name or p.startswith(name + "@")]
        if not family:
            add(criterion, f"{name} did not run", None)
            continue
        add(criterion, *_at_equal_attainment(ours, family))
    for metric in ("ttft", "itl"):
        key = f"median_error_{metric}_mean"
        criterion = (
            f"predicted vs simulated mean {metric.upper()} median error "
            f"<= {PREDICTION_ERROR_LIMIT:.0%}"
        )
        if key not in acc:
            add(criterion, "no steady window to compare", None)
            continue
        add(
            criterion,
            f"{acc[key]:.1%} over {acc.get('windows', 0):.0f} windows",
            acc[key] <= PREDICTION_ERROR_LIMIT,
        )
    return out


def _at_equal_attainment(ours: RunSummary, family: list[RunSummary]) -> tuple[str, bool]:
    """Ours against the cheapest setting of a baseline that attains at least as much.

    A baseline run at its default setting may be cheaper only because it misses
    the SLO; the fair comparison is the GPU-hours each needs for the same
    attainment. So every setting of the baseline that ran (e.g. the Dynamo-style
    headroom sweep) is a candidate; if none reaches ours' attainment, the baseline
    cannot buy it at any of the tried costs, and ours is better.
    """
    matched = [r for r in family if r.attainment >= ours.attainment]
    best = max(family, key=lambda r: r.attainment)
    if not matched:
        return (
            f"no setting reaches ours' {ours.attainment:.2%} (best {best.policy} "
            f"{best.attainment:.2%} at {best.gpu_hours:.2f} GPU-h; ours {ours.gpu_hours:.2f})",
            True,
        )
    cheapest = min(matched, key=lambda r: r.gpu_hours)
    return (
        f"GPU-h {ours.gpu_hours:.2f} vs {cheapest.gpu_hours:.2f} ({cheapest.policy}, "
        f"attainment {ours.attainment:.2%} vs {cheapest.attainment:.2%})",
        ours.gpu_hours < cheapest.gpu_hours,
    )


def print_verdicts(verdicts: list[Verdict]) -> None:
    """One line per criterion: PASS, FAIL or n/a, what, and the measured values."""
    print("Issue targets:")
    for v in verdicts:
        mark = "n/a " if v.passed is None else ("PASS" if v.passed else "FAIL")
        print(f"  {mark}  {v.scenario:<22} {v.criterion}: {v.value}")


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


# Per-scenario state the worker processes inherit (fork) instead of unpickling.
_SCENARIOS: dict[str, tuple[Traffic, GroundTruthSizing, ScalingSetup]] = {}
_SEED = 0


def _run_one(job: tuple[str, str]) -> tuple[RunSummary, SimResult, dict[str, float]]:
    """One policy on one scenario (a worker process): summary, result, accuracy."""
    scenario, name = job
    traffic, sizing, setup = _SCENARIOS[scenario]
    (run,) = run_policies(
        traffic,
        [name],
        setup,
        scenario,
        profile=H100_LLAMA_8B,
        planner_policy=PlannerPolicy(),
        seed=_SEED,
        sizing=sizing,
    )
    accuracy = prediction_accuracy(run) if name == "ours" else {}
    return run.summary, run.result, accuracy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with ``--quick`` applied."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rate-scale", type=float, default=readme.TRACE_RATE_SCALE, help="Azure trace rate scale"
    )
    parser.add_argument("--duration-s", type=float, default=None, help="cut the trace")
    parser.add_argument("--burst-rps", type=float, default=readme.BURSTS.base_rps)
    parser.add_argument("--burst-duration-s", type=float, default=readme.BURSTS.duration_s)
    parser.add_argument(
        "--slow-burst-duration-s",
        type=float,
        default=readme.SLOW_BURSTS.duration_s,
        help=f"length of the bursts every {SLOW_BURST_PERIOD_S:.0f} s (0: not run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="shortened scenarios for iterating: first 30 min of the trace, 20 min of bursts",
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="policies simulated in parallel (processes)"
    )
    parser.add_argument(
        "--policies",
        default=",".join((*POLICY_NAMES, "ours@memory", *DYNAMO_SWEEP)),
        help="policies to run; dynamo@H is the Dynamo-style baseline aiming H below the SLO",
    )
    parser.add_argument(
        "--no-shapes",
        dest="shapes",
        action="store_false",
        help="skip the shaped synthetic scenarios and the trace's other rate scales",
    )
    parser.add_argument("--shape-duration-s", type=float, default=1800.0)
    parser.add_argument(
        "--startup-s",
        type=float,
        default=None,
        help="pod start-up time of every scenario (default: each scenario's own, 60 s)",
    )
    parser.add_argument("--only", default="", help="comma-separated scenario names to run")
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s = args.duration_s or 1800.0
        args.burst_duration_s = min(args.burst_duration_s, 1200.0)
        args.slow_burst_duration_s = min(args.slow_burst_duration_s, 4200.0)
        args.shape_duration_s = min(args.shape_duration_s, 1200.0)
    return args


Scenario = tuple[str, Traffic, ScalingSetup]
Outcome = tuple[RunSummary, SimResult, dict[str, float]]
# The bursts scenarios and their period (per-burst attainment is judged on them).
BURST_PERIODS = {BURSTS: BURST_PERIOD_S, SLOW_BURSTS: SLOW_BURST_PERIOD_S}


def build_scenarios(args: argparse.Namespace) -> tuple[list[Scenario], Traffic | None]:
    """The scenarios the arguments ask for, and the raw trace (None without it)."""
    scenarios: list[Scenario] = []
    raw_trace: Traffic | None = None
    if TRACE.exists():
        raw_trace = load_azure_csv(TRACE)
        scales = sorted({args.rate_scale, *(TRACE_SCALES if args.shapes else ())})
        for scale in scales:
            scaled = raw_trace.scaled(rate_scale=scale, duration_s=args.duration_s, seed=args.seed)
            scenarios.append((f"azure-conv-x{scale:g}", scaled, SETUP))
    else:
        print(f"(no trace at {TRACE}: synthetic scenario only)", file=sys.stderr)
    bursts = readme.BURSTS.traffic(args.burst_duration_s, args.burst_rps, seed=args.seed)
    scenarios.append((BURSTS, bursts, SETUP))
    if args.slow_burst_duration_s > 0.0:
        slow = readme.SLOW_BURSTS.traffic(
            args.slow_burst_duration_s, args.burst_rps, seed=args.seed
        )
        scenarios.append((SLOW_BURSTS, slow, SETUP))
    if args.shapes:
        scenarios.extend(shaped_scenarios(args.shape_duration_s, args.seed))
    if args.only:
        wanted = set(args.only.split(","))
        scenarios = [sc for sc in scenarios if sc[0] in wanted]
    if args.startup_s is not None:
        startup = float(args.startup_s)
        scenarios = [(name, t, replace(s, startup_s=startup)) for name, t, s in scenarios]
    return scenarios, raw_trace


def size_scenarios(
    scenarios: list[Scenario], seed: int
) -> tuple[dict[str, dict[str, object]], dict[str, list[str]]]:
    """Each scenario's ground-truth sizing (kept for the workers) and static sweep."""
    sizings: dict[str, dict[str, object]] = {}
    sweeps: dict[str, list[str]] = {}
    for name, traffic, setup in scenarios:
        sizing = ground_truth_sizing(traffic, setup, H100_LLAMA_8B, seed=seed)
        _SCENARIOS[name] = (traffic, sizing, setup)
        sweeps[name] = static_sweep(sizing)
        sizings[name] = {
            "capacity_rps_per_replica_by_size": {
                str(n): c
                for n, c in zip(sizing.capacity.sizes, sizing.capacity.per_replica_rps, strict=True)
            },
            "fit_factor": sizing.fit_factor,
            "peak_need": float(sizing.needs.max()),
            "calibration_wall_s": sizing.wall_s,
        }
        print(
            f"{name}: {len(traffic)} requests, {traffic.duration_s:.0f} s, "
            f"{len(traffic) / traffic.duration_s:.1f} req/s; ground-truth capacity per "
            f"replica by fleet size {{{sizing.capacity.describe()}}} req/s "
            f"({sizing.fit_factor:.2f}x the steady stretches'; measured in "
            f"{sizing.wall_s:.0f} s), "
            f"peak need {sizing.needs.max()}; static sweep {sweeps[name]}",
            file=sys.stderr,
        )
    return sizings, sweeps


def plan_jobs(
    scenarios: list[Scenario], names: list[str], sweeps: dict[str, list[str]]
) -> list[tuple[str, str]]:
    """(scenario, policy) pairs to run.

    The burst memory alone (``ours@memory``) differs from ours only on bursts.
    The extra settings (the Dynamo headroom sweep, ours@memory) run on the
    scenarios they were made for; every scenario gets the static sweep and the
    hindsight reference (cheap: no FPM), which shows what a rise faster than pods
    start costs a policy that reacts to it exactly.
    """
    extras = {"ours@memory", *DYNAMO_SWEEP}
    return [
        (scenario, policy)
        for scenario, _, _ in scenarios
        for policy in [*names, *sweeps[scenario]]
        if policy not in extras
        or (policy == "ours@memory" and scenario in BURST_PERIODS)
        or (policy != "ours@memory" and scenario in (SHARED_TRACE, BURSTS, SLOW_BURSTS))
    ]


def run_jobs(
    jobs: list[tuple[str, str]], first_scenario: str, workers: int
) -> dict[tuple[str, str], Outcome]:
    """Every job's outcome, ``workers`` processes at a time."""
    outcomes: dict[tuple[str, str], Outcome] = {}
    if workers > 1:
        # Longest first (the FPM-driven run and the big fleets on the trace).
        order = sorted(jobs, key=lambda j: (not j[1].startswith("ours"), j[0] != first_scenario))
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            for job, outcome in zip(order, pool.map(_run_one, order), strict=True):
                outcomes[job] = outcome
                print(f"  {job[0]} {job[1]}: {outcome[0].wall_s:.0f} s wall", file=sys.stderr)
    else:
        for job in jobs:
            outcomes[job] = _run_one(job)
            print(f"  {job[0]} {job[1]}: {outcomes[job][0].wall_s:.0f} s wall", file=sys.stderr)
    return outcomes


@dataclass
class Collected:
    """The outcomes arranged for the table, the rules and the plots."""

    rows: list[RunSummary] = field(default_factory=list)
    accuracy: dict[str, dict[str, float]] = field(default_factory=dict)
    per_burst: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    confirmed: dict[str, dict[str, float]] = field(default_factory=dict)
    plotted: dict[str, list[SimResult]] = field(default_factory=dict)


def collect(jobs: list[tuple[str, str]], outcomes: dict[tuple[str, str], Outcome]) -> Collected:
    """Rows, prediction accuracy, per-burst attainment and the plotted runs, in job order."""
    got = Collected()
    for job in jobs:
        summary, result, acc = outcomes[job]
        got.rows.append(summary)
        if acc:
            got.accuracy[job[0]] = acc
        if job[0] in BURST_PERIODS:
            period = BURST_PERIODS[job[0]]
            got.per_burst.setdefault(job[0], {})[job[1]] = burst_attainment(
                result, result.traffic.duration_s, period
            )
            span = confirmed_span(result.traffic.duration_s, period)
            if span is not None:
                got.confirmed.setdefault(job[0], {})[job[1]] = replica_seconds(result, *span)
        if job[1] in POLICY_NAMES:  # the sweep's extra settings would clutter the plot
            got.plotted.setdefault(job[0], []).append(result)
    return got


def print_report(got: Collected, oracle: dict[str, float]) -> list[Verdict]:
    """The table, the prediction accuracy and the verdicts; returns the verdicts."""
    print()
    print(f"SLO: TTFT <= {SLO.ttft_ms:.0f} ms and ITL <= {SLO.itl_ms:.0f} ms per request")
    print(format_table(got.rows, oracle))
    print()
    print("Planner prediction accuracy (median relative error, predicted vs simulated):")
    for name, acc in got.accuracy.items():
        parts = ", ".join(
            f"{k.removeprefix('median_error_')} {v:.1%}" for k, v in acc.items() if k != "windows"
        )
        print(f"  {name}: {parts} over {acc.get('windows', 0):.0f} windows")
    verdicts = judge(got.rows, got.accuracy, got.per_burst, got.confirmed)
    print()
    print_verdicts(verdicts)
    return verdicts


def plot_scenarios(scenarios: list[Scenario], got: Collected, out: Path) -> list[str]:
    """One timeline per scenario; the paths written."""
    pngs: list[str] = []
    for k, (scenario, _, setup) in enumerate(scenarios):
        # The first scenario (the trace) is the headline plot; others get a suffix.
        png = out / ("policies_timeline.png" if k == 0 else f"policies_timeline_{scenario}.png")
        scale = float(scenario.rsplit("-x", 1)[1]) if scenario.startswith("azure-conv-x") else 1.0
        title = plot_title(scenario, scale, setup.slo, setup.startup_s)
        plot_timeline(got.plotted.get(scenario, []), setup.slo, str(png), title=title)
        pngs.append(str(png))
    return pngs


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; returns 0."""
    global _SEED
    args = parse_args(argv)
    names = [n for n in args.policies.split(",") if n]
    _SEED = args.seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scenarios, raw_trace = build_scenarios(args)

    began = time.perf_counter()
    sizings, sweeps = size_scenarios(scenarios, args.seed)
    jobs = plan_jobs(scenarios, names, sweeps)
    outcomes = run_jobs(jobs, scenarios[0][0], args.jobs)
    got = collect(jobs, outcomes)
    speed = speed_check(raw_trace)

    oracle = {r.scenario: r.gpu_hours for r in got.rows if r.policy == "oracle"}
    verdicts = print_report(got, oracle)
    print(
        f"Speed: {speed['simulated_s']:.0f} s of {speed['requests']:.0f} requests on 20 replicas "
        f"({speed['passes']:.0f} passes) simulated in {speed['wall_s']:.1f} s"
    )
    total_s = time.perf_counter() - began
    print(f"Total benchmark time {total_s:.0f} s")

    payload = {
        "slo": asdict(SLO),
        "setup": {"startup_s": SETUP.startup_s, "limits": asdict(SETUP.limits)},
        "planner_policy": asdict(PlannerPolicy()),
        "args": vars(args),
        "ground_truth_sizing": sizings,
        "runs": [
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in r.to_dict().items()
            }
            for r in got.rows
        ],
        "oracle_gpu_hours": oracle,
        "prediction_accuracy": got.accuracy,
        "attainment_per_burst_then_after_first": got.per_burst,
        "replica_seconds_after_third_burst": got.confirmed,
        "criteria": [asdict(v) for v in verdicts],
        "speed": speed,
        "total_wall_s": total_s,
    }
    (out / "bench_policies.json").write_text(json.dumps(payload, indent=2))
    pngs = plot_scenarios(scenarios, got, out)
    print(f"wrote {out / 'bench_policies.json'} and {', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
