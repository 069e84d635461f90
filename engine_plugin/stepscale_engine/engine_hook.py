"""EngineHook: turns each forward pass of one vLLM ``EngineCore`` into a ForwardPassMetrics.

Installed on an engine instance (never on vLLM's source) by wrapping four
instance methods, so it works with any scheduler class the user configures:

* ``scheduler.schedule``: when a non-empty batch is scheduled, compute its
  composition (O(batch)) and the queue state (O(1), see ``queue_tracker``);
* ``model_executor.execute_model``: the batch is submitted, start its timer;
* ``model_executor.sample_tokens``: the batch's work is enqueued; its output is
  ready when the call returns or, when it returns a future, when that future
  completes;
* ``scheduler.update_from_output``: the engine consumes the batch's output;
  finish the timing (pipelined batches: start = max(submit, previous done)) and
  hand the message to the publisher, which never blocks.

Both engine loops (``step`` and ``step_with_batch_queue``) go through these
four calls, so both are covered. Any exception inside the hook is counted and
logged (rate-limited) and the engine call proceeds untouched; after repeated
failures the hook turns itself off.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from stepscale_engine.batch_stats import scheduled_metrics
from stepscale_engine.pass_timer import PassTimer, PassTiming
from stepscale_engine.publisher import FpmPublisher
from stepscale_engine.queue_tracker import QueueTracker
from stepscale_engine.rate_limited_log import RateLimitedLog
from stepscale_engine.wire import QueuedRequestMetrics, ScheduledRequestMetrics

log = logging.getLogger(__name__)

# A batch that is scheduled but never consumed (engine error) must not leak.
MAX_PENDING_BATCHES = 64
# Consecutive hook failures after which the hook disables itself.
MAX_CONSECUTIVE_ERRORS = 100

REQUIRED_SCHEDULER_METHODS = ("schedule", "update_from_output")
REQUIRED_EXECUTOR_METHODS = ("execute_model",)


@dataclass(eq=False)
class PendingPass:
    """A scheduled batch on its way through the model."""

    scheduled: ScheduledRequestMetrics
    queued: QueuedRequestMetrics
    timing: PassTiming | None = None


class EngineHook:
    """Per-engine FPM producer; see the module docstring for where it hooks."""

    def __init__(
        self,
        scheduler: Any,
        model_executor: Any,
        publisher: FpmPublisher,
        timer: PassTimer,
    ) -> None:
        missing = [m for m in REQUIRED_SCHEDULER_METHODS if not hasattr(scheduler, m)]
        missing += [m for m in REQUIRED_EXECUTOR_METHODS if not hasattr(model_executor, m)]
        if missing:
            raise TypeError(f"engine lacks {', '.join(missing)}")
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.publisher = publisher
        self.timer = timer
        self.queue_tracker = QueueTracker.attach(scheduler)
        self.enabled = True
        self.errors = 0
        self.passes = 0
        self._consecutive_errors = 0
        self._pending: dict[int, PendingPass] = {}
        self._awaiting_sample: collections.deque[PendingPass] = collections.deque(
            maxlen=MAX_PENDING_BATCHES
        )
        self._previous_done = 0.0
        self._rate_log = RateLimitedLog(log)
        self._originals: dict[tuple[int, str], Any] = {}
        self._wrap(scheduler, "schedule", self._schedule)
        self._wrap(scheduler, "update_from_output", self._update_from_output)
        self._wrap(model_executor, "execute_model", self._execute_model)
        if hasattr(model_executor, "sample_tokens"):
            self._wrap(model_executor, "sample_tokens", self._sample_tokens)

    # -- installation ----------------------------------------------------------

    def _wrap(self, obj: Any, name: str, wrapper: Any) -> None:
        self._originals[(id(obj), name)] = getattr(obj, name)
        setattr(obj, name, wrapper)

    def uninstall(self) -> None:
        """Restore the engine's own methods and stop publishing."""
        for obj in (self.scheduler, self.model_executor):
            for name in (*REQUIRED_SCHEDULER_METHODS, *REQUIRED_EXECUTOR_METHODS, "sample_tokens"):
                if (id(obj), name) in self._originals:
                    setattr(obj, name, self._originals[(id(obj), name)])
        self.enabled = False
        self.publisher.close()

    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._consecutive_errors += 1
        self._rate_log.warning(where, "Stepscale FPM hook error in %s: %r", where, exc)
        if self._consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
            log.error(
                "Stepscale FPM hook disabled after %d consecutive errors", self._consecutive_errors
            )
            self.enabled = False

    # -- wrapped calls -----------------------------------------------------------

    def _schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._originals[(id(self.scheduler), "schedule")](*args, **kwargs)
        if self.enabled and output.total_num_scheduled_tokens > 0:
            try:
                if len(self._pending) >= MAX_PENDING_BATCHES:
                    self._pending.pop(next(iter(self._pending)))
                self._pending[id(output)] = PendingPass(
                    scheduled=scheduled_metrics(output, self.scheduler.requests),
                    queued=self.queue_tracker.metrics(),
                )
            except Exception as exc:  # noqa: BLE001 - never break the engine
                self._failed("schedule", exc)
        return output

    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        pending = self._pending.get(id(scheduler_output)) if self.enabled else None
        if pending is not None and pending.timing is None:
            try:
                pending.timing = self.timer.begin()
                self._awaiting_sample.append(pending)
            except Exception as exc:  # noqa: BLE001
                self._failed("execute_model", exc)
        original = self._originals[(id(self.model_executor), "execute_model")]
        return original(scheduler_output, *args, **kwargs)

    def _sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        result = self._originals[(id(self.model_executor), "sample_tokens")](*args, **kwargs)
        # Sampling is called in submission order, once per executed batch.
        pending = self._awaiting_sample.popleft() if self._awaiting_sample else None
        if pending is not None and pending.timing is not None:
            timing = pending.timing
            try:
                timing.mark_enqueued()
                if isinstance(result, Future) and not result.done():
                    result.add_done_callback(lambda _f: timing.mark_done())
                else:
                    timing.mark_done()
            except Exception as exc:  # noqa: BLE001
                self._failed("sample_tokens", exc)
        return result

    def _update_from_output(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        pending = self._pending.pop(id(scheduler_output), None)
        if pending is not None and pending.timing is not None and self.enabled:
            try:
                # Output is in hand: the latest possible completion time.
                pending.timing.mark_done()
                wall_time, self._previous_done = pending.timing.elapsed_s(self._previous_done)
                if pending in self._awaiting_sample:  # executed without a sampling call
                    self._awaiting_sample.remove(pending)
                self.publisher.publish(
                    wall_time, pending.scheduled, pending.queued, self.timer.scope
                )
                self.passes += 1
                self._consecutive_errors = 0
            except Exception as exc:  # noqa: BLE001
                self._failed("update_from_output", exc)
        original = self._originals[(id(self.scheduler), "update_from_output")]
        return original(scheduler_output, *args, **kwargs)
