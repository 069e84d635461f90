"""LocalEngine: a real vLLM CPU engine in a child process, with the plugin, replaying traffic.

The embedded default of ``stepscale demo``: one engine stands in for one pod.
The child builds a tiny random Llama (no downloads), starts vLLM in-process
with the Stepscale plugin enabled through the environment (exactly as in a pod),
warms up, measures how many requests of the demo's shape it serves per second
flat out (printed with ``READY``), waits for ``go SCHEDULE.json`` on stdin, then
submits each request of the schedule at its arrival time and steps the engine
until every request has finished. Like a client, it times each request: a
``REQ`` line on stdout per finished request carries its arrival, TTFT and mean
ITL (:class:`ClientLatency`), which the parent collects on a reader thread.

Run as a module for the child side::

    python -m stepscale_operator.local_engine --probe-prompt 400 --probe-output 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# Engine settings sized for a 2-core CPU machine and the tiny model.
ENGINE_ARGS: dict[str, Any] = dict(
    max_num_batched_tokens=512,
    max_num_seqs=64,
    max_model_len=2048,
    block_size=32,
)
MAX_PROMPT_TOKENS = 1536
MAX_OUTPUT_TOKENS = 256
# Flat-out probes at start; the fastest is the capacity (see _replay).
CAPACITY_PROBES = 3


@dataclass(frozen=True)
class ClientLatency:
    """One finished request as its client saw it (seconds from ``go``, milliseconds)."""

    arrival_s: float
    finished_s: float
    ttft_ms: float
    itl_ms: float  # mean inter-token latency; 0 for a one-token output

    def line(self) -> str:
        """The child's ``REQ`` line for this request."""
        return (
            f"REQ {self.arrival_s:.3f} {self.finished_s:.3f} {self.ttft_ms:.1f} {self.itl_ms:.2f}"
        )

    @classmethod
    def parse(cls, line: str) -> ClientLatency | None:
        """The request of a ``REQ`` line, None for any other line."""
        parts = line.split()
        if len(parts) != 5 or parts[0] != "REQ":
            return None
        return cls(*(float(p) for p in parts[1:]))


@dataclass
class LocalEngine:
    """Parent-side handle of the child engine process."""

    fpm_port: int
    worker_id: str = "local-engine-0"
    proc: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)
    finished: list[ClientLatency] = field(default_factory=list)
    _reader: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, probe: tuple[int, int], log_file: IO[str] | None) -> None:
        """Start the child; ``probe`` is the (prompt, output) tokens of the requests its
        throughput is measured with."""
        env = dict(
            os.environ,
            STEPSCALE_FPM_PORT=str(self.fpm_port),
            STEPSCALE_FPM_WORKER_ID=self.worker_id,
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            # One OpenMP thread: leaves a core for the control loop on 2-core machines.
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
            PYTHONUNBUFFERED="1",
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stepscale_operator.local_engine",
                "--probe-prompt",
                str(probe[0]),
                "--probe-output",
                str(probe[1]),
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file if log_file is not None else subprocess.DEVNULL,
            text=True,
        )

    def wait_ready(self) -> float:
        """Block until the engine is built and measured; returns the requests per
        second of the probe's shape it served flat out (raises if the child died)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("READY"):
                return float(line.split()[1])
        raise RuntimeError("local engine exited before it was ready:\n" + "".join(self.log[-20:]))

    def go(self, schedule: list[tuple[float, int, int]]) -> None:
        """Replay ``(arrival_s, prompt_tokens, output_tokens)`` requests from now;
        collect each finished request's latencies."""
        assert self.proc is not None and self.proc.stdin is not None
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(schedule, fh)
        self._reader = threading.Thread(target=self._read, name="local-engine-out", daemon=True)
        self._reader.start()
        self.proc.stdin.write(f"go {fh.name}\n")
        self.proc.stdin.flush()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            request = ClientLatency.parse(line)
            if request is None:
                self.log.append(line)
                continue
            with self._lock:
                self.finished.append(request)

    def finished_between(self, start_s: float, end_s: float) -> list[ClientLatency]:
        """The requests that finished in ``[start_s, end_s)`` (seconds from ``go``)."""
        with self._lock:
            return [r for r in self.finished if start_s <= r.finished_s < end_s]

    def done(self) -> bool:
        """True once every request of the schedule has finished."""
        return any(line.strip() == "DONE" for line in self.log[-5:])

    def running(self) -> bool:
        """True while the child is alive."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the child (idempotent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _replay(probe_prompt: int, probe_output: int) -> int:
    """Child side: build the engine, measure it, wait for go, replay the schedule."""
    import random

    from vllm import LLM, SamplingParams

    from stepscale_engine.tiny_model import build_tiny_llama

    model = build_tiny_llama(Path(tempfile.gettempdir()) / "stepscale-tiny-llama")
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        **ENGINE_ARGS,
    )
    engine = llm.llm_engine
    _warm_up(engine, SamplingParams)
    # The fastest of a few probes: on a shared machine noise only slows a probe, and
    # one slowed probe (26 req/s against 41 served later in one CI-class run) made
    # the demo's "overload" one the engine kept up with.
    capacity = max(
        _throughput(engine, SamplingParams, probe_prompt, probe_output, probe)
        for probe in range(CAPACITY_PROBES)
    )
    print(f"READY {capacity:.4f}", flush=True)
    schedule_path = sys.stdin.readline().split(maxsplit=1)[1].strip()
    schedule = [tuple(r) for r in json.loads(Path(schedule_path).read_text())]
    rng = random.Random(0)
    start = time.monotonic()
    index = 0
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    while index < len(schedule) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while index < len(schedule) and schedule[index][0] <= now:
            arrival, prompt_len, output_len = schedule[index]
            prompt = [rng.randint(1, 1000) for _ in range(int(prompt_len))]
            engine.add_request(
                f"req-{index}",
                {"prompt_token_ids": prompt},
                SamplingParams(max_tokens=int(output_len), ignore_eos=True, temperature=0.0),
            )
            # The client's clock starts at the scheduled arrival: a request the
            # loop could only add late (a long step) waited that long too.
            arrived[f"req-{index}"] = float(arrival)
            index += 1
        if engine.has_unfinished_requests():
            outputs = engine.step()
            _time_outputs(outputs, time.monotonic() - start, arrived, first_token)
        else:
            time.sleep(0.005)
    print("DONE", flush=True)
    # Stay up, idle and heartbeating, until the parent is done watching: a stream
    # that goes stale would make the last decisions holds on missing data.
    sys.stdin.readline()
    return 0


def _warm_up(engine: Any, sampling_params: Any) -> None:
    """Run a few requests of varied lengths before the replay: the CPU backend's
    first passes of each batch shape are several times slower, which would count
    against the SLO in the calm phase and against the model's first fit."""
    for k, prompt_len in enumerate((64, 200, 400, 700, 1000, 1400, 300, 90)):
        engine.add_request(
            f"warm-{k}",
            {"prompt_token_ids": [1 + (i * 7 + k) % 999 for i in range(prompt_len)]},
            sampling_params(max_tokens=24, ignore_eos=True, temperature=0.0),
        )
    while engine.has_unfinished_requests():
        engine.step()


def _throughput(
    engine: Any, sampling_params: Any, prompt_len: int, output_len: int, probe: int = 0
) -> float:
    """Requests per second served flat out: a full batch of ``(prompt_len,
    output_len)`` requests submitted at once. This machine's speed, not a constant,
    decides what overloads it (a shared or faster machine differs by 2x and more)."""
    n = int(ENGINE_ARGS["max_num_seqs"])
    for k in range(n):
        engine.add_request(
            f"probe-{probe}-{k}",
            {"prompt_token_ids": [1 + (i * 13 + k) % 999 for i in range(prompt_len)]},
            sampling_params(max_tokens=output_len, ignore_eos=True, temperature=0.0),
        )
    began = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    return n / max(time.monotonic() - began, 1e-3)


def _time_outputs(
    outputs: list[Any], now: float, arrived: dict[str, float], first_token: dict[str, float]
) -> None:
    """Note first tokens; print a ``REQ`` line for each request that finished."""
    for out in outputs:
        rid = out.request_id
        tokens = len(out.outputs[0].token_ids) if out.outputs else 0
        if tokens and rid not in first_token:
            first_token[rid] = now
        if out.finished and rid in arrived:
            first = first_token.pop(rid, now)
            arrival = arrived.pop(rid)
            itl_ms = (now - first) * 1e3 / (tokens - 1) if tokens > 1 else 0.0
            latency = ClientLatency(arrival, now, (first - arrival) * 1e3, itl_ms)
            print(latency.line(), flush=True)


def main() -> int:
    """Child entry point."""
    parser = argparse.ArgumentParser(description="replay a request schedule on a local engine")
    parser.add_argument("--probe-prompt", type=int, required=True)
    parser.add_argument("--probe-output", type=int, required=True)
    args = parser.parse_args()
    return _replay(args.probe_prompt, args.probe_output)


if __name__ == "__main__":
    sys.exit(main())
