"""The fault-tolerant runtime's store keys, in one place: the workers' runtime (comm/ft/) and
the processes that watch a run (the coordinator, each machine's agent, the local launcher) name
the same keys, so they live here, without torch.

Three stores hold them:

    the run's store     the TCPStore the launcher hosts, or the coordinator's (cluster/store.py):
                        what every shard group shares (admissions decided for whole replicas).
    a world's store     the run's store under the world's `namespace` ("" without shards,
                        "shard{s}" for shard group s): the first-start barrier, heartbeats,
                        epochs, operations, metrics, admission and the end of the run. The
                        rendezvous keeps its state under RENDEZVOUS there.
    a round's store     the store a rendezvous round hands its participants: who took part, the
                        epoch it forms, and the gloo group built over it.

Keys that name a worker take its fixed rank (with shards: its replica).
"""

from __future__ import annotations

import json

# ---- a world's store: the first-start barrier (each shard group has its own rendezvous)
STARTED = "ft/started"  # the world's first starts counted in, then ALL_STARTED lets them on
ALL_STARTED = "ft/all_started"


def count_start(store, world_size: int) -> None:
    """Count one first start in (a worker's own, or the coordinator's for a slot it freed);
    the count that reaches `world_size` opens ALL_STARTED."""
    if store.add(STARTED, 1) == world_size:
        store.set(ALL_STARTED, "1")


# ---- the run's store
def namespace(shard: int, shards: int) -> str:
    """Store prefix of shard group `shard`'s fault-tolerant world ("" without shards)."""
    return f"shard{shard}" if shards > 1 else ""


def replica_group(replica: int, incarnation: int) -> str:
    """Store prefix of one start of a replica's own process group (its S shards)."""
    return f"replica{replica}/{incarnation}"


def admit(round_idx: int) -> str:
    """With shards: whether restarted replicas are admitted at this round end ("1" or "0")."""
    return f"ft/admit/{round_idx}"


def ready(worker: int) -> str:
    """With shards: a restarted replica whose S processes have all asked to join."""
    return f"ft/ready/{worker}"


# ---- a world's store: who is alive
def heartbeat(worker: int) -> str:
    """A counter the worker's heartbeat thread adds to every heartbeat period."""
    return f"ft/hb/{worker}"


def incarnation(worker: int) -> str:
    """How many times the launcher has started the worker (1: its first start)."""
    return f"ft/incarnation/{worker}"


def evict(worker: int, incarnation: int) -> str:
    """Set: this incarnation of the worker is cut out of the rendezvous (stuck past a deadline)."""
    return f"ft/evict/{worker}:{incarnation}"


RENDEZVOUS = "ft/rdzv"  # prefix of the rendezvous handler's own state
EPOCHS = "ft/epochs"  # counter: epochs are numbered run-wide


# ---- a world's store: epochs and operations
def broken(epoch: int) -> str:
    """Why the epoch failed (the first reason written wins)."""
    return f"ft/ep/{epoch}/broken"


def members(epoch: int) -> str:
    """The epoch's members (JSON list)."""
    return f"ft/ep/{epoch}/members"


def next_epoch(epoch: int) -> str:
    """The epoch the members of `epoch` went on to (how a worker left behind learns it)."""
    return f"ft/ep/{epoch}/next"


def low(epoch: int, worker: int) -> str:
    """What the worker posts when it enters `epoch` (JSON): the lowest operation it still had
    pending ("low") and the operations it had finished, each with the members whose inputs its
    result holds ("done"), so that one finished anywhere is shared, not run again."""
    return f"ft/ep/{epoch}/low/{worker}"


def posted(worker: int) -> str:
    """The worker's last posted operation (who is stuck, at a deadline)."""
    return f"ft/posted/{worker}"


# ---- a world's store: rounds, metrics and admission
def metric(k: int, worker: int) -> str:
    """The worker's logging scalars of its k-th round (JSON list)."""
    return f"ft/metric/{k}/{worker}"


def at(worker: int) -> str:
    """The worker's last finished round."""
    return f"ft/at/{worker}"


def round_decision(round_idx: int) -> str:
    """Whether the members re-rendezvous at this round end: "{0 or 1}@{epoch}"."""
    return f"ft/round/{round_idx}"


def donor_digest(round_idx: int, donor: int, joiner: int) -> str:
    """The hash of the state `donor` sent `joiner` at this round end (the joiner compares). It
    names the whole transfer: a digest written for another round or pair is never read here."""
    return f"ft/donor_digest/{round_idx}/{donor}/{joiner}"


def refused_donors(worker: int) -> str:
    """The donors whose state the worker refused since it last rejoined (JSON list, in the
    order refused): its next admission asks another (comm/rendezvous.py `donor_after`)."""
    return f"ft/refused_donors/{worker}"


def record(token: str) -> str:
    """A joiner's "rejoined" record ("worker:incarnation"), for worker 0's log."""
    return f"ft/record/{token}"


# ---- a world's store: the end of the run
def final_members(worker: int) -> str:
    """The members of the worker's last epoch (JSON list), set when it finished training."""
    return f"ft/final_members/{worker}"


def finished(worker: int) -> str:
    return f"ft/finished/{worker}"


DONE = "ft/done"  # some worker finished training: a process that dies now is not restarted


# ---- a rendezvous round's store
ROUND_EPOCH = "epoch"  # the epoch number the round forms
GROUP = "pg"  # prefix of the round's gloo group


def who(position: int) -> str:
    """What the round's participant at `position` was doing (comm/rendezvous.py)."""
    return f"who/{position}"


# ---- values read by the processes that watch a run (any member may have written them)
def parse_members(raw: bytes, workers: int) -> list[int]:
    """A `final_members` value: a JSON list of 1 to `workers` workers, each in [0, `workers`);
    ValueError saying what it holds otherwise."""
    try:
        members = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not JSON: {raw[:60]!r}") from None
    if (
        type(members) is not list
        or not 1 <= len(members) <= workers
        or any(type(m) is not int or not 0 <= m < workers for m in members)
    ):
        raise ValueError(f"not a list of 1 to {workers} workers in [0, {workers}): {raw[:60]!r}")
    return members
