"""``stepscale simulate``: replay a trace (or synthetic load) against scaling policies.

The README's tables, reproduced:

  stepscale simulate --trace azure_llm_conv_2023.csv --rate-scale 20 --policy all --plot
  stepscale simulate --synthetic bursts --policy all --plot
  stepscale simulate --synthetic bursts-20min --policy all --plot

Files named without a directory (and --plot, --json given without a name) are
written under results/.
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

import numpy as np

from stepscale_operator.cli_input import (
    InputError,
    OneLineParser,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    report,
)
from stepscale_operator.latency_model import EngineLimits, SloTargets
from stepscale_operator.planner import PlannerPolicy
from stepscale_operator.simulator.ground_truth import (
    H100_LLAMA_8B,
    StepTimeProfile,
    profile_with,
)
from stepscale_operator.simulator.policies import ScalingSetup
from stepscale_operator.simulator.readme_scenarios import (
    BURSTS_ONLY,
    DYNAMO_SWEEP,
    README_POLICIES,
    SETUP,
    SLO,
    SYNTHETIC_SCENARIOS,
    check_policy_name,
)
from stepscale_operator.simulator.report import (
    format_table,
    plot_timeline,
    plot_title,
    write_requests_csv,
)
from stepscale_operator.simulator.scenario import Calibration, run_policies
from stepscale_operator.simulator.traffic import TraceError, Traffic, load_trace

SIMULATE_HELP = "simulate a fleet of engines under a trace and compare scaling policies"
RESULTS_DIR = Path("results")


def policy_list(text: str) -> list[str]:
    """``--policy``: ``all``, or one or more policy names separated by commas."""
    if text.strip() == "all":
        return list(README_POLICIES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a policy name or all")
    try:
        return [check_policy_name(n) for n in names]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def output_path(given: str | None, default_name: str) -> Path | None:
    """Where an output goes: ``None`` (not asked for), ``results/NAME`` for a bare
    file name or an option given without one, ``DIR/default_name`` for a folder,
    else the path as given."""
    if given is None:
        return None
    if given and (given.endswith("/") or Path(given).is_dir()):
        return Path(given) / default_name  # a folder: the default name in it
    name = given or default_name
    return RESULTS_DIR / name if "/" not in name else Path(name)


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``stepscale simulate``."""
    p.epilog = (__doc__ or "").split("\n", 2)[2]
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace")
    src.add_argument(
        "--synthetic",
        choices=tuple(SYNTHETIC_SCENARIOS),
        help="built-in synthetic load: "
        + "; ".join(
            f"{k} ({v.base_rps:g} req/s base, {v.duration_s / 60:.0f} min)"
            for k, v in SYNTHETIC_SCENARIOS.items()
        )
        + "; bursts rise to 2.5x the base every 10 min (bursts-20min: every 20 min)",
    )
    p.add_argument(
        "--policy",
        type=policy_list,
        default=["ours"],
        metavar="NAME[,NAME...]|all",
        help=f"policies to run: {', '.join(README_POLICIES)}, dynamo@H (the Dynamo-style "
        "baseline aiming H below the SLO), or all (every one the README names; default ours)",
    )
    p.add_argument(
        "--duration-s", type=positive_float, default=None, help="keep only the first part"
    )
    p.add_argument(
        "--rate-scale", type=positive_float, default=1.0, help="multiply the request rate"
    )
    p.add_argument(
        "--time-compress", type=positive_float, default=1.0, help="play the trace faster"
    )
    p.add_argument(
        "--base-rps",
        type=positive_float,
        default=None,
        help="synthetic base request rate (default: the scenario's, 40)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (traffic, noise)")
    p.add_argument("--ttft-ms", type=positive_float, default=SLO.ttft_ms, help="TTFT SLO")
    p.add_argument("--itl-ms", type=positive_float, default=SLO.itl_ms, help="ITL SLO")
    p.add_argument(
        "--startup-s", type=non_negative_float, default=SETUP.startup_s, help="pod start-up time"
    )
    p.add_argument("--min-replicas", type=positive_int, default=SETUP.min_replicas)
    p.add_argument("--max-replicas", type=positive_int, default=SETUP.max_replicas)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--kv-capacity-tokens", type=positive_int, default=400_000)
    p.add_argument(
        "--margin",
        type=non_negative_float,
        default=PlannerPolicy.margin,
        help="share below the SLO the planner aims at",
    )
    p.add_argument(
        "--noise-sigma",
        type=non_negative_float,
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
        type=positive_float,
        default=Calibration.duration_s,
        help="length of each run measuring the ground-truth capacity (oracle, static sizing)",
    )
    p.add_argument(
        "--calibration-iterations",
        type=positive_int,
        default=Calibration.iterations,
        help="bisection steps of that measurement (and, up to "
        f"{Calibration.fit_iterations}, of fitting its level to the whole traffic)",
    )
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        metavar="PNG",
        help="write a timeline figure (default name: results/timeline_SCENARIO.png)",
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="",
        metavar="PATH",
        help="write the summaries (default name: results/simulate_SCENARIO.json)",
    )
    p.add_argument(
        "--requests-csv",
        metavar="PATH",
        help="write one row per request and policy (arrival, tokens, replica, TTFT, ITL, "
        "preemptions)",
    )
    p.add_argument(
        "--publish-base-port",
        type=port,
        default=None,
        help="also publish the FPM of each simulated pod i on tcp://127.0.0.{i+2}:PORT, as "
        "real pods at their own IPs (ours only, or the one policy run)",
    )
    p.add_argument(
        "--realtime",
        type=non_negative_float,
        default=0.0,
        help="pace the simulation at this many simulated seconds per wall second (0: flat out)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _traffic(args: argparse.Namespace) -> Traffic:
    if args.trace:
        try:
            base = load_trace(args.trace)
        except TraceError as error:
            raise InputError(f"--trace {error}") from None
    else:
        scenario = SYNTHETIC_SCENARIOS[args.synthetic]
        duration = (args.duration_s or scenario.duration_s) * args.time_compress
        base = scenario.traffic(duration, args.base_rps, seed=args.seed)
    traffic = base.scaled(args.rate_scale, args.time_compress, args.duration_s, seed=args.seed)
    if len(traffic) == 0:
        raise InputError(
            f"no requests in the first {args.duration_s:g} s of {traffic.name}; "
            "expected a longer --duration-s"
        )
    return traffic


def _profile(args: argparse.Namespace) -> StepTimeProfile:
    """The ground truth: the default profile with ``--profile`` and ``--noise-sigma`` applied."""
    overrides: dict[str, object] = {}
    try:
        if args.profile:
            text = args.profile
            if not text.lstrip().startswith("{"):
                text = Path(text).read_text()
            loaded = json.loads(text)
            if not isinstance(loaded, dict):
                raise ValueError("expected a JSON object")
            overrides.update(loaded)
        if args.noise_sigma is not None:
            overrides["noise_sigma"] = args.noise_sigma
        return profile_with(H100_LLAMA_8B, overrides)
    except (OSError, ValueError) as error:
        raise InputError(f"bad --profile/--noise-sigma: {error}") from None


class _Progress:
    """A tqdm bar over the requests that have arrived (when tqdm is installed), plus
    optional pacing.

    Counts whole requests, summed over the policies: each policy's run advances it
    by the requests that arrived up to the simulated time it has covered, so the
    bar ends at requests x policies. It is created at the first tick, so the
    ground-truth calibration before the first run does not skew its rate and ETA.
    """

    def __init__(
        self,
        arrival_s: np.ndarray[Any, np.dtype[np.float64]],
        policies: int,
        enabled: bool,
        realtime: float,
    ) -> None:
        self.arrival_s = arrival_s
        self.total = int(arrival_s.size) * policies
        self.enabled = enabled
        self.realtime = realtime
        self._bar: Any = None
        self._label = ""
        self._done = 0  # requests of the current run already counted
        self._began = time.monotonic()

    def _open_bar(self) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self.enabled = False
            return
        # Redrawn at most once a second when stderr is a file (a log, CI), not a terminal.
        interval = 0.1 if sys.stderr.isatty() else 1.0
        self._bar = tqdm(
            total=self.total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=interval
        )

    def __call__(self, label: str, now: float) -> None:
        if self.enabled and self._bar is None:
            self._open_bar()
        if label != self._label:
            self._label = label
            self._done = 0
            self._began = time.monotonic()
            if self._bar is not None:
                self._bar.set_description(label)
        arrived = int(np.searchsorted(self.arrival_s, now, side="right"))
        if self._bar is not None and arrived > self._done:
            self._bar.update(arrived - self._done)
        self._done = max(self._done, arrived)
        if self.realtime > 0.0:
            ahead = now / self.realtime - (time.monotonic() - self._began)
            if ahead > 0.0:
                time.sleep(ahead)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``stepscale simulate``; prints the comparison table, returns an exit code.

    Raises :class:`InputError` for a bad input (the CLI prints it in one line).
    """
    if args.min_replicas > args.max_replicas:
        raise InputError(
            f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}; "
            "expected min <= max"
        )
    traffic = _traffic(args)
    profile = _profile(args)
    names = list(args.policy)
    bursts = args.synthetic is not None and SYNTHETIC_SCENARIOS[args.synthetic].kind == "bursts"
    if names == list(README_POLICIES) and not bursts:
        # "all": the burst memory alone differs from ours only where bursts recur.
        names = [n for n in names if n not in BURSTS_ONLY]
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
        f"({len(traffic) / max(traffic.duration_s, 1e-9):.1f} req/s); policies "
        f"{', '.join(names)}; measuring the ground-truth capacity first",
        file=sys.stderr,
    )
    tap = None
    if args.publish_base_port is not None:
        from stepscale_operator.simulator.publish import SimulatedPodPublishers

        tap = SimulatedPodPublishers(args.publish_base_port)
    progress = _Progress(
        traffic.arrival_s,
        len(names),
        not args.no_progress and traffic.duration_s > 300,
        args.realtime,
    )
    calibration = Calibration(
        duration_s=args.calibration_s,
        warmup_s=min(Calibration.warmup_s, args.calibration_s / 5.0),
        iterations=args.calibration_iterations,
        fit_iterations=min(args.calibration_iterations, Calibration.fit_iterations),
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
    scenario = traffic.name + (f"-x{args.rate_scale:g}" if args.rate_scale != 1.0 else "")
    plot = output_path(args.plot, f"timeline_{scenario}.png")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        title = plot_title(traffic.name, args.rate_scale, slo, args.startup_s)
        # With "all", the Dynamo-style sweep's extra settings would clutter the figure.
        shown = [r for r in runs if r.summary.policy not in DYNAMO_SWEEP or len(runs) < 8]
        plot_timeline([r.result for r in shown], slo, str(plot), title=title)
        print(f"timeline written to {plot}", file=sys.stderr)
    requests_csv = output_path(args.requests_csv, f"requests_{scenario}.csv")
    if requests_csv is not None:
        requests_csv.parent.mkdir(parents=True, exist_ok=True)
        count = write_requests_csv([r.result for r in runs], str(requests_csv))
        print(f"{count} request rows written to {requests_csv}", file=sys.stderr)
    summaries = output_path(args.json, f"simulate_{scenario}.json")
    if summaries is not None:
        payload = {
            "traffic": {
                "name": traffic.name,
                "requests": len(traffic),
                "duration_s": traffic.duration_s,
                "rate_scale": args.rate_scale,
            },
            "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
            "profile": dataclasses.asdict(profile),
            "runs": [_finite(r.to_dict()) for r in rows],
        }
        summaries.parent.mkdir(parents=True, exist_ok=True)
        summaries.write_text(json.dumps(payload, indent=2))
        print(f"summaries written to {summaries}", file=sys.stderr)
    return 0


def _finite(d: dict[str, object]) -> dict[str, object]:
    # JSON has no NaN/inf: report them as null.
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m stepscale_operator.simulate_cli ...``."""
    parser = OneLineParser(prog="stepscale simulate", description=SIMULATE_HELP)
    add_simulate_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_simulate(args)
    except InputError as error:
        return report("stepscale simulate", error)


if __name__ == "__main__":
    raise SystemExit(main())
