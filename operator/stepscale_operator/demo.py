"""``stepscale demo``: the whole loop on one machine, no cluster.

A real vLLM CPU engine (tiny random Llama, the Stepscale plugin enabled by
environment exactly as in a pod) replays a request trace: the shared Azure
conversation trace when it is present, else the built-in synthetic bursts.
The same core the operator runs (FPM subscriber, cost model, load estimate,
planner in advisory mode) listens over ZMQ and prints, every refresh, what
``kubectl get vd`` would show, plus the fitted model and the reason for the
current decision. At the end it writes the status it would put on the custom
resource to ``results/demo_status.json``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from stepscale_operator.fpm_pipeline import DeploymentModel
from stepscale_operator.local_engine import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, LocalEngine
from stepscale_operator.planner import (
    Decision,
    EngineLimits,
    Planner,
    PlannerInputs,
    PlannerPolicy,
    ReplicaCounts,
    SloTargets,
)
from stepscale_operator.simulator.traffic import Traffic, load_trace, synthetic
from stepscale_operator.subscriber import FpmSubscriber

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure_llm_conv_2023.csv"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``stepscale demo``."""
    parser.add_argument("--trace", type=Path, default=None,
                        help=f"Azure CSV or Mooncake JSONL (default: {DEFAULT_TRACE} if present, "
                             "else synthetic bursts)")
    parser.add_argument("--duration-s", type=float, default=120.0, help="seconds of traffic")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="request-rate multiplier (the CPU engine is small)")
    parser.add_argument("--refresh-s", type=float, default=3.0, help="status refresh period")
    parser.add_argument("--ttft-ms", type=float, default=1500.0)
    parser.add_argument("--itl-ms", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "demo_status.json")
    parser.add_argument("--engine-log", type=Path, default=None,
                        help="write the engine's own log here (default: discarded)")


def demo_traffic(trace: Path | None, duration_s: float, rate_scale: float) -> Traffic:
    """The requests to replay, clipped to what the tiny CPU engine can hold."""
    path = trace if trace is not None else (DEFAULT_TRACE if DEFAULT_TRACE.exists() else None)
    if path is not None:
        traffic = load_trace(path).scaled(rate_scale=rate_scale, duration_s=duration_s)
    else:
        traffic = synthetic("bursts", duration_s=duration_s, base_rps=2.0 * rate_scale,
                            mean_prompt=400.0, mean_output=80.0)
    traffic.prompt_tokens[:] = traffic.prompt_tokens.clip(8, MAX_PROMPT_TOKENS)
    traffic.output_tokens[:] = traffic.output_tokens.clip(1, MAX_OUTPUT_TOKENS)
    return traffic


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ms(value: float | None) -> str:
    if value is None or value != value or value == float("inf"):
        return "-"
    return f"{value:.0f}ms"


def status_table(name: str, age_s: float, decision: Decision, mape: float | None) -> str:
    """The ``kubectl get vd`` line (same columns as the CRD's printer columns)."""
    pred = decision.predicted_current
    header = f"{'NAME':<8}{'REPLICAS':>9}{'READY':>7}{'DESIRED':>9}{'TTFT':>9}{'ITL':>8}" \
             f"{'MAPE':>7}{'AGE':>7}"
    row = (f"{name:<8}{decision.current_replicas:>9}{decision.current_replicas:>7}"
           f"{decision.desired_replicas:>9}{_ms(pred.ttft_ms if pred else None):>9}"
           f"{_ms(pred.itl_ms if pred else None):>8}"
           f"{(f'{100 * mape:.0f}%' if mape is not None else '-'):>7}{age_s:>6.0f}s")
    return header + "\n" + row


def run_demo(args: argparse.Namespace) -> int:
    """Run the embedded default; returns the exit status."""
    traffic = demo_traffic(args.trace, args.duration_s, args.rate_scale)
    schedule = [(float(t), int(p), int(o)) for t, p, o in
                zip(traffic.arrival_s, traffic.prompt_tokens, traffic.output_tokens, strict=True)]
    port = _free_port()
    engine = LocalEngine(fpm_port=port)
    model = DeploymentModel("demo")
    model.add_stream((engine.worker_id, 0))
    subscriber = FpmSubscriber(model.on_batch, streams=model.streams, observe_streams=False)
    subscriber.add_endpoint(f"tcp://127.0.0.1:{port}")
    planner = Planner(PlannerPolicy(advisory=True))
    slo = SloTargets(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms)
    print(f"stepscale demo: {len(schedule)} requests from {traffic.name} over "
          f"{args.duration_s:.0f}s; SLO TTFT {args.ttft_ms:.0f} ms, ITL {args.itl_ms:.0f} ms")
    print("starting a vLLM CPU engine with the Stepscale plugin (about 20 s)...", flush=True)
    log_file = args.engine_log.open("w") if args.engine_log else None
    engine.start(schedule, log_file)
    decision: Decision | None = None
    try:
        subscriber.start()
        engine.wait_ready()
        time.sleep(1.5)  # the idle engine heartbeats: the subscription is live
        engine.go()
        started = time.monotonic()
        while engine.running():
            time.sleep(args.refresh_s)
            now = time.monotonic()
            decision = _decide(planner, model, slo, now)
            _print_status(model, decision, now - started, now)
        decision = _decide(planner, model, slo, time.monotonic())
    except KeyboardInterrupt:
        print("\ninterrupted")
    finally:
        engine.stop()
        subscriber.close()
        if log_file is not None:
            log_file.close()
    status = model.status()
    if decision is not None:
        status["last_decision"] = decision.to_dict()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(status, indent=2, default=str))
    print(f"\nfinal status written to {args.out}")
    return 0


def _decide(planner: Planner, model: DeploymentModel, slo: SloTargets, now: float) -> Decision:
    cost = model.cost_model
    quality = cost.quality
    return planner.decide(
        PlannerInputs(
            predictor=cost,
            model_ready=cost.ready,
            model_mape=quality.mape if cost.ready else None,
            load=model.estimate(now),
            load_time=now,
            replicas=ReplicaCounts(ready=1),
            slo=slo,
            min_replicas=1,
            max_replicas=8,
            engine=EngineLimits(max_num_batched_tokens=512, max_num_seqs=64,
                                kv_capacity_tokens=200_000),
            pod_startup_s=30.0,
        ),
        now,
    )


def _print_status(model: DeploymentModel, decision: Decision, age_s: float, now: float) -> None:
    cost = model.cost_model
    quality = cost.quality
    load = model.estimate(now)
    health: dict[str, Any] = model.streams.health(now, per_stream=False)
    mape = quality.mape if cost.ready else None
    print("\n" + status_table("demo", age_s, decision, mape))
    print(f"  model   {'ready' if cost.ready else 'warming up'}: {cost.formula()}")
    print(f"  load    prefill {load.prefill_tokens_per_s:.0f} tok/s, "
          f"decode {load.decode_tokens_per_s:.0f} tok/s, "
          f"queued {load.queued_prefill_requests:.0f} prefill / "
          f"{load.queued_decode_requests:.0f} decode, busy {100 * load.busy_fraction:.0f}%")
    print(f"  streams {health.get('fresh', 0)} fresh, {len(health.get('stale', []))} stale, "
          f"{health.get('passes', 0)} passes, {health.get('heartbeats', 0)} heartbeats, "
          f"lost {health.get('lost', 0)}, restarts {health.get('restarts', 0)}, "
          f"malformed {sum(health.get('rejected', {}).values())}")
    print(f"  decision {decision.action} {decision.current_replicas} -> "
          f"{decision.desired_replicas} (advisory): {decision.reason}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m stepscale_operator.demo``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_demo_arguments(parser)
    return run_demo(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
