"""EarlyPrefillEstimator: the prefill passes a request meets right after its first
token, from the pass stream; the beta-binomial the latency model draws them from."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics, heartbeat
from stepscale_operator.early_prefills import (
    MIN_FINISHED,
    SHARE_PASSES,
    SPANS,
    EarlyPrefillEstimator,
    EarlyPrefills,
    beta_binomial_rows,
    beta_binomials,
)
from stepscale_operator.itl_quantile import PrefillPassChain
from stepscale_operator.load_estimate import LoadEstimator


def _clumped(cycles: int, gap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(wall, prefill, finished) of a stream where prompts come in pairs: a prompt
    finishes, its mate is prefilled on the next pass, then ``gap`` decode passes."""
    prefill = np.tile(np.r_[1.0, 1.0, np.zeros(gap)], cycles)
    finished = prefill.copy()
    return np.full(prefill.shape, 0.02), prefill, finished


def _decoding(wall: np.ndarray) -> np.ndarray:
    """Every pass decodes (a heartbeat none): a stream that never ran dry."""
    return (wall > 0.0).astype(float)


def test_a_clump_mate_prefilled_next_lifts_the_first_passes_over_the_share() -> None:
    wall, prefill, finished = _clumped(400, 18)  # 2 prefill passes in 20: share 0.1
    est = EarlyPrefillEstimator(window_s=30.0)
    est.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=10.0)
    early = est.measured(10.0)
    assert early is not None
    assert early.spans == SPANS
    # After the first of a pair the next pass is prefill (1 in 1), after the second
    # none for 18: over one pass half of the finished prompts meet a prefill pass,
    # five times the share (a little less: the share is taken up to the prompt's
    # own pass, which carries prefill, and a stream's first passes have few before).
    lift_1, _ = early.at(1)
    assert lift_1 == pytest.approx(0.5 / 0.1, rel=0.05)
    # Over 16 passes the first of a pair meets its mate, the second none: K is 1
    # or 0, less variable than a binomial of that share, so no overdispersion.
    lift_16, rho_16 = early.at(16)
    assert lift_16 == pytest.approx(0.5 / 16 / 0.1, rel=0.05)
    assert rho_16 == 0.0
    want = _reference(wall, prefill, finished, np.zeros(wall.shape), _decoding(wall))
    for m, lift in zip(early.spans, early.lift, strict=True):
        assert lift == pytest.approx(want[m][0])


def test_each_prompt_is_judged_against_its_own_streams_share() -> None:
    # Two replicas: one busy with prefill (every other pass), one that rarely
    # prefills; on neither does a prompt meet more prefill than its replica's
    # share, though pooled the busy one's prompts meet far more than the mean.
    busy = np.tile([1.0, 0.0], 2000)
    quiet = np.tile(np.r_[1.0, np.zeros(39)], 100)
    est = EarlyPrefillEstimator()
    for slot, pre in ((0, busy), (1, quiet)):
        wall = np.full(pre.shape, 0.02)
        est.observe(slot, wall, pre, pre, np.zeros(pre.shape), _decoding(wall), now=2.0)
    early = est.measured(2.0)
    assert early is not None
    lift_2, _ = early.at(2)  # two passes: exactly one prefill on the busy replica
    assert lift_2 == pytest.approx(1.0, rel=0.05)


def _reference(
    wall: np.ndarray,
    prefill: np.ndarray,
    finished: np.ndarray,
    waiting: np.ndarray,
    decoding: np.ndarray,
) -> dict[int, tuple[float, float]]:
    """(lift, rho) per span, counted prompt by prompt against its stream's share,
    from its stream's SHARE_PASSES-th pass on and outside a backlog: the passes
    up to the first that decodes nothing or follows a heartbeat as they were, the
    rest a binomial at the share of prefill among the passes that decode."""
    passes = wall > 0.0
    run = np.cumsum(wall <= 0.0)[passes]
    pre = (prefill[passes] > 0).astype(float)
    dec = decoding[passes] > 0
    fin, wait, busy = finished[passes], waiting[passes], wall[passes]
    out = {}
    for m in SPANS:
        counts, variances, weights, shares = [], [], [], []
        for j in range(SHARE_PASSES - 1, pre.size - m):
            last = slice(j + 1 - SHARE_PASSES, j + 1)
            calm = (wait[last] * busy[last]).sum() < busy[last].sum()
            if fin[j] <= 0 or not calm:
                continue
            seen = 0
            while seen < m and dec[j + 1 + seen] and run[j + 1 + seen] == run[j + seen]:
                seen += 1
            share = pre[last].mean()
            decode_share = pre[last][dec[last]].mean() if dec[last].any() else share
            rest = (m - seen) * decode_share
            counts.append(pre[j + 1 : j + 1 + seen].sum() + rest)
            variances.append(rest * (1 - decode_share))
            weights.append(fin[j])
            shares.append(share)
        k, v, w, s = np.array(counts), np.array(variances), np.array(weights), np.array(shares)
        lift = (w @ k) / (m * (w @ s))
        q = lift * s
        residual = w @ ((k - m * q) ** 2 + v)
        binomial = w @ (m * q * (1 - q))
        rho = 0.0 if m == 1 else min(max((residual / binomial - 1) / (m - 1), 0.0), 1.0)
        out[m] = (lift, rho)
    return out


def test_each_span_counts_the_prefill_passes_after_every_finished_prompt() -> None:
    rng = np.random.default_rng(11)
    # Prompts in clumps: a pass carries prefill more often right after another.
    pre = np.zeros(6000)
    for i in range(1, pre.size):
        pre[i] = rng.random() < (0.5 if pre[i - 1] else 0.06)
    finished = pre * rng.integers(1, 3, pre.size).astype(float)
    wall = np.where(rng.random(pre.size) < 0.005, 0.0, 0.02)
    # Now and then the engine runs dry: a pass that decodes nothing.
    decoding = ((rng.random(pre.size) < 0.97) & (wall > 0.0)).astype(float)
    # A backlog over the middle third: its prompts are left out.
    waiting = np.where((np.arange(pre.size) > 2000) & (np.arange(pre.size) < 4000), 2.0, 0.0)
    est = EarlyPrefillEstimator()
    est.observe(0, wall, pre, finished, waiting, decoding, now=3.0)
    early = est.measured(3.0)
    assert early is not None
    want = _reference(wall, pre, finished, waiting, decoding)
    rhos = dict(zip(early.spans, early.overdispersion, strict=True))
    for m, lift in zip(early.spans, early.lift, strict=True):
        assert lift == pytest.approx(want[m][0])
        if m > 1:
            assert rhos[m] == pytest.approx(want[m][1])
    assert early.lift[0] > 2.0  # the clumps lift the first pass well over the share
    assert rhos[2] == rhos[1]  # one pass has none; the span of 2 stands for it


def test_a_backlog_and_a_stream_s_first_passes_are_not_counted() -> None:
    # A replica whose queue holds prompts all along prefills one after another: a
    # finished prompt always meets the next, but that is the backlog, not how
    # prompts come. Nor does a stream count before it has a share of its own.
    wall, prefill, finished = _clumped(400, 18)
    est = EarlyPrefillEstimator()
    dec = _decoding(wall)
    est.observe(0, wall, prefill, finished, np.full(wall.shape, 2.0), dec, now=1.0)
    assert est.measured(1.0) is None
    # A backlog that grew only lately (its stream's last passes had room on
    # average) still says the window's passes served a backlog: nothing measured.
    late = EarlyPrefillEstimator()
    waiting = np.where(np.arange(wall.size) > 0.6 * wall.size, 3.0, 0.0)
    late.observe(0, wall, prefill, finished, waiting, dec, now=1.0)
    assert late.measured(1.0) is None
    calm = EarlyPrefillEstimator()
    calm.observe(0, wall, prefill, finished, np.where(waiting > 0, 0.5, 0.0), dec, now=1.0)
    assert calm.measured(1.0) is not None
    # Over time, not passes: a backlog's passes are the long ones. Here one pass
    # in four holds 2 waiting: 0.5 a pass, but 1.4 over the time (its passes last
    # 0.1 s, the others 0.01 s).
    slow = np.arange(wall.size) % 4 == 0
    timed = EarlyPrefillEstimator()
    timed.observe(
        0, np.where(slow, 0.1, 0.01), prefill, finished, np.where(slow, 2.0, 0.0), dec, now=1.0
    )
    assert timed.measured(1.0) is None
    young = EarlyPrefillEstimator()
    n = SHARE_PASSES - 1  # a prompt finishing on each, enough to count were it older
    young.observe(0, np.full(n, 0.02), np.ones(n), np.ones(n), np.zeros(n), np.ones(n), now=1.0)
    assert young.measured(1.0) is None
    ones = np.ones(200)
    young.observe(0, np.full(200, 0.02), ones, ones, np.zeros(200), ones, now=1.0)
    assert young.measured(1.0) is not None


def test_batches_split_anywhere_give_what_one_batch_gives() -> None:
    rng = np.random.default_rng(3)
    prefill = (rng.random(4000) < 0.2).astype(float)
    finished = prefill * rng.integers(1, 3, 4000).astype(float)
    wall = np.where(rng.random(4000) < 0.01, 0.0, 0.02)  # a few heartbeats
    # A backlog now and then (not whole numbers: a mean of exactly one is a tie
    # that the sums' rounding breaks differently from batch to batch).
    waiting = rng.uniform(0.0, 2.0, 4000)
    whole = EarlyPrefillEstimator()
    decoding = (rng.random(4000) < 0.95).astype(float)
    whole.observe(7, wall, prefill, finished, waiting, decoding, now=5.0)
    split = EarlyPrefillEstimator()
    cuts = [0, 1, 33, 34, 500, 1777, 4000]
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        split.observe(
            7, wall[lo:hi], prefill[lo:hi], finished[lo:hi], waiting[lo:hi], decoding[lo:hi], 5.0
        )
    a, b = whole.measured(5.0), split.measured(5.0)
    assert a is not None and b is not None
    assert a.spans == b.spans
    assert a.lift == pytest.approx(b.lift, rel=1e-12)
    assert a.overdispersion == pytest.approx(b.overdispersion, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("idle_second", [True, False])
def test_a_request_that_ends_leaves_the_rest_of_its_span_at_what_decodes_meet(
    idle_second: bool,
) -> None:
    # A prompt finishes, its request ends (the next pass decodes nothing, after an
    # idle second's heartbeat or a shorter idle that sends none), then a prompt is
    # prefilled on an empty engine and decodes for 19 passes. That prefill came
    # after the request: a request with more intervals would have met the passes
    # at large for a decode, one prefill (the finished prompt's) in the 20 that
    # decode. Counted by pass, each finished prompt would meet a prefill next.
    cycle_wall = np.r_[0.02, *([0.0] if idle_second else []), np.full(20, 0.02)]
    cycle_pre = np.r_[1.0, *([0.0] if idle_second else []), 1.0, np.zeros(19)]
    cycle_fin = np.r_[1.0, *([0.0] if idle_second else []), 0.0, np.zeros(19)]
    cycle_dec = np.r_[1.0, *([0.0] if idle_second else []), 0.0, np.ones(19)]
    n = int(MIN_FINISHED) + 40
    wall, pre, fin, dec = (np.tile(c, n) for c in (cycle_wall, cycle_pre, cycle_fin, cycle_dec))
    est = EarlyPrefillEstimator()
    est.observe(0, wall, pre, fin, np.zeros(wall.shape), dec, 1.0)
    early = est.measured(1.0)
    assert early is not None
    # The share at large: 2 prefill passes in 21; a decode meets 1 in 20 (about:
    # the shares are taken over 512 passes, not whole cycles).
    assert early.lift == pytest.approx([(1 / 20) / (2 / 21)] * len(SPANS), rel=0.03)
    assert early.overdispersion == pytest.approx([0.0] * len(SPANS), abs=0.02)
    want = _reference(wall, pre, fin, np.zeros(wall.shape), dec)
    for m, lift in zip(early.spans, early.lift, strict=True):
        assert lift == pytest.approx(want[m][0])


def test_prompts_outside_the_window_are_forgotten() -> None:
    wall, prefill, finished = _clumped(200, 18)
    est = EarlyPrefillEstimator(window_s=10.0)
    est.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=1.0)
    assert est.measured(5.0) is not None
    assert est.measured(12.0) is None


def beta_binomial_pmf(m: int, share: float, rho: float) -> np.ndarray:
    """P(K = k), k = 0..m, one span by gamma functions: the reference the array
    pass (beta_binomial_rows) is checked against."""
    q = min(max(share, 0.0), 1.0)
    k = np.arange(m + 1, dtype=np.float64)
    log_choose = np.array(
        [math.lgamma(m + 1) - math.lgamma(i + 1) - math.lgamma(m - i + 1) for i in range(m + 1)]
    )
    if q <= 0.0 or q >= 1.0:
        out = np.zeros(m + 1)
        out[m if q >= 1.0 else 0] = 1.0
        return out
    if rho <= 1e-9 or m == 1:
        logp = log_choose + k * math.log(q) + (m - k) * math.log1p(-q)
        return np.exp(logp)
    total = 1.0 / min(rho, 1.0 - 1e-9) - 1.0  # alpha + beta
    a, b = q * total, (1.0 - q) * total
    lbeta_ab = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    lbeta = np.array(
        [math.lgamma(i + a) + math.lgamma(m - i + b) - math.lgamma(m + a + b) for i in range(m + 1)]
    )
    p = np.exp(log_choose + lbeta - lbeta_ab)
    return p / p.sum()


def test_beta_binomial_has_the_moments_it_is_matched_to() -> None:
    for m, q, rho in ((5, 0.1, 0.3), (12, 0.4, 0.05), (32, 0.02, 0.6)):
        p = beta_binomial_pmf(m, q, rho)
        k = np.arange(m + 1)
        assert p.sum() == pytest.approx(1.0)
        mean = p @ k
        assert mean == pytest.approx(m * q)
        var = p @ k**2 - mean**2
        assert var == pytest.approx(m * q * (1 - q) * (1 + (m - 1) * rho), rel=1e-6)
    binomial = beta_binomial_pmf(4, 0.25, 0.0)
    assert binomial == pytest.approx(
        [0.75**4, 4 * 0.25 * 0.75**3, 6 * 0.25**2 * 0.75**2, 4 * 0.25**3 * 0.75, 0.25**4]
    )


def test_all_spans_at_once_are_each_spans_beta_binomial() -> None:
    rng = np.random.default_rng(5)
    shares = rng.uniform(0.001, 0.6, 32)
    rhos = rng.uniform(0.0, 0.9, 32)
    rhos[[0, 3, 10]] = 0.0
    shares[7] = 1.0  # every pass: all the mass at m
    rows = beta_binomial_rows(shares, rhos)
    for m in range(1, 33):
        assert rows[m - 1, : m + 1] == pytest.approx(
            beta_binomial_pmf(m, shares[m - 1], rhos[m - 1]), abs=1e-9
        )
        assert rows[m - 1, m + 1 :].sum() == 0.0


def test_one_span_at_many_shares_is_each_shares_beta_binomial() -> None:
    """What the measured ITL tail draws per stream (request_itl_tail): one span,
    each row its own share."""
    rng = np.random.default_rng(6)
    shares = rng.uniform(0.0, 0.5, 20)
    shares[0] = 0.0  # no prefill: all the mass at 0
    for m, rho in ((1, 0.0), (6, 0.0), (6, 0.4)):
        rows = beta_binomials(np.full(shares.size, m), shares, np.full(shares.size, rho))
        assert rows.shape == (shares.size, m + 1)
        for row, share in zip(rows, shares, strict=True):
            assert row == pytest.approx(beta_binomial_pmf(m, share, rho), abs=1e-9)


def test_the_chain_meets_the_measured_lift_after_the_first_token() -> None:
    chain = PrefillPassChain.of(0.05, 0.2)
    early = EarlyPrefills((1, 4, 16), (4.0, 2.0, 1.5), (0.3, 0.3, 0.1))
    dists = chain.after_first_token(16, early)
    assert dists[0] @ np.arange(2) == pytest.approx(0.05 * 4.0)
    assert dists[3] @ np.arange(5) == pytest.approx(4 * 0.05 * 2.0)
    # Between spans: linear in log m (m = 8: halfway from 4 to 16).
    assert dists[7] @ np.arange(9) == pytest.approx(8 * 0.05 * 1.75)
    # Unmeasured: the chain from its stationary state, as before.
    plain = chain.after_first_token(16, None)
    for got, want in zip(plain, chain.count_distributions(16), strict=True):
        assert got == pytest.approx(want)


def _pass(counter: int, prefill_reqs: int, tokens: int = 100) -> ForwardPassMetrics:
    sched = ScheduledRequestMetrics(
        num_prefill_requests=prefill_reqs,
        sum_prefill_tokens=tokens * prefill_reqs,
        num_decode_requests=8,
        sum_decode_kv_tokens=4000,
    )
    return ForwardPassMetrics(
        worker_id="w", counter_id=counter, wall_time=0.02, scheduled_requests=sched
    )


def test_the_load_estimate_carries_what_its_streams_measured() -> None:
    est = LoadEstimator(window_s=30.0)
    # One pass that fills the token budget (so the prompts of 100 tokens are not
    # taken for chunks of longer ones), then a decode pass.
    est.observe(_pass(1, 1, tokens=2048), 0.01)
    est.observe(_pass(2, 0), 0.02)
    counter = 2
    t = 0.02
    for _ in range(300):  # pairs of prompts 20 passes apart, as above
        for reqs in (1, 1, *([0] * 18)):
            counter += 1
            t += 0.02
            est.observe(_pass(counter, reqs), t)
    est.observe(heartbeat("w", 0, counter + 1), t)  # liveness only: nothing counted
    load = est.estimate(t)
    assert load.early_prefills is not None
    lift_1, _ = load.early_prefills.at(1)
    assert lift_1 == pytest.approx(5.0, rel=0.02)
    assert load.to_dict()["early_prefills"] == list(load.early_prefills.lift)


def _head_of_backlogs(cycles: int, waiting: float) -> tuple[np.ndarray, ...]:
    """(wall, prefill, finished, waiting, decoding) of a replica that idles along on decode,
    then takes a burst it cannot keep up with: 40 slow prefill passes with
    ``waiting`` prompts queued. The burst's first prompts finish with room behind
    them (their last passes were calm), and what follows them is the backlog."""
    calm, burst = 600, 40
    wall = np.tile(np.r_[np.full(calm, 0.01), np.full(burst, 0.05)], cycles)
    prefill = np.tile(np.r_[np.zeros(calm - 1), np.ones(burst + 1)], cycles)
    queued = np.tile(np.r_[np.zeros(calm), np.full(burst, waiting)], cycles)
    return wall, prefill, prefill.copy(), queued, _decoding(wall)


def test_a_stream_with_a_backlog_over_the_window_is_left_out_the_others_count() -> None:
    # One replica took bursts it could not keep up with (a prompt or more waiting
    # over its window's time), another had room all along: the fleet together
    # waited under a prompt, but the backlogged replica's first prompts say what
    # its backlog did, not what a request meets on a replica with room.
    wall, prefill, finished = _clumped(400, 18)
    alone = EarlyPrefillEstimator()
    alone.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=1.0)
    fleet = EarlyPrefillEstimator()
    fleet.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=1.0)
    fleet.observe(1, *_head_of_backlogs(5, waiting=5.0), now=1.0)
    want, got = alone.measured(1.0), fleet.measured(1.0)
    assert want is not None and got is not None
    assert got.lift == pytest.approx(want.lift)
    assert got.overdispersion == pytest.approx(want.overdispersion)
    # The same replica with a lighter queue (under a prompt over its time) counts.
    light = EarlyPrefillEstimator()
    light.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=1.0)
    light.observe(1, *_head_of_backlogs(5, waiting=1.0), now=1.0)
    mixed = light.measured(1.0)
    assert mixed is not None
    assert mixed.lift[0] != pytest.approx(want.lift[0], rel=0.01)


def test_a_gone_stream_s_prompts_stay_for_the_window_and_its_slot_starts_afresh() -> None:
    wall, prefill, finished = _clumped(400, 18)
    est = EarlyPrefillEstimator(window_s=10.0)
    est.observe(0, wall, prefill, finished, np.zeros(wall.shape), _decoding(wall), now=1.0)
    before = est.measured(1.0)
    assert before is not None
    est.forget(0)
    # The slot's next stream is judged on its own window: its backlog leaves it
    # out, and the gone stream's prompts still count until they age out.
    est.observe(0, *_head_of_backlogs(5, waiting=5.0), now=2.0)
    after = est.measured(2.0)
    assert after is not None
    assert after.lift == pytest.approx(before.lift)
    assert est.measured(11.5) is None  # the gone stream's buckets left the window
    # Many streams come and go: rows are reused once their sums left the window.
    for t in range(20, 80):
        est.observe(
            t, wall[:50], prefill[:50], finished[:50], np.zeros(50), np.ones(50), now=float(t)
        )
        est.forget(t)
    assert est._ring.shape[0] <= 16
