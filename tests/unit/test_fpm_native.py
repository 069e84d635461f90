"""The native column decoder against msgspec, and the native receive's framing.

The native decoder may only be *faster*: on every payload it must either produce
exactly the columns and key msgspec's decode gives, or mark the row doubtful (so
the wire module decides). Checked on interop forms (key order, missing and
unknown keys, float32, nil scope, every int width), on structured hostile input
and on random bytes. Skipped where the extension is not built (failed under CI).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from stepscale_engine import wire
from stepscale_operator import fpm_native
from stepscale_operator.fpm_pipeline import PassMatrices
from stepscale_operator.pass_columns import N_NUMERIC
from tests.unit.native_paths import use_receive_path


@pytest.fixture(autouse=True)
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    use_receive_path("native", monkeypatch)


def pack(payloads: list[bytes]) -> tuple[bytes, np.ndarray]:
    ends = np.cumsum([len(p) for p in payloads], dtype=np.uint64).astype(np.uint32)
    return b"".join(payloads), ends


_typed = msgspec.msgpack.Decoder(wire.ForwardPassMetrics)


def reference(payload: bytes) -> wire.ForwardPassMetrics | None:
    """msgspec's typed decode, with the wire module's one leniency of shape
    (``timing_scope: nil`` reads as unset); None where neither decodes it."""
    if len(payload) > wire.MAX_PAYLOAD_BYTES:
        return None
    try:
        return _typed.decode(payload)
    except Exception:  # noqa: BLE001 - any failure: try the leniency, else None
        pass
    try:
        raw = msgspec.msgpack.decode(payload)
        if isinstance(raw, dict) and "timing_scope" in raw and raw["timing_scope"] is None:
            del raw["timing_scope"]
            return _typed.decode(msgspec.msgpack.encode(raw))
    except Exception:  # noqa: BLE001
        pass
    return None


def assert_agrees(payloads: list[bytes]) -> np.ndarray:
    """Native vs the reference decode on every payload; returns the doubtful mask."""
    blob, ends = pack(payloads)
    numeric, keys, doubtful = fpm_native.decode_columns(blob, ends)
    assert numeric.shape == (len(payloads), N_NUMERIC)
    for i, payload in enumerate(payloads):
        if doubtful[i]:
            assert keys[i] is None
            continue
        # Understood natively: the reference decodes it too, to the same numbers and key.
        msg = reference(payload)
        assert msg is not None, payload
        expected = PassMatrices.from_messages([msg])
        assert [keys[i]] == expected.keys
        np.testing.assert_array_equal(numeric[i], expected.numeric[0])
    return doubtful


def fpm_dict(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "version": 1,
        "worker_id": "pod-a",
        "dp_rank": 1,
        "counter_id": 7,
        "timing_scope": "model_step_cuda",
        "wall_time": 0.0125,
        "scheduled_requests": {
            "num_prefill_requests": 2,
            "sum_prefill_tokens": 900,
            "var_prefill_length": 12.5,
            "sum_prefill_kv_tokens": 64,
            "num_decode_requests": 30,
            "sum_decode_kv_tokens": 40_000,
            "var_decode_kv_tokens": 1e5,
        },
        "queued_requests": {"num_prefill_requests": 3, "sum_prefill_tokens": 4000},
    }
    d.update(over)
    return d


def test_our_encoding_and_interop_forms_decode_natively() -> None:
    ours = wire.encode_payload(
        wire.ForwardPassMetrics(
            worker_id="w",
            dp_rank=2,
            counter_id=10,
            wall_time=0.01,
            scheduled_requests=wire.ScheduledRequestMetrics(num_decode_requests=4),
        )
    )
    reordered = msgspec.msgpack.encode(dict(reversed(list(fpm_dict().items()))))
    minimal = msgspec.msgpack.encode({"worker_id": "sgl", "counter_id": 3})  # defaults
    unknown = msgspec.msgpack.encode(
        fpm_dict(extra={"a": [1, 2.5, None, True, b"x", "s"]}, more=[[{}]] * 3)
    )
    nil_scope = msgspec.msgpack.encode(fpm_dict(timing_scope=None))
    # float32 wall time and every unsigned/signed int width, hand-packed.
    f32 = (
        b"\x83"
        + b"\xa9worker_id\xa1w"
        + b"\xaacounter_id\xcf"
        + struct.pack(">Q", 5)
        + b"\xa9wall_time\xca"
        + struct.pack(">f", 0.25)
    )
    widths = (
        b"\x82\xaacounter_id\xd3"
        + struct.pack(">q", 9)
        + b"\xb2scheduled_requests\x82\xb3num_decode_requests\xcd\x01\x00"
        + b"\xb4sum_decode_kv_tokens\xce\x00\x01\x00\x00"
    )
    payloads = [ours, reordered, minimal, unknown, nil_scope, f32, widths]
    doubtful = assert_agrees(payloads)
    # nil scope is the one msgspec's typed decode refuses (the wire module reads it
    # as unset): natively it is understood, and the columns equal the wire's decode.
    assert not doubtful.any()
    blob, ends = pack([nil_scope])
    numeric, keys, _ = fpm_native.decode_columns(blob, ends)
    expected = PassMatrices.from_messages([wire.decode_payload(nil_scope)])
    np.testing.assert_array_equal(numeric, expected.numeric)
    assert keys == expected.keys


def test_what_the_native_reader_leaves_to_the_wire_module() -> None:
    enc = msgspec.msgpack.encode
    payloads = [
        enc([1, 2, 3]),  # not a map
        enc(fpm_dict(worker_id=5)),  # wrong type
        enc(fpm_dict(dp_rank=True)),  # bool is not an int for msgspec
        enc(fpm_dict(scheduled_requests=None)),
        enc(fpm_dict()) + b"\x00",  # trailing bytes
        enc(fpm_dict())[:-3],  # truncated
        b"\x81\xa7version\x01",  # fine; the next one repeats a key
        b"\x82\xa7version\x01\xa7version\x01",
        b"\x81\x01\x02",  # non-string key
        b"\x81\xa5extra\xc7\x01\x05x",  # ext type under an unknown key
        b"\x81\xa9worker_id\xa2\xff\xfe",  # invalid UTF-8
        b"\x81\xa5extra" + b"\x91" * 40 + b"\x00",  # nested deeper than 32
        b"\x00" * (wire.MAX_PAYLOAD_BYTES + 1),
    ]
    doubtful = assert_agrees(payloads)
    assert doubtful.tolist() == [True] * 6 + [False] + [True] * 6


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_decode_differently(payload: bytes) -> None:
    assert_agrees([payload, msgspec.msgpack.encode(fpm_dict()), payload])


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(width=32),
    st.text(max_size=5),
    st.binary(max_size=4),
)
field_names = st.sampled_from(
    [
        "version",
        "worker_id",
        "dp_rank",
        "counter_id",
        "timing_scope",
        "wall_time",
        "num_decode_requests",
        "var_prefill_length",
        "other",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    top=st.dictionaries(field_names, scalars, max_size=6),
    sched=st.one_of(st.none(), st.dictionaries(field_names, scalars, max_size=4)),
    f32=st.booleans(),
)
def test_structured_hostile_maps_never_decode_differently(
    top: dict[str, Any], sched: dict[str, Any] | None, f32: bool
) -> None:
    if sched is not None:
        top["scheduled_requests"] = sched
    payload = msgspec.msgpack.encode(top)
    assert_agrees([payload])


def connected_pair() -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """A raw XPUB and a SUB connected to it (the subscription has arrived)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    assert pub.poll(5000)
    pub.recv()
    return ctx, pub, sub


def test_drain_checks_every_frame_boundary() -> None:
    ctx, pub, sub = connected_pair()
    good = [b"", wire.encode_sequence(1), b"\x80"]
    sent = [good, [b"only"], [b"", b"short", b"\x80"], good, [b"", b"12345678", b"a", b"b"], good]
    for frames in sent:
        pub.send_multipart(frames)
    got: list[fpm_native.DrainedMessages] = []
    while sum(d.received for d in got) < len(sent):
        assert sub.poll(5000)
        got.append(fpm_native.drain(sub, 100))
    assert sum(d.received for d in got) == 6
    assert b"".join(d.payloads for d in got) == b"\x80" * 3
    assert b"".join(d.sequences for d in got) == wire.encode_sequence(1) * 3
    rejects = [r for d in got for r in d.rejects]
    assert rejects == [
        (fpm_native.REJECT_FRAME_COUNT, 0, b""),
        (fpm_native.REJECT_SEQUENCE_LENGTH, 5, b"\x80"),
        (fpm_native.REJECT_FRAME_COUNT, 0, b""),
    ]
    # An empty queue gives an empty batch, not an error.
    empty = fpm_native.drain(sub, 100)
    assert (empty.received, empty.payloads, len(empty.ends)) == (0, b"", 0)
    sub.close(0)
    pub.close(0)
    ctx.term()


def test_drain_rejects_oversized_payloads_uncopied_and_keeps_to_its_byte_budget() -> None:
    ctx, pub, sub = connected_pair()
    big = wire.MAX_PAYLOAD_BYTES + 1
    pub.send_multipart([b"", wire.encode_sequence(0), b"\x81" * big])
    for i in range(10):
        pub.send_multipart([b"", wire.encode_sequence(i), b"p" * 1000])
    got: list[fpm_native.DrainedMessages] = []
    while sum(d.received for d in got) < 11:
        assert sub.poll(5000)
        got.append(fpm_native.drain(sub, 100, max_bytes=2500))
    assert got[0].rejects == [(fpm_native.REJECT_PAYLOAD_TOO_LARGE, big, b"")]
    # Each drain stops at the message that reaches its budget.
    assert all(len(d.payloads) <= 3000 for d in got)
    assert b"".join(d.payloads for d in got) == b"p" * 10_000
    sub.close(0)
    pub.close(0)
    ctx.term()
