"""Per-stream bookkeeping and the text table of ``stepscale tail``.

Pure: no sockets and no clock of its own (callers pass ``now``, in seconds of any
monotonic clock), so the table logic is unit-tested without timing.

A stream is one publisher, keyed by ``(worker_id, dp_rank)`` from the payload.
Sequence rules from ``docs/fpm-wire-v1.md``: a publisher numbers every
message, heartbeats included, by one from 0. A jump forward is lost messages (a
gap); a sequence that goes back means the publisher restarted; the same sequence
again is a duplicate (the same publisher reached through two endpoints, or two
publishers claiming one identity).
Malformed frames carry no identity we can trust, so they are counted per
endpoint and reason instead.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from stepscale_engine.wire import ForwardPassMetrics, FrameError

DEFAULT_RATE_WINDOW_S = 5.0
# Arrivals are counted in buckets of this width, so memory per stream stays
# bounded (window / width buckets) whatever the message rate.
_RATE_BUCKET_S = 0.1


@dataclass(frozen=True, order=True)
class StreamKey:
    """Identity of one publisher."""

    worker_id: str
    dp_rank: int


@dataclass
class StreamStats:
    """Running counters of one stream."""

    first_seen: float
    last_seen: float
    messages: int = 0
    passes: int = 0
    heartbeats: int = 0
    gaps: int = 0  # messages lost, from forward jumps in the sequence
    restarts: int = 0  # times the sequence went back
    duplicates: int = 0  # messages that repeated the last sequence
    last_counter: int | None = None
    last_wall_time_s: float | None = None  # of the last pass; heartbeats excluded
    wall_time_total_s: float = 0.0
    # [bucket index, arrivals in it], oldest first.
    _arrivals: collections.deque[list[int]] = field(default_factory=collections.deque)

    @property
    def mean_wall_time_s(self) -> float | None:
        """Mean wall_time over the passes seen, None before the first pass."""
        return self.wall_time_total_s / self.passes if self.passes else None

    def note_arrival(self, now: float, window_s: float) -> None:
        """Count one arrival at ``now`` for the rate."""
        bucket = math.floor(now / _RATE_BUCKET_S)
        if self._arrivals and self._arrivals[-1][0] == bucket:
            self._arrivals[-1][1] += 1
        else:
            self._arrivals.append([bucket, 1])
        self._forget_before(now - window_s)

    def rate_per_s(self, now: float, window_s: float) -> float:
        """Messages per second over the last ``window_s`` (or since first seen, if shorter).

        The span is at least one second so that the first few messages do not
        read as a burst of thousands per second.
        """
        self._forget_before(now - window_s)
        arrivals = sum(count for _, count in self._arrivals)
        span = min(window_s, max(now - self.first_seen, 1.0))
        return arrivals / span

    def _forget_before(self, cutoff: float) -> None:
        while self._arrivals and (self._arrivals[0][0] + 1) * _RATE_BUCKET_S <= cutoff:
            self._arrivals.popleft()


@dataclass(frozen=True)
class StreamRow:
    """One line of the table, values ready to print."""

    key: StreamKey
    rate_per_s: float
    passes: int
    last_wall_time_ms: float | None
    mean_wall_time_ms: float | None
    gaps: int
    restarts: int
    duplicates: int
    heartbeats: int
    age_s: float


class TailView:
    """What ``stepscale tail`` knows about the streams it has received."""

    def __init__(self, rate_window_s: float = DEFAULT_RATE_WINDOW_S) -> None:
        if rate_window_s <= 0:
            raise ValueError("rate_window_s must be positive")
        self.rate_window_s = rate_window_s
        self._streams: dict[StreamKey, StreamStats] = {}
        self._malformed: dict[str, collections.Counter[FrameError]] = {}
        self.updates = 0  # frames accounted, valid or not: tells a caller what is new

    @property
    def streams(self) -> Mapping[StreamKey, StreamStats]:
        """Counters per stream."""
        return self._streams

    @property
    def malformed(self) -> Mapping[str, collections.Counter[FrameError]]:
        """Rejected frames per endpoint and reason."""
        return self._malformed

    @property
    def total_messages(self) -> int:
        """Valid messages received over all streams, heartbeats included."""
        return sum(stats.messages for stats in self._streams.values())

    def record(self, msg: ForwardPassMetrics, now: float) -> StreamStats:
        """Account one decoded message received at ``now``."""
        key = StreamKey(msg.worker_id, msg.dp_rank)
        stats = self._streams.get(key)
        if stats is None:
            stats = self._streams[key] = StreamStats(first_seen=now, last_seen=now)
        last = stats.last_counter
        if last is not None:
            if msg.counter_id > last + 1:
                stats.gaps += msg.counter_id - last - 1
            elif msg.counter_id < last:
                stats.restarts += 1
            elif msg.counter_id == last:
                stats.duplicates += 1
        stats.last_counter = msg.counter_id
        self.updates += 1
        stats.messages += 1
        stats.last_seen = now
        stats.note_arrival(now, self.rate_window_s)
        if msg.is_heartbeat:
            stats.heartbeats += 1
        else:
            stats.passes += 1
            stats.last_wall_time_s = msg.wall_time
            stats.wall_time_total_s += msg.wall_time
        return stats

    def record_malformed(self, endpoint: str, reason: FrameError) -> None:
        """Account one rejected frame received on ``endpoint``."""
        self._malformed.setdefault(endpoint, collections.Counter())[reason] += 1
        self.updates += 1

    def malformed_by_reason(self) -> collections.Counter[FrameError]:
        """Rejected frames per reason over all endpoints."""
        total: collections.Counter[FrameError] = collections.Counter()
        for counts in self._malformed.values():
            total.update(counts)
        return total

    def rows(self, now: float) -> list[StreamRow]:
        """One row per stream, sorted by worker id then rank."""
        rows = []
        for key in sorted(self._streams):
            stats = self._streams[key]
            mean = stats.mean_wall_time_s
            rows.append(
                StreamRow(
                    key=key,
                    rate_per_s=stats.rate_per_s(now, self.rate_window_s),
                    passes=stats.passes,
                    last_wall_time_ms=(
                        None if stats.last_wall_time_s is None else stats.last_wall_time_s * 1e3
                    ),
                    mean_wall_time_ms=None if mean is None else mean * 1e3,
                    gaps=stats.gaps,
                    restarts=stats.restarts,
                    duplicates=stats.duplicates,
                    heartbeats=stats.heartbeats,
                    age_s=max(0.0, now - stats.last_seen),
                )
            )
        return rows

    def render(self, now: float) -> str:
        """The table as plain text (no terminal control codes), ending in a newline."""
        header = (
            "WORKER", "DP", "MSG/S", "PASSES", "LAST_MS", "MEAN_MS",
            "GAPS", "RESTARTS", "DUPS", "HEARTBEATS", "AGE_S",
        )  # fmt: skip
        lines = [header]
        for row in self.rows(now):
            lines.append(
                (
                    row.key.worker_id or '""',
                    str(row.key.dp_rank),
                    f"{row.rate_per_s:.1f}",
                    str(row.passes),
                    _milliseconds(row.last_wall_time_ms),
                    _milliseconds(row.mean_wall_time_ms),
                    str(row.gaps),
                    str(row.restarts),
                    str(row.duplicates),
                    str(row.heartbeats),
                    f"{row.age_s:.1f}",
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        # Text columns left-aligned, numbers right-aligned, as kubectl does.
        text = [
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
            for line in lines
        ]
        if len(lines) == 1:
            text.append("(no messages yet)")
        for endpoint in sorted(self._malformed):
            counts = self._malformed[endpoint]
            detail = " ".join(
                f"{reason.value}={counts[reason]}"
                for reason in sorted(counts, key=lambda r: r.value)
            )
            text.append(f"malformed from {endpoint}: {detail}")
        return "\n".join(text) + "\n"


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
