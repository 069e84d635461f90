"""Pods of a deployment -> FPM endpoints and stream keys (pure).

A pod contributes one stream per data-parallel rank, ``(pod name, rank)`` (the
plugin's worker id is the pod name, from the downward API), published on
``tcp://{podIP}:{basePort + rank}``. A pod is subscribed to only while it is
Ready, has an IP and is not being deleted; otherwise it is "starting" (counted
by the planner as capacity on its way) or gone.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stepscale_operator.stream_state import StreamKey


@dataclass(frozen=True)
class PodView:
    """What the controller needs to know about one pod."""

    name: str
    ip: str | None
    ready: bool
    terminating: bool
    created_at: float | None  # wall-clock seconds (creationTimestamp)

    @property
    def serving(self) -> bool:
        """True when the pod should be subscribed to."""
        return self.ready and bool(self.ip) and not self.terminating

    @property
    def starting(self) -> bool:
        """True when the pod exists, is not terminating and is not Ready yet."""
        return not self.terminating and not self.serving


def parse_timestamp(text: object) -> float | None:
    """Seconds since the epoch of an RFC 3339 timestamp, or None."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A :class:`PodView` of a pod object (missing fields read as "not ready")."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )
    ip = status.get("podIP")
    return PodView(
        name=str(meta.get("name", "")),
        ip=ip if isinstance(ip, str) and ip else None,
        ready=ready and status.get("phase", "Running") == "Running",
        terminating=bool(meta.get("deletionTimestamp")),
        created_at=parse_timestamp(meta.get("creationTimestamp")),
    )


def format_host(ip: str) -> str:
    """An IP as a ZMQ tcp host (IPv6 in brackets)."""
    return f"[{ip}]" if ":" in ip else ip


def pod_streams(pod: PodView, base_port: int, data_parallel_size: int) -> dict[str, StreamKey]:
    """Endpoint -> stream key of every rank of a serving pod; empty when not serving."""
    if not pod.serving or pod.ip is None:
        return {}
    host = format_host(pod.ip)
    return {
        f"tcp://{host}:{base_port + rank}": (pod.name, rank) for rank in range(data_parallel_size)
    }


@dataclass(frozen=True)
class StreamChanges:
    """Endpoints to connect to and to drop, with their stream keys."""

    added: dict[str, StreamKey]
    removed: dict[str, StreamKey]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class PodDirectory:
    """The pods of one deployment and the streams they publish.

    Feed it every pod event (:meth:`observe`, :meth:`forget`); it answers which
    endpoints to subscribe to or drop. Changing the FPM base port or the
    data-parallel size (:meth:`reconfigure`) recomputes every pod's streams.
    """

    def __init__(self, base_port: int, data_parallel_size: int) -> None:
        self.base_port = base_port
        self.data_parallel_size = data_parallel_size
        self._pods: dict[str, PodView] = {}
        self._streams: dict[str, dict[str, StreamKey]] = {}  # pod -> endpoint -> key

    @property
    def pods(self) -> dict[str, PodView]:
        """Known pods by name."""
        return dict(self._pods)

    @property
    def endpoints(self) -> dict[str, StreamKey]:
        """Every endpoint subscribed to, with its stream key."""
        return {ep: key for streams in self._streams.values() for ep, key in streams.items()}

    def observe(self, pod: PodView) -> StreamChanges:
        """A pod was added or changed."""
        self._pods[pod.name] = pod
        return self._resync(pod.name)

    def forget(self, pod_name: str) -> StreamChanges:
        """A pod was deleted."""
        self._pods.pop(pod_name, None)
        return self._resync(pod_name)

    def reconfigure(self, base_port: int, data_parallel_size: int) -> StreamChanges:
        """New FPM base port or data-parallel size: recompute every pod's endpoints."""
        self.base_port = base_port
        self.data_parallel_size = data_parallel_size
        added: dict[str, StreamKey] = {}
        removed: dict[str, StreamKey] = {}
        for name in set(self._pods) | set(self._streams):
            changes = self._resync(name)
            added.update(changes.added)
            removed.update(changes.removed)
        return StreamChanges(added, removed)

    def ready_count(self) -> int:
        """Pods serving now."""
        return sum(1 for p in self._pods.values() if p.serving)

    def starting_since(self) -> list[float | None]:
        """Creation times of pods that exist but are not Ready yet."""
        return [p.created_at for p in self._pods.values() if p.starting]

    def _resync(self, pod_name: str) -> StreamChanges:
        old = self._streams.get(pod_name, {})
        pod = self._pods.get(pod_name)
        new = pod_streams(pod, self.base_port, self.data_parallel_size) if pod else {}
        if new:
            self._streams[pod_name] = new
        else:
            self._streams.pop(pod_name, None)
        added = {ep: k for ep, k in new.items() if old.get(ep) != k}
        removed = {ep: k for ep, k in old.items() if new.get(ep) != k}
        return StreamChanges(added, removed)
