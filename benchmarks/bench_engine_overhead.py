"""Real engine throughput with the FPM plugin on versus off, measured in the same run.

One vLLM CPU engine (tiny random Llama, in-process) runs the same batch
workload in alternating rounds: plugin installed (publishing to a live
subscriber in another process) and plugin uninstalled (vLLM's own methods
restored). Alternating rounds in one process cancel most of the drift of a
shared, noisy machine; the result is the median tokens/s of each arm and their
ratio. Target: the plugin costs at most 1% of throughput.

``--subscriber none`` (the default) measures the engine-side cost: the hook and
the sender thread encoding and sending every pass (ZMQ drops the messages at
the socket, as it does when the operator is away). ``--subscriber process`` adds
a live subscriber process on the same machine; on a 2-core box where vLLM's
OpenMP threads are pinned to both cores, that process's wake-ups preempt the
engine's compute, which is the cost of co-locating the consumer, not of the
plugin (in a cluster the operator runs in its own pod).

    .venv/bin/python benchmarks/bench_engine_overhead.py [--rounds 8] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

RESULTS = Path(__file__).resolve().parent.parent / "results"

SUBSCRIBER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b"")
s.connect(sys.argv[1]); n = 0
while True:
    s.recv_multipart(); n += 1
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _waiting_queues(scheduler: Any) -> list[Any]:
    from stepscale_engine.queue_tracker import QUEUE_ATTRIBUTES

    return [q for q in (getattr(scheduler, n, None) for n in QUEUE_ATTRIBUTES) if q is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per arm")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=192)
    parser.add_argument("--quick", action="store_true", help="3 rounds, smaller batch")
    parser.add_argument(
        "--subscriber",
        choices=("none", "process"),
        default="none",
        help="none: engine-side cost only; process: a live subscriber on this machine too",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.output_tokens = 3, 24, 48

    from stepscale_engine import plugin
    from stepscale_engine.queue_tracker import is_tracked
    from stepscale_engine.tiny_model import build_tiny_llama

    port = free_port()
    config = plugin.PluginConfig(
        base=str(port), bind_host="127.0.0.1", worker_id="bench", queue_capacity=10_000,
        heartbeat_interval_s=1.0,
    )
    model_dir = build_tiny_llama(Path(tempfile.gettempdir()) / "stepscale-tiny-llama")

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", max_model_len=1024, block_size=32, max_num_seqs=64,
              max_num_batched_tokens=2048, enable_prefix_caching=False, seed=0)
    engine_core = llm.llm_engine.engine_core.engine_core
    prompts: list[Any] = [
        {"prompt_token_ids": [1 + (i * 13 + t * 7) % 900 for t in range(64 + (i % 8) * 16)]}
        for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    subscriber = None
    if args.subscriber == "process":
        subscriber = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, f"tcp://127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )

    def run_round() -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.prompt_token_ids or []) + len(o.outputs[0].token_ids) for o in outputs)
        return tokens / elapsed

    try:
        run_round()  # warm-up: allocator, caches
        on: list[float] = []
        off: list[float] = []
        passes = 0
        for i in range(args.rounds):
            # ABBA order: neither arm always runs first (after a warm cache or a
            # freshly (un)installed hook).
            if i % 2:
                off.append(run_round())
            engine_core.__dict__.pop(plugin._HOOK_ATTR, None)
            hook = plugin.install_hook(engine_core, config)
            if hook is None:
                raise SystemExit("could not install the hook")
            on.append(run_round())
            passes += hook.passes
            hook.uninstall()
            # The "off" arm must be vLLM alone: methods and queue classes restored.
            if any(is_tracked(q) for q in _waiting_queues(engine_core.scheduler)):
                raise SystemExit("uninstall left a tracked queue: the off arm would pay for it")
            if not i % 2:
                off.append(run_round())
    finally:
        if subscriber is not None:
            subscriber.kill()

    result = {
        "workload": {"requests": args.requests, "output_tokens": args.output_tokens,
                     "rounds_per_arm": args.rounds, "subscriber": args.subscriber},
        "plugin_on_tokens_per_s": on,
        "plugin_off_tokens_per_s": off,
        "median_on": statistics.median(on),
        "median_off": statistics.median(off),
        "ratio_on_over_off": statistics.median(on) / statistics.median(off),
        "paired_ratios": [a / b for a, b in zip(on, off, strict=True)],
        "fpm_passes_published": passes,
    }
    result["median_paired_ratio"] = statistics.median(result["paired_ratios"])
    print("\nReal vLLM CPU engine throughput, plugin on vs off (same process, alternating),"
          f" subscriber: {args.subscriber}")
    print(f"{'arm':<12}{'median tok/s':>14}{'min':>10}{'max':>10}")
    for name, values in (("plugin off", off), ("plugin on", on)):
        print(f"{name:<12}{statistics.median(values):>14.0f}{min(values):>10.0f}"
              f"{max(values):>10.0f}")
    print(f"ratio on/off (medians): {result['ratio_on_over_off']:.4f}   "
          f"median paired ratio: {result['median_paired_ratio']:.4f}   "
          f"passes published: {passes}")
    RESULTS.mkdir(exist_ok=True)
    name = "bench_engine_overhead.json" if args.subscriber == "none" else (
        f"bench_engine_overhead_{args.subscriber}.json")
    (RESULTS / name).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
