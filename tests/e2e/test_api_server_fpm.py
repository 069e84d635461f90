"""End-to-end: vLLM's OpenAI API server publishes FPM while serving HTTP.

The plugin is enabled through the environment alone; the server is started the
way a user's container would start it (multiprocess engine). With
``--data-parallel-size 2`` each rank publishes on its own port with its rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stepscale_engine import wire
from tests.conftest import free_tcp_port
from tests.e2e.conftest import FpmCollector, api_server, complete

PROMPTS = [[1 + (i * 31 + t * 7) % 900 for t in range(20 + 15 * i)] for i in range(8)]
OUTPUT_TOKENS = 12


def serve_batch(base: str) -> list[int]:
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete(base, p, OUTPUT_TOKENS), PROMPTS))
    return [r["usage"]["completion_tokens"] for r in results]


def check_accounting(passes: list[wire.ForwardPassMetrics], completion_tokens: list[int]) -> None:
    sched = [m.scheduled_requests for m in passes]
    assert sum(s.sum_prefill_tokens for s in sched) == sum(len(p) for p in PROMPTS)
    assert sum(s.num_decode_requests for s in sched) == sum(completion_tokens) - len(PROMPTS)
    assert all(m.wall_time > 0 for m in passes)


def assert_consecutive(messages: list[wire.ForwardPassMetrics]) -> None:
    counters = [m.counter_id for m in messages]
    assert counters == list(range(counters[0], counters[0] + len(counters)))


def test_server_publishes_fpm_while_serving_http(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    port = free_tcp_port()
    collector = FpmCollector(f"tcp://127.0.0.1:{port}").start()
    log = tmp_path_factory.mktemp("api") / "server.log"
    try:
        with api_server(tiny_model, port, "api-pod-0", log) as base:
            # Idle engine: heartbeats prove the stream is up before any request.
            assert collector.wait_for(lambda ms: any(m.is_heartbeat for m in ms), 30.0), (
                "no heartbeat from the idle engine:\n" + log.read_text()[-4000:]
            )
            before = len(collector.messages)
            completion_tokens = serve_batch(base)
            assert completion_tokens == [OUTPUT_TOKENS] * len(PROMPTS)
            assert collector.wait_for(lambda ms: ms[-1].is_heartbeat, 5.0)
    finally:
        collector.stop()
    served = collector.messages[before:]
    assert {m.worker_id for m in served} == {"api-pod-0"}
    assert_consecutive(served)
    check_accounting([m for m in served if not m.is_heartbeat], completion_tokens)


def test_each_data_parallel_rank_publishes_on_its_own_port(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base_port = free_tcp_port(count=2)
    collectors = [FpmCollector(f"tcp://127.0.0.1:{base_port + r}").start() for r in (0, 1)]
    log = tmp_path_factory.mktemp("api-dp") / "server.log"
    try:
        with api_server(tiny_model, base_port, "dp-pod", log,
                        ["--data-parallel-size", "2"]) as base:
            for rank, collector in enumerate(collectors):
                assert collector.wait_for(lambda ms: any(m.is_heartbeat for m in ms), 60.0), (
                    f"no heartbeat from rank {rank}:\n" + log.read_text()[-4000:]
                )
            starts = [len(c.messages) for c in collectors]
            completion_tokens = serve_batch(base)
            for collector in collectors:
                assert collector.wait_for(lambda ms: ms[-1].is_heartbeat, 5.0)
    finally:
        for collector in collectors:
            collector.stop()
    passes: list[wire.ForwardPassMetrics] = []
    for rank, (collector, start) in enumerate(zip(collectors, starts, strict=True)):
        served = collector.messages[start:]
        assert {m.dp_rank for m in collector.messages} == {rank}
        assert {m.worker_id for m in collector.messages} == {"dp-pod"}
        assert_consecutive(served)
        passes += [m for m in served if not m.is_heartbeat]
    # Both ranks together account for every token served.
    check_accounting(passes, completion_tokens)
