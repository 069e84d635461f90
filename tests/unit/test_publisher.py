"""FpmPublisher over real ZMQ sockets on loopback."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_engine.wire import QueuedRequestMetrics, ScheduledRequestMetrics

SCHED = ScheduledRequestMetrics(num_decode_requests=3, sum_decode_kv_tokens=300)
QUEUED = QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=50)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[wire.ForwardPassMetrics]:
    out: list[wire.ForwardPassMetrics] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count and time.monotonic() < deadline:
        if sock.poll(100):
            out.append(wire.decode_frames(sock.recv_multipart()))
    return out


def wait_for_heartbeat(sock: zmq.Socket) -> wire.ForwardPassMetrics:
    """The subscription is live once a heartbeat arrives (ZMQ's slow-joiner window is over)."""
    (first,) = receive(sock, 1)
    assert first.is_heartbeat
    return first


def test_messages_carry_identity_and_consecutive_sequence(
    context: zmq.Context, tcp_port: int
) -> None:
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "pod-x", dp_rank=2,
                       heartbeat_interval_s=0.1, context=context)
    sub = subscribe(context, f"tcp://127.0.0.1:{tcp_port}")
    with pub:
        hb = wait_for_heartbeat(sub)
        for i in range(50):
            assert pub.publish(0.001 * (i + 1), SCHED, QUEUED, "model_step_host")
        msgs = [m for m in receive(sub, 200, timeout_s=3.0) if not m.is_heartbeat][:50]
    sub.close()
    assert len(msgs) == 50
    assert all(m.worker_id == "pod-x" and m.dp_rank == 2 for m in msgs)
    assert [m.wall_time for m in msgs] == pytest.approx([0.001 * (i + 1) for i in range(50)])
    assert msgs[0].scheduled_requests == SCHED and msgs[0].queued_requests == QUEUED
    assert msgs[0].timing_scope == "model_step_host"
    # Heartbeats and passes share one sequence with no holes.
    assert msgs[0].counter_id > hb.counter_id
    assert [m.counter_id for m in msgs] == list(range(msgs[0].counter_id, msgs[0].counter_id + 50))


def test_heartbeats_flow_while_idle_and_use_the_sequence(
    context: zmq.Context, tcp_port: int
) -> None:
    with FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", heartbeat_interval_s=0.05,
                      context=context) as pub:
        sub = subscribe(context, f"tcp://127.0.0.1:{tcp_port}")
        beats = receive(sub, 5)
        sub.close()
    assert len(beats) == 5
    assert all(b.is_heartbeat and b.worker_id == "w" for b in beats)
    counters = [b.counter_id for b in beats]
    assert counters == list(range(counters[0], counters[0] + 5))
    assert pub.stats.heartbeats >= 5


def test_full_queue_drops_counts_and_leaves_a_gap_of_exactly_the_drops(
    context: zmq.Context, tcp_port: int
) -> None:
    # No heartbeats during the test, so every sequence number is accounted for.
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", queue_capacity=10,
                       heartbeat_interval_s=3600.0, context=context)
    # Before start() nothing drains the queue: the 11th to 15th are dropped.
    results = [pub.publish(0.01, SCHED, QUEUED) for _ in range(15)]
    assert results == [True] * 10 + [False] * 5
    assert pub.stats.dropped_queue_full == 5
    sub = subscribe(context, f"tcp://127.0.0.1:{tcp_port}")
    with pub:
        # Numbered probes until one arrives (the subscription may not be live yet):
        # probe i follows 10 sent and 5 dropped messages and i earlier probes.
        received: list[wire.ForwardPassMetrics] = []
        probe = 0
        while not received and probe < 200:
            pub.publish(1000.0 + probe, SCHED, QUEUED)
            probe += 1
            received = [m for m in receive(sub, 20, timeout_s=0.05) if m.wall_time >= 1000.0]
    sub.close()
    first = received[0]
    assert first.counter_id == 15 + int(first.wall_time - 1000.0)
    assert pub.stats.enqueued == 10 + probe
    assert pub.stats.heartbeats == 0


# Hang guard only: a sender that never stops fails here instead of hanging CI.
HANG_GUARD_S = 120


@pytest.mark.timeout(HANG_GUARD_S)
def test_close_drains_what_is_queued_then_stops(context: zmq.Context, tcp_port: int) -> None:
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", heartbeat_interval_s=0.05,
                       context=context).start()
    sub = subscribe(context, f"tcp://127.0.0.1:{tcp_port}")
    wait_for_heartbeat(sub)
    for _ in range(500):
        pub.publish(0.01, SCHED, QUEUED)
    thread = pub._thread
    assert thread is not None
    pub.close(timeout_s=None)  # wait for the sender however long it takes
    assert not thread.is_alive()
    assert pub.stats.sent - pub.stats.heartbeats == 500  # drained before stopping
    passes = [m for m in receive(sub, 600, timeout_s=10.0) if not m.is_heartbeat]
    sub.close()
    assert len(passes) == 500


@pytest.mark.timeout(HANG_GUARD_S)
def test_close_without_waiting_returns_and_the_sender_still_stops(
    context: zmq.Context, tcp_port: int
) -> None:
    # What a self-disabling hook does on the engine thread: signal, never wait.
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", context=context).start()
    thread = pub._thread
    assert thread is not None
    pub.close(timeout_s=0.0)
    thread.join()
    assert pub._thread is None
    pub.close()  # closing again is harmless


@pytest.mark.timeout(HANG_GUARD_S)
def test_a_message_that_fails_to_encode_is_counted_and_the_sender_keeps_going(
    context: zmq.Context, tcp_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_encode = wire.encode_frames

    def encode_frames(msg: wire.ForwardPassMetrics) -> list[bytes]:
        if msg.wall_time == 666.0:
            raise struct.error("argument out of range")  # what a bad counter would raise
        return real_encode(msg)

    monkeypatch.setattr(wire, "encode_frames", encode_frames)
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", heartbeat_interval_s=0.05,
                       context=context).start()
    sub = subscribe(context, f"tcp://127.0.0.1:{tcp_port}")
    received = [wait_for_heartbeat(sub)]
    thread = pub._thread
    assert thread is not None
    assert pub.publish(666.0, SCHED, QUEUED)
    assert pub.publish(0.5, SCHED, QUEUED)
    # A dead sender ends the wait at once; a live one that never sends hits the guard.
    while thread.is_alive() and not any(m.wall_time == 0.5 for m in received):
        received += receive(sub, 1)
    assert thread.is_alive()
    assert pub.stats.send_errors == 1
    pub.close(timeout_s=None)
    sub.close()
    assert [m.wall_time for m in received if not m.is_heartbeat] == [0.5]
    # The lost message kept its sequence number: exactly one gap of one.
    counters = [m.counter_id for m in received]
    expected = range(counters[0], counters[-1] + 1)
    assert len(expected) == len(counters) + 1 and set(counters) < set(expected)


def test_binding_a_busy_port_raises_a_clear_error(context: zmq.Context, tcp_port: int) -> None:
    with FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "a", context=context):
        second = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "b", context=context)
        with pytest.raises(OSError, match="cannot bind FPM publisher"):
            second.start()


def test_ipc_endpoint(context: zmq.Context, tmp_path: Path) -> None:
    endpoint = wire.endpoint_for_rank(f"ipc://{tmp_path}/fpm", 1)
    with FpmPublisher(endpoint, "w", dp_rank=1, heartbeat_interval_s=0.05, context=context):
        sub = subscribe(context, endpoint)
        (beat,) = receive(sub, 1)
        sub.close()
    assert beat.dp_rank == 1 and beat.is_heartbeat


@pytest.mark.timeout(HANG_GUARD_S)
def test_publish_without_any_subscriber_never_blocks(context: zmq.Context, tcp_port: int) -> None:
    # PUB with no peer discards; the engine-side call must still succeed every time.
    # No heartbeats during the test, so every send is one of ours.
    pub = FpmPublisher(f"tcp://127.0.0.1:{tcp_port}", "w", queue_capacity=100_000,
                       heartbeat_interval_s=3600.0, context=context).start()
    accepted = sum(pub.publish(0.01, SCHED, QUEUED) for _ in range(20_000))
    pub.close(timeout_s=None)  # the sender drains everything before it stops
    assert accepted == 20_000
    assert pub.stats.sent + pub.stats.send_would_block == 20_000
    assert pub.stats.send_errors == 0
