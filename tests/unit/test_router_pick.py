"""Where the router sends a prompt, and the exposure carried from the measured count."""

from __future__ import annotations

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
# prompt in progress 90% of the time, prefill passes carrying 0.14 decodes.
MEASURED_AT, FLEET_BATCH, FLEET_BUSY, DECODES, QUEUED = 6, 6 * 0.65, 6 * 0.9, 0.14, 0.3


def carried(replicas: int, balanced: bool = True) -> float:
    """Decode requests a prefill pass carries at ``replicas``, from the measurement."""
    batch, busy = FLEET_BATCH / replicas, min(FLEET_BUSY / replicas, 1.0)
    exposure = prefill_exposure_at(DECODES, MEASURED_AT, replicas, batch, busy, QUEUED, balanced)
    return exposure * batch


def test_at_the_measured_count_the_measured_exposure_is_kept() -> None:
    batch = FLEET_BATCH / MEASURED_AT
    for balanced in (True, False):
        assert prefill_exposure_at(
            DECODES, MEASURED_AT, MEASURED_AT, batch, 0.9, QUEUED, balanced
        ) == pytest.approx(prefill_exposure(DECODES, batch))
    # The count unknown: taken as measured at the count asked about.
    assert prefill_exposure_at(DECODES, 0, 9, 0.4, 0.6, QUEUED, True) == pytest.approx(
        prefill_exposure(DECODES, 0.4)
    )
    # Not measured: every decode is exposed, at every count.
    assert prefill_exposure_at(None, MEASURED_AT, 12, 0.3, 0.5, QUEUED, True) == 1.0


def test_a_balancing_router_spares_decodes_faster_than_the_fleet_grows() -> None:
    # Over batches below one a prompt delays decodes only when no replica is free:
    # more replicas, fewer such moments. Held at their measured value, the decodes
    # per prefill pass (0.14) were the same at every count, so the predicted ITL
    # hardly moved with the fleet.
    at = {n: carried(n) for n in (4, 6, 8, 12, 16)}
    assert at[6] == pytest.approx(DECODES)
    assert at[4] > at[6] > at[8] > at[12] > at[16] >= 0.0
    # Steeper than an even split of the same decodes (a 1/n share of them).
    assert at[12] / at[6] < 0.5 * 6 / 12
    assert at[8] / at[6] < 6 / 8


def test_prefill_passes_beyond_both_router_models_do_not_grow_the_exposure_with_the_fleet() -> None:
    # Bursty code measured on 12 replicas: 0.16 decodes each over time, but its
    # prompts arrive in bursts that fill every replica, so a prefill pass carries
    # 1.77 decodes, beyond what either router model puts at the pick. A burst of R
    # requests over n replicas puts R / n beside a prefill: the excess falls with
    # the fleet as the batch does. Carried as a constant number of decodes, it made
    # the exposure grow with the fleet (5.8 on 14 replicas, 25.7 on 64) and the
    # planner ask for 21 replicas where 15 served.
    n0, fleet_batch, fleet_busy, decodes, queued = 12, 12 * 0.16, 12 * 0.3, 1.77, 0.1

    def exposure(n: int) -> float:
        batch, busy = fleet_batch / n, min(fleet_busy / n, 1.0)
        return prefill_exposure_at(decodes, n0, n, batch, busy, queued, True)

    high0 = balanced_pick_decodes(n0, fleet_batch / n0, fleet_busy / n0, queued)
    assert decodes > high0  # beyond the balanced model at the measured count
    counts = (8, 12, 16, 21, 32, 64)
    at = {n: exposure(n) for n in counts}
    assert at[12] == pytest.approx(prefill_exposure(decodes, fleet_batch / n0))
    for fewer, more in zip(counts, counts[1:], strict=False):
        assert at[more] <= at[fewer] * (1.0 + 1e-9)
    assert at[64] > 0.0
    # The decodes beside a prefill fall at least as fast as an even split's.
    for n in (16, 21, 32, 64):
        assert at[n] * fleet_batch / n <= decodes * n0 / n + 1e-9


def test_a_fleet_that_was_behind_carries_only_the_router_models() -> None:
    # A burst's onset on 9 replicas: prompts waited (1.5 per replica on average) and
    # the prefill passes ran beside a backlog, 184 decodes, 8x the batch over the
    # window. A fleet that keeps up holds no such backlog: carried to 17 replicas as
    # an excess, it put the burst's need at 17 where 8-10 served.
    fleet_batch, fleet_busy, queued, decodes = 17 * 12.0, 17 * 0.29, 2.8, 184.0

    def exposure(n: int, measured_queued: float) -> float:
        batch, busy = fleet_batch / n, min(fleet_busy / n, 1.0)
        return prefill_exposure_at(decodes, 9, n, batch, busy, queued, True, measured_queued)

    # At the measured count the measurement stands, backlog or not.
    assert exposure(9, 1.5) == pytest.approx(prefill_exposure(decodes, fleet_batch / 9))
    assert exposure(9, 1.5) > 7.0
    for n in (12, 17, 24):
        batch, busy = fleet_batch / n, min(fleet_busy / n, 1.0)
        high = balanced_pick_decodes(n, batch, busy, queued) / batch
        assert exposure(n, 1.5) == pytest.approx(high)  # the balanced model's pick
        assert exposure(n, 0.0) > 5.0 * exposure(n, 1.5)  # kept up: the excess carried


def test_a_random_router_keeps_the_measured_exposure_at_every_count() -> None:
    # Its pick is any replica, so a prefill pass carries the same share of the
    # mean batch whatever the count.
    for n in (4, 8, 12):
        batch = FLEET_BATCH / n
        assert carried(n, balanced=False) / batch == pytest.approx(
            prefill_exposure(DECODES, FLEET_BATCH / MEASURED_AT)
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
        prefill_pass_decodes=0.3,
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
    # Measured with the decodes at a prefill pass held at every count, the same decode requests met
    # the same prompts at every count (batches below one).
    held = [beside(replace(base, streams_total=n), n) for n in (8, 16)]
    assert held[1] == pytest.approx(held[0], rel=0.05)
    assert measured[3] < 0.5 * held[1]


def test_the_backlog_at_the_measured_count_is_prompts_waiting_per_serving_replica() -> None:
    # 6 prompts waiting on average over 3 serving streams (of 4: one is missing).
    load = replace(load_of(20.0), streams_missing=1, queued_prefill_requests_mean=6.0)
    per = PerReplicaLoad.from_estimate(load, 8)
    assert per.measured_replicas == 3
    assert per.measured_queued_prompts == pytest.approx(2.0)
