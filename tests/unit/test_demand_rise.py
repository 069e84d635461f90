"""A rise in demand against the load windows' sampling noise (demand_rise)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from stepscale_operator.demand_rise import demand_ratio, demand_rise_z, prompt_second_moment
from stepscale_operator.load_types import (
    LoadEstimate,
    prompt_bin_tokens_of,
    prompt_histogram_of,
)


def window(
    requests_per_s: float,
    mix: tuple[tuple[float, float], ...] = ((1000.0, 1.0),),
    *,
    tokens_scale: float = 1.0,
    window_s: float = 30.0,
) -> LoadEstimate:
    """A 30 s estimate at ``requests_per_s`` whose prompts are ``mix`` ((length, share)
    pairs, as the histogram holds them); ``tokens_scale`` scales its token rate alone
    (a window that drew more of the long prompts)."""
    lengths = np.concatenate([np.full(round(100 * share), length) for length, share in mix])
    mean = sum(length * share for length, share in mix)
    return LoadEstimate(
        window_s=window_s,
        streams_total=4,
        streams_missing=0,
        prefill_tokens_per_s=requests_per_s * mean * tokens_scale,
        prefill_cached_tokens_per_s=0.0,
        prefill_requests_per_s=requests_per_s,
        decode_tokens_per_s=requests_per_s * 200.0,
        mean_prompt_tokens=mean * tokens_scale,
        mean_decode_context_tokens=mean,
        prefix_cache_hit_fraction=0.0,
        queued_prefill_requests=0.0,
        queued_prefill_tokens=0.0,
        queued_decode_requests=0.0,
        prompt_histogram=prompt_histogram_of(lengths),
        prompt_bin_tokens=prompt_bin_tokens_of(lengths),
    )


# Long-context traffic: most prompts short, a fifth of them 126k tokens long.
LONG_TAIL = ((2000.0, 0.8), (126000.0, 0.2))


def test_the_second_moment_is_each_bins_mean_length_squared() -> None:
    load = window(1.0, ((1000.0, 0.5), (4000.0, 0.5)))
    assert prompt_second_moment(load) == pytest.approx(0.5 * 1000.0**2 + 0.5 * 4000.0**2)
    assert prompt_second_moment(replace(load, prompt_histogram=())) is None


def test_a_step_in_arrivals_is_many_standard_errors() -> None:
    # Silence, then a burst: 0.4 -> 16 prompts a second.
    assert demand_rise_z(window(0.4), window(16.0)) > 10.0
    # The bursts scenario's 40 -> 100 req/s.
    assert demand_rise_z(window(40.0), window(100.0)) > 10.0


def test_a_window_that_drew_more_long_prompts_is_noise() -> None:
    # One prompt a second, the request rate unchanged: a window with two and a half
    # times the prompt tokens is within three standard errors of a heavy tail.
    z = demand_rise_z(window(1.0, LONG_TAIL), window(1.0, LONG_TAIL, tokens_scale=2.5))
    assert 0.0 < z < 3.0
    # The same rise in tokens from as many more prompts is real.
    assert demand_rise_z(window(1.0, LONG_TAIL), window(2.5, LONG_TAIL)) > 3.0


def test_a_heavier_mix_of_many_narrow_prompts_is_real() -> None:
    # Thousands of prompts of one length: a mean that doubles is no sampling noise.
    z = demand_rise_z(window(50.0), window(50.0, tokens_scale=2.0))
    assert z > 10.0


def test_a_fall_is_no_rise_and_an_unmeasured_window_cannot_be_judged() -> None:
    assert demand_rise_z(window(16.0), window(0.4)) < 0.0
    assert demand_rise_z(window(1.0, window_s=0.0), window(2.0, window_s=0.0)) == math.inf
    assert demand_rise_z(window(0.0), window(0.0)) == math.inf


def test_the_demand_ratio_is_the_larger_of_arrivals_and_prompt_tokens() -> None:
    assert demand_ratio(window(40.0), window(100.0)) == pytest.approx(2.5)
    # The same arrivals drawing longer prompts: the tokens rose.
    assert demand_ratio(window(40.0), window(40.0, tokens_scale=2.0)) == pytest.approx(2.0)
    assert demand_ratio(window(40.0), window(30.0)) == pytest.approx(0.75)
    assert demand_ratio(window(0.0), window(5.0)) == math.inf  # from silence
    assert demand_ratio(window(0.0), window(0.0)) == 1.0
