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

The plugin must never crash the engine: everything it runs inside vLLM's own
calls (the wrapped ``__init__``, ``step`` and ``run_busy_loop``, and
``register()`` itself) is guarded; an unexpected error is logged once and the
plugin disables itself, and the engine's call proceeds as if it were not there.

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
from stepscale_engine.vllm_compat import missing_internals, vllm_version

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


# Set once an install attempt fails unexpectedly: no engine in this process
# tries again (each would fail the same way), and the warning is logged once.
_install_broken = False


def register() -> None:
    """Entry point: enable FPM publishing if configured; never raises."""
    try:
        _register()
    except Exception as exc:  # noqa: BLE001 - a plugin must not stop vLLM from starting
        log.warning(
            "Stepscale FPM disabled: unexpected error with vLLM %s: %r", vllm_version(), exc
        )


def _register() -> None:
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
            vllm_version(),
            exc,
        )
        return
    missing = missing_internals()
    if missing:
        log.warning(
            "Stepscale FPM disabled: vLLM %s lacks internals the plugin reads: %s",
            vllm_version(),
            ", ".join(missing),
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
            vllm_version(),
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
        if _HOOK_ATTR not in self.__dict__:  # every step passes here: keep it one lookup
            _ensure_hook(self, config)
        return method(self, *args, **kwargs)  # outside the guard: the engine's own errors

    return wrapper


def _installing_init(init: Callable[..., Any], config: PluginConfig) -> Callable[..., Any]:
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Subclasses call this through super(): install once, after the base is built.
        _ensure_hook(self, config, only_if_built=True)

    return wrapper


def _ensure_hook(engine_core: Any, config: PluginConfig, only_if_built: bool = False) -> None:
    """Install the hook on ``engine_core`` unless done or tried; never raises."""
    global _install_broken
    if _install_broken:
        return
    try:
        if _HOOK_ATTR in engine_core.__dict__:
            return
        if only_if_built and not hasattr(engine_core, "scheduler"):
            return
        install_hook(engine_core, config)
    except Exception as exc:  # noqa: BLE001 - never break the engine's own call
        _install_broken = True
        log.warning(
            "Stepscale FPM disabled: installing on vLLM %s failed: %r", vllm_version(), exc
        )


def install_hook(engine_core: Any, config: PluginConfig) -> Any:
    """Install an :class:`EngineHook` on one engine; returns it, or None if disabled.

    Never raises: anything unexpected (vLLM internals that differ, a port in
    use) logs one warning and leaves the engine untouched.
    """
    # Mark first: a failure below must not be retried on every step.
    engine_core.__dict__[_HOOK_ATTR] = None
    try:
        hook = _build_hook(engine_core, config)
    except OSError as exc:
        log.warning("Stepscale FPM disabled: %s", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - drift or a bug: disable, never crash
        log.warning(
            "Stepscale FPM disabled: vLLM %s internals differ from what the plugin needs: %r",
            vllm_version(),
            exc,
        )
        return None
    engine_core.__dict__[_HOOK_ATTR] = hook
    log.info(
        "Stepscale FPM publishing on %s (worker_id=%s, dp_rank=%d, timing_scope=%s)",
        hook.publisher.endpoint,
        config.worker_id,
        hook.publisher.dp_rank,
        hook.timer.scope,
    )
    return hook


def _build_hook(engine_core: Any, config: PluginConfig) -> Any:
    """Create, wire and start the hook of one engine; on any failure undo and raise."""
    from stepscale_engine.engine_hook import EngineHook
    from stepscale_engine.pass_timer import choose_pass_timer

    scheduler = getattr(engine_core, "scheduler", None)
    executor = getattr(engine_core, "model_executor", None)
    vllm_config = getattr(engine_core, "vllm_config", None)
    dp_rank = data_parallel_rank(vllm_config)
    publisher = FpmPublisher(
        config.endpoint(dp_rank),
        config.worker_id,
        dp_rank,
        queue_capacity=config.queue_capacity,
        heartbeat_interval_s=config.heartbeat_interval_s,
    )
    hook = EngineHook(scheduler, executor, publisher, choose_pass_timer(executor, vllm_config))
    try:
        publisher.start()
        atexit.register(publisher.close)
    except BaseException:
        hook.uninstall()  # restore the engine's methods and queues, stop the publisher
        raise
    return hook
