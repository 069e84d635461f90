"""One bad pod cannot take the model over: its stream is quarantined, named, let back.

Five pods share one engine type. One of them, sending 60% of all passes, reports
times 50x too fast or 20x too slow (inside every hard plausibility limit: a broken
clock, a misconfigured engine). The model must stay within 2 points of the MAPE it
has when that pod is honest, name the pod with its error, and learn from it again
once it reports honest times.
"""

from __future__ import annotations

import numpy as np
import pytest

from stepscale_operator.controller.status import cost_model_status
from stepscale_operator.cost_model import CostModel, sched_matrix
from tests.conftest import REPO_ROOT, benchmark_module
from tests.unit.test_cost_model import compositions, step_times

load_recording = benchmark_module("bench_cost_model").load_recording

GOOD = [(f"good-{i}", 0) for i in range(4)]
BAD = ("bad", 0)
N = 12_000
NOISE = 0.10


def _stream_keys(rng: np.random.Generator, n: int) -> list[tuple[str, int]]:
    """60% of the passes from BAD, the rest spread over the four good pods."""
    bad = rng.random(n) < 0.6
    good = rng.integers(0, len(GOOD), n)
    return [BAD if b else GOOD[g] for b, g in zip(bad, good, strict=True)]


def _run(factor: float, seed: int = 5, **model_kw: float) -> tuple[CostModel, float]:
    """Feed N synthetic passes in batches of 64; the bad pod's times are ``factor`` x
    the truth.

    Returns the model and the prequential MAPE on the good pods' passes of the second
    half (what the planner would have been told about them)."""
    rng = np.random.default_rng(seed)
    sched = compositions(rng, N)
    wall = step_times(rng, sched, NOISE)
    return _feed_with_bad_pod(rng, sched, wall, factor, **model_kw)


def _feed_with_bad_pod(
    rng: np.random.Generator,
    sched: np.ndarray,
    wall: np.ndarray,
    factor: float,
    **model_kw: float,
) -> tuple[CostModel, float]:
    """Spread the passes over the pods (60% to BAD, whose times are ``factor`` x true),
    feed them in batches of 64; the model and the second half's good-pod MAPE."""
    n = wall.shape[0]
    keys = _stream_keys(rng, n)
    is_bad = np.array([k == BAD for k in keys])
    reported = np.where(is_bad, wall * factor, wall)
    model = CostModel(warmup_passes=0, **model_kw)
    preds = np.full(n, np.nan)
    for s in range(0, n, 64):
        preds[s : s + 64] = model.update_batch(
            sched[s : s + 64], reported[s : s + 64], keys[s : s + 64]
        )
    scored = ~is_bad & np.isfinite(preds)
    scored[: n // 2] = False
    ape = np.abs(preds[scored] - wall[scored]) / wall[scored]
    return model, float(ape.mean())


@pytest.fixture(scope="module")
def clean_mape() -> float:
    return _run(1.0)[1]


@pytest.mark.parametrize("factor", [1 / 50, 20.0])
def test_a_bad_pod_with_most_of_the_passes_cannot_take_the_model_over(
    factor: float, clean_mape: float
) -> None:
    model, mape = _run(factor)
    assert mape <= clean_mape + 0.02, (mape, clean_mape)
    quarantined = model.quality.quarantined
    assert list(quarantined) == ["bad/0"]
    # Named with its error against the other pods: 50x faster is -98%, 20x slower +1900%.
    assert quarantined["bad/0"] == pytest.approx(factor - 1.0, rel=0.25)
    assert model.to_dict()["quality"]["quarantined"] == quarantined
    assert model.stream_residuals()[BAD]["quarantined"] == 1
    # It was there from the start with most of the passes: the model started afresh
    # once, without it (no flapping of good pods in and out).
    assert model.restarts_after_poisoning == 1
    # And on the custom resource's status.
    status = cost_model_status(model.to_dict())
    assert list(status["quarantinedStreams"]) == ["bad/0"]
    assert status["quarantinedStreams"]["bad/0"] == pytest.approx(factor - 1.0, rel=0.25)


GPU_RECORDING = REPO_ROOT / "tests" / "data" / "fpm_recording_h200_wide.jsonl.gz"


@pytest.fixture(scope="module")
def gpu_passes() -> tuple[np.ndarray, np.ndarray]:
    """The H200 recording's passes: composition matrix and CUDA-timed wall times."""
    passes = [m for m in load_recording(GPU_RECORDING) if m.wall_time > 0]
    return sched_matrix([m.scheduled_requests for m in passes]), np.array(
        [m.wall_time for m in passes]
    )


@pytest.mark.parametrize("factor", [1 / 50, 20.0])
def test_a_bad_pod_cannot_take_over_on_real_gpu_step_times(
    factor: float, gpu_passes: tuple[np.ndarray, np.ndarray]
) -> None:
    """The same on real CUDA step times (the H200 recording's passes spread over five
    pods of one engine type): within 2 points of the clean MAPE, the bad pod named."""
    sched, wall = gpu_passes
    _, clean = _feed_with_bad_pod(np.random.default_rng(2), sched, wall, 1.0)
    model, mape = _feed_with_bad_pod(np.random.default_rng(2), sched, wall, factor)
    assert mape <= clean + 0.02, (mape, clean)
    assert list(model.quality.quarantined) == ["bad/0"]
    assert model.quality.quarantined["bad/0"] == pytest.approx(factor - 1.0, rel=0.25)


def test_without_quarantine_the_bad_pod_takes_the_model_over(clean_mape: float) -> None:
    """The test above can fail: with quarantine off, 60% of the passes win."""
    model, mape = _run(20.0, quarantine_factor=1e9)
    assert model.quality.quarantined == {}
    assert mape > clean_mape + 0.5


def test_quarantined_pod_is_let_back_once_it_agrees_again() -> None:
    rng = np.random.default_rng(9)
    model = CostModel(warmup_passes=0)
    n = 6000
    sched = compositions(rng, n)
    wall = step_times(rng, sched, NOISE)
    keys = _stream_keys(rng, n)
    is_bad = np.array([k == BAD for k in keys])
    half = n // 2
    # First half: the bad pod reports 20x slow; second half: honest.
    reported = np.where(is_bad & (np.arange(n) < half), wall * 20.0, wall)
    named_at_half: dict[str, float] = {}
    for s in range(0, n, 64):
        model.update_batch(sched[s : s + 64], reported[s : s + 64], keys[s : s + 64])
        if s + 64 == half - (half % 64) or (s < half <= s + 64):
            named_at_half = dict(model.quality.quarantined)
    assert list(named_at_half) == ["bad/0"]
    assert model.quality.quarantined == {}
    assert model.stream_residuals()[BAD]["quarantined"] == 0
    # Let back means learned from again: its samples grew in the second half.
    assert model.stream_residuals()[BAD]["samples"] > 0.4 * np.count_nonzero(is_bad[half:])
