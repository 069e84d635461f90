"""The GPU recorder's engine and its recording path, run on the CPU with a tiny model.

``benchmarks/gpu_engine.py`` stands in for vLLM where vLLM cannot be installed (the
lent GPU machine); these tests check that it computes what one unchunked pass would
(so its step times are those of real attention over real context), and that
``record_cuda_steps.py`` records, through the real plugin hook and a real ZMQ
socket, exactly the work the engine did.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.conftest import REPO_ROOT, benchmark_module


def _engine() -> ModuleType:
    return benchmark_module("gpu_engine")


def _generate(
    budget: int,
    use_triton: bool = False,
    padded_decodes: bool = False,
    decoders: list[object] | None = None,
) -> dict[str, list[int]]:
    """Greedy outputs of a fixed set of requests, scheduled under ``budget`` tokens a
    pass (the decoder used is appended to ``decoders``)."""
    engine = _engine()
    decoder = engine.Decoder(engine.TINY, num_slots=4, max_len=256, device="cpu")
    if decoders is not None:
        decoders.append(decoder)
    decoder.use_triton = use_triton
    if padded_decodes:
        decoder.use_decode_graphs(max_batch=4, capture=False)
    scheduler = engine.Scheduler(budget, max_num_seqs=4, max_len=256)
    executor = engine.Executor(decoder, clock=lambda: 0.0)
    rng = random.Random(3)
    requests = [
        engine.Request(f"r{i}", [rng.randrange(256) for _ in range(length)], out)
        for i, (length, out) in enumerate([(70, 16), (5, 24), (130, 8), (33, 20), (90, 12)])
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.requests:
        output = scheduler.schedule()
        executor.execute_model(output)
        scheduler.update_from_output(output, executor.sample_tokens(None))
    return {r.request_id: r.output_token_ids for r in requests}


def test_chunked_prefill_and_decode_compute_what_one_pass_would() -> None:
    # A budget of 512 takes every prompt whole; 16 cuts them into chunks that attend
    # to the cached context (lower-right causal), mixed with other requests' decodes.
    whole = _generate(budget=512)
    assert [len(v) for v in whole.values()] == [16, 24, 8, 20, 12]
    assert _generate(budget=16) == whole


def test_a_chunk_that_does_not_end_its_prompt_is_sampled_and_discarded() -> None:
    # As vLLM does: a pass always samples, so its output waits for the whole pass.
    engine = _engine()
    scheduler = engine.Scheduler(16, max_num_seqs=4, max_len=256)
    scheduler.add_request(engine.Request("long", list(range(40)), 4))
    output = scheduler.schedule()
    plan = engine.plan_pass(output)
    assert plan.sample_rows == [15] and plan.sampled_for == [None]
    decoder = engine.Decoder(engine.TINY, num_slots=4, max_len=256, device="cpu")
    executor = engine.Executor(decoder, clock=lambda: 0.0)
    executor.execute_model(output)
    assert executor.sample_tokens(None) == {}


def test_padded_decode_batches_compute_what_unpadded_ones_do() -> None:
    # The static, padded inputs that CUDA graphs replay (captured sizes 1, 2, 4 here:
    # a batch of 3 runs padded to 4, its padding in the spare slot), run eagerly.
    engine = _engine()
    assert engine.capture_sizes(4) == [1, 2, 4]
    assert engine.capture_sizes(96)[-3:] == [80, 88, 96]
    decoders: list[object] = []
    assert _generate(budget=16, padded_decodes=True, decoders=decoders) == _generate(budget=16)
    graphs = decoders[0].graphs  # type: ignore[attr-defined]
    assert graphs.replays > 10 and graphs.padded_replays > 0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_the_triton_decode_kernel_matches_sdpa() -> None:
    # Triton's interpreter runs the GPU kernel on the CPU; it is chosen when Triton is
    # imported, hence a fresh process. vLLM's CPU install brings Triton (through
    # xgrammar), so CI runs this; on the GPU machine the recorder runs it compiled.
    code = (
        "from tests.unit.test_gpu_engine import _generate;"
        "assert _generate(budget=64, use_triton=True) == _generate(budget=64)"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0


def _split_kernel_error(splits: int) -> float:
    """Largest difference between the Triton decode kernel in ``splits`` parts and the
    per-request SDPA reference, on contexts of 1 to 300 tokens (run under the interpreter)."""
    engine = _engine()
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, slots, max_len = 4, 2, 16, 6, 320
    cache_k = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen)
    cache_v = torch.randn(slots, kv_heads, max_len, head_dim, generator=gen)
    lengths = torch.tensor([1, 63, 64, 65, 300], dtype=torch.int32)
    slot_ids = torch.tensor([4, 0, 2, 1, 5], dtype=torch.int32)
    q = torch.randn(5, heads, head_dim, generator=gen)
    want, got = torch.empty_like(q), torch.empty_like(q)
    engine.decode_attention(q, cache_k, cache_v, slot_ids, lengths, want, use_triton=False)
    engine.decode_attention(q, cache_k, cache_v, slot_ids, lengths, got, True, splits)
    return float((want - got).abs().max())


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton not installed")
def test_a_context_split_over_programs_combines_to_the_whole_softmax() -> None:
    # Splits of 64-token blocks: one split, splits that each hold part of the longest
    # context, and more splits than any context has blocks (empty ones must weigh 0).
    code = (
        "from tests.unit.test_gpu_engine import _split_kernel_error;"
        "errors = [_split_kernel_error(s) for s in (1, 3, 16)];"
        "print(errors); assert max(errors) < 1e-4, errors"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0


def test_small_decode_batches_split_their_contexts_over_the_sms() -> None:
    engine = _engine()
    assert engine.decode_splits(requests=1, heads=32, sm_count=132) == 9
    assert engine.decode_splits(requests=4, heads=32, sm_count=132) == 3
    assert engine.decode_splits(requests=16, heads=32, sm_count=132) == 1
    assert engine.decode_splits(requests=1, heads=4, sm_count=132) == engine.MAX_DECODE_SPLITS


def test_the_recorder_records_every_pass_the_engine_ran(tmp_path: Path) -> None:
    recorder = benchmark_module("record_cuda_steps")
    meta = recorder.record(
        "tiny", tmp_path, phase_s=1.0, seed=1, phases=("short", "long"), device="cpu"
    )
    assert meta["finished"] == meta["requests"] > 0
    assert meta["messages"] == meta["passes"] > 0
    assert meta["malformed"] == meta["hook_errors"] == meta["publisher_dropped"] == 0
    with gzip.open(tmp_path / "cuda_tiny.jsonl.gz") as fh:
        messages = [json.loads(line) for line in fh]
    passes = [m for m in messages if m["wall_time"] > 0]
    assert len(passes) == meta["passes"]
    # Every prompt token was prefilled once, and every output token after the first
    # (sampled by the last prefill chunk) took one decode.
    arrivals = recorder._arrivals(
        random.Random(1), ("short", "long"), 1.0, recorder.CONFIGS["tiny"]["load"],
        256, recorder.CONFIGS["tiny"]["max_len"],
    )
    prompts = sum(r.num_prompt_tokens for _, r in arrivals)
    outputs = sum(r.max_tokens for _, r in arrivals)
    scheduled = [p["scheduled_requests"] for p in passes]
    assert sum(s["sum_prefill_tokens"] for s in scheduled) == prompts
    assert sum(s["num_decode_requests"] for s in scheduled) == outputs - len(arrivals)
    timing = json.loads((tmp_path / "cuda_tiny.timing.json").read_text())
    assert timing["paired"] and timing["scopes"] == {"model_step_host": meta["passes"]}
    # Host timing on the CPU: the plugin's wall time is the executor's own, within the
    # few microseconds between the two clock reads.
    assert timing["wall_over_host"]["p50"] == pytest.approx(1.0, abs=0.05)
