"""StreamTable: gaps, restarts, duplicates, heartbeats, staleness, rejections, bounds."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stepscale_engine.wire import ForwardPassMetrics, FrameError, heartbeat
from stepscale_operator.stream_state import StreamGroups, StreamTable


def _pass(worker: str, rank: int, counter: int) -> ForwardPassMetrics:
    return ForwardPassMetrics(worker_id=worker, dp_rank=rank, counter_id=counter, wall_time=0.01)


def test_gap_counts_lost_messages() -> None:
    table = StreamTable()
    table.observe_batch([_pass("a", 0, c) for c in (0, 1, 5, 6)], now=1.0)
    state = table.get(("a", 0))
    assert state is not None
    assert state.lost == 3
    assert state.messages == 4
    assert state.last_sequence == 6


def test_restart_detected_and_counted() -> None:
    table = StreamTable()
    table.observe_batch([_pass("a", 0, c) for c in range(100)], now=1.0)
    result = table.observe_batch([_pass("a", 0, 2), _pass("a", 0, 3)], now=2.0)
    state = table.get(("a", 0))
    assert state is not None
    assert result.restarted == (("a", 0),)
    assert state.restarts == 1
    assert state.lost == 2  # sequence 0 and 1 of the new publisher were missed
    assert state.passes_since_restart == 2


def test_pass_index_counts_passes_since_each_rows_stream_started() -> None:
    """Per row: passes of its stream since it (re)started, across batches and streams,
    heartbeats not counted; what the cost model's warm-up is judged by."""
    table = StreamTable()
    first = table.observe_batch(
        [_pass("a", 0, 0), _pass("b", 0, 0), _pass("a", 0, 1), heartbeat("a", 0, 2)], now=1.0
    )
    assert first.pass_index[:3].tolist() == [1, 1, 2]
    second = table.observe_batch(
        [_pass("a", 0, 3), _pass("b", 0, 1), _pass("a", 0, 0), _pass("a", 0, 1)], now=2.0
    )
    # a: one more pass (3rd), then it restarted (counter back to 0): 1, 2 again.
    assert second.pass_index.tolist() == [3, 2, 1, 2]
    third = table.observe_batch([_pass("a", 0, 2)], now=3.0)
    assert third.pass_index.tolist() == [3]


def test_duplicate_is_counted_not_accepted() -> None:
    table = StreamTable()
    result = table.observe_batch(
        [_pass("a", 0, 0), _pass("b", 0, 7), _pass("a", 0, 1), _pass("a", 0, 1)], now=1.0
    )
    state = table.get(("a", 0))
    assert state is not None
    assert (state.messages, state.duplicates, state.lost, state.restarts) == (2, 1, 0, 0)
    # The mask is in input order, so consumers can drop exactly the duplicate.
    assert result.mask.tolist() == [True, True, True, False]
    assert int(result.mask.sum()) == 3 and not result.all_accepted
    # A duplicate of the last message of an earlier batch is caught too.
    again = table.observe_batch([_pass("a", 0, 1), _pass("a", 0, 2)], now=2.0)
    assert again.mask.tolist() == [False, True]


def test_heartbeats_are_liveness_not_passes() -> None:
    table = StreamTable()
    table.observe_batch([_pass("a", 0, 0), heartbeat("a", 0, 1), heartbeat("a", 0, 2)], now=5.0)
    state = table.get(("a", 0))
    assert state is not None
    assert (state.passes, state.heartbeats) == (1, 2)
    assert not state.is_stale(7.9)
    assert state.is_stale(8.1)  # 3 heartbeat intervals of silence


def test_expected_stream_is_missing_until_it_speaks() -> None:
    table = StreamTable()
    table.expect(("b", 1))
    assert table.stale(0.0) == [("b", 1)]
    table.observe(_pass("b", 1, 0), now=1.0)
    assert table.fresh(1.5) == [("b", 1)]
    assert table.stale(10.0) == [("b", 1)]


def test_rejections_by_reason_and_stream() -> None:
    table = StreamTable()
    table.observe(_pass("a", 0, 0), now=0.0)
    table.record_rejected(FrameError.VALUE, ("a", 0))
    table.record_rejected(FrameError.NOT_MSGPACK, None)
    table.record_rejected(FrameError.NOT_MSGPACK, None)
    assert table.rejected == {"value": 1, "not_msgpack": 2}
    state = table.get(("a", 0))
    assert state is not None and state.rejected == {"value": 1}


def test_memory_bounded_evicts_unexpected_longest_silent() -> None:
    table = StreamTable(max_streams=3)
    table.expect(("keep", 0))
    for i in range(10):
        table.observe(_pass(f"w{i}", 0, 0), now=float(i))
    assert len(table) == 3
    assert ("keep", 0) in table
    assert ("w9", 0) in table
    assert table.evicted == 8


def test_eviction_follows_recent_activity_not_creation_order() -> None:
    table = StreamTable(max_streams=3)
    for i, name in enumerate("abc"):
        table.observe(_pass(name, 0, 0), now=float(i))
    table.observe(_pass("a", 0, 1), now=5.0)  # a speaks again: b is now the longest silent
    table.observe(_pass("d", 0, 0), now=6.0)
    assert sorted(k[0] for k in table) == ["a", "c", "d"]
    # With every stream expected, the longest-silent expected one goes.
    for name in "acd":
        table.expect((name, 0))
    table.observe(_pass("e", 0, 0), now=7.0)
    assert sorted(k[0] for k in table) == ["c", "d", "e"]
    table.forget(("c", 0))
    table.observe(_pass("f", 0, 0), now=8.0)
    assert sorted(k[0] for k in table) == ["d", "e", "f"]


def test_health_is_json_able() -> None:
    table = StreamTable()
    table.expect(("gone", 0))
    table.observe_batch([_pass("a", 0, 0), _pass("a", 1, 3)], now=1.0)
    health = table.health(2.0)
    json.dumps(health)
    assert health["streams"] == 3
    assert health["fresh"] == 2
    assert health["stale"] == ["gone/0"]


def _reference(seqs: list[tuple[int, int]]) -> dict[int, tuple[int, int, int, int, int]]:
    """Message-by-message reference: (messages, lost, restarts, duplicates, since_restart)."""
    out: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    for stream, seq in seqs:
        o = out.setdefault(stream, [0, 0, 0, 0, 0])
        prev = last.get(stream)
        if prev is not None and seq == prev:
            o[3] += 1
            continue
        if prev is not None and seq < prev:
            o[2] += 1
            o[1] += seq
            o[4] = 0
        elif prev is not None and seq > prev + 1:
            o[1] += seq - prev - 1
        last[stream] = seq
        o[0] += 1
        o[4] += 1
    return {k: (v[0], v[1], v[2], v[3], v[4]) for k, v in out.items()}


def _reference_mask(seqs: list[tuple[int, int]]) -> list[bool]:
    """Message-by-message: False where the sequence repeats its stream's last one."""
    last: dict[int, int] = {}
    mask = []
    for stream, seq in seqs:
        mask.append(last.get(stream) != seq)
        last[stream] = seq
    return mask


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), max_size=30),
        min_size=1,
        max_size=4,
    )
)
def test_vectorised_batches_match_sequential_reference(
    batches: list[list[tuple[int, int]]],
) -> None:
    table = StreamTable()
    masks: list[bool] = []
    for i, batch in enumerate(batches):
        result = table.observe_batch([_pass("w", s, c) for s, c in batch], now=float(i))
        masks += result.mask.tolist()
    flat = [item for batch in batches for item in batch]
    expected = _reference(flat)
    assert masks == _reference_mask(flat)
    for stream, (messages, lost, restarts, dups, since) in expected.items():
        state = table.get(("w", stream))
        assert state is not None
        got = (state.messages, state.lost, state.restarts, state.duplicates)
        assert got == (messages, lost, restarts, dups)
        assert state.passes_since_restart == since


def test_stream_groups_keep_first_appearance_order_and_map_every_row() -> None:
    rows = [("b", 0), ("a", 1), ("b", 0), ("c", 0), ("a", 1), ("b", 1)]
    groups = StreamGroups.of(rows)
    assert groups.keys == [("b", 0), ("a", 1), ("c", 0), ("b", 1)]
    assert groups.index.tolist() == [0, 1, 0, 2, 1, 3]
    assert [groups.keys[i] for i in groups.index] == rows
    assert StreamGroups.of(groups) is groups and len(groups) == 6
    empty = StreamGroups.of([])
    assert empty.keys == [] and len(empty) == 0


def test_evicted_streams_keep_their_counts() -> None:
    table = StreamTable(max_streams=2)
    for worker in ("a", "b", "c"):
        for counter in (0, 1, 3):  # one lost
            table.observe(
                ForwardPassMetrics(worker_id=worker, counter_id=counter, wall_time=0.01), 0.0
            )
    assert table.evicted == 1 and len(table) == 2
    assert table.evicted_counts["messages"] == 3
    assert table.evicted_counts["passes"] == 3
    assert table.evicted_counts["lost"] == 1
    kept = sum(s.messages for s in (table.get(k) for k in table) if s is not None)
    assert kept + table.evicted_counts["messages"] == 9
