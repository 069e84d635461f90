"""Column layout of FPM batches, defined once for every consumer.

Ingest turns each batch of messages into one float matrix
(:class:`~stepscale_operator.fpm_pipeline.PassMatrices`): four header columns,
then the ScheduledRequestMetrics fields, then the QueuedRequestMetrics fields,
each in the wire structs' declaration order. The cost model, the load estimator
and the plausibility checks read the ``sched``/``queued`` sub-matrices with the
indices below.
"""

from __future__ import annotations

from stepscale_engine.wire import QueuedRequestMetrics, ScheduledRequestMetrics

SCHED_FIELDS: tuple[str, ...] = tuple(ScheduledRequestMetrics.__struct_fields__)
QUEUED_FIELDS: tuple[str, ...] = tuple(QueuedRequestMetrics.__struct_fields__)

# Columns of a sched matrix (n, len(SCHED_FIELDS)).
SCHED_PREFILL_REQS = SCHED_FIELDS.index("num_prefill_requests")
SCHED_PREFILL_TOKENS = SCHED_FIELDS.index("sum_prefill_tokens")
SCHED_PREFILL_VAR = SCHED_FIELDS.index("var_prefill_length")
SCHED_PREFILL_KV = SCHED_FIELDS.index("sum_prefill_kv_tokens")
SCHED_DECODE_REQS = SCHED_FIELDS.index("num_decode_requests")
SCHED_DECODE_KV = SCHED_FIELDS.index("sum_decode_kv_tokens")

# Columns of a queued matrix (n, len(QUEUED_FIELDS)).
QUEUED_PREFILL_REQS = QUEUED_FIELDS.index("num_prefill_requests")
QUEUED_PREFILL_TOKENS = QUEUED_FIELDS.index("sum_prefill_tokens")
QUEUED_DECODE_REQS = QUEUED_FIELDS.index("num_decode_requests")
QUEUED_DECODE_KV = QUEUED_FIELDS.index("sum_decode_kv_tokens")

# Columns of PassMatrices.numeric: version, dp_rank, counter_id, wall_time, sched, queued.
COL_VERSION, COL_DP_RANK, COL_COUNTER, COL_WALL = 0, 1, 2, 3
COL_SCHED = 4
COL_QUEUED = COL_SCHED + len(SCHED_FIELDS)
N_NUMERIC = COL_QUEUED + len(QUEUED_FIELDS)
