"""Wire format v1: golden bytes, compatibility with the other implementations, hostile input."""

from __future__ import annotations

import struct

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepscale_engine import wire
from stepscale_engine.wire import (
    DecodeError,
    ForwardPassMetrics,
    FrameError,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)

SCHEDULED = ScheduledRequestMetrics(
    num_prefill_requests=2,
    sum_prefill_tokens=700,
    var_prefill_length=2500.0,
    sum_prefill_kv_tokens=128,
    num_decode_requests=30,
    sum_decode_kv_tokens=24000,
    var_decode_kv_tokens=1.5e4,
)
QUEUED = QueuedRequestMetrics(
    num_prefill_requests=4,
    sum_prefill_tokens=2048,
    var_prefill_length=100.25,
    num_decode_requests=1,
    sum_decode_kv_tokens=900,
    var_decode_kv_tokens=0.0,
)


def sample(**overrides: object) -> ForwardPassMetrics:
    fields: dict[str, object] = dict(
        worker_id="pod-a",
        dp_rank=3,
        counter_id=41,
        wall_time=0.0123,
        scheduled_requests=SCHEDULED,
        queued_requests=QUEUED,
    )
    fields.update(overrides)
    return ForwardPassMetrics(**fields)  # type: ignore[arg-type]


def expected_map(with_scope: str | None = None) -> dict[str, object]:
    """The payload built independently of msgspec, in the field order of the spec."""
    top: dict[str, object] = {"version": 1, "worker_id": "pod-a", "dp_rank": 3, "counter_id": 41}
    if with_scope is not None:
        top["timing_scope"] = with_scope
    top["wall_time"] = 0.0123
    top["scheduled_requests"] = {
        "num_prefill_requests": 2,
        "sum_prefill_tokens": 700,
        "var_prefill_length": 2500.0,
        "sum_prefill_kv_tokens": 128,
        "num_decode_requests": 30,
        "sum_decode_kv_tokens": 24000,
        "var_decode_kv_tokens": 1.5e4,
    }
    top["queued_requests"] = {
        "num_prefill_requests": 4,
        "sum_prefill_tokens": 2048,
        "var_prefill_length": 100.25,
        "num_decode_requests": 1,
        "sum_decode_kv_tokens": 900,
        "var_decode_kv_tokens": 0.0,
    }
    return top


def test_golden_bytes_match_dynamo_and_sglang_layout() -> None:
    # Without a timing scope the payload is the 7-key map Dynamo and SGLang send.
    golden = msgpack.packb(expected_map(), use_bin_type=True)
    assert wire.encode_payload(sample()) == golden


def test_golden_bytes_match_vllm_pr_layout_with_timing_scope() -> None:
    golden = msgpack.packb(expected_map("model_step_cuda"), use_bin_type=True)
    assert wire.encode_payload(sample(timing_scope="model_step_cuda")) == golden


def test_frames_are_empty_topic_big_endian_sequence_and_payload() -> None:
    frames = wire.encode_frames(sample())
    assert frames[0] == b""
    assert frames[1] == struct.pack(">Q", 41)
    assert frames[2] == wire.encode_payload(sample())


@pytest.mark.parametrize("scope", [None, "execute_model_cuda", "model_step_host"])
def test_round_trip(scope: str | None) -> None:
    msg = sample() if scope is None else sample(timing_scope=scope)
    assert wire.decode_frames(wire.encode_frames(msg)) == msg


def test_decodes_payload_with_missing_keys_as_defaults() -> None:
    payload = msgpack.packb({"worker_id": "w", "counter_id": 5, "wall_time": 0.5})
    msg = wire.decode_payload(payload)
    assert msg.version == 1  # a missing version decodes as 1
    assert msg.scheduled_requests == ScheduledRequestMetrics()
    assert msg.queued_requests == QueuedRequestMetrics()
    assert msg.timing_scope is msgspec.UNSET


def test_ignores_unknown_keys_at_every_level() -> None:
    body = expected_map("execute_model_cuda")
    body["future_field"] = [1, 2, 3]
    body["scheduled_requests"]["new_counter"] = 9  # type: ignore[index]
    msg = wire.decode_payload(msgpack.packb(body))
    assert msg == sample(timing_scope="execute_model_cuda")


def test_integer_wall_time_is_accepted_as_float() -> None:
    payload = msgpack.packb({"counter_id": 1, "wall_time": 1})
    assert wire.decode_payload(payload).wall_time == 1.0


def zeros(struct_type: type[msgspec.Struct]) -> dict[str, object]:
    """All fields zero, each with its declared type: 0 for counts, 0.0 for variances."""
    fields = msgspec.structs.fields(struct_type)
    return {field.name: 0.0 if field.type is float else 0 for field in fields}


def test_heartbeat_has_only_identity_and_counter() -> None:
    hb = wire.heartbeat("w", 2, 17)
    assert hb.is_heartbeat
    expected = {
        "version": 1,
        "worker_id": "w",
        "dp_rank": 2,
        "counter_id": 17,
        "wall_time": 0.0,
        "scheduled_requests": zeros(ScheduledRequestMetrics),
        "queued_requests": zeros(QueuedRequestMetrics),
    }
    # Bytes, not values: 0 == 0.0 in Python, but the other implementations'
    # decoders see an int where a float belongs if we encode one.
    assert wire.encode_payload(hb) == msgpack.packb(expected)
    decoded = msgpack.unpackb(wire.encode_payload(hb))
    for part in ("scheduled_requests", "queued_requests"):
        floats = {k for k, v in decoded[part].items() if isinstance(v, float)}
        assert floats == {"var_prefill_length", "var_decode_kv_tokens"}
    assert isinstance(decoded["wall_time"], float)


def good_payload() -> bytes:
    return wire.encode_payload(sample())


SEQ41 = struct.pack(">Q", 41)

MALFORMED_CASES: list[tuple[str, list[bytes], FrameError]] = [
    ("no frames", [], FrameError.FRAME_COUNT),
    ("two frames", [SEQ41, good_payload()], FrameError.FRAME_COUNT),
    ("four frames", [b"", SEQ41, good_payload(), b"x"], FrameError.FRAME_COUNT),
    ("short sequence", [b"", b"\x00\x29", good_payload()], FrameError.SEQUENCE_LENGTH),
    ("long sequence", [b"", b"\x00" * 9, good_payload()], FrameError.SEQUENCE_LENGTH),
    ("garbage", [b"", SEQ41, b"\xc1\xc1\xc1garbage"], FrameError.NOT_MSGPACK),
    ("truncated", [b"", SEQ41, good_payload()[:-7]], FrameError.NOT_MSGPACK),
    ("empty payload", [b"", SEQ41, b""], FrameError.NOT_MSGPACK),
    (
        "huge payload",
        [b"", SEQ41, msgpack.packb({"worker_id": "x" * (wire.MAX_PAYLOAD_BYTES + 1)})],
        FrameError.PAYLOAD_TOO_LARGE,
    ),
    ("array not map", [b"", SEQ41, msgpack.packb([1, "w", 0, 41])], FrameError.SCHEMA),
    ("string payload", [b"", SEQ41, msgpack.packb("hello")], FrameError.SCHEMA),
    (
        "wrong type",
        [b"", SEQ41, msgpack.packb({"counter_id": 41, "dp_rank": "zero"})],
        FrameError.SCHEMA,
    ),
    (
        "float counter",
        [b"", SEQ41, msgpack.packb({"counter_id": 41.5})],
        FrameError.SCHEMA,
    ),
    (
        "nested wrong type",
        [b"", SEQ41, msgpack.packb({"counter_id": 41, "scheduled_requests": [1, 2]})],
        FrameError.SCHEMA,
    ),
    (
        "version 2",
        [b"", SEQ41, msgpack.packb({**expected_map(), "version": 2})],
        FrameError.VERSION,
    ),
    (
        "version 2 with other shape",
        [b"", SEQ41, msgpack.packb({"version": 2, "counter_id": "forty-one"})],
        FrameError.VERSION,
    ),
    (
        "negative tokens",
        [
            b"",
            SEQ41,
            msgpack.packb(
                {
                    "counter_id": 41,
                    "wall_time": 0.1,
                    "scheduled_requests": {"sum_prefill_tokens": -5},
                }
            ),
        ],
        FrameError.VALUE,
    ),
    (
        "nan wall time",
        [b"", SEQ41, msgpack.packb({"counter_id": 41, "wall_time": float("nan")})],
        FrameError.VALUE,
    ),
    (
        "deeply nested unknown value",
        [b"", SEQ41, b"\x81\xa5other" + b"\x91" * 1000 + b"\xc0"],
        FrameError.SCHEMA,
    ),
    (
        "deeply nested maps",
        [b"", SEQ41, b"\x81\xa5other" + b"\x81\xa1k" * 1000 + b"\xc0"],
        FrameError.SCHEMA,
    ),
    (
        "deep nesting inside a known key",
        [b"", SEQ41, b"\x81\xb2scheduled_requests\x81\xa1x" + b"\x91" * 1000 + b"\xc0"],
        FrameError.SCHEMA,
    ),
    (
        "large negative variance",
        [
            b"",
            SEQ41,
            msgpack.packb(
                {
                    "counter_id": 41,
                    "wall_time": 0.1,
                    "queued_requests": {
                        "num_decode_requests": 2,
                        "sum_decode_kv_tokens": 200,
                        "var_decode_kv_tokens": -5.0,
                    },
                }
            ),
        ],
        FrameError.VALUE,
    ),
]


@pytest.mark.parametrize(
    ("frames", "reason"), [c[1:] for c in MALFORMED_CASES], ids=[c[0] for c in MALFORMED_CASES]
)
def test_malformed_input_is_a_decode_error_with_its_reason(
    frames: list[bytes], reason: FrameError
) -> None:
    with pytest.raises(DecodeError) as info:
        wire.decode_frames(frames)
    assert info.value.reason is reason


def test_any_unexpected_decoder_exception_becomes_a_decode_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class BrokenDecoder:
        def decode(self, payload: bytes) -> ForwardPassMetrics:
            raise KeyError("something msgspec never raised before")

    monkeypatch.setattr(wire, "_decoder", BrokenDecoder())
    with pytest.raises(DecodeError) as info:
        wire.decode_frames([b"", SEQ41, good_payload()])
    assert info.value.reason is FrameError.NOT_MSGPACK
    assert "KeyError" in info.value.detail


def test_sequence_differing_from_counter_is_reported_but_accepted() -> None:
    # The spec rejects only wrong frame counts and sequence lengths.
    mismatches: list[tuple[int, int]] = []
    msg = wire.decode_frames(
        [b"", struct.pack(">Q", 40), good_payload()],
        on_sequence_mismatch=lambda sequence, m: mismatches.append((sequence, m.counter_id)),
    )
    assert msg == sample()
    assert mismatches == [(40, 41)]
    # Without a callback it is accepted all the same; a matching one reports nothing.
    assert wire.decode_frames([b"", struct.pack(">Q", 40), good_payload()]) == sample()
    wire.decode_frames(wire.encode_frames(sample()), on_sequence_mismatch=mismatches.append)
    assert mismatches == [(40, 41)]


def test_timing_scope_nil_reads_as_unset() -> None:
    body = {**expected_map(), "timing_scope": None}
    msg = wire.decode_payload(msgpack.packb(body))
    assert msg.timing_scope is msgspec.UNSET
    assert msg == sample()
    # Re-encoded, it is the plain layout again (no nil on our wire).
    assert wire.encode_payload(msg) == msgpack.packb(expected_map())


def test_timing_scope_of_another_type_is_still_a_schema_error() -> None:
    with pytest.raises(DecodeError) as info:
        wire.decode_payload(msgpack.packb({**expected_map(), "timing_scope": 3}))
    assert info.value.reason is FrameError.SCHEMA


@pytest.mark.parametrize(
    ("part", "fields"),
    [
        # E[x^2] - E[x]^2 rounding at the scale of the data: 1e-12 on nothing ...
        ("scheduled_requests", {"var_prefill_length": -1e-12}),
        # ... or a few thousandths on contexts of 100k tokens (mean^2 = 1e10).
        (
            "queued_requests",
            {"num_decode_requests": 3, "sum_decode_kv_tokens": 300_000,
             "var_decode_kv_tokens": -0.004},
        ),
        (
            "scheduled_requests",
            {"num_decode_requests": 2, "sum_decode_kv_tokens": 4000,
             "var_decode_kv_tokens": -1e-9},
        ),
    ],
)
def test_variance_negative_by_rounding_is_accepted_as_zero(
    part: str, fields: dict[str, object]
) -> None:
    body = {**expected_map(), part: fields}
    msg = wire.decode_payload(msgpack.packb(body))
    decoded_part = getattr(msg, part)
    variance_field = next(k for k in fields if k.startswith("var_"))
    assert getattr(decoded_part, variance_field) == 0.0
    assert all(getattr(decoded_part, k) == v for k, v in fields.items() if k != variance_field)


def test_negative_non_variance_float_is_still_rejected() -> None:
    with pytest.raises(DecodeError) as info:
        wire.decode_payload(msgpack.packb({"counter_id": 1, "wall_time": -1e-12}))
    assert info.value.reason is FrameError.VALUE


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(
    body=st.dictionaries(
        st.sampled_from(
            ["version", "worker_id", "dp_rank", "counter_id", "wall_time", "timing_scope"]
            + ["scheduled_requests", "queued_requests", "other"]
        ),
        msgpack_values,
    )
)
def test_random_payloads_decode_or_fail_with_a_reason(body: dict[str, object]) -> None:
    payload = msgpack.packb(body)
    try:
        msg = wire.decode_payload(payload)
    except DecodeError as exc:
        assert isinstance(exc.reason, FrameError)
    else:
        assert msg.version == 1
        assert msg.wall_time >= 0.0


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=600))
def test_random_bytes_never_raise_anything_but_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.decode_frames([b"", struct.pack(">Q", 0), raw + b"\xc1"])


counts = st.integers(min_value=0, max_value=2**31)
variances = st.floats(min_value=0.0, max_value=1e12, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    scheduled=st.builds(
        ScheduledRequestMetrics,
        counts, counts, variances, counts, counts, counts, variances,
    ),
    queued=st.builds(QueuedRequestMetrics, counts, counts, variances, counts, counts, variances),
    counter=st.integers(min_value=0, max_value=2**64 - 1),
    wall=st.floats(min_value=0.0, max_value=1e3, allow_nan=False),
    scope=st.sampled_from([msgspec.UNSET, "model_step_cuda", "model_step_host"]),
)
def test_any_valid_message_round_trips(
    scheduled: ScheduledRequestMetrics,
    queued: QueuedRequestMetrics,
    counter: int,
    wall: float,
    scope: str,
) -> None:
    msg = ForwardPassMetrics(
        worker_id="w",
        counter_id=counter,
        timing_scope=scope,
        wall_time=wall,
        scheduled_requests=scheduled,
        queued_requests=queued,
    )
    assert wire.decode_frames(wire.encode_frames(msg)) == msg
    # The independent msgpack decoder sees the same map.
    assert msgpack.unpackb(wire.encode_payload(msg))["counter_id"] == counter


@pytest.mark.parametrize(
    ("base", "rank", "expected"),
    [
        (20380, 0, "tcp://*:20380"),
        ("20380", 3, "tcp://*:20383"),
        ("ipc:///tmp/fpm", 2, "ipc:///tmp/fpm.2"),
        ("/tmp/fpm", 1, "ipc:///tmp/fpm.1"),
    ],
)
def test_endpoint_for_rank(base: str | int, rank: int, expected: str) -> None:
    assert wire.endpoint_for_rank(base, rank) == expected
