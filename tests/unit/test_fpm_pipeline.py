"""DeploymentModel: one deployment's streams, cost model and load, fed by message batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stepscale_engine.wire import ForwardPassMetrics, ScheduledRequestMetrics, heartbeat
from stepscale_operator.cost_model import CostModel
from stepscale_operator.fpm_pipeline import DeploymentModel, MessageBatch, PassMatrices


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


def test_reuses_columns_carried_by_the_batch() -> None:
    msgs = [_pass("a", c, 4) for c in range(30)]
    batch = MessageBatch(msgs)
    batch.matrices = PassMatrices.from_messages(msgs)
    dm = DeploymentModel(cost_model=CostModel(warmup_passes=0, min_samples=1))
    dm.ingest(batch, now=0.0)
    np.testing.assert_array_equal(batch.matrices.counters, np.arange(30))
    assert dm.cost_model.samples == 30


def test_status_is_json_able() -> None:
    dm = DeploymentModel("d", cost_model=CostModel(warmup_passes=0, min_samples=5))
    dm.ingest([_pass("a", c, 1 + c % 7) for c in range(50)], now=0.0)
    status = json.loads(json.dumps(dm.status(now=0.5)))
    assert status["name"] == "d"
    assert status["cost_model"]["ready"]
    assert "a/0" in status["stream_residuals"]
    assert status["load"]["complete"]
