"""Output lengths measured from the pass stream, and the ITL quantile they set."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import numpy.typing as npt
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics, heartbeat
from stepscale_operator.itl_quantile import (
    PassTimes,
    PrefillPassChain,
    itl_distribution,
    normal_itl_distribution,
)
from stepscale_operator.latency_model import EngineLimits, PerReplicaLoad, predict_latency
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS
from stepscale_operator.output_lengths import OutputLengthEstimator
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.prompt_mix import PromptMix
from tests.unit.test_planner import LinearStepTime


def itl_quantile(
    passes: PassTimes,
    chain: PrefillPassChain,
    bins: tuple[tuple[int, int, float], ...],
    variance_per_pass: float,
    tail: float,
    prompts: PromptMix | None = None,
    mean_intervals: float = 0.0,
    own_context: tuple[tuple[float, float], ...] = ((0.0, 1.0),),
) -> float:
    """The ITL exceeded by a share ``tail`` of requests (as the latency model takes it)."""
    dist = itl_distribution(
        passes, chain, bins, variance_per_pass, prompts, mean_intervals, own_context
    )
    return dist.quantile(tail)


FloatArray = npt.NDArray[np.float64]


def _stream(
    passes: int, seed: int, short_share: float = 0.35
) -> tuple[FloatArray, FloatArray, npt.NDArray[np.int64]]:
    """One engine's passes: prompts finishing prefill per pass (clustered arrivals),
    the decode batch each pass sees, and the output lengths drawn.

    Each request leaves the decode batch ``L - 1`` passes after its prefill, as in
    vLLM; ``short_share`` of the outputs are 1-10 tokens, the rest log-normal."""
    rng = np.random.default_rng(seed)
    starts = np.flatnonzero(rng.random(passes) < 0.02)
    sizes = rng.geometric(0.5, starts.size)
    at = np.repeat(starts, sizes) + rng.integers(0, 50, int(sizes.sum()))
    finished_prefill = np.bincount(at[at < passes], minlength=passes)
    n = int(finished_prefill.sum())
    lengths = np.where(
        rng.random(n) < short_share,
        rng.integers(1, 11, n),
        np.clip(rng.lognormal(math.log(60.0), 1.0, n), 1, 4000).astype(np.int64),
    )
    leaves = np.zeros(passes + 5000)
    np.add.at(leaves, np.repeat(np.arange(passes), finished_prefill) + lengths - 1, 1.0)
    decoding = np.zeros(passes)
    decoding[1:] = np.cumsum(finished_prefill - leaves[:passes])[:-1]
    return finished_prefill.astype(np.float64), decoding, lengths


def _routed_fleet(
    passes: int, replicas: int, seed: int, short_share: float = 0.35
) -> tuple[list[FloatArray], list[FloatArray], npt.NDArray[np.int64]]:
    """Engines behind a router that sends each prompt to the one with the fewest
    requests (the simulator's router, and a load-aware gateway's): a replica's
    arrivals follow its own departures. Passes are in step across replicas;
    arrivals are Poisson with a slowly swinging rate. Returns per replica the
    prompts finishing prefill per pass and the decode batch, and all lengths."""
    rng = np.random.default_rng(seed)
    rate = 0.6 * replicas * (1.0 + 0.8 * np.sin(np.arange(passes) / 3000.0))
    arrivals = rng.poisson(rate)
    total = int(arrivals.sum())
    lengths = np.where(
        rng.random(total) < short_share,
        rng.integers(1, 11, total),
        np.clip(rng.lognormal(math.log(60.0), 1.0, total), 1, 4000).astype(np.int64),
    )
    jitter = rng.random((total, replicas)) * 0.5  # ties broken at random
    finished_prefill = np.zeros((replicas, passes))
    leaves = np.zeros((replicas, passes + 5000))
    outstanding = np.zeros(replicas)
    i = 0
    for j in range(passes):
        if j:
            outstanding -= leaves[:, j - 1]
        for _ in range(int(arrivals[j])):
            r = int(np.argmin(outstanding + jitter[i]))
            finished_prefill[r, j] += 1.0
            leaves[r, j + lengths[i] - 1] += 1.0
            outstanding[r] += 1.0
            i += 1
    decoding = np.zeros((replicas, passes))
    decoding[:, 1:] = np.cumsum(finished_prefill - leaves[:, :passes], axis=1)[:, :-1]
    return list(finished_prefill), list(decoding), lengths


def _walls(finished_prefill: FloatArray) -> FloatArray:
    """Every pass 10 ms: streams of passes with no heartbeat among them."""
    return np.full(finished_prefill.shape[0], 0.01)


def _true_shares(lengths: npt.NDArray[np.int64]) -> list[float]:
    intervals = lengths - 1
    return [float(np.mean((intervals >= a) & (intervals <= b))) for a, b in OUTPUT_INTERVAL_BINS]


def test_output_length_shares_are_recovered_from_when_requests_leave_the_decode_batch() -> None:
    estimator = OutputLengthEstimator(half_life_s=1e9)
    lengths = []
    for slot in range(3):
        a, d, drawn = _stream(300_000, seed=slot)
        lengths.append(drawn)
        for k in range(0, a.size, 300):  # delivered in ingest-sized batches
            estimator.observe(
                slot, a[k : k + 300], d[k : k + 300], _walls(a[k : k + 300]), now=k * 0.01
            )
    shares = estimator.shares()
    true = _true_shares(np.concatenate(lengths))
    assert len(shares) == len(OUTPUT_INTERVAL_BINS)
    # Each short bin (1 to 16 tokens) within 0.015 of its true share (2-9%), and the
    # share of outputs of at most 12 tokens within 5 points of the true ~39%: what
    # a million passes pin down (single streams of 200k passes scatter by -18..+4%).
    for got, want in zip(shares[:8], true[:8], strict=True):
        assert got == pytest.approx(want, abs=0.015), (shares, true)
    assert sum(shares[:7]) == pytest.approx(sum(true[:7]), abs=0.05)


def test_output_lengths_are_not_biased_by_a_router_that_answers_departures() -> None:
    # Plain least squares put the 1-8 token shares 40% low here (0.019-0.024
    # against 0.035): later arrivals told it how long earlier requests ran.
    a, d, lengths = _routed_fleet(150_000, replicas=3, seed=5)
    estimator = OutputLengthEstimator(half_life_s=1e9)
    for k in range(0, a[0].size, 300):
        for slot in range(3):
            estimator.observe(
                slot,
                a[slot][k : k + 300],
                d[slot][k : k + 300],
                _walls(a[slot][k : k + 300]),
                now=k * 0.01,
            )
    shares = estimator.shares()
    true = _true_shares(lengths)
    for got, want in zip(shares[:4], true[:4], strict=True):  # 1-4 tokens
        assert got == pytest.approx(want, rel=0.2), (shares, true)
    assert sum(shares[:6]) == pytest.approx(sum(true[:6]), rel=0.1)


def _idle_engine(
    seconds: float, rate: float, seed: int, pass_s: float = 0.01
) -> tuple[FloatArray, FloatArray, FloatArray, npt.NDArray[np.int64], FloatArray]:
    """One engine that is often idle: Poisson prompts at ``rate`` a second, one pass
    of ``pass_s`` each to prefill, then one per output token; no pass while there is
    nothing to do, and a heartbeat (wall time 0) for each whole second without one.
    Returns per message the prompts finishing prefill, the decode batch and the wall
    time, the output lengths drawn (log-normal, median 100 tokens), and per message
    the time it is published."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, int(rate * seconds * 1.5) + 10))
    arrivals = arrivals[arrivals < seconds]
    lengths = np.clip(rng.lognormal(math.log(100.0), 1.0, arrivals.size), 1, 4000).astype(np.int64)
    finished, batch, wall, sent = [], [], [], []
    left: list[int] = []  # intervals still to generate, per request decoding
    t, i = 0.0, 0
    while i < arrivals.size or left:
        if not left and arrivals[i] > t:
            beats = int((arrivals[i] - t) // 1.0)
            finished += [0.0] * beats
            batch += [0.0] * beats
            wall += [0.0] * beats
            sent += [t + k for k in range(1, beats + 1)]
            t = float(arrivals[i])
        decoding = len(left)
        new = 0
        while i < arrivals.size and arrivals[i] <= t:
            left.append(int(lengths[i]) - 1)
            new += 1
            i += 1
        finished.append(float(new))
        batch.append(float(decoding))
        wall.append(pass_s)
        sent.append(t + pass_s)
        # The requests decoding got a token each; the new ones got their first.
        left = [r - 1 if k < decoding else r for k, r in enumerate(left)]
        left = [r for r in left if r > 0]
        t += pass_s
    return np.array(finished), np.array(batch), np.array(wall), lengths, np.array(sent)


def test_output_lengths_of_an_often_idle_engine_count_its_idle_time() -> None:
    # A replica busy a fifth of the time: in pass counts the next prompt comes right
    # after the last request leaves, and without the idle time put back the shares
    # of 32-127 intervals came out less than half the truth (0.21 against 0.46;
    # with it 0.48).
    streams = [_idle_engine(1500.0, 0.15, seed) for seed in range(6)]
    with_idle = OutputLengthEstimator(half_life_s=1e9)
    passes_only = OutputLengthEstimator(half_life_s=1e9)
    for slot, (a, d, w, _, _) in enumerate(streams):
        for k in range(0, a.size, 300):
            part = slice(k, k + 300)
            with_idle.observe(slot, a[part], d[part], w[part], now=k * 0.01)
            ran = w[part] > 0.0
            passes_only.observe(slot, a[part][ran], d[part][ran], w[part][ran], now=k * 0.01)
    true = _true_shares(np.concatenate([lengths for _, _, _, lengths, _ in streams]))
    # The bins of 32-127 intervals: the outputs of median length and shorter.
    assert sum(true[10:]) > 0.15
    assert sum(with_idle.shares()[10:]) == pytest.approx(sum(true[10:]), rel=0.2)
    assert sum(passes_only.shares()[10:]) < 0.6 * sum(true[10:])


def test_heartbeats_in_one_call_count_for_the_pass_in_the_next() -> None:
    # Ingest splits a stream's messages at arbitrary points: an idle stretch whose
    # heartbeats arrive in one call and whose next pass in another is the same idle.
    a = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    d = np.array([2.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    w = np.array([0.01, 0.0, 0.0, 0.0, 0.01, 0.01])  # a pass, 3 heartbeats, 2 passes
    split = OutputLengthEstimator()
    split.observe(0, a[:4], d[:4], w[:4], now=0.0)
    split.observe(0, a[4:], d[4:], w[4:], now=3.0)
    whole = OutputLengthEstimator()
    whole.observe(0, a, d, w, now=3.0)
    for est in (split, whole):
        passes = est._pending[0]
        idle = np.concatenate([np.zeros(p[0].size) if p[3] is None else p[3] for p in passes])
        assert idle.tolist() == [0.0, 3.0, 0.0]  # heartbeats before each pass
        assert np.concatenate([p[0] for p in passes]).tolist() == [0.0, 1.0, 0.0]


def test_a_new_stream_asked_after_each_single_pass_is_learned_as_in_one_batch() -> None:
    # The simulator's policies ask for shares every tick, when a new stream may have
    # sent one pass: its first flush then completes no pass (the bench once crashed).
    a, d, _ = _stream(20_000, seed=9)
    stepwise = OutputLengthEstimator(half_life_s=1e9, min_finished=0.0)
    for k in range(3):
        stepwise.observe(0, a[k : k + 1], d[k : k + 1], _walls(a[k : k + 1]), now=0.0)
        stepwise.shares()
    stepwise.observe(0, a[3:], d[3:], _walls(a[3:]), now=0.0)
    whole = OutputLengthEstimator(half_life_s=1e9, min_finished=0.0)
    whole.observe(0, a, d, _walls(a), now=0.0)
    assert stepwise.shares() == pytest.approx(whole.shares(), abs=1e-9)


def test_output_lengths_wait_for_enough_requests_and_forget_a_stream() -> None:
    estimator = OutputLengthEstimator(half_life_s=1e9, min_finished=500.0)
    a, d, _ = _stream(5_000, seed=7)  # ~150 requests
    estimator.observe(0, a, d, _walls(a), now=0.0)
    assert estimator.shares() == ()
    estimator.forget(0)
    a, d, _ = _stream(100_000, seed=8)
    estimator.observe(1, a, d, _walls(a), now=1.0)
    assert len(estimator.shares()) == len(OUTPUT_INTERVAL_BINS)


def test_a_stream_first_seen_mid_flight_is_learned_only_past_its_longest_lag() -> None:
    a, d, _ = _stream(60_000, seed=3)
    cold = OutputLengthEstimator(half_life_s=1e9, min_finished=0.0)
    cold.observe(
        0, a[30_000:], d[30_000:], _walls(a[30_000:]), now=0.0
    )  # requests already decoding
    whole = OutputLengthEstimator(half_life_s=1e9, min_finished=0.0)
    whole.observe(0, a, d, _walls(a), now=0.0)
    # Without the wait, the unknown history would be taken for silence and every
    # request decoding at the first pass for one that arrived with no prefill.
    assert 0.0 < cold._finished < 0.95 * float(a[30_000:].sum())
    assert whole._finished == pytest.approx(float(a[:-1].sum()), rel=0.05)


def test_the_load_estimate_carries_the_output_lengths_of_its_streams() -> None:
    a, d, lengths = _stream(150_000, seed=11)
    est = LoadEstimator(window_s=30.0)
    est.add_stream(("pod-0", 0))
    msgs = [
        ForwardPassMetrics(
            worker_id="pod-0",
            counter_id=i,
            wall_time=0.01,
            scheduled_requests=ScheduledRequestMetrics(
                num_prefill_requests=int(a[i]),
                sum_prefill_tokens=64 * int(a[i]),
                num_decode_requests=int(d[i]),
                sum_decode_kv_tokens=100 * int(d[i]),
            ),
        )
        for i in range(a.size)
    ]
    for k in range(0, len(msgs), 1000):
        est.observe_batch(msgs[k : k + 1000], now=k * 0.01)
    shares = est.estimate(a.size * 0.01).output_interval_shares
    true = _true_shares(lengths)
    assert len(shares) == len(OUTPUT_INTERVAL_BINS)
    assert sum(shares[:7]) == pytest.approx(sum(true[:7]), abs=0.06)


def test_the_load_estimate_hands_its_streams_heartbeats_to_the_output_lengths() -> None:
    # The same often-idle engines, as messages through the load estimator in the
    # order they are sent: the idle time reaches the output lengths only if the
    # heartbeats do.
    streams = [_idle_engine(1500.0, 0.15, seed) for seed in range(6)]
    # Prompts of varied length (median 300 tokens, within the 2,048-token budget):
    # the estimator takes a pass that fills the largest it has seen for a chunk.
    prompt_tokens = np.random.default_rng(0).lognormal(math.log(300.0), 1.0, 100_000)
    prompt_tokens = np.clip(prompt_tokens, 16, 2048).astype(np.int64)
    msgs: list[tuple[float, ForwardPassMetrics]] = []
    for pod, (a, d, w, _, sent) in enumerate(streams):
        for i in range(a.size):
            if w[i] <= 0.0:
                msgs.append((sent[i], heartbeat(f"pod-{pod}", 0, i)))
                continue
            sched = ScheduledRequestMetrics(
                num_prefill_requests=int(a[i]),
                sum_prefill_tokens=int(prompt_tokens[i % prompt_tokens.size]) * int(a[i]),
                num_decode_requests=int(d[i]),
                sum_decode_kv_tokens=100 * int(d[i]),
            )
            msgs.append(
                (
                    sent[i],
                    ForwardPassMetrics(
                        worker_id=f"pod-{pod}",
                        counter_id=i,
                        wall_time=float(w[i]),
                        scheduled_requests=sched,
                    ),
                )
            )
    msgs.sort(key=lambda m: m[0])
    est = LoadEstimator(window_s=30.0)
    for k in range(0, len(msgs), 1000):
        batch = msgs[k : k + 1000]
        est.observe_batch([m for _, m in batch], now=batch[-1][0])
    shares = est.estimate(msgs[-1][0]).output_interval_shares
    true = _true_shares(np.concatenate([lengths for _, _, _, lengths, _ in streams]))
    assert sum(shares[10:]) == pytest.approx(sum(true[10:]), rel=0.2)


def test_prefill_pass_chain_has_the_asked_share_and_long_window_variance() -> None:
    chain = PrefillPassChain.of(0.2, variance_per_pass=0.2 * 3.0)
    dists = chain.count_distributions(32)
    for m, dist in enumerate(dists, start=1):
        assert dist.sum() == pytest.approx(1.0)
        assert float(np.arange(m + 1) @ dist) == pytest.approx(0.2 * m)
    k = np.arange(33)
    var32 = float(k**2 @ dists[31] - (k @ dists[31]) ** 2)
    # Correlated passes: more spread than independent ones (0.16 per pass), tending
    # to the asked 0.6 per pass as the window grows.
    assert 0.16 * 32 < var32 < 0.6 * 32


def test_itl_quantile_of_two_token_outputs_is_a_prefill_pass_when_more_than_the_tail_hit_one() -> (
    None
):
    passes = PassTimes(decode_s=0.008, prefill_s=0.060, mean_s=0.0184)
    chain = PrefillPassChain.of(0.2, 0.2 * 0.8)
    only_two = ((0, 0, 0.0), (1, 1, 1.0))  # every request generates 2 tokens: one interval
    assert itl_quantile(passes, chain, only_two, 0.16, 0.01) == pytest.approx(0.060, rel=1e-3)
    # All long: the mean pass plus a normal tail, far below a prefill pass.
    none_short = tuple((a, b, 0.0) for a, b in OUTPUT_INTERVAL_BINS)
    long_only = itl_quantile(passes, chain, none_short, 0.16, 0.01)
    assert 0.0184 < long_only < 0.03


def test_itl_quantile_mixes_the_requests_own_context_shifts() -> None:
    # No prefill at all: every request's ITL is its decode pass, moved by its context.
    passes = PassTimes(decode_s=0.007, prefill_s=0.007, mean_s=0.007)
    chain = PrefillPassChain.of(0.0, 0.0)
    long_only = tuple((a, b, 0.0) for a, b in OUTPUT_INTERVAL_BINS)
    assert itl_quantile(passes, chain, long_only, 0.0, 0.01) == pytest.approx(0.007)
    # 2% of requests read 5 ms more KV a pass: they are the p99.
    two_percent = ((-0.0001, 0.98), (0.005, 0.02))
    at_p99 = itl_quantile(passes, chain, long_only, 0.0, 0.01, own_context=two_percent)
    assert at_p99 == pytest.approx(0.012, rel=1e-3)
    # Half a percent of them are below the tail: the p99 is the others' pass.
    half_percent = ((0.0, 0.995), (0.005, 0.005))
    below = itl_quantile(passes, chain, long_only, 0.0, 0.01, own_context=half_percent)
    assert below == pytest.approx(0.007, rel=1e-3)
    # The prior's normal takes the same mixture; one class is the normal itself.
    assert normal_itl_distribution(0.007, 0.0, two_percent).quantile(0.01) == pytest.approx(
        0.012, rel=1e-3
    )
    assert normal_itl_distribution(0.007, 0.001, ((0.0, 1.0),)).quantile(0.01) == pytest.approx(
        0.007 + 2.3263e-3, rel=1e-3
    )


def test_measured_short_outputs_raise_the_predicted_itl_tail_and_the_prior_stays() -> None:
    base = PerReplicaLoad(
        prefill_tokens_per_s=12000.0,
        prefill_requests_per_s=8.0,
        decode_tokens_per_s=200.0,
        mean_prompt_tokens=1500.0,
        mean_cached_tokens=0.0,
        mean_decode_context_tokens=1600.0,
        arrival_dispersion=3.0,
    )
    policy = PlannerPolicy()
    engine = EngineLimits()
    prior = predict_latency(LinearStepTime(), base, engine, policy)
    long_outputs = tuple((a, b, 0.0) for a, b in OUTPUT_INTERVAL_BINS)  # measured: none short
    short = tuple((a, b, 0.035 * (b - a + 1) if b <= 9 else 0.0) for a, b in OUTPUT_INTERVAL_BINS)
    with_long = predict_latency(LinearStepTime(), _with(base, long_outputs), engine, policy)
    with_short = predict_latency(LinearStepTime(), _with(base, short), engine, policy)
    assert with_short.itl_ms > 1.5 * with_long.itl_ms
    assert with_short.itl_mean_ms == pytest.approx(prior.itl_mean_ms)
    assert with_long.itl_ms > with_long.itl_mean_ms


def _with(load: PerReplicaLoad, bins: tuple[tuple[int, int, float], ...]) -> PerReplicaLoad:
    return replace(load, output_intervals=bins)


# 90% one-chunk prompts adding 10 ms, 10% eight-chunk ones adding 30 ms a chunk,
# 0.05 prompts per pass with dispersion 3.
_TWO_CLASS_MIX = PromptMix(0.05, 3.0, ((1.0, 0.010, 0.9), (8.0, 0.030, 0.1)))


def _assert_two_class_compound(step: float, cdf: npt.NDArray[np.float64], count: float) -> None:
    """``cdf`` is the extra time of ``count`` prompts of the mix on average, a
    negative binomial count (variance 3 x ``count``)."""
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    grid = np.arange(cdf.size) * step
    mean_x = 0.9 * 0.010 + 0.1 * 0.240
    second_x = 0.9 * 0.010**2 + 0.1 * 0.240**2
    assert float(pmf @ grid) == pytest.approx(count * mean_x, rel=1e-3)
    variance = float(pmf @ grid**2) - float(pmf @ grid) ** 2
    want = count * (second_x - mean_x**2) + 3.0 * count * mean_x**2
    assert variance == pytest.approx(want, rel=0.02)


def test_prompt_mix_extra_time_has_the_compound_mean_and_variance() -> None:
    # Over 100 passes: 5 prompts on average.
    table = _TWO_CLASS_MIX.extra_cdf_table([100], np.zeros(1))
    _assert_two_class_compound(float(table.steps[0]), table.rows(0)[0], count=5.0)


def test_a_prompt_rarer_than_the_tail_moves_the_variance_not_the_long_outputs_p99() -> None:
    # 0.5% of prompts take 100 chunks of 200 ms: rarer than 1 in 100 requests' lives.
    passes = PassTimes(decode_s=0.010, prefill_s=0.014, mean_s=0.0125)
    classes = ((1.0, 0.004, 0.995), (100.0, 0.200, 0.005))
    mix = PromptMix(0.01, 1.0, classes)
    long_only = tuple((a, b, 0.0) for a, b in OUTPUT_INTERVAL_BINS)  # all past the bins
    chain = PrefillPassChain.of(0.02, 0.02)
    compound = itl_quantile(passes, chain, long_only, 0.02, 0.01, mix, 128.0)
    # A normal with the compound's variance: mean extra per pass 0.01 x (0.995 x
    # 0.004 + 0.005 x 20), over 128 passes.
    mean_x = 0.995 * 0.004 + 0.005 * 20.0
    second_x = 0.995 * 0.004**2 + 0.005 * 20.0**2
    sd = math.sqrt(0.01 * 128 * second_x) / 128
    normal = passes.decode_s + 0.01 * mean_x + 2.326 * sd
    assert compound < 0.5 * normal
    # The common prompts still set it: a little above a decode pass.
    assert passes.decode_s < compound < passes.decode_s + 0.004


def test_prompts_queued_behind_a_prefill_add_to_the_compound_count() -> None:
    # As above, with 2 prompts more on average in the second row: 7 prompts, on
    # the grid both rows share.
    table = _TWO_CLASS_MIX.extra_cdf_table([100], np.array([0.0, 2.0]))
    step, cdf = float(table.steps[0]), table.rows(0)
    _assert_two_class_compound(step, cdf[0], count=5.0)
    _assert_two_class_compound(step, cdf[1], count=7.0)


def test_the_longest_prompts_requests_meet_the_prompts_queued_behind_their_prefill() -> None:
    # Two prompt classes: short ones of one chunk, and long ones of 12 chunks that
    # hold the prefill budget for 11 passes of 0.3 s, while 0.5 prompts arrive a
    # second: 1.65 prompts wait behind each long prompt and are prefilled in its
    # request's first passes.
    passes = PassTimes(decode_s=0.008, prefill_s=0.2, mean_s=0.03)
    classes = ((1.0, 0.02, 0.9), (12.0, 0.3, 0.1))
    mix = PromptMix(0.5 * 0.03, 1.0, classes)
    own = ((0.0, 0.9), (0.004, 0.1))
    outputs = tuple((a, b, 0.0) for a, b in OUTPUT_INTERVAL_BINS)  # all long
    chain = PrefillPassChain.of(0.05, 0.1)

    def share_above(
        limit_s: float, behind: tuple[float, ...], own_context: tuple[tuple[float, float], ...]
    ) -> float:
        dist = itl_distribution(passes, chain, outputs, 0.1, mix, 100.0, own_context, None, behind)
        return dist.share_above(limit_s)

    # Nothing behind: what the mix gave before this term.
    assert share_above(0.06, (0.0, 0.0), own) == pytest.approx(share_above(0.06, (), own))
    behind = (0.0, 0.5 * 11 * 0.3)
    # The long prompts' requests alone: more of them over the limit.
    long_alone = ((0.0, 0.0), (0.004, 1.0))
    assert share_above(0.06, behind, long_alone) > 1.5 * share_above(0.06, (0.0, 0.0), long_alone)
    # The short prompts' requests are as before.
    short_alone = ((0.0, 1.0), (0.004, 0.0))
    assert share_above(0.06, behind, short_alone) == pytest.approx(
        share_above(0.06, (0.0, 0.0), short_alone)
    )
