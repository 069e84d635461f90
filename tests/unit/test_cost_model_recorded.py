"""CostModel over a real FPM stream recorded from the vLLM CPU engine.

``tests/data/fpm_recording_contended_tight.jsonl.gz``: 7,381 passes (plus two heartbeats)
of ``benchmarks/record_fpm.py --configs tight --phase-s 12`` (all five load
phases: short, long, prefix, decode_heavy, mixed; chunked prefill and preemption),
recorded on the shared 2-core machine at a load average of about 2-2.5 (read
shortly afterwards; the recorder did not log it then), with vLLM pinned to one
OpenMP thread. About 5.5% of its passes were stalled 10-30x by the
OS scheduler, in runs of up to 111 passes; these runs are what made the previous
model predict ~2x for thousands of passes.

The figures are deterministic (fixed data, fixed feeding order), so the bounds
are accuracy assertions, not timing thresholds. Measured when written (baseline
predictions <= 0 scored, clamped to 1 us): model MAPE 18.5% / median APE 8.7%,
median signed error -0.5%, over all scored passes; on the noise-floor passes model
17.0% / 8.3%, noise floor 22.5% / 7.5%, baseline 93.6% / 29.6%; plain EW-OLS
162% (stalls pull an unweighted least squares). The other kept recordings
(``fpm_recording_*.jsonl.gz``, see ``benchmarks/record_fpm.py``) are checked against
EW-OLS and the non-local noise floor below: ``contended_*`` were recorded while other
jobs shared the 2 cores (stall runs of 10-30x, which make a plain EW-OLS 69-180%
MAPE), ``quiet_*`` with the machine otherwise idle (load average 0.2-1.9 with the
recorder itself; EW-OLS 10.6-19.8%, the fair comparison), each with its recorder's
``.meta.json`` beside it. ``h200_*`` are real GPU time: CUDA-event ``wall_time``
from the plugin's own timer on an NVIDIA H200, recorded by
``benchmarks/record_cuda_steps.py`` with decode passes replayed from CUDA graphs:
``wide`` a 14B Llama-shaped model (16 layers of Llama-3-70B's shape), ``eight_b``
Llama-3-8B's shape, both bf16 (4,015 and 4,043 passes, 8-96 and 6-71 ms p1-p99).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics
from stepscale_operator.cost_model import CostModel, regime_ids, sched_matrix
from tests.conftest import benchmark_module

REPO = Path(__file__).resolve().parents[2]
RECORDING = REPO / "tests" / "data" / "fpm_recording_contended_tight.jsonl.gz"
# Every recording kept in the repository (benchmarks/record_fpm.py configurations).
RECORDINGS = sorted((REPO / "tests" / "data").glob("fpm_recording_*.jsonl.gz"))

# Stated bounds (the target is 1.25x the noise floor's MAPE).
MAX_MAPE_OVER_FLOOR = 1.25
MAX_MEDIAN_APE_OVER_FLOOR = 1.5  # the floor's cells are also local in time; see the bench
MAX_MAPE_OVER_BASELINE = 0.5


def _bench() -> ModuleType:
    """benchmarks/bench_cost_model.py as a module (the baseline and floor live there)."""
    return benchmark_module("bench_cost_model")


@functools.cache
def _score_recording(path: Path) -> dict[str, Any]:
    """The bench's figures for one kept recording (computed once per test run)."""
    return dict(_bench().score(_bench().load_recording(path)))


@pytest.fixture(scope="module")
def passes() -> list[ForwardPassMetrics]:
    msgs = _bench().load_recording(RECORDING)
    return [m for m in msgs if m.wall_time > 0]


@pytest.fixture(scope="module")
def scored(passes: list[ForwardPassMetrics]) -> dict[str, Any]:
    return dict(_bench().score(passes))


def _feed(model: CostModel, passes: list[ForwardPassMetrics], batch: int = 16) -> np.ndarray:
    """Prequential predictions, fed in arrival order in small batches like the pipeline."""
    sched = sched_matrix([m.scheduled_requests for m in passes])
    wall = np.array([m.wall_time for m in passes])
    keys = [(m.worker_id, m.dp_rank) for m in passes]
    counters = [m.counter_id for m in passes]
    preds = np.full(len(passes), np.nan)
    for s in range(0, len(passes), batch):
        e = s + batch
        preds[s:e] = model.update_batch(sched[s:e], wall[s:e], keys[s:e], counters[s:e])
    return preds


def test_recording_covers_every_regime(passes: list[ForwardPassMetrics]) -> None:
    sched = sched_matrix([m.scheduled_requests for m in passes])
    counts = np.bincount(regime_ids(sched), minlength=4)
    assert len(passes) > 5000
    assert counts[0] >= 100 and counts[1] >= 3000 and counts[2] >= 300  # prefill, decode, mixed
    walls = np.array([m.wall_time for m in passes])
    assert (walls > 10 * np.median(walls)).mean() > 0.03  # it does contain stalls


def test_model_beats_the_baseline(scored: dict[str, Any]) -> None:
    model, base = scored["all"]["model"], scored["all"]["baseline"]
    assert model["n"] == base["n"] > 5000
    assert model["mape"] <= MAX_MAPE_OVER_BASELINE * base["mape"]
    assert model["median_ape"] < base["median_ape"]


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name.split(".")[0])
def test_every_recording_at_least_as_accurate_as_ew_ols_and_near_the_nonlocal_floor(
    path: Path,
) -> None:
    """On every kept recording, prequentially, over the same passes: MAPE no worse than
    a plain exponentially weighted OLS (1,000-pass half-life), and within 1.25x of the
    non-local noise floor (identical work done at other moments; the 8B GPU shape is
    the closest, 1.21x when written)."""
    result = _score_recording(path)
    assert result["all"]["model"]["n"] > 1000
    assert result["model_mape_over_ew_ols"] <= 1.0
    assert result["model_mape_over_noise_floor_nonlocal"] <= MAX_MAPE_OVER_FLOOR


# Median signed error bounds per regime. The target is 3% everywhere; measured when
# written (bench_cost_model.py): overall and decode-only within 3.1% on every kept
# recording. Where a regime is off by more, the bound says by how much, and why:
# * prefill-bearing passes are few (1-8% of passes) and fall in a few phases, so
#   their median also measures the machine at those moments. Contended recordings:
#   -24% to +14% (stall runs that fell on prefill-heavy phases); quiet ones: -6.1%
#   (decode_small, 184 prefill passes) to +5.2% (bigger, 308).
# * quiet_roomy's decode batches of 1-3: -5.8%. The same work done at other moments
#   (the non-local floor) runs up to 13% faster or slower tenth by tenth of that
#   recording, and small batches fell in its slow tenths.
SIGNED_BOUND = 0.035
PREFILL_SIGNED_BOUND = {"contended": 0.25, "quiet": 0.07, "gpu": SIGNED_BOUND}
SMALL_DECODE_SIGNED_BOUND = {"fpm_recording_quiet_roomy": 0.065}


def _kind(name: str) -> str:
    """``quiet``, ``contended`` (CPU recordings) or ``gpu``, from the recording's name."""
    if name.startswith("fpm_recording_quiet_"):
        return "quiet"
    return "gpu" if name.startswith("fpm_recording_h200_") else "contended"


GPU_RECORDINGS = [p for p in RECORDINGS if _kind(p.name.split(".")[0]) == "gpu"]
MAX_GPU_MAPE = 0.05  # the target for real CUDA step times
# Measured when written: wide 2.8%, eight_b 4.9% (its prefill-bearing passes, 23% of
# them and run eagerly by the stand-in engine, 11.2%; decode-only passes 3.1%).
GPU_SIGNED_BOUND = 0.03  # the issue's, per regime; at most 0.8% when written


@pytest.mark.parametrize("path", GPU_RECORDINGS, ids=lambda p: p.name.split(".")[0])
def test_real_gpu_step_times_within_five_percent_and_unbiased(path: Path) -> None:
    """On CUDA-timed passes, where the same work takes the same time (non-local floor
    1.5-3%), the model is within 5% MAPE, better than the Dynamo-style regression, and
    within 3% at the median in every regime. Measured when written: wide 2.8% (EW-OLS
    3.6%, Dynamo-style 3.9%), eight_b 4.9% (11.1%, 7.1%); median signed within 0.1%
    on both, every regime within 0.8%."""
    result = _score_recording(path)
    model = result["all"]["model"]
    assert model["n"] > 2000
    assert model["mape"] <= MAX_GPU_MAPE, model
    assert model["mape"] < result["all"]["baseline"]["mape"]
    by_regime = result["signed_by_regime"]["model"]
    assert all(abs(v) < GPU_SIGNED_BOUND for v in by_regime.values()), by_regime
    meta = json.loads(path.with_name(path.name.split(".")[0] + ".meta.json").read_text())
    assert meta["timing_check"]["scopes"]["model_step_cuda"] > 0.99 * meta["passes"]


def test_a_kind_of_pass_first_seen_on_a_quiet_gpu_is_learned_within_a_few() -> None:
    """The 8B recording's long-prompt phase brings 2,048-token chunks the model has not
    seen, 2.2-2.9x what the fit of shorter prompts says. On a quiet GPU the stall
    gate is narrow (residual scale ~0.04): before the unlearned regime's gate had a
    floor, 15 of the first 30 such chunks were predicted more than 30% low (the first
    13 of them in a row, over ~400 passes); now 4."""
    path = REPO / "tests" / "data" / "fpm_recording_h200_eight_b.jsonl.gz"
    bench = _bench()
    msgs = [m for m in bench.load_recording(path) if m.wall_time > 0]
    preds = bench.model_predictions(msgs)
    wall = np.array([m.wall_time for m in msgs])
    first = [
        i
        for i, m in enumerate(msgs)
        if m.scheduled_requests.sum_prefill_tokens >= 1900
        and m.scheduled_requests.sum_prefill_kv_tokens == 0
    ][:30]
    errors = np.abs(preds[first] - wall[first]) / wall[first]
    assert errors[0] > 0.5  # the extrapolation was that far off at first
    assert int((errors > 0.3).sum()) <= 6, np.round(errors, 2)


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name.split(".")[0])
def test_every_recording_unbiased_overall_and_on_decode_passes(path: Path) -> None:
    """Median signed error within 3.5% overall and on decode-only passes on every
    kept recording, and on decode batches of 1-3 and prefill-bearing passes within
    the bounds above (the version before per-regime forgetting had +3.7% on
    prefix-shared decode 1-3, and +51% on the bigger model's prefill passes)."""
    result = _score_recording(path)
    name = path.name.split(".")[0]
    kind = _kind(name)
    by_regime = result["signed_by_regime"]["model"]
    assert abs(result["all"]["model"]["median_signed"]) < SIGNED_BOUND, result["all"]["model"]
    assert abs(by_regime["decode"]) < SIGNED_BOUND, by_regime
    small_bound = SMALL_DECODE_SIGNED_BOUND.get(name, SIGNED_BOUND)
    assert abs(by_regime["small_decode"]) < small_bound, by_regime
    assert abs(by_regime["prefill"]) < PREFILL_SIGNED_BOUND[kind], by_regime


def test_model_is_within_stated_factor_of_the_noise_floor(scored: dict[str, Any]) -> None:
    on = scored["floor_passes"]
    assert on["noise_floor"]["n"] == on["model"]["n"] > 4000  # the same passes
    assert scored["model_mape_over_noise_floor"] <= MAX_MAPE_OVER_FLOOR
    assert scored["model_median_ape_over_noise_floor"] <= MAX_MEDIAN_APE_OVER_FLOOR


def test_prequential_error_has_no_long_bad_stretch(passes: list[ForwardPassMetrics]) -> None:
    """The old failure: after a stall run the model predicted ~2x for thousands of passes."""
    preds = _feed(CostModel(), passes)
    wall = np.array([m.wall_time for m in passes])
    ape = np.abs(preds - wall) / wall
    ok = np.isfinite(ape)
    quarters = np.array_split(np.flatnonzero(ok), 4)
    medians = [float(np.median(ape[q])) for q in quarters]
    assert max(medians) < 0.15, medians


def test_median_signed_error_is_small_overall_and_per_regime(
    scored: dict[str, Any],
) -> None:
    """Unbiased: real passes neither above nor below the prediction at the median,
    overall, on decode-only passes and on decode batches of 1-3 (within 3%). Under
    1/y^2 weights these were -2% to -12% across recordings. Prefill-bearing passes are
    held to 8%: their error is the model's shape (aggregated prompt statistics), not
    its weighting, and moves both ways between recordings (bench_cost_model)."""
    overall = scored["all"]["model"]["median_signed"]
    by_regime = scored["signed_by_regime"]["model"]
    assert abs(overall) < 0.03, overall
    assert abs(by_regime["decode"]) < 0.03, by_regime
    assert abs(by_regime["small_decode"]) < 0.03, by_regime
    assert abs(by_regime["prefill"]) < 0.08, by_regime


def test_fit_is_physical_and_ready(passes: list[ForwardPassMetrics]) -> None:
    model = CostModel()
    _feed(model, passes)
    coef = model.coefficients
    assert model.ready
    assert all(v >= 0.0 and math.isfinite(v) for v in coef.values())
    # A step of this tiny model on one CPU thread takes about 4-5 ms.
    assert 3e-3 < coef["intercept"] < 6e-3
    q = model.quality
    assert q.outliers_rejected > 0.03 * len(passes)  # the stalls were kept out
    assert q.prefill_only_samples > 0 and q.decode_only_samples > 0 and q.mixed_samples > 0


def test_warm_start_keeps_accuracy(passes: list[ForwardPassMetrics]) -> None:
    """Train on the first half, snapshot through JSON, restore, go on with the second."""
    half = len(passes) // 2
    first, second = passes[:half], passes[half:]
    continuous = CostModel()
    _feed(continuous, first)
    snapshot = json.loads(json.dumps(continuous.to_dict()))
    restored = CostModel.from_dict(snapshot)
    assert restored.ready
    wall = np.array([m.wall_time for m in second])
    pred_restored = _feed(restored, second)
    pred_continuous = _feed(continuous, second)
    pred_cold = _feed(CostModel(), second)

    def mape(pred: np.ndarray, sel: slice) -> float:
        ape = np.abs(pred[sel] - wall[sel]) / wall[sel]
        return float(np.nanmean(ape))

    # Predictions from the first pass after the (re)start's warm-up, as good as never stopping.
    warmup = restored.warmup_passes
    assert np.isfinite(pred_restored[warmup:]).all()
    assert np.isnan(pred_cold[warmup : warmup + 100]).any()  # a cold model has nothing yet
    early = slice(warmup, warmup + 500)
    assert mape(pred_restored, early) <= 1.1 * mape(pred_continuous, early) + 0.01
    assert mape(pred_restored, slice(warmup, None)) <= (
        1.1 * mape(pred_continuous, slice(warmup, None)) + 0.01
    )
    assert all(v >= 0.0 for v in restored.coefficients.values())


def test_bench_defaults_to_local_recordings_else_the_repository_one(tmp_path: Path) -> None:
    bench = _bench()
    assert bench.default_recordings(tmp_path) == []
    kept = tmp_path / "tests" / "data" / "kept.jsonl.gz"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"")
    assert bench.default_recordings(tmp_path) == [kept]
    local = tmp_path / "results" / "recordings"
    local.mkdir(parents=True)
    for name in ("a.jsonl", "b.jsonl.gz"):
        (local / name).write_bytes(b"")
    assert bench.default_recordings(tmp_path) == [local / "a.jsonl", local / "b.jsonl.gz"]
    if not any(REPO.glob("results/recordings/*.jsonl*")):
        assert bench.default_recordings(REPO) == RECORDINGS


def test_baseline_predictions_at_or_below_zero_are_scored_not_dropped() -> None:
    bench = _bench()
    # Decode passes that get faster with the batch: the baseline's line extrapolates
    # below zero for a large batch. That is a prediction too, and a bad one.
    msgs = [
        ForwardPassMetrics(
            worker_id="w",
            counter_id=i,
            wall_time=0.1 - 0.001 * n,
            scheduled_requests=ScheduledRequestMetrics(num_decode_requests=n),
        )
        for i, n in enumerate([*range(1, 60), 200])
    ]
    preds = bench.baseline_predictions(msgs)
    assert preds[-1] == bench.MIN_PREDICTION_S
    assert np.isfinite(preds[3:]).all()  # NaN only before its first fit (3 samples)


def test_slow_moments_mark_passes_among_slow_decode_passes() -> None:
    """The bench's hindsight diagnostic: a prefill pass run while the decode passes
    around it were 3x their prediction is in a slow moment; one among decode passes
    on time is not, however far off its own prediction is."""
    bench = _bench()
    msgs = []
    for i in range(200):
        prefill = i % 10 == 5
        slow_machine = 100 <= i < 160
        sched = ScheduledRequestMetrics(
            num_prefill_requests=int(prefill),
            sum_prefill_tokens=100 if prefill else 0,
            num_decode_requests=4,
        )
        wall = (3.0 if slow_machine else 1.0) * (5.0 if prefill else 1.0)
        msgs.append(
            ForwardPassMetrics(
                worker_id="w", counter_id=i, wall_time=wall, scheduled_requests=sched
            )
        )
    pred = np.ones(200)  # right for decode passes on time; 5x low for every prefill pass
    slow = bench.slow_moments(msgs, pred)
    assert slow[125] and slow[135] and slow[115]
    assert not slow[25] and not slow[185]


def test_median_interval_resamples_runs_so_phases_widen_it() -> None:
    """The bench's interval of a regime's median keeps neighbours together: errors
    that come in phases (the machine slow for a stretch, a batch kept for dozens of
    passes) leave the median far less certain than as many independent errors, and
    independent errors get about the interval they would get one by one."""
    bench = _bench()
    rng = np.random.default_rng(1)
    n = 400
    y = np.ones(n)
    # Eight phases of 50 passes, each off by its own -20% .. +20%, a little noise within.
    phases = np.repeat(rng.uniform(-0.2, 0.2, 8), 50) + rng.normal(0.0, 0.01, n)
    noise = rng.normal(0.0, 0.1, n)  # independent errors of a similar spread
    everything = np.ones(n, dtype=bool)

    def width(signed: np.ndarray) -> float:
        interval = bench.median_interval(y, 1.0 + signed, everything)
        assert interval is not None and interval[0] <= np.median(signed) <= interval[1]
        return interval[1] - interval[0]

    def one_by_one(signed: np.ndarray) -> float:
        medians = np.median(signed[rng.integers(0, n, (1000, n))], axis=1)
        return float(np.percentile(medians, 97.5) - np.percentile(medians, 2.5))

    assert width(phases) > 2.0 * one_by_one(phases)
    assert 0.7 < width(noise) / one_by_one(noise) < 1.4
    assert bench.median_interval(y[:19], y[:19], everything[:19]) is None
