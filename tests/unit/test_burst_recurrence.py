"""Recurring bursts: the period from evenly spaced onsets, and when it breaks."""

from __future__ import annotations

import pytest

from stepscale_operator.burst_recurrence import BurstRecurrence


def test_three_evenly_spaced_bursts_give_the_next_one() -> None:
    bursts = BurstRecurrence(bursts=3, tolerance=0.1)
    assert bursts.expected(0.0) is None
    for k, onset in enumerate((300.0, 905.0, 1500.0)):
        bursts.burst_began(onset, need=5)
        bursts.burst_need(7 + k)  # the peak comes after the onset
        if k == 1:
            # Two onsets: a tentative period, its jitter the whole tolerance.
            tentative = bursts.expected(1000.0)
            assert tentative is not None and not tentative.confirmed
            assert tentative.next_onset == pytest.approx(1510.0)
            assert tentative.jitter_s == pytest.approx(60.5)
    nxt = bursts.expected(1600.0)
    assert nxt is not None and nxt.confirmed
    assert nxt.period_s == pytest.approx(600.0)
    assert nxt.next_onset == pytest.approx(2100.0)
    assert nxt.jitter_s == pytest.approx(10.0)  # gaps 605 and 595
    assert nxt.peak_need == 9 and nxt.bursts == 3
    # Still expected a little late; overdue past the tolerance (10% of the period).
    assert bursts.expected(2150.0) is not None
    assert bursts.expected(2161.0) is None


def test_uneven_gaps_are_no_pattern_and_the_last_bursts_count() -> None:
    bursts = BurstRecurrence(bursts=3, tolerance=0.1)
    for onset in (0.0, 600.0, 1500.0):
        bursts.burst_began(onset, need=6)
    assert bursts.expected(1600.0) is None  # gaps 600 and 900
    # Two more at 900 s: the oldest gap drops out and the pattern holds.
    for onset in (2400.0, 3300.0):
        bursts.burst_began(onset, need=6)
    nxt = bursts.expected(3400.0)
    assert nxt is not None and nxt.next_onset == pytest.approx(4200.0)


def test_the_same_burst_seen_again_is_not_a_new_onset() -> None:
    bursts = BurstRecurrence(bursts=3, tolerance=0.1)
    for onset in (100.0, 700.0, 700.0, 650.0, 1300.0):
        bursts.burst_began(onset, need=4)
    nxt = bursts.expected(1300.0)
    assert nxt is not None and nxt.period_s == pytest.approx(600.0)


@pytest.mark.parametrize("required", [0, 1])
def test_fewer_than_two_required_bursts_disable_it(required: int) -> None:
    bursts = BurstRecurrence(bursts=required, tolerance=0.1)
    for onset in (0.0, 600.0, 1200.0, 1800.0):
        bursts.burst_began(onset, need=4)
    assert bursts.expected(1900.0) is None


def test_two_required_bursts_confirm_on_one_gap() -> None:
    bursts = BurstRecurrence(bursts=2, tolerance=0.1)
    for onset in (0.0, 600.0):
        bursts.burst_began(onset, need=4)
    nxt = bursts.expected(700.0)
    assert nxt is not None and nxt.confirmed and nxt.next_onset == pytest.approx(1200.0)
