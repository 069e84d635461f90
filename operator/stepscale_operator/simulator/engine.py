"""One simulated continuous-batching engine (vLLM V1 scheduling, simplified).

Each pass, like vLLM's scheduler: running decodes get one token each; then
running prompts still in prefill get chunks, then waiting requests are admitted
(FCFS), all within ``max_num_batched_tokens``, ``max_num_seqs`` and the KV
capacity. When the KV cache cannot hold the decodes' next tokens, the most
recently admitted request is preempted (recompute mode: its whole context is
recomputed later, and it counts as queued decode, then as prefill, per the FPM
spec).

Speed: a run of decode-only passes with nothing else changing (no arrival, no
completion, no KV pressure) is computed in one vectorised shot and processed as
one event; an arrival or a planner tick cuts the run at the pass in progress.
Decode requests do no per-pass Python work: each one finishes at a known pass
number, kept in a heap, and the sums over their contexts shift by the batch size
per pass.

Every pass produces the :class:`ForwardPassMetrics` our engine plugin would
publish, with the same field semantics, when ``emit_fpm`` is on.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    heartbeat,
)
from stepscale_operator.latency_model import EngineLimits
from stepscale_operator.simulator.ground_truth import StepTimeProfile

# Longest decode run computed ahead. Under load, arrivals cut runs after a few
# passes, so drawing thousands of step times ahead would be wasted work.
_MAX_RUN_STEPS = 128


@dataclass
class RequestTable:
    """Per-request inputs and outcomes for the whole simulation (index = request id)."""

    prompt: list[int]
    output: list[int]
    first_token_s: npt.NDArray[np.float64]
    finish_s: npt.NDArray[np.float64]
    preemptions: npt.NDArray[np.int64]

    @classmethod
    def create(cls, prompt: list[int], output: list[int]) -> RequestTable:
        """Outcomes start as NaN (not yet happened)."""
        n = len(prompt)
        return cls(
            prompt=prompt,
            output=[max(int(o), 1) for o in output],
            first_token_s=np.full(n, np.nan),
            finish_s=np.full(n, np.nan),
            preemptions=np.zeros(n, dtype=np.int64),
        )


def _variance(total: float, total_sq: float, n: int) -> float:
    if n <= 0:
        return 0.0
    mean = total / n
    return max(total_sq / n - mean * mean, 0.0)


class SimEngine:
    """A single engine; the fleet drives it with :meth:`start_step` and :meth:`finish_step`."""

    def __init__(
        self,
        worker_id: str,
        requests: RequestTable,
        limits: EngineLimits,
        profile: StepTimeProfile,
        seed: int,
        on_finish: Callable[[SimEngine, int], None] | None = None,
        emit_fpm: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.req = requests
        self.limits = limits
        self.profile = profile
        self.on_finish = on_finish
        self.emit_fpm = emit_fpm
        self.outbox: list[tuple[float, ForwardPassMetrics]] = []
        self.counter_id = 0
        self.last_emit_s = 0.0
        self._rng = random.Random(seed)
        self._np_rng = np.random.default_rng(seed)

        # Waiting queue: request ids; ``_need`` is what each must compute before its
        # next token (prompt, or prompt + generated after a preemption).
        self.waiting: deque[int] = deque()
        self._need: dict[int, int] = {}
        self._done: dict[int, int] = {}  # tokens computed of ``_need``
        self._generated: dict[int, int] = {}  # tokens produced so far
        self._preempted: set[int] = set()  # waiting because preempted (queued decode)
        self.prefilling: list[int] = []
        self._admitted: dict[int, None] = {}  # running requests in admission order

        # Decoding requests: context = offset + pass counter.
        self._pass = 0
        self._decode_offset: dict[int, int] = {}
        self._decode_finish: list[tuple[int, int]] = []  # (pass number, request id)
        self._off_sum = 0.0
        self._off_sq = 0.0
        self._kv_prefill = 0  # KV held by prefilling requests

        # The pass (or run of decode passes) in flight.
        self.busy = False
        self._run_ends: list[float] = []
        self._run_prefill: list[tuple[int, int]] = []  # (request id, chunk tokens)
        self._run_sched: ScheduledRequestMetrics | None = None
        self._run_queued: QueuedRequestMetrics | None = None
        self._run_start_pass = 0
        self._run_start_s = 0.0
        self._run_decode_kv0 = 0.0

        self.steps = 0
        # Per second of each run's end: [decode tokens, prompt tokens beside them]
        # (over every pass, its decode requests times the prompt tokens it computed).
        # Their ratio is the prompt tokens a decode token's pass carried, what delays
        # it; bench_prediction.py sets it against the latency model's window by
        # window, since over a whole run a changing load weighs its busiest minutes.
        self.beside_by_second: dict[int, list[int]] = {}
        self.busy_s = 0.0

    # -- load seen by the router -------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Requests assigned and not finished."""
        return len(self.waiting) + len(self._admitted)

    @property
    def decode_batch(self) -> int:
        """Requests currently in their decode phase."""
        return len(self._decode_offset)

    # -- arrivals ----------------------------------------------------------------

    def add_request(self, rid: int) -> None:
        """Queue a new request; it is scheduled at the next pass boundary."""
        self.waiting.append(rid)
        self._need[rid] = self.req.prompt[rid]
        self._done[rid] = 0
        self._generated[rid] = 0

    def cut_run(self, now: float) -> float | None:
        """End a decode run at the pass in progress at ``now``; returns its new end."""
        if not self.busy or self._run_prefill or len(self._run_ends) <= 1:
            return None
        j = bisect.bisect_left(self._run_ends, now)
        if j >= len(self._run_ends) - 1:
            return None
        del self._run_ends[j + 1 :]
        return self._run_ends[-1]

    # -- scheduling --------------------------------------------------------------

    def _kv_used(self) -> float:
        return self._kv_prefill + self._off_sum + len(self._decode_offset) * self._pass

    def _preempt_newest(self) -> None:
        rid = next(reversed(self._admitted))
        del self._admitted[rid]
        if rid in self._decode_offset:
            off = self._decode_offset.pop(rid)
            self._off_sum -= off
            self._off_sq -= off * off
            # Its finish entry stays in the heap and is skipped when popped.
            self._generated[rid] = off + self._pass - self.req.prompt[rid]
        else:
            self.prefilling.remove(rid)
            self._kv_prefill -= self._done[rid]
        self._need[rid] = self.req.prompt[rid] + self._generated[rid]
        self._done[rid] = 0
        self._preempted.add(rid)
        self.req.preemptions[rid] += 1
        self.waiting.appendleft(rid)

    def start_step(self, now: float) -> float | None:
        """Schedule the next pass (or decode run) at ``now``; returns when it ends."""
        limits = self.limits
        cap = limits.kv_capacity_tokens
        # Decodes first: make room for one more token each.
        while self._decode_offset and self._kv_used() + len(self._decode_offset) > cap:
            self._preempt_newest()
        batch = len(self._decode_offset)
        budget = limits.max_num_batched_tokens - batch
        kv_free = cap - self._kv_used() - batch
        chunks: list[tuple[int, int]] = []
        for rid in self.prefilling:
            if budget <= 0 or kv_free <= 0:
                break
            take = min(self._need[rid] - self._done[rid], budget, int(kv_free))
            chunks.append((rid, take))
            budget -= take
            kv_free -= take
        while (
            self.waiting
            and budget > 0
            and kv_free > 0
            and len(self._admitted) < limits.max_num_seqs
        ):
            rid = self.waiting[0]
            if self._need[rid] > cap:
                # Longer than the whole cache: vLLM rejects it; finish it empty.
                self.waiting.popleft()
                self._finish(rid, now)
                continue
            self.waiting.popleft()
            self._preempted.discard(rid)
            self._admitted[rid] = None
            self.prefilling.append(rid)
            take = min(self._need[rid], budget, int(kv_free))
            chunks.append((rid, take))
            budget -= take
            kv_free -= take
        if not chunks and batch == 0:
            self.busy = False
            return None

        self.busy = True
        self._run_prefill = chunks
        self._run_start_s = now
        if self.emit_fpm:
            self._run_queued = self._queued_metrics()
        self._run_start_pass = self._pass
        decode_kv = self._off_sum + batch * self._pass
        self._run_decode_kv0 = decode_kv
        if chunks:
            p_tokens = sum(t for _, t in chunks)
            p_kv = sum(self._done[r] for r, _ in chunks)
            mean = self.profile.mean_time(p_tokens, p_kv, len(chunks), batch, decode_kv)
            dt = self.profile.sample(mean, self._rng)
            self._run_ends = [now + dt]
            if self.emit_fpm:
                lengths = [float(self._need[r]) for r, _ in chunks]
                self._run_sched = ScheduledRequestMetrics(
                    num_prefill_requests=len(chunks),
                    sum_prefill_tokens=p_tokens,
                    var_prefill_length=float(np.var(lengths)) if len(lengths) > 1 else 0.0,
                    sum_prefill_kv_tokens=p_kv,
                    num_decode_requests=batch,
                    sum_decode_kv_tokens=int(decode_kv),
                    var_decode_kv_tokens=_variance(self._off_sum, self._off_sq, batch),
                )
            return self._run_ends[0]

        # Decode-only: run until the first completion or until the KV cache is full.
        steps = self._decode_finish_pass() - self._pass
        kv_room = cap - self._kv_used()
        steps = max(1, min(steps, int(kv_room // batch), _MAX_RUN_STEPS))
        times = self.profile.decode_run(batch, decode_kv, steps, self._np_rng)
        self._run_ends = (now + np.cumsum(times)).tolist()
        return self._run_ends[-1]

    def _decode_finish_pass(self) -> int:
        heap = self._decode_finish
        while heap:
            when, rid = heap[0]
            off = self._decode_offset.get(rid)
            # Skip entries of requests preempted (or re-admitted with a new finish).
            if off is not None and when == self._finish_pass_of(rid, off):
                return when
            heapq.heappop(heap)
        return self._pass + _MAX_RUN_STEPS

    def _finish_pass_of(self, rid: int, offset: int) -> int:
        # Context = offset + pass; the request ends when context reaches
        # prompt + output (its last token produced).
        return self.req.prompt[rid] + self.req.output[rid] - offset

    def _queued_metrics(self) -> QueuedRequestMetrics:
        new_n = 0
        new_sum = 0.0
        new_sq = 0.0
        pre_n = 0
        pre_sum = 0.0
        pre_sq = 0.0
        for rid in self.waiting:
            need = float(self._need[rid])
            if rid in self._preempted:
                pre_n += 1
                pre_sum += need
                pre_sq += need * need
            else:
                new_n += 1
                new_sum += need
                new_sq += need * need
        return QueuedRequestMetrics(
            num_prefill_requests=new_n,
            sum_prefill_tokens=int(new_sum),
            var_prefill_length=_variance(new_sum, new_sq, new_n),
            num_decode_requests=pre_n,
            sum_decode_kv_tokens=int(pre_sum),
            var_decode_kv_tokens=_variance(pre_sum, pre_sq, pre_n),
        )

    # -- completion --------------------------------------------------------------

    def finish_step(self) -> float:
        """Apply the pass (or run) in flight; returns the time it ended."""
        ends = self._run_ends
        end = ends[-1]
        start = self._run_start_pass
        batch = len(self._decode_offset)
        n_passes = len(ends)
        if self.emit_fpm:
            queued = self._run_queued
            assert queued is not None
            if self._run_prefill:
                assert self._run_sched is not None
                self._emit(end, end - self._run_start_s, self._run_sched, queued)
            else:
                var = _variance(self._off_sum, self._off_sq, batch)
                walls = [ends[0] - self._run_start_s]
                walls.extend(b - a for a, b in zip(ends, ends[1:], strict=False))
                for i in range(n_passes):
                    sched = ScheduledRequestMetrics(
                        num_decode_requests=batch,
                        sum_decode_kv_tokens=int(self._run_decode_kv0 + batch * i),
                        var_decode_kv_tokens=var,
                    )
                    self._emit(ends[i], walls[i], sched, queued)
        self.steps += n_passes
        if batch:
            cell = self.beside_by_second.setdefault(int(end), [0, 0])
            cell[0] += batch * n_passes
            cell[1] += batch * sum(t for _, t in self._run_prefill)
        self.busy_s += end - self._run_start_s
        self._pass = start + n_passes

        # Prefill chunks: the request that completes its context produces a token.
        if self._run_prefill:
            for rid, take in self._run_prefill:
                self._done[rid] += take
                self._kv_prefill += take
                if self._done[rid] < self._need[rid]:
                    continue
                self.prefilling.remove(rid)
                self._kv_prefill -= self._done[rid]
                if self._generated[rid] == 0:
                    self.req.first_token_s[rid] = end
                self._generated[rid] += 1
                if self._generated[rid] >= self.req.output[rid]:
                    del self._admitted[rid]
                    self._finish(rid, end)
                    continue
                # Joins the decodes after this pass: context = prompt + generated.
                offset = self.req.prompt[rid] + self._generated[rid] - self._pass
                self._decode_offset[rid] = offset
                self._off_sum += offset
                self._off_sq += offset * offset
                heapq.heappush(self._decode_finish, (self._finish_pass_of(rid, offset), rid))

        # Decodes that produced their last token.
        heap = self._decode_finish
        while heap and heap[0][0] <= self._pass:
            when, rid = heapq.heappop(heap)
            off = self._decode_offset.get(rid)
            if off is None or when != self._finish_pass_of(rid, off):
                continue
            del self._decode_offset[rid]
            del self._admitted[rid]
            self._off_sum -= off
            self._off_sq -= off * off
            self._finish(rid, end)
        self.busy = False
        return end

    def _finish(self, rid: int, now: float) -> None:
        self.req.finish_s[rid] = now
        for table in (self._need, self._done, self._generated):
            table.pop(rid, None)
        if self.on_finish is not None:
            self.on_finish(self, rid)

    # -- metrics -----------------------------------------------------------------

    def _emit(
        self,
        when: float,
        wall: float,
        sched: ScheduledRequestMetrics,
        queued: QueuedRequestMetrics,
    ) -> None:
        self.outbox.append(
            (
                when,
                ForwardPassMetrics(
                    worker_id=self.worker_id,
                    counter_id=self.counter_id,
                    wall_time=max(wall, 1e-9),
                    scheduled_requests=sched,
                    queued_requests=queued,
                ),
            )
        )
        self.counter_id += 1
        self.last_emit_s = when

    def heartbeat_if_idle(self, now: float, interval_s: float = 1.0) -> None:
        """The publisher's idle heartbeat, when nothing was published for ``interval_s``."""
        if self.emit_fpm and now - self.last_emit_s >= interval_s:
            self.outbox.append((now, heartbeat(self.worker_id, 0, self.counter_id)))
            self.counter_id += 1
            self.last_emit_s = now
