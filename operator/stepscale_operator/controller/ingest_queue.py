"""The queue between a deployment's subscriber thread and its model: bounded in bytes.

The subscriber thread puts each received batch here with its arrival time and
never waits; the model takes them out in merged chunks. Two things make that
cheap and safe under any load:

* **Merged chunks.** A model ingest costs about the same whatever its size (the
  cost model's and the load estimator's per-call work), and receives are small
  (tens of messages at a few thousand messages per second). :meth:`IngestQueue.take`
  merges consecutive batches into one of up to ``chunk_messages`` rows that
  arrived within ``merge_span_s`` of each other; the chunk is ingested at the
  arrival time of its last batch. So a pass may be accounted up to
  ``merge_span_s`` (2 s) after it arrived: small against the load window
  (30 s by default) and the decision interval, and what makes ingest cheap
  (the per-call cost is per stream, and a deployment has hundreds).
* **Bounded in bytes, shedding counted.** What a queued batch holds is estimated
  from its rows (:func:`queued_bytes`); a batch that would take the queue past
  ``max_bytes`` is shed whole, counted in :attr:`IngestQueue.shed_messages`, and
  the time of the last shedding is kept so that status can say it is happening.
  Only the columns are queued, never the raw payloads. Every queue of the process
  also draws on one shared :class:`ByteBudget` (``PROCESS_QUEUE_BUDGET``), so the
  total stays bounded however many deployments the operator watches.
"""

from __future__ import annotations

import threading
from collections import deque

from stepscale_operator.fpm_pipeline import PassMatrices

DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # one deployment's queue
DEFAULT_PROCESS_MAX_BYTES = 96 * 1024 * 1024  # every queue of the process together
DEFAULT_CHUNK_MESSAGES = 8192
DEFAULT_MERGE_SPAN_S = 2.0
# Per row besides its numbers: the list slot, the key tuple and its worker-id string
# (CPython object headers; the id's own characters are added per batch).
_ROW_OVERHEAD_BYTES = 8 + 64 + 56


def queued_bytes(matrices: PassMatrices) -> int:
    """An estimate of the memory one queued batch holds (its columns and row keys)."""
    n = len(matrices)
    if n == 0:
        return 0
    id_len = len(matrices.keys[0][0])
    return int(matrices.numeric.nbytes) + n * (_ROW_OVERHEAD_BYTES + id_len)


class ByteBudget:
    """Bytes that several queues may hold together (thread-safe)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(1, int(max_bytes))
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int, force: bool = False) -> bool:
        """Reserve ``n`` bytes if they fit (always with ``force``); True if reserved."""
        with self._lock:
            if not force and self.used + n > self.max_bytes:
                return False
            self.used += n
            return True

    def give_back(self, n: int) -> None:
        """Release ``n`` bytes reserved with :meth:`take`."""
        with self._lock:
            self.used -= n


PROCESS_QUEUE_BUDGET = ByteBudget(DEFAULT_PROCESS_MAX_BYTES)


class IngestQueue:
    """Received batches waiting for the model (thread-safe; see the module docstring)."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        chunk_messages: int = DEFAULT_CHUNK_MESSAGES,
        merge_span_s: float = DEFAULT_MERGE_SPAN_S,
        shared: ByteBudget = PROCESS_QUEUE_BUDGET,
    ) -> None:
        """``max_bytes``: this queue's bound; ``shared``: the bound of all queues."""
        self.max_bytes = max(1, int(max_bytes))
        self.shared = shared
        self.chunk_messages = max(1, int(chunk_messages))
        self.merge_span_s = float(merge_span_s)
        self._items: deque[tuple[float, PassMatrices, int]] = deque()
        self._lock = threading.Lock()
        self.messages = 0  # queued now
        self.bytes = 0  # queued now (estimate)
        self.shed_messages = 0  # monotonic
        self.shed_batches = 0  # monotonic
        self.last_shed: float | None = None  # arrival time of the last shed batch

    def put(self, arrived: float, matrices: PassMatrices) -> bool:
        """Queue a batch received at ``arrived``; False (and counted) when it is shed."""
        size = queued_bytes(matrices)
        with self._lock:
            # An empty queue always takes one batch, so no deployment starves.
            fits = self.bytes + size <= self.max_bytes and self.shared.take(size)
            if not fits and self._items:
                self.shed_messages += len(matrices)
                self.shed_batches += 1
                self.last_shed = arrived
                return False
            if not fits:
                self.shared.take(size, force=True)
            self._items.append((arrived, matrices, size))
            self.messages += len(matrices)
            self.bytes += size
            return True

    def shed_oldest(self, keep_messages: int, now: float) -> int:
        """Shed (and count) the oldest batches until at most ``keep_messages`` remain
        queued (whole batches: one more may stay); returns the messages shed."""
        shed = 0
        with self._lock:
            while self._items and self.messages - len(self._items[0][1]) >= keep_messages:
                _, matrices, size = self._items.popleft()
                self.messages -= len(matrices)
                self.bytes -= size
                self.shared.give_back(size)
                self.shed_batches += 1
                shed += len(matrices)
            if shed:
                self.shed_messages += shed
                self.last_shed = now
        return shed

    def clear(self) -> None:
        """Drop everything queued, uncounted (the deployment is going away), and give
        its bytes back to the shared budget."""
        with self._lock:
            self.shared.give_back(self.bytes)
            self._items.clear()
            self.messages = 0
            self.bytes = 0

    def oldest(self) -> float | None:
        """Arrival time of the oldest queued batch, or None when empty."""
        with self._lock:
            return self._items[0][0] if self._items else None

    def take(self, max_messages: int) -> tuple[float, PassMatrices] | None:
        """One merged chunk of at most ``max_messages`` rows (at least one batch), with
        the arrival time of its last batch; None when empty."""
        limit = max(1, min(int(max_messages), self.chunk_messages))
        parts: list[PassMatrices] = []
        with self._lock:
            if not self._items:
                return None
            first = self._items[0][0]
            rows = 0
            arrived = first
            while self._items:
                t, matrices, size = self._items[0]
                if parts and (rows + len(matrices) > limit or t - first > self.merge_span_s):
                    break
                self._items.popleft()
                parts.append(matrices)
                rows += len(matrices)
                arrived = t
                self.messages -= len(matrices)
                self.bytes -= size
                self.shared.give_back(size)
        return arrived, PassMatrices.concat(parts)

    def __len__(self) -> int:
        return self.messages
