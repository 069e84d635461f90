"""DeploymentModel: one deployment's streams, cost model and load, fed by message batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics, heartbeat
from stepscale_operator.cost_model import CostModel
from stepscale_operator.fpm_pipeline import DeploymentModel, MessageBatch, PassMatrices
from stepscale_operator.pass_columns import COL_WALL


def _pass(worker: str, counter: int, n_dec: int, rank: int = 0) -> ForwardPassMetrics:
    sched = ScheduledRequestMetrics(num_decode_requests=n_dec, sum_decode_kv_tokens=n_dec * 100)
    # Ground truth: 2 ms + 0.1 ms per decode request.
    return ForwardPassMetrics(
        worker_id=worker,
        dp_rank=rank,
        counter_id=counter,
        wall_time=0.002 + 1e-4 * n_dec,
        scheduled_requests=sched,
    )


def test_ingest_feeds_streams_model_and_load() -> None:
    rng = np.random.default_rng(0)
    dm = DeploymentModel("d", cost_model=CostModel(warmup_passes=5, min_samples=50))
    msgs = [_pass(f"pod-{i % 2}", i // 2, int(rng.integers(1, 64))) for i in range(2000)]
    for i in range(0, 2000, 100):
        result = dm.ingest(msgs[i : i + 100], now=i / 100)
        assert result.passes == 100
    assert dm.cost_model.samples == 2000 - 2 * 5  # warm-up per stream
    probe = ScheduledRequestMetrics(num_decode_requests=32, sum_decode_kv_tokens=3200)
    assert dm.cost_model.predict(probe) == pytest.approx(0.0052, rel=0.02)
    load = dm.estimate(now=19.5)
    assert load.streams_total == 2 and load.complete
    assert load.decode_tokens_per_s > 0
    assert dm.streams.health(19.5)["passes"] == 2000


def test_heartbeats_are_liveness_not_samples_and_restart_rewarms() -> None:
    dm = DeploymentModel(cost_model=CostModel(warmup_passes=3, min_samples=1))
    dm.ingest([_pass("a", c, 4) for c in range(10)], now=0.0)
    assert dm.cost_model.samples == 7
    dm.ingest([heartbeat("a", 0, 10), heartbeat("a", 0, 11)], now=1.0)
    assert dm.cost_model.samples == 7
    assert dm.cost_model.heartbeats_ignored == 2
    result = dm.ingest([_pass("a", c, 4) for c in range(0, 5)], now=2.0)  # engine restarted
    assert result.restarted == (("a", 0),)
    assert dm.cost_model.samples == 7 + 2  # three warm-up passes again
    assert dm.estimate(now=2.5).complete


def test_missing_stream_makes_estimate_incomplete() -> None:
    dm = DeploymentModel()
    dm.add_stream(("expected", 0))
    dm.ingest([_pass("a", 0, 4)], now=0.0)
    load = dm.estimate(now=0.5)
    assert load.streams_missing == 1 and not load.complete
    dm.remove_stream(("expected", 0))
    assert dm.estimate(now=0.5).complete


def test_ingest_learns_from_the_batch_columns_not_the_structs() -> None:
    msgs = [_pass("a", c, 1 + c % 31) for c in range(300)]
    carried = PassMatrices.from_messages(msgs)
    # Columns that differ from the messages: every pass twice as slow. Learning from
    # them (not from columns rebuilt out of the structs) doubles the model's predictions.
    carried.numeric[:, COL_WALL] *= 2.0
    built = 0

    def structs() -> list[ForwardPassMetrics]:
        nonlocal built
        built += 1
        return msgs

    batch = MessageBatch(carried, structs)
    dm = DeploymentModel(cost_model=CostModel(warmup_passes=0, min_samples=1))
    dm.ingest(batch, now=0.0)
    probe = ScheduledRequestMetrics(num_decode_requests=16, sum_decode_kv_tokens=1600)
    assert dm.cost_model.predict(probe) == pytest.approx(2 * (0.002 + 16e-4), rel=0.02)
    assert built == 0  # ingest never asked for the structs
    assert len(batch) == 300 and batch[5] is msgs[5] and built == 1
    assert list(batch) == msgs and built == 1  # built once, then kept
    # A batch made of structs carries their columns.
    plain = DeploymentModel(cost_model=CostModel(warmup_passes=0, min_samples=1))
    plain.ingest(MessageBatch.of(msgs), now=0.0)
    assert plain.cost_model.samples == 300
    assert plain.cost_model.predict(probe) == pytest.approx(0.002 + 16e-4, rel=0.02)


def test_duplicates_are_learned_once() -> None:
    msgs = [_pass("a", c, 8) for c in range(100)]
    once = DeploymentModel(cost_model=CostModel(warmup_passes=0, min_samples=1))
    twice = DeploymentModel(cost_model=CostModel(warmup_passes=0, min_samples=1))
    once.ingest(msgs, now=0.0)
    replayed = [m for m in msgs for _ in range(2)]  # every message twice
    result = twice.ingest(replayed[:100], now=0.0)
    result2 = twice.ingest(replayed[99:], now=0.0)  # one duplicate straddles the batches
    assert (result.messages, result2.messages) == (50, 50)
    assert twice.streams.health(0.5)["duplicates"] == 101  # 201 messages, 100 passes
    assert twice.cost_model.samples == once.cost_model.samples == 100
    assert twice.estimate(0.5).decode_tokens_per_s == once.estimate(0.5).decode_tokens_per_s


def _mixed_pass(counter: int) -> ForwardPassMetrics:
    """A pass with prompt tokens every third time, so both regimes are learned."""
    n_dec = 1 + counter % 7
    prompt = 128 if counter % 3 == 0 else 0
    sched = ScheduledRequestMetrics(
        num_prefill_requests=1 if prompt else 0,
        sum_prefill_tokens=prompt,
        num_decode_requests=n_dec,
        sum_decode_kv_tokens=n_dec * 100,
    )
    wall = 0.002 + 1e-4 * n_dec + 2e-5 * prompt
    return ForwardPassMetrics(
        worker_id="a", counter_id=counter, wall_time=wall, scheduled_requests=sched
    )


def test_status_is_json_able() -> None:
    dm = DeploymentModel("d", cost_model=CostModel(warmup_passes=0, min_samples=5))
    dm.ingest([_mixed_pass(c) for c in range(50)], now=0.0)
    status = json.loads(json.dumps(dm.status(now=0.5)))
    assert status["name"] == "d"
    assert status["cost_model"]["ready"]
    assert "a/0" in status["stream_residuals"]
    assert status["load"]["complete"]
    assert status["load"]["missing_streams"] == []


def test_status_without_fresh_streams_shows_unknown_load_not_zero() -> None:
    dm = DeploymentModel("d")
    dm.add_stream(("pod-b", 0))
    dm.ingest([_pass("a", c, 4) for c in range(10)], now=0.0)
    load = json.loads(json.dumps(dm.status(now=100.0)))["load"]  # everything went silent
    assert load["complete"] is False
    assert load["missing_streams"] == ["a/0", "pod-b/0"]
    assert load["decode_tokens_per_s"] is None and load["queued_decode_requests"] is None
    assert load["mean_decode_context_tokens"] is None and load["busy_fraction"] is None
