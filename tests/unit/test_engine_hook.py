"""Engine-side computation: batch composition, incremental queue state, and EngineHook.

Batch composition is checked on real vLLM ``SchedulerOutput`` objects against an
independent reference written from the spec; the queue tracker runs on vLLM's
own ``FCFSRequestQueue``/``PriorityRequestQueue`` and must equal the plain scan
after every operation. EngineHook is driven with fake scheduler and executor
objects that call it the way ``EngineCore.step`` and ``step_with_batch_queue``
do, with an injected clock so wall times are exact.

There is no GPU on these machines: CUDA is mocked. ``CudaPassTimer`` is given
fake event objects with the ``record``/``query``/``elapsed_time`` interface of
``torch.cuda.Event``, so only its logic is tested here, not real CUDA timing.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="the queue tests use vLLM's own queue classes")

from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.core.sched.request_queue import (  # noqa: E402
    FCFSRequestQueue,
    PriorityRequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from stepscale_engine import engine_hook  # noqa: E402
from stepscale_engine.batch_stats import scheduled_metrics  # noqa: E402
from stepscale_engine.engine_hook import EngineHook  # noqa: E402
from stepscale_engine.pass_timer import (  # noqa: E402
    CudaPassTimer,
    HostPassTimer,
    choose_pass_timer,
)
from stepscale_engine.queue_tracker import (  # noqa: E402
    QueueTracker,
    is_tracked,
    request_contribution,
    scan_queued_metrics,
)
from stepscale_engine.vllm_compat import vllm_version  # noqa: E402
from stepscale_engine.wire import (  # noqa: E402
    TIMING_SCOPE_MODEL_STEP_CUDA,
    TIMING_SCOPE_MODEL_STEP_HOST,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)

# Both vLLM queue classes: the deque-based FCFS queue and the heap-based
# priority queue (whose instance layout differs from a deque's).
POLICIES = [
    SchedulingPolicy.FCFS,
    pytest.param(SchedulingPolicy.PRIORITY, id="priority"),
]


# -- scheduler outputs -------------------------------------------------------------


@dataclass
class NewReq:
    """A request scheduled for the first time."""

    rid: str
    prompt_len: int
    computed: int  # prefix-cache hit
    scheduled: int  # tokens this step, spec tokens included
    spec: int = 0
    embeds: bool = False  # prompt embeddings: no token ids in the output


@dataclass
class CachedReq:
    """A request scheduled before (running, chunked continuation or resumed)."""

    rid: str
    computed: int
    num_output: int
    scheduled: int
    spec: int = 0
    num_tokens: int = 0  # what the scheduler's Request says: prompt + output


def make_output(new: Sequence[NewReq] = (), cached: Sequence[CachedReq] = ()) -> SchedulerOutput:
    """A real vLLM SchedulerOutput for the described batch."""
    batch: list[NewReq | CachedReq] = [*new, *cached]
    num_scheduled = {r.rid: r.scheduled for r in batch}
    spec = {r.rid: [-1] * r.spec for r in batch if r.spec}
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.rid,
                prompt_token_ids=None if r.embeds else list(range(r.prompt_len)),
                mm_features=[],
                sampling_params=None,
                pooling_params=None,
                block_ids=([],),
                num_computed_tokens=r.computed,
                lora_request=None,
            )
            for r in new
        ],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[r.rid for r in cached],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * len(cached),
            num_computed_tokens=[r.computed for r in cached],
            num_output_tokens=[r.num_output for r in cached],
        ),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens=spec,
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def request_table(new: Sequence[NewReq] = (), cached: Sequence[CachedReq] = ()) -> dict[str, Any]:
    """The scheduler's ``requests`` dict: only ``num_tokens`` is read."""
    table: dict[str, Any] = {r.rid: SimpleNamespace(num_tokens=r.prompt_len) for r in new}
    table.update({r.rid: SimpleNamespace(num_tokens=r.num_tokens) for r in cached})
    return table


def reference_metrics(
    new: Sequence[NewReq], cached: Sequence[CachedReq]
) -> ScheduledRequestMetrics:
    """The spec's definitions, computed the plain way."""
    prefill_lengths: list[int] = []
    prefill_tokens = prefill_kv = 0
    decode_contexts: list[int] = []
    for r in new:
        prefill_lengths.append(r.prompt_len)
        prefill_tokens += r.scheduled - r.spec
        prefill_kv += r.computed
    for c in cached:
        step = c.scheduled - c.spec
        if c.num_output == 0 or step > 1:  # context phase, or recomputing after preemption
            prefill_lengths.append(c.num_tokens)
            prefill_tokens += step
            prefill_kv += c.computed
        else:
            decode_contexts.append(c.computed)
    return ScheduledRequestMetrics(
        num_prefill_requests=len(prefill_lengths),
        sum_prefill_tokens=prefill_tokens,
        var_prefill_length=statistics.pvariance(prefill_lengths) if prefill_lengths else 0.0,
        sum_prefill_kv_tokens=prefill_kv,
        num_decode_requests=len(decode_contexts),
        sum_decode_kv_tokens=sum(decode_contexts),
        var_decode_kv_tokens=statistics.pvariance(decode_contexts) if decode_contexts else 0.0,
    )


def assert_metrics_close(actual: Any, expected: Any) -> None:
    for name in expected.__struct_fields__:
        assert getattr(actual, name) == pytest.approx(
            getattr(expected, name), rel=1e-9, abs=1e-6
        ), name


def test_empty_output_is_all_zero() -> None:
    assert scheduled_metrics(SchedulerOutput.make_empty(), {}) == ScheduledRequestMetrics()


def test_new_requests_are_prefill_with_their_prompt_length() -> None:
    new = [
        NewReq("a", prompt_len=100, computed=16, scheduled=84),
        NewReq("b", prompt_len=300, computed=0, scheduled=300),
    ]
    result = scheduled_metrics(make_output(new), request_table(new))
    assert result == ScheduledRequestMetrics(
        num_prefill_requests=2,
        sum_prefill_tokens=384,
        var_prefill_length=10_000.0,
        sum_prefill_kv_tokens=16,
    )


def test_chunked_prefill_continuation_is_prefill_with_the_full_prompt() -> None:
    cached = [CachedReq("c", computed=512, num_output=0, scheduled=256, num_tokens=1000)]
    result = scheduled_metrics(make_output(cached=cached), request_table(cached=cached))
    assert result == ScheduledRequestMetrics(
        num_prefill_requests=1,
        sum_prefill_tokens=256,
        sum_prefill_kv_tokens=512,
    )


def test_decode_requests_sum_and_variance_of_context() -> None:
    cached = [
        CachedReq("d1", computed=100, num_output=3, scheduled=1, num_tokens=101),
        CachedReq("d2", computed=300, num_output=9, scheduled=1, num_tokens=301),
    ]
    result = scheduled_metrics(make_output(cached=cached), request_table(cached=cached))
    assert result == ScheduledRequestMetrics(
        num_decode_requests=2,
        sum_decode_kv_tokens=400,
        var_decode_kv_tokens=10_000.0,
    )


def test_request_resuming_after_preemption_is_prefill() -> None:
    # Has output tokens, but recomputes 120 tokens of its context this step.
    cached = [CachedReq("r", computed=0, num_output=5, scheduled=120, num_tokens=125)]
    result = scheduled_metrics(make_output(cached=cached), request_table(cached=cached))
    assert (result.num_prefill_requests, result.num_decode_requests) == (1, 0)
    assert (result.sum_prefill_tokens, result.sum_prefill_kv_tokens) == (120, 0)


def test_speculative_tokens_do_not_make_a_decode_a_prefill() -> None:
    cached = [CachedReq("s", computed=50, num_output=4, scheduled=4, spec=3, num_tokens=54)]
    result = scheduled_metrics(make_output(cached=cached), request_table(cached=cached))
    assert (result.num_prefill_requests, result.num_decode_requests) == (0, 1)
    assert result.sum_decode_kv_tokens == 50


def test_prompt_embeddings_take_the_length_from_the_request() -> None:
    new = [NewReq("e", prompt_len=77, computed=0, scheduled=77, embeds=True)]
    with_table = scheduled_metrics(make_output(new), {"e": SimpleNamespace(num_tokens=77)})
    assert with_table.num_prefill_requests == 1 and with_table.sum_prefill_tokens == 77
    # Without the table: computed + chunk; with a second request the variance shows it.
    pair = [*new, NewReq("f", prompt_len=7, computed=0, scheduled=7)]
    assert scheduled_metrics(make_output(pair), None).var_prefill_length == pytest.approx(
        statistics.pvariance([77, 7])
    )


def test_missing_request_table_falls_back_to_computed_plus_step() -> None:
    cached = [
        CachedReq("c", computed=512, num_output=0, scheduled=256, num_tokens=1000),
        CachedReq("d", computed=0, num_output=0, scheduled=100, num_tokens=400),
    ]
    result = scheduled_metrics(make_output(cached=cached), None)
    assert result.var_prefill_length == pytest.approx(statistics.pvariance([768, 100]))


new_reqs = st.builds(
    lambda i, prompt, hit, chunk_frac, spec: NewReq(
        f"n{i}",
        prompt,
        min(hit, prompt - 1),
        max(1, int((prompt - min(hit, prompt - 1)) * chunk_frac)) + spec,
        spec,
    ),
    st.integers(0, 10**6),
    st.integers(1, 5000),
    st.integers(0, 4000),
    st.floats(0.01, 1.0),
    st.integers(0, 3),
)
cached_reqs = st.builds(
    lambda i, computed, n_out, step, spec: CachedReq(
        f"c{i}", computed, n_out, step + spec, spec, num_tokens=computed + max(n_out, step)
    ),
    st.integers(0, 10**6),
    st.integers(0, 8000),
    st.integers(0, 500),
    st.integers(1, 600),
    st.integers(0, 3),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(new_reqs, max_size=8, unique_by=lambda r: r.rid),
    st.lists(cached_reqs, max_size=40, unique_by=lambda r: r.rid),
)
def test_scheduled_metrics_match_the_reference(new: list[NewReq], cached: list[CachedReq]) -> None:
    cached = [c for c in cached if c.rid not in {n.rid for n in new}]
    result = scheduled_metrics(make_output(new, cached), request_table(new, cached))
    assert_metrics_close(result, reference_metrics(new, cached))


# -- queue tracker -------------------------------------------------------------------


class FakeRequest:
    """The attributes of vLLM's Request that the queues and the tracker read."""

    def __init__(
        self,
        rid: str,
        prompt: int,
        output: int = 0,
        status: RequestStatus = RequestStatus.WAITING,
        priority: int = 0,
        arrival_time: float = 0.0,
    ) -> None:
        self.request_id = rid
        self.num_prompt_tokens = prompt
        self.num_output_tokens = output
        self.status = status
        self.priority = priority
        self.arrival_time = arrival_time

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def __lt__(self, other: FakeRequest) -> bool:
        # Same order as vllm.v1.request.Request.__lt__.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return f"FakeRequest({self.request_id}, {self.status.name})"


def make_scheduler(policy: SchedulingPolicy) -> SimpleNamespace:
    return SimpleNamespace(
        waiting=create_request_queue(policy), kv_holding_waiting=create_request_queue(policy)
    )


def queues_of(scheduler: SimpleNamespace) -> list[Any]:
    return [scheduler.waiting, scheduler.kv_holding_waiting]


def test_contribution_classifies_by_status() -> None:
    assert request_contribution(FakeRequest("a", 100, 7)) == (False, 100)
    assert request_contribution(FakeRequest("b", 100, 7, RequestStatus.PREEMPTED)) == (True, 107)
    remote = FakeRequest("c", 100, 0, RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert request_contribution(remote) == (True, 100)
    grammar = FakeRequest("d", 30, 0, RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)
    assert request_contribution(grammar) == (False, 30)


def test_scan_of_known_queue() -> None:
    queue = [
        FakeRequest("a", 100),
        FakeRequest("b", 300),
        FakeRequest("p", 50, 10, RequestStatus.PREEMPTED),
    ]
    assert scan_queued_metrics([queue]) == QueuedRequestMetrics(
        num_prefill_requests=2,
        sum_prefill_tokens=400,
        var_prefill_length=10_000.0,
        num_decode_requests=1,
        sum_decode_kv_tokens=60,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_attach_keeps_the_queue_class_and_counts_what_is_there(policy: SchedulingPolicy) -> None:
    scheduler = make_scheduler(policy)
    scheduler.waiting.add_request(FakeRequest("a", 10, arrival_time=1.0))
    scheduler.waiting.add_request(FakeRequest("b", 30, arrival_time=2.0))
    original_class = type(scheduler.waiting)
    tracker = QueueTracker.attach(scheduler)
    assert isinstance(scheduler.waiting, original_class)
    assert type(scheduler.waiting) is not original_class
    assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))
    assert tracker.metrics().num_prefill_requests == 2
    # Attaching again neither re-wraps nor double-counts.
    again = QueueTracker.attach(scheduler)
    assert type(scheduler.waiting).__mro__.count(original_class) == 1
    assert again.metrics() == tracker.metrics()
    assert [r.request_id for r in scheduler.waiting] == ["a", "b"]  # order untouched


def test_attach_rejects_a_scheduler_without_queues() -> None:
    with pytest.raises(TypeError, match="waiting queues"):
        QueueTracker.attach(SimpleNamespace(waiting=[], running=[]))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_mutation_method_is_tracked(policy: SchedulingPolicy) -> None:
    scheduler = make_scheduler(policy)
    tracker = QueueTracker.attach(scheduler)
    waiting = scheduler.waiting
    reqs = [FakeRequest(f"r{i}", 10 * (i + 1), arrival_time=float(i)) for i in range(8)]
    preempted = FakeRequest("p", 500, 40, RequestStatus.PREEMPTED, arrival_time=0.5)

    def check() -> None:
        assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))

    for request in reqs[:5]:
        waiting.add_request(request)
        check()
    waiting.prepend_request(preempted)
    check()
    assert tracker.metrics().num_decode_requests == 1
    waiting.prepend_requests([reqs[5], reqs[6]])
    check()
    popped = waiting.pop_request()
    check()
    assert popped not in list(waiting)
    waiting.remove_request(reqs[2])
    check()
    waiting.remove_requests([reqs[3], reqs[4], reqs[7]])  # reqs[7] was never queued
    check()
    scheduler.kv_holding_waiting.add_request(
        FakeRequest("k", 64, 0, RequestStatus.WAITING_FOR_REMOTE_KVS)
    )
    check()
    while waiting:
        waiting.pop_request()
        check()
    scheduler.kv_holding_waiting.pop_request()
    assert tracker.metrics() == QueuedRequestMetrics()
    assert tracker.resyncs == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_mutations_leave_the_sums_alone(policy: SchedulingPolicy) -> None:
    scheduler = make_scheduler(policy)
    tracker = QueueTracker.attach(scheduler)
    scheduler.waiting.add_request(FakeRequest("a", 10))
    with pytest.raises(IndexError):
        scheduler.kv_holding_waiting.pop_request()
    with pytest.raises(ValueError):
        scheduler.waiting.remove_request(FakeRequest("stranger", 99))
    assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))
    assert tracker.resyncs == 0


def test_a_request_leaves_with_what_it_brought() -> None:
    # vLLM changes a queued request's status in place (a remote-KV request is
    # promoted when its KV arrives); the sums must still return to zero.
    scheduler = make_scheduler(SchedulingPolicy.FCFS)
    tracker = QueueTracker.attach(scheduler)
    request = FakeRequest("k", 100, 0, RequestStatus.WAITING_FOR_REMOTE_KVS)
    scheduler.kv_holding_waiting.add_request(request)
    request.status = RequestStatus.WAITING
    assert tracker.metrics().num_decode_requests == 1  # remembered from entry
    scheduler.kv_holding_waiting.pop_request()
    assert tracker.metrics() == QueuedRequestMetrics()
    assert tracker.resyncs == 0


@pytest.mark.parametrize(
    "mutate",
    [
        lambda q, r: q.append(r),
        lambda q, r: q.appendleft(r),
        lambda q, r: q.extend([r, FakeRequest("x2", 9)]),
        lambda q, r: q.popleft(),
        lambda q, r: q.pop(),
        lambda q, r: q.clear(),
        lambda q, r: q.remove(q[0]),
    ],
    ids=["append", "appendleft", "extend", "popleft", "pop", "clear", "remove"],
)
def test_direct_deque_mutation_is_caught_by_a_resync(mutate: Any) -> None:
    scheduler = make_scheduler(SchedulingPolicy.FCFS)
    tracker = QueueTracker.attach(scheduler)
    for i in range(3):
        scheduler.waiting.add_request(FakeRequest(f"r{i}", 10 + i))
    mutate(scheduler.waiting, FakeRequest("x", 1000, 5, RequestStatus.PREEMPTED))
    assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))
    assert tracker.resyncs == 1
    # After the resync, tracked operations are exact again, with no further resync.
    while scheduler.waiting:
        scheduler.waiting.pop_request()
    assert tracker.metrics() == QueuedRequestMetrics()
    assert tracker.resyncs == 1


def test_direct_heap_mutation_of_a_priority_queue_is_caught() -> None:
    scheduler = make_scheduler(SchedulingPolicy.PRIORITY)
    tracker = QueueTracker.attach(scheduler)
    scheduler.waiting.add_request(FakeRequest("a", 10))
    scheduler.waiting._heap.append(FakeRequest("b", 20, priority=5))
    assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))
    assert tracker.resyncs == 1


statuses = st.sampled_from(
    [
        RequestStatus.WAITING,
        RequestStatus.PREEMPTED,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    ]
)
OPERATIONS = ["add", "pop", "prepend", "prepend_many", "remove", "remove_many"]


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_tracker_equals_the_scan_under_random_operations(
    policy: SchedulingPolicy, data: st.DataObject
) -> None:
    scheduler = make_scheduler(policy)
    tracker = QueueTracker.attach(scheduler)
    outside: list[FakeRequest] = []  # popped or removed: "running", may come back
    serial = 0
    for _ in range(data.draw(st.integers(1, 60), label="steps")):
        queue = data.draw(st.sampled_from(queues_of(scheduler)), label="queue")
        members = list(queue)
        operation = data.draw(st.sampled_from(OPERATIONS), label="op")
        if operation == "add":
            serial += 1
            queue.add_request(
                FakeRequest(
                    f"r{serial}",
                    data.draw(st.integers(1, 100_000)),
                    data.draw(st.integers(0, 5000)),
                    data.draw(statuses),
                    data.draw(st.integers(0, 3)),
                    float(serial),
                )
            )
        elif operation == "pop" and members:
            outside.append(queue.pop_request())
        elif operation == "prepend" and outside:
            request = outside.pop(data.draw(st.integers(0, len(outside) - 1)))
            request.status = RequestStatus.PREEMPTED  # the scheduler's preemption path
            request.num_output_tokens += data.draw(st.integers(0, 100))
            queue.prepend_request(request)
        elif operation == "prepend_many" and outside:
            batch = data.draw(st.lists(st.sampled_from(outside), unique=True, max_size=5))
            for request in batch:
                outside.remove(request)
            queue.prepend_requests(batch)
        elif operation == "remove" and members:
            request = data.draw(st.sampled_from(members))
            queue.remove_request(request)
            outside.append(request)
        elif operation == "remove_many" and members:
            batch = data.draw(st.lists(st.sampled_from(members), unique=True, max_size=5))
            queue.remove_requests(batch)
            outside.extend(batch)
        # Integer-valued sums are exact in floats, so equality is exact too.
        assert tracker.metrics() == scan_queued_metrics(queues_of(scheduler))
    assert tracker.resyncs == 0


# -- EngineHook --------------------------------------------------------------------


class FakeClock:
    """An injected clock: time moves only when the test says so."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass
class RecordingPublisher:
    """Stands in for FpmPublisher: records what the hook hands over."""

    published: list[tuple[float, ScheduledRequestMetrics, QueuedRequestMetrics, Any]] = field(
        default_factory=list
    )
    fail: bool = False
    closed: bool = False
    close_timeout_s: float | None = None

    def publish(
        self,
        wall_time: float,
        scheduled: ScheduledRequestMetrics,
        queued: QueuedRequestMetrics,
        timing_scope: Any = None,
    ) -> bool:
        if self.fail:
            raise RuntimeError("publisher broke")
        self.published.append((wall_time, scheduled, queued, timing_scope))
        return True

    def close(self, timeout_s: float | None = 1.0) -> None:
        self.closed = True
        self.close_timeout_s = timeout_s


class FakeScheduler:
    """A user-defined scheduler class: only what EngineCore calls on it."""

    def __init__(self, policy: SchedulingPolicy = SchedulingPolicy.FCFS) -> None:
        # Any: the queues hold FakeRequests, not vLLM Requests.
        self.waiting: Any = create_request_queue(policy)
        self.kv_holding_waiting: Any = create_request_queue(policy)
        self.requests: dict[str, Any] = {}
        self.next_output: Any = None
        self.consumed: list[tuple[Any, Any]] = []

    def schedule(self, throttle: bool = False) -> Any:
        return self.next_output

    def update_from_output(self, scheduler_output: Any, model_output: Any) -> dict[str, Any]:
        self.consumed.append((scheduler_output, model_output))
        return {"outputs_for": scheduler_output}


class FakeExecutor:
    """Sync mode: ``execute_model`` returns a finished future of None and
    ``sample_tokens`` returns the output. Pipelined mode: ``sample_tokens`` returns
    a future the test completes later."""

    def __init__(self, pipelined: bool = False) -> None:
        self.pipelined = pipelined
        self.executed: list[Any] = []
        self.sample_futures: list[Future[Any]] = []
        self.direct_output: Any = None  # execute_model's result (no sampling call)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Future[Any]:
        self.executed.append(scheduler_output)
        future: Future[Any] = Future()
        future.set_result(self.direct_output)
        return future

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        if self.pipelined:
            future: Future[Any] = Future()
            self.sample_futures.append(future)
            return future
        return f"tokens-{len(self.executed)}"


DECODE_BATCH = [
    CachedReq(f"d{i}", computed=100 + i, num_output=3, scheduled=1, num_tokens=101 + i)
    for i in range(4)
]


def decode_output() -> SchedulerOutput:
    return make_output(cached=DECODE_BATCH)


def make_hook(
    pipelined: bool = False, timer: Any = None, clock: FakeClock | None = None
) -> tuple[EngineHook, FakeScheduler, FakeExecutor, RecordingPublisher, FakeClock]:
    clock = clock or FakeClock()
    scheduler, executor, publisher = FakeScheduler(), FakeExecutor(pipelined), RecordingPublisher()
    scheduler.requests = request_table(cached=DECODE_BATCH)
    hook = EngineHook(
        scheduler,
        executor,
        publisher,
        timer or HostPassTimer(clock=clock),
    )
    return hook, scheduler, executor, publisher, clock


def sync_step(
    scheduler: FakeScheduler,
    executor: FakeExecutor,
    clock: FakeClock,
    output: Any,
    run_s: float,
    before_s: float = 0.0,
    after_s: float = 0.0,
) -> Any:
    """What EngineCore.step does, with time passing at each stage."""
    scheduler.next_output = output
    out = scheduler.schedule(False)
    clock.now += before_s  # grammar bitmask etc. happen outside the model
    future = executor.execute_model(out, non_block=True)
    clock.now += run_s
    model_output = future.result()
    if model_output is None:
        model_output = executor.sample_tokens(None)
    clock.now += after_s
    return scheduler.update_from_output(out, model_output)


def test_sync_path_publishes_one_message_per_pass_with_host_wall_time() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    queued_request = FakeRequest("q", 700)
    scheduler.waiting.add_request(queued_request)
    output = decode_output()
    result = sync_step(scheduler, executor, clock, output, run_s=0.25, before_s=0.5, after_s=2.0)

    assert result == {"outputs_for": output}  # the engine's own return value
    assert executor.executed == [output]
    assert scheduler.consumed == [(output, "tokens-1")]
    (wall_time, scheduled, queued, scope) = publisher.published[0]
    assert len(publisher.published) == 1
    assert wall_time == pytest.approx(0.25)  # submission to sampled output only
    assert scheduled == scheduled_metrics(output, scheduler.requests)
    assert scheduled.num_decode_requests == 4
    assert queued == QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=700)
    assert scope == TIMING_SCOPE_MODEL_STEP_HOST
    assert hook.passes == 1 and hook.errors == 0


def test_queue_state_is_the_one_at_schedule_time() -> None:
    _hook, scheduler, executor, publisher, clock = make_hook()
    scheduler.waiting.add_request(FakeRequest("q1", 10))
    scheduler.next_output = decode_output()
    out = scheduler.schedule()
    scheduler.waiting.add_request(FakeRequest("q2", 20))  # arrives while the model runs
    executor.execute_model(out, non_block=True)
    scheduler.update_from_output(out, executor.sample_tokens(None))
    assert publisher.published[0][2].num_prefill_requests == 1


def test_pass_without_a_sampling_call_is_timed_to_the_output() -> None:
    _hook, scheduler, executor, publisher, clock = make_hook()
    executor.direct_output = "pooled"  # execute_model returns the output itself
    sync_step(scheduler, executor, clock, decode_output(), run_s=0.5, after_s=0.25)
    executor.direct_output = None  # the next pass samples again
    sync_step(scheduler, executor, clock, decode_output(), run_s=0.125, after_s=1.0)
    assert [p[0] for p in publisher.published] == pytest.approx([0.75, 0.125])


def test_empty_batch_publishes_nothing() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    empty = SchedulerOutput.make_empty()
    result = sync_step(scheduler, executor, clock, empty, run_s=0.1)
    assert publisher.published == []
    assert result == {"outputs_for": empty}
    assert executor.executed == [empty]
    assert hook.passes == 0 and hook.errors == 0


def test_pipelined_batches_use_max_of_submission_and_previous_completion() -> None:
    _hook, scheduler, executor, publisher, clock = make_hook(pipelined=True)
    outputs = [decode_output() for _ in range(3)]

    def submit(out: Any) -> Future[Any]:
        # step_with_batch_queue: schedule, execute (non-blocking), sample (future).
        scheduler.next_output = out
        scheduled = scheduler.schedule(False)
        executor.execute_model(scheduled, non_block=True)
        future: Future[Any] = executor.sample_tokens(None, non_block=True)
        return future

    clock.now = 100.0
    first = submit(outputs[0])
    clock.now = 101.0
    second = submit(outputs[1])  # while the first is still running
    clock.now = 105.0
    first.set_result("tokens-a")  # completion callback reads the clock now
    clock.now = 106.0
    scheduler.update_from_output(outputs[0], first.result())
    clock.now = 108.0
    # Completed on another thread, as an executor's future is.
    setter = threading.Thread(target=second.set_result, args=("tokens-b",))
    setter.start()
    setter.join()
    clock.now = 109.0
    scheduler.update_from_output(outputs[1], second.result())
    clock.now = 110.0
    third = submit(outputs[2])  # submitted after the second completed
    clock.now = 112.5
    third.set_result("tokens-c")
    clock.now = 113.0
    scheduler.update_from_output(outputs[2], third.result())

    # 1st: 100 -> 105. 2nd: max(101, 105) -> 108. 3rd: max(110, 108) -> 112.5.
    assert [p[0] for p in publisher.published] == pytest.approx([5.0, 3.0, 2.5])


def test_hook_errors_never_reach_the_engine_and_disable_after_100_in_a_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    original_queue_class = type(scheduler.waiting).__mro__[1]
    # Claims tokens, but has none of the fields batch composition reads.
    malformed = SimpleNamespace(total_num_scheduled_tokens=5)
    for _ in range(engine_hook.MAX_CONSECUTIVE_ERRORS - 1):
        result = sync_step(scheduler, executor, clock, malformed, run_s=0.1)
        assert result == {"outputs_for": malformed}
    assert hook.errors == engine_hook.MAX_CONSECUTIVE_ERRORS - 1 and hook.enabled
    assert publisher.published == []
    # A good pass resets the run of failures.
    sync_step(scheduler, executor, clock, decode_output(), run_s=0.1)
    assert len(publisher.published) == 1
    for _ in range(engine_hook.MAX_CONSECUTIVE_ERRORS - 1):
        sync_step(scheduler, executor, clock, malformed, run_s=0.1)
    assert hook.enabled and not publisher.closed
    with caplog.at_level("WARNING", logger=engine_hook.log.name):
        sync_step(scheduler, executor, clock, malformed, run_s=0.1)
    assert not hook.enabled
    # The publisher is stopped, heartbeats included: a busy engine whose hook
    # broke must go stale, not look idle. Signalled, not waited for (engine thread).
    assert publisher.closed and publisher.close_timeout_s == 0.0
    disabled = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(disabled) == 1
    assert f"vLLM {vllm_version()}" in disabled[0].getMessage()
    # The engine is as it was: its own methods and queue class.
    assert scheduler.schedule == FakeScheduler.schedule.__get__(scheduler)
    assert type(scheduler.waiting) is original_queue_class
    # Disabled: the engine still runs every pass, nothing more is published.
    result = sync_step(scheduler, executor, clock, decode_output(), run_s=0.1)
    assert result["outputs_for"] is scheduler.consumed[-1][0]
    assert len(publisher.published) == 1
    assert len(scheduler.consumed) == 2 * engine_hook.MAX_CONSECUTIVE_ERRORS + 1
    assert hook.errors == 2 * engine_hook.MAX_CONSECUTIVE_ERRORS - 1  # none after disabling


def test_publisher_failure_is_counted_not_raised() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    publisher.fail = True
    output = decode_output()
    assert sync_step(scheduler, executor, clock, output, run_s=0.1) == {"outputs_for": output}
    assert hook.errors == 1 and hook.passes == 0


def test_drifted_scheduler_output_never_reaches_the_engine() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    # A future SchedulerOutput that renamed total_num_scheduled_tokens.
    drifted = SimpleNamespace(total_tokens=5)
    result = sync_step(scheduler, executor, clock, drifted, run_s=0.1)
    assert result == {"outputs_for": drifted}
    assert executor.executed == [drifted]
    assert hook.errors == 1 and hook.passes == 0 and publisher.published == []
    # Not even an object: still the engine's own result.
    assert sync_step(scheduler, executor, clock, None, run_s=0.1) == {"outputs_for": None}
    assert hook.errors == 2


def test_drifted_request_never_breaks_the_engines_queue_calls() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    good = FakeRequest("good", 10)
    drifted = SimpleNamespace(request_id="new", status=RequestStatus.WAITING)  # no token counts
    scheduler.waiting.add_request(good)
    scheduler.waiting.add_request(drifted)  # must not raise inside the engine
    assert list(scheduler.waiting) == [good, drifted]
    # The hook notices (the tracked count is short) and counts an error; the pass still runs.
    output = decode_output()
    assert sync_step(scheduler, executor, clock, output, run_s=0.1) == {"outputs_for": output}
    assert hook.errors == 1 and publisher.published == []
    assert scheduler.waiting.pop_request() is good
    assert scheduler.waiting.pop_request() is drifted


def test_uninstall_restores_the_engine_methods_and_queue_classes() -> None:
    hook, scheduler, executor, publisher, clock = make_hook()
    queue_classes = {name: type(getattr(scheduler, name)).__mro__[1]
                     for name in ("waiting", "kv_holding_waiting")}
    scheduler.waiting.add_request(FakeRequest("q", 10))
    assert scheduler.schedule != FakeScheduler.schedule.__get__(scheduler)
    assert "schedule" in vars(scheduler)
    hook.uninstall()
    assert scheduler.schedule == FakeScheduler.schedule.__get__(scheduler)
    assert "schedule" not in vars(scheduler)  # the class's method shows through again
    assert executor.sample_tokens == FakeExecutor.sample_tokens.__get__(executor)
    assert publisher.closed
    # The queues are their own class again, untracked, and keep their requests.
    for name, original in queue_classes.items():
        queue = getattr(scheduler, name)
        assert type(queue) is original
        assert not is_tracked(queue)
        assert not hasattr(queue, "_stepscale_agg")
    assert [r.request_id for r in scheduler.waiting] == ["q"]
    sync_step(scheduler, executor, clock, decode_output(), run_s=0.1)
    assert publisher.published == []
    # Installing again works and counts what is queued.
    again = EngineHook(scheduler, executor, RecordingPublisher(), HostPassTimer(clock=clock))
    assert again.queue_tracker.metrics().num_prefill_requests == 1


def test_detach_leaves_queues_another_tracker_converted() -> None:
    scheduler = make_scheduler(SchedulingPolicy.FCFS)
    first = QueueTracker.attach(scheduler)
    second = QueueTracker.attach(scheduler)  # found them tracked already
    second.detach()
    assert is_tracked(scheduler.waiting)
    first.detach()
    assert type(scheduler.waiting) is FCFSRequestQueue


def test_engine_without_required_methods_is_refused() -> None:
    with pytest.raises(TypeError, match="update_from_output"):
        EngineHook(
            SimpleNamespace(schedule=lambda: None),
            FakeExecutor(),
            RecordingPublisher(),
            HostPassTimer(),
        )


# -- CUDA timing (mocked: no GPU on these machines) ----------------------------------


class FakeGpu:
    """A GPU timeline in milliseconds that events read when recorded."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.events: list[FakeEvent] = []

    def new_event(self) -> FakeEvent:
        event = FakeEvent(self)
        self.events.append(event)
        return event


class FakeEvent:
    """``torch.cuda.Event(enable_timing=True)``'s interface."""

    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu
        self.recorded_at_ms: float | None = None
        self.records = 0
        self.complete = True

    def record(self) -> None:
        self.records += 1
        self.recorded_at_ms = self._gpu.now_ms

    def query(self) -> bool:
        return self.complete

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.recorded_at_ms is not None and end.recorded_at_ms is not None
        return end.recorded_at_ms - self.recorded_at_ms


def test_cuda_timing_uses_the_events_once_complete() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    timing = CudaPassTimer(new_event=gpu.new_event, clock=clock).begin()
    gpu.now_ms = 12.0
    timing.mark_enqueued()
    timing.mark_enqueued()  # a second call must not move the end event
    gpu.now_ms = 40.0
    clock.now += 0.5
    timing.mark_done()
    assert [e.records for e in gpu.events] == [1, 1]
    elapsed = timing.elapsed_s(previous_done=0.0)
    assert elapsed.wall_time_s == pytest.approx(0.012)
    assert elapsed.scope == TIMING_SCOPE_MODEL_STEP_CUDA
    assert elapsed.done_at == clock.now  # host completion still tracked for the next batch


def test_cuda_timing_falls_back_to_host_time_when_the_end_event_is_not_usable() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    timer = CudaPassTimer(new_event=gpu.new_event, clock=clock)
    not_ready = timer.begin()
    not_ready.mark_enqueued()
    gpu.events[-1].complete = False
    clock.now += 0.25
    # Host time, and labelled as such: the message must say what was measured.
    assert not_ready.elapsed_s(0.0) == (
        pytest.approx(0.25), clock.now, TIMING_SCOPE_MODEL_STEP_HOST
    )
    never_enqueued = timer.begin()
    clock.now += 0.5
    assert never_enqueued.elapsed_s(0.0) == (
        pytest.approx(0.5), clock.now, TIMING_SCOPE_MODEL_STEP_HOST
    )


def test_hook_labels_each_pass_with_the_scope_it_measured() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    _hook, scheduler, executor, publisher, _ = make_hook(
        timer=CudaPassTimer(new_event=gpu.new_event, clock=clock), clock=clock
    )
    for end_ready in (True, False, True):
        scheduler.next_output = decode_output()
        out = scheduler.schedule()
        executor.execute_model(out, non_block=True)
        gpu.now_ms += 2.0
        clock.now += 0.5
        model_output = executor.sample_tokens(None)
        gpu.events[-1].complete = end_ready
        scheduler.update_from_output(out, model_output)
    assert [(p[0], p[3]) for p in publisher.published] == [
        (pytest.approx(0.002), TIMING_SCOPE_MODEL_STEP_CUDA),
        (pytest.approx(0.5), TIMING_SCOPE_MODEL_STEP_HOST),
        (pytest.approx(0.002), TIMING_SCOPE_MODEL_STEP_CUDA),
    ]


def test_hook_with_cuda_timer_publishes_gpu_time_and_scope() -> None:
    gpu, clock = FakeGpu(), FakeClock()
    _hook, scheduler, executor, publisher, _ = make_hook(
        timer=CudaPassTimer(new_event=gpu.new_event, clock=clock), clock=clock
    )
    scheduler.next_output = decode_output()
    out = scheduler.schedule()
    gpu.now_ms = 5.0
    executor.execute_model(out, non_block=True)  # start event at 5 ms
    gpu.now_ms = 9.5
    model_output = executor.sample_tokens(None)  # end event at 9.5 ms
    clock.now += 3.0  # host time is much longer: must not be used
    scheduler.update_from_output(out, model_output)
    (wall_time, _scheduled, _queued, scope) = publisher.published[0]
    assert wall_time == pytest.approx(0.0045)
    assert scope == TIMING_SCOPE_MODEL_STEP_CUDA


def test_host_timer_is_chosen_without_an_in_process_cuda_device() -> None:
    cpu_config = SimpleNamespace(device_config=SimpleNamespace(device="cpu"))
    assert isinstance(choose_pass_timer(SimpleNamespace(), cpu_config), HostPassTimer)
    multiproc = type("MultiprocExecutor", (), {})()
    cuda_config = SimpleNamespace(device_config=SimpleNamespace(device="cuda"))
    assert isinstance(choose_pass_timer(multiproc, cuda_config), HostPassTimer)


def test_fcfs_and_priority_classes_are_the_real_ones() -> None:
    # Guards the fixtures above: the tracker is exercised on vLLM's classes.
    assert isinstance(make_scheduler(SchedulingPolicy.FCFS).waiting, FCFSRequestQueue)
    assert isinstance(make_scheduler(SchedulingPolicy.PRIORITY).waiting, PriorityRequestQueue)


def test_hook_installs_on_a_priority_scheduler() -> None:
    scheduler = FakeScheduler(SchedulingPolicy.PRIORITY)
    clock = FakeClock()
    EngineHook(
        scheduler,
        FakeExecutor(),
        RecordingPublisher(),
        HostPassTimer(clock=clock),
    )
    scheduler.waiting.add_request(FakeRequest("q", 10))
    assert isinstance(scheduler.waiting, PriorityRequestQueue)
