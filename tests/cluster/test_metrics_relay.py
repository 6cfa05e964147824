"""The coordinator's metrics log from the machines' relayed lines (cluster/metrics_relay.py): one
source until it is lost, then the next from its reserve; every record written once, in order."""

from __future__ import annotations

import json

import pytest

from frugaltrain.cluster.metrics_relay import MetricsRelay
from frugaltrain.metrics.log import read_metrics

H = 4


def lines(machine: str, first: int, last: int, event_after: int | None = None) -> list[str]:
    """Machine `machine`'s log from step `first` to `last`: step records carrying its name,
    a round record every H steps, a membership record after step `event_after`."""
    out = []
    for s in range(first, last + 1):
        out.append({"kind": "step", "step": s, "by": machine})
        if s % H == 0:
            out.append({"kind": "round", "round": s // H, "step": s, "by": machine})
        if s == event_after:
            out.append({"kind": "membership", "event": "left", "round": s // H, "by": machine})
    return [json.dumps(r) for r in out]


def written(path) -> tuple[list[tuple[int, str]], list[int], list[dict]]:
    recs = read_metrics(path)
    steps = [(r["step"], r["by"]) for r in recs if r["kind"] == "step"]
    rounds = [r["round"] for r in recs if r["kind"] == "round"]
    return steps, rounds, [r for r in recs if r["kind"] == "membership"]


def test_the_next_machine_goes_on_when_the_source_is_lost(tmp_path):
    relay = MetricsRelay(tmp_path / "metrics.jsonl")
    relay.add("A", lines("A", 1, 8), ["A", "B"])
    relay.add("B", lines("B", 1, 8), ["A", "B"])  # in reserve: A wrote these
    relay.add("A", lines("A", 9, 12), ["A", "B"])
    relay.add("B", lines("B", 9, 16), ["B"])  # A lost: B's slot is now the lowest
    steps, rounds, _ = written(tmp_path / "metrics.jsonl")
    assert steps == [(s, "A") for s in range(1, 13)] + [(s, "B") for s in range(13, 17)]
    assert rounds == [1, 2, 3, 4]


def test_a_joiner_in_a_lower_slot_does_not_take_over(tmp_path):
    relay = MetricsRelay(tmp_path / "metrics.jsonl")
    relay.add("B", lines("B", 1, 8), ["B"])  # slot 0's machine was lost
    relay.add("C", lines("C", 13, 16, event_after=13), ["C", "B"])  # took slot 0 at round 3
    relay.add("B", lines("B", 9, 16), ["C", "B"])
    steps, rounds, events = written(tmp_path / "metrics.jsonl")
    assert steps == [(s, "B") for s in range(1, 17)]
    assert rounds == [1, 2, 3, 4] and events == []


def test_resent_lines_and_the_reserves_records_are_written_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    relay.add("A", lines("A", 1, 8, event_after=6), ["A", "B"])
    relay.add("A", lines("A", 1, 8, event_after=6), ["A", "B"])  # its acknowledgement was lost
    relay.add("B", lines("B", 1, 7, event_after=6), ["A", "B"])
    relay.add("B", lines("B", 8, 12), ["B"])  # A lost after step 8
    steps, rounds, events = written(path)
    assert [s for s, _ in steps] == list(range(1, 13))
    assert rounds == [1, 2, 3]
    assert [e["by"] for e in events] == ["A"]  # B's record of the same change is not repeated


def test_a_change_the_lost_source_logged_last_is_not_repeated_by_the_next(tmp_path):
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    event = {"kind": "membership", "event": "left", "round": 2, "epoch": 3, "members": [1, 2]}
    relay.add("A", [*lines("A", 1, 8), json.dumps({**event, "reason": "gloo error"})], ["A", "B"])
    relay.add("B", [*lines("B", 1, 8), json.dumps({**event, "reason": "heartbeat"})], ["A", "B"])
    relay.add("B", lines("B", 9, 12), ["B"])  # A lost
    steps, rounds, events = written(path)
    assert [s for s, _ in steps] == list(range(1, 13)) and rounds == [1, 2, 3]
    assert [e["reason"] for e in events] == ["gloo error"]
    relay = MetricsRelay(path)  # a coordinator restarted on the same file
    relay.add("B", lines("B", 10, 16), ["B"])
    assert [s for s, _ in written(path)[0]] == list(range(1, 17))


def test_cut_keeps_the_rounds_up_to_a_checkpoint_and_logs_the_rest_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    relay.add("A", lines("A", 1, 12), ["A"])
    relay.cut(8)
    relay.add("A", lines("A", 9, 12), ["A"])
    steps, rounds, _ = written(path)
    assert [s for s, _ in steps] == list(range(1, 13)) and rounds == [1, 2, 3]


def test_a_line_that_is_not_a_record_is_refused(tmp_path):
    relay = MetricsRelay(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError):
        relay.add("A", ["not json"], ["A"])


def test_a_gap_in_the_sources_log_is_filled_from_the_reserve(tmp_path):
    """The source's writing worker was restarted and rejoined at round 3's end: the rounds
    trained meanwhile come from the next machine's log, once, in order."""
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    relay.add("A", lines("A", 1, 4), ["A", "B"])
    relay.add("B", lines("B", 1, 12), ["A", "B"])
    relay.add("A", lines("A", 13, 16), ["A", "B"])
    steps, rounds, _ = written(path)
    want = [(s, "A") for s in range(1, 5)] + [(s, "B") for s in range(5, 13)]
    assert steps == want + [(s, "A") for s in range(13, 17)]
    assert rounds == [1, 2, 3, 4]
    order = [(r["kind"], r["step"]) for r in read_metrics(path)]
    assert order == sorted(order, key=lambda x: (x[1], x[0] == "round"))  # as one worker logs


def test_a_round_record_the_source_writes_late_is_its_own(tmp_path):
    """Worker 0 writes a round's record once the workers' means are in, which may be after the
    next round's first steps: that is not a gap, and the other machine's record of the round
    (its own worker's scalars, not the means) is not taken instead."""
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    late = [json.loads(x) for x in lines("A", 1, 8)]
    round_1 = late.pop(4)  # round 1's record, after step 5
    late.insert(5, round_1)
    relay.add("B", lines("B", 1, 8), ["A", "B"])
    relay.add("A", [json.dumps(r) for r in late], ["A", "B"])
    recs = read_metrics(path)
    assert [(r["round"], r["by"]) for r in recs if r["kind"] == "round"] == [(1, "A"), (2, "A")]
    assert [r["by"] for r in recs] == ["A"] * len(late)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "step", "step": "9"},
        {"kind": "step", "step": 2.5},
        {"kind": "step", "step": -1},
        {"kind": "step", "step": 2**64},
        {"kind": None, "step": 9},
        {"kind": "step", "step": [9]},
        [9],
        "9",
    ],
)
def test_a_wrong_typed_record_is_refused_whole_and_the_others_go_on(tmp_path, bad):
    """Found unchecked: a record of the wrong type from a machine that is not the source was
    kept in its reserve, and every later call, from any machine, failed comparing it. Now the
    call raises, naming the machine, and keeps none of its lines."""
    path = tmp_path / "metrics.jsonl"
    relay = MetricsRelay(path)
    relay.add("A", lines("A", 1, 4), ["A", "B"])
    with pytest.raises(ValueError, match="machine B: metrics: "):
        relay.add("B", [*lines("B", 1, 6), json.dumps(bad)], ["A", "B"])
    assert relay.reserve.get("B", []) == []
    relay.add("A", lines("A", 5, 8), ["A", "B"])
    relay.add("B", lines("B", 1, 12), ["B"])  # A lost: B goes on from its reserve
    steps, rounds, _ = written(path)
    assert steps == [(s, "A") for s in range(1, 9)] + [(s, "B") for s in range(9, 13)]
    assert rounds == [1, 2, 3]


@pytest.mark.parametrize(
    "line",
    [
        '{"kind": "membership", "x": "\u2028"}',  # a line break to the log's reader
        '{"kind": "membership", "x": "\ud800"}',  # cannot be written as UTF-8
        '{"kind": "membership", "x": ' + "[" * 20 + "]" * 20 + "}",
        "[" * 100_000,
    ],
)
def test_a_line_the_log_could_not_hold_is_refused(tmp_path, line):
    relay = MetricsRelay(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match="machine A: metrics: "):
        relay.add("A", [line], ["A"])
    relay.add("A", lines("A", 1, 4), ["A"])
    assert [s for s, _ in written(tmp_path / "metrics.jsonl")[0]] == [1, 2, 3, 4]


def test_a_log_torn_by_a_crash_is_read_past(tmp_path):
    """A coordinator killed mid-write leaves a torn last line; the one resumed on the file
    reads past it instead of failing every ping."""
    path = tmp_path / "metrics.jsonl"
    MetricsRelay(path).add("A", lines("A", 1, 4), ["A"])
    with open(path, "a") as f:
        f.write('{"kind": "step", "st\n')
    relay = MetricsRelay(path)
    relay.add("A", lines("A", 3, 8), ["A"])
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(1, 9))
