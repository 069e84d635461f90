"""``stepscale simulate``: replay a trace (or synthetic load) against scaling policies.

Example::

    stepscale simulate --trace ../shared/traces/azure_llm_conv_2023.csv \\
        --rate-scale 20 --policy all --plot timeline.png --json results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.planner import PlannerPolicy
from stepscale_operator.simulator.ground_truth import (
    H100_LLAMA_8B,
    StepTimeProfile,
    profile_with,
)
from stepscale_operator.simulator.policies import ScalingSetup
from stepscale_operator.simulator.report import format_table, plot_timeline, write_requests_csv
from stepscale_operator.simulator.scenario import POLICY_NAMES, Calibration, run_policies
from stepscale_operator.simulator.traffic import SYNTHETIC_KINDS, Traffic, load_trace, synthetic

SIMULATE_HELP = "simulate a fleet of engines under a trace and compare scaling policies"


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``stepscale simulate``."""
    p.epilog = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace")
    src.add_argument("--synthetic", choices=SYNTHETIC_KINDS, help="built-in synthetic load")
    p.add_argument("--policy", default="ours", choices=(*POLICY_NAMES, "all"))
    p.add_argument("--duration-s", type=float, default=None, help="keep only the first part")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the request rate")
    p.add_argument("--time-compress", type=float, default=1.0, help="play the trace faster")
    p.add_argument("--base-rps", type=float, default=5.0, help="synthetic base request rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--itl-ms", type=float, default=40.0)
    p.add_argument("--startup-s", type=float, default=60.0, help="pod start-up time")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-capacity-tokens", type=int, default=400_000)
    p.add_argument("--margin", type=float, default=PlannerPolicy.margin)
    p.add_argument(
        "--noise-sigma",
        type=float,
        default=None,
        help=f"log-normal noise of each pass's time (default {H100_LLAMA_8B.noise_sigma})",
    )
    p.add_argument(
        "--profile",
        metavar="JSON",
        help="ground-truth step-time fields to override, as a JSON object or a file holding "
        'one, e.g. \'{"flops_per_s": 4e14, "overhead_s": 0.002}\' (default: Llama-3-8B on H100)',
    )
    p.add_argument(
        "--calibration-s",
        type=float,
        default=Calibration.duration_s,
        help="length of each run measuring the ground-truth capacity (oracle, static sizing)",
    )
    p.add_argument(
        "--calibration-iterations",
        type=int,
        default=Calibration.iterations,
        help="bisection steps of that measurement",
    )
    p.add_argument("--plot", help="write a PNG timeline here")
    p.add_argument("--json", help="write the summaries here")
    p.add_argument(
        "--requests-csv",
        metavar="PATH",
        help="write one row per request and policy (arrival, tokens, replica, TTFT, ITL, "
        "preemptions)",
    )
    p.add_argument(
        "--publish-base-port",
        type=int,
        default=None,
        help="also publish the FPM of each simulated pod i on tcp://127.0.0.{i+2}:PORT, as "
        "real pods at their own IPs (ours only, or the one policy run)",
    )
    p.add_argument(
        "--realtime",
        type=float,
        default=0.0,
        help="pace the simulation at this many simulated seconds per wall second (0: flat out)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _traffic(args: argparse.Namespace) -> Traffic:
    if args.trace:
        base = load_trace(args.trace)
    else:
        duration = args.duration_s or 1800.0
        base = synthetic(
            args.synthetic, duration * args.time_compress, args.base_rps, seed=args.seed
        )
    return base.scaled(args.rate_scale, args.time_compress, args.duration_s, seed=args.seed)


def _profile(args: argparse.Namespace) -> StepTimeProfile:
    """The ground truth: the default profile with ``--profile`` and ``--noise-sigma`` applied."""
    overrides: dict[str, object] = {}
    if args.profile:
        text = args.profile
        if not text.lstrip().startswith("{"):
            text = Path(text).read_text()
        loaded = json.loads(text)
        if not isinstance(loaded, dict):
            raise ValueError("--profile must be a JSON object")
        overrides.update(loaded)
    if args.noise_sigma is not None:
        overrides["noise_sigma"] = args.noise_sigma
    return profile_with(H100_LLAMA_8B, overrides)


class _Progress:
    """A tqdm bar over simulated seconds (when tqdm is installed), plus optional pacing.

    Advanced by the simulated time each policy's run has covered, capped at the
    traffic's end: the drain after it adds nothing, so the bar ends at its total.
    """

    def __init__(self, total_s: float, policies: int, enabled: bool, realtime: float) -> None:
        self.total_s = total_s
        self.realtime = realtime
        self._bar: Any = None
        self._label = ""
        self._done_s = 0.0  # simulated seconds of the current run already counted
        self._began = time.monotonic()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=round(total_s * policies), unit="sim-s", file=sys.stderr)

    def __call__(self, label: str, now: float) -> None:
        if label != self._label:
            self._label = label
            self._done_s = 0.0
            self._began = time.monotonic()
            if self._bar is not None:
                self._bar.set_description(label)
        reached = min(max(now, 0.0), self.total_s)
        if self._bar is not None and reached > self._done_s:
            self._bar.update(reached - self._done_s)
        self._done_s = max(self._done_s, reached)
        if self.realtime > 0.0:
            ahead = now / self.realtime - (time.monotonic() - self._began)
            if ahead > 0.0:
                time.sleep(ahead)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``stepscale simulate``; prints the comparison table, returns an exit code."""
    try:
        traffic = _traffic(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"stepscale simulate: cannot load traffic: {exc}", file=sys.stderr)
        return 2
    try:
        profile = _profile(args)
    except (OSError, ValueError) as exc:
        print(f"stepscale simulate: bad --profile/--noise-sigma: {exc}", file=sys.stderr)
        return 2
    names = list(POLICY_NAMES) if args.policy == "all" else [args.policy]
    slo = SloTargets(args.ttft_ms, args.itl_ms)
    setup = ScalingSetup(
        slo=slo,
        limits=EngineLimits(
            args.max_num_batched_tokens, args.max_num_seqs, args.kv_capacity_tokens
        ),
        startup_s=args.startup_s,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
    )
    print(
        f"traffic {traffic.name}: {len(traffic)} requests over {traffic.duration_s:.0f} s "
        f"({len(traffic) / max(traffic.duration_s, 1e-9):.1f} req/s)",
        file=sys.stderr,
    )
    tap = None
    if args.publish_base_port is not None:
        from stepscale_operator.simulator.publish import SimulatedPodPublishers

        tap = SimulatedPodPublishers(args.publish_base_port)
    progress = _Progress(
        traffic.duration_s,
        len(names),
        not args.no_progress and traffic.duration_s > 300,
        args.realtime,
    )
    calibration = Calibration(
        duration_s=args.calibration_s,
        warmup_s=min(Calibration.warmup_s, args.calibration_s / 5.0),
        iterations=args.calibration_iterations,
    )
    try:
        runs = run_policies(
            traffic,
            names,
            setup,
            traffic.name,
            profile=profile,
            planner_policy=PlannerPolicy(margin=args.margin),
            seed=args.seed,
            progress=progress,
            fpm_tap=tap,
            calibration=calibration,
        )
    finally:
        progress.close()
        if tap is not None:
            tap.close()
    rows = [r.summary for r in runs]
    oracle = {r.scenario: r.gpu_hours for r in rows if r.policy == "oracle"}
    print(format_table(rows, oracle))
    if args.plot:
        plot_timeline([r.result for r in runs], slo, args.plot, title=traffic.name)
        print(f"timeline written to {args.plot}", file=sys.stderr)
    if args.requests_csv:
        count = write_requests_csv([r.result for r in runs], args.requests_csv)
        print(f"{count} request rows written to {args.requests_csv}", file=sys.stderr)
    if args.json:
        payload = {
            "traffic": {
                "name": traffic.name,
                "requests": len(traffic),
                "duration_s": traffic.duration_s,
            },
            "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
            "profile": dataclasses.asdict(profile),
            "runs": [_finite(r.to_dict()) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


def _finite(d: dict[str, object]) -> dict[str, object]:
    # JSON has no NaN/inf: report them as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m stepscale_operator.simulate_cli ...``."""
    parser = argparse.ArgumentParser(prog="stepscale simulate", description=SIMULATE_HELP)
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
