"""Pods of a deployment -> FPM endpoints and stream keys (pure).

A pod contributes one stream per data-parallel rank, ``(pod name, rank)`` (the
plugin's worker id is the pod name, from the downward API), published on
``tcp://{podIP}:{basePort + rank}``. A pod is subscribed to only while it is
Ready, has an IP and is not being deleted; otherwise it is "starting" (counted
by the planner as capacity on its way) or gone.
"""

from __future__ import annotations

import datetime
from collections import OrderedDict
from collections.abc import Iterable, Mapping
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

    @staticmethod
    def merge(changes: Iterable[StreamChanges]) -> StreamChanges:
        """The changes of several steps as one (an endpoint dropped then re-added counts once)."""
        added: dict[str, StreamKey] = {}
        removed: dict[str, StreamKey] = {}
        for change in changes:
            for ep, key in change.removed.items():
                if added.pop(ep, None) != key:
                    removed[ep] = key
            for ep, key in change.added.items():
                if removed.get(ep) == key:
                    del removed[ep]
                else:
                    added[ep] = key
        return StreamChanges(added, removed)


class PodDirectory:
    """The pods of one deployment and the streams they publish.

    Feed it every pod event (:meth:`observe`, :meth:`forget`); it answers which
    endpoints to subscribe to or drop. Changing the FPM base port or the
    data-parallel size (:meth:`reconfigure`) recomputes every pod's streams.

    Watches miss deletions: a pod deleted while the watch was down (a re-list
    after an expired resourceVersion, a peering pause) never gets a DELETED
    event. :meth:`resync` reconciles the directory with a full listing; every
    change is numbered (:meth:`mark`), so that a listing taken before an event
    that arrived meanwhile does not undo that event.
    """

    def __init__(self, base_port: int, data_parallel_size: int) -> None:
        self.base_port = base_port
        self.data_parallel_size = data_parallel_size
        self._pods: dict[str, PodView] = {}
        self._streams: dict[str, dict[str, StreamKey]] = {}  # pod -> endpoint -> key
        self._version = 0
        # Pod name -> version of its last observe/forget (forgotten pods stay until a resync).
        self._changed_at: dict[str, int] = {}

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
        self._touch(pod.name)
        return self._resync(pod.name)

    def forget(self, pod_name: str) -> StreamChanges:
        """A pod was deleted."""
        self._pods.pop(pod_name, None)
        self._touch(pod_name)
        return self._resync(pod_name)

    def mark(self) -> int:
        """The version to pass to :meth:`resync` for a listing started now."""
        return self._version

    def resync(self, listed: Iterable[PodView], since: int) -> StreamChanges:
        """Match a full listing started at ``since`` (:meth:`mark`): forget pods it lacks.

        Pods observed or forgotten after ``since`` are left alone: their event is
        newer than the listing. Listed pods not seen since then are (re)observed.
        """
        by_name = {pod.name: pod for pod in listed}
        steps: list[StreamChanges] = []
        for name in list(self._pods):
            if name not in by_name and self._changed_at.get(name, 0) <= since:
                steps.append(self.forget(name))
        for name, pod in by_name.items():
            if self._changed_at.get(name, 0) <= since:
                steps.append(self.observe(pod))
        # Forgotten pods older than this listing need no memory any more.
        for name in [n for n, v in self._changed_at.items() if v <= since and n not in self._pods]:
            del self._changed_at[name]
        return StreamChanges.merge(steps)

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

    def _touch(self, pod_name: str) -> None:
        self._version += 1
        self._changed_at[pod_name] = self._version

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


class PendingPods:
    """Pod bodies seen before their deployment's autoscaler exists, at most ``limit`` in all.

    Pods of an invalid or not yet reconciled ``VllmDeployment`` wait here. Beyond
    the limit the oldest entry goes: the periodic listing (:meth:`PodDirectory.resync`)
    finds it again once the autoscaler runs.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._pods: OrderedDict[tuple[Any, str], dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    def put(self, owner: Any, pod_name: str, body: Mapping[str, Any]) -> None:
        """Remember (or update) a pod of ``owner``."""
        self._pods.pop((owner, pod_name), None)
        self._pods[(owner, pod_name)] = dict(body)
        while len(self._pods) > self.limit:
            self._pods.popitem(last=False)

    def discard(self, owner: Any, pod_name: str) -> None:
        """A pod of ``owner`` was deleted."""
        self._pods.pop((owner, pod_name), None)

    def pop_owner(self, owner: Any) -> list[dict[str, Any]]:
        """Take every pod of ``owner``, oldest first."""
        keys = [k for k in self._pods if k[0] == owner]
        return [self._pods.pop(k) for k in keys]
