"""The look-ahead's headroom: the floor at the horizon it was set at, grown beyond it
only as far as the measured demand's rises grew with the horizon."""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_operator.lookahead_headroom import lookahead_headroom, rise_quantile

FLOOR, CAP, Q, PAIRS = 1.1, 1.3, 0.9, 6


def headroom(history: list[tuple[float, float]], horizon_s: float, cap: float = CAP) -> float:
    return lookahead_headroom(history, horizon_s, 70.0, FLOOR, cap, Q, PAIRS)


def readings(rates: np.ndarray, period_s: float = 10.0) -> list[tuple[float, float]]:
    return [(i * period_s, float(r)) for i, r in enumerate(rates)]


def test_rise_quantile_pairs_each_reading_with_the_first_one_a_horizon_later() -> None:
    history = readings(np.array([10.0, 11.0, 12.0, 13.0, 14.0]))
    # Pairs 20 s apart: 12/10, 13/11, 14/12.
    assert rise_quantile(history, 20.0, 1.0, 1) == pytest.approx(12.0 / 10.0)
    assert rise_quantile(history, 20.0, 0.0, 1) == pytest.approx(14.0 / 12.0)
    assert rise_quantile(history, 20.0, 0.5, 4) is None  # only three pairs
    # A reading of zero demand has no ratio: it is left out, not counted infinite.
    assert rise_quantile(readings(np.array([0.0, 5.0, 6.0])), 10.0, 1.0, 1) == pytest.approx(1.2)


def test_a_steady_load_keeps_the_floor_at_any_horizon() -> None:
    # Sampling noise alone: 30 s readings swing by the same amount a minute or
    # three minutes apart, so a slower start-up needs no more headroom.
    rng = np.random.default_rng(1)
    history = readings(100.0 * rng.lognormal(0.0, 0.08, size=180))
    assert headroom(history, 190.0) == pytest.approx(FLOOR, abs=0.03)
    assert headroom(history, 70.0) == FLOOR


def test_a_drifting_load_gets_more_headroom_over_a_longer_start_up() -> None:
    # Ramps up and down over ten minutes, with the readings' sampling noise: the
    # rises grow with the horizon (up to half the period).
    rng = np.random.default_rng(2)
    t = np.arange(180) * 10.0
    history = readings(
        100.0 * (1.0 + 0.3 * np.sin(2.0 * np.pi * t / 600.0)) * rng.lognormal(0.0, 0.05, 180)
    )
    at_60s_pods = headroom(history, 70.0)
    at_120s_pods = headroom(history, 130.0)
    at_180s_pods = headroom(history, 190.0, cap=2.0)
    assert at_60s_pods == FLOOR
    assert FLOOR < at_120s_pods < at_180s_pods
    # The growth is the measured one: the quantile rise at 190 s over that at 70 s.
    here, there = rise_quantile(history, 190.0, Q, PAIRS), rise_quantile(history, 70.0, Q, PAIRS)
    assert here is not None and there is not None
    assert at_180s_pods == pytest.approx(FLOOR * here / there)
    assert headroom(history, 190.0) == CAP  # never beyond the cap


def test_without_enough_history_no_rise_is_assumed() -> None:
    rising = readings(np.linspace(100.0, 200.0, 20))  # 190 s of a steep ramp
    assert headroom(rising, 190.0) == FLOOR  # one pair 190 s apart: too few
    assert headroom(rising[:2], 190.0) == FLOOR
    assert headroom([], 190.0) == FLOOR
    # With a ramp long enough to pair, its rise over the longer horizon shows.
    assert headroom(readings(np.linspace(100.0, 200.0, 40)), 190.0) > FLOOR
