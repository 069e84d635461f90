"""A deployment's ingest stays bounded whatever arrives (no API server needed).

Batches are handed to the autoscaler's subscriber sink (``_on_batch``), as its
subscriber thread does on receipt, on a fake clock, so that arrival times,
staleness and expiry are exact. What the subscriber itself bounds (frame sizes,
bytes per receive) is tested over real ZMQ in tests/unit/test_subscriber.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator

import pytest

from stepscale_engine import wire
from stepscale_operator.controller import autoscaler as autoscaler_module
from stepscale_operator.controller.autoscaler import DeploymentAutoscaler
from stepscale_operator.controller.discovery import PodView
from stepscale_operator.controller.ingest_queue import ByteBudget, IngestQueue
from stepscale_operator.controller.round_priority import RoundPriority
from stepscale_operator.controller.spec import parse_spec
from stepscale_operator.controller.status import load_status, round_status, stream_status
from stepscale_operator.fpm_pipeline import DeploymentModel, MessageBatch
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.planner import Decision, PlannerInputs


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def autoscaler(clock: FakeClock) -> Iterator[DeploymentAutoscaler]:
    spec = parse_spec({"model": "m", "image": "i", "fpm": {"basePort": 20480}})
    a = DeploymentAutoscaler("ns/chat", spec, clock=clock, wall_clock=clock)
    yield a
    a.close()


def passes(worker: str, first: int, n: int, rank: int = 0) -> MessageBatch:
    """``n`` forward passes of one stream, numbered from ``first``."""
    return MessageBatch.of(
        [
            wire.ForwardPassMetrics(
                worker_id=worker,
                dp_rank=rank,
                counter_id=first + i,
                wall_time=0.01,
                scheduled_requests=wire.ScheduledRequestMetrics(
                    num_decode_requests=4, sum_decode_kv_tokens=400
                ),
            )
            for i in range(n)
        ]
    )


def pods(autoscaler: DeploymentAutoscaler, *names: str) -> None:
    for i, name in enumerate(names):
        autoscaler.observe_pod(PodView(name, f"127.0.0.{60 + i}", True, False, None))


def run_pods(
    autoscaler: DeploymentAutoscaler, clock: FakeClock, names: list[str], seconds: int, start: int
) -> int:
    """Each pod publishes 10 passes per second for ``seconds``; returns the next counter."""
    for s in range(seconds):
        clock.now += 1.0
        for name in names:
            autoscaler._on_batch(passes(name, start + 10 * s, 10))
    return start + 10 * seconds


def test_messages_in_flight_after_a_pod_deletion_never_count_as_missing(
    autoscaler: DeploymentAutoscaler, clock: FakeClock
) -> None:
    pods(autoscaler, "a", "b")
    counter = run_pods(autoscaler, clock, ["a", "b"], 3, 0)
    assert autoscaler.decide().load.complete
    autoscaler.forget_pod("b")
    autoscaler._on_batch(passes("b", counter, 5))  # still in flight when "b" went
    run_pods(autoscaler, clock, ["a"], 10, counter)
    round_ = autoscaler.decide()
    assert round_.load.complete, round_.load.missing_streams
    assert round_.load.streams_total == 1
    assert round_.totals["stray_messages"] == 5
    assert round_.stream_health["stray_streams"] == 1
    # Once silent for the expiry, the identity is forgotten (its count stays).
    clock.now += autoscaler.strays.expire_after_s + 1.0
    autoscaler._on_batch(passes("a", 10_000, 1))
    round_ = autoscaler.decide()
    assert round_.stream_health["stray_streams"] == 0
    assert round_.totals["stray_messages"] == 5


def test_an_identity_that_is_no_pod_never_holds_the_planner(
    autoscaler: DeploymentAutoscaler, clock: FakeClock
) -> None:
    pods(autoscaler, "a")
    autoscaler._on_batch(passes("intruder", 0, 1))
    run_pods(autoscaler, clock, ["a"], 20, 0)
    round_ = autoscaler.decide()
    assert round_.load.complete and round_.load.missing_streams == ()
    assert round_.totals["stray_messages"] == 1
    assert round_.totals["messages"] == 200  # the intruder's message is not the fleet's


def test_status_stays_small_with_ten_thousand_hostile_identities(
    autoscaler: DeploymentAutoscaler, clock: FakeClock
) -> None:
    pods(autoscaler, "a")
    for i in range(10_000):
        autoscaler._on_batch(passes(f"{i:05d}" + "x" * 60_000, 0, 1))
    run_pods(autoscaler, clock, ["a"], 5, 0)
    round_ = autoscaler.decide()
    status = round_status(
        round_,
        now_wall=clock.now,
        generation=1,
        previous_conditions=[],
        mode="auto",
        min_samples=50,
        selector="app=chat",
        replicas=1,
        ready_replicas=1,
        desired_replicas=1,
        decision_applied=False,
        last_scaling=None,
    )
    assert len(json.dumps(status)) < 64 * 1024
    # Each hostile identity is 60 kB: most of them are shed before they are even queued.
    assert status["streams"]["strayMessages"] + status["streams"]["shedMessages"] == 10_000
    assert status["load"]["complete"] is True


def test_status_lists_are_capped_in_count_and_name_length() -> None:
    names = tuple(f"{i:05d}" + "y" * 60_000 + "/0" for i in range(10_000))
    load = dataclasses.replace(
        LoadEstimator().estimate(0.0),
        streams_total=10_000,
        streams_missing=10_000,
        missing_streams=names,
    )
    listed = load_status(load)
    streams = stream_status({"streams": 10_000, "fresh": 0, "stale": list(names)}, 10_000)
    assert listed is not None
    assert listed["streamsMissing"] == 10_000 and streams["stale"] == 10_000  # exact counts
    for shown in (listed["missingStreams"], streams["staleStreams"]):
        assert 0 < len(shown) <= 32 and all(len(n) <= 128 for n in shown)
    assert len(json.dumps([listed, streams])) < 16 * 1024


def test_the_queue_is_bounded_in_bytes_and_sheds_with_a_count(clock: FakeClock) -> None:
    spec = parse_spec({"model": "m", "image": "i", "fpm": {"basePort": 20490}})
    autoscaler = DeploymentAutoscaler(
        "ns/chat", spec, clock=clock, wall_clock=clock, max_queued_bytes=20_000
    )
    try:
        pods(autoscaler, "a")
        for i in range(100):  # the clock stands still: nothing is ingested meanwhile
            autoscaler._on_batch(passes("a", 10 * i, 10))
        assert autoscaler.queue.bytes <= 20_000
        round_ = autoscaler.decide()
        shed = round_.totals["shed_messages"]
        assert shed > 0
        assert round_.totals["messages"] + shed == 1000  # every message accounted for
        assert round_.stream_health["shedding"] is True
        clock.now += 2 * spec.autoscaling.interval_s
        autoscaler._on_batch(passes("a", 1000, 1))
        round_ = autoscaler.decide()
        assert round_.stream_health["shedding"] is False
        assert round_.totals["lost"] == shed  # the gap it left is seen as such
    finally:
        autoscaler.close()


def test_queued_batches_are_merged_into_few_ingests_and_work_per_call_is_bounded(
    autoscaler: DeploymentAutoscaler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods(autoscaler, "a")
    calls: list[int] = []
    original = DeploymentModel.ingest_matrices

    def counting(self: DeploymentModel, matrices, now):  # type: ignore[no-untyped-def]
        calls.append(len(matrices))
        return original(self, matrices, now)

    monkeypatch.setattr(DeploymentModel, "ingest_matrices", counting)
    for i in range(300):  # 300 receives within one instant
        autoscaler._on_batch(passes("a", 10 * i, 10))
    assert autoscaler.ingest(max_messages=1000) == 1000  # a turn does what it is allowed
    assert len(autoscaler.queue) == 2000
    assert calls == [1000]
    assert autoscaler.ingest() == 2000
    assert calls == [1000, 2000]
    assert autoscaler.totals()["messages"] == 3000


def test_totals_keep_the_counts_of_streams_the_table_evicted(
    autoscaler: DeploymentAutoscaler, clock: FakeClock
) -> None:
    autoscaler.model.streams.max_streams = 2
    pods(autoscaler, "a", "b", "c")
    run_pods(autoscaler, clock, ["a", "b", "c"], 2, 0)
    totals = autoscaler.decide().totals
    assert autoscaler.model.streams.evicted >= 1
    assert totals["messages"] == 60


def test_all_queues_of_the_process_share_one_byte_budget(clock: FakeClock) -> None:
    shared = ByteBudget(30_000)
    first = IngestQueue(max_bytes=1_000_000, shared=shared)
    second = IngestQueue(max_bytes=1_000_000, shared=shared)
    batch = passes("a", 0, 10).matrices
    while first.put(clock.now, batch):
        pass
    assert shared.used <= 30_000
    assert first.shed_messages == 10
    # The budget is spent: another deployment's queue takes one batch (it must never
    # starve) and sheds the next, counted.
    assert second.put(clock.now, batch) is True
    assert second.put(clock.now, batch) is False
    assert second.shed_messages == 10
    # What one queue gives back (ingested, or the deployment closed), the other can use.
    first.take(1_000_000)
    second.clear()
    assert shared.used == 0
    assert second.put(clock.now, batch) and second.put(clock.now, batch)


def test_a_round_sheds_a_backlog_beyond_its_budget_and_says_so(
    autoscaler: DeploymentAutoscaler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    pods(autoscaler, "a")
    monkeypatch.setattr(autoscaler_module, "ROUND_INGEST_MESSAGES", 500)
    monkeypatch.setattr(autoscaler, "_waiting", 1)  # the subscriber side ingests nothing
    for i in range(300):
        autoscaler._on_batch(passes("a", 10 * i, 10))
    assert len(autoscaler.queue) == 3000
    monkeypatch.setattr(autoscaler, "_waiting", 0)
    round_ = autoscaler.decide()
    # The oldest part of the backlog is shed, the newest 500 decided on.
    assert round_.ingested_messages == 500
    assert round_.totals["shed_messages"] == 2500
    assert round_.totals["messages"] == 500
    assert round_.stream_health["shedding"] is True
    assert autoscaler.model.streams.health(clock.now)["messages"] == 500


def test_a_round_after_shedding_tells_the_planner_the_load_reads_low(
    autoscaler: DeploymentAutoscaler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an overloaded operator sheds, the load estimate misses: the planner is told
    the share it saw, and holds scale-down (tests/unit/test_planner.py)."""
    seen: list[float] = []
    decide = autoscaler.planner.decide

    def spy(inputs: PlannerInputs, now: float) -> Decision:
        seen.append(inputs.load_seen_fraction)
        return decide(inputs, now)

    monkeypatch.setattr(autoscaler.planner, "decide", spy)
    pods(autoscaler, "a")
    counter = run_pods(autoscaler, clock, ["a"], 10, 0)
    autoscaler.decide()
    assert seen[-1] == 1.0
    monkeypatch.setattr(autoscaler_module, "ROUND_INGEST_MESSAGES", 500)
    monkeypatch.setattr(autoscaler, "_waiting", 1)  # the subscriber side ingests nothing
    run_pods(autoscaler, clock, ["a"], 300, counter)  # 3,000 passes; the round keeps 500
    monkeypatch.setattr(autoscaler, "_waiting", 0)
    round_ = autoscaler.decide()
    assert round_.totals["shed_messages"] == 2500
    assert seen[-1] == pytest.approx(500 / 3000)  # since the last round: 500 of 3,000 seen


def test_subscriber_threads_wait_while_a_decision_round_runs() -> None:
    priority = RoundPriority()
    assert priority.wait_for_rounds() is False  # no round running: no wait
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(priority.wait_for_rounds(60.0)))
    with priority.round():
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # held back while the round runs
    waiter.join(30.0)  # released when the round ends, long before its 60 s timeout
    assert not waiter.is_alive() and results == [True]
    # A round that never ends holds ingest back for at most the timeout.
    with priority.round():
        assert priority.wait_for_rounds(timeout_s=0.05) is True


def test_decision_rounds_of_different_deployments_run_one_at_a_time() -> None:
    """Overlapping rounds would share the GIL and the CPU: each would take as long as
    all of them together. The second waits for the first to end."""
    priority = RoundPriority()
    first_in, release = threading.Event(), threading.Event()
    second_in = threading.Event()

    def first() -> None:
        with priority.round():
            first_in.set()
            release.wait(30.0)

    def second() -> None:
        with priority.round():
            second_in.set()

    a = threading.Thread(target=first)
    a.start()
    assert first_in.wait(30.0)
    b = threading.Thread(target=second)
    b.start()
    assert not second_in.wait(0.2)  # held back while the first round runs
    assert priority.running
    release.set()
    assert second_in.wait(30.0)
    a.join(30.0)
    b.join(30.0)
    assert not priority.running


def test_a_subscriber_thread_leaves_its_queue_to_a_running_round(
    autoscaler: DeploymentAutoscaler, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a round of any deployment runs, the subscriber side ingests nothing (the
    round takes the CPU first, and ingests this queue itself); it catches up after."""
    priority = RoundPriority()
    monkeypatch.setattr(autoscaler_module, "ROUNDS", priority)
    pods(autoscaler, "a")
    autoscaler.queue.put(clock.now, passes("a", 0, 50).matrices)
    clock.now += autoscaler_module.INGEST_AFTER_S + 1.0  # old enough to be ingested
    in_round, release = threading.Event(), threading.Event()

    def other_deployments_round() -> None:
        with priority.round():
            in_round.set()
            release.wait(30.0)

    t = threading.Thread(target=other_deployments_round)
    t.start()
    try:
        assert in_round.wait(30.0)
        autoscaler._ingest_queued(clock.now)
        assert len(autoscaler.queue) == 50  # left for later
    finally:
        release.set()
        t.join(30.0)
    autoscaler._ingest_queued(clock.now)
    assert len(autoscaler.queue) == 0
    assert autoscaler.totals()["messages"] == 50
