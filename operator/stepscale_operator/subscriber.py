"""FpmSubscriber: the ZMQ edge that receives FPM streams from many engines.

One SUB socket connects to every endpoint (ZMQ fair-queues them), so one poll
serves any number of pods; the stream identity ``(worker_id, dp_rank)`` comes from
each payload. Endpoints are added and removed at run time from any thread: the
request is queued and the polling thread is woken through an inproc PAIR socket,
because ZMQ sockets must only be used by one thread.

Receiving is batched: up to ``max_batch`` messages are drained per wake-up,
decoded, validated column-wise (:class:`~stepscale_operator.fpm_pipeline.PassMatrices`)
and handed to the sink as one :class:`~stepscale_operator.fpm_pipeline.MessageBatch`.

Validation is exactly :func:`stepscale_engine.wire.decode_frames`'s: the fast path
accepts only what it would accept, and anything the fast path doubts goes through
``decode_frames`` itself to get the rejection reason. Frame boundaries: one
``recv_multipart`` costs about three times as much as three bare ``recv`` calls,
because it asks ZMQ (``getsockopt(RCVMORE)``) whether more frames follow after
every frame. The default, ``exact_framing=True``, receives zero-copy frames instead,
which carry that flag themselves: every boundary is checked, a malformed message
loses nothing but itself, and it is about 1.3-1.5x faster than
``recv_multipart`` (benchmarks/bench_ingest.py). The opt-in
``exact_framing=False`` reads ``[topic, sequence, payload]`` as bytes and asks
once, after the payload; a message of the wrong length is still detected and
counted (``frame_count``), but since its boundary was found late the message
after it can be dropped with it (counted in ``resyncs``).
Nothing here raises on bad input: every rejection is counted by reason and
logged at a limited rate. Any exception while decoding one payload (for example
a ``RecursionError`` from deeply nested msgpack) rejects that payload only, and
an unexpected error in the polling thread is counted and the thread goes on:
one packet must never stop ingestion.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from stepscale_engine import wire
from stepscale_engine.rate_limited_log import RateLimitedLog
from stepscale_engine.wire import DecodeError, ForwardPassMetrics, FrameError
from stepscale_operator.fpm_pipeline import (
    COL_COUNTER,
    COL_VERSION,
    MessageBatch,
    PassMatrices,
)
from stepscale_operator.stream_state import StreamKey, StreamTable

log = logging.getLogger(__name__)

BatchSink = Callable[[list[ForwardPassMetrics]], None]

_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
_raw_decoder = msgspec.msgpack.Decoder()
_instance_ids = itertools.count()
# Counters at or above 2**53 are not exact in float64: send them to the slow path.
_EXACT_FLOAT_LIMIT = float(2**53)


@dataclass
class SubscriberStats:
    """Counters of one subscriber (plain ints; read from any thread)."""

    received: int = 0  # messages (multipart) taken off the socket
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # FrameError value -> count
    resyncs: int = 0  # frame boundary found late; the message after may be lost
    duplicates: int = 0  # valid messages whose sequence the stream table had already seen
    sequence_mismatches: int = 0  # accepted, but the sequence frame != counter_id (spec: allowed)
    batches: int = 0
    sink_errors: int = 0
    endpoint_errors: int = 0
    internal_errors: int = 0  # unexpected errors in the polling loop (it keeps running)


class FpmSubscriber:
    """Receives, decodes and validates FPM messages from many endpoints; feeds a sink."""

    def __init__(
        self,
        on_batch: BatchSink | None = None,
        *,
        endpoints: Iterable[str] = (),
        streams: StreamTable | None = None,
        observe_streams: bool = True,
        context: zmq.Context | None = None,
        max_batch: int = 4096,
        rcvhwm: int = 100_000,
        exact_framing: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``streams``/``observe_streams``: see :class:`DeploymentModel` for sharing a table."""
        self.on_batch = on_batch
        self.streams = streams if streams is not None else StreamTable()
        self.observe_streams = observe_streams
        self.max_batch = max(1, int(max_batch))
        self.exact_framing = exact_framing
        self.stats = SubscriberStats()
        self._clock = clock
        self._context = context or zmq.Context.instance()
        self._rate_log = RateLimitedLog(log)
        self._endpoints: set[str] = set()
        self._commands: deque[tuple[str, str]] = deque()
        self._command_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False

        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        ctrl = f"inproc://stepscale-fpm-sub-ctrl-{id(self)}-{next(_instance_ids)}"
        self._ctrl_recv = self._context.socket(zmq.PAIR)
        self._ctrl_recv.setsockopt(zmq.LINGER, 0)
        self._ctrl_recv.bind(ctrl)
        self._ctrl_send = self._context.socket(zmq.PAIR)
        self._ctrl_send.setsockopt(zmq.LINGER, 0)
        self._ctrl_send.connect(ctrl)
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._ctrl_recv, zmq.POLLIN)
        for ep in endpoints:
            self.add_endpoint(ep)

    # -- endpoints (any thread) ------------------------------------------------

    def add_endpoint(self, endpoint: str) -> None:
        """Connect to an engine's PUB endpoint (``tcp://host:port`` or ``ipc://...``)."""
        self._command("add", endpoint)

    def remove_endpoint(self, endpoint: str) -> None:
        """Disconnect from an endpoint; its stream goes stale unless the table forgets it."""
        self._command("remove", endpoint)

    @property
    def endpoints(self) -> set[str]:
        """Endpoints currently connected (as applied by the polling thread)."""
        return set(self._endpoints)

    def _command(self, op: str, endpoint: str) -> None:
        with self._command_lock:
            if self._closed:
                raise RuntimeError("subscriber is closed")
            self._commands.append((op, endpoint))
            if self._thread is not None:
                self._ctrl_send.send(b"!", flags=zmq.NOBLOCK)

    def _apply_commands(self) -> None:
        """Run queued endpoint changes; only on the thread that owns the sockets."""
        while True:
            with self._command_lock:
                if not self._commands:
                    return
                op, endpoint = self._commands.popleft()
            try:
                if op == "add" and endpoint not in self._endpoints:
                    self._sub.connect(endpoint)
                    self._endpoints.add(endpoint)
                elif op == "remove" and endpoint in self._endpoints:
                    self._endpoints.discard(endpoint)
                    self._sub.disconnect(endpoint)
            except zmq.ZMQError as exc:
                self.stats.endpoint_errors += 1
                self._rate_log.warning(
                    f"endpoint-{op}", "FPM subscriber cannot %s %s: %s", op, endpoint, exc
                )

    # -- synchronous API (tests, simulator) -------------------------------------

    def poll_batch(self, timeout_s: float = 0.0) -> MessageBatch:
        """Wait up to ``timeout_s`` for messages, then decode and return a batch (no sink)."""
        if self._thread is not None:
            raise RuntimeError("poll_batch is not available while the background thread runs")
        self._apply_commands()
        if not self._sub.poll(int(timeout_s * 1000), zmq.POLLIN):
            return MessageBatch()
        return self._receive_batch()

    def run_once(self, timeout_s: float = 0.0) -> int:
        """Receive one batch and hand it to the sink; returns the number accepted."""
        batch = self.poll_batch(timeout_s)
        self._dispatch(batch)
        return len(batch)

    # -- background thread -----------------------------------------------------

    def start(self) -> FpmSubscriber:
        """Start the polling thread; the sink runs on it."""
        if self._thread is not None:
            return self
        if self._closed:
            raise RuntimeError("subscriber is closed")
        self._stop.clear()
        with self._command_lock:
            self._thread = threading.Thread(target=self._run, name="stepscale-fpm-sub", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (if any) and close the sockets; idempotent."""
        with self._command_lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._stop.set()
                self._ctrl_send.send(b"!", flags=zmq.NOBLOCK)
        if thread is not None:
            thread.join(timeout_s)
            self._thread = None
        for sock in (self._sub, self._ctrl_recv, self._ctrl_send):
            sock.close(linger=0)

    def __enter__(self) -> FpmSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll_and_drain()
            except Exception as exc:  # noqa: BLE001 - one bad packet must not stop ingestion
                self.stats.internal_errors += 1
                self._rate_log.warning("internal", "FPM subscriber error (continuing): %r", exc)
                self._stop.wait(0.01)  # no busy loop should the error repeat

    def _poll_and_drain(self) -> None:
        """One wake-up of the polling thread: endpoint changes, then drain the socket."""
        self._apply_commands()
        events = dict(self._poller.poll(100))
        if self._ctrl_recv in events:
            while self._ctrl_recv.poll(0):
                self._ctrl_recv.recv()
        if self._sub in events:
            # Drain what is there in batches before polling again.
            while not self._stop.is_set():
                self._dispatch(self._receive_batch())
                if not self._sub.poll(0, zmq.POLLIN):
                    break

    # -- receiving and decoding -------------------------------------------------

    def _receive_batch(self) -> MessageBatch:
        """Drain up to ``max_batch`` messages and decode them."""
        seqs: list[bytes] = []
        payloads: list[bytes | memoryview] = []
        recv = self._sub.recv
        getsockopt = self._sub.getsockopt
        noblock, rcvmore = zmq.NOBLOCK, zmq.RCVMORE
        exact = self.exact_framing
        received = 0
        for _ in range(self.max_batch):
            frames_read = 0  # of the current message, to spot one cut short
            try:
                if exact:
                    # Zero-copy frames carry their own "more" flag (zmq_msg_more),
                    # so every boundary is checked without a getsockopt per frame.
                    first = recv(noblock, copy=False)
                    received += 1
                    if not first.more:
                        self._reject(FrameError.FRAME_COUNT, None)
                        continue
                    second = recv(noblock, copy=False)
                    if not second.more:
                        self._reject(FrameError.FRAME_COUNT, None)
                        continue
                    third = recv(noblock, copy=False)
                    if third.more:
                        self._drain_message()
                        self._reject(FrameError.FRAME_COUNT, None)
                        continue
                    topic, seq, payload = first.buffer, second.bytes, third.buffer
                else:
                    topic = recv(noblock)
                    received += 1
                    frames_read = 1
                    if topic != b"" and not getsockopt(rcvmore):
                        self._reject(FrameError.FRAME_COUNT, None)
                        continue
                    seq = recv(noblock)
                    frames_read = 2
                    payload = recv(noblock)
                    if getsockopt(rcvmore):
                        # More than three frames, or a short message before this one.
                        self._drain_message()
                        self.stats.resyncs += 1
                        self._reject(FrameError.FRAME_COUNT, None)
                        continue
            except zmq.Again:
                # The queue emptied mid-message: the last message had fewer frames.
                if frames_read:
                    self._reject(FrameError.FRAME_COUNT, None)
                break
            if len(seq) != 8:
                self._reject(FrameError.SEQUENCE_LENGTH, _peek_stream(payload), f"{len(seq)} bytes")
                continue
            seqs.append(seq)
            payloads.append(payload)
        self.stats.received += received
        return self._decode(seqs, payloads)

    def _drain_message(self) -> None:
        while self._sub.getsockopt(zmq.RCVMORE):
            self._sub.recv(zmq.NOBLOCK)

    def _decode(self, seqs: list[bytes], payloads: list[bytes | memoryview]) -> MessageBatch:
        """Decode well-framed messages; vectorised validation, slow path for the doubtful."""
        n = len(payloads)
        batch = MessageBatch()
        if n == 0:
            batch.matrices = PassMatrices.from_messages([])
            return batch
        decoded: list[ForwardPassMetrics | None]
        try:
            if any(len(p) > wire.MAX_PAYLOAD_BYTES for p in payloads):
                raise ValueError("oversized payload")
            decoded = [_decoder.decode(p) for p in payloads]
        except Exception:  # noqa: BLE001 - e.g. RecursionError: judge each payload alone
            decoded = [self._decode_one(p, q) for p, q in zip(payloads, seqs, strict=True)]
        good_idx = [i for i, m in enumerate(decoded) if m is not None]
        msgs = [m for m in decoded if m is not None]
        matrices = PassMatrices.from_messages(msgs)
        seq_values = np.frombuffer(b"".join(seqs[i] for i in good_idx), dtype=">u8")
        num = matrices.numeric
        valid = (
            (num[:, COL_VERSION] == wire.WIRE_VERSION)
            & np.isfinite(num).all(axis=1)
            & (num[:, 1:] >= 0.0).all(axis=1)
            & (num[:, COL_COUNTER] < _EXACT_FLOAT_LIMIT)
            & (num[:, COL_COUNTER] == seq_values.astype(np.float64))
        )
        if not valid.all():
            # The wire module judges doubtful rows, and what it accepts is what it
            # returns (its leniency, e.g. a rounding-negative variance set to 0).
            for row in np.flatnonzero(~valid):
                i = good_idx[int(row)]
                judged = self._slow_path_message([b"", seqs[i], payloads[i]])
                valid[row] = judged is not None
                if judged is not None:
                    msgs[row] = judged
            msgs = [m for m, ok in zip(msgs, valid, strict=True) if ok]
            matrices = PassMatrices.from_messages(msgs)
        # Payloads that failed to decode were rejected in _decode_one.
        if self.observe_streams and msgs:
            seen = self.streams.observe_columns(
                matrices.keys, matrices.counters, matrices.wall, self._clock()
            )
            if not seen.all_accepted:
                # Counted as duplicates by the table; the sink must not learn them twice.
                self.stats.duplicates += int(np.count_nonzero(~seen.mask))
                matrices = matrices.select(seen.mask)
                msgs = [m for m, ok in zip(msgs, seen.mask, strict=True) if ok]
        batch.extend(msgs)
        batch.matrices = matrices
        self.stats.accepted += len(msgs)
        return batch

    def _decode_one(
        self, payload: bytes | memoryview, seq: bytes | memoryview
    ) -> ForwardPassMetrics | None:
        """The fast decoder's message, else the wire module's (lenient) one, else None
        with the rejection counted. Sequence mismatches are counted later, once."""
        if len(payload) <= wire.MAX_PAYLOAD_BYTES:
            try:
                return _decoder.decode(payload)
            except Exception:  # noqa: BLE001 - the wire module judges it below
                pass
        frames = [b"", seq, payload]
        msg, reason, detail = _wire_decode(frames)
        if msg is None:
            self._reject(reason or FrameError.SCHEMA, _peek_stream(payload), detail)
        return msg

    def _slow_path_message(self, frames: list[bytes | memoryview]) -> ForwardPassMetrics | None:
        """The wire module's message for a doubtful frame; its reason counted if rejected."""
        msg, reason, detail = _wire_decode(frames, self._count_sequence_mismatch)
        if msg is None:
            self._reject(reason or FrameError.SCHEMA, _peek_stream(frames[2]), detail)
        return msg

    def _count_sequence_mismatch(self, sequence: int, msg: ForwardPassMetrics) -> None:
        """Not a rejection (the stream is numbered by ``counter_id``), but worth counting."""
        self.stats.sequence_mismatches += 1

    def _reject(self, reason: FrameError, key: StreamKey | None, detail: str = "") -> None:
        name = reason.value
        self.stats.rejected[name] = self.stats.rejected.get(name, 0) + 1
        self.streams.record_rejected(reason, key)
        self._rate_log.warning(name, "FPM frame rejected (%s): %s", name, detail[:200])

    def _dispatch(self, batch: MessageBatch) -> None:
        if not batch or self.on_batch is None:
            return
        self.stats.batches += 1
        try:
            self.on_batch(batch)
        except Exception as exc:  # noqa: BLE001 - a broken sink must not stop ingest
            self.stats.sink_errors += 1
            self._rate_log.warning("sink", "FPM sink failed: %r", exc)


def _wire_decode(
    frames: list[bytes | memoryview],
    on_sequence_mismatch: Callable[[int, ForwardPassMetrics], None] | None = None,
) -> tuple[ForwardPassMetrics | None, FrameError | None, str]:
    """The wire module's message for ``frames``, or None with its rejection reason.

    Any exception other than :class:`DecodeError` (the wire module failing on a
    hostile payload, e.g. by recursion) counts as a payload that is not msgpack.
    """
    try:
        return wire.decode_frames(frames, on_sequence_mismatch=on_sequence_mismatch), None, ""
    except DecodeError as exc:
        return None, exc.reason, exc.detail
    except Exception as exc:  # noqa: BLE001 - a hostile payload must not escape as an error
        return None, FrameError.NOT_MSGPACK, f"undecodable payload: {type(exc).__name__}"


def _peek_stream(payload: bytes | memoryview) -> StreamKey | None:
    """Best-effort stream identity of a rejected payload, for per-stream counts."""
    try:
        raw = _raw_decoder.decode(payload)
    except Exception:  # noqa: BLE001 - anything undecodable has no identity
        return None
    if isinstance(raw, dict):
        worker, rank = raw.get("worker_id", ""), raw.get("dp_rank", 0)
        if isinstance(worker, str) and isinstance(rank, int) and not isinstance(rank, bool):
            return (worker, rank)
    return None
