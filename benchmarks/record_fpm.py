"""Record FPM streams from a real vLLM CPU engine under varied load, for cost-model accuracy.

Each engine configuration runs in its own process (vLLM loads plugins once per
process) with the Stepscale plugin enabled by environment, and this script
subscribes over TCP like the operator would, writing one JSON object per
received message (``msgspec.json`` of ``ForwardPassMetrics``) to
``results/recordings/<config>.jsonl``.

Load phases (arrivals are Poisson, prompts and outputs drawn per phase):

* ``short``: short prompts, small decode batches;
* ``long``: long prompts, chunked prefill under the token budget;
* ``prefix``: prompts sharing long prefixes (prefix-cache hits);
* ``decode_heavy``: many concurrent requests with long outputs (large decode batches);
* ``mixed``: everything at once.

* ``decode_small``: rare arrivals with long outputs (decode batches of 1-3);
* ``prefix_hot``: long prompts sharing long prefixes (mostly cache hits);
* ``preempt``: more long requests than the KV cache holds (preemption, recompute).

Configurations: ``roomy`` (plenty of KV, budget 512) and ``tight`` (few KV
blocks, budget 128: chunked prefill everywhere and preemption), the defaults;
``decode_small``, ``prefix`` (prefix caching on), ``preempt`` (36 KV blocks) and
``bigger`` (a 4x wider, 2x deeper random Llama), each with its own phases.

    .venv/bin/python benchmarks/record_fpm.py [--configs roomy tight] [--phase-s 15] [--nice -10]

Each recording gets a ``<config>.meta.json`` beside it with the machine's load
average before and after; ``benchmarks/bench_cost_model.py`` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "results" / "recordings"

# name: (arrivals per second, prompt length range, output length range, shared prefix)
PHASES: dict[str, tuple[float, tuple[int, int], tuple[int, int], bool]] = {
    "short": (12.0, (16, 96), (8, 48), False),
    "long": (2.0, (400, 900), (16, 64), False),
    "prefix": (6.0, (200, 600), (8, 48), True),
    "decode_heavy": (20.0, (16, 64), (100, 300), False),
    "mixed": (8.0, (16, 800), (8, 200), False),
    # Rare arrivals, long outputs: decode batches of 1-3 requests most of the time.
    "decode_small": (0.6, (16, 64), (150, 400), False),
    # Many long prompts sharing long prefixes: most prompt tokens are cache hits.
    "prefix_hot": (5.0, (300, 900), (8, 48), True),
    # More concurrent long requests than the KV cache holds: preemption and recompute.
    "preempt": (10.0, (100, 400), (150, 400), False),
}
ALL_PHASES = ("short", "long", "prefix", "decode_heavy", "mixed")

_ROOMY = dict(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=2048)
# name: engine arguments, load phases in order, and changes to the tiny model's config.
CONFIGS: dict[str, dict[str, Any]] = {
    "roomy": dict(engine=_ROOMY, phases=ALL_PHASES),
    "tight": dict(
        engine=dict(
            max_num_batched_tokens=128,
            max_num_seqs=32,
            max_model_len=1024,
            num_gpu_blocks_override=40,
        ),
        phases=ALL_PHASES,
    ),
    "decode_small": dict(engine=_ROOMY, phases=("decode_small", "short", "decode_small")),
    "prefix": dict(
        engine=dict(_ROOMY, enable_prefix_caching=True),
        phases=("prefix_hot", "prefix", "mixed"),
    ),
    "preempt": dict(
        engine=dict(
            max_num_batched_tokens=256,
            max_num_seqs=48,
            max_model_len=1024,
            num_gpu_blocks_override=36,
        ),
        phases=("preempt", "decode_heavy", "preempt"),
    ),
    # 4x wider, 2x deeper (head_dim 64): about 30x the tiny model's arithmetic per token;
    # lighter phases, so that the queue drains within a few minutes.
    "bigger": dict(
        engine=_ROOMY,
        phases=("short", "long", "short"),
        model=dict(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
        ),
    ),
}


def drive_engine(config_name: str, phase_s: float, seed: int, nice: int = 0) -> None:
    """Child process: build the engine, wait for the go line, run every phase."""
    if nice:
        # Optional: a negative niceness (root only) makes the scheduler prefer the engine
        # over other work on a shared machine, i.e. fewer stalled passes. Off by default,
        # since stalls are part of what the cost model must survive.
        try:
            os.nice(nice)
        except OSError as exc:
            print(f"could not change niceness by {nice}: {exc}", flush=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from stepscale_engine.tiny_model import build_tiny_llama

    config = CONFIGS[config_name]
    overrides = config.get("model")
    model_dir = "stepscale-tiny-llama" + (f"-{config_name}" if overrides else "")
    model = build_tiny_llama(Path(tempfile.gettempdir()) / model_dir, overrides=overrides)
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        seed=seed,
        **config["engine"],
    )
    engine = llm.llm_engine
    max_len = config["engine"]["max_model_len"]
    print("READY", flush=True)
    sys.stdin.readline()
    rng = random.Random(seed)
    shared_prefix = [1 + (t * 11) % 900 for t in range(max_len)]
    request_id = 0
    for name in config["phases"]:
        rate, (p_lo, p_hi), (o_lo, o_hi), shared = PHASES[name]
        print(f"phase {name}", flush=True)
        end = time.monotonic() + phase_s
        next_arrival = time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            while next_arrival <= now:
                prompt_len = rng.randint(p_lo, p_hi)
                out_len = min(rng.randint(o_lo, o_hi), max_len - prompt_len - 1)
                if shared:
                    keep = rng.randint(prompt_len // 2, prompt_len)
                    tokens = shared_prefix[:keep] + [
                        rng.randint(1, 900) for _ in range(prompt_len - keep)
                    ]
                else:
                    tokens = [rng.randint(1, 900) for _ in range(prompt_len)]
                engine.add_request(
                    f"r{request_id}",
                    {"prompt_token_ids": tokens},
                    SamplingParams(max_tokens=max(1, out_len), ignore_eos=True, temperature=0.0),
                )
                request_id += 1
                next_arrival += rng.expovariate(rate)
            if engine.has_unfinished_requests():
                engine.step()
            else:
                time.sleep(0.002)
        while engine.has_unfinished_requests():  # drain before the next phase
            engine.step()
    time.sleep(1.5)  # heartbeats mark the end
    print("DONE", flush=True)


def record(config_name: str, out_dir: Path, phase_s: float, seed: int, nice: int = 0) -> Path:
    """Run one configuration in a child process and record its stream.

    Writes ``<config>.jsonl`` and ``<config>.meta.json`` (machine load before and
    after, CPU count, niceness, phase length): step times on a shared machine
    depend on what else runs, so every figure measured on a recording should be
    read with its load.
    """
    import zmq

    from stepscale_engine import wire

    with socket.socket() as sock:  # a free port for the engine to publish on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{config_name}.jsonl"
    # One OpenMP thread pinned to core 0: with two threads on two shared cores,
    # any other process stalls a whole pass at the OpenMP barrier (we saw
    # 100+ ms passes), which is scheduler noise, not the engine's cost.
    env = dict(
        os.environ,
        STEPSCALE_FPM_PORT=str(port),
        STEPSCALE_FPM_WORKER_ID=f"recorder-{config_name}",
        PYTHONUNBUFFERED="1",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
    )
    load_start = os.getloadavg()
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            config_name,
            "--phase-s",
            str(phase_s),
            "--seed",
            str(seed),
            "--nice",
            str(nice),
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()
    count = [0, 0]

    def collect() -> None:
        import msgspec

        with path.open("wb") as fh:
            while not stop.is_set():
                if sub.poll(50):
                    try:
                        msg = wire.decode_frames(sub.recv_multipart())
                    except wire.DecodeError:
                        count[1] += 1
                        continue
                    fh.write(msgspec.json.encode(msg) + b"\n")
                    count[0] += 1

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    assert proc.stdout is not None and proc.stdin is not None
    for line in proc.stdout:
        if line.strip() == "READY":
            break
    time.sleep(1.5)  # a heartbeat has reached us: subscription is live
    proc.stdin.write("go\n")
    proc.stdin.flush()
    for line in proc.stdout:
        print(f"  [{config_name}] {line.strip()}", flush=True)
    proc.wait()
    time.sleep(0.5)
    stop.set()
    thread.join()
    sub.close()
    load_end = os.getloadavg()
    meta: dict[str, Any] = {
        "config": config_name,
        "engine_args": CONFIGS[config_name]["engine"],
        "phases": list(CONFIGS[config_name]["phases"]),
        "model": CONFIGS[config_name].get("model", {}),
        "phase_s": phase_s,
        "seed": seed,
        "nice": nice,
        "messages": count[0],
        "malformed": count[1],
        "cpus": os.cpu_count(),
        "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path.with_name(f"{config_name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"  [{config_name}] {count[0]} messages -> {path} ({count[1]} malformed), "
        f"load {load_start[0]:.2f} -> {load_end[0]:.2f}"
    )
    if proc.returncode != 0:
        raise SystemExit(f"engine for {config_name} exited with {proc.returncode}")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["roomy", "tight"], choices=sorted(CONFIGS))
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds per load phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness increment for the engine (negative needs root)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        drive_engine(args.child, args.phase_s, args.seed, args.nice)
        return 0
    for name in args.configs:
        record(name, args.out, args.phase_s, args.seed, args.nice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
