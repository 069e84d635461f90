"""LocalEngine: a real vLLM CPU engine in a child process, with the plugin, replaying traffic.

The embedded default of ``stepscale demo``: one engine stands in for one pod.
The child builds a tiny random Llama (no downloads), starts vLLM in-process
with the Stepscale plugin enabled through the environment (exactly as in a pod),
waits for ``go`` on stdin, then submits each request of the schedule at its
arrival time and steps the engine until every request has finished.

Run as a module for the child side::

    python -m stepscale_operator.local_engine --schedule FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


@dataclass
class LocalEngine:
    """Parent-side handle of the child engine process."""

    fpm_port: int
    worker_id: str = "local-engine-0"
    proc: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)

    def start(self, schedule: list[tuple[float, int, int]], log_file: IO[str] | None) -> None:
        """Start the child with ``(arrival_s, prompt_tokens, output_tokens)`` requests."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(schedule, fh)
            schedule_path = fh.name
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
            [sys.executable, "-m", "stepscale_operator.local_engine", "--schedule", schedule_path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file if log_file is not None else subprocess.DEVNULL,
            text=True,
        )

    def wait_ready(self) -> None:
        """Block until the engine is built (raises if the child died)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.strip() == "READY":
                return
        raise RuntimeError("local engine exited before it was ready:\n" + "".join(self.log[-20:]))

    def go(self) -> None:
        """Start replaying the schedule."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

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


def _replay(schedule_path: str) -> int:
    """Child side: build the engine, wait for go, replay the schedule."""
    import random

    from vllm import LLM, SamplingParams

    from stepscale_engine.tiny_model import build_tiny_llama

    schedule = [tuple(r) for r in json.loads(Path(schedule_path).read_text())]
    model = build_tiny_llama(Path(tempfile.gettempdir()) / "stepscale-tiny-llama")
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              seed=0, **ENGINE_ARGS)
    engine = llm.llm_engine
    print("READY", flush=True)
    sys.stdin.readline()
    rng = random.Random(0)
    start = time.monotonic()
    index = 0
    while index < len(schedule) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while index < len(schedule) and schedule[index][0] <= now:
            _, prompt_len, output_len = schedule[index]
            prompt = [rng.randint(1, 1000) for _ in range(int(prompt_len))]
            engine.add_request(
                f"req-{index}",
                {"prompt_token_ids": prompt},
                SamplingParams(max_tokens=int(output_len), ignore_eos=True, temperature=0.0),
            )
            index += 1
        if engine.has_unfinished_requests():
            engine.step()
        else:
            time.sleep(0.005)
    print("DONE", flush=True)
    return 0


def main() -> int:
    """Child entry point."""
    parser = argparse.ArgumentParser(description="replay a request schedule on a local engine")
    parser.add_argument("--schedule", required=True)
    args = parser.parse_args()
    return _replay(args.schedule)


if __name__ == "__main__":
    sys.exit(main())
