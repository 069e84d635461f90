"""Plugin entry point: configuration from the environment, patching, version drift.

The engine classes here are small stand-ins for vLLM's ``EngineCore`` family
(only their method names matter to the patching); the real engine is exercised
in tests/e2e.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import types
from typing import Any

import pytest

from stepscale_engine import plugin, vllm_compat
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


# -- version drift: the internals the plugin reads ------------------------------------


def test_the_installed_vllm_has_every_internal_the_plugin_reads() -> None:
    pytest.importorskip("vllm", reason="needs the real vLLM")
    assert vllm_compat.missing_internals() == []


def test_drifted_scheduler_types_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass
    class SchedulerOutput:  # renamed one field, dropped another
        scheduled_new_reqs: list[Any]
        scheduled_cached_reqs: Any
        num_scheduled_tokens: dict[str, int]
        total_scheduled_tokens: int

    @dataclasses.dataclass
    class CachedRequestData:
        req_ids: list[str]
        num_computed_tokens: list[int]
        num_output_tokens: list[int] = dataclasses.field(default_factory=list)

    class RequestStatus(enum.IntEnum):  # no WAITING_FOR_REMOTE_KVS
        WAITING = 1
        PREEMPTED = 2

    class Request:
        @property
        def num_tokens(self) -> int:
            return 0

    output = types.ModuleType("vllm.v1.core.sched.output")
    output.SchedulerOutput = SchedulerOutput  # type: ignore[attr-defined]
    output.CachedRequestData = CachedRequestData  # type: ignore[attr-defined]
    request = types.ModuleType("vllm.v1.request")
    request.RequestStatus = RequestStatus  # type: ignore[attr-defined]
    request.Request = Request  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.output", output)
    monkeypatch.setitem(sys.modules, "vllm.v1.request", request)

    assert vllm_compat.missing_internals() == [
        "SchedulerOutput.total_num_scheduled_tokens",
        "SchedulerOutput.scheduled_spec_decode_tokens",
        "vllm.v1.core.sched.output.NewRequestData",
        "RequestStatus.WAITING_FOR_REMOTE_KVS",
    ]


class FakeEngineModule(types.ModuleType):
    """Stands in for ``vllm.v1.engine.core`` so register() never patches vLLM itself."""

    def __init__(self) -> None:
        super().__init__("vllm.v1.engine.core")
        self.EngineCore, _proc = make_engine_family()


@pytest.fixture
def fake_engine_module(monkeypatch: pytest.MonkeyPatch) -> FakeEngineModule:
    module = FakeEngineModule()
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", module)
    monkeypatch.setenv("STEPSCALE_FPM_PORT", "20380")
    # Keep our records on the root logger, where caplog sees them.
    monkeypatch.setattr(plugin, "_log_like_vllm", lambda: None)
    return module


def test_register_disables_with_one_warning_when_internals_drifted(
    fake_engine_module: FakeEngineModule,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(plugin, "missing_internals", lambda: ["RequestStatus.PREEMPTED"])
    with caplog.at_level(logging.WARNING):
        plugin.register()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert f"vLLM {vllm_compat.vllm_version()}" in warnings[0]
    assert "RequestStatus.PREEMPTED" in warnings[0]
    assert not hasattr(fake_engine_module.EngineCore, plugin._PATCHED_ATTR)


def test_register_never_raises(
    fake_engine_module: FakeEngineModule,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(plugin, "missing_internals", lambda: [])

    def broken_patch(cls: type, config: PluginConfig) -> bool:
        raise AttributeError("EngineCore.__init__ is read-only in this build")

    monkeypatch.setattr(plugin, "patch_engine_core", broken_patch)
    with caplog.at_level(logging.WARNING):
        plugin.register()  # must not raise
    assert "Stepscale FPM disabled" in caplog.text and "read-only" in caplog.text


def test_register_patches_when_nothing_drifted(
    fake_engine_module: FakeEngineModule, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plugin, "missing_internals", lambda: [])
    plugin.register()
    assert getattr(fake_engine_module.EngineCore, plugin._PATCHED_ATTR, False)


# -- the engine's own calls survive any failure of the plugin ----------------------------


def test_failing_install_never_breaks_the_engine_and_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin, "_install_broken", False)
    attempts: list[Any] = []

    def broken_install(engine: Any, config: PluginConfig) -> None:
        attempts.append(engine)
        raise KeyError("vllm_config")

    monkeypatch.setattr(plugin, "install_hook", broken_install)
    core_cls, proc_cls = make_engine_family()
    early = proc_cls()  # built before the patch: installs in its busy loop
    assert plugin.patch_engine_core(core_cls, CONFIG)
    with caplog.at_level(logging.WARNING):
        late = core_cls()  # the wrapped __init__ returns normally
        assert early.run_busy_loop() == "looped"
        assert late.step() == "stepped"
        assert late.step_with_batch_queue() == "batch-stepped"
    assert hasattr(late, "scheduler")  # constructed completely
    assert len(attempts) == 1  # disabled after the first failure: no retry per step
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "KeyError" in warnings[0]


def test_engine_errors_still_reach_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    # The guard covers the plugin only: the engine's own exceptions are not swallowed.
    monkeypatch.setattr(plugin, "install_hook", lambda engine, config: None)

    class Engine:
        def __init__(self) -> None:
            self.scheduler = object()

        def step(self) -> None:
            raise RuntimeError("engine failure")

        def step_with_batch_queue(self) -> None: ...

    assert plugin.patch_engine_core(Engine, CONFIG)
    with pytest.raises(RuntimeError, match="engine failure"):
        Engine().step()


def test_install_hook_survives_unexpected_errors(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_publisher(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("zmq context terminated")

    monkeypatch.setattr(plugin, "FpmPublisher", broken_publisher)
    engine = make_engine_family()[0]()
    with caplog.at_level(logging.WARNING):
        assert plugin.install_hook(engine, CONFIG) is None
    assert "zmq context terminated" in caplog.text
    assert f"vLLM {vllm_compat.vllm_version()}" in caplog.text
    assert engine.__dict__[plugin._HOOK_ATTR] is None
