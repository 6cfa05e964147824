"""Per-peer communication figures of a round, written into its record by the real runtime
(train/round_log.py) and the simulator (sim/engine.py) alike, under the same keys:

    peer/bytes_sent, peer/bytes_received   [rank] model-counted bytes this worker moved
    peer/blocking_s, peer/compute_s        [rank] seconds blocked in communication, computing
    peer/feedback_norm                     [rank] norm of what a codec with error feedback has
                                           not yet sent (codecs/feedback.py; absent without)
    comm/blocking_s/<op>                   the workers' mean blocking seconds in operation <op>,
                                           the name a strategy gives a collective (outer,
                                           grads, mix1, mix2, pull, fragmentK; `other` for a
                                           name not in `blocking_ops`); they sum to
                                           time/blocking_s
    comm/rejected                          contributions the guard rejected or clipped (the
                                           `"kind": "rejected"` records of the round)
    comm/membership_changes                `"kind": "membership"` records since the last round
                                           record (fault-tolerant runtime), or crashes and
                                           rejoins (simulator)

A list has one entry per worker, indexed by rank; a worker that posted nothing (down, not a
member) has null there, never a zero. Times are on the record's `clock`.

In the real runtime every worker knows only its own figures. They reach worker 0 through the
round's one mean of logging scalars (the runtime's round end, comm/runtime.py): worker r posts
its figure at position r and 0 elsewhere, and a 1 at position r of a presence vector, so
figure_r = mean_r / presence_r however many workers posted. The vector must line up on every
worker, so its operation names come from the config alone (`blocking_ops`), not from what a
worker saw.
"""

from __future__ import annotations

from frugaltrain.config import Config

PEER_KEYS = ("bytes_sent", "bytes_received", "blocking_s", "compute_s", "feedback_norm")
# The names outer/ gives its collectives (Comm.all_reduce_mean_/mix_ `op=`); Streaming's
# fragments are added from the config. Add a new strategy's names here.
KNOWN_OPS = ("grads", "mix1", "mix2", "outer", "pull")
OTHER = "other"  # blocking time under any other name: kept, so the split still sums up


def blocking_ops(cfg: Config) -> tuple[str, ...]:
    """The operation names of the per-op split, sorted, then "other"; the same on every worker
    of a run (a function of the config)."""
    o = cfg.outer
    fragments = (
        [f"fragment{k}" for k in range(o.streaming.fragments)] if o.strategy == "streaming" else []
    )
    return (*sorted({*KNOWN_OPS, *fragments}), OTHER)


def fold_ops(by_op: dict[str, float], ops: tuple[str, ...]) -> dict[str, float]:
    """`by_op` (name -> seconds) with every name outside `ops` added to "other"."""
    out: dict[str, float] = {}
    for name, seconds in by_op.items():
        key = name if name in ops else OTHER
        out[key] = out.get(key, 0.0) + seconds
    return out


def post_vector(
    rank: int, world_size: int, figures: dict[str, float], by_op: dict[str, float], ops
) -> list[float]:
    """This worker's part of the round's logging mean: for each of PEER_KEYS a slot per rank
    (its figure at `rank`), a presence slot per rank, then per operation its seconds and
    whether it has run on this worker (1/0)."""
    out: list[float] = []
    for key in (*PEER_KEYS, None):
        slots = [0.0] * world_size
        slots[rank] = 1.0 if key is None else float(figures[key])
        out += slots
    folded = fold_ops(by_op, ops)
    out += [folded.get(op, 0.0) for op in ops]
    out += [1.0 if op in folded else 0.0 for op in ops]
    return out


def vector_size(world_size: int, ops: tuple[str, ...]) -> int:
    return (len(PEER_KEYS) + 1) * world_size + 2 * len(ops)


def fields_from_means(means: list[float], world_size: int, ops: tuple[str, ...]) -> dict:
    """A round record's per-peer and per-op fields from the workers' mean of their
    `post_vector`s (see the module docstring)."""
    M = world_size
    presence = means[len(PEER_KEYS) * M : (len(PEER_KEYS) + 1) * M]
    peers = {}
    for i, key in enumerate(PEER_KEYS):
        slots = means[i * M : (i + 1) * M]
        peers[key] = [v / p if p > 0 else None for v, p in zip(slots, presence, strict=True)]
    start = (len(PEER_KEYS) + 1) * M
    seconds, seen = means[start : start + len(ops)], means[start + len(ops) :]
    by_op = {op: s for op, s, n in zip(ops, seconds, seen, strict=True) if n > 0}
    return peer_fields(peers, by_op)


def sim_fields(
    M: int, live: list[int], figures: dict[str, list[float]], by_op: list[dict], ops
) -> dict:
    """The simulator's per-peer and per-op fields: `figures[key][j]` and `by_op[j]` are live
    worker live[j]'s figures this round; the per-op means are over the live workers."""
    peers: dict[str, list] = {key: [None] * M for key in PEER_KEYS}
    for key in PEER_KEYS:
        for j, rank in enumerate(live):
            peers[key][rank] = figures[key][j]
    folded = [fold_ops(d, ops) for d in by_op]
    seen = [op for op in ops if any(op in f for f in folded)]
    means = {op: sum(f.get(op, 0.0) for f in folded) / len(live) for op in seen}
    return peer_fields(peers, means)


def peer_fields(peers: dict[str, list], by_op: dict[str, float]) -> dict:
    """Record keys of per-peer lists (bytes as integers) and per-op means."""
    out = {}
    for key, values in peers.items():
        if key == "feedback_norm" and not any(values):
            continue  # a dense codec: nothing is held back
        whole = key.startswith("bytes")
        out[f"peer/{key}"] = [
            None if v is None else (int(round(v)) if whole else float(v)) for v in values
        ]
    out.update({f"comm/blocking_s/{op}": seconds for op, seconds in by_op.items()})
    return out


def count_events(records: list[dict]) -> dict[str, int]:
    """comm/rejected and comm/membership_changes of event records (those a runtime hands the
    loop at a round end)."""
    rejected = sum(len(r.get("workers", [])) for r in records if r.get("kind") == "rejected")
    changes = sum(1 for r in records if r.get("kind") == "membership")
    return {"comm/rejected": rejected, "comm/membership_changes": changes}
