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
failures the hook turns itself off: it restores the engine's methods and queues
and stops the publisher, heartbeats included, so that no subscriber mistakes a
busy engine whose hook broke for an idle one.
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
from stepscale_engine.vllm_compat import vllm_version
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
        # Names each object had in its own __dict__ before wrapping (else: a class method).
        self._own_attributes: set[tuple[int, str]] = set()
        try:
            self._wrap(scheduler, "schedule", self._schedule)
            self._wrap(scheduler, "update_from_output", self._update_from_output)
            self._wrap(model_executor, "execute_model", self._execute_model)
            if hasattr(model_executor, "sample_tokens"):
                self._wrap(model_executor, "sample_tokens", self._sample_tokens)
        except BaseException:
            self._detach()  # never leave the engine half-wrapped
            raise

    # -- installation ----------------------------------------------------------

    def _wrap(self, obj: Any, name: str, wrapper: Any) -> None:
        self._originals[(id(obj), name)] = getattr(obj, name)
        if name in getattr(obj, "__dict__", {}):
            self._own_attributes.add((id(obj), name))
        setattr(obj, name, wrapper)

    def uninstall(self) -> None:
        """Restore the engine's own methods and queue classes, and stop publishing."""
        self._detach()
        self.publisher.close()

    def _detach(self) -> None:
        """Put the engine back as it was before the hook: methods, then queues."""
        self.enabled = False
        for obj in (self.scheduler, self.model_executor):
            for name in (*REQUIRED_SCHEDULER_METHODS, *REQUIRED_EXECUTOR_METHODS, "sample_tokens"):
                key = (id(obj), name)
                if key not in self._originals:
                    continue
                if key in self._own_attributes:
                    setattr(obj, name, self._originals[key])
                elif name in getattr(obj, "__dict__", {}):
                    delattr(obj, name)  # the class's own method shows through again
        self.queue_tracker.detach()

    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        self._consecutive_errors += 1
        self._rate_log.warning(where, "Stepscale FPM hook error in %s: %r", where, exc)
        if self._consecutive_errors >= MAX_CONSECUTIVE_ERRORS and self.enabled:
            self._disable(
                f"{self._consecutive_errors} consecutive errors, the last in {where}: {exc!r}"
            )

    def _disable(self, reason: str) -> None:
        """Turn the hook off for good, without ever stalling the engine thread."""
        log.warning(
            "Stepscale FPM disabled on vLLM %s after %s; this engine stops publishing"
            " (no more heartbeats either)",
            vllm_version(),
            reason,
        )
        try:
            self._detach()
        finally:
            # Signal the sender to drain and close, without waiting for it here.
            self.publisher.close(timeout_s=0.0)

    # -- wrapped calls -----------------------------------------------------------

    def _schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._originals[(id(self.scheduler), "schedule")](*args, **kwargs)
        if self.enabled:
            try:
                self._on_scheduled(output)
            except Exception as exc:  # noqa: BLE001 - never break the engine
                self._failed("schedule", exc)
        return output

    def _on_scheduled(self, output: Any) -> None:
        if output.total_num_scheduled_tokens <= 0:
            return  # nothing runs: no pass, no message
        if len(self._pending) >= MAX_PENDING_BATCHES:
            self._pending.pop(next(iter(self._pending)))
        self._pending[id(output)] = PendingPass(
            scheduled=scheduled_metrics(output, self.scheduler.requests),
            queued=self.queue_tracker.metrics(),
        )

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
                elapsed = pending.timing.elapsed_s(self._previous_done)
                self._previous_done = elapsed.done_at
                if pending in self._awaiting_sample:  # executed without a sampling call
                    self._awaiting_sample.remove(pending)
                # The scope of this pass: what was actually measured for it.
                self.publisher.publish(
                    elapsed.wall_time_s, pending.scheduled, pending.queued, elapsed.scope
                )
                self.passes += 1
                self._consecutive_errors = 0
            except Exception as exc:  # noqa: BLE001
                self._failed("update_from_output", exc)
        original = self._originals[(id(self.scheduler), "update_from_output")]
        return original(scheduler_output, *args, **kwargs)
