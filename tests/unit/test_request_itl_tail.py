"""The realized ITL tail over requests: each output-length class over its own span
of (stream, second) cells, so long outputs average their ITL over the seconds they
decode in and short ones keep the cell."""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics
from stepscale_operator.load_estimate import LoadEstimator
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS
from stepscale_operator.request_itl_tail import (
    ONE_CELL,
    OutputSpan,
    output_spans,
    request_itl_tail,
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
    shares[0] = 0.5  # one-token outputs: no interval, one cell
    # The other half carries the mean output: 100 intervals on average, so 200 each,
    # 5 s at 25 ms.
    spans = output_spans(shares, 100.0, 0.025, 1.0, 30)
    assert spans == (OutputSpan(1, 0.5), OutputSpan(5, 0.5))
    # Every share 0: all longer than the last bin, at least one interval more.
    longest = OUTPUT_INTERVAL_BINS[-1][1] + 1
    spans = output_spans([0.0] * N_BINS, None, 0.025, 1.0, 30)
    assert spans == (OutputSpan(round(longest * 0.025), 1.0),)
    # At most the window.
    assert output_spans([0.0] * N_BINS, 5000.0, 0.025, 1.0, 30) == (OutputSpan(30, 1.0),)


def test_without_measured_shares_or_itl_every_request_is_one_cell() -> None:
    assert output_spans((), 200.0, 0.025, 1.0, 30) == ONE_CELL
    assert output_spans([0.0] * N_BINS, 200.0, 0.0, 1.0, 30) == ONE_CELL


def test_the_estimator_reads_long_outputs_below_their_worst_seconds() -> None:
    """End to end through :class:`LoadEstimator`: requests of 200 tokens (beyond the
    last output class) decode for about 2.5 s; one second in ten runs its passes at
    3x. The cells' p99 is a slow second's; a request's worst is that second averaged
    with its neighbours."""
    rng = np.random.default_rng(7)
    est = LoadEstimator(window_s=30.0)
    active: list[int] = []  # passes left per decoding request
    counter = 0
    for second in range(150):
        wall = 0.03 if second % 10 == 0 else 0.01
        batch = []
        for _ in range(round(1.0 / wall)):
            arrivals = int(rng.poisson(0.2))
            sched = ScheduledRequestMetrics(
                num_prefill_requests=arrivals,
                sum_prefill_tokens=200 * arrivals,
                num_decode_requests=len(active),
                sum_decode_kv_tokens=300 * len(active),
            )
            counter += 1
            batch.append(
                ForwardPassMetrics(
                    worker_id="w",
                    dp_rank=0,
                    counter_id=counter,
                    wall_time=wall,
                    scheduled_requests=sched,
                )
            )
            active = [left - 1 for left in active if left > 1] + [199] * arrivals
        est.observe_batch(batch, second + 1.0)  # each second's passes, as they arrive
    load = est.estimate(150.0)
    assert load.output_interval_shares, "the output shares are measured"
    assert sum(load.output_interval_shares) < 0.5  # most beyond the last class
    # The cells' own p99 is a slow second's 30 ms; the requests' is about half way.
    assert load.realized_itl_tail_ms < 25.0, load.realized_itl_tail_ms
    assert load.realized_itl_tail_ms > load.realized_itl_mean_ms
