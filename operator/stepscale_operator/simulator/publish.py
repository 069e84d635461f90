"""Publish simulated engines' FPM over real ZMQ sockets (the ``--publish-base-port`` option).

Each simulated pod gets its own :class:`~stepscale_engine.publisher.FpmPublisher`
bound at its own loopback address and the *same* port, ``tcp://127.0.0.{i+2}:PORT``
for pod ``sim-{i}`` (all of 127.0.0.0/8 is loopback on Linux). That is the shape
the operator's discovery expects of real pods, ``tcp://{podIP}:{basePort + rank}``,
so an operator or ``stepscale tail`` can treat each simulated pod as a pod with
its own IP. This is the only simulator module that opens sockets.

A pod's publisher is created with its first message (a heartbeat included: an
idle ready pod still shows up) and closed when the simulated replica stops, so
its stream goes stale instead of heartbeating on. The publisher numbers messages
itself and sends its own heartbeats in real time, so the simulated ``counter_id``
and heartbeats are not forwarded; timing follows the simulation, not the wall
clock, unless the caller paces it.
"""

from __future__ import annotations

from collections.abc import Sequence

from stepscale_engine.publisher import FpmPublisher
from stepscale_engine.wire import ForwardPassMetrics

# Pod i gets loopback address number i + 2 (127.0.0.1 stays free for the host).
_FIRST_HOST = 2


def pod_host(index: int) -> str:
    """Loopback address of simulated pod ``index``: 127.0.0.2, 127.0.0.3, ... then 127.0.1.0."""
    n = index + _FIRST_HOST
    if not 0 <= n < 1 << 24:
        raise ValueError(f"pod index {index} has no 127/8 address")
    return f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


class SimulatedPodPublishers:
    """One FPM publisher per simulated pod; the ``fpm_tap`` of a :class:`Fleet`."""

    def __init__(self, base_port: int) -> None:
        self.base_port = base_port
        self._publishers: dict[str, FpmPublisher] = {}
        self._stopped: set[str] = set()

    def endpoint_of(self, worker_id: str) -> str:
        """``tcp://127.x.y.z:PORT`` of a worker named ``sim-{i}`` (data-parallel rank 0)."""
        index = int(worker_id.rsplit("-", 1)[-1])
        return f"tcp://{pod_host(index)}:{self.base_port}"

    @property
    def endpoints(self) -> dict[str, str]:
        """Worker id -> endpoint of every pod publishing now."""
        return {w: p.endpoint for w, p in self._publishers.items()}

    def __call__(self, batch: Sequence[tuple[float, ForwardPassMetrics]]) -> None:
        """Hand every forward pass of a housekeeping tick to its pod's publisher."""
        for _, msg in batch:
            publisher = self._publisher(msg.worker_id)
            if publisher is None or msg.is_heartbeat:
                continue  # the publisher sends its own heartbeats
            publisher.publish(msg.wall_time, msg.scheduled_requests, msg.queued_requests)

    def replica_stopped(self, worker_id: str) -> None:
        """The simulated pod is gone: close its socket so its stream goes stale."""
        self._stopped.add(worker_id)
        publisher = self._publishers.pop(worker_id, None)
        if publisher is not None:
            publisher.close()

    def close(self) -> None:
        """Drain and close every publisher (the simulated fleet is gone)."""
        for worker_id in list(self._publishers):
            self.replica_stopped(worker_id)

    def _publisher(self, worker_id: str) -> FpmPublisher | None:
        if worker_id in self._stopped:
            return None
        publisher = self._publishers.get(worker_id)
        if publisher is None:
            publisher = FpmPublisher(self.endpoint_of(worker_id), worker_id).start()
            self._publishers[worker_id] = publisher
        return publisher
