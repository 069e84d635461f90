"""The native fast path of FPM ingest, when it was built: batched receive and decode.

Python pays about a microsecond for each call into pyzmq or msgspec, and an FPM
message costs three frame receives, one decode and one struct-to-columns copy:
that, not the work itself, bounds a pure-Python subscriber to roughly 100k
messages/s on one core. The C extension ``_fpm_native`` does the same steps once
per *batch*:

* :func:`drain` receives up to N whole messages or a byte budget of payloads
  (GIL released), checks every frame boundary exactly as
  :mod:`stepscale_engine.wire` requires, rejects payloads over the wire limit
  before copying them, and returns the sequences and payloads packed into two
  byte strings;
* :func:`decode_columns` reads those payloads straight into the rows of
  :class:`~stepscale_operator.fpm_pipeline.PassMatrices`. It handles only the
  plain form of the wire format and marks everything else *doubtful*; the
  subscriber sends doubtful rows to the wire module, which decides. The column
  schema it reads is derived here from the wire module's structs, so the two
  cannot drift apart silently (import fails if a field is not mapped).

The extension is optional (``setup.py`` builds it where a C compiler exists).
Without it, or without a libzmq it can bind through pyzmq, :data:`AVAILABLE` /
:data:`DRAIN_AVAILABLE` are False and the subscriber uses its pure-Python path,
which gives identical results (tests run both).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from stepscale_engine import wire
from stepscale_operator.fpm_pipeline import PassMatrices
from stepscale_operator.pass_columns import (
    COL_COUNTER,
    COL_DP_RANK,
    COL_QUEUED,
    COL_SCHED,
    COL_VERSION,
    COL_WALL,
    N_NUMERIC,
)
from stepscale_operator.stream_state import StreamKey

log = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

# Mirrors of the C enums.
_KIND_INT, _KIND_FLOAT, _KIND_KEY_STR, _KIND_OPT_STR, _KIND_MAP = 1, 2, 3, 4, 5
REJECT_FRAME_COUNT, REJECT_SEQUENCE_LENGTH, REJECT_PAYLOAD_TOO_LARGE = 1, 2, 3
# Payload bytes one drain may hold (it stops after the message that reaches it).
DEFAULT_DRAIN_BYTES = 4 * 1024 * 1024

# Where each top-level field of ForwardPassMetrics goes.
_TOP_COLUMNS = {
    "version": COL_VERSION,
    "dp_rank": COL_DP_RANK,
    "counter_id": COL_COUNTER,
    "wall_time": COL_WALL,
}
_NESTED = {
    "scheduled_requests": (1, wire.ScheduledRequestMetrics, COL_SCHED),
    "queued_requests": (2, wire.QueuedRequestMetrics, COL_QUEUED),
}


def _scalar_kind(tp: Any) -> int:
    if isinstance(tp, msgspec.inspect.IntType):
        return _KIND_INT
    if isinstance(tp, msgspec.inspect.FloatType):
        return _KIND_FLOAT
    raise TypeError(f"no column kind for {tp!r}")


def _column_schema() -> tuple[tuple[float, ...], list[list[tuple[str, int, int, int]]]]:
    """``(defaults, maps)`` for ``decode_columns``, from the wire module's structs."""
    defaults = [0.0] * N_NUMERIC
    top: list[tuple[str, int, int, int]] = []
    maps: list[list[tuple[str, int, int, int]]] = [top, [], []]
    info = msgspec.inspect.type_info(wire.ForwardPassMetrics)
    assert isinstance(info, msgspec.inspect.StructType)
    for f in info.fields:
        if f.name in _TOP_COLUMNS:
            col = _TOP_COLUMNS[f.name]
            top.append((f.name, _scalar_kind(f.type), col, int(f.name == "dp_rank")))
            defaults[col] = float(f.default)
        elif f.name == "worker_id":
            top.append((f.name, _KIND_KEY_STR, 0, 0))
        elif f.name == "timing_scope":
            top.append((f.name, _KIND_OPT_STR, 0, 0))
        elif f.name in _NESTED:
            index, struct, first_col = _NESTED[f.name]
            top.append((f.name, _KIND_MAP, index, 0))
            nested = msgspec.inspect.type_info(struct)
            assert isinstance(nested, msgspec.inspect.StructType)
            for j, g in enumerate(nested.fields):
                maps[index].append((g.name, _scalar_kind(g.type), first_col + j, 0))
                defaults[first_col + j] = float(g.default)
        else:
            raise TypeError(f"ForwardPassMetrics.{f.name} has no column: map it here")
    return tuple(defaults), maps


SCHEMA = _column_schema()


def _load() -> ModuleType | None:
    try:
        return importlib.import_module("stepscale_operator._fpm_native")
    except ImportError:
        return None


def _pyzmq_backend_path() -> str | None:
    """File of pyzmq's compiled backend module (linked to the libzmq its sockets use)."""
    try:
        backend = importlib.import_module("zmq.backend.cython._zmq")
    except ImportError:  # e.g. the CFFI backend (PyPy): no native receive
        return None
    return getattr(backend, "__file__", None)


_native = _load()
AVAILABLE = _native is not None
"""The native column decoder is built and importable."""


def _bind() -> bool:
    if _native is None:
        return False
    path = _pyzmq_backend_path()
    if path is None:
        return False
    try:
        _native.bind_libzmq(path)
    except OSError as exc:
        log.info("native FPM receive unavailable (%s); using pyzmq", exc)
        return False
    return True


DRAIN_AVAILABLE = _bind()
"""The native batched receive can use pyzmq's libzmq."""


@dataclass(frozen=True)
class DrainedMessages:
    """What one :func:`drain` took off a socket."""

    received: int  # messages (whole multipart messages), rejected ones included
    sequences: bytes  # 8 bytes (big-endian) per well-framed message
    payloads: bytes  # their payloads, back to back
    ends: npt.NDArray[np.uint32]  # end offset of each payload in ``payloads``
    # (REJECT_*, sequence frame length or, for REJECT_PAYLOAD_TOO_LARGE, the payload
    # size, payload: only for REJECT_SEQUENCE_LENGTH)
    rejects: list[tuple[int, int, bytes]]


def drain(
    sock: zmq.Socket,
    max_messages: int,
    max_bytes: int = DEFAULT_DRAIN_BYTES,
    max_payload: int = wire.MAX_PAYLOAD_BYTES,
) -> DrainedMessages:
    """Receive up to ``max_messages`` queued messages (or ``max_bytes`` of payloads)
    without blocking; a payload over ``max_payload`` bytes is rejected uncopied."""
    if not DRAIN_AVAILABLE or _native is None:
        raise RuntimeError("the native FPM receive is not available")
    received, seqs, payloads, ends, rejects = _native.drain(
        sock.underlying, max_messages, max(1, int(max_bytes)), max(0, int(max_payload))
    )
    return DrainedMessages(received, seqs, payloads, np.frombuffer(ends, np.uint32), rejects)


Columns = tuple[FloatArray, list[StreamKey | None], npt.NDArray[np.bool_]]


def decode_columns(payloads: bytes, ends: npt.NDArray[np.uint32]) -> Columns:
    """Rows of PassMatrices for back-to-back payloads: ``(numeric, keys, doubtful)``.

    A doubtful row (its key None, its numbers meaningless) is one the fast reader
    did not fully understand; only the wire module may accept or reject it.
    Native when built, else :func:`decode_columns_python` (same results).
    """
    if _native is None:
        return decode_columns_python(payloads, ends)
    ends = np.ascontiguousarray(ends, dtype=np.uint32)
    numeric = np.empty((ends.shape[0], N_NUMERIC))
    keys, doubtful = _native.decode_columns(payloads, ends, numeric, SCHEMA, wire.MAX_PAYLOAD_BYTES)
    return numeric, keys, np.frombuffer(doubtful, dtype=bool)


_decoder = msgspec.msgpack.Decoder(wire.ForwardPassMetrics)


def decode_columns_python(payloads: bytes, ends: npt.NDArray[np.uint32]) -> Columns:
    """:func:`decode_columns` with msgspec: a row is doubtful where its decode fails."""
    n = int(ends.shape[0])
    view = memoryview(payloads)
    starts = np.r_[0, ends[:-1]].astype(np.int64) if n else np.zeros(0, np.int64)
    msgs: list[wire.ForwardPassMetrics | None] = []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        try:
            if end - start > wire.MAX_PAYLOAD_BYTES:
                raise ValueError("oversized payload")
            msgs.append(_decoder.decode(view[start:end]))
        except Exception:  # noqa: BLE001 - e.g. RecursionError: the wire module judges it
            msgs.append(None)
    doubtful = np.array([m is None for m in msgs], dtype=bool)
    good = [m for m in msgs if m is not None]
    numeric = np.zeros((n, N_NUMERIC))
    numeric[~doubtful] = PassMatrices.from_messages(good).numeric
    keys: list[StreamKey | None] = [None if m is None else (m.worker_id, m.dp_rank) for m in msgs]
    return numeric, keys, doubtful
