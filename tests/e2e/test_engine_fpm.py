"""End-to-end: a real vLLM V1 CPU engine with the plugin enabled by environment only.

Every check compares the received FPM stream with something measured
independently inside the engine process (see ``engine_scenario.py``).
"""

from __future__ import annotations

import statistics

from tests.e2e.conftest import ScenarioRun


def assert_stream_is_whole(run: ScenarioRun, worker_id: str) -> None:
    counters = [m.counter_id for m in run.messages]
    assert counters == list(range(counters[0], counters[0] + len(counters))), "sequence gap"
    assert {m.worker_id for m in run.messages} == {worker_id}
    assert {m.dp_rank for m in run.messages} == {0}
    # Heartbeats once idle (the scenario idles 2.5 s after its last request).
    tail = run.messages[-2:]
    assert all(m.is_heartbeat for m in tail)


def test_plain_batch_accounts_for_every_token(scenario_runs: dict[str, ScenarioRun]) -> None:
    run = scenario_runs["plain"]
    measured = run.measured
    assert_stream_is_whole(run, "e2e-plain")
    prompts, generated = measured["prompt_tokens"], measured["generated_tokens"]
    sched = [m.scheduled_requests for m in run.passes]
    # No prefix cache, no preemption: each prompt token is computed once, as prefill.
    assert sum(s.sum_prefill_tokens for s in sched) == sum(prompts)
    # The first token of each request comes from its prefill pass; the rest from decodes.
    assert sum(s.num_decode_requests for s in sched) == sum(generated) - len(generated)
    # One message per forward pass, in order, and nothing for empty iterations.
    assert len(run.passes) == len(measured["forward_s"])
    assert {m.timing_scope for m in run.passes} == {"model_step_host"}


def test_wall_time_agrees_with_the_workers_own_timing(
    scenario_runs: dict[str, ScenarioRun],
) -> None:
    run = scenario_runs["plain"]
    forward = run.measured["forward_s"]
    walls = [m.wall_time for m in run.passes]
    assert len(walls) == len(forward)
    # The plugin's interval encloses the worker's execute+sample calls...
    assert all(w >= f for w, f in zip(walls, forward, strict=True))
    # ...and adds only the executor's dispatch around them.
    excess = [(w - f) / f for w, f in zip(walls, forward, strict=True)]
    assert statistics.median(excess) < 0.25


def test_first_pass_sees_the_rest_queued(scenario_runs: dict[str, ScenarioRun]) -> None:
    run = scenario_runs["plain"]
    first = run.passes[0]
    n_requests = len(run.measured["prompt_tokens"])
    assert first.queued_requests.num_prefill_requests > 0
    assert (
        first.scheduled_requests.num_prefill_requests + first.queued_requests.num_prefill_requests
        == n_requests
    )
    assert run.passes[-1].queued_requests.num_prefill_requests == 0


def test_chunked_prefill_and_preemption(scenario_runs: dict[str, ScenarioRun]) -> None:
    run = scenario_runs["chunked_preempt"]
    measured = run.measured
    assert_stream_is_whole(run, "e2e-chunked_preempt")
    prompts, generated = measured["prompt_tokens"], measured["generated_tokens"]
    preemptions = measured["preemptions"]
    sched = [m.scheduled_requests for m in run.passes]
    assert preemptions, "the scenario must force preemption"
    # Chunk continuations report the earlier chunks as KV (no prefix cache here).
    assert any(s.sum_prefill_kv_tokens > 0 for s in sched)
    # Preempted requests wait as queued decode with their whole context.
    assert any(m.queued_requests.num_decode_requests > 0 for m in run.passes)
    # Every token position is computed once, plus whatever preemption threw away.
    recomputed = sum(p["num_computed_tokens"] for p in preemptions)
    total = sum(s.sum_prefill_tokens + s.num_decode_requests for s in sched)
    assert total == sum(prompts) + sum(generated) - len(generated) + recomputed
    # A resumed request recomputes its context as prefill, not as a zero-context decode.
    decodes = sum(s.num_decode_requests for s in sched)
    normal_decodes = sum(generated) - len(generated)
    resumed_with_output = sum(1 for p in preemptions if p["num_output_tokens"] > 0)
    assert normal_decodes - resumed_with_output <= decodes <= normal_decodes
    assert sum(s.sum_prefill_tokens for s in sched) > sum(prompts)


def test_prefix_cache_hits_are_prefill_kv_not_computed(
    scenario_runs: dict[str, ScenarioRun],
) -> None:
    run = scenario_runs["prefix"]
    measured = run.measured
    assert_stream_is_whole(run, "e2e-prefix")
    sched = [m.scheduled_requests for m in run.passes]
    cached = sum(measured["cached_tokens"])
    assert cached > 0, "shared prefixes must hit the prefix cache"
    assert sum(s.sum_prefill_tokens for s in sched) == sum(measured["prompt_tokens"]) - cached
    assert sum(s.sum_prefill_kv_tokens for s in sched) >= cached
