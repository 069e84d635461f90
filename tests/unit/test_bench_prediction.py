"""bench_prediction.py's window-by-window comparison of the prompt tokens a decode sees."""

from __future__ import annotations

import math
from types import ModuleType

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
