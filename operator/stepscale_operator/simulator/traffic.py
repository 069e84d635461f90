"""Request traffic for the simulator: trace loaders and a synthetic generator.

A :class:`Traffic` is three aligned arrays sorted by arrival time (seconds from
the start, prompt tokens, output tokens). Loaders read the Azure LLM inference
trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) and Mooncake JSONL
(``timestamp`` in ms, ``input_length``, ``output_length``); the generator makes
diurnal ramps, bursts and step changes from a rate function.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import numpy as np
import numpy.typing as npt

SYNTHETIC_KINDS = ("flat", "diurnal", "bursts", "steps")

# The "bursts" kind: after a warm-up at the base rate, every period a ramp to
# BURST_LEVEL times the base, a hold at that level, and a ramp back down.
BURST_WARMUP_S = 300.0
BURST_PERIOD_S = 600.0
BURST_RAMP_S = 30.0
BURST_HOLD_S = 150.0
BURST_LEVEL = 2.5


def burst_windows(duration_s: float, period_s: float = BURST_PERIOD_S) -> list[tuple[float, float]]:
    """``(start, end)`` of each burst of the "bursts" kind that begins within
    ``duration_s``: from the start of its ramp up to the end of its ramp down."""
    length = 2.0 * BURST_RAMP_S + BURST_HOLD_S
    windows: list[tuple[float, float]] = []
    start = BURST_WARMUP_S
    while start < duration_s:
        windows.append((start, min(start + length, duration_s)))
        start += period_s
    return windows


@dataclass(frozen=True)
class Traffic:
    """Requests sorted by arrival; ``duration_s`` is the span the traffic covers."""

    arrival_s: npt.NDArray[np.float64]
    prompt_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    duration_s: float
    name: str = "traffic"

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    def scaled(
        self,
        rate_scale: float = 1.0,
        time_compress: float = 1.0,
        duration_s: float | None = None,
        seed: int = 0,
        jitter_s: float = 15.0,
    ) -> Traffic:
        """Resample the traffic.

        ``time_compress`` > 1 plays the trace faster (same requests, shorter span);
        ``rate_scale`` multiplies the request rate at the same time scale: whole
        copies of each request plus a random fraction (seeded). The original keeps
        its time; each extra copy moves by up to ``jitter_s`` either way, so
        copies do not arrive in lockstep but the trace keeps its shape at
        minute scale.
        ``duration_s`` keeps only the first part (after compression).
        """
        if rate_scale <= 0.0 or time_compress <= 0.0:
            raise ValueError("rate_scale and time_compress must be positive")
        rng = np.random.default_rng(seed)
        t = self.arrival_s / time_compress
        prompt, output = self.prompt_tokens, self.output_tokens
        if rate_scale != 1.0:
            whole = math.floor(rate_scale)
            copies = np.full(t.size, whole, dtype=np.int64)
            copies += rng.random(t.size) < (rate_scale - whole)
            idx = np.repeat(np.arange(t.size), copies)
            # The first copy of each request is the original; the rest are jittered.
            first = np.ones(idx.size, dtype=bool)
            first[1:] = idx[1:] != idx[:-1]
            shift = rng.uniform(-jitter_s, jitter_s, idx.size)
            span_end = t[-1] if t.size else 0.0
            t = np.clip(t[idx] + np.where(first, 0.0, shift), 0.0, span_end)
            prompt, output = prompt[idx], output[idx]
        span = self.duration_s / time_compress
        if duration_s is not None:
            keep = t < duration_s
            t, prompt, output = t[keep], prompt[keep], output[keep]
            span = min(span, duration_s)
        order = np.argsort(t, kind="stable")
        return Traffic(t[order], prompt[order], output[order], span, self.name)

    def rates(self, bucket_s: float) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Bucket start times and requests per second in each bucket (for plots)."""
        n = max(1, math.ceil(self.duration_s / bucket_s))
        counts = np.bincount(
            np.minimum((self.arrival_s / bucket_s).astype(np.int64), n - 1), minlength=n
        )
        return np.arange(n, dtype=np.float64) * bucket_s, counts.astype(np.float64) / bucket_s


def merged(parts: Sequence[Traffic], name: str) -> Traffic:
    """The requests of every part in one stream, sorted by arrival: tenants that
    share a deployment, each with its own shape and rate."""
    if not parts:
        raise ValueError("merged needs at least one part")
    t = np.concatenate([p.arrival_s for p in parts])
    order = np.argsort(t, kind="stable")
    return Traffic(
        t[order],
        np.concatenate([p.prompt_tokens for p in parts])[order],
        np.concatenate([p.output_tokens for p in parts])[order],
        max(p.duration_s for p in parts),
        name,
    )


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the line and what is
    expected."""


def _from_lists(
    times: list[float], prompt: list[int], output: list[int], path: str | Path
) -> Traffic:
    name = Path(path).stem
    if not times:
        raise TraceError(f"{path}: no requests; expected at least one row")
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return Traffic(
        t,
        np.maximum(np.asarray(prompt, dtype=np.int64)[order], 1),
        np.maximum(np.asarray(output, dtype=np.int64)[order], 1),
        float(t[-1]) + 1.0,
        name,
    )


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


def _number(value: object, what: str, where: str, whole: bool = True) -> float:
    """``value`` as a number >= 0 (whole unless told), else a :class:`TraceError`
    naming ``where``."""
    try:
        number = float(str(value).strip())
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0 or (whole and number != int(number)):
        kind = "a whole number" if whole else "a number"
        raise TraceError(f"{where}: {what} is {value!r}; expected {kind} >= 0")
    return number


def _azure_time(stamp: str, where: str) -> float:
    stamp = stamp.strip()
    # Timestamps carry 7 fractional digits; datetime takes at most 6.
    if "." in stamp:
        head, frac = stamp.split(".", 1)
        stamp = f"{head}.{frac[:6]}"
    try:
        parsed = datetime.fromisoformat(stamp)
    except ValueError:
        raise TraceError(
            f"{where}: TIMESTAMP is {stamp!r}; expected a date and time like "
            "2023-11-16 18:15:46.6805900"
        ) from None
    if parsed.tzinfo is None:
        # The trace's stamps are UTC; read as local time they would jump
        # by an hour across a daylight-saving change.
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def load_azure_csv(path: str | Path) -> Traffic:
    """Azure LLM inference trace (2023): ``TIMESTAMP,ContextTokens,GeneratedTokens``.

    Raises :class:`TraceError` for a missing column (named) or a bad value (with
    its line number).
    """
    times: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    with _open_trace(path) as f:
        reader = csv.DictReader(f)
        found = [name.strip() for name in reader.fieldnames or ()]
        missing = [c for c in AZURE_COLUMNS if c not in found]
        if missing:
            raise TraceError(
                f"{path}: missing column{'s' if len(missing) > 1 else ''} "
                f"{', '.join(missing)}; expected a CSV header with {','.join(AZURE_COLUMNS)}"
                f" (found {','.join(found) or 'no header'})"
            )
        reader.fieldnames = found
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            if any(row.get(c) is None for c in AZURE_COLUMNS):
                raise TraceError(f"{where}: expected {len(AZURE_COLUMNS)} columns")
            times.append(_azure_time(row["TIMESTAMP"], where))
            prompt.append(int(_number(row["ContextTokens"], "ContextTokens", where)))
            output.append(int(_number(row["GeneratedTokens"], "GeneratedTokens", where)))
    return _from_lists(times, prompt, output, path)


def load_mooncake_jsonl(path: str | Path) -> Traffic:
    """Mooncake trace: one JSON object per line with ``timestamp`` (ms) and lengths."""
    times: list[float] = []
    prompt: list[int] = []
    output: list[int] = []
    with _open_trace(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{where}: not JSON ({error.msg})") from None
            missing = [k for k in MOONCAKE_FIELDS if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise TraceError(
                    f"{where}: missing {', '.join(missing)}; expected an object with "
                    f"{', '.join(MOONCAKE_FIELDS)}"
                )
            times.append(_number(rec["timestamp"], "timestamp", where, whole=False) / 1000.0)
            prompt.append(int(_number(rec["input_length"], "input_length", where)))
            output.append(int(_number(rec["output_length"], "output_length", where)))
    return _from_lists(times, prompt, output, path)


def _open_trace(path: str | Path) -> TextIO:
    try:
        return open(path, newline="")
    except OSError as error:
        raise TraceError(f"{path}: {error.strerror or error}") from None


def load_trace(path: str | Path) -> Traffic:
    """Load a trace by its extension: ``.csv`` (Azure) or ``.jsonl`` (Mooncake).

    Raises :class:`TraceError` (a ``ValueError``) for anything that keeps it from
    being read, with a message naming the file and what is expected.
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return load_azure_csv(path)
    if suffix in (".jsonl", ".json"):
        return load_mooncake_jsonl(path)
    raise TraceError(f"{path}: unknown trace format {suffix!r}; expected .csv or .jsonl")


def rate_function(
    kind: str, base_rps: float, duration_s: float, burst_period_s: float = BURST_PERIOD_S
) -> Callable[[float], float]:
    """Requests per second over time for a synthetic ``kind`` (see ``SYNTHETIC_KINDS``);
    ``burst_period_s`` is the time from one burst's start to the next's ("bursts")."""
    if kind == "flat":
        return lambda t: base_rps
    if kind == "diurnal":
        # One compressed "day": trough at 40% of base, peak at 160%.
        return lambda t: base_rps * (1.0 - 0.6 * math.cos(2.0 * math.pi * t / duration_s))
    if kind == "bursts":
        # The schedule is the BURST_* constants above (and ``burst_windows``).
        def bursts(t: float) -> float:
            if t < BURST_WARMUP_S:
                return base_rps
            phase = (t - BURST_WARMUP_S) % burst_period_s
            rise = BURST_LEVEL - 1.0
            if phase < BURST_RAMP_S:
                level = 1.0 + rise * phase / BURST_RAMP_S
            elif phase < BURST_RAMP_S + BURST_HOLD_S:
                level = BURST_LEVEL
            elif phase < 2.0 * BURST_RAMP_S + BURST_HOLD_S:
                level = BURST_LEVEL - rise * (phase - BURST_RAMP_S - BURST_HOLD_S) / BURST_RAMP_S
            else:
                level = 1.0
            return base_rps * level

        return bursts
    if kind == "steps":
        levels = (1.0, 2.0, 0.5, 1.5, 1.0)
        return lambda t: base_rps * levels[min(int(t / duration_s * len(levels)), len(levels) - 1)]
    raise ValueError(f"unknown synthetic kind {kind!r}; choose from {SYNTHETIC_KINDS}")


def synthetic(
    kind: str,
    duration_s: float = 1800.0,
    base_rps: float = 5.0,
    mean_prompt: float = 1100.0,
    mean_output: float = 200.0,
    seed: int = 0,
    burst_period_s: float = BURST_PERIOD_S,
) -> Traffic:
    """Poisson arrivals with a time-varying rate; log-normal prompt and output lengths.

    Lengths have a coefficient of variation of about 1, like the Azure
    conversation trace (prompt mean ~1150, output mean ~210).
    """
    rate = rate_function(kind, base_rps, duration_s, burst_period_s)
    return _poisson(rate, duration_s, mean_prompt, mean_output, seed, f"synthetic-{kind}")


def phased(
    phases: Sequence[tuple[float, float]],
    mean_prompt: float = 1100.0,
    mean_output: float = 200.0,
    seed: int = 0,
    name: str = "phased",
) -> Traffic:
    """Poisson arrivals at a constant rate per phase: ``(seconds, requests per second)``
    one after the other (a calm, an overload and a calm phase, say)."""
    ends = np.cumsum([max(d, 0.0) for d, _ in phases])
    rates = [r for _, r in phases]

    def rate(t: float) -> float:
        k = int(np.searchsorted(ends, t, side="right"))
        return rates[min(k, len(rates) - 1)]

    return _poisson(rate, float(ends[-1]), mean_prompt, mean_output, seed, name)


def _poisson(
    rate: Callable[[float], float],
    duration_s: float,
    mean_prompt: float,
    mean_output: float,
    seed: int,
    name: str,
) -> Traffic:
    rng = np.random.default_rng(seed)
    peak = max(rate(t) for t in np.linspace(0.0, duration_s, 2001)) * 1.05
    # Thinning: candidates at the peak rate, each kept with probability rate/peak.
    n = rng.poisson(peak * duration_s)
    t = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.random(n) * peak < np.fromiter((rate(x) for x in t), np.float64, n)
    t = t[keep]
    sigma = math.sqrt(math.log(2.0))  # CV of 1 for a log-normal
    prompt = rng.lognormal(math.log(mean_prompt) - sigma**2 / 2.0, sigma, t.size)
    output = rng.lognormal(math.log(mean_output) - sigma**2 / 2.0, sigma, t.size)
    return Traffic(
        t,
        np.clip(prompt, 16, 16_000).astype(np.int64),
        np.clip(output, 1, 2_000).astype(np.int64),
        duration_s,
        name,
    )


@dataclass(frozen=True)
class TrafficShape:
    """Shapes real traces show and Poisson traffic with log-normal lengths does not.

    Arrivals come in clusters (a user's or an agent's requests together; mean
    ``cluster_mean`` requests within ``cluster_spread_s``), so counts per second are
    over-dispersed (variance/mean about ``2 * cluster_mean - 1``); the source goes
    silent and comes back (on/off periods with a ``silent_share`` of the time off),
    which gives inter-arrival CV^2 in the hundreds. Prompts are log-normal with
    median ``prompt_median`` and shape ``prompt_sigma`` (1.5: a tail to 100k tokens
    at a median of 1k), cut at ``max_prompt`` (the engine's max_model_len less the
    output); a ``short_output_share`` of the outputs has 1-10 tokens.
    """

    cluster_mean: float = 1.0
    cluster_spread_s: float = 0.5
    silent_share: float = 0.0
    mean_on_s: float = 60.0
    prompt_median: float = 800.0
    prompt_sigma: float = 1.0
    max_prompt: int = 16_000
    output_median: float = 150.0
    output_sigma: float = 1.0
    short_output_share: float = 0.0


def shaped_synthetic(
    shape: TrafficShape,
    rate: Callable[[float], float],
    duration_s: float,
    seed: int = 0,
    name: str = "synthetic-shaped",
) -> Traffic:
    """Traffic of ``shape`` whose mean request rate follows ``rate(t)`` (req/s).

    ``rate`` is the mean over on and off periods: while on, clusters arrive at
    ``rate / (1 - silent_share) / cluster_mean`` per second.
    """
    rng = np.random.default_rng(seed)
    grid = np.linspace(0.0, duration_s, 2001)
    peak = max(rate(float(t)) for t in grid) * 1.05
    on_scale = 1.0 / max(1.0 - shape.silent_share, 1e-6)
    cluster_peak = peak * on_scale / max(shape.cluster_mean, 1.0)
    n = rng.poisson(cluster_peak * duration_s)
    starts = np.sort(rng.uniform(0.0, duration_s, n))
    keep = rng.random(n) * peak < np.fromiter((rate(float(x)) for x in starts), np.float64, n)
    starts = starts[keep]
    if shape.silent_share > 0.0:
        mean_off = shape.mean_on_s * shape.silent_share / (1.0 - shape.silent_share)
        clock, on = 0.0, bool(rng.random() >= shape.silent_share)
        edges: list[tuple[float, float]] = []
        while clock < duration_s:
            length = float(rng.exponential(shape.mean_on_s if on else mean_off))
            if not on:
                edges.append((clock, clock + length))
            clock += length
            on = not on
        silent = np.zeros(starts.size, dtype=bool)
        for lo, hi in edges:
            silent |= (starts >= lo) & (starts < hi)
        starts = starts[~silent]
    # Cluster sizes: geometric with the given mean (1: single requests).
    p = 1.0 / max(shape.cluster_mean, 1.0)
    sizes = rng.geometric(p, starts.size) if p < 1.0 else np.ones(starts.size, np.int64)
    t = np.repeat(starts, sizes) + rng.uniform(0.0, shape.cluster_spread_s, int(sizes.sum()))
    t = np.sort(t[t < duration_s])
    prompt = rng.lognormal(math.log(shape.prompt_median), shape.prompt_sigma, t.size)
    output = rng.lognormal(math.log(shape.output_median), shape.output_sigma, t.size)
    short = rng.random(t.size) < shape.short_output_share
    output = np.where(short, rng.integers(1, 11, t.size), output)
    return Traffic(
        t,
        np.clip(prompt, 16, shape.max_prompt).astype(np.int64),
        np.clip(output, 1, 4_000).astype(np.int64),
        duration_s,
        name,
    )
