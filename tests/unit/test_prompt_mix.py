"""The compound sum of the prompts' extra time, taken at a few counts per m."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from stepscale_operator.itl_quantile import PassTimes, PrefillPassChain, itl_distribution
from stepscale_operator.prompt_mix import COUNT_NODE_SPACING, PromptMix, count_nodes

# 90% one-chunk prompts adding 10 ms, 10% eight-chunk ones adding 30 ms a chunk,
# 0.05 prompts per pass with dispersion 3 (as in test_output_lengths).
_MIX = PromptMix(0.05, 3.0, ((1.0, 0.010, 0.9), (8.0, 0.030, 0.1)))


def _moments(step: float, cdf: npt.NDArray[np.float64]) -> tuple[float, float]:
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    grid = np.arange(cdf.size) * step
    mean = float(pmf @ grid)
    return mean, float(pmf @ grid**2) - mean**2


def test_count_nodes_are_counts_no_farther_apart_than_the_spacing_and_rebuild_every_row() -> None:
    mus = np.array([0.0, 0.004, 0.011, 0.024, 0.041, 0.065, 0.106, 0.17, 0.27, 0.43, 0.6, 6.0])
    nodes, below, weight = count_nodes(mus + 1.0)
    assert set(nodes) <= set(mus + 1.0)
    assert nodes[0] == 1.0 and nodes[-1] == 7.0
    assert 2 < nodes.size < mus.size
    # Consecutive nodes within the spacing in sqrt, unless no count lies between.
    roots = np.sqrt(nodes)
    between = [
        np.sum((mus + 1.0 > a) & (mus + 1.0 < b))
        for a, b in zip(nodes[:-1], nodes[1:], strict=True)
    ]
    assert all(
        g <= COUNT_NODE_SPACING + 1e-12 or n == 0
        for g, n in zip(np.diff(roots), between, strict=True)
    )
    # Each row is its neighbours' mixture at its own mean count.
    rebuilt = (1.0 - weight) * nodes[below] + weight * nodes[below + 1]
    np.testing.assert_allclose(rebuilt, mus + 1.0, rtol=1e-12)


def test_count_nodes_of_one_count_is_that_count() -> None:
    nodes, below, weight = count_nodes(np.array([2.0, 2.0]))
    assert list(nodes) == [2.0] and list(below) == [0, 0] and list(weight) == [0.0, 0.0]


def test_close_rows_share_nodes_and_keep_their_compound_mean_and_variance() -> None:
    # Over 100 passes 5 prompts arrive; 0 to 0.5 more wait behind a prefill: 11
    # rows, a few transforms.
    behind = np.linspace(0.0, 0.5, 11)
    table = _MIX.extra_cdf_table([100], behind)
    assert len(table.node_cdfs) < behind.size
    mean_x = 0.9 * 0.010 + 0.1 * 0.240
    second_x = 0.9 * 0.010**2 + 0.1 * 0.240**2
    for row, extra in zip(table.rows(0), behind, strict=True):
        count = 5.0 + extra
        mean, variance = _moments(float(table.steps[0]), row)
        assert mean == pytest.approx(count * mean_x, rel=1e-3)
        # Negative binomial count of variance 3 x its mean, plus what mixing two
        # counts adds (at most the spacing squared).
        want = count * (second_x - mean_x**2) + 3.0 * count * mean_x**2
        assert variance == pytest.approx(want, rel=0.02)


def test_the_table_evaluates_each_row_between_its_grid_points() -> None:
    behind = np.array([0.0, 0.1, 0.3, 2.0])
    table = _MIX.extra_cdf_table([40, 100, 400], behind)
    rows = np.array([3, 0, 1, 2, 1])
    rng = np.random.default_rng(7)
    at = rng.uniform(-5.0, 2100.0, size=(3, 50, rows.size))
    got = table.cdf_at(at, rows)
    for j in range(3):
        cdfs = table.rows(j)
        for c, r in enumerate(rows):
            want = np.interp(at[j, :, c], np.arange(cdfs.shape[1]), cdfs[r], left=0.0, right=1.0)
            np.testing.assert_allclose(got[j, :, c], want, atol=1e-12)


def test_each_m_is_its_own_distribution_in_one_table() -> None:
    # One table over several m gives what each m alone gives.
    behind = np.array([0.0, 1.5])
    table = _MIX.extra_cdf_table([40, 100, 400], behind)
    for j, m in enumerate((40, 100, 400)):
        alone = _MIX.extra_cdf_table([m], behind)
        assert table.steps[j] == alone.steps[0]
        np.testing.assert_allclose(table.rows(j), alone.rows(0), atol=1e-12)


def test_no_prompts_put_all_the_extra_time_at_zero() -> None:
    table = PromptMix(0.0, 1.0, ((1.0, 0.01, 1.0),)).extra_cdf_table([50, 500], np.zeros(2))
    assert np.all(table.rows(0) == 1.0) and np.all(table.rows(1) == 1.0)


def test_outputs_all_within_the_exact_intervals_need_no_compound_sum() -> None:
    # Every output of at most 30 intervals: the chain alone sets the ITL, with or
    # without the prompt mix (no span to take the compound sum over).
    passes = PassTimes(decode_s=0.010, prefill_s=0.050, mean_s=0.020)
    chain = PrefillPassChain.of(0.1, 0.2)
    short = ((1, 4, 0.5), (5, 30, 0.5))
    with_mix = itl_distribution(passes, chain, short, 0.2, _MIX, 10.0)
    without = itl_distribution(passes, chain, short, 0.2, None, 10.0)
    assert with_mix.quantile(0.01) == pytest.approx(without.quantile(0.01))
    # At most a prefill pass (the search stops within a grid cell of it).
    assert passes.decode_s < with_mix.quantile(0.01) <= passes.prefill_s * (1.0 + 1e-6)
    table = _MIX.extra_cdf_table([], np.zeros(3))
    assert table.steps.size == 0 and table.node_cdfs.shape == (0, 2048)
