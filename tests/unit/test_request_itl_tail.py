"""The realized ITL tail over requests: each output-length class over its own span
of (stream, second) cells, so long outputs average their ITL over the seconds they
decode in, and short ones draw their few passes from the cell's."""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics
from stepscale_operator.early_prefills import EarlyPrefills
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS
from stepscale_operator.request_itl_tail import (
    ONE_CELL,
    CellPasses,
    OutputSpan,
    output_spans,
    request_itl_tail,
    weighted_quantile,
)

N_BINS = len(OUTPUT_INTERVAL_BINS)


def _every_tenth_second_slow(streams: int = 1, seconds: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """(decode wall, decode tokens) grids: 100 tokens a second at 10 ms, every tenth
    second at 30 ms."""
    tokens = np.full((streams, seconds), 100.0)
    itl = np.where(np.arange(seconds) % 10 == 0, 0.030, 0.010)
    return tokens * itl, tokens


def test_one_cell_is_the_cells_own_quantile() -> None:
    wall, tokens = _every_tenth_second_slow()
    assert request_itl_tail(wall, tokens, ONE_CELL, 0.99) == pytest.approx(30.0)
    assert request_itl_tail(wall, tokens, ONE_CELL, 0.5) == pytest.approx(10.0)


def test_long_outputs_average_their_itl_over_the_seconds_they_decode_in() -> None:
    wall, tokens = _every_tenth_second_slow()
    # No run of three seconds holds two slow ones: the worst request sees (30+10+10)/3.
    tail = request_itl_tail(wall, tokens, (OutputSpan(3, 1.0),), 0.99)
    assert tail == pytest.approx(50.0 / 3.0)
    # A span longer than the window is the window.
    assert request_itl_tail(wall, tokens, (OutputSpan(99, 1.0),), 0.99) == pytest.approx(
        (3 * 30 + 27 * 10) / 30
    )


def test_a_class_sets_the_tail_once_its_share_of_slow_requests_reaches_the_quantile() -> None:
    wall, tokens = _every_tenth_second_slow()
    # A tenth of the short outputs met a slow second: 0.2% of requests at 2% short.
    few_short = (OutputSpan(1, 0.02), OutputSpan(3, 0.98))
    assert request_itl_tail(wall, tokens, few_short, 0.99) == pytest.approx(50.0 / 3.0)
    # 2% of requests at 20% short: they set the p99.
    many_short = (OutputSpan(1, 0.2), OutputSpan(3, 0.8))
    assert request_itl_tail(wall, tokens, many_short, 0.99) == pytest.approx(30.0)


def test_nothing_decoded_gives_no_tail() -> None:
    empty = np.zeros((2, 30))
    assert request_itl_tail(empty, empty, ONE_CELL, 0.99) == 0.0
    no_cells = np.zeros((2, 0))
    assert request_itl_tail(no_cells, no_cells, (OutputSpan(3, 1.0),), 0.99) == 0.0


def test_spans_come_from_the_output_shares_and_the_mean_itl() -> None:
    shares = [0.0] * N_BINS
    shares[0] = 0.5  # one-token outputs: no interval, so no ITL
    shares[3] = 0.2  # three intervals: within a cell, over their passes
    # The other 30% carry the mean output: 100 intervals on average, so 330 each,
    # 8.3 s at 25 ms.
    spans = output_spans(shares, 100.0, 0.025, 1.0, 30)
    assert [(s.cells, s.passes) for s in spans] == [(1, 3), (8, 0)]
    assert [s.share for s in spans] == pytest.approx([0.2, 0.3])
    # Every share 0: all longer than the last bin, at least one interval more.
    longest = OUTPUT_INTERVAL_BINS[-1][1] + 1
    spans = output_spans([0.0] * N_BINS, None, 0.025, 1.0, 30)
    assert spans == (OutputSpan(round(longest * 0.025), 1.0),)
    # At most the window.
    assert output_spans([0.0] * N_BINS, 5000.0, 0.025, 1.0, 30) == (OutputSpan(30, 1.0),)


def _cells_with_prefill_passes(share: float) -> tuple[np.ndarray, np.ndarray, CellPasses]:
    """One stream, 30 cells of 100 passes, 100 decode tokens and 10 prompts finished;
    ``share`` of every cell's passes carry prefill and take 50 ms, the others 10 ms."""
    tokens = np.full((1, 30), 100.0)
    itl = share * 0.050 + (1.0 - share) * 0.010
    cells = CellPasses(
        np.full((1, 30), 100.0),
        np.full((1, 30), 100.0 * share),
        np.full((1, 30), 0.010),
        np.full((1, 30), 0.050),
        np.full((1, 30), 10.0),
    )
    return tokens * itl, tokens, cells


def test_short_outputs_draw_their_passes_from_the_cell() -> None:
    wall, tokens, cells = _cells_with_prefill_passes(0.1)
    # One interval: a tenth of them is a prefill pass, whole. The cell's mean, 14 ms,
    # is what taking the cell gave.
    one = (OutputSpan(1, 1.0, passes=1),)
    assert request_itl_tail(wall, tokens, one, 0.99) == pytest.approx(14.0)
    assert request_itl_tail(wall, tokens, one, 0.99, cells) == pytest.approx(50.0)
    assert request_itl_tail(wall, tokens, one, 0.5, cells) == pytest.approx(10.0)
    # Four intervals, binomial: P(K >= 2) = 5.2% and P(K >= 3) = 0.37%, so the p99
    # meets two prefill passes in four, (2 x 10 + 2 x 50) / 4 ms.
    four = (OutputSpan(1, 1.0, passes=4),)
    assert request_itl_tail(wall, tokens, four, 0.99, cells) == pytest.approx(30.0)
    # A measured lift of 2 over a request's first passes: P(K >= 3) = 2.7% at a share
    # of 0.2, so three in four.
    lifted = EarlyPrefills((1, 2, 4), (2.0, 2.0, 2.0), (0.0, 0.0, 0.0))
    assert request_itl_tail(wall, tokens, four, 0.99, cells, lifted) == pytest.approx(40.0)


def test_overdispersed_prefill_passes_widen_the_short_outputs_tail() -> None:
    wall, tokens, cells = _cells_with_prefill_passes(0.05)
    four = (OutputSpan(1, 1.0, passes=4),)
    binomial = EarlyPrefills((1, 4), (1.0, 1.0), (0.0, 0.0))
    clumped = EarlyPrefills((1, 4), (1.0, 1.0), (0.5, 0.5))
    # Binomial at 5%: P(K >= 2) = 1.4%, P(K >= 3) = 0.05%.
    assert request_itl_tail(wall, tokens, four, 0.99, cells, binomial) == pytest.approx(30.0)
    # The same mean, clumped: the prefill passes come together.
    assert request_itl_tail(wall, tokens, four, 0.99, cells, clumped) == pytest.approx(50.0)


def test_a_clump_of_prompts_counts_only_as_far_as_the_measured_lift() -> None:
    """Six prompts prefilled together in one second of thirty, over 60 of its 100
    passes: the cell's share counts the passes they shared, which none of them
    decodes on. What a request meets after its first token is the stream's share
    times the lift measured there."""
    _, tokens, uniform = _cells_with_prefill_passes(0.0)
    prefill = np.zeros((1, 30))
    prefill[0, 0] = 60.0
    finished = np.zeros((1, 30))
    finished[0, 0] = 6.0
    cells = CellPasses(
        uniform.passes, prefill, uniform.decode_pass_s, uniform.prefill_pass_s, finished
    )
    wall = tokens * 0.010
    one = (OutputSpan(1, 1.0, passes=1),)
    # The stream's share is 2%: the median request meets none, the p99 one.
    assert request_itl_tail(wall, tokens, one, 0.5, cells) == pytest.approx(10.0)
    assert request_itl_tail(wall, tokens, one, 0.99, cells) == pytest.approx(50.0)
    # Measured: the pass after a finish carried prefill 30 times as often.
    clumped = EarlyPrefills((1, 2), (30.0, 30.0), (0.0, 0.0))
    assert request_itl_tail(wall, tokens, one, 0.5, cells, clumped) == pytest.approx(50.0)


def test_without_measured_shares_or_itl_every_request_is_one_cell() -> None:
    assert output_spans((), 200.0, 0.025, 1.0, 30) == ONE_CELL
    assert output_spans([0.0] * N_BINS, 200.0, 0.0, 1.0, 30) == ONE_CELL


def _pass(
    counter: int, wall: float, arrivals: int, prompt: int, decoding: int, context: int
) -> ForwardPassMetrics:
    """One pass of stream "w": ``arrivals`` prompts of ``prompt`` tokens prefilled
    whole beside ``decoding`` decodes of ``context`` tokens each."""
    sched = ScheduledRequestMetrics(
        num_prefill_requests=arrivals,
        sum_prefill_tokens=prompt * arrivals,
        num_decode_requests=decoding,
        sum_decode_kv_tokens=context * decoding,
    )
    return ForwardPassMetrics(
        worker_id="w", dp_rank=0, counter_id=counter, wall_time=wall, scheduled_requests=sched
    )


def test_the_estimator_reads_long_outputs_below_their_worst_seconds() -> None:
    """End to end through :class:`LoadEstimator`: requests of 200 tokens (beyond the
    last output class) decode for about 2.5 s; one second in twenty runs its passes at
    3x. The cells' p99 is a slow second's; a request's worst is that second averaged
    with its neighbours. (The output shares put about a quarter of these requests
    in the short classes, which take the second they start in: at one slow second
    in ten those sat at the 1% quantile by themselves.)"""
    rng = np.random.default_rng(7)
    est = LoadEstimator(window_s=30.0)
    active: list[int] = []  # passes left per decoding request
    counter = 0
    for second in range(150):
        wall = 0.03 if second % 20 == 0 else 0.01
        batch = []
        for _ in range(round(1.0 / wall)):
            arrivals = int(rng.poisson(0.2))
            counter += 1
            batch.append(_pass(counter, wall, arrivals, 200, len(active), 300))
            active = [left - 1 for left in active if left > 1] + [199] * arrivals
        est.observe_batch(batch, second + 1.0)  # each second's passes, as they arrive
    load = est.estimate(150.0)
    assert load.output_interval_shares, "the output shares are measured"
    assert sum(load.output_interval_shares) < 0.5  # most beyond the last class
    # The cells' own p99 is a slow second's 30 ms; the requests' is about half way.
    assert load.realized_itl_tail_ms < 25.0, load.realized_itl_tail_ms
    assert load.realized_itl_tail_ms > load.realized_itl_mean_ms


def test_the_estimator_reads_short_outputs_at_the_prefill_passes_they_meet() -> None:
    """End to end through :class:`LoadEstimator`: every request decodes three
    intervals; a pass carrying a prompt's prefill takes 40 ms, the others 10 ms.
    The requests' own p99 (computed here pass by pass) meets two prefill passes in
    three, where a second's mean is 13 ms."""
    rng = np.random.default_rng(3)
    est = LoadEstimator(window_s=30.0)
    active: list[int] = []
    counter = 0
    walls: list[float] = []
    joined: list[int] = []  # per request, the pass after which it decodes
    for second in range(120):
        batch: list[ForwardPassMetrics] = []
        while sum(m.wall_time for m in batch) < 1.0:
            arrivals = int(rng.poisson(0.1))
            wall = 0.040 if arrivals else 0.010
            counter += 1
            batch.append(_pass(counter, wall, arrivals, 100, len(active), 200))
            walls.append(wall)
            joined += [len(walls)] * arrivals
            active = [left - 1 for left in active if left > 1] + [3] * arrivals
        est.observe_batch(batch, second + 1.0)
    load = est.estimate(120.0)
    assert load.output_interval_shares, "the output shares are measured"
    passes = np.array(walls)
    recent = [j for j in joined if j + 3 <= passes.size and j > passes.size - 2000]
    truth = np.percentile([passes[j : j + 3].mean() * 1e3 for j in recent], 99)
    assert truth == pytest.approx(30.0)
    assert load.realized_itl_mean_ms < 15.0
    assert load.realized_itl_tail_ms == pytest.approx(truth, rel=0.1)


def test_the_quantile_of_many_values_is_the_one_a_full_sort_gives() -> None:
    """Past a few thousand values the quantile bins them first; it must pick the
    value a sort of them all picks, ties and zero weights included."""
    rng = np.random.default_rng(11)
    for size in (20_000, 200_000):
        values = np.round(rng.lognormal(3.0, 0.6, size), 1)  # many ties
        weights = rng.exponential(1.0, size) * (rng.random(size) > 0.2)
        order = np.argsort(values, kind="stable")
        cumulative = np.cumsum(weights[order]) / weights.sum()
        for q in (0.5, 0.9, 0.99, 0.999):
            expected = values[order][np.searchsorted(cumulative, q)]
            assert weighted_quantile(values, weights, q) == expected
