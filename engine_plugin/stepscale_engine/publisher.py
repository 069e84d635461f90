"""FpmPublisher: sends ForwardPassMetrics over ZMQ PUB without ever blocking the engine.

The engine thread only appends a finished record to a bounded deque (drop and
count when full). A background thread owns the socket: it assigns sequence
numbers, encodes, sends non-blocking, and emits a heartbeat after
``heartbeat_interval_s`` without a message.

Sequence numbers are assigned on the sender thread alone, so heartbeats and
passes can never be numbered out of order. Messages the engine dropped because
the queue was full still consume sequence numbers: a subscriber sees exactly
those losses as a gap.

A message that cannot be encoded or sent (whatever the exception) is counted
in ``send_errors`` and logged at a limited rate; the sender keeps running, so
one bad record never ends the stream.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from msgspec import UNSET, UnsetType

from stepscale_engine import wire
from stepscale_engine.rate_limited_log import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_QUEUE_CAPACITY = 10_000
# While passes are flowing the sender drains the queue at this interval (adds at
# most this much delivery latency, far below any scaling decision period); after
# IDLE_AFTER_S without a pass it sleeps until woken. Each drain is a thread
# wake-up, and on CPU engines, whose OpenMP threads are pinned to every core, a
# wake-up preempts the model's compute: the real vLLM CPU engine lost 10-20% of
# its throughput with a 2-25 ms poll, 2-5% at 50-100 ms, and at 250 ms (4 wake-ups
# a second) as little as with no wake-ups at all: on/off median ratio 0.997
# (benchmarks/bench_engine_overhead.py). The operator decides once a second.
BUSY_POLL_S = 0.25
IDLE_AFTER_S = 0.6
CLOSE_LINGER_MS = 500


@dataclass
class PublisherStats:
    """Counters of one publisher; read from any thread (values are plain ints)."""

    enqueued: int = 0
    dropped_queue_full: int = 0
    sent: int = 0
    heartbeats: int = 0
    send_would_block: int = 0
    send_errors: int = 0  # any failure to encode or send one message


# What the engine thread hands over: (wall_time, scheduled, queued, timing_scope,
# messages dropped before this one).
_Record = tuple[
    float, wire.ScheduledRequestMetrics, wire.QueuedRequestMetrics, "str | UnsetType", int
]


class FpmPublisher:
    """Publishes one rank's FPM stream on ``endpoint`` (``tcp://*:PORT`` or ``ipc://...``)."""

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        dp_rank: int = 0,
        *,
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        heartbeat_interval_s: float = wire.HEARTBEAT_INTERVAL_S,
        context: zmq.Context | None = None,
    ) -> None:
        if queue_capacity < 1:
            raise ValueError("queue_capacity must be at least 1")
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.stats = PublisherStats()
        self._capacity = queue_capacity
        self._heartbeat_interval_s = heartbeat_interval_s
        self._context = context or zmq.Context.instance()
        self._queue: collections.deque[_Record] = collections.deque()
        self._wake = threading.Event()
        self._sender_idle = True
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._next_counter = 0
        self._drops_accounted = 0
        self._rate_log = RateLimitedLog(log)

    # -- engine thread ---------------------------------------------------------

    def publish(
        self,
        wall_time: float,
        scheduled: wire.ScheduledRequestMetrics,
        queued: wire.QueuedRequestMetrics,
        timing_scope: str | UnsetType = UNSET,
    ) -> bool:
        """Hand one forward pass to the sender; O(1), never blocks. False if dropped."""
        if len(self._queue) >= self._capacity:
            self.stats.dropped_queue_full += 1
            return False
        self._queue.append(
            (wall_time, scheduled, queued, timing_scope, self.stats.dropped_queue_full)
        )
        self.stats.enqueued += 1
        # Waking a thread costs the engine ~8 us; only an idle sender needs it.
        if self._sender_idle:
            self._wake.set()
        return True

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> FpmPublisher:
        """Start the sender thread and bind; raises if the endpoint cannot be bound."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(
            target=self._run, name=f"stepscale-fpm-pub-{self.dp_rank}", daemon=True
        )
        self._thread.start()
        self._bound.wait(timeout=10.0)
        if self._bind_error is not None:
            self._thread.join(timeout=1.0)
            raise OSError(f"cannot bind FPM publisher to {self.endpoint}: {self._bind_error}")
        return self

    def close(self, timeout_s: float | None = 1.0) -> None:
        """Drain what is queued, then close the socket.

        Waits at most ``timeout_s`` for the sender to finish (``None``: until it
        has; ``0``: not at all, the sender finishes on its own).
        """
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout_s)
        self._thread = None

    def __enter__(self) -> FpmPublisher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sender thread ---------------------------------------------------------

    def _run(self) -> None:
        sock = self._context.socket(zmq.PUB)
        try:
            sock.setsockopt(zmq.SNDHWM, self._capacity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            sock.close(linger=0)
            self._bound.set()
            return
        self._bound.set()
        last_send = last_pass = time.monotonic()
        try:
            while True:
                stopping = self._stop.is_set()
                if self._queue:
                    while self._queue:
                        self._guarded(self._send, sock, self._queue.popleft())
                    last_send = last_pass = time.monotonic()
                elif not stopping and time.monotonic() - last_send >= self._heartbeat_interval_s:
                    self._guarded(self._send_heartbeat, sock)
                    last_send = time.monotonic()
                if stopping:
                    break
                self._sleep(last_send, last_pass)
            # The drained messages may still sit in ZMQ's own send buffer: give
            # them a bounded moment to reach the wire instead of discarding them
            # (linger 0 would), keeping the whole close within about a second.
            sock.close(linger=CLOSE_LINGER_MS)
        finally:
            if not sock.closed:
                sock.close(linger=0)

    def _sleep(self, last_send: float, last_pass: float) -> None:
        """Wait for work: poll while the engine is busy, block on the event when idle.

        While passes keep coming the sender polls every ``BUSY_POLL_S`` so the
        engine never pays for waking it; after ``IDLE_AFTER_S`` without a pass it
        blocks until woken or a heartbeat is due. The engine reads
        ``_sender_idle`` after appending and we set it before re-checking the
        queue, so a message is never left waiting for the heartbeat timeout.
        """
        now = time.monotonic()
        if now - last_pass < IDLE_AFTER_S:
            self._stop.wait(BUSY_POLL_S)
            return
        self._sender_idle = True
        if not self._queue:
            self._wake.wait(max(0.0, last_send + self._heartbeat_interval_s - now))
        self._wake.clear()
        self._sender_idle = False

    def _guarded(self, send: Callable[..., object], *args: object) -> None:
        """Run one send; any exception is counted and logged, never ends the thread."""
        try:
            send(*args)
        except Exception as exc:  # noqa: BLE001 - the stream must outlive one bad message
            self.stats.send_errors += 1
            self._rate_log.warning(
                "unexpected", "FPM message on %s not sent: %r", self.endpoint, exc
            )

    def _take_counter(self, dropped: int) -> int:
        # Messages dropped at the queue keep their place in the sequence, so a
        # subscriber sees each loss as a gap exactly where it happened.
        counter = self._next_counter + (dropped - self._drops_accounted)
        self._drops_accounted = dropped
        self._next_counter = counter + 1
        return counter

    def _send(self, sock: zmq.Socket, record: _Record) -> None:
        wall_time, scheduled, queued, timing_scope, dropped_before = record
        msg = wire.ForwardPassMetrics(
            worker_id=self.worker_id,
            dp_rank=self.dp_rank,
            counter_id=self._take_counter(dropped_before),
            timing_scope=timing_scope,
            wall_time=wall_time,
            scheduled_requests=scheduled,
            queued_requests=queued,
        )
        self._send_frames(sock, msg)

    def _send_heartbeat(self, sock: zmq.Socket) -> None:
        counter = self._take_counter(self.stats.dropped_queue_full)
        msg = wire.heartbeat(self.worker_id, self.dp_rank, counter)
        if self._send_frames(sock, msg):
            self.stats.heartbeats += 1

    def _send_frames(self, sock: zmq.Socket, msg: wire.ForwardPassMetrics) -> bool:
        try:
            sock.send_multipart(wire.encode_frames(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.stats.send_would_block += 1
            return False
        except zmq.ZMQError as exc:
            self.stats.send_errors += 1
            self._rate_log.warning("send", "FPM send on %s failed: %s", self.endpoint, exc)
            return False
        self.stats.sent += 1
        return True
