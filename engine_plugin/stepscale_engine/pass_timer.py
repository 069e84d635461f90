"""How long each forward pass took: host clock, or CUDA events when the model runs in-process.

Scopes (the ``timing_scope`` field of each message):

* ``model_step_host`` (host monotonic clock): from the moment the engine submits
  the batch (``execute_model``) until its output is available (the sampling call
  returns, its future completes, or at the latest when the scheduler consumes
  the output). With pipelined batches (async scheduling, batch queue) the start
  is ``max(submission, completion of the previous batch)`` so that overlapping
  work is not counted twice. Used on CPU, and on GPU when the model runs in
  worker processes (tensor/pipeline parallel executors).
* ``model_step_cuda`` (CUDA events): an event recorded on the current stream
  when the batch is submitted and another after sampling is enqueued; the
  elapsed GPU time between them. Used when the engine process itself drives a
  CUDA device (``UniProcExecutor``). The end event is read only once the output
  is on the host, so reading it never synchronises the engine. If the end event
  is not complete (or was never recorded) by then, that pass falls back to host
  time and is labelled ``model_step_host``: the scope travels with each pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from stepscale_engine.wire import TIMING_SCOPE_MODEL_STEP_CUDA, TIMING_SCOPE_MODEL_STEP_HOST


class Elapsed(NamedTuple):
    """The measured duration of one pass."""

    wall_time_s: float  # seconds of this pass
    done_at: float  # its host completion time (the next pipelined batch starts no earlier)
    scope: str  # the ``timing_scope`` of what was actually measured


class PassTiming(Protocol):
    """Per-batch timing handle created at submission."""

    def mark_enqueued(self) -> None:
        """All GPU work of this batch is enqueued (engine thread, after sampling is called)."""

    def mark_done(self) -> None:
        """Output of this batch is available; any thread; the first call counts."""

    def elapsed_s(self, previous_done: float) -> Elapsed:
        """This pass's duration, starting no earlier than ``previous_done``."""


class PassTimer(Protocol):
    """Creates a timing handle per submitted batch."""

    scope: str  # the scope it measures when all goes well (each pass says its own)

    def begin(self) -> PassTiming:
        """Called when the engine submits a batch to the executor."""


class HostPassTiming:
    """Host monotonic timing of one batch."""

    __slots__ = ("_clock", "done_at", "submitted_at")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.submitted_at = clock()
        self.done_at: float | None = None

    def mark_enqueued(self) -> None:
        """Nothing to do: the host clock needs no marker on the GPU stream."""

    def mark_done(self) -> None:
        """Record the completion time; only the first call counts."""
        if self.done_at is None:
            self.done_at = self._clock()

    def elapsed_s(self, previous_done: float) -> Elapsed:
        """From ``max(submission, previous_done)`` to completion (now, if not marked)."""
        if self.done_at is None:
            self.done_at = self._clock()
        start = max(self.submitted_at, previous_done)
        return Elapsed(max(0.0, self.done_at - start), self.done_at, TIMING_SCOPE_MODEL_STEP_HOST)


class HostPassTimer:
    """Host timing (``model_step_host``)."""

    scope = TIMING_SCOPE_MODEL_STEP_HOST

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock

    def begin(self) -> HostPassTiming:
        """Start timing a batch the engine is submitting now."""
        return HostPassTiming(self._clock)


class CudaPassTiming:
    """CUDA-event timing of one batch; falls back to host time if events are not ready."""

    __slots__ = ("_end", "_host", "_new_event", "_start")

    def __init__(self, new_event: Callable[[], Any], clock: Callable[[], float]) -> None:
        self._new_event = new_event
        self._host = HostPassTiming(clock)
        self._start = new_event()
        self._start.record()
        self._end: Any = None

    def mark_enqueued(self) -> None:
        """Record the end event; the first call counts."""
        # Recorded on the engine thread's current stream right after sampling is
        # enqueued: the event completes when the GPU finishes this batch.
        if self._end is None:
            self._end = self._new_event()
            self._end.record()

    def mark_done(self) -> None:
        """Record the host completion time; only the first call counts."""
        # May run on an executor thread: touch only the host clock here.
        self._host.mark_done()

    def elapsed_s(self, previous_done: float) -> Elapsed:
        """GPU time between the events, or host time (labelled so) if the end is not ready."""
        host = self._host.elapsed_s(previous_done)
        end = self._end
        if end is None or not end.query():
            return host  # scope model_step_host: that is what this pass measured
        gpu_s = self._start.elapsed_time(end) / 1000.0
        return Elapsed(gpu_s, host.done_at, TIMING_SCOPE_MODEL_STEP_CUDA)


class CudaPassTimer:
    """CUDA-event timing (``model_step_cuda``)."""

    scope = TIMING_SCOPE_MODEL_STEP_CUDA

    def __init__(
        self,
        new_event: Callable[[], Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if new_event is None:
            import torch  # only on CUDA images, where torch is already loaded

            def new_event() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._new_event = new_event
        self._clock = clock

    def begin(self) -> CudaPassTiming:
        """Record the start event for a batch the engine is submitting now."""
        return CudaPassTiming(self._new_event, self._clock)


def choose_pass_timer(model_executor: Any, vllm_config: Any) -> PassTimer:
    """CUDA events when this process drives the CUDA device itself, host time otherwise."""
    executor_name = type(model_executor).__name__
    device = str(getattr(getattr(vllm_config, "device_config", None), "device", ""))
    if executor_name == "UniProcExecutor" and device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                return CudaPassTimer()
        except Exception:  # noqa: BLE001 - any torch problem: host timing is still right
            pass
    return HostPassTimer()
