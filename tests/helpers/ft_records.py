"""What a fault-tolerant run's metrics.jsonl says about its membership (tests/comm/ft,
tests/cluster): which mechanism reported each change, and how many members each round ran with.

Membership records (`"kind": "membership"`, comm/ft/elastic_world.py) carry `round`: the last round
the recording worker had finished when the change took effect. A change found in a round's own
operations (a blocking all-reduce or gather) is recorded with the round before it; one taken at a
round end (a late Mix1 message, a joiner's admission), with that round. Either way, worker 0's
record of round r (`ft/members`, taken before its round end) counts exactly the changes of the
rounds before r.
"""

from __future__ import annotations


def detected_by(reason: str) -> str:
    """The mechanism a membership record's `reason` names, by the texts the fault-tolerant
    runtime (comm/ft/) writes:
    "heartbeat" (a member silent for the heartbeat timeout, in a blocking wait or behind a late
    Mix1 message), "deadline" (the adaptive deadline), "run.timeout_s" (a wait that lasted
    run.timeout_s: gloo's own timeout, or the deadline before it has rounds to adapt to),
    "rendezvous" (a missed keep-alive) or "gloo error" (anything else: gloo's own error, e.g. the
    closed socket of a killed peer)."""
    if "no heartbeat for" in reason:
        return "heartbeat"
    if "no answer within run.timeout_s" in reason or "deadline (run.timeout_s =" in reason:
        return "run.timeout_s"
    if "no answer within the deadline" in reason:
        return "deadline"
    if "no keep-alive" in reason:
        return "rendezvous"
    return "gloo error"


def membership(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "membership"]


def members_per_round(records: list[dict], workers: int) -> list[int]:
    """How many members each logged round ran with according to the membership records: the
    member list of the last change recorded with an earlier round (`workers` before any).
    `rejoined` and `refused` records are left out: they are the joiner's own, written to the log
    a round end or more after the `joined` record of the same change."""
    changes = sorted(
        (e for e in membership(records) if e["event"] not in ("rejoined", "refused")),
        key=lambda e: e["round"],
    )  # stable: changes of the same round keep the order they happened in
    counts = []
    for r in (r for r in records if r.get("kind") == "round"):
        before = [e for e in changes if e["round"] < r["round"]]
        counts.append(len(before[-1]["members"]) if before else workers)
    return counts
