"""vLLM general plugin: ``register()`` is the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` in every one of its processes. It does nothing (and
costs nothing) unless ``STEPSCALE_FPM_PORT`` or ``STEPSCALE_FPM_ENDPOINT`` is set.
When enabled it wraps ``EngineCore.__init__`` so that each new engine installs an
:class:`EngineHook` on its scheduler and executor as soon as it is built (the
stream starts with heartbeats before the first request), and ``EngineCore.step``
and ``EngineCore.step_with_batch_queue`` so that an engine whose construction
had already begun when vLLM loaded the plugin installs it on its first step.
Nothing else in vLLM is touched, and no ``--scheduler-cls`` is needed: a user's
own scheduler class works too.

Environment:

==============================  =====================================================
``STEPSCALE_FPM_PORT``          TCP base port; rank r binds ``base + r`` (e.g. 20380)
``STEPSCALE_FPM_ENDPOINT``      instead of a port: ``ipc:///path/name`` (rank r binds
                                ``ipc:///path/name.r``)
``STEPSCALE_FPM_BIND_HOST``     TCP interface to bind (default ``*``)
``STEPSCALE_FPM_WORKER_ID``     stream identity (default: ``POD_NAME``, then hostname)
``STEPSCALE_FPM_QUEUE``         publisher queue capacity (default 10000)
``STEPSCALE_FPM_HEARTBEAT_S``   idle heartbeat interval (default 1.0)
==============================  =====================================================
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stepscale_engine import wire
from stepscale_engine.publisher import DEFAULT_QUEUE_CAPACITY, FpmPublisher

log = logging.getLogger("stepscale_engine")

_HOOK_ATTR = "_stepscale_fpm_hook"
_PATCHED_ATTR = "_stepscale_fpm_patched"
STEP_METHODS = ("step", "step_with_batch_queue")


@dataclass(frozen=True)
class PluginConfig:
    """Settings read from the environment; ``None`` from :meth:`from_env` means disabled."""

    base: str  # TCP base port (digits) or IPC name
    bind_host: str
    worker_id: str
    queue_capacity: int
    heartbeat_interval_s: float

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig | None:
        """Parse the environment; raises ``ValueError`` with a clear message on bad values."""
        env = os.environ if env is None else env
        port = env.get("STEPSCALE_FPM_PORT", "").strip()
        endpoint = env.get("STEPSCALE_FPM_ENDPOINT", "").strip()
        if not port and not endpoint:
            return None
        if port:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"STEPSCALE_FPM_PORT={port!r} is not a TCP port number")
            base = port
        else:
            if not endpoint.startswith("ipc://"):
                raise ValueError(
                    f"STEPSCALE_FPM_ENDPOINT={endpoint!r} must start with ipc:// "
                    "(use STEPSCALE_FPM_PORT for TCP)"
                )
            base = endpoint
        worker_id = (
            env.get("STEPSCALE_FPM_WORKER_ID")
            or env.get("POD_NAME")
            or env.get("HOSTNAME")
            or socket.gethostname()
        )
        try:
            capacity = int(env.get("STEPSCALE_FPM_QUEUE", DEFAULT_QUEUE_CAPACITY))
            heartbeat = float(env.get("STEPSCALE_FPM_HEARTBEAT_S", wire.HEARTBEAT_INTERVAL_S))
        except ValueError as exc:
            raise ValueError(
                f"bad STEPSCALE_FPM_QUEUE or STEPSCALE_FPM_HEARTBEAT_S: {exc}"
            ) from None
        if capacity < 1 or heartbeat <= 0:
            raise ValueError("STEPSCALE_FPM_QUEUE and STEPSCALE_FPM_HEARTBEAT_S must be positive")
        return cls(
            base=base,
            bind_host=env.get("STEPSCALE_FPM_BIND_HOST", "*"),
            worker_id=worker_id,
            queue_capacity=capacity,
            heartbeat_interval_s=heartbeat,
        )

    def endpoint(self, dp_rank: int) -> str:
        """Bind address of one data-parallel rank."""
        return wire.endpoint_for_rank(self.base, dp_rank, self.bind_host)


def data_parallel_rank(vllm_config: Any) -> int:
    """vLLM's ``data_parallel_index``, falling back to ``data_parallel_rank``."""
    parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, name, None)
        if isinstance(value, int):
            return value
    return 0


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "unavailable"


def register() -> None:
    """Entry point: enable FPM publishing if configured; never raises."""
    try:
        config = PluginConfig.from_env()
    except ValueError as exc:
        log.warning("Stepscale FPM disabled: %s", exc)
        return
    if config is None:
        return
    _log_like_vllm()
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception as exc:  # noqa: BLE001 - drift: any import problem disables us
        log.warning(
            "Stepscale FPM disabled: vLLM %s has no vllm.v1.engine.core.EngineCore (%s)",
            _vllm_version(),
            exc,
        )
        return
    patch_engine_core(EngineCore, config)


def _log_like_vllm() -> None:
    """Send our records through vLLM's handlers so they appear in the server log."""
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.handlers and not log.handlers:
        for handler in vllm_logger.handlers:
            log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def patch_engine_core(engine_core_cls: type, config: PluginConfig) -> bool:
    """Wrap the step methods of ``engine_core_cls``; False (with one warning) on drift."""
    if getattr(engine_core_cls, _PATCHED_ATTR, False):
        return True  # vLLM loads plugins more than once per process
    missing = [m for m in STEP_METHODS if not callable(getattr(engine_core_cls, m, None))]
    if missing:
        log.warning(
            "Stepscale FPM disabled: vLLM %s EngineCore lacks %s",
            _vllm_version(),
            ", ".join(missing),
        )
        return False
    for name in STEP_METHODS:
        setattr(engine_core_cls, name, _installing_call(getattr(engine_core_cls, name), config))
    engine_core_cls.__init__ = _installing_init(engine_core_cls.__init__, config)  # type: ignore[misc]
    # An engine process often loads plugins from inside EngineCore.__init__, too
    # late for the wrapper above; its busy loop starts right after, so install
    # there and the idle engine still heartbeats before its first request.
    for cls in _subclasses(engine_core_cls):
        if "run_busy_loop" in cls.__dict__:
            cls.run_busy_loop = _installing_call(cls.__dict__["run_busy_loop"], config)  # type: ignore[attr-defined]
    setattr(engine_core_cls, _PATCHED_ATTR, True)
    log.info("Stepscale FPM enabled (worker_id=%s, base=%s)", config.worker_id, config.base)
    return True


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    subclass: type
    for subclass in cls.__subclasses__():
        found += [subclass, *_subclasses(subclass)]
    return found


def _installing_call(method: Callable[..., Any], config: PluginConfig) -> Callable[..., Any]:
    """Wrap an engine method so that its first call installs the hook on that engine."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _HOOK_ATTR not in self.__dict__:
            install_hook(self, config)
        return method(self, *args, **kwargs)

    return wrapper


def _installing_init(init: Callable[..., Any], config: PluginConfig) -> Callable[..., Any]:
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Subclasses call this through super(): install once, after the base is built.
        if _HOOK_ATTR not in self.__dict__ and hasattr(self, "scheduler"):
            install_hook(self, config)

    return wrapper


def install_hook(engine_core: Any, config: PluginConfig) -> Any:
    """Install an :class:`EngineHook` on one engine; returns it, or None if disabled."""
    # Mark first: a failure below must not be retried on every step.
    engine_core.__dict__[_HOOK_ATTR] = None
    from stepscale_engine.engine_hook import EngineHook
    from stepscale_engine.pass_timer import choose_pass_timer

    scheduler = getattr(engine_core, "scheduler", None)
    executor = getattr(engine_core, "model_executor", None)
    vllm_config = getattr(engine_core, "vllm_config", None)
    dp_rank = data_parallel_rank(vllm_config)
    try:
        publisher = FpmPublisher(
            config.endpoint(dp_rank),
            config.worker_id,
            dp_rank,
            queue_capacity=config.queue_capacity,
            heartbeat_interval_s=config.heartbeat_interval_s,
        )
        hook = EngineHook(scheduler, executor, publisher, choose_pass_timer(executor, vllm_config))
    except TypeError as exc:
        log.warning(
            "Stepscale FPM disabled: vLLM %s internals differ from what the plugin needs: %s",
            _vllm_version(),
            exc,
        )
        return None
    try:
        publisher.start()
    except OSError as exc:
        log.warning("Stepscale FPM disabled: %s", exc)
        hook.uninstall()
        return None
    engine_core.__dict__[_HOOK_ATTR] = hook
    atexit.register(publisher.close)
    log.info(
        "Stepscale FPM publishing on %s (worker_id=%s, dp_rank=%d, timing_scope=%s)",
        publisher.endpoint,
        config.worker_id,
        dp_rank,
        hook.timer.scope,
    )
    return hook
