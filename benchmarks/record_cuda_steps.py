"""Record real GPU step times through the real engine plugin, for the cost model.

Runs :mod:`gpu_engine` (a vLLM-shaped continuous-batching engine: vLLM itself
cannot be installed on the lent GPU machine) with the plugin's own parts
installed as in vLLM: :class:`EngineHook` wraps the scheduler's and executor's
methods, :class:`CudaPassTimer` times each pass with CUDA events on the
engine's stream, and :class:`FpmPublisher` sends every pass over ZMQ on
loopback TCP. A subscriber in a process of its own (``fpm_sink.py``, so that it
never holds the engine's interpreter lock) decodes the frames with the wire
module and writes one ``msgspec.json`` line per pass, the format of
``record_fpm.py``, so ``bench_cost_model.py`` scores it like any recording.

It also checks the plugin's timing: the executor keeps each pass's host time
(submission to sampled tokens on the host, which waits for the device), and
``<config>.timing.json`` compares it with the CUDA-event ``wall_time`` of the
same pass (their ratio and difference, medians and tails; the share of passes
whose events were not ready and fell back to host time).

Load phases (Poisson arrivals; prompt and output lengths uniform in a range):
``short``, ``long`` (chunked prefill under the token budget), ``decode_heavy``
(large decode batches), ``mixed``, ``decode_small`` (batches of 1-3).

    python3 benchmarks/record_cuda_steps.py --configs wide eight_b --phase-s 15 --out DIR
    [--cuda-graphs]

On a machine without CUDA, ``--configs tiny`` runs the same path on the CPU
(host timing), which is what the tests do. Needs PyTorch, Triton, pyzmq and
msgspec; on a GPU machine with no package index, carry the last two as wheels for
its Python (``pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux_2_28_x86_64 pyzmq msgspec``) and install them with
``pip install --no-index --target DIR``, DIR on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import select
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "engine_plugin"), str(REPO / "benchmarks")]

import gpu_engine  # noqa: E402

# name: (arrivals per second, prompt length range, output length range)
PHASES: dict[str, tuple[float, tuple[int, int], tuple[int, int]]] = {
    "short": (20.0, (32, 256), (16, 96)),
    "long": (3.0, (1000, 3500), (16, 64)),
    "decode_heavy": (30.0, (32, 512), (100, 400)),
    "mixed": (8.0, (32, 2500), (8, 300)),
    "decode_small": (0.8, (32, 1500), (200, 500)),
}
ALL_PHASES = ("short", "long", "decode_heavy", "mixed", "decode_small")

# name: model shape, engine limits, arrival-rate scale (a slower model gets less load).
CONFIGS: dict[str, dict[str, Any]] = {
    "wide": dict(shape=gpu_engine.WIDE, budget=2048, seqs=64, max_len=4096, load=1.0),
    "eight_b": dict(shape=gpu_engine.EIGHT_B, budget=2048, seqs=96, max_len=4096, load=1.5),
    "tiny": dict(shape=gpu_engine.TINY, budget=512, seqs=16, max_len=4096, load=0.05),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SinkProcess:
    """``fpm_sink.py`` in a process of its own: subscribes, writes the stream to ``path``."""

    def __init__(self, endpoint: str, path: Path, timeout_s: float = 30.0) -> None:
        self.path = path
        self._proc = subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / "fpm_sink.py"), endpoint, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        # The subscription is live once a heartbeat has come through: no pass is lost.
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        if not ready or self._proc.stdout.readline().strip() != "live":
            self._proc.kill()
            raise RuntimeError(f"no heartbeat reached the subscriber within {timeout_s}s")

    def close(self, published: int) -> dict[str, int]:
        """Stop once the ``published`` passes have arrived (or it gave up waiting);
        its counts (messages, heartbeats, malformed)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"stop {published}\n")
        self._proc.stdin.flush()
        counts: dict[str, int] = json.loads(self._proc.stdout.readline())
        self._proc.wait(timeout=30)
        return counts

    def passes(self) -> list[Any]:
        """The recorded passes (heartbeats left out), in arrival order."""
        import msgspec

        from stepscale_engine import wire

        with gzip.open(self.path, "rb") as fh:
            msgs = [msgspec.json.decode(line, type=wire.ForwardPassMetrics) for line in fh]
        return [m for m in msgs if not m.is_heartbeat]


def _arrivals(rng: random.Random, phases: tuple[str, ...], phase_s: float, load: float,
              vocab: int, max_len: int) -> list[tuple[float, gpu_engine.Request]]:
    """Every request of the run with its arrival time (seconds from the start)."""
    out: list[tuple[float, gpu_engine.Request]] = []
    for index, name in enumerate(phases):
        rate, (p_lo, p_hi), (o_lo, o_hi) = PHASES[name]
        t = index * phase_s
        while True:
            t += rng.expovariate(rate * load)
            if t >= (index + 1) * phase_s:
                break
            prompt = rng.randint(p_lo, min(p_hi, max_len - o_hi))
            tokens = [rng.randrange(vocab) for _ in range(prompt)]
            request = gpu_engine.Request(f"r{len(out)}", tokens, rng.randint(o_lo, o_hi))
            out.append((t, request))
    return out


def run_engine(
    scheduler: gpu_engine.Scheduler,
    executor: gpu_engine.Executor,
    arrivals: list[tuple[float, gpu_engine.Request]],
    deadline_s: float,
) -> int:
    """The engine loop (vLLM's ``EngineCore.step``): schedule, execute, sample, update."""
    start = time.perf_counter()
    pending = list(arrivals)
    passes = 0
    while True:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            scheduler.add_request(pending.pop(0)[1])
        if now >= deadline_s or (not pending and not scheduler.requests):
            return passes
        output = scheduler.schedule()
        if output.total_num_scheduled_tokens == 0:
            time.sleep(0.001)
            continue
        executor.execute_model(output)
        sampled = executor.sample_tokens(None)
        scheduler.update_from_output(output, sampled)
        passes += 1


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p01": at(0.01), "p50": statistics.median(ordered), "p99": at(0.99)}


def timing_check(messages: list[Any], host_times_s: list[float]) -> dict[str, Any]:
    """The plugin's wall_time of each pass beside the executor's host time of the same pass.

    Passes are paired in order (the hook publishes one message per pass, the
    executor keeps one host time per pass); ``paired`` is false if the counts differ.
    """
    pairs = list(zip(messages, host_times_s, strict=False))
    by_scope: dict[str, int] = {}
    for m, _ in pairs:
        by_scope[str(m.timing_scope)] = by_scope.get(str(m.timing_scope), 0) + 1
    return {
        "passes": len(messages),
        "host_times": len(host_times_s),
        "paired": len(messages) == len(host_times_s),
        "scopes": by_scope,
        "wall_over_host": _quantiles([m.wall_time / h for m, h in pairs if h > 0]),
        "host_minus_wall_us": _quantiles([(h - m.wall_time) * 1e6 for m, h in pairs]),
        "wall_time_ms": _quantiles([m.wall_time * 1e3 for m, _ in pairs]),
        # First use of a pass shape over its later repeats (warm-up check).
        "first_use_over_repeats": {
            "decode": first_over_repeats([m for m in messages if _is_decode_only(m)]),
            "prefill": first_over_repeats([m for m in messages if not _is_decode_only(m)]),
        },
    }


def _is_decode_only(msg: Any) -> bool:
    return bool(msg.scheduled_requests.num_prefill_requests == 0)


def first_over_repeats(messages: list[Any]) -> dict[str, float]:
    """The first pass of each shape over its later repeats, medians over shapes.

    A shape is the number of prefill requests and the number of tokens in the pass
    (what sets the kernels' sizes); shapes seen at least four times count. Near 1
    when every size was warmed up before the run; above it when a first use costs
    extra.
    """
    by_shape: dict[tuple[int, int], list[float]] = {}
    for m in messages:
        s = m.scheduled_requests
        tokens = s.sum_prefill_tokens + s.num_decode_requests
        by_shape.setdefault((s.num_prefill_requests, tokens), []).append(m.wall_time)
    ratios = [
        walls[0] / statistics.median(walls[1:]) for walls in by_shape.values() if len(walls) >= 4
    ]
    return {"shapes": len(ratios), **_quantiles(ratios)}


def record(config_name: str, out_dir: Path, phase_s: float, seed: int,
           phases: tuple[str, ...], device: str, cuda_graphs: bool = False) -> dict[str, Any]:
    """One configuration: build the engine, install the plugin, run every phase, save."""
    import torch

    from stepscale_engine.engine_hook import EngineHook
    from stepscale_engine.pass_timer import CudaPassTimer, HostPassTimer, PassTimer
    from stepscale_engine.publisher import FpmPublisher

    config = CONFIGS[config_name]
    shape: gpu_engine.ModelShape = config["shape"]
    built = time.perf_counter()
    decoder = gpu_engine.Decoder(shape, config["seqs"], config["max_len"], device)
    if cuda_graphs:
        decoder.use_decode_graphs(config["seqs"])
    scheduler = gpu_engine.Scheduler(config["budget"], config["seqs"], config["max_len"])
    executor = gpu_engine.Executor(decoder, time.perf_counter)
    warm_up_passes = _warm_up(decoder, config)
    build_s = time.perf_counter() - built

    port = _free_port()
    publisher = FpmPublisher(f"tcp://127.0.0.1:{port}", f"cuda-{config_name}", 0).start()
    timer: PassTimer = CudaPassTimer() if device.startswith("cuda") else HostPassTimer()
    hook = EngineHook(scheduler, executor, publisher, timer)
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = SinkProcess(f"tcp://127.0.0.1:{port}", out_dir / f"cuda_{config_name}.jsonl.gz")

    rng = random.Random(seed)
    arrivals = _arrivals(rng, phases, phase_s, config["load"], shape.vocab, config["max_len"])
    replays_before = decoder.graphs.replays if decoder.graphs is not None else 0
    began = time.perf_counter()
    passes = run_engine(scheduler, executor, arrivals, deadline_s=len(phases) * phase_s + 30.0)
    ran_s = time.perf_counter() - began
    hook.uninstall()
    counts = sink.close(published=publisher.stats.enqueued)
    passes_recorded = sink.passes()

    check = timing_check(passes_recorded, executor.host_times_s)
    meta: dict[str, Any] = {
        "config": config_name,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "model": {**shape.__dict__, "parameters": shape.parameters()},
        "engine_args": {
            "max_num_batched_tokens": config["budget"],
            "max_num_seqs": config["seqs"],
            "max_model_len": config["max_len"],
        },
        "phases": list(phases),
        "phase_s": phase_s,
        "load_scale": config["load"],
        "seed": seed,
        "requests": len(arrivals),
        "finished": scheduler.finished,
        "passes": passes,
        "messages": counts["messages"],
        "heartbeats": counts["heartbeats"],
        "malformed": counts["malformed"],
        "hook_errors": hook.errors,
        "publisher_dropped": publisher.stats.dropped_queue_full,
        "warm_up_passes": warm_up_passes,
        "decode_graphs": decoder.graphs.sizes if decoder.graphs is not None else [],
        # Decode passes of the run (warm-up left out) replayed from a graph.
        "graph_replays": (decoder.graphs.replays - replays_before) if decoder.graphs else 0,
        "build_s": round(build_s, 1),
        "run_s": round(ran_s, 1),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / f"cuda_{config_name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out_dir / f"cuda_{config_name}.timing.json").write_text(json.dumps(check, indent=1) + "\n")
    print(json.dumps({"meta": meta, "timing": check}), flush=True)
    del decoder, executor
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return meta


def _warm_up(decoder: gpu_engine.Decoder, config: dict[str, Any]) -> int:
    """Throwaway passes of every size the run can produce; returns how many ran.

    A first pass of a new size pays one-off costs of the CUDA runtime (kernels loaded
    on first use, allocator growth): in the first H200 recordings, made without this,
    a prefill-bearing pass of a new shape ran 1.3-2.6x its later repeats (median).
    vLLM pays these at start-up (its profile run and CUDA-graph capture of every
    decode batch size), so the recording
    should not carry them: one prefill pass of each token count (every count to 64,
    then every 8th to the budget), one decode pass of each batch size, and chunked
    prompts whose later chunks attend to cached context.
    """
    budget, seqs, max_len = config["budget"], config["seqs"], config["max_len"]
    rounds: list[list[tuple[int, int]]] = [[(tokens, 1)] for tokens in range(1, 65)]
    rounds += [[(tokens, 1)] for tokens in range(72, budget + 1, 8)]
    rounds += [[(8, 2)] * batch for batch in range(1, seqs + 1)]
    rounds.append([(budget // 2 + 3 * i, 4) for i in range(4)])
    passes = 0
    for requests in rounds:
        scheduler = gpu_engine.Scheduler(budget, seqs, max_len)
        executor = gpu_engine.Executor(decoder, time.perf_counter)
        for i, (prompt, outputs) in enumerate(requests):
            scheduler.add_request(gpu_engine.Request(f"w{i}", [1] * prompt, outputs))
        while scheduler.requests:
            output = scheduler.schedule()
            executor.execute_model(output)
            scheduler.update_from_output(output, executor.sample_tokens(None))
            passes += 1
    return passes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", nargs="+", default=["wide", "eight_b"], choices=sorted(CONFIGS)
    )
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds per load phase")
    parser.add_argument("--phases", nargs="+", default=list(ALL_PHASES), choices=sorted(PHASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "recordings")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="replay decode-only passes from CUDA graphs"
    )
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    failed = []
    for name in args.configs:
        try:
            record(
                name, args.out, args.phase_s, args.seed, tuple(args.phases), device,
                cuda_graphs=args.cuda_graphs,
            )
        except Exception:  # noqa: BLE001 - one configuration's failure must not lose the others
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
