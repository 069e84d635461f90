"""ForwardPassMetrics (FPM) wire protocol, version 1.

The one module both sides import: the three structs, the frame format
``[topic, sequence, payload]`` and the decoder's validation rules. The schema is
fixed by ``shared/spec/fpm-wire-v1.md`` and shared with NVIDIA Dynamo, SGLang and
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
exception that escapes.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Sequence

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


def _check_values(msg: ForwardPassMetrics) -> str | None:
    if msg.version != WIRE_VERSION:
        return None  # handled by the caller as a VERSION error
    if msg.dp_rank < 0 or msg.counter_id < 0:
        return "negative dp_rank or counter_id"
    if not math.isfinite(msg.wall_time) or msg.wall_time < 0.0:
        return f"wall_time {msg.wall_time!r} is not a finite non-negative number"
    for part in (msg.scheduled_requests, msg.queued_requests):
        for name in part.__struct_fields__:
            value = getattr(part, name)
            if isinstance(value, float):
                if not math.isfinite(value) or value < 0.0:
                    return f"{name} {value!r} is not a finite non-negative number"
            elif value < 0:
                return f"{name} {value!r} is negative"
    return None


def decode_payload(payload: bytes | memoryview) -> ForwardPassMetrics:
    """Decode and validate one payload.

    Raises :class:`DecodeError` (never anything else) for input that is too
    large, not msgpack, of the wrong shape or types, of another version, or
    with values no engine can produce.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise DecodeError(FrameError.PAYLOAD_TOO_LARGE, f"{len(payload)} bytes")
    try:
        msg = _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        # A version we do not speak may also change the shape: report the version.
        version = _peek_version(payload)
        if version is not None and version != WIRE_VERSION:
            raise DecodeError(FrameError.VERSION, f"version {version!r}") from None
        raise DecodeError(FrameError.SCHEMA, str(exc)) from None
    except (msgspec.DecodeError, ValueError, OverflowError) as exc:
        raise DecodeError(FrameError.NOT_MSGPACK, str(exc)) from None
    if msg.version != WIRE_VERSION:
        raise DecodeError(FrameError.VERSION, f"version {msg.version!r}")
    problem = _check_values(msg)
    if problem is not None:
        raise DecodeError(FrameError.VALUE, problem)
    return msg


def _peek_version(payload: bytes | memoryview) -> object | None:
    try:
        raw = _any_decoder.decode(payload)
    except Exception:  # noqa: BLE001 - any failure just means "unknown"
        return None
    if isinstance(raw, dict):
        return raw.get("version", WIRE_VERSION)
    return None


def decode_frames(frames: Sequence[bytes | memoryview]) -> ForwardPassMetrics:
    """Decode a received multipart message; raises :class:`DecodeError` on bad input."""
    if len(frames) != 3:
        raise DecodeError(FrameError.FRAME_COUNT, f"{len(frames)} frames, expected 3")
    seq_frame = frames[1]
    if len(seq_frame) != 8:
        raise DecodeError(FrameError.SEQUENCE_LENGTH, f"{len(seq_frame)} bytes, expected 8")
    msg = decode_payload(frames[2])
    (sequence,) = _SEQUENCE.unpack(seq_frame)
    if sequence != msg.counter_id:
        raise DecodeError(
            FrameError.SEQUENCE_MISMATCH,
            f"sequence {sequence} != counter_id {msg.counter_id}",
        )
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
