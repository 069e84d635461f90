"""Plugin entry point: configuration from the environment, patching, version drift.

The engine classes here are small stand-ins for vLLM's ``EngineCore`` family
(only their method names matter to the patching); the real engine is exercised
in tests/e2e.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from stepscale_engine import plugin
from stepscale_engine.plugin import PluginConfig


def test_disabled_without_port_or_endpoint() -> None:
    assert PluginConfig.from_env({}) is None


def test_port_config_and_worker_id_fallbacks() -> None:
    cfg = PluginConfig.from_env({"STEPSCALE_FPM_PORT": "20380", "POD_NAME": "pod-7"})
    assert cfg is not None
    assert cfg.worker_id == "pod-7"
    assert cfg.endpoint(0) == "tcp://*:20380" and cfg.endpoint(3) == "tcp://*:20383"
    explicit = PluginConfig.from_env(
        {"STEPSCALE_FPM_PORT": "20380", "POD_NAME": "p", "STEPSCALE_FPM_WORKER_ID": "w"}
    )
    assert explicit is not None and explicit.worker_id == "w"


def test_ipc_endpoint_config() -> None:
    cfg = PluginConfig.from_env({"STEPSCALE_FPM_ENDPOINT": "ipc:///tmp/fpm", "HOSTNAME": "h"})
    assert cfg is not None and cfg.endpoint(2) == "ipc:///tmp/fpm.2"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STEPSCALE_FPM_PORT": "http"}, "not a TCP port"),
        ({"STEPSCALE_FPM_PORT": "70000"}, "not a TCP port"),
        ({"STEPSCALE_FPM_ENDPOINT": "tcp://x:1"}, "must start with ipc://"),
        ({"STEPSCALE_FPM_PORT": "1", "STEPSCALE_FPM_QUEUE": "lots"}, "STEPSCALE_FPM_QUEUE"),
        ({"STEPSCALE_FPM_PORT": "1", "STEPSCALE_FPM_HEARTBEAT_S": "0"}, "must be positive"),
    ],
)
def test_bad_values_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PluginConfig.from_env(env)


def test_register_with_bad_env_warns_and_does_not_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("STEPSCALE_FPM_PORT", "not-a-port")
    with caplog.at_level(logging.WARNING):
        plugin.register()
    assert "Stepscale FPM disabled" in caplog.text


CONFIG = PluginConfig(
    base="1", bind_host="127.0.0.1", worker_id="w", queue_capacity=10, heartbeat_interval_s=1.0
)


def make_engine_family() -> tuple[type, type]:
    class FakeEngineCore:
        def __init__(self) -> None:
            self.scheduler = object()
            self.calls: list[str] = []

        def step(self) -> str:
            return "stepped"

        def step_with_batch_queue(self) -> str:
            return "batch-stepped"

    class FakeEngineCoreProc(FakeEngineCore):
        def run_busy_loop(self) -> str:
            return "looped"

    return FakeEngineCore, FakeEngineCoreProc


def test_patch_installs_on_construction_and_in_the_busy_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed: list[Any] = []

    def fake_install(engine: Any, config: PluginConfig) -> None:
        engine.__dict__[plugin._HOOK_ATTR] = "hook"
        installed.append(engine)

    monkeypatch.setattr(plugin, "install_hook", fake_install)
    core_cls, proc_cls = make_engine_family()
    # An engine built while the plugin was loading: constructed before the patch.
    early = proc_cls()
    assert plugin.patch_engine_core(core_cls, CONFIG)
    assert plugin.patch_engine_core(core_cls, CONFIG)  # loading twice is harmless
    late = core_cls()
    assert installed == [late]
    assert early.run_busy_loop() == "looped"  # original behaviour kept
    assert installed == [late, early]
    assert early.step() == "stepped" and late.step_with_batch_queue() == "batch-stepped"
    assert installed == [late, early]  # each engine once


def test_version_drift_disables_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    class OldEngineCore:
        def step(self) -> None: ...

    with caplog.at_level(logging.WARNING):
        assert not plugin.patch_engine_core(OldEngineCore, CONFIG)
    assert "lacks step_with_batch_queue" in caplog.text
    assert not hasattr(OldEngineCore, plugin._PATCHED_ATTR)


def test_install_hook_on_an_engine_without_scheduler_disables_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Bare:
        pass

    engine = Bare()
    with caplog.at_level(logging.WARNING):
        assert plugin.install_hook(engine, CONFIG) is None
    assert "internals differ" in caplog.text
    # Marked, so a failing install is not retried on every step.
    assert plugin._HOOK_ATTR in engine.__dict__


def test_data_parallel_rank_prefers_index() -> None:
    class Parallel:
        data_parallel_index = 3
        data_parallel_rank = 1

    class Config:
        parallel_config = Parallel()

    assert plugin.data_parallel_rank(Config()) == 3
    assert plugin.data_parallel_rank(object()) == 0
