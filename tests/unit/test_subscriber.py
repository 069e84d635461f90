"""FpmSubscriber over real ZMQ sockets on 127.0.0.1: interop payloads, hostile frames, endpoints.

Every test runs twice: with the native batched receive and column decoder
(``stepscale_operator.fpm_native``), and with the pure-Python path the subscriber
falls back to where the extension is not built; both must behave the same.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_operator import fpm_native
from stepscale_operator.fpm_pipeline import MessageBatch, PassMatrices
from stepscale_operator.subscriber import FpmSubscriber
from tests.unit.native_paths import use_receive_path

# The fixture's monkeypatch holds for a whole hypothesis test, which is what we want.
FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@pytest.fixture(params=["native", "pure-python"], autouse=True)
def receive_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the native receive/decode, then on the pure-Python one."""
    use_receive_path(request.param, monkeypatch)
    return str(request.param)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def xpub(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A publisher that can tell when the subscriber is connected (raw frames)."""
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def connect(sub: FpmSubscriber, pub: zmq.Socket, endpoint: str) -> None:
    sub.add_endpoint(endpoint)
    sub.poll_batch(0.0)  # applies the connect on this thread
    assert pub.poll(5000), "subscription never arrived"
    pub.recv()


def collect(sub: FpmSubscriber, want: int, timeout_s: float = 5.0) -> list[wire.ForwardPassMetrics]:
    got: list[wire.ForwardPassMetrics] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sub.stats.received < want:
        got.extend(sub.poll_batch(0.1))
    got.extend(sub.poll_batch(0.05))
    return got


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or the deadline passes; its final value."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def payload_dict(counter: int, **extra: object) -> dict[str, object]:
    return {
        "version": 1,
        "worker_id": "dyn",
        "dp_rank": 0,
        "counter_id": counter,
        "wall_time": 0.02,
        "scheduled_requests": {"num_decode_requests": 3, "sum_decode_kv_tokens": 300},
        "queued_requests": {},
        **extra,
    }


def frames_of(d: dict[str, object], seq: int | None = None) -> list[bytes]:
    counter = d["counter_id"]
    assert isinstance(counter, int)
    return [b"", wire.encode_sequence(counter if seq is None else seq), msgspec.msgpack.encode(d)]


def test_interop_payloads_dynamo_vllm_pr_and_unknown_keys(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        pub.send_multipart(frames_of(payload_dict(0)))  # Dynamo/SGLang: no timing_scope
        pub.send_multipart(frames_of(payload_dict(1, timing_scope="model_step_cuda")))
        pub.send_multipart(frames_of(payload_dict(2, future_field=[1, 2], another={"x": 1})))
        minimal = {"worker_id": "dyn", "counter_id": 3}  # missing keys take defaults
        pub.send_multipart([b"", wire.encode_sequence(3), msgspec.msgpack.encode(minimal)])
        got = collect(sub, 4)
    assert [m.counter_id for m in got] == [0, 1, 2, 3]
    assert got[1].timing_scope == "model_step_cuda"
    assert got[0].scheduled_requests.num_decode_requests == 3
    assert got[3].is_heartbeat
    assert sub.stats.rejected == {}
    state = sub.streams.get(("dyn", 0))
    assert state is not None and state.messages == 4 and state.lost == 0
    pub.close(0)


def test_the_wire_modules_leniency_holds_through_the_subscriber(ctx: zmq.Context) -> None:
    # What the wire module accepts, the subscriber passes on as the wire module
    # reads it: a nil timing_scope (unset) and a variance negative only by rounding
    # (set to 0), on the batch path as well as alone.
    rounding = {
        "num_decode_requests": 3,
        "sum_decode_kv_tokens": 300,
        "var_decode_kv_tokens": -1e-9,
    }
    pub, ep = xpub(ctx)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        pub.send_multipart(frames_of(payload_dict(0, timing_scope=None)))
        pub.send_multipart(frames_of(payload_dict(1, scheduled_requests=rounding)))
        pub.send_multipart(frames_of(payload_dict(2)))
        got = collect(sub, 3)
    assert [m.counter_id for m in got] == [0, 1, 2]
    assert sub.stats.rejected == {}
    assert got[0].timing_scope is msgspec.UNSET
    assert got[1].scheduled_requests.var_decode_kv_tokens == 0.0
    pub.close(0)


def test_hostile_frames_are_counted_never_raised(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    good = payload_dict(0)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        hostile = [
            [b"", wire.encode_sequence(0), b"\xc1 not msgpack"],
            [b"", b"short", msgspec.msgpack.encode(good)],
            [b"", wire.encode_sequence(0), msgspec.msgpack.encode([1, 2, 3])],
            [b"", wire.encode_sequence(0), msgspec.msgpack.encode(payload_dict(0, version=2))],
            [b"", wire.encode_sequence(0), msgspec.msgpack.encode(payload_dict(0, wall_time=-1.0))],
            [b"", wire.encode_sequence(0), msgspec.msgpack.encode(payload_dict(0, dp_rank=-3))],
            [b"", wire.encode_sequence(0), msgspec.msgpack.encode(payload_dict(0, worker_id=7))],
            [b"", wire.encode_sequence(0), b"\x00" * (wire.MAX_PAYLOAD_BYTES + 1)],
            [
                b"",
                wire.encode_sequence(0),
                msgspec.msgpack.encode(
                    payload_dict(0, scheduled_requests={"var_prefill_length": float("nan")})
                ),
            ],
        ]
        pub.send_multipart(frames_of(payload_dict(1)))  # the stream is known before the junk
        got = collect(sub, 1)
        for frames in hostile:
            pub.send_multipart(frames)
        # The spec numbers a stream by counter_id: a different sequence frame is counted,
        # not rejected (stepscale_engine.wire.decode_frames).
        pub.send_multipart(frames_of(payload_dict(2), seq=99))
        pub.send_multipart(frames_of(payload_dict(3)))
        got += collect(sub, len(hostile) + 3)
    assert [m.counter_id for m in got] == [1, 2, 3]
    assert sub.stats.sequence_mismatches == 1
    assert sub.stats.rejected == {
        "not_msgpack": 1,
        "sequence_length": 1,
        "schema": 2,
        "version": 1,
        "value": 3,
        "payload_too_large": 1,
    }
    assert sub.streams.rejected == sub.stats.rejected
    state = sub.streams.get(("dyn", 0))
    # Identity was readable (the dp_rank=-3 one belongs to another, unknown stream).
    assert state is not None and state.rejected.get("value") == 2
    pub.close(0)


def test_wrong_frame_counts_are_rejected_and_stream_recovers(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        counter = 0
        for bad in ([b""], [b"", wire.encode_sequence(0)], [b"x"], [b"", b"1" * 8, b"p", b"q"]):
            pub.send_multipart(bad)
            pub.send_multipart(frames_of(payload_dict(counter)))
            counter += 1
        for _ in range(5):
            pub.send_multipart(frames_of(payload_dict(counter)))
            counter += 1
        got = collect(sub, 13)
    # Every boundary is checked: nothing is lost but the malformed messages.
    assert [m.counter_id for m in got] == list(range(9))
    assert sub.stats.rejected == {"frame_count": 4}
    assert sub.stats.received == 13
    pub.close(0)


def test_real_publisher_stream_with_background_thread(ctx: zmq.Context) -> None:
    received: list[wire.ForwardPassMetrics] = []
    lock = threading.Lock()

    def sink(batch: list[wire.ForwardPassMetrics]) -> None:
        with lock:
            received.extend(batch)

    with socket.socket() as probe:  # a free port for the publisher to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    pub = FpmPublisher(endpoint, "pod-a", 1, heartbeat_interval_s=0.05, context=ctx)
    with pub, FpmSubscriber(sink, context=ctx) as sub:
        sub.start()
        sub.add_endpoint(pub.endpoint)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not received:
            time.sleep(0.02)  # wait for heartbeats: the connection is up
        sched = wire.ScheduledRequestMetrics(num_decode_requests=4, sum_decode_kv_tokens=40)
        for _ in range(200):
            pub.publish(0.01, sched, wire.QueuedRequestMetrics(), "model_step_host")
        while time.monotonic() < deadline:
            with lock:
                if sum(1 for m in received if not m.is_heartbeat) >= 200:
                    break
            time.sleep(0.02)
        sub.remove_endpoint(pub.endpoint)
        assert wait_until(lambda: pub.endpoint not in sub.endpoints)
    passes = [m for m in received if not m.is_heartbeat]
    assert len(passes) == 200
    assert all(m.worker_id == "pod-a" and m.dp_rank == 1 for m in received)
    state = sub.streams.get(("pod-a", 1))
    assert state is not None and state.passes == 200 and state.heartbeats >= 1


def test_many_endpoints_one_socket_and_bad_endpoint(ctx: zmq.Context) -> None:
    pubs = [xpub(ctx) for _ in range(4)]
    with FpmSubscriber(context=ctx) as sub:
        sub.add_endpoint("tcp://*:not-a-port")  # a bind-style address cannot be connected
        for pub, ep in pubs:
            connect(sub, pub, ep)
        for i, (pub, _) in enumerate(pubs):
            d = payload_dict(0)
            d["worker_id"] = f"pod-{i}"
            pub.send_multipart(frames_of(d))
        got = collect(sub, 4)
        assert sub.stats.endpoint_errors == 1
        assert len(sub.endpoints) == 4
    assert sorted(m.worker_id for m in got) == [f"pod-{i}" for i in range(4)]
    for pub, _ in pubs:
        pub.close(0)


def test_sink_errors_do_not_stop_ingest(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)

    def broken(batch: list[wire.ForwardPassMetrics]) -> None:
        raise RuntimeError("sink bug")

    with FpmSubscriber(broken, context=ctx) as sub:
        connect(sub, pub, ep)
        pub.send_multipart(frames_of(payload_dict(0)))
        deadline = time.monotonic() + 5
        while sub.stats.accepted == 0 and time.monotonic() < deadline:
            sub.run_once(0.1)
    assert sub.stats.sink_errors == 1
    pub.close(0)


def test_deeply_nested_payload_does_not_stop_the_thread(ctx: zmq.Context) -> None:
    """msgspec recurses per nesting level: 1000 levels raise RecursionError inside the
    decoder. That payload is rejected like any malformed one; the next message arrives."""
    received: list[wire.ForwardPassMetrics] = []
    lock = threading.Lock()

    def sink(batch: list[wire.ForwardPassMetrics]) -> None:
        with lock:
            received.extend(batch)

    pub, ep = xpub(ctx)
    nested = b"\x81\xa5other" + b"\x91" * 1000 + b"\xc0"
    with FpmSubscriber(sink, context=ctx) as sub:
        sub.add_endpoint(ep)
        sub.start()
        assert pub.poll(5000), "subscription never arrived"
        pub.recv()
        pub.send_multipart([b"", wire.encode_sequence(0), nested])
        pub.send_multipart(frames_of(payload_dict(1)))
        assert wait_until(lambda: bool(received))
        assert sum(sub.stats.rejected.values()) == 1  # the nested one, as malformed
        assert sub.stats.internal_errors == 0
        pub.send_multipart(frames_of(payload_dict(2)))  # and the thread keeps going
        assert wait_until(lambda: len(received) == 2)
    assert [m.counter_id for m in received] == [1, 2]
    pub.close(0)


def test_removed_endpoint_stops_and_re_adding_resumes(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report the re-added connection's subscription too
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        pub.send_multipart(frames_of(payload_dict(0)))
        assert [m.counter_id for m in collect(sub, 1)] == [0]
        sub.remove_endpoint(ep)
        sub.poll_batch(0.0)  # applies the disconnect on this thread
        assert ep not in sub.endpoints
        # ZMQ discards whatever arrives from a disconnected endpoint.
        for counter in (1, 2):
            pub.send_multipart(frames_of(payload_dict(counter)))
        connect(sub, pub, ep)  # re-adding works: a new subscription arrives
        # The subscription can reach the publisher a moment before ZMQ routes to the
        # new connection, so publish fresh messages until one arrives.
        got: list[wire.ForwardPassMetrics] = []
        counter = 3
        deadline = time.monotonic() + 10.0
        while not got and time.monotonic() < deadline:
            pub.send_multipart(frames_of(payload_dict(counter)))
            counter += 1
            got = collect(sub, sub.stats.received + 1, timeout_s=0.3)
        assert ep in sub.endpoints
    counters = [m.counter_id for m in got]
    assert counters and counters[0] >= 3  # nothing sent while removed arrived
    assert sub.stats.received == 1 + len(got)
    pub.close(0)


def test_ipc_endpoint(ctx: zmq.Context, tmp_path: Path) -> None:
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path / 'fpm.0'}"
    sock.bind(endpoint)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, sock, endpoint)
        for counter in range(3):
            sock.send_multipart(frames_of(payload_dict(counter)))
        got = collect(sub, 3)
        assert sub.endpoints == {endpoint}
    assert [m.counter_id for m in got] == [0, 1, 2]
    sock.close(0)


def test_duplicates_are_counted_and_not_passed_on(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        for counter in (0, 1, 1, 2):  # a replayed message
            pub.send_multipart(frames_of(payload_dict(counter)))
        got = collect(sub, 4)
    assert [m.counter_id for m in got] == [0, 1, 2]
    assert sub.stats.duplicates == 1 and sub.stats.accepted == 3
    state = sub.streams.get(("dyn", 0))
    assert state is not None and state.duplicates == 1 and state.passes == 3
    pub.close(0)


def decode_one(sub: FpmSubscriber, seq: bytes, payload: bytes) -> MessageBatch:
    """The subscriber's decode of one well-framed message."""
    return sub._decode(seq, payload, np.array([len(payload)], dtype=np.uint32))


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(payload=st.binary(max_size=300), seq=st.binary(min_size=8, max_size=8))
def test_fast_path_never_accepts_what_the_wire_module_rejects(payload: bytes, seq: bytes) -> None:
    sub = FpmSubscriber(context=zmq.Context.instance())
    try:
        batch = decode_one(sub, seq, payload)
        try:
            wire.decode_frames([b"", seq, payload])
            wire_accepts = True
        except wire.DecodeError:
            wire_accepts = False
        assert (len(batch) == 1) == wire_accepts
        assert sub.stats.accepted + sum(sub.stats.rejected.values()) == 1
    finally:
        sub.close()


@settings(max_examples=100, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    d=st.fixed_dictionaries(
        {
            "counter_id": st.integers(-5, 2**64 - 1),
            "dp_rank": st.integers(-2, 10),
            "wall_time": st.one_of(st.floats(allow_nan=True), st.integers(-1, 5)),
            "version": st.integers(0, 3),
            "scheduled_requests": st.fixed_dictionaries(
                {"num_decode_requests": st.integers(-3, 10**6), "var_decode_kv_tokens": st.floats()}
            ),
        }
    )
)
def test_fast_path_agrees_with_wire_on_structured_input(d: dict[str, object]) -> None:
    payload = msgspec.msgpack.encode(d)
    counter = d["counter_id"]
    assert isinstance(counter, int)
    seq = wire.encode_sequence(max(0, counter))
    sub = FpmSubscriber(context=zmq.Context.instance())
    try:
        batch = decode_one(sub, seq, payload)
        try:
            expected = wire.decode_frames([b"", seq, payload])
        except wire.DecodeError:
            expected = None
        assert len(batch) == (expected is not None)
        if expected is not None:
            # The same message, and the same numbers in the columns ingest uses.
            assert batch.messages() == [expected]
            want = PassMatrices.from_messages([expected])
            assert np.array_equal(batch.matrices.numeric, want.numeric)
            assert batch.matrices.keys == want.keys
    finally:
        sub.close()


def test_each_run_uses_the_receive_path_it_names(ctx: zmq.Context, receive_path: str) -> None:
    native = receive_path == "native"
    with FpmSubscriber(context=ctx) as sub:
        assert sub.native_receive is native
    assert fpm_native.AVAILABLE is native


def test_oversized_payloads_are_rejected_before_they_are_decoded(ctx: zmq.Context) -> None:
    """A payload over the wire limit is counted without its identity: it was never decoded."""
    pub, ep = xpub(ctx)
    padded = payload_dict(1, timing_scope="x" * (wire.MAX_PAYLOAD_BYTES + 10))
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        pub.send_multipart(frames_of(payload_dict(0)))
        got = collect(sub, 1)
        pub.send_multipart(frames_of(padded))  # valid msgpack naming stream ("dyn", 0)
        pub.send_multipart(frames_of(payload_dict(2)))
        got += collect(sub, 3)
    assert [m.counter_id for m in got] == [0, 2]
    assert sub.stats.rejected == {"payload_too_large": 1}
    state = sub.streams.get(("dyn", 0))
    assert state is not None and state.rejected == {}
    pub.close(0)


def test_huge_frames_never_reach_the_subscriber(ctx: zmq.Context) -> None:
    """Frames far over the limit cost their sender the connection (ZMQ_MAXMSGSIZE): they
    are never buffered, and the publisher's later messages still arrive."""
    pub, ep = xpub(ctx)
    with FpmSubscriber(context=ctx) as sub:
        connect(sub, pub, ep)
        for _ in range(20):
            pub.send_multipart([b"", wire.encode_sequence(0), b"\x00" * (1 << 20)])
        got: list[wire.ForwardPassMetrics] = []
        counter = 0

        def arrived() -> bool:
            nonlocal counter
            if pub.poll(0):
                pub.recv()  # the re-subscription after the reconnect
            pub.send_multipart(frames_of(payload_dict(counter)))
            counter += 1
            got.extend(sub.poll_batch(0.05))
            return bool(got)

        assert wait_until(arrived, 10.0)
    assert sub.stats.received == len(got) + sum(sub.stats.rejected.values())
    assert "payload_too_large" not in sub.stats.rejected  # not received at all
    assert sub.stats.reconnects >= 1  # ZMQ dropped the connection; the subscriber re-made it
    pub.close(0)


def test_one_receive_holds_a_bounded_number_of_payload_bytes(ctx: zmq.Context) -> None:
    pub, ep = xpub(ctx)
    size = len(frames_of(payload_dict(0))[2])
    with FpmSubscriber(context=ctx, max_batch_bytes=5 * size) as sub:
        connect(sub, pub, ep)
        for i in range(40):
            pub.send_multipart(frames_of(payload_dict(i)))
        assert wait_until(lambda: sub._sub.poll(0) != 0)
        time.sleep(0.2)  # let the 40 messages land in the socket's queue
        sizes = []
        while sum(sizes) < 40:
            batch = sub.poll_batch(1.0)
            assert len(batch) > 0
            sizes.append(len(batch))
    assert max(sizes) <= 5
    pub.close(0)


def test_receives_gather_for_coalesce_s_at_low_rates_and_fewer_messages_at_high_rates(
    ctx: zmq.Context,
) -> None:
    now = [100.0]
    sub = FpmSubscriber(context=ctx, coalesce_s=0.5, coalesce_messages=200, clock=lambda: now[0])
    try:
        assert sub._coalesce_wait(0) == 0.5  # nothing yet: the longest wait
        now[0] += 0.5
        # 100 msg/s: 200 messages take 2 s to arrive, so the whole 0.5 s.
        assert sub._coalesce_wait(50) == 0.5
        now[0] += 0.5
        # 8,000 msg/s: wait only as long as 200 take (what waits in ZMQ costs memory).
        assert sub._coalesce_wait(4000) == pytest.approx(0.025)
    finally:
        sub.close()
