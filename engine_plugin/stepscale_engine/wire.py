"""ForwardPassMetrics (FPM) wire protocol, version 1.

The one module both sides import: the three structs, the frame format
``[topic, sequence, payload]`` and the decoder's validation rules. The schema is
fixed by ``docs/fpm-wire-v1.md`` and shared with NVIDIA Dynamo, SGLang and
the vLLM RFC #38760 pull request:

* every struct is a plain ``msgspec.Struct`` (``frozen=True, gc=False``), encoded
  as a msgpack map with string keys in declaration order, sub-structs nested;
* ``timing_scope`` is the optional string the vLLM pull request adds between
  ``counter_id`` and ``wall_time``. It is ``UNSET`` unless the publisher knows its
  scope, and msgspec omits ``UNSET`` fields, so a message without it encodes to
  exactly the bytes Dynamo and SGLang produce, and one with it to the bytes of the
  vLLM pull request.

Decoding goes by key, ignores unknown keys, defaults missing keys, and turns
every kind of bad input into a :class:`FrameError` with a reason, never an
exception that escapes. It is lenient where the spec allows and other
implementations differ harmlessly: ``timing_scope: nil`` reads as unset, a
variance that is negative only by floating-point rounding reads as 0, and a
sequence frame that differs from ``counter_id`` is reported to the caller but
not rejected (the spec rejects only wrong frame counts and sequence lengths).
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Callable, Sequence

import msgspec
from msgspec import UNSET, UnsetType

WIRE_VERSION = 1
DEFAULT_BASE_PORT = 20380
HEARTBEAT_INTERVAL_S = 1.0
# A real payload is about 400 bytes; anything far larger is hostile or broken and
# is rejected before msgpack parses it.
MAX_PAYLOAD_BYTES = 64 * 1024

# Values the vLLM pull request uses, plus ours for host-side timing.
TIMING_SCOPE_EXECUTE_MODEL_CUDA = "execute_model_cuda"
TIMING_SCOPE_MODEL_STEP_CUDA = "model_step_cuda"
TIMING_SCOPE_MODEL_STEP_HOST = "model_step_host"

_SEQUENCE = struct.Struct(">Q")


class ScheduledRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Composition of the batch one forward pass executed."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class QueuedRequestMetrics(msgspec.Struct, frozen=True, gc=False):
    """Requests waiting to be scheduled when the pass ran."""

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0


class ForwardPassMetrics(msgspec.Struct, frozen=True, gc=False):
    """One message per forward pass; ``wall_time == 0`` marks a heartbeat."""

    version: int = WIRE_VERSION
    worker_id: str = ""
    dp_rank: int = 0
    counter_id: int = 0
    timing_scope: str | UnsetType = UNSET
    wall_time: float = 0.0  # seconds
    scheduled_requests: ScheduledRequestMetrics = ScheduledRequestMetrics()
    queued_requests: QueuedRequestMetrics = QueuedRequestMetrics()

    @property
    def is_heartbeat(self) -> bool:
        """True for the idle-engine heartbeat (no forward pass ran)."""
        return self.wall_time == 0.0


class FrameError(enum.Enum):
    """Why a received frame was rejected; each reason is counted separately."""

    FRAME_COUNT = "frame_count"  # not exactly three frames
    SEQUENCE_LENGTH = "sequence_length"  # sequence frame not 8 bytes
    PAYLOAD_TOO_LARGE = "payload_too_large"
    NOT_MSGPACK = "not_msgpack"  # not valid msgpack at all
    SCHEMA = "schema"  # valid msgpack, wrong shape or types
    VERSION = "version"  # a version other than 1
    VALUE = "value"  # negative counts, non-finite times
    # Not a rejection: decode_frames accepts the message and reports the
    # mismatch through ``on_sequence_mismatch``; callers count it under this name.
    SEQUENCE_MISMATCH = "sequence_mismatch"  # sequence frame != counter_id


class DecodeError(Exception):
    """Raised by :func:`decode_payload`; carries the :class:`FrameError` reason."""

    def __init__(self, reason: FrameError, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
# Only used to tell "not msgpack" from "msgpack of the wrong shape" after a failure.
_any_decoder = msgspec.msgpack.Decoder()


def encode_payload(msg: ForwardPassMetrics) -> bytes:
    """Encode one message to its msgpack payload bytes."""
    return _encoder.encode(msg)


def encode_sequence(counter_id: int) -> bytes:
    """The 8-byte unsigned big-endian sequence frame."""
    return _SEQUENCE.pack(counter_id)


def encode_frames(msg: ForwardPassMetrics) -> list[bytes]:
    """The three ZMQ frames ``[b"", sequence, payload]`` for one message."""
    return [b"", _SEQUENCE.pack(msg.counter_id), _encoder.encode(msg)]


# A variance computed as E[x^2] - E[x]^2 (as other implementations do) can come
# out slightly negative by cancellation; its rounding error is a few ulps of
# E[x^2], about mean^2 when the spread is small. Anything within this fraction of
# mean^2 (or of 1, for tiny means) is read as 0; beyond it the value is wrong.
VARIANCE_ROUNDING_TOLERANCE = 1e-6
# Each variance field -> the (sum, count) fields whose mean sets its scale.
_VARIANCE_SCALE = {
    "var_prefill_length": ("sum_prefill_tokens", "num_prefill_requests"),
    "var_decode_kv_tokens": ("sum_decode_kv_tokens", "num_decode_requests"),
}

_Part = ScheduledRequestMetrics | QueuedRequestMetrics


def _is_rounding_noise(part: _Part, name: str, value: float) -> bool:
    """True if a negative ``value`` of field ``name`` is a variance off by rounding only."""
    if name not in _VARIANCE_SCALE:
        return False
    total_field, count_field = _VARIANCE_SCALE[name]
    total, count = getattr(part, total_field), getattr(part, count_field)
    mean = total / count if count > 0 else 0.0
    return -value <= VARIANCE_ROUNDING_TOLERANCE * max(1.0, mean * mean)


def _part_problem(part: _Part) -> str | None:
    for name in part.__struct_fields__:
        value = getattr(part, name)
        if isinstance(value, float):
            if not math.isfinite(value):
                return f"{name} {value!r} is not finite"
            if value < 0.0 and not _is_rounding_noise(part, name, value):
                return f"{name} {value!r} is negative"
        elif value < 0:
            return f"{name} {value!r} is negative"
    return None


def _check_values(msg: ForwardPassMetrics) -> str | None:
    if msg.dp_rank < 0 or msg.counter_id < 0:
        return "negative dp_rank or counter_id"
    if not math.isfinite(msg.wall_time) or msg.wall_time < 0.0:
        return f"wall_time {msg.wall_time!r} is not a finite non-negative number"
    return _part_problem(msg.scheduled_requests) or _part_problem(msg.queued_requests)


def _clamp_part(part: _Part) -> _Part:
    negative = {n: 0.0 for n in _VARIANCE_SCALE if getattr(part, n) < 0.0}
    return msgspec.structs.replace(part, **negative) if negative else part


def _clamp_rounding_noise(msg: ForwardPassMetrics) -> ForwardPassMetrics:
    """``msg`` with variances that are negative by rounding (already checked) set to 0."""
    scheduled = _clamp_part(msg.scheduled_requests)
    queued = _clamp_part(msg.queued_requests)
    if scheduled is msg.scheduled_requests and queued is msg.queued_requests:
        return msg
    return msgspec.structs.replace(msg, scheduled_requests=scheduled, queued_requests=queued)


def decode_payload(payload: bytes | memoryview) -> ForwardPassMetrics:
    """Decode and validate one payload.

    Raises :class:`DecodeError` (never anything else) for input that is too
    large, not msgpack, of the wrong shape or types, of another version, or
    with values no engine can produce.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(FrameError.PAYLOAD_TOO_LARGE, f"{len(payload)} bytes")
    try:
        msg = _decode_struct(payload)
    except DecodeError:
        raise
    except RecursionError:
        # msgspec recurses per nesting level: a deeply nested value (even under
        # a key we would ignore) exhausts the stack. No real message nests.
        raise DecodeError(FrameError.SCHEMA, "nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the contract: nothing but DecodeError escapes
        raise DecodeError(FrameError.NOT_MSGPACK, f"{type(exc).__name__}: {exc}") from None
    if msg.version != WIRE_VERSION:
        raise DecodeError(FrameError.VERSION, f"version {msg.version!r}")
    problem = _check_values(msg)
    if problem is not None:
        raise DecodeError(FrameError.VALUE, problem)
    return _clamp_rounding_noise(msg)


def _decode_struct(payload: bytes | memoryview) -> ForwardPassMetrics:
    """msgpack -> struct, with the reason for a failure; may raise anything unexpected."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raw = _decode_raw(payload)
        if isinstance(raw, dict):
            # A version we do not speak may also change the shape: report the version.
            version = raw.get("version", WIRE_VERSION)
            if version != WIRE_VERSION:
                raise DecodeError(FrameError.VERSION, f"version {version!r}") from None
            if "timing_scope" in raw and raw["timing_scope"] is None:
                # ``nil`` for the optional scope means "not measured": read as unset.
                del raw["timing_scope"]
                return _decode_struct(_encoder.encode(raw))
        raise DecodeError(FrameError.SCHEMA, str(exc)) from None
    except (msgspec.DecodeError, ValueError, OverflowError) as exc:
        raise DecodeError(FrameError.NOT_MSGPACK, str(exc)) from None


def _decode_raw(payload: bytes | memoryview) -> object | None:
    """The payload as plain msgpack values, or None if even that fails."""
    try:
        return _any_decoder.decode(payload)
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        return None


SequenceMismatchHook = Callable[[int, ForwardPassMetrics], None]


def decode_frames(
    frames: Sequence[bytes | memoryview],
    *,
    on_sequence_mismatch: SequenceMismatchHook | None = None,
) -> ForwardPassMetrics:
    """Decode a received multipart message; raises :class:`DecodeError` on bad input.

    A sequence frame that differs from the payload's ``counter_id`` is not
    malformed by the spec: the message is returned, and
    ``on_sequence_mismatch(sequence, msg)`` is called so the caller can count it
    (as :attr:`FrameError.SEQUENCE_MISMATCH`).
    """
    if len(frames) != 3:
        raise DecodeError(FrameError.FRAME_COUNT, f"{len(frames)} frames, expected 3")
    seq_frame = frames[1]
    if len(seq_frame) != 8:
        raise DecodeError(FrameError.SEQUENCE_LENGTH, f"{len(seq_frame)} bytes, expected 8")
    msg = decode_payload(frames[2])
    if on_sequence_mismatch is not None:
        (sequence,) = _SEQUENCE.unpack(seq_frame)
        if sequence != msg.counter_id:
            on_sequence_mismatch(sequence, msg)
    return msg


def heartbeat(worker_id: str, dp_rank: int, counter_id: int) -> ForwardPassMetrics:
    """The idle heartbeat: only identity and counter set, everything else zero."""
    return ForwardPassMetrics(worker_id=worker_id, dp_rank=dp_rank, counter_id=counter_id)


def endpoint_for_rank(base: str | int, dp_rank: int, host: str = "*") -> str:
    """Endpoint of one data-parallel rank.

    ``base`` is a TCP base port (rank r binds ``base + r``) or an IPC name
    (rank r binds ``ipc://{name}.{r}``).
    """
    if isinstance(base, int) or str(base).isdigit():
        return f"tcp://{host}:{int(base) + dp_rank}"
    name = str(base).removeprefix("ipc://")
    return f"ipc://{name}.{dp_rank}"
