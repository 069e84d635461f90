"""Ground-truth step time of simulated engines: an 8B model on one H100-class GPU.

The default profile is a roofline with a fixed overhead. Where each number comes
from:

* Model, from Meta-Llama-3-8B's published ``config.json`` and model card:
  ``hidden_size`` 4096, ``num_hidden_layers`` 32, ``num_attention_heads`` 32 (head
  dim 4096 / 32 = 128), ``num_key_value_heads`` 8; 8.03e9 parameters, so bf16
  weights take 16.06 GB, read once per pass. K and V in bf16 take
  32 layers * 8 heads * 128 * 2 (K, V) * 2 bytes = 131,072 bytes per token.
* GPU, from NVIDIA's H100 Tensor Core GPU datasheet (SXM form factor): 3.35 TB/s
  of HBM3 bandwidth and 989 TFLOP/s dense BF16 (the datasheet's 1,979 is with
  sparsity).

Assumptions, not measured on a GPU (override them with ``--profile``):

* 85% of the peak bandwidth is achievable (2.85 TB/s);
* 50% model FLOP utilisation for prefill-sized GEMMs (495 TFLOP/s);
* 1 ms per pass of scheduler, sampling and launch overhead, plus 10 us per
  scheduled request (CPU-side batch preparation);
* 3% multiplicative log-normal noise per pass (``--noise-sigma``).

The model built on them:

* Memory time = (weights + KV read for every context token + KV written for new
  prefill tokens) / bandwidth: the ~5.6 ms floor of a decode pass.
* Compute time = 2 * params FLOP per processed token (GEMMs) plus attention,
  4 * layers * d_model * (context) FLOP per query token: a 2048-token prefill
  chunk takes ~67 ms, i.e. ~30k prompt tokens/s.
* A pass takes max(memory, compute) plus the overheads above.

:meth:`StepTimeProfile.predict` is the noise-free mean, so the same object can
stand in for a perfect cost model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ScheduledRequestMetrics


@dataclass(frozen=True)
class StepTimeProfile:
    """Roofline step-time model; defaults are Llama-3-8B (bf16) on one H100 SXM."""

    params: float = 8.03e9
    weight_bytes: float = 16.06e9
    kv_bytes_per_token: float = 131_072.0
    layers: int = 32
    d_model: int = 4096
    hbm_bytes_per_s: float = 3.35e12 * 0.85
    flops_per_s: float = 989e12 * 0.50
    overhead_s: float = 1.0e-3
    per_request_s: float = 10e-6
    noise_sigma: float = 0.03

    def mean_time(
        self,
        prefill_tokens: float,
        prefill_kv_tokens: float,
        num_prefill: float,
        num_decode: float,
        decode_kv_tokens: float,
    ) -> float:
        """Noise-free pass time in seconds for a batch of the given shape."""
        kv_read = decode_kv_tokens + prefill_kv_tokens
        mem = (
            self.weight_bytes + self.kv_bytes_per_token * (kv_read + prefill_tokens)
        ) / self.hbm_bytes_per_s
        # Attention of a prefill chunk: each query token sees the earlier context
        # plus half the chunk on average.
        attn_ctx = prefill_tokens * (prefill_kv_tokens / max(num_prefill, 1.0)) + (
            prefill_tokens * prefill_tokens / (2.0 * max(num_prefill, 1.0))
        )
        flops = 2.0 * self.params * (prefill_tokens + num_decode) + 4.0 * self.layers * (
            self.d_model * (attn_ctx + decode_kv_tokens)
        )
        compute = flops / self.flops_per_s
        return self.overhead_s + self.per_request_s * (num_prefill + num_decode) + max(mem, compute)

    def predict(self, sched: ScheduledRequestMetrics) -> float:
        """Noise-free pass time; makes the profile a perfect ``StepTimePredictor``."""
        return self.mean_time(
            sched.sum_prefill_tokens,
            sched.sum_prefill_kv_tokens,
            sched.num_prefill_requests,
            sched.num_decode_requests,
            sched.sum_decode_kv_tokens,
        )

    def sample(self, mean_s: float, rng: random.Random) -> float:
        """One noisy realisation of a pass whose mean time is ``mean_s``."""
        return mean_s * math.exp(rng.gauss(0.0, self.noise_sigma))

    def decode_run(
        self,
        batch: int,
        first_kv_tokens: float,
        steps: int,
        rng: np.random.Generator,
    ) -> npt.NDArray[np.float64]:
        """Noisy times of ``steps`` consecutive decode-only passes.

        Every pass adds one token to each of the ``batch`` contexts, so the KV
        read grows by ``batch`` per pass; computed in one vectorised shot.
        """
        kv = first_kv_tokens + batch * np.arange(steps, dtype=np.float64)
        mem = (self.weight_bytes + self.kv_bytes_per_token * kv) / self.hbm_bytes_per_s
        compute = (
            2.0 * self.params * batch + 4.0 * self.layers * self.d_model * kv
        ) / self.flops_per_s
        base = self.overhead_s + self.per_request_s * batch + np.maximum(mem, compute)
        return base * np.exp(rng.normal(0.0, self.noise_sigma, steps))


H100_LLAMA_8B = StepTimeProfile()


def profile_with(base: StepTimeProfile, overrides: Mapping[str, object]) -> StepTimeProfile:
    """``base`` with some fields replaced (numbers only); unknown names are an error."""
    known = {f.name for f in fields(StepTimeProfile)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown profile fields {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}  # int or float, by field
    for name, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"profile field {name!r} must be a number, not {value!r}")
        # Rates divide; everything else may be zero (e.g. no noise, no overhead).
        if value < 0 or (value == 0 and name in ("hbm_bytes_per_s", "flops_per_s")):
            raise ValueError(f"profile field {name!r} out of range: {value!r}")
        values[name] = int(value) if name in ("layers", "d_model") else float(value)
    return replace(base, **values)
