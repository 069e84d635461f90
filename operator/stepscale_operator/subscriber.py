"""FpmSubscriber: the ZMQ edge that receives FPM streams from many engines.

One SUB socket connects to every endpoint (ZMQ fair-queues them), so one poll
serves any number of pods; the stream identity ``(worker_id, dp_rank)`` comes from
each payload. Endpoints are added and removed at run time from any thread: the
request is queued and the polling thread is woken through an inproc PAIR socket,
because ZMQ sockets must only be used by one thread.

Memory is bounded in bytes, whatever the peers send: the socket refuses frames
over :data:`MAX_FRAME_BYTES` (ZMQ drops such a peer's connection; it reconnects,
and the stream's sequence gap counts what was lost), a payload over the wire
limit is rejected before it is copied or decoded, each drain stops at
``max_batch_bytes`` of payloads, and each connection queues at most ``rcvhwm``
messages (beyond that ZMQ drops them, which the sequence numbers count as lost).

Receiving is batched: up to ``max_batch`` messages are drained per wake-up and
decoded straight into columns (:class:`~stepscale_operator.fpm_pipeline.PassMatrices`),
handed to the sink as one :class:`~stepscale_operator.fpm_pipeline.MessageBatch`.
Where the native extension is built (:mod:`~stepscale_operator.fpm_native`), the
receive and the decode each cost one call per batch; otherwise pyzmq and msgspec
do the same per message (slower, identical results).

Validation is exactly :func:`stepscale_engine.wire.decode_frames`'s: the fast path
accepts only what it would accept, and anything the fast path doubts goes through
``decode_frames`` itself to get the rejection reason. Every frame boundary is
checked (each frame carries its own "more" flag), so a malformed message loses
nothing but itself.
Nothing here raises on bad input: every rejection is counted by reason and
logged at a limited rate. Any exception while decoding one payload (for example
a ``RecursionError`` from deeply nested msgpack) rejects that payload only, and
an unexpected error in the polling thread is counted and the thread goes on:
one packet must never stop ingestion.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import msgspec
import numpy as np
import numpy.typing as npt
import zmq

from stepscale_engine import wire
from stepscale_engine.rate_limited_log import RateLimitedLog
from stepscale_engine.wire import DecodeError, ForwardPassMetrics, FrameError
from stepscale_operator import fpm_native
from stepscale_operator.connection_monitor import ConnectionMonitor
from stepscale_operator.fpm_pipeline import MessageBatch, PassMatrices
from stepscale_operator.pass_columns import COL_COUNTER, COL_VERSION
from stepscale_operator.stream_state import StreamKey, StreamTable

log = logging.getLogger(__name__)

BatchSink = Callable[[MessageBatch], None]

_raw_decoder = msgspec.msgpack.Decoder()
_instance_ids = itertools.count()
# Counters at or above 2**53 are not exact in float64: send them to the slow path.
_EXACT_FLOAT_LIMIT = float(2**53)
# ZMQ_MAXMSGSIZE of the SUB socket. Above the wire limit, so that a payload a little
# too large is received and counted (payload_too_large); a far larger frame costs
# its sender the connection before it is buffered.
MAX_FRAME_BYTES = 2 * wire.MAX_PAYLOAD_BYTES
# Messages per connection ZMQ holds before it drops (counted as gaps): 1.3 s of one
# engine at 50 passes/s (0.3 s at 200), far above what arrives between two receives
# or during a decision round. It bounds ZMQ's memory: a pass that arrives in its own
# TCP read pins that read's 8 KiB buffer until it is received (libzmq receives
# zero-copy), so a full connection holds about 1 MB, not 64 x 400 bytes. With 250,
# an operator held to 0.15 core under 20k msg/s reached 836 MB RSS (64: 354 MB;
# benchmarks/bench_operator_ingest.py, one run each).
DEFAULT_RCVHWM = 64


@dataclass
class SubscriberStats:
    """Counters of one subscriber (plain ints; read from any thread)."""

    received: int = 0  # messages (multipart) taken off the socket
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # FrameError value -> count
    duplicates: int = 0  # valid messages whose sequence the stream table had already seen
    sequence_mismatches: int = 0  # accepted, but the sequence frame != counter_id (spec: allowed)
    batches: int = 0
    sink_errors: int = 0
    endpoint_errors: int = 0
    reconnects: int = 0  # connections ZMQ dropped for good (e.g. a frame too large), re-made
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
        max_batch_bytes: int = fpm_native.DEFAULT_DRAIN_BYTES,
        rcvhwm: int = DEFAULT_RCVHWM,
        native_receive: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        coalesce_s: float = 0.0,
        coalesce_messages: int = 256,
    ) -> None:
        """``streams``/``observe_streams``: see :class:`DeploymentModel` for sharing a table.

        ``native_receive``: use the native batched receive (default: where it is built).
        ``coalesce_s``: after draining the socket, the polling thread waits this long
        before it looks again, so that each receive takes many messages (each costs
        a fixed overhead): throughput for latency. Keep ``rcvhwm`` above what one
        connection sends in that time. ``coalesce_messages``: at high rates it waits
        only as long as that many messages take to arrive (memory: see
        :meth:`_coalesce_wait`).
        """
        self.on_batch = on_batch
        self.streams = streams if streams is not None else StreamTable()
        self.observe_streams = observe_streams
        self.max_batch = max(1, int(max_batch))
        self.max_batch_bytes = max(1, int(max_batch_bytes))
        self.coalesce_s = max(0.0, float(coalesce_s))
        self.coalesce_messages = max(1, int(coalesce_messages))
        self._last_drain: float | None = None
        if native_receive is None:
            native_receive = fpm_native.DRAIN_AVAILABLE
        elif native_receive and not fpm_native.DRAIN_AVAILABLE:
            raise RuntimeError("the native FPM receive is not available (extension not built)")
        self.native_receive = native_receive
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
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
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
        self._monitor = ConnectionMonitor(self._sub)
        self._poller.register(self._monitor.socket, zmq.POLLIN)
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
                    self._monitor.forget(endpoint)
                    self._sub.disconnect(endpoint)
            except zmq.ZMQError as exc:
                self.stats.endpoint_errors += 1
                self._rate_log.warning(
                    f"endpoint-{op}", "FPM subscriber cannot %s %s: %s", op, endpoint, exc
                )

    def _reconnect_dropped(self) -> None:
        """Re-connect the endpoints whose connection ZMQ closed and will not restore."""
        now = self._clock()
        self._monitor.read_events(now)
        for endpoint in self._monitor.due(now):
            if endpoint not in self._endpoints:
                continue
            self.stats.reconnects += 1
            self._rate_log.warning(
                "reconnect",
                "FPM endpoint %s was dropped (frame too large?); re-connecting",
                endpoint,
            )
            # ZMQ may have forgotten it already: then connecting again is all that is needed.
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(endpoint)
            try:
                self._sub.connect(endpoint)
            except zmq.ZMQError as exc:
                self.stats.endpoint_errors += 1
                self._rate_log.warning("endpoint-add", "cannot re-connect %s: %s", endpoint, exc)

    # -- synchronous API (tests, simulator) -------------------------------------

    def poll_batch(self, timeout_s: float = 0.0) -> MessageBatch:
        """Wait up to ``timeout_s`` for messages, then decode and return a batch (no sink)."""
        if self._thread is not None:
            raise RuntimeError("poll_batch is not available while the background thread runs")
        self._apply_commands()
        self._reconnect_dropped()
        if not self._sub.poll(int(timeout_s * 1000), zmq.POLLIN):
            return MessageBatch.of([])
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
        self._monitor.close()
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
        self._reconnect_dropped()
        events = dict(self._poller.poll(100))
        if self._ctrl_recv in events:
            while self._ctrl_recv.poll(0):
                self._ctrl_recv.recv()
        if self._sub in events:
            # Drain what is there in batches before polling again.
            received = self.stats.received
            while not self._stop.is_set():
                self._dispatch(self._receive_batch())
                if not self._sub.poll(0, zmq.POLLIN):
                    break
            if self.coalesce_s > 0:
                # Let messages gather: a receive costs about the same for 1 or 1,000.
                self._stop.wait(self._coalesce_wait(self.stats.received - received))

    def _coalesce_wait(self, drained: int) -> float:
        """How long to let messages gather before the next receive: ``coalesce_s``,
        or less where that many would be more than ``coalesce_messages``. A message
        waiting in ZMQ pins the receive buffer it arrived in (about 16 KiB with one
        FPM frame per TCP read), so what waits, not only what is received, costs
        memory: at 4,000 msg/s a 0.5 s wait held some 30 MB per deployment."""
        now = self._clock()
        elapsed = now - self._last_drain if self._last_drain is not None else 0.0
        self._last_drain = now
        if drained <= 0 or elapsed <= 0.0:
            return self.coalesce_s
        rate = drained / elapsed
        return max(0.0, min(self.coalesce_s, self.coalesce_messages / rate))

    # -- receiving and decoding -------------------------------------------------

    def _receive_batch(self) -> MessageBatch:
        """Drain up to ``max_batch`` messages and decode them."""
        if self.native_receive:
            drained = fpm_native.drain(self._sub, self.max_batch, self.max_batch_bytes)
            self.stats.received += drained.received
            for code, sequence_length, payload in drained.rejects:
                if code == fpm_native.REJECT_PAYLOAD_TOO_LARGE:
                    # Never copied nor decoded: no identity to count it against.
                    self._reject(FrameError.PAYLOAD_TOO_LARGE, None, f"{sequence_length} bytes")
                elif code == fpm_native.REJECT_SEQUENCE_LENGTH:
                    self._reject(
                        FrameError.SEQUENCE_LENGTH,
                        _peek_stream(payload),
                        f"{sequence_length} bytes",
                    )
                else:
                    self._reject(FrameError.FRAME_COUNT, None)
            return self._decode(drained.sequences, drained.payloads, drained.ends)
        return self._receive_batch_pyzmq()

    def _receive_batch_pyzmq(self) -> MessageBatch:
        """The pure-pyzmq receive: same checks as the native one, a call per frame."""
        seqs: list[bytes] = []
        payloads: list[memoryview] = []
        recv = self._sub.recv
        noblock = zmq.NOBLOCK
        received = 0
        budget = self.max_batch_bytes
        for _ in range(self.max_batch):
            if budget <= 0:
                break
            try:
                # Zero-copy frames carry their own "more" flag (zmq_msg_more), so
                # every boundary is checked without a getsockopt per frame.
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
            except zmq.Again:
                break  # ZMQ delivers whole messages: only the queue ran empty
            size = len(third.buffer)
            if size > wire.MAX_PAYLOAD_BYTES:  # rejected before it is copied or decoded
                self._reject(FrameError.PAYLOAD_TOO_LARGE, None, f"{size} bytes")
                continue
            seq, payload = second.bytes, third.buffer
            budget -= size
            if len(seq) != 8:
                self._reject(FrameError.SEQUENCE_LENGTH, _peek_stream(payload), f"{len(seq)} bytes")
                continue
            seqs.append(seq)
            payloads.append(payload)
        self.stats.received += received
        ends = np.cumsum([len(p) for p in payloads], dtype=np.uint64).astype(np.uint32)
        return self._decode(b"".join(seqs), b"".join(payloads), ends)

    def _drain_message(self) -> None:
        while self._sub.getsockopt(zmq.RCVMORE):
            self._sub.recv(zmq.NOBLOCK)

    def _decode(
        self, sequences: bytes, payloads: bytes, ends: npt.NDArray[np.uint32]
    ) -> MessageBatch:
        """Decode well-framed messages into columns; the wire module judges doubtful rows.

        ``sequences`` holds 8 bytes per message, ``payloads`` the payloads back to
        back, ``ends`` where each one ends.
        """
        n = int(ends.shape[0])
        if n == 0:
            return MessageBatch.of([])
        numeric, keys, doubtful = fpm_native.decode_columns(payloads, ends)
        seq_values = np.frombuffer(sequences, dtype=">u8")
        valid = (
            ~doubtful
            & (numeric[:, COL_VERSION] == wire.WIRE_VERSION)
            & np.isfinite(numeric).all(axis=1)
            & (numeric[:, 1:] >= 0.0).all(axis=1)
            & (numeric[:, COL_COUNTER] < _EXACT_FLOAT_LIMIT)
            & (numeric[:, COL_COUNTER] == seq_values.astype(np.float64))
        )
        starts = np.r_[0, ends[:-1]].astype(np.int64)
        judged: dict[int, ForwardPassMetrics] = {}
        if not valid.all():
            # The wire module judges doubtful rows, and what it accepts is what it
            # returns (its leniency, e.g. a rounding-negative variance set to 0).
            for row in np.flatnonzero(~valid).tolist():
                frames = [
                    b"",
                    sequences[8 * row : 8 * row + 8],
                    payloads[starts[row] : ends[row]],
                ]
                msg = self._slow_path_message(frames)
                if msg is not None:
                    judged[row] = msg
                    numeric[row] = PassMatrices.from_messages([msg]).numeric[0]
                    keys[row] = (msg.worker_id, msg.dp_rank)
                    valid[row] = True
        rows = np.flatnonzero(valid)
        if len(rows) == n:  # the usual case: every row valid, no copies
            matrices = PassMatrices(cast(list[StreamKey], keys), numeric)
        else:
            kept = [cast(StreamKey, keys[i]) for i in rows.tolist()]
            matrices = PassMatrices(kept, numeric[rows])
        if self.observe_streams and len(rows):
            seen = self.streams.observe_columns(
                matrices.groups, matrices.counters, matrices.wall, self._clock()
            )
            if not seen.all_accepted:
                # Counted as duplicates by the table; the sink must not learn them twice.
                self.stats.duplicates += int(np.count_nonzero(~seen.mask))
                matrices = matrices.select(seen.mask)
                rows = rows[seen.mask]
        self.stats.accepted += len(rows)

        def messages() -> list[ForwardPassMetrics]:
            # On demand only: ingest needs the columns, not the structs.
            return [
                judged[r] if r in judged else wire.decode_payload(payloads[starts[r] : ends[r]])
                for r in rows.tolist()
            ]

        return MessageBatch(matrices, messages)

    def _slow_path_message(self, frames: Sequence[bytes | memoryview]) -> ForwardPassMetrics | None:
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
    frames: Sequence[bytes | memoryview],
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
