"""Batch composition of one forward pass, from vLLM V1's ``SchedulerOutput``.

Pure: reads duck-typed objects (a real ``SchedulerOutput`` or a test double) and
never imports vLLM. Classification follows ``docs/fpm-wire-v1.md``:

* prefill: newly scheduled requests; cached requests still in their context
  phase (chunked-prefill continuations, no output token yet); and any request
  that computes more than one token this step beyond its speculative tokens (a
  request resuming after preemption recomputes its whole context: counting it as
  a zero-context decode would hide up to a full token budget of work).
* decode: everything else scheduled.

``SchedulerOutput`` records each request's ``num_computed_tokens`` before the
step (vLLM advances the request's own counter right after scheduling), so the
tokens already in the KV cache are read from the output, never from the
request.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from stepscale_engine.wire import ScheduledRequestMetrics


def population_variance(total: float, total_sq: float, count: int) -> float:
    """Population variance from a count, a sum and a sum of squares (never negative)."""
    if count <= 1:
        return 0.0
    mean = total / count
    return max(0.0, total_sq / count - mean * mean)


def scheduled_metrics(
    scheduler_output: Any, requests: Mapping[str, Any] | None = None
) -> ScheduledRequestMetrics:
    """Composition of the batch in ``scheduler_output``.

    ``requests`` maps request id to vLLM ``Request`` (the scheduler's
    ``requests`` dict); it is consulted only for prefill requests whose full
    length the output does not carry (cached continuations, resumed requests).
    Cost is O(scheduled requests); nothing here depends on the waiting queue.
    """
    num_scheduled: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    spec_tokens: Mapping[str, Sequence[int]] = scheduler_output.scheduled_spec_decode_tokens

    n_prefill = 0
    prefill_tokens = 0
    prefill_kv = 0
    prefill_len_sum = 0.0
    prefill_len_sq = 0.0

    for new in scheduler_output.scheduled_new_reqs:
        rid = new.req_id
        chunk = num_scheduled.get(rid, 0)
        if spec_tokens:
            chunk -= len(spec_tokens.get(rid, ()))
        prompt = new.prompt_token_ids
        if prompt is not None:
            full = len(prompt)
        else:  # prompt embeddings: the request knows its length
            full = _full_length(rid, requests, new.num_computed_tokens + chunk)
        n_prefill += 1
        prefill_tokens += chunk
        prefill_kv += new.num_computed_tokens
        prefill_len_sum += full
        prefill_len_sq += full * full

    cached = scheduler_output.scheduled_cached_reqs
    computed_list: Sequence[int] = cached.num_computed_tokens
    # Fast path for the common pure-decode batch: every scheduled request takes
    # at least one token, so if the cached requests' tokens add up to their
    # count, each computes exactly one; with none in its context phase they are
    # all decodes, and the sums are C-level reductions over vLLM's own lists.
    if (
        not spec_tokens
        and scheduler_output.total_num_scheduled_tokens - prefill_tokens == len(computed_list)
        and 0 not in cached.num_output_tokens
    ):
        n_decode = len(computed_list)
        decode_kv = sum(computed_list)
        decode_kv_sq = sum(map(operator.mul, computed_list, computed_list))
        return _metrics(
            n_prefill, prefill_tokens, prefill_len_sum, prefill_len_sq, prefill_kv,
            n_decode, decode_kv, decode_kv_sq,
        )

    n_decode = 0
    decode_kv = 0
    decode_kv_sq = 0
    for rid, computed, n_out in zip(
        cached.req_ids, cached.num_computed_tokens, cached.num_output_tokens, strict=False
    ):
        step_tokens = num_scheduled.get(rid, 0)
        if spec_tokens:
            step_tokens -= len(spec_tokens.get(rid, ()))
        if n_out == 0 or step_tokens > 1:
            full = _full_length(rid, requests, computed + step_tokens)
            n_prefill += 1
            prefill_tokens += step_tokens
            prefill_kv += computed
            prefill_len_sum += full
            prefill_len_sq += full * full
        else:
            n_decode += 1
            decode_kv += computed
            decode_kv_sq += computed * computed

    return _metrics(
        n_prefill, prefill_tokens, prefill_len_sum, prefill_len_sq, prefill_kv,
        n_decode, decode_kv, decode_kv_sq,
    )


def _metrics(
    n_prefill: int,
    prefill_tokens: int,
    prefill_len_sum: float,
    prefill_len_sq: float,
    prefill_kv: int,
    n_decode: int,
    decode_kv: int,
    decode_kv_sq: int,
) -> ScheduledRequestMetrics:
    return ScheduledRequestMetrics(
        num_prefill_requests=n_prefill,
        sum_prefill_tokens=prefill_tokens,
        var_prefill_length=population_variance(prefill_len_sum, prefill_len_sq, n_prefill),
        sum_prefill_kv_tokens=prefill_kv,
        num_decode_requests=n_decode,
        sum_decode_kv_tokens=decode_kv,
        var_decode_kv_tokens=population_variance(decode_kv, decode_kv_sq, n_decode),
    )


def _full_length(rid: str, requests: Mapping[str, Any] | None, fallback: int) -> int:
    """Full context a prefill request must hold: prompt plus any tokens already generated."""
    if requests is not None:
        req = requests.get(rid)
        if req is not None:
            return int(req.num_tokens)
    return fallback
