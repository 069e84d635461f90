"""Where the router sends a prompt, and the exposure carried from the measured count."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from stepscale_operator.latency_model import EngineLimits, PerReplicaLoad, predict_latency
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS, LoadEstimate
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.router_pick import (
    balanced_pick_decodes,
    least_loaded_queue,
    prefill_exposure,
    prefill_exposure_at,
)
from tests.unit.test_planner import LinearStepTime, load_of

# The long-context shape measured on 6 replicas: 0.65 decodes each over time, a
# prompt in progress 90% of the time, prefill passes carrying 0.86 fewer decodes
# than the mean pass.
MEASURED_AT, FLEET_BATCH, FLEET_BUSY, DEFICIT, QUEUED = 6, 6 * 0.65, 6 * 0.9, 0.86, 0.3


def carried(replicas: int, balanced: bool = True) -> float:
    """Decode requests a prefill pass carries at ``replicas``, from the measurement."""
    batch, busy = FLEET_BATCH / replicas, min(FLEET_BUSY / replicas, 1.0)
    exposure = prefill_exposure_at(DEFICIT, MEASURED_AT, replicas, batch, busy, QUEUED, balanced)
    return exposure * batch


def test_at_the_measured_count_the_measured_exposure_is_kept() -> None:
    batch = FLEET_BATCH / MEASURED_AT
    for balanced in (True, False):
        assert prefill_exposure_at(
            DEFICIT, MEASURED_AT, MEASURED_AT, batch, 0.9, QUEUED, balanced
        ) == pytest.approx(prefill_exposure(DEFICIT, batch))
    # The count unknown: taken as measured at the count asked about.
    assert prefill_exposure_at(DEFICIT, 0, 9, 0.4, 0.6, QUEUED, True) == pytest.approx(
        prefill_exposure(DEFICIT, 0.4)
    )
    # No deficit measured: every decode is exposed, at every count.
    assert prefill_exposure_at(0.0, MEASURED_AT, 12, 0.3, 0.5, QUEUED, True) == 1.0


def test_a_balancing_router_spares_decodes_faster_than_the_fleet_grows() -> None:
    # Over batches below one a prompt delays decodes only when no replica is free:
    # more replicas, fewer such moments. Held at its measured value, the deficit
    # gave every count the same decodes per prefill pass (max(b, 1) - deficit =
    # 0.14), so the predicted ITL hardly moved with the fleet.
    at = {n: carried(n) for n in (4, 6, 8, 12, 16)}
    assert at[6] == pytest.approx(1.0 - DEFICIT)
    assert at[4] > at[6] > at[8] > at[12] > at[16] >= 0.0
    # Steeper than an even split of the same decodes (a 1/n share of them).
    assert at[12] / at[6] < 0.5 * 6 / 12
    assert at[8] / at[6] < 6 / 8


def test_a_random_router_keeps_the_measured_exposure_at_every_count() -> None:
    # Its pick is any replica, so a prefill pass carries the same share of the
    # mean batch whatever the count.
    for n in (4, 8, 12):
        batch = FLEET_BATCH / n
        assert carried(n, balanced=False) / batch == pytest.approx(
            prefill_exposure(DEFICIT, FLEET_BATCH / MEASURED_AT)
        )


def test_the_two_router_models_bound_the_decodes_at_the_pick() -> None:
    # One replica is picked whatever it holds.
    assert least_loaded_queue(1, 0.5, 0.5, QUEUED).decodes == pytest.approx(0.5)
    for n in (6, 8, 12):
        batch, busy = FLEET_BATCH / n, min(FLEET_BUSY / n, 1.0)
        independent = least_loaded_queue(n, batch, busy, QUEUED).decodes
        balanced = balanced_pick_decodes(n, batch, busy, QUEUED)
        # A free replica is likelier among independent ones: fewer decodes at the pick.
        assert 0.0 <= independent < balanced < batch
    # Over large batches a prompt is lost in the spread: both near the mean batch.
    for n in (2, 4):
        assert least_loaded_queue(n, 40.0 / n, 0.5, QUEUED).decodes > 0.5 * 40.0 / n
        assert balanced_pick_decodes(n, 40.0 / n, 0.5, QUEUED) > 0.9 * 40.0 / n
    # Fewer requests than replicas in the fleet: a balanced one always has a free replica.
    assert balanced_pick_decodes(64, 0.01, 0.0, 0.0) < 1e-6
    assert balanced_pick_decodes(8, 0.0, 0.5, QUEUED) == 0.0


def test_the_prediction_falls_with_the_fleet_where_a_balancing_router_spares_decodes() -> None:
    # A load measured on 4 replicas with batches below one (long prompts, short
    # outputs: 0.84 decodes each over time), prefill passes carrying 0.3 decodes;
    # the prompt tokens beside a decode at other counts follow the router's pick.
    shares = (1.0 / len(OUTPUT_INTERVAL_BINS),) * len(OUTPUT_INTERVAL_BINS)
    base = replace(
        load_of(4.0, prompt=8000.0, output=100.0),
        output_interval_shares=shares,
        prefill_pass_decode_deficit=0.7,
    )
    engine = EngineLimits(max_num_batched_tokens=2048)

    def beside(load: LoadEstimate, n: int) -> float:
        per = PerReplicaLoad.from_estimate(load, n)
        return predict_latency(
            LinearStepTime(), per, engine, PlannerPolicy(), n
        ).prefill_tokens_per_decode

    assert base.streams_total - base.streams_missing == 4
    measured = [beside(base, n) for n in (2, 4, 8, 16)]
    assert measured[0] > measured[1] > measured[2] > measured[3]
    # Measured with the deficit held at every count, the same decode requests met
    # the same prompts at every count (batches below one).
    held = [beside(replace(base, streams_total=n), n) for n in (8, 16)]
    assert held[1] == pytest.approx(held[0], rel=0.05)
    assert measured[3] < 0.5 * held[1]


def test_a_replica_in_a_long_prefill_drains_its_decodes_and_becomes_the_pick() -> None:
    # 8 replicas, 4 decodes each, a prompt in progress on 30% of them. Short
    # prefills (50 ms among decodes that live 1.6 s) leave the batch as it is:
    # the pick is prefilling about as often as before.
    from stepscale_operator.latency_model import _decodes_while_prefilling

    plain = least_loaded_queue(8, 4.0, 0.3, 0.1)
    short = _decodes_while_prefilling(4.0, 2.5, [(0.05, 1.0)], 0.05)
    assert short[0][0] == pytest.approx(4.0 * (1.6 / 0.05) * (1.0 - math.exp(-0.05 / 1.6)))
    assert least_loaded_queue(8, 4.0, 0.3, 0.1, short).prefilling == pytest.approx(
        plain.prefilling, rel=0.05
    )
    # 5% of prompts take 12 s: over one of them the replica's decodes finish and
    # none join (0.53 left on average, an eighth), so the router, counting
    # outstanding requests, sends the next prompt there: the pick is prefilling
    # over three times as often (the long-context scenario: 9 of 10 reachable
    # TTFT misses waited behind such a prefill while other replicas had none).
    mix = [(0.5, 0.95), (12.0, 0.05)]
    drained = _decodes_while_prefilling(4.0, 2.5, mix, 0.5 * 0.95 + 12.0 * 0.05)
    assert drained[1][0] == pytest.approx(4.0 * 1.6 / 12.0, rel=0.01)
    assert sum(w for _, w in drained) == pytest.approx(1.0)
    assert least_loaded_queue(8, 4.0, 0.3, 0.1, drained).prefilling > 3.0 * plain.prefilling
    # One replica: it is picked whatever it holds.
    assert least_loaded_queue(1, 4.0, 0.3, 0.1, drained).prefilling == pytest.approx(0.3)
