"""LoadEstimator: rates per wall-clock second, cache hits, chunking, queues, staleness, trends."""

from __future__ import annotations

import json

import pytest

from stepscale_engine.wire import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    heartbeat,
)
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.stream_state import DEFAULT_STALE_AFTER_S


def _msg(
    counter: int,
    sched: ScheduledRequestMetrics,
    worker: str = "w",
    rank: int = 0,
    queued: QueuedRequestMetrics | None = None,
    wall: float = 0.01,
) -> ForwardPassMetrics:
    return ForwardPassMetrics(
        worker_id=worker,
        dp_rank=rank,
        counter_id=counter,
        wall_time=wall,
        scheduled_requests=sched,
        queued_requests=queued or QueuedRequestMetrics(),
    )


DECODE = ScheduledRequestMetrics(num_decode_requests=10, sum_decode_kv_tokens=5000)


def feed(
    est: LoadEstimator,
    seconds: int,
    per_second: int,
    sched: ScheduledRequestMetrics,
    worker: str = "w",
    start: float = 0.0,
) -> None:
    for s in range(seconds):
        for i in range(per_second):
            now = start + s + i / per_second
            est.observe(_msg(s * per_second + i, sched, worker), now)


def test_decode_rate_and_context_per_wall_clock_second() -> None:
    est = LoadEstimator(window_s=10.0)
    feed(est, 20, 50, DECODE)
    load = est.estimate(20.0)
    assert load.decode_tokens_per_s == pytest.approx(500.0, rel=0.05)  # 10 requests x 50 passes/s
    assert load.mean_decode_context_tokens == pytest.approx(500.0)
    assert load.busy_fraction == pytest.approx(0.5, rel=0.05)  # 50 passes x 10 ms
    assert load.prefill_tokens_per_s == 0.0
    assert load.complete and load.window_s == 10.0


def test_rates_sum_over_streams() -> None:
    est = LoadEstimator(window_s=10.0)
    feed(est, 15, 20, DECODE, worker="a")
    feed(est, 15, 20, DECODE, worker="b")
    load = est.estimate(15.0)
    assert load.streams_total == 2
    assert load.decode_tokens_per_s == pytest.approx(400.0, rel=0.05)


def test_young_stream_rate_uses_time_observed() -> None:
    est = LoadEstimator(window_s=30.0)
    feed(est, 5, 20, DECODE, start=100.0)
    assert est.estimate(105.0).decode_tokens_per_s == pytest.approx(200.0, rel=0.1)


def test_stale_and_never_seen_streams_are_missing_not_zero() -> None:
    est = LoadEstimator(window_s=10.0, stale_after_s=3.0)
    est.add_stream(("never", 0))
    feed(est, 10, 20, DECODE, worker="a")
    feed(est, 5, 20, DECODE, worker="b")  # b goes silent at t=5
    load = est.estimate(10.0)
    assert load.streams_total == 3
    assert load.streams_missing == 2
    assert not load.complete
    assert load.decode_tokens_per_s == pytest.approx(200.0, rel=0.1)  # a only, b unknown
    est.remove_stream(("never", 0))
    est.remove_stream(("b", 0))
    assert est.estimate(10.0).complete


def test_heartbeats_keep_a_stream_fresh_with_zero_load() -> None:
    est = LoadEstimator(window_s=10.0)
    for i in range(10):
        est.observe(heartbeat("idle", 0, i), float(i))
    load = est.estimate(9.5)
    assert load.complete
    assert load.decode_tokens_per_s == 0.0 and load.busy_fraction == 0.0


def test_prefix_cache_hits_and_prompt_length() -> None:
    est = LoadEstimator(window_s=10.0)
    # Each prompt is 1000 tokens, 600 of them served from the prefix cache.
    hit = ScheduledRequestMetrics(
        num_prefill_requests=1, sum_prefill_tokens=400, sum_prefill_kv_tokens=600
    )
    big_decode = ScheduledRequestMetrics(num_decode_requests=2000)  # sets the token budget
    est.observe(_msg(0, big_decode), 0.0)
    feed(est, 10, 10, hit)
    load = est.estimate(10.0)
    assert load.prefix_cache_hit_fraction == pytest.approx(0.6)
    assert load.mean_prompt_tokens == pytest.approx(1000.0)
    assert load.prefill_requests_per_s == pytest.approx(10.0, rel=0.1)


def feed_chunked_prompts(est: LoadEstimator, first_counter: int) -> int:
    """One 3000-token prompt a second for 10 s, in chunks of 1000 (the budget), each
    followed by a small pass that ends the run of full passes; returns the next counter."""
    counter = first_counter
    for second in range(10):
        for chunk in range(3):
            sched = ScheduledRequestMetrics(
                num_prefill_requests=1, sum_prefill_tokens=1000, sum_prefill_kv_tokens=1000 * chunk
            )
            est.observe(_msg(counter, sched), second + chunk * 0.1)
            counter += 1
        tail = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=10)
        est.observe(_msg(counter, tail), second + 0.5)
        counter += 1
    return counter


def test_chunk_continuations_are_not_cache_hits() -> None:
    # KV of chunks 2 and 3 is the prompt's own earlier chunks, not a cache hit.
    est = LoadEstimator(window_s=10.0)
    feed_chunked_prompts(est, first_counter=0)
    load = est.estimate(10.0)
    assert load.prefix_cache_hit_fraction == pytest.approx(0.0)
    assert load.prefill_tokens_per_s == pytest.approx(3010.0, rel=0.1)


def test_queues_are_latest_per_stream_and_heartbeat_empties_them() -> None:
    est = LoadEstimator()
    q = QueuedRequestMetrics(num_prefill_requests=3, sum_prefill_tokens=900, num_decode_requests=2)
    est.observe(_msg(0, DECODE, "a", queued=q), 1.0)
    est.observe(_msg(0, DECODE, "b", queued=q), 1.0)
    load = est.estimate(1.5)
    assert (load.queued_prefill_requests, load.queued_prefill_tokens) == (6.0, 1800.0)
    assert load.queued_decode_requests == 4.0
    est.observe(heartbeat("b", 0, 1), 2.0)
    assert est.estimate(2.0).queued_prefill_requests == 3.0


def test_trend_sign_follows_a_ramp() -> None:
    est = LoadEstimator(window_s=30.0)
    counter = 0
    for s in range(60):
        for _ in range(5 + s):  # passes per second grow by one each second
            est.observe(_msg(counter, DECODE), float(s) + 0.5)
            counter += 1
    load = est.estimate(60.0)
    assert load.decode_tokens_per_s_trend == pytest.approx(10.0, rel=0.25)  # 10 tokens/s per s
    assert load.prefill_tokens_per_s_trend == 0.0


def test_memory_bounded_in_streams() -> None:
    est = LoadEstimator(max_streams=4)
    for i in range(20):
        est.observe(_msg(0, DECODE, f"w{i}"), float(i))
    assert len(est.streams) == 4
    assert ("w19", 0) in est.streams


def test_window_forgets_old_load() -> None:
    est = LoadEstimator(window_s=10.0)
    feed(est, 10, 20, DECODE)
    est.observe(heartbeat("w", 0, 10_000), 30.0)
    assert est.estimate(30.0).decode_tokens_per_s == 0.0


def test_eviction_keeps_recently_active_streams() -> None:
    est = LoadEstimator(max_streams=3)
    for i, name in enumerate("abc"):
        est.observe(_msg(0, DECODE, name), float(i))
    est.observe(_msg(1, DECODE, "a"), 5.0)  # a speaks again: b is now the longest silent
    est.observe(_msg(0, DECODE, "d"), 6.0)
    assert sorted(k[0] for k in est.streams) == ["a", "c", "d"]


def test_default_staleness_is_the_shared_one() -> None:
    assert LoadEstimator().stale_after_s == DEFAULT_STALE_AFTER_S


def test_hostile_values_are_rejected_counted_and_do_not_skew_the_load() -> None:
    est = LoadEstimator(window_s=10.0)
    # Valid on the wire, absurd as a pass: 1e12 prompt tokens in 10 ms. Learned, it
    # would also become the stream's token budget, and no chunk would look full again.
    absurd = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=10**12)
    est.observe(_msg(0, absurd), 0.0)
    counter = feed_chunked_prompts(est, first_counter=1)
    # Within the hard limits but 1000x this stream's largest pass: not believed either.
    beyond = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=10**6)
    est.observe(_msg(counter, beyond, wall=1.0), 9.6)
    flooded = QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=10**15)
    est.observe(_msg(counter + 1, DECODE, queued=flooded), 9.7)
    load = est.estimate(10.0)
    assert est.rejected == {"size": 1, "budget": 1, "queue": 1}
    assert load.prefix_cache_hit_fraction == pytest.approx(0.0)
    assert load.prefill_tokens_per_s == pytest.approx(3010.0, rel=0.1)
    assert load.queued_prefill_tokens == 0.0
    assert load.complete  # rejected content is still liveness


def test_queue_mean_over_the_window_and_queue_trends() -> None:
    est = LoadEstimator(window_s=30.0)
    for step in range(300):  # the queue grows linearly: 100 tokens and 2 requests per second
        t = step * 0.1
        q = QueuedRequestMetrics(
            num_prefill_requests=int(t),
            sum_prefill_tokens=int(100 * t),
            num_decode_requests=int(2 * t),
        )
        est.observe(_msg(step, DECODE, queued=q), t)
    load = est.estimate(30.0)
    assert load.queued_prefill_tokens == pytest.approx(2990.0)  # the latest value
    assert load.queued_prefill_tokens_mean == pytest.approx(1500.0, rel=0.05)
    assert load.queued_decode_requests_mean == pytest.approx(30.0, rel=0.05)
    assert load.queued_prefill_tokens_trend == pytest.approx(100.0, rel=0.1)
    assert load.queued_decode_requests_trend == pytest.approx(2.0, rel=0.1)
    assert load.decode_tokens_per_s_trend == pytest.approx(0.0, abs=1.0)  # steady passes


def test_a_pod_that_joins_adds_what_it_serves_not_its_short_window_rate() -> None:
    # "a" served 200 tokens/s alone for 20 s; then "b" joined and each served 100
    # tokens/s for the last 10 s. The fleet served 6000 tokens over the 30 s
    # window: 200/s, not a's 30 s average (167) plus b's 10 s rate (100).
    est = LoadEstimator(window_s=30.0)
    feed(est, 20, 20, DECODE, worker="a")
    feed(est, 10, 10, DECODE, worker="a", start=20.0)
    feed(est, 10, 10, DECODE, worker="b", start=20.0)
    load = est.estimate(30.0)
    assert load.decode_tokens_per_s == pytest.approx(200.0, rel=0.05)


def test_queue_change_over_the_window_gives_arrivals_by_mass_balance() -> None:
    # The queue rose to 20,000 tokens and drained back to 2,000 within the window:
    # a least-squares slope understates that drop; the end-to-end change does not.
    est = LoadEstimator(window_s=30.0)
    for step in range(300):
        t = step * 0.1
        level = 20_000 * t / 15.0 if t < 15.0 else 20_000 - 18_000 * (t - 15.0) / 15.0
        q = QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=int(level))
        est.observe(_msg(step, DECODE, queued=q), t)
    load = est.estimate(30.0)
    # From the oldest sub-window's mean (3,300-4,700 tokens, over the window's
    # first 5 s) to 2,100 now, over ~27 s.
    change = load.queued_prefill_tokens_change_per_s
    assert (2_100 - 4_700) / 27.0 <= change <= (2_100 - 3_300) / 27.0
    assert load.queued_prefill_tokens_trend > change  # the slope misses the drop


def test_recent_demand_sees_a_step_the_window_still_averages() -> None:
    # A saturated engine serves 2,000 prefill tokens/s throughout; from t=25 s the
    # arrivals step up and its queue grows by 6,000 tokens/s. At t=30 s the window's
    # balance (served + change since its oldest part) still averages the step with
    # the 25 s before it; the newest sub-windows' balance shows the 8,000 arriving.
    est = LoadEstimator(window_s=30.0)
    prefill = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=200)
    for step in range(300):
        t = step * 0.1
        level = 1_000 + (6_000 * (t - 25.0) if t > 25.0 else 0.0)
        q = QueuedRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=int(level))
        est.observe(_msg(step, prefill, queued=q), t)
    load = est.estimate(30.0)
    assert load.prefill_tokens_per_s == pytest.approx(2_000.0, rel=0.05)
    window_demand = load.prefill_tokens_per_s + load.queued_prefill_tokens_change_per_s
    assert window_demand < 4_000.0
    # Over the newest 5-7.5 s: 2,000 served + 30,000 tokens of growth / 7.5 s.
    assert load.prefill_demand_tokens_per_s_recent == pytest.approx(6_000.0, rel=0.1)
    assert load.prefill_demand_tokens_per_s_recent > 1.5 * window_demand
    assert "prefill_demand_tokens_per_s_recent" not in load.unavailable


def test_queue_mean_smooths_a_burst_that_has_drained() -> None:
    est = LoadEstimator(window_s=30.0)
    q = QueuedRequestMetrics(num_prefill_requests=100, sum_prefill_tokens=10_000)
    for step in range(300):
        t = step * 0.1
        est.observe(_msg(step, DECODE, queued=q if t < 15.0 else None), t)
    load = est.estimate(30.0)
    assert load.queued_prefill_requests == 0.0  # now
    assert load.queued_prefill_requests_mean == pytest.approx(50.0, rel=0.05)  # over the window
    assert load.queued_prefill_tokens_trend < 0.0


def test_no_fresh_stream_is_unknown_load_never_zero() -> None:
    est = LoadEstimator(window_s=10.0, stale_after_s=3.0)
    est.add_stream(("never", 1))
    feed(est, 5, 20, DECODE, worker="a")
    load = est.estimate(100.0)
    d = load.to_dict()
    assert d["complete"] is False and d["streams_missing"] == 2
    assert d["missing_streams"] == ["a/0", "never/1"]
    for key in (
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "mean_decode_context_tokens",
        "prefix_cache_hit_fraction",
        "queued_prefill_tokens",
        "queued_decode_requests_mean",
        "decode_tokens_per_s_trend",
        "queued_prefill_tokens_trend",
        "busy_fraction",
    ):
        assert d[key] is None, key
    assert d["window_s"] == 10.0
    # The dataclass stays plain floats for the planner, which holds on incomplete load.
    assert load.decode_tokens_per_s == 0.0 and "decode_tokens_per_s" in load.unavailable


def test_values_with_nothing_to_average_are_null() -> None:
    est = LoadEstimator(window_s=10.0)
    feed(est, 10, 20, DECODE)  # decode only: no prompt to measure
    d = est.estimate(10.0).to_dict()
    assert d["mean_decode_context_tokens"] == pytest.approx(500.0)
    assert d["prefix_cache_hit_fraction"] is None and d["mean_prompt_tokens"] is None
    assert d["prefill_tokens_per_s"] == 0.0  # measured: there was none
    idle = LoadEstimator(window_s=10.0)
    for i in range(10):
        idle.observe(heartbeat("idle", 0, i), float(i))
    d = idle.estimate(9.5).to_dict()
    assert d["decode_tokens_per_s"] == 0.0 and d["mean_decode_context_tokens"] is None


def test_trends_need_two_sub_windows() -> None:
    est = LoadEstimator(window_s=30.0)
    feed(est, 2, 20, DECODE)  # 2 s of data; sub-windows are 5 s
    d = est.estimate(2.0).to_dict()
    assert d["decode_tokens_per_s_trend"] is None and d["queued_decode_requests_trend"] is None
    assert d["decode_tokens_per_s"] == pytest.approx(200.0, rel=0.1)


def test_to_dict_is_json_with_nulls_for_what_is_unknown() -> None:
    est = LoadEstimator(window_s=10.0)
    est.add_stream(("gone", 0))
    feed(est, 10, 20, DECODE)
    load = est.estimate(10.0)
    d = json.loads(json.dumps(load.to_dict()))
    assert d["missing_streams"] == ["gone/0"] and d["complete"] is False
    assert "mean_prompt_tokens" in load.unavailable and d["mean_prompt_tokens"] is None
    assert d["decode_tokens_per_s"] == pytest.approx(load.decode_tokens_per_s)


# -- measured shapes and realized latency -------------------------------------------


def _with_budget(est: LoadEstimator, tokens: int = 131_072) -> LoadEstimator:
    """``est`` after one pass of ``tokens`` long before the window: the stream's token
    budget, so the prompt passes that follow are not taken for chunks of longer ones."""
    est.observe(
        _msg(10**6, ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=tokens)),
        -100.0,
    )
    return est


def _one_prompt_pass(
    counter: int, prompt: int, decodes: int = 4, worker: str = "w"
) -> ForwardPassMetrics:
    """A pass that finishes one whole prompt of ``prompt`` tokens beside ``decodes``."""
    sched = ScheduledRequestMetrics(
        num_prefill_requests=1,
        sum_prefill_tokens=prompt,
        num_decode_requests=decodes,
        sum_decode_kv_tokens=decodes * 500,
    )
    return _msg(counter, sched, worker=worker, wall=0.05)


def test_prompt_histogram_keeps_the_tail_of_the_lengths() -> None:
    from stepscale_operator.load_types import PROMPT_BIN_EDGES

    est = _with_budget(LoadEstimator(window_s=30.0))
    counter = 0
    # 90 short prompts and 10 of 100k tokens (a long-context tail) over 20 s.
    for s in range(20):
        for i in range(5):
            counter += 1
            prompt = 100_000 if (s * 5 + i) % 10 == 0 else 500
            est.observe(_one_prompt_pass(counter, prompt), s + i / 5.0)
    load = est.estimate(20.0)
    hist = load.prompt_histogram
    assert sum(hist) == pytest.approx(100.0)
    long_bin = max(i for i, edge in enumerate(PROMPT_BIN_EDGES) if edge <= 100_000)
    short_bin = max(i for i, edge in enumerate(PROMPT_BIN_EDGES) if edge <= 500)
    assert hist[long_bin] == pytest.approx(10.0) and hist[short_bin] == pytest.approx(90.0)


def test_each_prompt_bin_carries_the_mean_length_of_its_prompts() -> None:
    from stepscale_operator.latency_model import prompt_distribution

    est = _with_budget(LoadEstimator(window_s=30.0))
    # Prompts piled at a context cap of 4,100 tokens (the bottom of the 4,096-5,793
    # bin) and 600-token ones: each bin's length is its prompts', not its centre.
    for k in range(40):
        est.observe(_one_prompt_pass(k + 1, 4_100 if k % 4 == 0 else 600), k * 0.5)
    load = est.estimate(20.0)
    lengths = [
        length
        for length, _ in prompt_distribution(
            load.prompt_histogram, load.mean_prompt_tokens, load.prompt_bin_tokens
        )
    ]
    assert lengths == pytest.approx([600.0, 4_100.0])
    centred = [
        length for length, _ in prompt_distribution(load.prompt_histogram, load.mean_prompt_tokens)
    ]
    assert centred[1] > 1.04 * 4_100.0  # the geometric centres, scaled to the mean


def test_two_prompts_in_one_pass_spread_by_their_variance() -> None:
    est = _with_budget(LoadEstimator(window_s=30.0))
    sched = ScheduledRequestMetrics(
        num_prefill_requests=2, sum_prefill_tokens=2000, var_prefill_length=900.0**2
    )
    for k in range(10):
        est.observe(_msg(k, sched, wall=0.05), k * 0.5)
    hist = est.estimate(5.0).prompt_histogram
    # 100 and 1900 tokens: two bins, not one at the mean of 1000.
    assert len([h for h in hist if h > 0]) == 2 and sum(hist) == pytest.approx(20.0)


def _bin_of(length: int) -> int:
    """The prompt-length histogram bin of ``length`` tokens."""
    from stepscale_operator.load_types import PROMPT_BIN_EDGES

    return max(i for i, edge in enumerate(PROMPT_BIN_EDGES) if edge <= length)


def _long_prompt_finishing_in_a_full_pass(counter: int) -> list[ForwardPassMetrics]:
    """A 2,600-token prompt in chunks of a 1,000-token budget whose last chunk (600)
    shares a full pass with the first 400 tokens of an 800-token prompt, which ends
    in the pass after: the long prompt finishes in a full pass."""
    chunks = [
        ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=1000),
        ScheduledRequestMetrics(
            num_prefill_requests=1, sum_prefill_tokens=1000, sum_prefill_kv_tokens=1000
        ),
        ScheduledRequestMetrics(
            num_prefill_requests=2,
            sum_prefill_tokens=1000,
            sum_prefill_kv_tokens=2000,
            var_prefill_length=900.0**2,  # of the full lengths 2,600 and 800
        ),
        ScheduledRequestMetrics(
            num_prefill_requests=1, sum_prefill_tokens=400, sum_prefill_kv_tokens=400
        ),
    ]
    return [_msg(counter + i, sched, wall=0.05) for i, sched in enumerate(chunks)]


@pytest.mark.parametrize("batched", [False, True], ids=["one-by-one", "in-batches"])
def test_prompts_finishing_in_full_passes_are_counted(batched: bool) -> None:
    est = _with_budget(LoadEstimator(window_s=30.0), tokens=1000)
    for cycle in range(10):
        msgs = _long_prompt_finishing_in_a_full_pass(4 * cycle)
        if batched:  # the next pass in the same batch
            est.observe_batch(msgs, cycle + 0.5)
        else:  # the next pass in a later batch: the full pass waits for it
            for i, msg in enumerate(msgs):
                est.observe(msg, cycle + 0.1 * i)
    load = est.estimate(10.0)
    hist = load.prompt_histogram
    # Both prompts of every cycle, the long one included (only the 800s when a full
    # pass was taken to finish nothing).
    assert hist[_bin_of(2600)] == pytest.approx(10.0) and hist[_bin_of(800)] == pytest.approx(10.0)
    assert sum(hist) == pytest.approx(20.0)
    assert load.mean_prompt_tokens == pytest.approx(1700.0)


@pytest.mark.parametrize("then", ["decode-only pass", "heartbeat"])
def test_a_full_pass_before_a_pass_without_prompts_finished_them_all(then: str) -> None:
    est = _with_budget(LoadEstimator(window_s=30.0), tokens=1000)
    # Two prompts of 600 and 380 tokens fill the budget beside 20 decodes; nothing
    # goes on in the next message, so both finished.
    both = ScheduledRequestMetrics(
        num_prefill_requests=2,
        sum_prefill_tokens=980,
        var_prefill_length=110.0**2,
        num_decode_requests=20,
        sum_decode_kv_tokens=20 * 500,
    )
    counter = 0
    for cycle in range(10):
        est.observe(_msg(counter, both, wall=0.05), cycle + 0.1)
        nxt = (
            _msg(counter + 1, DECODE)
            if then == "decode-only pass"
            else heartbeat("w", 0, counter + 1)
        )
        est.observe(nxt, cycle + 0.2)
        counter += 2
    load = est.estimate(10.0)
    hist = load.prompt_histogram
    assert sum(hist) == pytest.approx(20.0)
    for length in (600, 380):
        assert hist[_bin_of(length)] == pytest.approx(10.0)
    assert load.mean_prompt_tokens == pytest.approx(490.0)


def _arrivals_with(per_second: list[int]) -> float:
    """Arrival dispersion measured when ``per_second[s]`` prompts finish in second s."""
    est = _with_budget(LoadEstimator(window_s=30.0))
    counter = 0
    for s, count in enumerate(per_second):
        for i in range(count):
            counter += 1
            est.observe(_one_prompt_pass(counter, 800), s + (i + 0.5) / (count + 1))
        counter += 1
        est.observe(_msg(counter, DECODE), s + 0.999)
    return est.estimate(float(len(per_second))).arrival_dispersion


def test_arrival_dispersion_tells_bursts_from_steady_arrivals() -> None:
    steady = _arrivals_with([4] * 30)
    bursty = _arrivals_with([0, 0, 0, 0, 0, 20] * 5)
    assert steady == pytest.approx(0.0, abs=0.05)  # perfectly regular: no variance
    # Poisson arrivals give 1; these come in bursts of 20 every 6 s.
    assert bursty > 5.0


def test_a_fleet_younger_than_the_window_is_no_burst_to_its_dispersion() -> None:
    # An operator (or a deployment) that started 8 s ago: steady arrivals of 4 a
    # second. The 22 s of the window before its first message were not observed; read
    # as seconds without arrivals they made the bursts scenario's steady 40 req/s a
    # dispersion of 36 at the first decision, which sized the fleet for a burst.
    est = LoadEstimator(window_s=30.0)
    budget = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=131_072)
    est.observe(_msg(0, budget), 0.01)
    counter = 0
    for s in range(8):
        for i in range(4):
            counter += 1
            est.observe(_one_prompt_pass(counter, 800), s + (i + 0.5) / 5)
        counter += 1
        est.observe(_msg(counter, DECODE), s + 0.999)
    load = est.estimate(8.0)
    assert load.arrival_dispersion == pytest.approx(0.0, abs=0.05)
    # The rate is the same span's: 4 a second, not 32 spread over 30 s.
    assert load.prefill_requests_per_s == pytest.approx(4.0, rel=0.15)


def _replica_arrivals(
    per_stream: dict[str, list[int]], start: dict[str, int] | None = None
) -> LoadEstimate:
    """The estimate when ``per_stream[w][s]`` prompts finish on stream ``w`` in second s
    (from second ``start[w]`` on: a pod that joined then)."""
    est = LoadEstimator(window_s=30.0)
    counter = 0
    seconds = max(len(v) for v in per_stream.values())
    for worker in per_stream:  # each stream's token budget, long before the window
        counter += 1
        budget = ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=131_072)
        est.observe(_msg(counter, budget, worker=worker), -100.0)
    for s in range(seconds):
        for worker, counts in per_stream.items():
            if s < (start or {}).get(worker, 0):
                continue
            for i in range(counts[s]):
                counter += 1
                at = s + (i + 0.5) / (counts[s] + 1)
                est.observe(_one_prompt_pass(counter, 800, worker=worker), at)
            counter += 1
            est.observe(_msg(counter, DECODE, worker=worker), s + 0.999)
    return est.estimate(float(seconds))


def test_replica_arrival_dispersion_shows_what_the_router_did_to_the_fleets_arrivals() -> None:
    # A steady fleet total of 8 a second, split alternately: all to one pod, then all
    # to the other. The fleet's arrivals are regular, each replica's come in bursts.
    alternating = _replica_arrivals({"a": [8, 0] * 15, "b": [0, 8] * 15})
    assert alternating.arrival_dispersion == pytest.approx(0.0, abs=0.05)
    assert alternating.replica_arrival_dispersion > 3.0
    # Bursts of 20 every 6 s split evenly: both the fleet's and each replica's bursty.
    even = _replica_arrivals({"a": [0, 0, 0, 0, 0, 10] * 5, "b": [0, 0, 0, 0, 0, 10] * 5})
    assert even.arrival_dispersion > 5.0 and even.replica_arrival_dispersion > 2.5
    assert even.replica_arrival_dispersion < even.arrival_dispersion


def test_a_pod_that_joined_mid_window_is_no_burst_to_its_replica_dispersion() -> None:
    load = _replica_arrivals({"a": [4] * 30, "b": [4] * 30}, start={"b": 15})
    # Its 15 silent seconds before it existed are not arrivals it missed.
    assert load.replica_arrival_dispersion == pytest.approx(0.0, abs=0.05)


def test_replica_arrival_dispersion_is_unknown_without_arrivals() -> None:
    load = _replica_arrivals({"a": [0] * 30})
    assert load.replica_arrival_dispersion == 0.0
    assert "replica_arrival_dispersion" in load.unavailable


def test_queue_growth_counts_as_arrivals() -> None:
    # Nothing finishes prefill, but the prefill queue grows by 3 every second
    # in bursts of 9 every third second: those are arrivals.
    est = LoadEstimator(window_s=30.0)
    queued = 0
    for s in range(30):
        if s % 3 == 0:
            queued += 9
        q = QueuedRequestMetrics(num_prefill_requests=queued, sum_prefill_tokens=queued * 100)
        est.observe(_msg(s, DECODE, queued=q), s + 0.5)
    load = est.estimate(30.0)
    assert load.arrival_dispersion > 2.0


def _one_prefill_pass_a_second(seconds: int) -> LoadEstimate:
    # Per second: 9 decode passes of 10 ms with 10 decode requests, then one prefill
    # pass of 100 ms with 2 (a router that sends prompts to the replica with the
    # fewest requests).
    est = _with_budget(LoadEstimator(window_s=30.0))
    counter = 0
    for s in range(seconds):
        for i in range(10):
            counter += 1
            sched, wall = DECODE, 0.01
            if i == 9:
                sched = ScheduledRequestMetrics(
                    num_prefill_requests=1,
                    sum_prefill_tokens=2000,
                    num_decode_requests=2,
                    sum_decode_kv_tokens=1000,
                )
                wall = 0.1
            est.observe(_msg(counter, sched, wall=wall), s + i / 10.0)
    return est.estimate(float(seconds))


def test_realized_itl_is_pass_time_weighted_by_decode_requests() -> None:
    load = _one_prefill_pass_a_second(20)
    # Per token (90*10 + 2*100) / 92 ms.
    assert load.realized_itl_mean_ms == pytest.approx((90 * 10 + 2 * 100) / 92, rel=1e-6)
    assert load.realized_itl_tail_ms >= load.realized_itl_mean_ms - 1e-9
    # One prompt per second, each in prefill for one 100 ms pass, nobody queued.
    assert load.realized_ttft_mean_ms == pytest.approx(100.0, rel=1e-6)


def test_prefill_passes_that_carry_fewer_decodes_than_the_mean_give_the_deficit() -> None:
    load = _one_prefill_pass_a_second(25)
    # The mean pass carries (9 x 10 + 2) / 10 = 9.2 decode requests, a prefill pass 2.
    assert load.prefill_pass_decode_deficit == pytest.approx(7.2, rel=1e-6)
    assert "prefill_pass_decode_deficit" not in load.unavailable
    # Ten prefill passes say too little: unknown, not zero.
    few = _one_prefill_pass_a_second(10)
    assert "prefill_pass_decode_deficit" in few.unavailable
    assert few.to_dict()["prefill_pass_decode_deficit"] is None
