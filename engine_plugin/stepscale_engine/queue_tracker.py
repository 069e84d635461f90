"""Queue state (``QueuedRequestMetrics``) kept incrementally, O(1) per iteration.

Scanning the waiting queue every forward pass costs O(waiting) on the engine's
hot path, which is exactly when queues are long. Instead each vLLM waiting queue
is given a subclass (its ``__class__`` is swapped, so ``isinstance`` checks and
the scheduler's own code are unaffected) whose mutators update running sums as
requests enter and leave. Each request's contribution is remembered when it
enters, so it leaves with exactly what it brought even if its status changed.

A cheap consistency check (tracked count versus ``len(queue)``) catches anything
that mutates a queue behind the tracked methods (a custom scheduler calling
deque methods directly, say); the tracker then rebuilds its sums by one scan and
counts a resync.

The tracked methods run inside vLLM's own calls, so they never raise on the
tracker's account: if a request lacks what the tracker reads (a drifted vLLM),
it is left uncounted, the count check then sees the difference, and the resync
fails inside the hook, which counts the error and eventually turns itself off.
:meth:`QueueTracker.detach` gives the queues their own class back.

Classification per the spec: preempted requests and requests waiting for remote
KV are queued *decode* with context = all their tokens (vLLM resets a preempted
request's computed count to 0, so it must recompute prompt plus output); every
other waiting request is queued *prefill* with its prompt length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stepscale_engine.batch_stats import population_variance
from stepscale_engine.wire import QueuedRequestMetrics

# Names the queue attributes have had across vLLM V1 releases.
QUEUE_ATTRIBUTES = ("waiting", "kv_holding_waiting", "skipped_waiting")
_DECODE_STATUS_NAMES = frozenset({"PREEMPTED", "WAITING_FOR_REMOTE_KVS"})
_TRACKED_METHODS = (
    "add_request",
    "pop_request",
    "prepend_request",
    "prepend_requests",
    "remove_request",
    "remove_requests",
)


def request_contribution(request: Any) -> tuple[bool, int]:
    """``(is_decode, tokens)`` a waiting request adds to the queue aggregates."""
    status = getattr(request, "status", None)
    if getattr(status, "name", None) in _DECODE_STATUS_NAMES:
        return True, int(request.num_tokens)
    return False, int(request.num_prompt_tokens)


@dataclass
class QueueAggregates:
    """Running sums over the requests of the tracked queues."""

    num_prefill: int = 0
    sum_prefill_tokens: int = 0
    sumsq_prefill_tokens: float = 0.0
    num_decode: int = 0
    sum_decode_kv: int = 0
    sumsq_decode_kv: float = 0.0
    version: int = 0  # bumped on every change, so readers can reuse a result

    def add(self, is_decode: bool, tokens: int, sign: int = 1) -> None:
        """Add (``sign=1``) or remove (``sign=-1``) one request's contribution."""
        self.version += 1
        if is_decode:
            self.num_decode += sign
            self.sum_decode_kv += sign * tokens
            self.sumsq_decode_kv += sign * float(tokens) * tokens
        else:
            self.num_prefill += sign
            self.sum_prefill_tokens += sign * tokens
            self.sumsq_prefill_tokens += sign * float(tokens) * tokens

    @property
    def count(self) -> int:
        """Requests counted."""
        return self.num_prefill + self.num_decode

    def to_metrics(self) -> QueuedRequestMetrics:
        """The wire struct for the current sums."""
        return QueuedRequestMetrics(
            num_prefill_requests=self.num_prefill,
            sum_prefill_tokens=self.sum_prefill_tokens,
            var_prefill_length=population_variance(
                self.sum_prefill_tokens, self.sumsq_prefill_tokens, self.num_prefill
            ),
            num_decode_requests=self.num_decode,
            sum_decode_kv_tokens=self.sum_decode_kv,
            var_decode_kv_tokens=population_variance(
                self.sum_decode_kv, self.sumsq_decode_kv, self.num_decode
            ),
        )


def scan_queued_metrics(queues: Iterable[Iterable[Any]]) -> QueuedRequestMetrics:
    """The straightforward O(waiting) computation: one pass over every request.

    Used to rebuild sums after a resync, and as the baseline the benchmark
    compares the incremental tracker against.
    """
    agg = QueueAggregates()
    for queue in queues:
        for request in queue:
            agg.add(*request_contribution(request))
    return agg.to_metrics()


def _enter(queue: Any, request: Any) -> None:
    key = id(request)
    if key in queue._stepscale_contrib:  # already counted: never count twice
        return
    try:
        contribution = request_contribution(request)
    except Exception:  # noqa: BLE001 - runs inside the engine's call: never raise
        return  # left uncounted: the count check in metrics() notices
    queue._stepscale_contrib[key] = contribution
    queue._stepscale_agg.add(*contribution)


def _leave(queue: Any, request: Any) -> None:
    contribution = queue._stepscale_contrib.pop(id(request), None)
    if contribution is not None:
        queue._stepscale_agg.add(*contribution, sign=-1)


def _tracking_methods(base: type) -> dict[str, Any]:
    """Mutators of ``base`` that also keep the running sums current.

    They call ``base``'s own methods explicitly: the tracked class has ``base``
    as its only parent, so its instance layout is identical and ``__class__``
    can be swapped for any queue class (a deque subclass or a plain object).
    """

    def add_request(self: Any, request: Any) -> None:
        base.add_request(self, request)  # type: ignore[attr-defined]
        _enter(self, request)

    def pop_request(self: Any) -> Any:
        request = base.pop_request(self)  # type: ignore[attr-defined]
        _leave(self, request)
        return request

    def prepend_request(self: Any, request: Any) -> None:
        base.prepend_request(self, request)  # type: ignore[attr-defined]
        _enter(self, request)

    def prepend_requests(self: Any, requests: Iterable[Any]) -> None:
        batch = list(requests)
        base.prepend_requests(self, batch)  # type: ignore[attr-defined]
        for request in batch:
            _enter(self, request)

    def remove_request(self: Any, request: Any) -> None:
        base.remove_request(self, request)  # type: ignore[attr-defined]
        _leave(self, request)

    def remove_requests(self: Any, requests: Iterable[Any]) -> None:
        batch = list(requests)
        base.remove_requests(self, batch)  # type: ignore[attr-defined]
        for request in batch:
            _leave(self, request)

    return {
        "add_request": add_request,
        "pop_request": pop_request,
        "prepend_request": prepend_request,
        "prepend_requests": prepend_requests,
        "remove_request": remove_request,
        "remove_requests": remove_requests,
    }


# Original queue class -> its tracked subclass.
_subclass_cache: dict[type, type] = {}


def _tracked_class(cls: type) -> type:
    tracked = _subclass_cache.get(cls)
    if tracked is None:
        tracked = type(f"Tracked{cls.__name__}", (cls,), _tracking_methods(cls))
        _subclass_cache[cls] = tracked
    return tracked


def is_tracked(queue: Any) -> bool:
    """True if ``queue`` already keeps Stepscale's running sums."""
    return type(queue) in _subclass_cache.values()


class QueueTracker:
    """Incremental ``QueuedRequestMetrics`` over a scheduler's waiting queues."""

    def __init__(self, queues: list[Any], converted: dict[int, type] | None = None) -> None:
        self._queues = queues
        # id(queue) -> its class before this tracker swapped it (restored by detach).
        self._converted = converted or {}
        self.resyncs = 0
        # Most passes leave the queues untouched: reuse the last struct then.
        self._cached_key: tuple[tuple[int, int], ...] = ()
        self._cached = QueuedRequestMetrics()

    @classmethod
    def attach(cls, scheduler: Any) -> QueueTracker:
        """Start tracking every waiting queue of ``scheduler``.

        Raises ``TypeError`` if the scheduler has no queue with the expected
        methods (an unknown vLLM version or scheduler); the caller then disables
        itself rather than guessing.
        """
        queues = []
        converted: dict[int, type] = {}
        for name in QUEUE_ATTRIBUTES:
            queue = getattr(scheduler, name, None)
            if queue is None or not all(hasattr(queue, m) for m in _TRACKED_METHODS):
                continue
            if not is_tracked(queue):
                converted[id(queue)] = type(queue)
                queue.__class__ = _tracked_class(type(queue))
                queue._stepscale_contrib = {}
                queue._stepscale_agg = QueueAggregates()
                _rebuild(queue)
            queues.append(queue)
        if not queues:
            raise TypeError(
                f"{type(scheduler).__name__} has none of the waiting queues {QUEUE_ATTRIBUTES}"
            )
        return cls(queues, converted)

    def detach(self) -> None:
        """Give the queues this tracker converted their own class back, untracked.

        Afterwards the scheduler's queue calls cost exactly what they cost
        without the plugin. Queues another tracker converted are left alone.
        """
        for queue in self._queues:
            original = self._converted.pop(id(queue), None)
            if original is None:
                continue
            queue.__class__ = original
            for attribute in ("_stepscale_contrib", "_stepscale_agg"):
                queue.__dict__.pop(attribute, None)

    def metrics(self) -> QueuedRequestMetrics:
        """Current queue state; O(number of queues) unless a resync is needed."""
        aggs: list[QueueAggregates] = []
        for queue in self._queues:
            agg: QueueAggregates = queue._stepscale_agg
            if agg.count != len(queue):
                _rebuild(queue)
                self.resyncs += 1
                agg = queue._stepscale_agg
            aggs.append(agg)
        key = tuple((id(agg), agg.version) for agg in aggs)
        if key == self._cached_key:
            return self._cached
        total = QueueAggregates()
        for agg in aggs:
            total.num_prefill += agg.num_prefill
            total.sum_prefill_tokens += agg.sum_prefill_tokens
            total.sumsq_prefill_tokens += agg.sumsq_prefill_tokens
            total.num_decode += agg.num_decode
            total.sum_decode_kv += agg.sum_decode_kv
            total.sumsq_decode_kv += agg.sumsq_decode_kv
        self._cached_key, self._cached = key, total.to_metrics()
        return self._cached


def _rebuild(queue: Any) -> None:
    contrib: dict[int, tuple[bool, int]] = {}
    agg = QueueAggregates()
    for request in queue:
        contribution = request_contribution(request)
        contrib[id(request)] = contribution
        agg.add(*contribution)
    # Keep versions rising across rebuilds so a cached result is never reused.
    previous = getattr(queue, "_stepscale_agg", None)
    agg.version += 1 + (previous.version if previous is not None else 0)
    queue._stepscale_contrib = contrib
    queue._stepscale_agg = agg
