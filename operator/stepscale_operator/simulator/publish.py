"""Publish simulated engines' FPM over real ZMQ sockets (the ``--publish-base-port`` option).

Each simulated pod gets its own :class:`~stepscale_engine.publisher.FpmPublisher`
on ``tcp://127.0.0.1:{base_port + i}``, so an operator can subscribe to hundreds
of simulated pods on one machine. This is the only simulator module that opens
sockets; publishers are created lazily, when a pod first produces metrics.

The publisher numbers messages itself (and sends its own heartbeats in real
time), so the simulated ``counter_id`` is not reused; timing follows the
simulation, not the wall clock, unless the caller paces it.
"""

from __future__ import annotations

from collections.abc import Sequence

from stepscale_engine.publisher import FpmPublisher
from stepscale_engine.wire import ForwardPassMetrics


class SimulatedPodPublishers:
    """One FPM publisher per simulated worker; a callable ``fpm_tap`` for :class:`Fleet`."""

    def __init__(self, base_port: int, host: str = "127.0.0.1") -> None:
        self.base_port = base_port
        self.host = host
        self._publishers: dict[str, FpmPublisher] = {}

    def endpoint_of(self, worker_id: str) -> str:
        """``tcp://host:port`` of a worker named ``sim-{i}``."""
        index = int(worker_id.rsplit("-", 1)[-1])
        return f"tcp://{self.host}:{self.base_port + index}"

    def __call__(self, batch: Sequence[tuple[float, ForwardPassMetrics]]) -> None:
        """Hand every forward pass of a housekeeping tick to its pod's publisher."""
        for _, msg in batch:
            if msg.is_heartbeat:
                continue  # the publisher sends its own heartbeats
            publisher = self._publishers.get(msg.worker_id)
            if publisher is None:
                publisher = FpmPublisher(self.endpoint_of(msg.worker_id), msg.worker_id)
                publisher.start()
                self._publishers[msg.worker_id] = publisher
            publisher.publish(msg.wall_time, msg.scheduled_requests, msg.queued_requests)

    def close(self) -> None:
        """Drain and close every publisher."""
        for publisher in self._publishers.values():
            publisher.close()
        self._publishers.clear()
