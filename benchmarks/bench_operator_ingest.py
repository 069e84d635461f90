"""One operator process against a fleet, in the controller's own wiring: CPU, memory, rounds.

What it builds, for each offered rate, in a fresh operator process:

* ``--deployments`` :class:`DeploymentAutoscaler` objects (each with its own
  :class:`FpmSubscriber` and thread, as the operator makes them), each fed its
  pods through the controller's discovery path (:func:`pod_view` of a pod
  object -> :meth:`DeploymentAutoscaler.observe_pod`), ``--pods`` Ready pods of
  ``--ranks`` data-parallel ranks each, on distinct 127.0.0.0/8 addresses: with
  the defaults 10 x 50 x 2 = 1,000 endpoints;
* per deployment, a timer thread standing in for the kopf timer: every
  ``intervalSeconds`` it runs what ``handlers.decision_round`` runs minus the
  Kubernetes API calls (``decide()``, ``build_conditions``, ``build_status``,
  ``observe_metrics``). Round latency is when a round finished minus when it
  was due (lateness and duration both count);
* ``--publishers`` publisher processes (separate processes, separate cores if
  any are free) that bind every endpoint (one PUB socket each) and send real
  FPM frames (``stepscale_engine.wire``) round-robin over the endpoints at the
  offered rate.

The operator process measures, over the window after ``--warmup`` seconds: its
own CPU time (``time.process_time``: every thread of the process, none of the
publishers'), hence cores and CPU microseconds per message received; its RSS
(and peak); the round latencies; the messages its subscribers received, that
its models ingested, that were shed (queue full), stray, and the sequence gaps
(messages lost on the way: ZMQ high-water marks, shedding). ``unaccounted`` is
what the publishers sent that is neither ingested nor counted as a gap.

Process CPU per message is the figure to compare: the machine may be shared and
the publishers take CPU too, so wall-clock throughput says little; medians of
the rounds are reported. The last rate is an overload run (default: twice the
highest normal rate), which must degrade by counted shedding, not by stalled
rounds or growing memory.

Run: ``PYTHONPATH=engine_plugin:operator python benchmarks/bench_operator_ingest.py``
(``--quick`` for a short smoke run). Prints a table; writes
``results/bench_operator_ingest.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from stepscale_engine import wire
from stepscale_operator import fpm_native

TARGET_CPU_US = 20.0
TARGET_RSS_MB = 500.0
TARGET_P99_ROUND_S = 1.0
BASE_PORT = 23000


def endpoints_of(deployment: int, pods: int, ranks: int) -> list[tuple[str, str, int]]:
    """(pod name, pod IP, port) of every rank of a deployment's pods."""
    out = []
    for p in range(pods):
        ip = f"127.{10 + deployment}.{p // 250}.{1 + p % 250}"
        for r in range(ranks):
            out.append((f"d{deployment}-pod-{p}", ip, BASE_PORT + r))
    return out


def pod_object(name: str, ip: str) -> dict[str, Any]:
    """A Ready pod as the API server returns it (what the controller's watch sees)."""
    return {
        "metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


# -- publishers (separate processes) ------------------------------------------


def publish(
    targets: list[tuple[str, str, int]], rate: float, start_at: float, stop_at: float, out: Any
) -> None:
    """Bind every target, then send ``rate`` msg/s round-robin until ``stop_at``."""
    ctx = zmq.Context(io_threads=1)
    socks = []
    for _, ip, port in targets:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.bind(f"tcp://{ip}:{port}")
        socks.append(s)
    encoder = msgspec.msgpack.Encoder()
    counters = [0] * len(targets)
    sched = wire.ScheduledRequestMetrics(
        num_prefill_requests=1,
        sum_prefill_tokens=512,
        num_decode_requests=32,
        sum_decode_kv_tokens=32 * 900,
    )
    queued = wire.QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=300)
    while time.time() < start_at:
        time.sleep(0.01)
    sent = 0
    i = 0
    t0 = time.time()
    while True:
        now = time.time()
        if now >= stop_at:
            break
        due = int((now - t0) * rate)
        while sent < due:
            k = i % len(targets)
            i += 1
            worker, _, port = targets[k]
            msg = wire.ForwardPassMetrics(
                worker_id=worker,
                dp_rank=port - BASE_PORT,
                counter_id=counters[k],
                wall_time=0.02,
                scheduled_requests=sched,
                queued_requests=queued,
            )
            socks[k].send_multipart([b"", wire.encode_sequence(counters[k]), encoder.encode(msg)])
            counters[k] += 1
            sent += 1
        time.sleep(0.005)
    out.put({"sent": sent})
    time.sleep(1.0)  # let the last frames leave before the sockets close
    for s in socks:
        s.close(0)
    ctx.term()


# -- the operator process ----------------------------------------------------


def rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0)


def operator(
    args: argparse.Namespace, rate: float, start_at: float, stop_at: float, out: Any
) -> None:
    """The measured process: the controller's wiring, timers, measurements."""
    from stepscale_operator.controller.autoscaler import DeploymentAutoscaler
    from stepscale_operator.controller.discovery import pod_view
    from stepscale_operator.controller.metrics import OperatorMetrics
    from stepscale_operator.controller.rounds import observe_metrics
    from stepscale_operator.controller.spec import parse_spec
    from stepscale_operator.controller.status import build_conditions, build_status

    spec = parse_spec(
        {
            "model": "m",
            "image": "i",
            "dataParallelSize": args.ranks,
            "resources": {"gpus": args.ranks},
            "fpm": {"basePort": BASE_PORT},
            "autoscaling": {"intervalSeconds": args.interval, "advisory": True},
        }
    )
    autoscalers = []
    for d in range(args.deployments):
        a = DeploymentAutoscaler(f"bench/d{d}", spec)
        seen = set()
        for name, ip, _ in endpoints_of(d, args.pods, args.ranks):
            if name not in seen:
                seen.add(name)
                a.observe_pod(pod_view(pod_object(name, ip)))
        autoscalers.append(a)
    metrics = OperatorMetrics()
    latencies: list[float] = []
    status_bytes: list[int] = []
    stop = threading.Event()
    measure_from = start_at + args.warmup

    def timer(a: DeploymentAutoscaler, offset: float) -> None:
        previous: dict[str, int] = {}
        due = start_at + offset
        while not stop.is_set():
            stop.wait(max(0.0, due - time.time()))
            if stop.is_set():
                return
            r = a.decide()
            snap = r.cost_model_snapshot
            conditions = build_conditions(
                now_wall=time.time(),
                generation=1,
                previous=[],
                problems=(),
                mode="advisory",
                load=r.load,
                model_ready=bool(snap.get("ready")),
                samples=int(snap.get("samples", 0) or 0),
                min_samples=spec.autoscaling.cost_model.min_samples,
                mape=(snap.get("quality") or {}).get("mape"),
            )
            status = build_status(
                now_wall=time.time(),
                generation=1,
                selector="app=x",
                mode="advisory",
                replicas=args.pods,
                ready_replicas=args.pods,
                desired_replicas=args.pods,
                conditions=conditions,
                cost_model_snapshot=snap,
                load=r.load,
                decision=r.decision,
                decision_applied=False,
                last_scaling=None,
                stream_health=r.stream_health,
                endpoints=r.endpoints,
            )
            observe_metrics(
                metrics,
                a.name,
                totals=r.totals,
                previous=previous,
                status=status,
                endpoints=r.endpoints,
                ready=r.ready,
            )
            done = time.time()
            if due >= measure_from and done <= stop_at:
                latencies.append(done - due)
                status_bytes.append(len(json.dumps(status)))
            due += args.interval
            while due < done - args.interval:  # rounds missed outright count as late
                latencies.append(done - due)
                due += args.interval

    threads = [
        threading.Thread(target=timer, args=(a, args.interval * i / len(autoscalers)), daemon=True)
        for i, a in enumerate(autoscalers)
    ]
    for t in threads:
        t.start()

    def counts() -> dict[str, int]:
        c = {"received": 0, "ingested": 0, "gaps": 0, "shed": 0, "stray": 0, "rejected": 0}
        for a in autoscalers:
            tot = a.totals()
            c["received"] += a.subscriber.stats.received
            c["rejected"] += sum(a.subscriber.stats.rejected.values())
            c["ingested"] += tot["messages"]
            c["gaps"] += tot["lost"]
            c["shed"] += tot["shed_messages"]
            c["stray"] += tot["stray_messages"]
        return c

    time.sleep(max(0.0, measure_from - time.time()))
    cpu0, wall0, c0 = time.process_time(), time.time(), counts()
    rss_samples = []
    while time.time() < stop_at:
        time.sleep(1.0)
        rss_samples.append(rss_mb()[0])
    cpu1, wall1, c1 = time.process_time(), time.time(), counts()
    # Drain what is still queued so the accounting can close.
    time.sleep(2.0)
    stop.set()
    for a in autoscalers:
        a.ingest()
    final = counts()
    rss, peak = rss_mb()
    window = {k: c1[k] - c0[k] for k in c1}
    cpu = cpu1 - cpu0
    latencies.sort()
    out.put(
        {
            "rate": rate,
            "window_s": wall1 - wall0,
            "operator_cpu_s": cpu,
            "operator_cores": cpu / (wall1 - wall0),
            "received_per_s": window["received"] / (wall1 - wall0),
            "cpu_us_per_message": 1e6 * cpu / max(1, window["received"]),
            "rss_mb_median": statistics.median(rss_samples) if rss_samples else rss,
            "rss_mb_end": rss,
            "rss_mb_peak": peak,
            "rounds": len(latencies),
            "round_latency_p50_s": _pct(latencies, 0.5),
            "round_latency_p99_s": _pct(latencies, 0.99),
            "round_latency_max_s": latencies[-1] if latencies else None,
            "status_bytes_max": max(status_bytes) if status_bytes else None,
            "window": window,
            "final": final,
        }
    )
    for a in autoscalers:
        a.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def run_rate(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """One fresh operator process and the publishers at ``rate`` msg/s."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    all_targets = [
        t for d in range(args.deployments) for t in endpoints_of(d, args.pods, args.ranks)
    ]
    start_at = time.time() + args.setup
    stop_at = start_at + args.warmup + args.duration
    op = ctx.Process(target=operator, args=(args, rate, start_at, stop_at, out))
    op.start()
    pubs = [
        ctx.Process(
            target=publish,
            args=(
                all_targets[i :: args.publishers],
                rate / args.publishers,
                start_at,
                stop_at,
                out,
            ),
        )
        for i in range(args.publishers)
    ]
    for p in pubs:
        p.start()
    results: list[dict[str, Any]] = []
    deadline = time.time() + args.setup + args.warmup + args.duration + 120
    while len(results) < 1 + len(pubs):
        try:
            results.append(out.get(timeout=2.0))
        except queue.Empty:
            failed = [p for p in (op, *pubs) if p.exitcode not in (None, 0)]
            if failed or time.time() > deadline:
                for p in (op, *pubs):
                    p.kill()
                raise RuntimeError(f"a benchmark process failed or hung: {failed}") from None
    for p in (op, *pubs):
        p.join(30)
    row = next(r for r in results if "rate" in r)
    row["sent"] = sum(r["sent"] for r in results if "sent" in r)
    final = row["final"]
    row["unaccounted"] = row["sent"] - final["ingested"] - final["gaps"] - final["stray"]
    return row


def main() -> None:
    """Run each rate, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--deployments", type=int, default=10)
    parser.add_argument("--pods", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--publishers", type=int, default=2)
    parser.add_argument("--rates", default="5000,10000,20000")
    parser.add_argument(
        "--overload", type=float, default=0.0, help="msg/s (default 2x the highest)"
    )
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--setup", type=float, default=8.0, help="seconds to bind and connect")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="results/bench_operator_ingest.json")
    args = parser.parse_args()
    if args.quick:
        args.deployments, args.pods, args.duration, args.warmup = 2, 10, 12.0, 4.0
        args.interval = 3.0
    rates = [float(r) for r in args.rates.split(",") if r]
    overload = args.overload or 2 * max(rates)
    rows = []
    for rate in [*rates, overload]:
        row = run_rate(args, rate)
        row["overload"] = rate == overload
        rows.append(row)
        print(f"  done {rate:.0f} msg/s", flush=True)
    print()
    print(
        f"{args.deployments} deployments x {args.pods} pods x {args.ranks} ranks = "
        f"{args.deployments * args.pods * args.ranks} endpoints; "
        f"intervalSeconds {args.interval:g}; native receive: {fpm_native.DRAIN_AVAILABLE}; "
        f"{os.cpu_count()} CPUs"
    )
    header = (
        f"{'offered':>9} {'received/s':>10} {'cores':>6} {'us/msg':>7} {'RSS MB':>7} {'peak':>6} "
        f"{'p50 s':>6} {'p99 s':>6} {'rounds':>6} {'shed':>8} {'gaps':>8} {'stray':>6} {'unacc':>6}"
    )
    print(header)
    for r in rows:
        f = r["final"]
        print(
            f"{r['rate']:>9.0f} {r['received_per_s']:>10.0f} {r['operator_cores']:>6.2f} "
            f"{r['cpu_us_per_message']:>7.1f} {r['rss_mb_median']:>7.0f} {r['rss_mb_peak']:>6.0f} "
            f"{r['round_latency_p50_s'] or 0:>6.3f} {r['round_latency_p99_s'] or 0:>6.3f} "
            f"{r['rounds']:>6} {f['shed']:>8} {f['gaps']:>8} {f['stray']:>6} {r['unaccounted']:>6}"
            + ("  (overload)" if r["overload"] else "")
        )
    verdict = {
        "cpu_us_per_message": all(
            r["cpu_us_per_message"] <= TARGET_CPU_US for r in rows if not r["overload"]
        ),
        "rss_mb": all(r["rss_mb_peak"] <= TARGET_RSS_MB for r in rows),
        "round_p99_s": all((r["round_latency_p99_s"] or 1e9) <= TARGET_P99_ROUND_S for r in rows),
    }
    print("targets:", ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in verdict.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "config": vars(args),
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "native_receive": fpm_native.DRAIN_AVAILABLE,
                "targets": {
                    "cpu_us_per_message": TARGET_CPU_US,
                    "rss_mb": TARGET_RSS_MB,
                    "round_p99_s": TARGET_P99_ROUND_S,
                },
                "verdict": verdict,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
