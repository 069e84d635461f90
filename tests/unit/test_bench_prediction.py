"""bench_prediction.py's window-by-window comparison of the prompt tokens a decode sees."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from tests.conftest import benchmark_module


def _bench() -> ModuleType:
    return benchmark_module("bench_prediction")


def test_a_prediction_is_judged_on_the_window_it_measured() -> None:
    # Ten quiet minutes (100 decode tokens a second, 1 prompt token beside each), then
    # ten busy ones (10,000 a second, 40 beside each). A model that predicts each
    # window exactly is 1.00x window by window, where the whole run's ratio is 39.6
    # (weighted to the busy minutes) whatever the model predicted for the quiet ones.
    by_second: dict[int, list[int]] = {}
    for t in range(1200):
        decodes, each = (100, 1) if t < 600 else (10_000, 40)
        by_second[t] = [decodes, decodes * each]
    checks = [(float(t), 1.0 if t <= 600 else 40.0) for t in range(35, 1200, 5)]
    _, _, ratio = _bench().beside_decodes_by_window(by_second, checks)
    assert ratio == pytest.approx(1.0, abs=0.01)
    whole_run = sum(b for _, b in by_second.values()) / sum(d for d, _ in by_second.values())
    assert whole_run == pytest.approx(39.6, abs=0.1)
    # A model that predicts half of what each window carried reads 0.5x.
    halved = [(t, p / 2.0) for t, p in checks]
    assert _bench().beside_decodes_by_window(by_second, halved)[2] == pytest.approx(0.5, abs=0.01)


def test_windows_without_prompts_beside_decodes_are_not_judged() -> None:
    by_second = {t: [100, 0] for t in range(100)}
    assert all(math.isnan(v) for v in _bench().beside_decodes_by_window(by_second, [(60.0, 3.0)]))
    assert all(math.isnan(v) for v in _bench().beside_decodes_by_window({}, [(60.0, 3.0)]))


def test_the_slowest_requests_are_shown_with_the_prefills_they_met_while_decoding() -> None:
    # 200 fast requests, each alone on its replica; on replica 0 a 3-token request
    # (A) whose two clump mates, arriving 50 and 60 ms after it, are prefilled while
    # it decodes, and a prompt that came 5 s earlier is prefilled then too; on
    # replica 1 a long output (D) slow with nothing beside it.
    fast = 200
    arrival = [10.0 * i for i in range(fast)] + [0.0, 0.05, 0.06, -5.0, 3.0]
    first = [a + 0.02 for a in arrival[:fast]] + [0.10, 0.12, 0.15, 0.18, 3.05]
    finish = [f + 0.01 * 9 for f in first[:fast]] + [0.20, 2.0, 2.0, 2.0, 3.05 + 0.06 * 99]
    replica = list(range(2, fast + 2)) + [0, 0, 0, 0, 1]
    output = [10] * fast + [3, 200, 200, 200, 100]
    arr, ft, fin = (np.array(x, dtype=np.float64) for x in (arrival, first, finish))
    out = np.array(output, dtype=np.int64)
    itl = np.where(out > 1, (fin - ft) * 1e3 / np.maximum(out - 1, 1), 0.0)
    anatomy = _anatomy()(arr, ft, fin, np.array(replica, dtype=np.int64), out, itl)
    assert anatomy["slow_requests"] == 2  # A (50 ms) and D (60 ms), above the p99
    assert anatomy["slow_short_share"] == pytest.approx(0.5)
    assert anatomy["slow_prefills"] == pytest.approx(1.5)  # A met 3, D none
    assert anatomy["slow_clump_prefills"] == pytest.approx(1.0)  # A's two mates only
    assert anatomy["slow_ttft_ms"] == pytest.approx(75.0)  # 100 and 50 ms
    # The sample of short outputs (the 200 fast ones and A) met A's three at most.
    assert anatomy["short_prefills"] == pytest.approx(3 / 201)
    assert anatomy["short_clump_prefills"] == pytest.approx(2 / 201)


def test_a_run_without_an_itl_has_no_slow_requests_to_show() -> None:
    one_token = np.ones(3, dtype=np.int64)
    times = np.array([0.0, 1.0, 2.0])
    none = _anatomy()(times, times + 0.1, times + 0.1, one_token * 0, one_token, times * 0.0)
    assert none == {}


def _anatomy() -> Callable[..., dict[str, float]]:
    anatomy: Callable[..., dict[str, float]] = benchmark_module(
        "slow_request_anatomy"
    ).slow_request_anatomy
    return anatomy


def _held_run(pairs: list[tuple[float, float]], slo_ms: float = 40.0) -> dict[str, object]:
    """A held run of 7 whose window at 5 s * i had predicted and simulated p99 ITL ``pairs[i]``."""
    return {
        "run": "scenario@7",
        "replicas": 7,
        "itl_slo_ms": slo_ms,
        "itl_p99_across": [(5.0 * i, {"7": p, "6": 2.0 * p}) for i, (p, _) in enumerate(pairs)],
        "window_itl_p99": {f"{5.0 * i:.1f}": s for i, (_, s) in enumerate(pairs)},
    }


def test_calibration_is_binned_by_the_prediction_not_the_outcome() -> None:
    # A model right on average: each prediction's window ran 0.8x, 1x or 1.25x of it.
    # Binned by the prediction (20 ms: half the SLO; 36 ms: 0.9 of it) every band
    # reads 1.00. Binned by the outcome, the 45 ms window (1.25x of 36) would sit in
    # the band above the SLO and read under-predicted (0.80) for a model that is not.
    spread = (0.8, 1.0, 1.25)
    pairs = [(p, p * k) for p in (20.0, 36.0) for k in spread]
    cells = _bench().calibration_by_band([_held_run(pairs)])["scenario@7"]
    bands = _bench().ITL_BANDS
    by_band = dict(zip(bands, cells, strict=True))
    assert by_band[(0.0, 0.6)] == pytest.approx((1.0, 3))
    assert by_band[(0.8, 1.0)] == pytest.approx((1.0, 3))
    assert by_band[(1.0, 1.25)][1] == 0 and math.isnan(by_band[(1.0, 1.25)][0])
    # The count held (7), not another the run also predicted at (6: twice as high).
    assert sum(count for _, count in cells) == len(pairs)


def test_a_model_low_near_the_slo_shows_in_that_band_alone() -> None:
    # Right at low load, 10% low where it predicts 0.8-1.0 of the SLO; an infeasible
    # prediction (inf) and a window with no simulated value are left out.
    pairs = [(20.0, 20.0)] * 5 + [(36.0, 40.0)] * 5 + [(math.inf, 90.0)]
    run = _held_run(pairs)
    run["itl_p99_across"].append((500.0, {"7": 30.0}))  # type: ignore[union-attr]
    cells = _bench().calibration_by_band([run])["scenario@7"]
    assert cells[0] == pytest.approx((1.0, 5))
    assert cells[2] == pytest.approx((0.9, 5))
    assert sum(count for _, count in cells) == 10


def test_a_short_output_met_a_prefill_only_on_its_replica_between_its_tokens() -> None:
    # Replica 0 runs a pass every 10 ms; the pass ending at 0.05 s carries prefill.
    # A (2 tokens: one interval, the pass ending at 0.03) met none; B (3 tokens,
    # passes ending at 0.05 and 0.06) met it; C (3 tokens, first token at 0.05: the
    # prefill pass made it) met none after. D, on replica 1 at the same time, met
    # none: replica 0's prefill is not its. E's first token comes before the first
    # prediction, so it is not judged.
    rows = [(0.0, 0.01 * i, i == 5) for i in range(1, 11)]
    rows += [(1.0, 0.01 * i, False) for i in range(1, 11)]
    passes = np.array(rows, dtype=np.float64)
    first = np.array([0.02, 0.04, 0.05, 0.04, 0.001])
    finish = np.array([0.03, 0.06, 0.07, 0.06, 0.03])
    replica = np.array([0, 0, 0, 1, 0], dtype=np.int64)
    tokens = np.array([2, 3, 3, 3, 2], dtype=np.int64)
    model = [0.1 * m for m in range(1, 17)]  # P(K >= 1) for 1..16 intervals
    requests = _bench().RequestPasses.of(passes, first, finish, replica, tokens)
    cal = _bench().short_output_calibration([(0.01, model)], requests)
    assert cal["2"] == pytest.approx([0.1, 0.0, 1.0])  # A alone (E not judged)
    assert cal["3"] == pytest.approx([0.2, 1.0 / 3.0, 3.0])  # B met it; C and D did not
    assert set(cal) == {"2", "3"}
    assert _bench().short_output_calibration([], requests) == {}


def test_a_short_outputs_own_lift_is_its_prefill_passes_over_its_replicas_share() -> None:
    # Replica 0 runs a pass every millisecond (times in ms here) for 100 ms; every
    # tenth carries prefill. A (3 tokens: two intervals, passes ending at 51 and 52)
    # follows the prefill pass at 50 and meets none; its replica's share before it
    # is 5 of 50. B (first token at 69) meets the one at 70; its share is 6 of 69.
    # Together: 1 / (2 x (5/50 + 6/69)), against the streams' measured 2.0.
    rows = [(0.0, float(i), i % 10 == 0) for i in range(1, 101)]
    passes = np.array(rows, dtype=np.float64)
    first = np.array([50.0, 69.0])
    finish = np.array([52.0, 71.0])
    replica = np.array([0, 0], dtype=np.int64)
    tokens = np.array([3, 3], dtype=np.int64)
    measured = [1.0 + 0.5 * m for m in range(1, 17)]  # 2.0 at two intervals
    requests = _bench().RequestPasses.of(passes, first, finish, replica, tokens)
    lift = _bench().short_output_lift([(1.0, measured)], requests)
    assert lift == {"3": pytest.approx([2.0, 1.0 / (2.0 * (5 / 50 + 6 / 69)), 2.0])}
    assert _bench().short_output_lift([], requests) == {}
