"""IngestCoverage: the share of a window's passes that reached the load estimate."""

from __future__ import annotations

import pytest

from stepscale_operator.ingest_coverage import IngestCoverage


def test_nothing_sent_or_lost_is_full_coverage() -> None:
    coverage = IngestCoverage(window_s=30.0)
    assert coverage.observe(0.0, 0, 0) == 1.0
    assert coverage.observe(10.0, 0, 0) == 1.0


def test_losses_count_over_the_window_then_age_out() -> None:
    coverage = IngestCoverage(window_s=30.0)
    coverage.observe(0.0, 0, 0)
    assert coverage.observe(10.0, 900, 100) == pytest.approx(0.9)
    # No more losses: the window still holds the earlier ones ...
    assert coverage.observe(30.0, 2900, 100) == pytest.approx(2900 / 3000)
    # ... until its start passes the round that saw them.
    assert coverage.observe(40.0, 3900, 100) == pytest.approx(1.0)


def test_the_baseline_is_the_last_round_at_or_before_the_window_start() -> None:
    coverage = IngestCoverage(window_s=30.0)
    for t in range(0, 100, 10):
        coverage.observe(float(t), 100 * t, t)  # 1 of 101 lost throughout
    assert coverage.observe(100.0, 10_000, 100) == pytest.approx(3000 / 3030)
