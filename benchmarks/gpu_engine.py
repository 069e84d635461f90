"""A small continuous-batching engine, shaped like vLLM V1, for recording real GPU step times.

vLLM cannot be installed on the lent GPU machine (nothing can be fetched there and
its wheels are far over what may be carried), so ``record_cuda_steps.py`` drives
this engine instead and installs the real plugin on it. What it shares with vLLM
is what the plugin and the cost model see:

* a scheduler with a ``waiting`` queue, a ``requests`` dict and the two methods the
  hook wraps (``schedule``, ``update_from_output``); ``schedule`` returns an
  object with ``SchedulerOutput``'s fields (new and cached request data,
  ``num_scheduled_tokens``), decodes first, then chunked prefill under a token
  budget, like vLLM V1's default scheduler;
* an executor with ``execute_model`` (the forward pass, enqueued) and
  ``sample_tokens`` (greedy sampling, output copied to the host);
* a Llama-shaped decoder in bf16 with random weights: one packed batch of all
  scheduled tokens through fused QKV and gate-up projections, rotary positions,
  a KV cache of one fixed-length slot per running request, prefill attention by
  PyTorch's SDPA (lower-right causal over the cached context) and decode
  attention by a Triton kernel that reads each request's own context only,
  split over the SMs for small batches as vLLM's FlashAttention decode does
  (:func:`decode_splits`), so a pass's cost follows its tokens, its decode
  batch and its KV depth as in vLLM's paged attention.

Decode-only passes can be replayed from CUDA graphs, one per batch size, padded
up to the next captured size (:class:`DecodeGraphs`, vLLM's default); otherwise
every pass runs eagerly, like vLLM with ``enforce_eager``. Not modelled: prefix
caching, preemption (a request is admitted only when a slot is free). On a
CPU-only machine the same engine runs a tiny model with per-request SDPA decode
attention, which is how the tests run it.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional

# -- model -----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped decoder; weights are random (no download)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 32_000

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Number of weights (embedding and head included)."""
        d = self.head_dim
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


# Llama-3-70B's layer shape, 16 of its 80 layers: GPU-bound decode passes.
WIDE = ModelShape(hidden=8192, intermediate=28672, layers=16, heads=64, kv_heads=8)
# Llama-3-8B's shape: eager kernel launches are a visible share of a decode pass.
EIGHT_B = ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8)
# For CPU tests.
TINY = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)


def _decode_attention_kernel() -> Any:
    """The Triton decode-attention kernel (built on first use: Triton is only on GPU images)."""
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, part_o_ptr, part_ml_ptr, slots_ptr, lens_ptr, scale,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_kl, stride_ot, stride_oh,
        group: tl.constexpr, head_dim: tl.constexpr, block: tl.constexpr,
        splits: tl.constexpr,
    ):
        # One program per (decode request, query head, split of its context): online
        # softmax over that split, block cached tokens at a time. With one split the
        # result is normalised into ``o``; with more, each split's unnormalised sum,
        # maximum and denominator go to the partial buffers for the combine.
        t = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        slot = tl.load(slots_ptr + t)
        length = tl.load(lens_ptr + t)
        span = tl.cdiv(tl.cdiv(length, splits), block) * block
        lo = s * span
        hi = tl.minimum(lo + span, length)
        kv_head = h // group
        d = tl.arange(0, head_dim)
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d).to(tl.float32) * scale
        base = slot.to(tl.int64) * stride_ks + kv_head * stride_kh
        m_i = tl.full([1], -1.0e30, tl.float32)
        l_i = tl.zeros([1], tl.float32)
        acc = tl.zeros([head_dim], tl.float32)
        for start in range(lo, hi, block):
            offs = start + tl.arange(0, block)
            valid = offs < hi
            ptrs = base + offs[:, None] * stride_kl + d[None, :]
            k = tl.load(k_ptr + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            s_qk = tl.sum(k * q[None, :], 1)
            s_qk = tl.where(valid, s_qk, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s_qk, 0))
            p = tl.exp(s_qk - m_new)
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        if splits == 1:
            out = acc / l_i
            tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))
        else:
            row = (t * tl.num_programs(1) + h) * splits + s
            tl.store(part_o_ptr + row * head_dim + d, acc)
            one = tl.arange(0, 1)
            tl.store(part_ml_ptr + row * 2 + one, m_i)
            tl.store(part_ml_ptr + row * 2 + 1 + one, l_i)

    return decode_attention_kernel


_KERNEL: Any = None
# Most splits of one request's context (vLLM's FlashAttention caps its own at 128;
# a few suffice for the contexts recorded here).
MAX_DECODE_SPLITS = 16


def decode_splits(requests: int, heads: int, sm_count: int) -> int:
    """How many parts each decode request's context is split into (flash-decoding).

    One program per (request, head) leaves most of the GPU idle for small batches,
    each program walking its whole context alone: on the H200 a single 8B decode
    over 1,700 tokens took 9.9 ms where 16 requests over 150 tokens each took 6.7.
    vLLM's decode attention (FlashAttention's and FlashInfer's split-KV) spreads a
    small batch's contexts over the SMs, so its small batches cost what their
    context reads do. Enough splits for two programs per SM; set by the batch size
    alone, so a captured graph keeps its grid.
    """
    programs = max(1, requests * heads)
    return max(1, min(MAX_DECODE_SPLITS, -(-2 * sm_count // programs)))


def decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    use_triton: bool,
    splits: int = 1,
) -> None:
    """Attention of one new token per request over its own cached context, into ``out``.

    ``q``, ``out``: ``[n, heads, head_dim]``; ``cache_*``: ``[slots, kv_heads, max_len,
    head_dim]``; ``slots``, ``lengths``: ``[n]`` (context length includes the new token).
    With Triton each context is read in ``splits`` parts whose partial softmaxes are
    then combined.
    """
    n, heads, head_dim = q.shape
    group = heads // cache_k.shape[1]
    if use_triton:
        global _KERNEL
        if _KERNEL is None:
            _KERNEL = _decode_attention_kernel()
        part_o = torch.empty((n, heads, splits, head_dim), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((n, heads, splits, 2), device=q.device, dtype=torch.float32)
        _KERNEL[(n, heads, splits)](
            q, cache_k, cache_v, out, part_o, part_ml, slots, lengths,
            1.0 / math.sqrt(head_dim),
            q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
            out.stride(0), out.stride(1),
            group=group, head_dim=head_dim, block=64, splits=splits,
        )
        if splits > 1:
            # Splits past a short context are empty: maximum -1e30, weight exp(-inf) = 0.
            m, denominator = part_ml[..., 0], part_ml[..., 1]
            weight = torch.exp(m - m.amax(dim=-1, keepdim=True))
            total = (part_o * weight[..., None]).sum(dim=-2)
            out.copy_(total / (denominator * weight).sum(dim=-1)[..., None])
        return
    for i, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist(), strict=True)):
        k = cache_k[slot, :, :length].repeat_interleave(group, dim=0)
        v = cache_v[slot, :, :length].repeat_interleave(group, dim=0)
        out[i] = functional.scaled_dot_product_attention(q[i][:, None], k, v)[:, 0]


@dataclass
class PassPlan:
    """Where each scheduled token of one pass goes (built on the host, per pass)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    # Prefill chunks: (first token index, tokens, slot, tokens already cached).
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)
    decode_start: int = 0
    decode_slots: list[int] = field(default_factory=list)
    decode_lengths: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # token indices whose logits are sampled
    # The request of each sampled row; None where the token is discarded (mid-prompt).
    sampled_for: list[str | None] = field(default_factory=list)


class Decoder:
    """Random-weight Llama-shaped decoder with a slot KV cache."""

    def __init__(self, shape: ModelShape, num_slots: int, max_len: int, device: str) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.use_triton = self.device.type == "cuda"
        # Sets the decode splits; on the CPU an H200's count, so that the tests' Triton
        # interpreter runs the split path.
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 132
        )
        self.max_len = max_len
        s, d = shape, shape.head_dim
        gen = torch.Generator(device=self.device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, device=self.device, dtype=self.dtype)
            return w.mul_(1.0 / math.sqrt(rows))

        self.embed = weight(s.vocab, s.hidden).mul_(math.sqrt(s.vocab))
        self.layers = [
            dict(
                wqkv=weight(s.hidden, (s.heads + 2 * s.kv_heads) * d),
                wo=weight(s.heads * d, s.hidden),
                wgu=weight(s.hidden, 2 * s.intermediate),
                wdown=weight(s.intermediate, s.hidden),
                norm1=torch.ones(s.hidden, device=self.device, dtype=self.dtype),
                norm2=torch.ones(s.hidden, device=self.device, dtype=self.dtype),
            )
            for _ in range(s.layers)
        ]
        self.final_norm = torch.ones(s.hidden, device=self.device, dtype=self.dtype)
        self.lm_head = weight(s.hidden, s.vocab)
        # One spare slot beyond the requests': padding rows of a captured decode batch
        # write and read there.
        self.spare_slot = num_slots
        cache_shape = (s.layers, num_slots + 1, s.kv_heads, max_len, d)
        self.cache_k = torch.zeros(cache_shape, device=self.device, dtype=self.dtype)
        self.cache_v = torch.zeros(cache_shape, device=self.device, dtype=self.dtype)
        inv_freq = 1.0 / (500_000.0 ** (torch.arange(0, d, 2, device=self.device) / d))
        angles = torch.outer(torch.arange(max_len, device=self.device), inv_freq)
        self.cos = angles.cos().to(self.dtype)
        self.sin = angles.sin().to(self.dtype)
        self.graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, max_batch: int, capture: bool | None = None) -> None:
        """Replay decode-only passes from CUDA graphs (captured now; eager on the CPU)."""
        if capture is None:
            capture = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self, capture_sizes(max_batch), capture)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, plan: PassPlan) -> torch.Tensor:
        """Run one pass over every scheduled token; returns the sampled token ids (on device)."""
        if self.device.type != "cuda":
            return self._forward(plan)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # FlashAttention and the memory-efficient kernel only, as vLLM uses: PyTorch may
        # otherwise pick cuDNN's attention, which builds a plan per new sequence length
        # (in the second H200 recordings a prefill of a length not seen before ran 1.3-1.4x
        # its prediction at the median, 3x at the 90th percentile; seen lengths 0.9x).
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return self._forward(plan)

    def _forward(self, plan: PassPlan) -> torch.Tensor:
        if self.graphs is not None and not plan.prefills and plan.decode_slots:
            sampled = self.graphs.replay(plan)
            if sampled is not None:
                return sampled
        return self.run(self.inputs(plan), plan.prefills, plan.decode_start)

    def inputs(self, plan: PassPlan) -> PassInputs:
        """The pass's index tensors on the device."""
        dev = self.device
        return PassInputs(
            tokens=torch.tensor(plan.token_ids, device=dev),
            positions=torch.tensor(plan.positions, device=dev),
            slots=torch.tensor(plan.slots, device=dev),
            decode_slots=torch.tensor(plan.decode_slots, device=dev, dtype=torch.int32),
            decode_lengths=torch.tensor(plan.decode_lengths, device=dev, dtype=torch.int32),
            sample_rows=torch.tensor(plan.sample_rows, device=dev, dtype=torch.long),
        )

    def run(
        self,
        inputs: PassInputs,
        prefills: list[tuple[int, int, int, int]],
        decode_start: int,
    ) -> torch.Tensor:
        """The forward pass over ``inputs``; the sampled token ids (on device).

        Reads nothing from the host once the inputs are on the device, so a pass of
        decodes alone can be captured as a CUDA graph and replayed.
        """
        s, d = self.shape, self.shape.head_dim
        positions, slots = inputs.positions, inputs.slots
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        n = inputs.tokens.shape[0]
        group = s.heads // s.kv_heads
        has_decodes = inputs.decode_slots.shape[0] > 0
        splits = decode_splits(inputs.decode_slots.shape[0], s.heads, self.sm_count)
        x = self.embed[inputs.tokens]
        for index, layer in enumerate(self.layers):
            h = functional.rms_norm(x, (s.hidden,), layer["norm1"])
            qkv = (h @ layer["wqkv"]).view(n, s.heads + 2 * s.kv_heads, d)
            q = self._rope(qkv[:, : s.heads], cos, sin)
            k = self._rope(qkv[:, s.heads : s.heads + s.kv_heads], cos, sin)
            v = qkv[:, s.heads + s.kv_heads :]
            cache_k, cache_v = self.cache_k[index], self.cache_v[index]
            cache_k[slots, :, positions] = k
            cache_v[slots, :, positions] = v
            attn = torch.empty_like(q)
            for first, count, slot, cached in prefills:
                length = cached + count
                kk = cache_k[slot, :, :length].repeat_interleave(group, dim=0)[None]
                vv = cache_v[slot, :, :length].repeat_interleave(group, dim=0)[None]
                qq = q[first : first + count].transpose(0, 1)[None]
                if cached == 0:
                    o = functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                else:  # the chunk's queries see all cached tokens and their own prefix
                    from torch.nn.attention.bias import causal_lower_right

                    bias = causal_lower_right(count, length)
                    o = functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=bias)
                attn[first : first + count] = o[0].transpose(0, 1)
            if has_decodes:
                decode_attention(
                    q[decode_start:], cache_k, cache_v, inputs.decode_slots,
                    inputs.decode_lengths, attn[decode_start:], self.use_triton, splits,
                )
            x = x + attn.reshape(n, s.heads * d) @ layer["wo"]
            h = functional.rms_norm(x, (s.hidden,), layer["norm2"])
            gate, up = (h @ layer["wgu"]).chunk(2, dim=-1)
            x = x + (functional.silu(gate) * up) @ layer["wdown"]
        last = functional.rms_norm(x[inputs.sample_rows], (s.hidden,), self.final_norm)
        return (last @ self.lm_head).argmax(dim=-1)


@dataclass
class PassInputs:
    """One pass's index tensors, on the model's device."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    decode_slots: torch.Tensor  # int32
    decode_lengths: torch.Tensor  # int32
    sample_rows: torch.Tensor


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes with a graph of their own: vLLM's default list, up to ``max_batch``."""
    sizes = [1, 2, 4, *range(8, 513, 8)]
    below = [b for b in sizes if b < max_batch]
    return [*below, max_batch]


class DecodeGraphs:
    """Passes of decodes alone replayed from CUDA graphs, one per batch size, as vLLM does.

    A batch is padded up to the next captured size; padding rows read and write the
    decoder's spare cache slot only. ``capture=False`` keeps the padded static inputs
    but runs the pass eagerly (how the CPU tests check the padding).
    """

    def __init__(self, decoder: Decoder, sizes: list[int], capture: bool) -> None:
        self.decoder = decoder
        self.sizes = sorted(sizes)
        self.replays = 0
        self.padded_replays = 0
        self._static: dict[int, PassInputs] = {}
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        dev = decoder.device
        for size in sorted(self.sizes, reverse=True):  # largest first: the pool is reused
            rows = torch.arange(size, device=dev)
            pad = torch.full((size,), decoder.spare_slot, device=dev)
            self._static[size] = PassInputs(
                tokens=torch.zeros(size, dtype=torch.long, device=dev),
                positions=torch.zeros(size, dtype=torch.long, device=dev),
                slots=pad.clone(),
                decode_slots=pad.to(torch.int32),
                decode_lengths=torch.ones(size, dtype=torch.int32, device=dev),
                sample_rows=rows,
            )
        if capture:
            self._capture()

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            static = self._static[size]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compile and allocate outside the capture
                    self.decoder.run(static, [], 0)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.decoder.run(static, [], 0)
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, plan: PassPlan) -> torch.Tensor | None:
        """The sampled ids of a decode-only pass, or None if no captured size holds it."""
        n = len(plan.decode_slots)
        size = next((b for b in self.sizes if b >= n), None)
        if size is None:
            return None
        static, pad = self._static[size], size - n
        spare = self.decoder.spare_slot
        static.tokens.copy_(torch.tensor(plan.token_ids + [0] * pad))
        static.positions.copy_(torch.tensor(plan.positions + [0] * pad))
        static.slots.copy_(torch.tensor(plan.slots + [spare] * pad))
        static.decode_slots.copy_(torch.tensor(plan.decode_slots + [spare] * pad))
        static.decode_lengths.copy_(torch.tensor(plan.decode_lengths + [1] * pad))
        self.replays += 1
        self.padded_replays += pad > 0
        if size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][:n]
        return self.decoder.run(static, [], 0)[:n]


# -- requests and scheduling -------------------------------------------------------


class RequestStatus(enum.Enum):
    """The two states this engine uses (vLLM's names, which the queue tracker reads)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()


@dataclass(eq=False)
class Request:
    """One generation request."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.num_prompt_tokens + self.num_output_tokens


class WaitingQueue(deque[Request]):
    """First come, first served, with the method names of vLLM V1's request queues."""

    def add_request(self, request: Request) -> None:
        """Queue at the back."""
        self.append(request)

    def pop_request(self) -> Request:
        """Take the oldest."""
        return self.popleft()

    def prepend_request(self, request: Request) -> None:
        """Put one back at the front."""
        self.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put several back at the front, in order."""
        self.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        """Drop one (an abort)."""
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop several."""
        for request in list(requests):
            self.remove(request)


@dataclass
class NewRequestData:
    """``SchedulerOutput.scheduled_new_reqs`` entry."""

    req_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """``SchedulerOutput.scheduled_cached_reqs``: running requests, column-wise."""

    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)


@dataclass(eq=False)
class SchedulerOutput:
    """The fields of vLLM V1's ``SchedulerOutput`` that the plugin reads, plus the plan."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    batch: list[tuple[Request, int]]  # (request, tokens this pass), in plan order


class Scheduler:
    """Decodes first, then chunked prefill of running and new requests under a token budget."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, max_len: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_len = max_len
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.finished = 0

    def add_request(self, request: Request) -> None:
        """Accept a request (its prompt plus output must fit one slot)."""
        if request.num_prompt_tokens + request.max_tokens > self.max_len:
            raise ValueError(f"request {request.request_id} is longer than {self.max_len} tokens")
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def schedule(self) -> SchedulerOutput:
        """Choose this pass's tokens: every running decode, then prefill chunks in arrival order."""
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        cached = CachedRequestData()
        for request in decodes + prefilling:
            if budget <= 0:
                break
            remaining = request.num_prompt_tokens - request.num_computed_tokens
            count = 1 if remaining <= 0 else min(remaining, budget)
            batch.append((request, count))
            cached.req_ids.append(request.request_id)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            cached.num_output_tokens.append(request.num_output_tokens)
            budget -= count
        new: list[NewRequestData] = []
        while budget > 0 and self.waiting and self.free_slots:
            request = self.waiting.pop_request()
            request.status = RequestStatus.RUNNING
            request.slot = self.free_slots.pop()
            self.running.append(request)
            count = min(request.num_prompt_tokens, budget)
            batch.append((request, count))
            new.append(NewRequestData(request.request_id, request.prompt_token_ids, 0))
            budget -= count
        counts = {request.request_id: count for request, count in batch}
        return SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values()),
            scheduled_spec_decode_tokens={},
            batch=batch,
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Advance each scheduled request; finished ones give their slot back."""
        for request, count in output.batch:
            request.num_computed_tokens += count
            if request.num_computed_tokens < request.num_prompt_tokens:
                continue  # a partial prefill chunk samples nothing
            request.output_token_ids.append(sampled[request.request_id])
            if request.num_output_tokens >= request.max_tokens:
                self.running.remove(request)
                self.free_slots.append(request.slot)
                del self.requests[request.request_id]
                self.finished += 1


def plan_pass(output: SchedulerOutput) -> PassPlan:
    """Token layout of one pass: prefill chunks first, then one token per decode."""
    plan = PassPlan()
    decodes: list[Request] = []
    for request, count in output.batch:
        done = request.num_computed_tokens
        if done >= request.num_prompt_tokens:
            decodes.append(request)
            continue
        first = len(plan.token_ids)
        plan.token_ids.extend(request.prompt_token_ids[done : done + count])
        plan.positions.extend(range(done, done + count))
        plan.slots.extend([request.slot] * count)
        plan.prefills.append((first, count, request.slot, done))
        # Every request is sampled, a chunk that does not end its prompt too (its token
        # discarded), as in vLLM: the pass's output then always waits for the whole
        # pass. A pass of one unfinished chunk that sampled nothing returned to the
        # host while the GPU still ran it (H200: a 2,048-token chunk "took" 16-33 ms).
        plan.sample_rows.append(first + count - 1)
        plan.sampled_for.append(
            request.request_id if done + count >= request.num_prompt_tokens else None
        )
    plan.decode_start = len(plan.token_ids)
    for request in decodes:
        position = request.num_computed_tokens  # the last sampled token goes here
        plan.sample_rows.append(len(plan.token_ids))
        plan.sampled_for.append(request.request_id)
        plan.token_ids.append(request.output_token_ids[-1])
        plan.positions.append(position)
        plan.slots.append(request.slot)
        plan.decode_slots.append(request.slot)
        plan.decode_lengths.append(position + 1)
    return plan


class Executor:
    """Runs a scheduled pass on the decoder; sampling copies the tokens to the host.

    Also keeps the host time of every pass (submission to tokens on the host), so
    the recorder can check the plugin's CUDA-event times against it.
    """

    def __init__(self, decoder: Decoder, clock: Any) -> None:
        self.decoder = decoder
        self._clock = clock
        self._pending: torch.Tensor | None = None
        self._started = 0.0
        self._sampled_for: list[str | None] = []
        self.host_times_s: list[float] = []

    def execute_model(self, output: SchedulerOutput) -> None:
        """Enqueue the forward pass (returns before the device finishes)."""
        self._started = self._clock()
        plan = plan_pass(output)
        self._pending = self.decoder.forward(plan)
        self._sampled_for = plan.sampled_for

    def sample_tokens(self, grammar_output: Any = None) -> dict[str, int]:
        """The sampled token of each request that samples, on the host (waits for the device)."""
        assert self._pending is not None
        values = self._pending.tolist()
        self.host_times_s.append(self._clock() - self._started)
        self._pending = None
        pairs = zip(self._sampled_for, values, strict=True)
        return {request_id: token for request_id, token in pairs if request_id is not None}
