"""End-to-end: vLLM's OpenAI API server (multiprocess engine) publishes FPM while serving HTTP.

The plugin is enabled through the environment alone; the server is started the
way a user's container would start it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import free_tcp_port
from tests.e2e.conftest import FpmCollector, engine_env


@pytest.fixture(scope="module")
def api_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    tuple[str, FpmCollector]
]:
    http_port, fpm_port = free_tcp_port(), free_tcp_port()
    log_path = tmp_path_factory.mktemp("api") / "server.log"
    collector = FpmCollector(f"tcp://127.0.0.1:{fpm_port}").start()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(tiny_model), "--skip-tokenizer-init", "--enforce-eager",
             "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
             "--no-enable-prefix-caching", "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(http_port)],
            env=engine_env(fpm_port, "api-pod-0"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("API server exited:\n" + log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("API server did not become healthy:\n" + log_path.read_text()[-4000:])
        yield base, collector
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        collector.stop()


def complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, object]:
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        base + "/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def test_server_publishes_fpm_while_serving_http(api_server: tuple[str, FpmCollector]) -> None:
    base, collector = api_server
    # Idle engine: heartbeats prove the stream is up before any request.
    assert collector.wait_for(lambda ms: any(m.is_heartbeat for m in ms), 15.0)
    before = len(collector.messages)
    prompts = [[1 + (i * 31 + t * 7) % 900 for t in range(20 + 15 * i)] for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda p: complete(base, p, 12), prompts))
    completion_tokens = [r["usage"]["completion_tokens"] for r in results]  # type: ignore[index]
    assert completion_tokens == [12] * 8
    assert collector.wait_for(lambda ms: ms[-1].is_heartbeat, 5.0)
    served = collector.messages[before:]
    passes = [m for m in served if not m.is_heartbeat]
    assert {m.worker_id for m in served} == {"api-pod-0"}
    counters = [m.counter_id for m in served]
    assert counters == list(range(counters[0], counters[0] + len(counters)))
    sched = [m.scheduled_requests for m in passes]
    assert sum(s.sum_prefill_tokens for s in sched) == sum(len(p) for p in prompts)
    assert sum(s.num_decode_requests for s in sched) == sum(completion_tokens) - len(prompts)
    assert all(m.wall_time > 0 for m in passes)
