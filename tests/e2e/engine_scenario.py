"""Runs one workload on a real vLLM CPU engine with the Stepscale plugin enabled by env.

Started as a subprocess by the end-to-end tests (one engine per process: vLLM
loads plugins once per process). The plugin is configured only through the
environment the test passes (``STEPSCALE_FPM_PORT`` ...). The script also takes
independent measurements the test compares the FPM stream against:

* the worker's own ``execute_model`` + ``sample_tokens`` duration per pass
  (inside the executor, so the plugin's ``wall_time`` must contain it);
* every preemption (request id, tokens it must recompute), recorded by wrapping
  the scheduler's ``_preempt_request``;
* per-request prompt and generated token counts from the outputs.

Protocol: prints ``READY`` once the engine is built, waits for a line on stdin
(the test has seen a heartbeat by then), runs, idles 2.5 s so heartbeats flow,
writes the measurements to ``--out`` as JSON and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

SCENARIOS: dict[str, dict[str, Any]] = {
    # Enough KV and budget: every prompt in one chunk, no preemption.
    "plain": dict(
        engine=dict(max_num_batched_tokens=2048, max_num_seqs=32, enable_prefix_caching=False),
        prompts=[(40 + 23 * i, 24 + (i % 5) * 4) for i in range(16)],
    ),
    # Small token budget and few KV blocks: chunked prefill and preemption.
    "chunked_preempt": dict(
        engine=dict(
            max_num_batched_tokens=128,
            max_num_seqs=16,
            num_gpu_blocks_override=20,
            enable_prefix_caching=False,
            max_model_len=512,
        ),
        prompts=[(60 + 33 * i, 48) for i in range(12)],
    ),
    # Shared prefixes with prefix caching on: cache hits show as prefill KV tokens.
    "prefix": dict(
        engine=dict(max_num_batched_tokens=1024, max_num_seqs=16, enable_prefix_caching=True),
        prompts=[(64 + 32 * i, 8) for i in range(10)],
    ),
}


def prompt_tokens(length: int, index: int, shared_prefix: bool) -> list[int]:
    """Token ids for one prompt; distinct per request unless sharing a prefix."""
    if shared_prefix:
        return [1 + (t % 900) for t in range(length)]
    return [1 + ((t * 7 + index * 131) % 900) for t in range(length)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    scenario = SCENARIOS[args.scenario]

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        seed=0,
        **{"max_model_len": 1024, **scenario["engine"]},
    )
    engine_core = llm.llm_engine.engine_core.engine_core
    worker = engine_core.model_executor.driver_worker.worker
    forward_s: list[float] = []
    started: list[float] = []
    original_execute, original_sample = worker.execute_model, worker.sample_tokens

    def timed_execute(scheduler_output: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens > 0:
            started.append(time.perf_counter())
        return original_execute(scheduler_output)

    def timed_sample(grammar_output: Any) -> Any:
        result = original_sample(grammar_output)
        if started:
            forward_s.append(time.perf_counter() - started.pop())
        return result

    worker.execute_model, worker.sample_tokens = timed_execute, timed_sample

    preemptions: list[dict[str, int | str]] = []
    scheduler = engine_core.scheduler
    original_preempt = scheduler._preempt_request

    def recording_preempt(request: Any, *a: Any, **kw: Any) -> Any:
        preemptions.append(
            {
                "request_id": request.request_id,
                "num_tokens": int(request.num_tokens),
                "num_computed_tokens": int(request.num_computed_tokens),
                "num_output_tokens": int(request.num_output_tokens),
            }
        )
        return original_preempt(request, *a, **kw)

    scheduler._preempt_request = recording_preempt

    print("READY", flush=True)
    sys.stdin.readline()

    shared = bool(scenario["engine"].get("enable_prefix_caching"))
    prompts = [
        {"prompt_token_ids": prompt_tokens(length, i, shared)}
        for i, (length, _) in enumerate(scenario["prompts"])
    ]
    params = [
        SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
        for _, out in scenario["prompts"]
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    time.sleep(2.5)

    with open(args.out, "w") as fh:
        json.dump(
            {
                "prompt_tokens": [len(p["prompt_token_ids"]) for p in prompts],
                "generated_tokens": [len(o.outputs[0].token_ids) for o in outputs],
                "cached_tokens": [int(o.num_cached_tokens or 0) for o in outputs],
                "forward_s": forward_s,
                "preemptions": preemptions,
            },
            fh,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
