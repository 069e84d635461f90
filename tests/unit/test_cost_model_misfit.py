"""Misfit buckets: a bucket rejected while its stream's other passes are let in is
the model being wrong there; a stream rejected everywhere at once is stalled.

Pure: :class:`MisfitBuckets` is fed what the stall gate decided (which passes it
rejected, in which bucket, from which stream), batch by batch.
"""

from __future__ import annotations

import numpy as np

from stepscale_operator.cost_model.admission import ResidualGate, StreamRecord
from stepscale_operator.cost_model.features import N_BUCKETS
from stepscale_operator.cost_model.misfit import MisfitBuckets

USUAL, NEW, OTHER = 3, 7, 11  # three coverage buckets


def _feed(
    tell: MisfitBuckets,
    streams: list[StreamRecord],
    rows: list[tuple[int, int, bool]],
) -> None:
    """One batch of (stream slot, bucket, rejected) rows."""
    slot = np.array([r[0] for r in rows], dtype=np.int64)
    buckets = np.array([r[1] for r in rows], dtype=np.int64)
    rejected = np.array([r[2] for r in rows], dtype=bool)
    tell.observe(buckets, rejected, slot, streams)


def _misfit(tell: MisfitBuckets, bucket: int) -> bool:
    return bool(tell.misfit(np.array([bucket], dtype=np.int64))[0])


def _batches_until_misfit(
    tell: MisfitBuckets,
    streams: list[StreamRecord],
    batch: list[tuple[int, int, bool]],
    bucket: int,
    limit: int = 200,
) -> int | None:
    """Feed the same batch ``limit`` times; after how many ``bucket`` was first
    misfit (None: never)."""
    told = None
    for i in range(limit):
        _feed(tell, streams, batch)
        if told is None and _misfit(tell, bucket):
            told = i + 1
    return told


def test_a_bucket_rejected_beside_passes_let_in_is_misfit_within_about_its_contrast_memory() -> (
    None
):
    tell = MisfitBuckets()  # contrast memory: 50 of a bucket's passes
    # Four usual passes let in, one of a new kind rejected, as a subscriber hands a
    # batch of one stream in.
    batch = [(0, USUAL, False)] * 4 + [(0, NEW, True)]
    told_after = _batches_until_misfit(tell, [StreamRecord()], batch, NEW)
    assert told_after is not None and 40 <= told_after <= 60, told_after
    assert not _misfit(tell, USUAL)
    # By persistence alone (its share of rejections over 500 of its passes) it
    # would have taken 500.
    assert tell.reject_rate[NEW] < 0.5


def test_a_stream_rejected_everywhere_at_once_is_stalled_not_misfit() -> None:
    tell = MisfitBuckets()
    stream = [StreamRecord()]
    for _ in range(100):
        _feed(tell, stream, [(0, USUAL, False)] * 4 + [(0, NEW, False)])
    # A stall run of 300 passes slows every kind the stream runs.
    for _ in range(60):
        _feed(tell, stream, [(0, USUAL, True)] * 4 + [(0, NEW, True)])
    assert not _misfit(tell, NEW) and not _misfit(tell, USUAL)
    # Only the run's first passes had a contrast (the stream's other passes were
    # on time just before it).
    assert tell.contrast_rate[NEW] < 0.25


def test_the_contrast_is_per_stream() -> None:
    """One pod stalled throughout, another sending the new kind rejected beside its
    usual passes let in: the second one's contrast tells the misfit alone."""
    tell = MisfitBuckets()
    streams = [StreamRecord(), StreamRecord()]
    for _ in range(80):
        _feed(
            tell,
            streams,
            [(0, OTHER, True)] * 4 + [(0, NEW, True)] + [(1, USUAL, False)] * 4 + [(1, NEW, True)],
        )
    assert _misfit(tell, NEW)
    # The stalled pod's own kind stays a stall: its stream had no pass let in.
    assert not _misfit(tell, OTHER)


def test_a_misfit_bucket_learned_again_is_gated_again() -> None:
    """Once its passes are let in and come within the gate, the shares fall back
    under half and the gate rejects stalls there again."""
    tell = MisfitBuckets()
    stream = [StreamRecord()]
    for _ in range(80):
        _feed(tell, stream, [(0, USUAL, False)] * 4 + [(0, NEW, True)])
    assert _misfit(tell, NEW)
    for _ in range(80):
        _feed(tell, stream, [(0, USUAL, False)] * 4 + [(0, NEW, False)])
    assert not _misfit(tell, NEW)


def test_a_bucket_that_is_most_of_its_stream_is_told_by_the_passes_let_in_before_it() -> None:
    """Four passes in five of the new kind, rejected: the stream's share of
    rejected passes is 0.8, so it gives no contrast; the first new pass after each
    usual one let in has one (a stall slows the passes around it too)."""
    tell = MisfitBuckets()
    batch = [(0, USUAL, False)] + [(0, NEW, True)] * 4
    told_after = _batches_until_misfit(tell, [StreamRecord()], batch, NEW)
    # One contrasted pass per batch: about the contrast memory (50) of them.
    assert told_after is not None and 40 <= told_after <= 60, told_after
    assert not _misfit(tell, USUAL)


def test_a_pass_just_before_one_let_in_has_a_contrast_too() -> None:
    """The same kind, four in five, but each batch ends with the usual pass: the
    new pass before it has a contrast as well as the one after the last batch's,
    so the bucket is told in half as many batches."""
    batch = [(0, NEW, True)] * 4 + [(0, USUAL, False)]
    told_after = _batches_until_misfit(MisfitBuckets(), [StreamRecord()], batch, NEW)
    assert told_after is not None and 20 <= told_after <= 30, told_after


def test_scattered_stalls_under_half_of_a_bucket_are_not_a_misfit() -> None:
    """Most stalls seen on a shared CPU are single passes (0.6-0.9 of the runs in
    the kept recordings): a pass stalled now and then right after one on time,
    in a third of one bucket's passes, is a stall, however long it goes on."""
    tell = MisfitBuckets()
    stream = [StreamRecord()]
    rng = np.random.default_rng(0)
    for _ in range(600):
        stalled = rng.random(5) < 1 / 3
        _feed(tell, stream, [(0, NEW, bool(s)) for s in stalled])
    assert not _misfit(tell, NEW)


def test_a_stream_rejected_for_longer_than_any_stall_is_misfit() -> None:
    """A stream of the new kind alone (a prefill worker), every pass rejected: no
    other pass of it gives a contrast, but no stall run is 400 passes long (the
    longest seen on a shared CPU are ~110-160). Another pod's passes let in,
    interleaved in the same batches, are no contrast for it: each stream is
    counted in its own pass order."""
    tell = MisfitBuckets()  # longest_stall: 400
    streams = [StreamRecord(), StreamRecord()]
    told_after = None
    for i in range(120):
        _feed(tell, streams, [(0, NEW, True), (1, USUAL, False)] * 5)
        if i + 1 <= 80:  # 400 passes in a row: a stall, as far as anyone knows
            assert not _misfit(tell, NEW), i
        if told_after is None and _misfit(tell, NEW):
            told_after = i + 1
            # By persistence alone (500 of the bucket's passes) it would take 100.
            assert tell.reject_rate[NEW] < 0.5
    # Then the contrast memory: 50 of the bucket's passes, five to a batch.
    assert told_after is not None and 85 <= told_after <= 95, told_after
    assert [s.rejected_run for s in streams] == [600, 0]


def test_the_gate_takes_a_misfit_bucket_at_full_weight_and_rejects_the_rest() -> None:
    """Passes 8x slower than predicted: rejected as stalls in a learned bucket and in
    an unlearned one (beyond its 3x), taken at full weight in a misfit one (the model
    is wrong there). Passes 1.1x slower, past the learned knee: a fraction of a
    weight in a learned bucket, full weight in a misfit one."""
    gate = ResidualGate(
        window=2000, every=50, huber_k=2.0, reject_k=4.0, bucket_trust=20.0,
        drift_k=3.0, drift_floor=0.03,
    )  # fmt: skip
    gate.push(np.random.default_rng(0).normal(0.0, 0.03, 500))  # scale ~0.03
    buckets = np.array([USUAL, NEW, OTHER], dtype=np.int64)
    counts = np.zeros(N_BUCKETS + 1)
    counts[[USUAL, OTHER]] = 1000.0  # USUAL and OTHER learned, NEW not
    misfit = np.array([False, False, True])
    covered = np.zeros(3, dtype=bool)

    def weights(factor: float) -> tuple[list[float], list[bool]]:
        log_res = np.full(3, np.log(factor))
        w, rejected = gate.weights(np.expm1(log_res), log_res, buckets, covered, counts, misfit)
        return w.tolist(), rejected.tolist()

    assert weights(8.0) == ([0.0, 0.0, 1.0], [True, True, False])
    w, rejected = weights(1.1)
    assert rejected == [False, False, False]
    assert 0.0 < w[0] < 1.0 and w[1:] == [1.0, 1.0]
