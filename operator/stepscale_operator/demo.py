"""``stepscale demo``: the whole loop on one machine, no cluster.

A real vLLM CPU engine (tiny random Llama, the Stepscale plugin enabled by
environment exactly as in a pod) replays a request trace: the shared Azure
conversation trace when it is present, else the built-in synthetic bursts.
The operator's own controller core listens to it: a
:class:`~stepscale_operator.controller.autoscaler.DeploymentAutoscaler` (FPM
subscriber, cost model, load estimate, planner in advisory mode) that sees the
engine as one pod of a ``VllmDeployment``, and the status builder the operator
writes the custom resource with. Every refresh prints what ``kubectl get vd``
would show, plus the fitted model and the reason for the current decision; at
the end the status that would be on the resource goes to
``results/demo_status.json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepscale_operator.controller.autoscaler import DeploymentAutoscaler
from stepscale_operator.controller.discovery import PodView
from stepscale_operator.controller.spec import VllmDeploymentSpec, parse_spec
from stepscale_operator.controller.status import build_conditions, build_status
from stepscale_operator.local_engine import (
    ENGINE_ARGS,
    MAX_OUTPUT_TOKENS,
    MAX_PROMPT_TOKENS,
    LocalEngine,
)
from stepscale_operator.simulator.traffic import Traffic, load_trace, synthetic

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"
NAME = "demo"
POD_IP = "127.0.0.1"  # the local engine stands in for one pod on loopback


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stepscale demo``."""
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"Azure CSV or Mooncake JSONL (default: {DEFAULT_TRACE} if present, "
        "else synthetic bursts)",
    )
    parser.add_argument("--duration-s", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="request-rate multiplier (the CPU engine is small)",
    )
    parser.add_argument("--refresh-s", type=float, default=3.0, help="status refresh period")
    parser.add_argument("--ttft-ms", type=float, default=1500.0)
    parser.add_argument("--itl-ms", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "demo_status.json")
    parser.add_argument(
        "--engine-log",
        type=Path,
        default=None,
        help="write the engine's own log here (default: discarded)",
    )


def demo_traffic(trace: Path | None, duration_s: float, rate_scale: float) -> Traffic:
    """The requests to replay, clipped to what the tiny CPU engine can hold."""
    path = trace if trace is not None else (DEFAULT_TRACE if DEFAULT_TRACE.exists() else None)
    if path is not None:
        traffic = load_trace(path).scaled(rate_scale=rate_scale, duration_s=duration_s)
    else:
        traffic = synthetic(
            "bursts",
            duration_s=duration_s,
            base_rps=2.0 * rate_scale,
            mean_prompt=400.0,
            mean_output=80.0,
        )
    traffic.prompt_tokens[:] = traffic.prompt_tokens.clip(8, MAX_PROMPT_TOKENS)
    traffic.output_tokens[:] = traffic.output_tokens.clip(1, MAX_OUTPUT_TOKENS)
    return traffic


def demo_spec(fpm_port: int, ttft_ms: float, itl_ms: float, refresh_s: float) -> VllmDeploymentSpec:
    """The ``VllmDeployment`` spec the local engine would have: advisory, CPU, its limits."""
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
                "startupSeconds": 30,
                "slo": {"ttftMs": ttft_ms, "itlMs": itl_ms},
            },
        }
    )


class DemoOperator:
    """The operator's core for one local engine seen as the only pod of a ``VllmDeployment``.

    :meth:`pod_ready` is the pod event a kubelet's Ready report would cause;
    :meth:`status` is one decision round and returns the status the operator
    would write (the child Deployment has one replica; advisory mode never
    changes that).
    """

    def __init__(self, spec: VllmDeploymentSpec, pod_name: str, pod_ip: str = POD_IP) -> None:
        self.spec = spec
        self.pod_name = pod_name
        self.pod_ip = pod_ip
        self.created_at = time.time()
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
        """Decide once; the ``VllmDeployment`` status that round would write."""
        result = self.autoscaler.decide(current_replicas=self.spec.replicas)
        snapshot = result.cost_model_snapshot
        quality = snapshot.get("quality") or {}
        now = time.time()
        conditions = build_conditions(
            now_wall=now,
            generation=1,
            previous=self._previous_conditions,
            problems=(),
            mode="advisory",
            load=result.load,
            model_ready=bool(snapshot.get("ready")),
            samples=int(snapshot.get("samples", 0) or 0),
            min_samples=self.spec.autoscaling.cost_model.min_samples,
            mape=quality.get("mape"),
        )
        self._previous_conditions = conditions
        decision = result.decision
        return build_status(
            now_wall=now,
            generation=1,
            selector=f"stepscale.io/vllmdeployment={NAME}",
            mode="advisory",
            replicas=self.spec.replicas,
            ready_replicas=result.ready,
            desired_replicas=decision.desired_replicas if decision else self.spec.replicas,
            conditions=conditions,
            cost_model_snapshot=snapshot,
            load=result.load,
            decision=decision,
            decision_applied=False,
            last_scaling=None,
            stream_health=result.stream_health,
            endpoints=result.endpoints,
        )

    def close(self) -> None:
        """Stop listening."""
        self.autoscaler.close()


def _ms(value: object) -> str:
    return f"{value:.0f}ms" if isinstance(value, int | float) else "-"


def _num(value: object, fmt: str = ".0f") -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def kubectl_table(status: Mapping[str, Any], name: str, age_s: float) -> str:
    """What ``kubectl get vd`` prints for ``status`` (the CRD's printer columns)."""
    current = (status.get("predictions") or {}).get("current") or {}
    cm = status.get("costModel") or {}
    mape = cm.get("mapePercent") if cm.get("ready") else None
    header = (
        f"{'NAME':<8}{'REPLICAS':>9}{'READY':>7}{'DESIRED':>9}"
        f"{'TTFT':>9}{'ITL':>8}{'MAPE':>7}{'AGE':>7}"
    )
    row = (
        f"{name:<8}{_num(status.get('replicas')):>9}{_num(status.get('readyReplicas')):>7}"
        f"{_num(status.get('desiredReplicas')):>9}{_ms(current.get('ttftMs')):>9}"
        f"{_ms(current.get('itlMs')):>8}"
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(args: argparse.Namespace) -> int:
    """Run the embedded default; returns the exit status."""
    traffic = demo_traffic(args.trace, args.duration_s, args.rate_scale)
    schedule = [
        (float(t), int(p), int(o))
        for t, p, o in zip(
            traffic.arrival_s, traffic.prompt_tokens, traffic.output_tokens, strict=True
        )
    ]
    port = _free_port()
    engine = LocalEngine(fpm_port=port)
    operator = DemoOperator(
        demo_spec(port, args.ttft_ms, args.itl_ms, args.refresh_s), engine.worker_id
    )
    print(
        f"stepscale demo: {len(schedule)} requests from {traffic.name} over "
        f"{args.duration_s:.0f}s; SLO TTFT {args.ttft_ms:.0f} ms, ITL {args.itl_ms:.0f} ms"
    )
    print("starting a vLLM CPU engine with the Stepscale plugin (about 20 s)...", flush=True)
    log_file = args.engine_log.open("w") if args.engine_log else None
    engine.start(schedule, log_file)
    status: dict[str, Any] = {}
    try:
        engine.wait_ready()
        operator.pod_ready()
        time.sleep(1.5)  # the idle engine heartbeats: the subscription is live
        engine.go()
        started = time.monotonic()
        while engine.running():
            time.sleep(args.refresh_s)
            status = operator.status()
            print("\n" + kubectl_table(status, NAME, time.monotonic() - started))
            print("\n".join(detail_lines(status)), flush=True)
        status = operator.status()  # the engine is gone: its stream goes missing
    except KeyboardInterrupt:
        print("\ninterrupted")
    finally:
        engine.stop()
        operator.close()
        if log_file is not None:
            log_file.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(status, indent=2))
    print(f"\nfinal status (what the VllmDeployment would show) written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m stepscale_operator.demo``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
