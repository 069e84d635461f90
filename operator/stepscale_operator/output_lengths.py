"""Output lengths from the pass stream: when requests leave the decode batch
against when they finished prefill.

No FPM field names a request, but every decode request gets one token per pass,
so a request that generates ``L`` tokens leaves the decode batch ``L - 1`` passes
after the pass that finished its prompt. Per stream and pass ``j``:

* ``A_j``, prompts that finished prefill in pass ``j`` (the load estimator's
  count: prefill requests less the one left partial by a full pass), and
* ``N_j = D_j + A_j - D_{j+1}`` (``D``: decode requests of a pass), the requests
  that finished in pass ``j``: those leaving the decode batch, and prompts of one
  token, which never enter it.

Then ``E[N_j] = sum_m p_m A_{j-m}``, with ``p_m`` the share of requests with ``m``
inter-token intervals: a deconvolution. It is solved as a least squares over
the streams' passes, one coefficient per bin of ``m``
(:data:`~stepscale_operator.load_types.OUTPUT_INTERVAL_BINS`, plus bins of longer
outputs up to 2047 intervals that only absorb them), non-negative, with the
normal equations forgotten with a half-life in time. Arrivals vary from pass to
pass (Poisson at least), which is what identifies the lags.

Both sides are high-passed first (less their mean over the previous
``_SMOOTH`` passes; a linear filter applied to both keeps the lags), so what
varies slowly (a replica's decode population, the traffic's level) does not
leak into the short bins; only bins of up to ``_SMOOTH / 2`` intervals are
reported.

Arrivals answer departures. A router that sends new prompts to the replica with
the fewest requests, and an engine whose batch is full and admits a waiting
prompt when one leaves, both make ``A`` rise just after requests finish. Then a
later pass's arrivals carry news of how long earlier requests ran, and plain
least squares (arrivals as regressors) reads that as fewer short outputs: on
the simulator's least-outstanding router it put the shares of 1-8 token outputs
20-50% low. So the regression is an instrumental-variables one (two-stage
least squares): the instrument is the part of each pass's arrivals that the
stream's last ``_FEEDBACK_LAGS`` departures do not predict (a linear fit of
``A_j`` on ``N_{j-1..j-16}``, pooled and forgotten like the rest). A request's
length is drawn when it arrives, independent of all before, so those surprises
are uncorrelated with the lengths still to be learned, while they still move
with the arrivals. With arrivals that do not answer departures the fit finds
no feedback and the estimate is the plain least squares. On recordings of the
simulator's fleet the 1-8 token shares now come within 0-20% of the truth
(bursty code, silence-burst; the trace's stay near zero, as they are); the
instrument is weaker than the arrivals, so the estimate is noisier than plain
least squares would be without the coupling.

Idle time is put back. An engine with nothing to do runs no passes, so in pass
counts its idle stretches vanish: the next prompt lands on the pass right after
the last request left, whatever the clock says. Where replicas are often idle
(a few long requests each, long context), those arrivals answer departures in
a way no linear fit of recent departures catches, and the shares came out
several times low (long context on 11 replicas: 2.4% of requests with up to
127 intervals, 32.6% in truth). The publisher sends a heartbeat for each second
without a pass (:data:`~stepscale_engine.wire.HEARTBEAT_INTERVAL_S`), so ``h``
heartbeats before a pass say the engine was idle between ``h`` and ``h + 1``
intervals; the midpoint's worth of empty passes, at the mean pass time, goes in
before it. An idle gap shorter than one interval stays unseen. In a synthetic
replica of the same traffic (0.11 prompts a second, 11 streams) that took the
shares from 0.117 to 0.341 against 0.326; the true gaps gave 0.310.

A stream first seen with requests decoding has a history before it that is not
known: its passes count once they are past the longest lag. A preempted request
looks like one that finished and a new prompt; messages lost on the way shift
the lags of the passes around them. Both are rare and only blur the shares.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from stepscale_engine import wire
from stepscale_operator.cost_model.regression import nnls_normal
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS

FloatArray = npt.NDArray[np.float64]

_SMOOTH = 2 * (OUTPUT_INTERVAL_BINS[-1][1] + 1)  # passes of the high-pass mean
# The bins reported, then longer ones that absorb what longer outputs add.
_BINS: tuple[tuple[int, int], ...] = (
    *OUTPUT_INTERVAL_BINS,
    *((2**k, 2 ** (k + 1) - 1) for k in range(7, 11)),
)
_REPORTED = len(OUTPUT_INTERVAL_BINS)
_RUN = 512  # passes of a stream buffered before they are learned
_LONGEST = _BINS[-1][1]
_HISTORY = _LONGEST + 1 + _SMOOTH  # passes of A a stream keeps
_LO = np.array([lo for lo, _ in _BINS])
_HI = np.array([hi for _, hi in _BINS])
_WIDTH = (_HI - _LO + 1).astype(np.float64)
# Empty passes put in for an idle stretch, at most: past the longest reported lag
# and the high-pass mean, a pass sees what came before only through the bins that
# absorb long outputs (a synthetic idle fleet's shares were the same at 2,304).
_IDLE_PASSES_MAX = OUTPUT_INTERVAL_BINS[-1][1] + 1 + _SMOOTH
# Departures that the feedback fit reads arrivals from: a balancing router answers
# within a few passes, a full batch admits on the next.
_FEEDBACK_LAGS = 16


def _lag_sums(series: FloatArray, rows: npt.NDArray[np.int64]) -> FloatArray:
    """``out[i, b]``: the sum of ``series`` over the lags of bin ``b`` before pass
    ``rows[i]``, less its mean over the ``_SMOOTH`` passes before that (sums of the
    cumulative sums give both). ``rows`` start at least ``_HISTORY - 1`` in."""
    cum = np.concatenate([[0.0], np.cumsum(series)])
    cc = np.concatenate([[0.0], np.cumsum(cum)])
    upper = rows[:, None] - _LO[None, :] + 1
    lower = rows[:, None] - _HI[None, :]
    out = cum[upper] - cum[lower]
    out -= (cc[upper] - cc[upper - _SMOOTH] - cc[lower] + cc[lower - _SMOOTH]) / _SMOOTH
    return out


class _FeedbackFit:
    """How a stream's arrivals follow its departures: a least-squares fit of ``A_j``
    on ``N_{j-1..j-_FEEDBACK_LAGS}`` and a constant, pooled over streams, decayed
    sums. No feedback (too few passes yet) is zero coefficients."""

    def __init__(self) -> None:
        self._gram = np.zeros((_FEEDBACK_LAGS + 1, _FEEDBACK_LAGS + 1))
        self._rhs = np.zeros(_FEEDBACK_LAGS + 1)
        self._coef = np.zeros(_FEEDBACK_LAGS + 1)

    def add(self, lagged_departures: FloatArray, arrivals: FloatArray) -> None:
        """Passes' departures before each (one row per pass) and their arrivals."""
        f = np.column_stack([lagged_departures, np.ones(arrivals.shape[0])])
        self._gram += f.T @ f
        self._rhs += f.T @ arrivals
        rows = self._gram[-1, -1]  # decayed count of passes
        if rows >= 4 * (_FEEDBACK_LAGS + 1):
            ridge = np.eye(_FEEDBACK_LAGS + 1) * (1e-6 * float(np.trace(self._gram)) + 1e-9)
            self._coef = np.asarray(
                np.linalg.solve(self._gram + ridge, self._rhs), dtype=np.float64
            )

    def decay(self, keep: float) -> None:
        """Forget by the factor ``keep``."""
        self._gram *= keep
        self._rhs *= keep

    def surprise(self, arrivals: FloatArray, lagged_departures: FloatArray) -> FloatArray:
        """Arrivals less the part the departures before them predict."""
        coef = self._coef
        return arrivals - lagged_departures @ coef[:-1] - coef[-1]


class OutputLengthEstimator:
    """Shares of output lengths from the passes of a deployment's streams (see the
    module docstring). Streams are numbered slots, as the load estimator keeps them."""

    def __init__(self, half_life_s: float = 600.0, min_finished: float = 500.0) -> None:
        self.half_life_s = float(half_life_s)
        self.min_finished = float(min_finished)  # decayed finished requests before shares
        k = len(_BINS)
        # Two-stage least squares, decayed sums: instrument z (lag sums of the
        # arrivals' surprises) against regressors x (lag sums of arrivals), target y.
        self._zx = np.zeros((k, k))
        self._zz = np.zeros((k, k))
        self._zy = np.zeros(k)
        self._feedback = _FeedbackFit()
        self._finished = 0.0
        self._time: float | None = None
        self._history: dict[int, FloatArray] = {}  # per slot: A of its last passes
        self._surprise: dict[int, FloatArray] = {}  # per slot: A less its feedback part
        self._decoding: dict[int, float] = {}  # per slot: D of its last pass
        self._seen: dict[int, int] = {}  # per slot: passes seen
        self._known_from: dict[int, int] = {}  # per slot: first pass whose lags are known
        self._finishes: dict[int, FloatArray] = {}  # per slot: N of its last passes
        # Per slot: (A, D, wall time, heartbeats before each pass or None: none).
        self._pending: dict[
            int, list[tuple[FloatArray, FloatArray, FloatArray, FloatArray | None]]
        ] = {}
        self._idle_beats: dict[int, int] = {}  # per slot: heartbeats since its last pass
        # Passes' wall time, decayed like the rest: the length of an idle pass.
        self._pass_s = 0.0
        self._passes = 0.0
        self._time_seen: float | None = None

    def forget(self, slot: int) -> None:
        """Drop a stream's history (its pod is gone, or the slot is reused)."""
        self._history.pop(slot, None)
        self._surprise.pop(slot, None)
        self._decoding.pop(slot, None)
        self._seen.pop(slot, None)
        self._known_from.pop(slot, None)
        self._finishes.pop(slot, None)
        self._pending.pop(slot, None)
        self._idle_beats.pop(slot, None)

    def observe(
        self,
        slot: int,
        finished_prefill: FloatArray,
        decoding: FloatArray,
        wall: FloatArray,
        now: float,
    ) -> None:
        """A stream's new messages, in order: prompts that finished prefill in each
        (``A``), its decode requests (``D``) and its wall time (0: a heartbeat,
        which is no pass but a second of idle engine).

        Buffered: a stream's passes are learned in runs of at least ``_RUN`` (or
        when :meth:`shares` is asked), so the per-call cost is paid rarely."""
        if wall.shape[0] == 0:
            return
        beat = wall <= 0.0
        carried = self._idle_beats.get(slot, 0)
        idle_beats: FloatArray | None = None
        if beat.any():
            if beat.all():
                self._idle_beats[slot] = carried + int(beat.shape[0])
                return
            passes = ~beat
            beats_so_far = np.cumsum(beat)
            at_pass = beats_so_far[passes]
            # Heartbeats between each pass and the stream's previous one.
            idle_beats = np.diff(at_pass, prepend=0).astype(np.float64)
            idle_beats[0] += carried
            self._idle_beats[slot] = int(beats_so_far[-1] - at_pass[-1])
            finished_prefill, decoding, wall = (
                finished_prefill[passes],
                decoding[passes],
                wall[passes],
            )
        elif carried:  # the heartbeats came in an earlier call
            idle_beats = np.zeros(wall.shape[0])
            idle_beats[0] = carried
            self._idle_beats[slot] = 0
        self._time_seen = now if self._time_seen is None else max(self._time_seen, now)
        buffered = self._pending.setdefault(slot, [])
        buffered.append((finished_prefill, decoding, wall, idle_beats))
        if sum(a.shape[0] for a, _, _, _ in buffered) >= _RUN:
            self._flush(slot)

    def _with_idle_passes(
        self, finished_prefill: FloatArray, decoding: FloatArray, idle_beats: FloatArray
    ) -> tuple[FloatArray, FloatArray]:
        """The passes with empty ones put in for the idle time before each (the
        module docstring): the midpoint of what its heartbeats bound, at the mean
        pass time, and no more than ``_IDLE_PASSES_MAX``."""
        if not idle_beats.any() or self._passes <= 0.0:
            return finished_prefill, decoding
        idle_s = np.where(idle_beats > 0.0, (idle_beats + 0.5) * wire.HEARTBEAT_INTERVAL_S, 0.0)
        mean_pass_s = self._pass_s / self._passes
        empty = np.minimum(np.rint(idle_s / mean_pass_s), _IDLE_PASSES_MAX).astype(np.int64)
        at = np.arange(empty.shape[0]) + np.cumsum(empty)  # each real pass's new place
        a = np.zeros(int(at[-1]) + 1)
        d = np.zeros_like(a)
        a[at] = finished_prefill
        d[at] = decoding
        return a, d

    def _flush(self, slot: int) -> None:
        buffered = self._pending.pop(slot, None)
        if not buffered:
            return
        assert self._time_seen is not None
        self._decay(self._time_seen)
        wall = np.concatenate([w for _, _, w, _ in buffered])
        self._pass_s += float(wall.sum())
        self._passes += float(wall.shape[0])
        finished_prefill, decoding = self._with_idle_passes(
            np.concatenate([a for a, _, _, _ in buffered]),
            np.concatenate([d for _, d, _, _ in buffered]),
            np.concatenate([np.zeros(a.shape[0]) if b is None else b for a, _, _, b in buffered]),
        )
        n = finished_prefill.shape[0]
        seen = self._seen.get(slot, 0)
        if slot not in self._history:
            self._history[slot] = np.zeros(_HISTORY)
            # An idle stream has no past to miss; otherwise wait out the longest lag.
            self._known_from[slot] = 0 if decoding[0] == 0 else _HISTORY
        a = np.concatenate([self._history[slot], finished_prefill])
        # Passes whose departures this batch completes: from the stream's previous
        # last pass (finished by this batch's first D) on.
        first_row = _HISTORY - 1 if seen > 0 else _HISTORY
        rows = np.arange(first_row, _HISTORY + n - 1)
        if seen > 0:
            d_here = np.concatenate([[self._decoding[slot]], decoding[:-1]])
            d_after = decoding
        else:
            d_here, d_after = decoding[:-1], decoding[1:]
        finished = d_here + a[rows] - d_after
        past = np.concatenate([self._finishes.get(slot, np.zeros(_SMOOTH)), finished])
        # The new passes' arrivals less what the departures before each predict.
        new = np.arange(_HISTORY, _HISTORY + n)
        lagged = past[new[:, None] - first_row + _SMOOTH - np.arange(1, _FEEDBACK_LAGS + 1)]
        surprise = np.concatenate(
            [self._surprise.get(slot, np.zeros(_HISTORY)), self._feedback.surprise(a[new], lagged)]
        )
        keep_new = seen - _HISTORY + new >= self._known_from[slot]
        self._feedback.add(lagged[keep_new], a[new][keep_new])
        x = _lag_sums(a, rows)
        z = _lag_sums(surprise, rows)
        cf = np.concatenate([[0.0], np.cumsum(past)])
        k = np.arange(_SMOOTH, _SMOOTH + finished.size)
        y = finished - (cf[k] - cf[k - _SMOOTH]) / _SMOOTH
        keep = seen - _HISTORY + rows >= self._known_from[slot]  # pass index known
        if keep.any():
            self._zx += z[keep].T @ x[keep]
            self._zz += z[keep].T @ z[keep]
            self._zy += z[keep].T @ y[keep]
            self._finished += float(finished[keep].sum())
        self._finishes[slot] = past[-_SMOOTH:]
        self._history[slot] = a[-_HISTORY:]
        self._surprise[slot] = surprise[-_HISTORY:]
        self._decoding[slot] = float(decoding[-1])
        self._seen[slot] = seen + n

    def _decay(self, now: float) -> None:
        if self._time is not None and now > self._time:
            keep = 0.5 ** ((now - self._time) / self.half_life_s)
            self._zx *= keep
            self._zz *= keep
            self._zy *= keep
            self._feedback.decay(keep)
            self._finished *= keep
            self._pass_s *= keep
            self._passes *= keep
        self._time = now if self._time is None else max(self._time, now)

    def shares(self) -> tuple[float, ...]:
        """Share of requests per reported bin (empty until enough requests finished)."""
        for slot in list(self._pending):
            self._flush(slot)
        if self._finished < self.min_finished:
            return ()
        k = len(_BINS)
        scale = float(np.trace(self._zz)) / k
        if not scale > 0.0:
            return ()
        # 2SLS: least squares of y on the part of x that z explains.
        weight = np.linalg.solve(self._zz + np.eye(k) * (1e-9 * scale), self._zx)
        gram = self._zx.T @ weight
        gram = 0.5 * (gram + gram.T)
        rhs = weight.T @ self._zy
        ridge = gram + np.eye(k) * (1e-6 * float(np.trace(gram)) / k)
        per_lag = nnls_normal(ridge, rhs)
        shares = (per_lag * _WIDTH)[:_REPORTED]
        # The longer bins only absorb what long outputs add (the high-pass leaves
        # them poorly pinned), so they do not scale the reported shares down.
        total = float(shares.sum())
        if total > 1.0:
            shares = shares / total
        return tuple(float(s) for s in shares)
