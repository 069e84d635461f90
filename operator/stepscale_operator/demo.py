"""``stepscale demo``: the whole loop on one machine, no cluster.

A real vLLM CPU engine (tiny random Llama, the Stepscale plugin enabled by
environment exactly as in a pod) serves a load with a calm phase, an overload
phase past its SLO and a calm phase again (or a trace, ``--trace``). The
operator's own controller core listens to it: a
:class:`~stepscale_operator.controller.autoscaler.DeploymentAutoscaler` (FPM
subscriber, cost model, load estimate, planner in advisory mode) that sees the
engine as one pod of a ``VllmDeployment``, and the status builder the operator
writes the custom resource with. Every refresh prints what ``kubectl get vd``
would show, plus the fitted model, the reason for the current decision, and the
model's predicted p99 TTFT/ITL beside what the demo's own requests measured as a
client. The recommendation rises during the overload and falls after the
stabilization window, which the demo shortens (it says so on screen). It ends
with a summary (:mod:`stepscale_operator.demo_summary`); the status that would be
on the resource goes to ``results/demo_status.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepscale_operator.cli_input import (
    InputError,
    OneLineParser,
    non_negative_float,
    positive_float,
    report,
)
from stepscale_operator.controller.autoscaler import DeploymentAutoscaler, planner_policy
from stepscale_operator.controller.discovery import PodView
from stepscale_operator.controller.spec import VllmDeploymentSpec, parse_spec
from stepscale_operator.controller.status import round_status
from stepscale_operator.demo_summary import DemoRecord, MeasuredLatency, Round, summary_lines
from stepscale_operator.latency_model import SloTargets
from stepscale_operator.local_engine import (
    ENGINE_ARGS,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    LocalEngine,
)
from stepscale_operator.scale_verdict import scale_down_pause_s, stabilization_span_s
from stepscale_operator.simulator.traffic import TraceError, Traffic, load_trace, phased

REPO_ROOT = Path(__file__).resolve().parents[2]
NAME = "demo"
POD_IP = "127.0.0.1"  # the local engine stands in for one pod on loopback
# Shorter than an operator's defaults, so a rise and a fall fit in a few minutes;
# shown on screen. On a cluster these are spec.autoscaling fields.
DEMO_STABILIZATION_S = 30.0
DEMO_INITIAL_HOLD_S = 30.0
DEMO_BURST_MEMORY_S = 20.0
DEMO_STARTUP_S = 30.0
# Client-side latencies are measured over the requests finished this recently.
MEASURE_WINDOW_S = 10.0
# After the load ends the engine idles (heartbeating) until the recommendation is
# back at one replica: at most as long as the planner's own scale-down rules take
# from the peak (:func:`wind_down_s`), plus this much.
WIND_DOWN_SLACK_S = 30.0
# Prompt and output lengths of the load profile (tokens), kept small for the CPU engine.
DEMO_PROMPT_TOKENS = 400.0
DEMO_OUTPUT_TOKENS = 80.0
# The overload phase's rate, as a multiple of what the engine serves flat out
# (measured after its warm-up): past the SLO on any machine, and a backlog the
# calm phase after it drains.
OVERLOAD_FACTOR = 1.6
# The overload rate assumed before the engine is measured (checking the input).
NOMINAL_OVERLOAD_RPS = 12.0


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stepscale demo``."""
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="replay this Azure CSV or Mooncake JSONL trace instead of the calm / "
        "overload / calm load profile",
    )
    parser.add_argument(
        "--calm-rps",
        type=positive_float,
        default=1.5,
        help="request rate of the calm phases (default 1.5 req/s)",
    )
    parser.add_argument(
        "--overload-rps",
        type=positive_float,
        default=None,
        help=f"request rate of the overload phase (default: {OVERLOAD_FACTOR:g}x what the "
        "engine serves flat out, measured after its warm-up)",
    )
    parser.add_argument(
        "--phases-s",
        type=_phases,
        default=(30.0, 40.0, 60.0),
        metavar="CALM,OVERLOAD,CALM",
        help="length of the three phases in seconds (default 30,40,60)",
    )
    parser.add_argument(
        "--duration-s",
        type=positive_float,
        default=None,
        help="seconds of traffic to replay (default: the whole profile, or 120 s of a trace)",
    )
    parser.add_argument(
        "--rate-scale",
        type=positive_float,
        default=1.0,
        help="multiply the request rate (of the profile or the trace)",
    )
    parser.add_argument(
        "--refresh-s", type=positive_float, default=3.0, help="status refresh period (s)"
    )
    parser.add_argument(
        "--ttft-ms", type=positive_float, default=1500.0, help="TTFT SLO (ms, default 1500)"
    )
    parser.add_argument(
        "--itl-ms", type=positive_float, default=60.0, help="ITL SLO (ms, default 60)"
    )
    parser.add_argument(
        "--stabilization-s",
        type=non_negative_float,
        default=DEMO_STABILIZATION_S,
        help="scale-down stabilization window (s; an operator's default is 120, the demo "
        f"uses {DEMO_STABILIZATION_S:g} so the fall fits the run)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "results" / "demo_status.json",
        help="where the final VllmDeployment status goes (default results/demo_status.json)",
    )
    parser.add_argument(
        "--engine-log",
        type=Path,
        default=None,
        help="write the engine's own log here (default: discarded)",
    )


def _phases(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected three lengths > 0 in seconds, CALM,OVERLOAD,CALM; got {text!r}"
        )
    return (values[0], values[1], values[2])


def overload_rps(args: argparse.Namespace, capacity_rps: float | None) -> float:
    """The overload phase's rate: ``--overload-rps``, else :data:`OVERLOAD_FACTOR`
    times the engine's measured ``capacity_rps`` (nominal before it is measured)."""
    if args.overload_rps is not None:
        return float(args.overload_rps)
    if capacity_rps is None:
        return NOMINAL_OVERLOAD_RPS
    return OVERLOAD_FACTOR * capacity_rps


def demo_traffic(args: argparse.Namespace, capacity_rps: float | None = None) -> Traffic:
    """The requests to replay, clipped to what the tiny CPU engine can hold;
    ``capacity_rps`` is what the engine serves flat out, once measured.

    Raises :class:`InputError` for a trace that cannot be read.
    """
    if args.trace is not None:
        try:
            base = load_trace(args.trace)
        except TraceError as error:
            raise InputError(f"--trace {error}") from None
        traffic = base.scaled(rate_scale=args.rate_scale, duration_s=args.duration_s or 120.0)
    else:
        calm, overload, after = args.phases_s
        traffic = phased(
            [
                (calm, args.calm_rps * args.rate_scale),
                (overload, overload_rps(args, capacity_rps) * args.rate_scale),
                (after, args.calm_rps * args.rate_scale),
            ],
            mean_prompt=DEMO_PROMPT_TOKENS,
            mean_output=DEMO_OUTPUT_TOKENS,
            name="calm / overload / calm",
        )
        if args.duration_s is not None:
            traffic = traffic.scaled(duration_s=args.duration_s)
    if len(traffic) == 0:
        raise InputError("no requests to replay; expected a longer --duration-s or a busier trace")
    traffic.prompt_tokens[:] = traffic.prompt_tokens.clip(8, MAX_PROMPT_TOKENS)
    traffic.output_tokens[:] = traffic.output_tokens.clip(1, MAX_OUTPUT_TOKENS)
    return traffic


def demo_spec(
    fpm_port: int,
    ttft_ms: float,
    itl_ms: float,
    refresh_s: float,
    stabilization_s: float = DEMO_STABILIZATION_S,
) -> VllmDeploymentSpec:
    """The ``VllmDeployment`` spec the local engine would have: advisory, CPU, its limits,
    and the demo's shorter scale-down timings."""
    return parse_spec(
        {
            "model": "tiny-random-llama (built locally)",
            "image": "local",
            "replicas": 1,
            "resources": {"gpus": 0},
            "fpm": {"basePort": fpm_port},
            "engine": {
                "maxNumBatchedTokens": ENGINE_ARGS["max_num_batched_tokens"],
                "maxNumSeqs": ENGINE_ARGS["max_num_seqs"],
                "kvCapacityTokens": 200_000,
            },
            "autoscaling": {
                "mode": "advisory",
                "minReplicas": 1,
                "maxReplicas": 8,
                "intervalSeconds": max(1.0, refresh_s),
                "startupSeconds": DEMO_STARTUP_S,
                "slo": {"ttftMs": ttft_ms, "itlMs": itl_ms},
                "scaleDown": {
                    "stabilizationWindowSeconds": stabilization_s,
                    "initialHoldSeconds": DEMO_INITIAL_HOLD_S,
                },
                "bursts": {"memorySeconds": DEMO_BURST_MEMORY_S},
            },
        }
    )


def wind_down_s(spec: VllmDeploymentSpec, peak: int) -> float:
    """Seconds after the last request finished until the recommendation is back at one
    replica from ``peak``, at most, by the planner's own rules (plus a slack).

    The load window first lets go of the overload, then the stabilization window must
    agree, then each scale-down step waits for the fleet to settle at its new size
    (one step per load window for a small fleet: a peak of 6 takes 5 of them).
    """
    policy = planner_policy(spec)
    sizes = range(peak, 1, -max(1, policy.scale_down_step))
    steps_s = sum(scale_down_pause_s(policy, size) for size in sizes)
    # The demo's added replicas never become ready: they are starting all along.
    span_s = stabilization_span_s(policy, spec.autoscaling.startup_s, starting=peak - 1)
    window_s = spec.autoscaling.load_window_s + span_s
    return window_s + steps_s + 2.0 * spec.autoscaling.interval_s + WIND_DOWN_SLACK_S


class DemoOperator:
    """The operator's core for one local engine seen as the only pod of a ``VllmDeployment``.

    :meth:`pod_ready` is the pod event a kubelet's Ready report would cause;
    :meth:`status` is one decision round and returns the status the operator
    would write. The planner runs in advisory mode (nothing real is scaled) but
    its recommendation becomes the child Deployment's count, as in auto mode.
    """

    def __init__(self, spec: VllmDeploymentSpec, pod_name: str, pod_ip: str = POD_IP) -> None:
        self.spec = spec
        self.pod_name = pod_name
        self.pod_ip = pod_ip
        self.created_at = time.time()
        self.replicas = spec.replicas  # the child Deployment's count, as the operator sets it
        self.autoscaler = DeploymentAutoscaler(NAME, spec)
        self._previous_conditions: list[dict[str, Any]] = []
        # The pod exists from the start; it is "starting" until the engine is ready.
        self._observe(ready=False)

    def _observe(self, ready: bool) -> None:
        view = PodView(self.pod_name, self.pod_ip, ready, False, self.created_at)
        self.autoscaler.observe_pod(view)

    def pod_ready(self) -> None:
        """The engine answers: the pod turns Ready and its FPM endpoint is subscribed to."""
        self._observe(ready=True)

    def status(self) -> dict[str, Any]:
        """Decide once; the ``VllmDeployment`` status that round would write.

        The recommendation is followed as ``auto`` mode would: the child
        Deployment's count becomes the desired one. Only the local engine is real,
        so the replicas added that way stay "starting" (capacity the planner sees
        coming), and a scale-down removes them again after the stabilization window.
        """
        result = self.autoscaler.decide(current_replicas=self.replicas)
        decision = result.decision
        replicas = self.replicas
        if decision is not None:
            self.replicas = decision.desired_replicas
        status = round_status(
            result,
            now_wall=time.time(),
            generation=1,
            previous_conditions=self._previous_conditions,
            mode="advisory",
            min_samples=self.spec.autoscaling.cost_model.min_samples,
            selector=f"stepscale.io/vllmdeployment={NAME}",
            replicas=replicas,
            ready_replicas=result.ready,
            desired_replicas=decision.desired_replicas if decision else replicas,
            decision_applied=False,
            last_scaling=None,
        )
        self._previous_conditions = status["conditions"]
        return status

    def close(self) -> None:
        """Stop listening."""
        self.autoscaler.close()


def _ms(value: object) -> str:
    return f"{value:.0f}ms" if isinstance(value, int | float) else "-"


def _num(value: object, fmt: str = ".0f") -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def kubectl_table(status: Mapping[str, Any], name: str, age_s: float) -> str:
    """What ``kubectl get vd`` prints for ``status`` (the CRD's printer columns): the
    predicted p99 TTFT and ITL each beside the one the fleet realized."""
    predictions = status.get("predictions") or {}
    current = predictions.get("current") or {}
    measured = predictions.get("measured") or {}
    cm = status.get("costModel") or {}
    mape = cm.get("mapePercent") if cm.get("ready") else None
    header = (
        f"{'NAME':<8}{'REPLICAS':>9}{'READY':>7}{'DESIRED':>9}"
        f"{'TTFT':>9}{'TTFT-MEASURED':>15}{'ITL':>8}{'ITL-MEASURED':>14}{'MAPE':>7}{'AGE':>7}"
    )
    row = (
        f"{name:<8}{_num(status.get('replicas')):>9}{_num(status.get('readyReplicas')):>7}"
        f"{_num(status.get('desiredReplicas')):>9}{_ms(current.get('ttftMs')):>9}"
        f"{_ms(measured.get('ttftMs')):>15}{_ms(current.get('itlMs')):>8}"
        f"{_ms(measured.get('itlMs')):>14}"
        f"{(_num(mape) + '%' if mape is not None else '-'):>7}{age_s:>6.0f}s"
    )
    return header + "\n" + row


def detail_lines(status: Mapping[str, Any]) -> list[str]:
    """The fitted model, the load, the streams and the decision, one line each."""
    cm = status.get("costModel") or {}
    load = status.get("load") or {}
    streams = status.get("streams") or {}
    decision = status.get("lastDecision") or {}
    busy = load.get("busyFraction")
    return [
        f"  model   {'ready' if cm.get('ready') else 'warming up'}: {cm.get('formula', '')}",
        f"  load    prefill {_num(load.get('prefillTokensPerSecond'))} tok/s, "
        f"decode {_num(load.get('decodeTokensPerSecond'))} tok/s, "
        f"queued {_num(load.get('queuedPrefillRequests'))} prefill / "
        f"{_num(load.get('queuedDecodeRequests'))} decode, "
        f"busy {_num(100 * busy if isinstance(busy, int | float) else None)}%",
        f"  streams {streams.get('connected', 0)} fresh, {streams.get('stale', 0)} stale, "
        f"{streams.get('passes', 0)} passes, {streams.get('heartbeats', 0)} heartbeats, "
        f"lost {streams.get('gaps', 0)}, restarts {streams.get('restarts', 0)}, "
        f"malformed {streams.get('malformed', 0)}",
        f"  decision {decision.get('action', '-')} {decision.get('from', '-')} -> "
        f"{decision.get('to', '-')} ({status.get('mode', '')}): {decision.get('reason', '')}",
    ]


def latency_lines(entry: Round, slo: SloTargets) -> list[str]:
    """Predicted (the model, at the running replicas) and measured (the demo's own
    requests) p99 TTFT and ITL side by side, with the SLO."""
    m = entry.measured
    return [
        f"  latency p99          TTFT      ITL   (SLO {slo.ttft_ms:g} / {slo.itl_ms:g} ms)",
        f"    predicted     {_ms(entry.predicted_ttft_ms):>9}{_ms(entry.predicted_itl_ms):>9}"
        "   the model, at the ready replicas and the planned load",
        f"    measured      {_ms(m.ttft_p99_ms):>9}{_ms(m.itl_p99_ms):>9}"
        f"   client side, {m.requests} requests finished in the last {MEASURE_WINDOW_S:g} s",
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(args: argparse.Namespace) -> int:
    """Run the embedded default; returns the exit status (bad input: :class:`InputError`)."""
    traffic = demo_traffic(args)  # bad input fails here, before an engine starts
    slo = SloTargets(args.ttft_ms, args.itl_ms)
    port = _free_port()
    engine = LocalEngine(fpm_port=port)
    spec = demo_spec(port, args.ttft_ms, args.itl_ms, args.refresh_s, args.stabilization_s)
    operator = DemoOperator(spec, engine.worker_id)
    print(_introduction(args, spec), flush=True)
    log_file = args.engine_log.open("w") if args.engine_log else None
    engine.start((int(DEMO_PROMPT_TOKENS), int(DEMO_OUTPUT_TOKENS)), log_file)
    status: dict[str, Any] = {}
    record = DemoRecord()
    try:
        began = time.monotonic()
        capacity = engine.wait_ready()
        traffic = demo_traffic(args, capacity)
        print(
            f"engine ready after {time.monotonic() - began:.0f} s; it serves {capacity:.1f} "
            f"req/s flat out; replaying {_load_description(traffic, args, capacity)}",
            flush=True,
        )
        operator.pod_ready()
        time.sleep(1.5)  # the idle engine heartbeats: the subscription is live
        engine.go(
            [
                (float(t), int(p), int(o))
                for t, p, o in zip(
                    traffic.arrival_s, traffic.prompt_tokens, traffic.output_tokens, strict=True
                )
            ]
        )
        started = time.monotonic()
        peak, drained_at = 1, math.inf  # the highest recommendation; when the load ended
        while engine.running():
            time.sleep(args.refresh_s)
            now = time.monotonic() - started
            status = operator.status()
            measured = MeasuredLatency.of(engine.finished_between(now - MEASURE_WINDOW_S, now))
            entry = record.add(now, status, measured)
            print("\n" + kubectl_table(status, NAME, now))
            print("\n".join(detail_lines(status) + latency_lines(entry, slo)), flush=True)
            peak = max(peak, entry.desired)
            if engine.done():
                drained_at = min(drained_at, now)
            back = entry.desired <= 1 and status.get("replicas") == 1
            if engine.done() and (back or now > drained_at + wind_down_s(spec, peak)):
                break
    except KeyboardInterrupt:
        print("\ninterrupted")
    finally:
        engine.stop()
        operator.close()
        if log_file is not None:
            log_file.close()
    print("\n".join(summary_lines(record, engine.finished, slo, status, running_replicas=1)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(status, indent=2))
    print(f"\nthe last status (what the VllmDeployment showed) is in {args.out}")
    return 0


def _load_description(traffic: Traffic, args: argparse.Namespace, capacity: float) -> str:
    """The replayed load in words: the phases and their rates, or the trace."""
    if args.trace is not None:
        return f"{len(traffic)} requests of {traffic.name} x{args.rate_scale:g}"
    calm, overload, after = args.phases_s
    return (
        f"{len(traffic)} requests: {calm:g} s calm at {args.calm_rps * args.rate_scale:g} "
        f"req/s, {overload:g} s overload at "
        f"{overload_rps(args, capacity) * args.rate_scale:.1f} req/s, {after:g} s calm"
    )


def _introduction(args: argparse.Namespace, spec: VllmDeploymentSpec) -> str:
    """What the demo will do, and the settings it shortens, before it starts."""
    if args.trace is None:
        calm, overload, after = args.phases_s
        shape = "the engine's flat-out rate" if args.overload_rps is None else "the given rate"
        load = f"{calm:g} s calm, {overload:g} s overload (past {shape}), {after:g} s calm"
    else:
        load = f"the trace {args.trace} x{args.rate_scale:g}"
    return "\n".join(
        [
            f"stepscale demo: {load}; SLO TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms",
            "  READY is the one real vLLM CPU engine; DESIRED is the operator core's "
            "recommendation, and REPLICAS follows it as in auto mode, but the replicas "
            "it adds are not real (they stay starting)",
            f"  demo timings: scale-down stabilization {args.stabilization_s:g} s, initial hold "
            f"{DEMO_INITIAL_HOLD_S:g} s, burst memory {DEMO_BURST_MEMORY_S:g} s, pod start-up "
            f"{DEMO_STARTUP_S:g} s (operator defaults: 120, 300, 900, 120); scale-down "
            f"removes one replica per {spec.autoscaling.load_window_s:g} s load window",
            "  TTFT/ITL columns: the model's predicted p99 at the running replicas; "
            "TTFT-MEASURED/ITL-MEASURED: the p99 the engine's passes show it realized "
            "(the closed loop's measurement)",
            "starting a vLLM CPU engine with the Stepscale plugin (30-100 s)...",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m stepscale_operator.demo``."""
    parser = OneLineParser(prog="stepscale demo", description=(__doc__ or "").splitlines()[0])
    add_demo_arguments(parser)
    try:
        return run_demo(parser.parse_args(argv))
    except InputError as error:
        return report("stepscale demo", error)


if __name__ == "__main__":
    sys.exit(main())
