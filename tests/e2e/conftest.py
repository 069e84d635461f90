"""Fixtures that run a real vLLM CPU engine with the plugin and collect its FPM stream."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from stepscale_engine import wire
from stepscale_engine.tiny_model import build_tiny_llama
from tests.conftest import free_tcp_port

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama small enough for a 2-core CPU (built locally: no downloads)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine_env(port: int, worker_id: str) -> dict[str, str]:
    """Environment for a vLLM process: the plugin is enabled by these variables alone."""
    env = dict(os.environ)
    env.update(
        STEPSCALE_FPM_PORT=str(port),
        STEPSCALE_FPM_WORKER_ID=worker_id,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class FpmCollector:
    """A SUB socket on a background thread that keeps every decoded message."""

    endpoint: str
    messages: list[wire.ForwardPassMetrics] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> FpmCollector:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if sock.poll(50):
                    try:
                        self.messages.append(wire.decode_frames(sock.recv_multipart()))
                    except wire.DecodeError as exc:
                        self.errors.append(str(exc))
        finally:
            sock.close()

    def wait_for(self, predicate: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.messages):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def passes(self) -> list[wire.ForwardPassMetrics]:
        return [m for m in self.messages if not m.is_heartbeat]


@contextlib.contextmanager
def api_server(model: Path, fpm_port: int, worker_id: str, log_path: Path,
               extra_args: Sequence[str] = ()) -> Iterator[str]:
    """vLLM's OpenAI API server as a user's container starts it; yields its base URL.

    The plugin is enabled by the environment alone (``engine_env``).
    """
    http_port = free_tcp_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(model), "--skip-tokenizer-init", "--enforce-eager",
             "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
             "--no-enable-prefix-caching", "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(http_port), *extra_args],
            env=engine_env(fpm_port, worker_id),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 600
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
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def complete(base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One /v1/completions request with a token-id prompt."""
    body = json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        base + "/v1/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        return dict(json.loads(resp.read()))


@dataclass
class ScenarioRun:
    """The FPM stream of one scenario and the engine's independent measurements."""

    messages: list[wire.ForwardPassMetrics]
    passes: list[wire.ForwardPassMetrics]
    measured: dict[str, Any]


def run_scenario(model: Path, scenario: str, port: int, tmp_path: Path) -> ScenarioRun:
    """Run ``engine_scenario.py`` in its own process and collect its stream over TCP."""
    out = tmp_path / f"{scenario}.json"
    collector = FpmCollector(f"tcp://127.0.0.1:{port}").start()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_scenario.py"), "--model", str(model),
         "--scenario", scenario, "--out", str(out)],
        env=engine_env(port, f"e2e-{scenario}"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            log.append(line)
            if line.strip() == "READY":
                break
        else:
            pytest.fail("engine exited before READY:\n" + "".join(log[-40:]))
        # The engine binds at construction and heartbeats while idle: once one
        # arrives, our subscription is live and no pass can be missed.
        assert collector.wait_for(lambda ms: any(m.is_heartbeat for m in ms), 10.0), (
            "no heartbeat from the idle engine"
        )
        proc.stdin.write("go\n")
        proc.stdin.flush()
        drain = threading.Thread(target=lambda: log.extend(proc.stdout or []), daemon=True)
        drain.start()
        assert proc.wait(timeout=600) == 0, "".join(log[-40:])
        time.sleep(0.3)
    finally:
        if proc.poll() is None:
            proc.kill()
        collector.stop()
    assert not collector.errors, collector.errors
    return ScenarioRun(collector.messages, collector.passes, json.loads(out.read_text()))


@pytest.fixture(scope="session")
def scenario_runs(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ScenarioRun]]:
    """Each scenario runs once per session; tests read the cached result."""
    cache: dict[str, ScenarioRun] = {}

    class Runs(dict[str, ScenarioRun]):
        def __missing__(self, scenario: str) -> ScenarioRun:
            run = run_scenario(
                tiny_model, scenario, free_tcp_port(), tmp_path_factory.mktemp(scenario)
            )
            self[scenario] = run
            return run

    runs = Runs(cache)
    yield runs
