"""The latency model's predictions against the simulation, on fixed fleets.

``bench_policies.py`` judges the predictions of a fleet the planner keeps
resizing; here the planner's model predicts every 5 s for a fleet held at a
fixed size (``scenario@n``), or for the planner's own choices (``scenario@0``,
starting at ``--start``), so an error in the queueing model shows apart from the
planner's moves. Per 30 s window, as ``prediction_errors`` compares them: the
median bias and error of the predicted mean and p99 TTFT and p99 ITL, beside
each p99 error its floor (what a window's size alone costs a prediction of its
true p99: the bootstrap's, which is at most that), and the pooled share of
requests above their window's predicted p99 TTFT and ITL (1% when calibrated).
Also the prompt tokens computed in a decode token's pass, on average (what
delays the decodes): what the latency model puts it at (median over
its predictions: a mean step's prompt tokens times the router's exposure) and what
the simulated engines did over the window each prediction measured (the medians
over windows, and the median of their ratio). Then, per run, what the
requests above the run's p99 ITL met while they decoded, beside a sample of
short outputs (``slow_request_anatomy.py``), and per held run, by output
length, the share of short outputs the model has meet a prefill pass while
they decode against the share that did (:func:`short_output_calibration`).
Prints the tables; writes ``bench_prediction.json``.

``--across scenario@6,8,12,16`` holds the fleet at each of those counts and has
the model also predict, from the load measured there, the p99 ITL at each of the
other counts: what the planner asks when it weighs a scale-up or a scale-down.
The matrix printed is the median, over 30 s windows of at least 30 requests, of
the predicted p99 ITL at ``n`` (load measured at ``n0``) over the simulated p99
ITL of the same window on the fleet held at ``n``. Every held run (``@n`` with
``n`` above 0, with or without ``--across``) also gives that ratio at its own
count by the band its prediction fell in (a share of the ITL SLO): the planner's
decisions rest on the bands near 1.0, which a median over every window, mostly
calm ones, hides. On the trace x20 held at 7 and 8 the model read 0.96 and 0.98
over every window, but 0.97 and 0.93 where it predicted 0.8-1.0 of the SLO and
0.92 and 0.79 above it.

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/bench_prediction.py
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_policies as bp  # noqa: E402
from slow_request_anatomy import CLUMP_S, SHORT_TOKENS, slow_request_anatomy  # noqa: E402

from stepscale_engine.wire import ForwardPassMetrics  # noqa: E402
from stepscale_operator.latency_model import (  # noqa: E402
    PerReplicaLoad,
    predict_latency,
    short_output_prefill_counts,
)
from stepscale_operator.simulator import readme_scenarios as readme  # noqa: E402
from stepscale_operator.simulator.fleet import Fleet, FleetView, SimResult  # noqa: E402
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B  # noqa: E402
from stepscale_operator.simulator.policies import (  # noqa: E402
    PlannerDrivenPolicy,
    ScalingSetup,
    prediction_errors,
)
from stepscale_operator.simulator.report import request_latencies  # noqa: E402
from stepscale_operator.simulator.traffic import Traffic, load_azure_csv  # noqa: E402

DEFAULT_RUNS = (
    "azure-conv-x20@8,azure-conv-x20@12,azure-conv-x40@20,shaped-bursty-code@11,"
    "shaped-heavy-prompts@8,shaped-long-context@12,shaped-silence-burst@8,"
    "azure-conv-x20@0,azure-conv-x40@0"
)
SHAPE_DURATION_S = 1800.0  # the shaped scenarios as bench_policies.py makes them
KEYS = (
    "median_bias_ttft_mean",
    "median_bias_ttft_p99",
    "median_error_ttft_p99",
    "median_bias_itl_p99",
    "median_error_itl_p99",
    "sampling_error_ttft_p99",
    "sampling_error_itl_p99",
    "share_above_predicted_ttft_p99",
    "share_above_predicted_itl_p99",
    "windows",
)


@dataclass
class HeldFleetPolicy(PlannerDrivenPolicy):
    """Ours, predicting as always, but held at ``replicas`` (0: the planner's choice)."""

    replicas: int = 0
    # Counts to predict the p99 ITL at as well, from the same load (``--across``).
    across: tuple[int, ...] = ()
    predicted_across: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # Per prediction at the held count: (time, P(K >= 1) for outputs of 1..SHORT_INTERVALS
    # intervals), the prefill passes the model has a short output meet.
    short_meets: list[tuple[float, list[float]]] = field(default_factory=list)
    # Per prediction: (time, the measured lift at 1..SHORT_INTERVALS intervals).
    lifts: list[tuple[float, list[float]]] = field(default_factory=list)

    def desired(self, view: FleetView) -> int:
        """The planner's decision is made (and its prediction recorded); the fleet
        keeps ``replicas`` when set."""
        checks = len(self.checks)
        decided = super().desired(view)
        if len(self.checks) == checks:  # no prediction recorded now
            return self.replicas if self.replicas > 0 else decided
        load = self.model.estimate(view.now)
        if self.across:
            at: dict[int, float] = {}
            for n in self.across:
                per = PerReplicaLoad.from_estimate(load, n)
                pred = predict_latency(
                    self.model.cost_model, per, self.setup.limits, self.planner.policy, n
                )
                at[n] = pred.itl_ms if pred.feasible else math.inf
            self.predicted_across.append((view.now, at))
        if self.replicas > 0:
            counts = short_output_prefill_counts(
                self.model.cost_model,
                PerReplicaLoad.from_estimate(load, self.replicas),
                self.setup.limits,
                self.planner.policy,
                self.replicas,
                SHORT_INTERVALS,
            )
            if counts:
                self.short_meets.append((view.now, [1.0 - float(c[0]) for c in counts]))
            if load.early_prefills is not None:
                lift, _ = load.early_prefills.up_to(SHORT_INTERVALS)
                self.lifts.append((view.now, [float(x) for x in lift]))
        return self.replicas if self.replicas > 0 else decided


class PrefillPassLog:
    """An FPM tap that keeps each simulated pass's end time, replica and whether it
    carried prefill (what a short output met, to set against the model)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, bool]] = []

    def __call__(self, batch: Sequence[tuple[float, ForwardPassMetrics]]) -> None:
        for when, msg in batch:
            if msg.is_heartbeat:
                continue
            sched = msg.scheduled_requests
            replica = int(msg.worker_id.rsplit("-", 1)[1])  # the simulator's "sim-<index>"
            self.rows.append((replica, when, sched.num_prefill_requests > 0))

    def replica_stopped(self, worker_id: str) -> None:
        """Nothing to end: the log is read after the run."""

    def close(self) -> None:
        """Nothing to close."""


def scenario_traffic(name: str, duration_s: float, seed: int) -> tuple[Traffic, ScalingSetup]:
    """The traffic of a ``bench_policies.py`` scenario, cut to ``duration_s``."""
    if name.startswith("azure-conv-x"):
        if not bp.TRACE.exists():
            raise ValueError(f"no trace at {bp.TRACE}")
        scale = float(name.rsplit("-x", 1)[1])
        raw = load_azure_csv(bp.TRACE)
        return raw.scaled(rate_scale=scale, duration_s=duration_s, seed=seed), bp.SETUP
    for synthetic in (readme.BURSTS, readme.SLOW_BURSTS):
        if synthetic.name == name:
            return synthetic.traffic(seed=seed).scaled(duration_s=duration_s), bp.SETUP
    for shaped, traffic, setup in bp.shaped_scenarios(SHAPE_DURATION_S, seed):
        if shaped == name:
            return traffic.scaled(duration_s=duration_s), setup
    # ValueError, not SystemExit: the pool re-raises it here; an exit hangs the pool.
    raise ValueError(f"unknown scenario {name!r}")


def run_one(job: tuple[str, float, int, int, tuple[int, ...]]) -> dict[str, object]:
    """One ``scenario@n`` run: its prediction errors and wall time."""
    run, duration_s, start, seed, across = job
    name, _, count = run.partition("@")
    replicas = int(count or 0)
    traffic, setup = scenario_traffic(name, duration_s, seed)
    # A held run predicts at its own count at least, for the calibration by band.
    own = across or ((replicas,) if replicas else ())
    policy = HeldFleetPolicy(setup=setup, replicas=replicas, across=own)
    began = time.perf_counter()
    config = setup.fleet_config(H100_LLAMA_8B, replicas or start, seed)
    log = PrefillPassLog()
    result = Fleet(traffic, policy, config, fpm_tap=log).run()
    errors = prediction_errors(policy, result)
    held = [check.replicas for check in policy.checks]
    pred, sim, ratio = beside_decodes_by_window(
        result.beside_by_second,
        [(check.time, check.prefill_tokens_per_decode) for check in policy.checks],
    )
    outputs = RequestPasses.of(
        np.array(log.rows, dtype=np.float64).reshape(-1, 3),
        result.requests.first_token_s,
        result.requests.finish_s,
        result.replica_of,
        result.traffic.output_tokens,
    )
    return {
        "run": run,
        "replicas": replicas or "planner",
        "replicas_median": float(statistics.median(held)) if held else 0.0,
        "itl_slo_ms": setup.slo.itl_ms,
        "wall_s": time.perf_counter() - began,
        **{key: errors.get(key, float("nan")) for key in KEYS},
        "prefill_tokens_per_decode_predicted": pred,
        "prefill_tokens_per_decode_simulated": sim,
        "prefill_tokens_per_decode_ratio": ratio,
        "itl_p99_across": [
            (t, {str(n): v for n, v in at.items()}) for t, at in policy.predicted_across
        ],
        "window_itl_p99": window_itl_p99(result, [t for t, _ in policy.predicted_across]),
        "short_outputs_meeting_prefill": short_output_calibration(policy.short_meets, outputs),
        "short_output_lift": short_output_lift(policy.lifts, outputs),
        "slow_requests": slow_request_anatomy(
            result.traffic.arrival_s,
            result.requests.first_token_s,
            result.requests.finish_s,
            result.replica_of,
            result.traffic.output_tokens,
            request_latencies(result).itl_ms,
        ),
    }


# Outputs of up to this many intervals (tokens - 1) are set against the model's
# prefill passes (:func:`short_output_calibration`).
SHORT_INTERVALS = 16
# The passes a request's replica share is taken over, as early_prefills takes it.
LIFT_SHARE_PASSES = 512


@dataclass(frozen=True)
class RequestPasses:
    """Per request of a run, what the passes of its replica held around it: the
    prefill-bearing passes that ended after its first token and by its last
    (``met``), and its replica's share of prefill-bearing passes over the
    :data:`LIFT_SHARE_PASSES` passes up to its first token (``share``); both 0
    for requests that did not finish (``done`` False)."""

    first_token_s: npt.NDArray[np.float64]
    output_tokens: npt.NDArray[np.int64]
    done: npt.NDArray[np.bool_]
    met: npt.NDArray[np.float64]
    share: npt.NDArray[np.float64]
    any_passes: bool

    @classmethod
    def of(
        cls,
        passes: npt.NDArray[np.float64],
        first_token_s: npt.NDArray[np.float64],
        finish_s: npt.NDArray[np.float64],
        replica: npt.NDArray[np.int64],
        output_tokens: npt.NDArray[np.int64],
    ) -> RequestPasses:
        """From the run's (replica, end time, carried prefill) pass rows."""
        done = np.isfinite(first_token_s) & np.isfinite(finish_s)
        met = np.zeros(first_token_s.size)
        share = np.zeros(first_token_s.size)
        for r in np.unique(replica[done]):
            mine = passes[passes[:, 0] == r]
            mine = mine[np.argsort(mine[:, 1], kind="stable")]
            carried = np.concatenate([[0.0], np.cumsum(mine[:, 2])])
            ids = np.flatnonzero(done & (replica == r))
            after = np.searchsorted(mine[:, 1], first_token_s[ids], side="right")
            by_last = np.searchsorted(mine[:, 1], finish_s[ids], side="right")
            met[ids] = carried[by_last] - carried[after]
            back = np.maximum(after - LIFT_SHARE_PASSES, 0)
            share[ids] = (carried[after] - carried[back]) / np.maximum(after - back, 1)
        return cls(first_token_s, output_tokens, done, met, share, passes.size > 0)

    def of_length(self, tokens: int, last: npt.NDArray[np.int64]) -> npt.NDArray[np.intp]:
        """The finished requests of ``tokens`` output tokens that have a ``last``
        measurement (its index, -1: none) before their first token."""
        return np.flatnonzero(self.done & (self.output_tokens == tokens) & (last >= 0))


def latest_before_first_token(
    series: list[tuple[float, list[float]]], requests: RequestPasses
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp]]:
    """(the series' values as rows, per request the index of the last row recorded
    before its first token, -1: none): what each request is set against."""
    times = np.array([t for t, _ in series])
    values = np.array([v for _, v in series])
    return values, np.searchsorted(times, requests.first_token_s, side="right") - 1


def short_output_calibration(
    predicted: list[tuple[float, list[float]]], requests: RequestPasses
) -> dict[str, list[float]]:
    """Per output length of 2..``SHORT_INTERVALS + 1`` tokens: [the share of such
    requests the model has meet at least one prefill pass, the share that did in
    the simulation, requests]. Each request is set against the last prediction
    before its first token; it met a prefill if a pass on its replica that ended
    after its first token and by its last carried one. Lengths with no request
    are left out.

    The planner's p99 ITL on short-output traffic is set by this share, so a
    model low here is low there (bursty code held at 5 and 11 replicas: 0.65-0.75x
    and 0.3-0.6x; docs/planner-history.md, 2026-12-01)."""
    out: dict[str, list[float]] = {}
    if not predicted or not requests.any_passes:
        return out
    meets, which = latest_before_first_token(predicted, requests)
    for tokens in range(2, SHORT_INTERVALS + 2):
        ids = requests.of_length(tokens, which)
        if ids.size:
            model = float(meets[which[ids], tokens - 2].mean())
            met = float((requests.met[ids] > 0.0).mean())
            out[str(tokens)] = [model, met, float(ids.size)]
    return out


def short_output_lift(
    measured: list[tuple[float, list[float]]], requests: RequestPasses
) -> dict[str, list[float]]:
    """Per output length of 2..``SHORT_INTERVALS + 1`` tokens (``m`` intervals):
    [the lift the streams measured at ``m`` (mean over such requests of the last
    measurement before their first token), the lift those requests had, requests].
    A request's own lift is the prefill-bearing passes it met (``K``) over ``m``
    times its replica's share before it; over the requests, sum K / (m sum
    share), as early_prefills sums it. Lengths with no request are left out."""
    out: dict[str, list[float]] = {}
    if not measured or not requests.any_passes:
        return out
    lifts, which = latest_before_first_token(measured, requests)
    for tokens in range(2, SHORT_INTERVALS + 2):
        m = tokens - 1
        ids = requests.of_length(tokens, which)
        share = float(requests.share[ids].sum())
        if ids.size and share > 0.0:
            streams = float(lifts[which[ids], m - 1].mean())
            own = float(requests.met[ids].sum() / (m * share))
            out[str(tokens)] = [streams, own, float(ids.size)]
    return out


def window_itl_p99(
    result: SimResult, times: list[float], window_s: float = 30.0
) -> dict[str, float]:
    """The simulated p99 ITL of the requests that arrived in the window before each
    time (keyed by the time, as text), where at least 30 did."""
    itl = request_latencies(result).itl_ms
    arrival = result.traffic.arrival_s
    out: dict[str, float] = {}
    for t in times:
        lo, hi = np.searchsorted(arrival, [t - window_s, t])
        seen = itl[lo:hi]
        seen = seen[np.isfinite(seen) & (seen > 0)]
        if seen.size >= 30:
            out[f"{t:.1f}"] = float(np.percentile(seen, 99))
    return out


def beside_decodes_by_window(
    by_second: dict[int, list[int]],
    checks: list[tuple[float, float]],
    window_s: float = 30.0,
) -> tuple[float, float, float]:
    """The prompt tokens a decode token's pass carried, predicted against simulated
    window by window: each check (time, predicted) against the simulated ratio over
    the ``window_s`` it measured. Returns the medians of the predicted, of the
    simulated and of their ratio, over the checks whose window had decodes with
    prompts beside them (nan: none).

    Compared over the whole run instead, a load that changes (silence, then a
    burst) weights the simulated ratio to its busiest minutes while the
    predictions' median falls on a quiet one: silence-burst on 4 replicas read
    11.2 predicted against 33.6 simulated, 1.00x window by window.
    """
    seconds = np.array(sorted(by_second), dtype=np.int64)
    if seconds.size == 0:
        return math.nan, math.nan, math.nan
    cells = np.array([by_second[int(t)] for t in seconds], dtype=np.float64)
    decodes, beside = np.cumsum(cells[:, 0]), np.cumsum(cells[:, 1])
    predicted, simulated = [], []
    for t, pred in checks:
        lo, hi = np.searchsorted(seconds, [t - window_s, t])
        if hi <= lo:
            continue
        d = decodes[hi - 1] - (decodes[lo - 1] if lo else 0.0)
        b = beside[hi - 1] - (beside[lo - 1] if lo else 0.0)
        if d > 0.0 and b > 0.0:
            predicted.append(pred)
            simulated.append(b / d)
    if not simulated:
        return math.nan, math.nan, math.nan
    ratios = [p / s for p, s in zip(predicted, simulated, strict=True)]
    return (
        float(statistics.median(predicted)),
        float(statistics.median(simulated)),
        float(statistics.median(ratios)),
    )


def across_matrix(rows: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """``{n0: {n: median ratio}}``: the p99 ITL predicted at ``n`` from the load
    measured at ``n0``, over the one simulated at ``n`` in the same window."""
    simulated = {str(row["replicas"]): row["window_itl_p99"] for row in rows}
    matrix: dict[str, dict[str, float]] = {}
    for row in rows:
        cells: dict[str, float] = {}
        for n, sim in simulated.items():
            assert isinstance(sim, dict)
            ratios = [
                at[n] / sim[f"{t:.1f}"]
                for t, at in row["itl_p99_across"]  # type: ignore[attr-defined]
                if f"{t:.1f}" in sim and n in at
            ]
            cells[n] = float(statistics.median(ratios)) if ratios else math.nan
        matrix[str(row["replicas"])] = cells
    return matrix


# Bands of the predicted p99 ITL, as a share of the SLO, for :func:`calibration_by_band`:
# the planner decides where the prediction crosses the SLO less its margin (0.89),
# so the bands around 1.0 are the ones its decisions rest on.
ITL_BANDS: tuple[tuple[float, float], ...] = (
    (0.0, 0.6),
    (0.6, 0.8),
    (0.8, 1.0),
    (1.0, 1.25),
    (1.25, math.inf),
)


def calibration_by_band(rows: list[dict[str, object]]) -> dict[str, list[tuple[float, int]]]:
    """Per held run, for each of :data:`ITL_BANDS`: the median, over the 30 s windows
    whose p99 ITL predicted for the run's own count falls in the band (as a share
    of the run's ITL SLO), of predicted over simulated, and the count of those
    windows.

    Binned by the prediction, not by the simulated value: binned by the outcome, the
    windows that happened to run slow read as under-predicted whatever the model
    (regression to the mean)."""
    out: dict[str, list[tuple[float, int]]] = {}
    for row in rows:
        sim = row["window_itl_p99"]
        assert isinstance(sim, dict)
        n, slo_ms = str(row["replicas"]), float(row["itl_slo_ms"])  # type: ignore[arg-type]
        pairs = [
            (at[n], sim[f"{t:.1f}"])
            for t, at in row["itl_p99_across"]  # type: ignore[attr-defined]
            if f"{t:.1f}" in sim and n in at and math.isfinite(at[n])
        ]
        cells = []
        for lo, hi in ITL_BANDS:
            ratios = [p / s for p, s in pairs if lo * slo_ms <= p < hi * slo_ms and s > 0.0]
            cells.append((float(statistics.median(ratios)) if ratios else math.nan, len(ratios)))
        out[str(row["run"])] = cells
    return out


def print_by_length(rows: list[dict[str, object]], key: str, lengths: Sequence[int]) -> None:
    """One line per run of ``rows[key]`` (output tokens -> [ours, reference,
    requests]): ours over the reference, with the requests, per length."""
    print(f"{'run':28} " + "".join(f"{f'{n} tok':>14}" for n in lengths))
    for row in rows:
        by_length = row[key]
        assert isinstance(by_length, dict)
        if not by_length:
            continue
        shown = []
        for n in lengths:
            ours, reference, count = by_length.get(str(n), (math.nan, math.nan, 0.0))
            ratio = ours / reference if reference > 0.0 else math.nan
            shown.append(f"{f'{ratio:.2f} ({count:.0f})':>14}")
        print(f"{row['run']:28} " + "".join(shown))


def main(argv: list[str] | None = None) -> int:
    """Run every ``scenario@n`` (in parallel), print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated scenario@n")
    parser.add_argument("--duration-s", type=float, default=1800.0)
    parser.add_argument("--start", type=int, default=10, help="first count of @0 runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(bp.REPO / "results"))
    parser.add_argument(
        "--across",
        default="",
        help="scenario@n1,n2,...: hold each count and predict at the others (replaces --runs)",
    )
    args = parser.parse_args(argv)
    across: tuple[int, ...] = ()
    runs = [run for run in args.runs.split(",") if run]
    if args.across:
        scenario, _, counts = args.across.partition("@")
        across = tuple(int(n) for n in counts.split(",") if n)
        if len(across) < 2 or min(across) <= 0:
            parser.error("--across needs a scenario and two or more counts above 0")
        runs = [f"{scenario}@{n}" for n in across]
    jobs = [(run, args.duration_s, args.start, args.seed, across) for run in runs]
    with Pool(args.workers) as pool:
        rows = pool.map(run_one, jobs)
    print(
        f"{'run':28} {'held':>7} {'TTFT mean':>9} {'TTFT p99':>8} {'(error)':>7} {'(floor)':>7} "
        f"{'ITL p99':>8} {'(error)':>7} {'(floor)':>7} {'>TTFT':>6} {'>ITL':>6} {'windows':>7} "
        f"{'prompt tokens a decode sees: pred':>33} {'sim':>6} {'ratio':>6}"
    )
    for row in rows:
        print(
            f"{row['run']:28} {row['replicas_median']:7.0f} "
            f"{row['median_bias_ttft_mean']:+9.1%} {row['median_bias_ttft_p99']:+8.1%} "
            f"{row['median_error_ttft_p99']:7.1%} {row['sampling_error_ttft_p99']:7.1%} "
            f"{row['median_bias_itl_p99']:+8.1%} "
            f"{row['median_error_itl_p99']:7.1%} {row['sampling_error_itl_p99']:7.1%} "
            f"{row['share_above_predicted_ttft_p99']:6.1%} "
            f"{row['share_above_predicted_itl_p99']:6.1%} {row['windows']:7.0f} "
            f"{row['prefill_tokens_per_decode_predicted']:33.1f} "
            f"{row['prefill_tokens_per_decode_simulated']:6.1f} "
            f"{row['prefill_tokens_per_decode_ratio']:6.2f}"
        )
    print(
        "\nWhat the requests above the run's p99 ITL met while they decoded, beside a "
        f"sample of outputs of {SHORT_TOKENS} tokens or fewer (slow_request_anatomy.py): "
        f"prompts prefilled on their replica, of them those that came within {CLUMP_S:g} s "
        "after them (their own clump), median TTFT"
    )
    print(
        f"{'run':28} {'p99 ITL':>8} {'slow':>5} {'short':>6} {'prefills':>8} {'clump':>6} "
        f"{'TTFT':>7} | {'short: prefills':>15} {'clump':>6} {'TTFT':>7}"
    )
    for row in rows:
        a = row["slow_requests"]
        assert isinstance(a, dict)
        if not a:
            continue
        print(
            f"{row['run']:28} {a['itl_p99_ms']:8.1f} {a['slow_requests']:5.0f} "
            f"{a['slow_short_share']:6.0%} {a['slow_prefills']:8.2f} "
            f"{a['slow_clump_prefills']:6.2f} {a['slow_ttft_ms']:7.0f} | "
            f"{a['short_prefills']:15.2f} {a['short_clump_prefills']:6.2f} "
            f"{a['short_ttft_ms']:7.0f}"
        )
    lengths = (2, 3, 4, 6, 8, 11, 14, 17)
    print(
        "\nShort outputs meeting a prefill pass while they decode, by output tokens: "
        "the model's share over the simulated (requests); held runs"
    )
    print_by_length(rows, "short_outputs_meeting_prefill", lengths)
    print(
        "\nThe lift of a short output's passes, by output tokens: measured by the "
        "streams over what the requests of that length had (requests)"
    )
    print_by_length(rows, "short_output_lift", lengths)
    report: dict[str, object] = {"args": vars(args), "runs": rows}
    if across:
        matrix = across_matrix(rows)
        report["itl_p99_across_ratio"] = matrix
        print(
            f"\n{args.across.partition('@')[0]}: median over 30 s windows of the p99 ITL "
            "predicted at n (load measured at n0) over the simulated at n"
        )
        print("n0 \\ n " + "".join(f"{n:>8}" for n in across))
        for n0 in across:
            print(f"{n0:>7} " + "".join(f"{matrix[str(n0)][str(n)]:8.2f}" for n in across))
    held = [row for row in rows if isinstance(row["replicas"], int)]
    if held:
        bands = calibration_by_band(held)
        report["itl_p99_by_predicted_band"] = {
            run: [
                {"band_of_slo": [lo, hi], "median_ratio": ratio, "windows": count}
                for (lo, hi), (ratio, count) in zip(ITL_BANDS, cells, strict=True)
            ]
            for run, cells in bands.items()
        }
        print(
            "\nPredicted over simulated p99 ITL at the held count, by the predicted value "
            "as a share of the ITL SLO (median over windows; windows)"
        )
        print(f"{'run':28} " + "".join(f"{f'[{lo:g},{hi:g})':>16}" for lo, hi in ITL_BANDS))
        for run, cells in bands.items():
            print(
                f"{run:28} " + "".join(f"{f'{ratio:.2f} ({count})':>16}" for ratio, count in cells)
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prediction.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'bench_prediction.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
