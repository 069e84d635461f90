"""The window's mean prompt, shrunk towards the usual one by its own sampling noise."""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_operator.demand import settled_mean
from stepscale_operator.load_types import prompt_histogram_of

RNG = np.random.default_rng(0)
HEAVY = prompt_histogram_of(np.minimum(RNG.lognormal(np.log(12_000), 1.2, 20_000), 126_000))
LIGHT = prompt_histogram_of(RNG.lognormal(np.log(1_000), 0.4, 20_000))


def test_a_busy_window_keeps_its_own_mean() -> None:
    # Thousands of prompts per window: a 10% change of mix is real and kept.
    assert settled_mean(1_100.0, 1_000.0, LIGHT, prompts=3_000) == pytest.approx(1_100.0, rel=0.01)


def standard_error(histogram: tuple[float, ...], prompts: float) -> float:
    from stepscale_operator.load_types import prompt_bin_centers

    c, h = np.array(prompt_bin_centers()), np.array(histogram)
    mean = (c * h).sum() / h.sum()
    return float(np.sqrt((h * (c - mean) ** 2).sum() / h.sum() / prompts))


def test_a_swing_within_the_noise_of_a_few_heavy_tailed_prompts_is_shrunk_away() -> None:
    # 36 prompts of lognormal sigma 1.2: one standard error is about a fifth of the mean.
    usual, se = 20_000.0, standard_error(HEAVY, 36)
    assert 0.1 * usual < se < 0.5 * usual
    for gap in (-se, -0.5 * se, 0.5 * se, se):
        assert settled_mean(usual + gap, usual, HEAVY, prompts=36) == pytest.approx(usual)
    # Twice the noise: three quarters of the gap are kept.
    assert settled_mean(usual + 2 * se, usual, HEAVY, prompts=36) == pytest.approx(usual + 1.5 * se)


def test_a_change_far_beyond_the_noise_is_kept_almost_whole() -> None:
    # The same traffic switching to four times longer prompts is a change of mix.
    settled = settled_mean(80_000.0, 20_000.0, HEAVY, prompts=36)
    assert settled > 0.97 * 80_000.0


def test_no_data_changes_nothing() -> None:
    assert settled_mean(500.0, 900.0, (), prompts=10) == 500.0
    assert settled_mean(500.0, 900.0, LIGHT, prompts=0.0) == 500.0
