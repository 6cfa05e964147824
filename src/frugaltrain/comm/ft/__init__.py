"""The fault-tolerant runtime: torch.distributed with membership epochs, deadlines and rejoin.

Engine: torch elastic's rendezvous (`DynamicRendezvousHandler`, c10d backend, on the TCPStore
the launcher hosts) decides who is in each membership epoch (comm/rendezvous.py); each epoch gets
a fresh gloo process group over the store of its rendezvous round. docs/fault_tolerance.md
explains why this and not torchft.

The parts (their store keys are in cluster/keys.py, which the coordinator reads too):

    heartbeat.py      the heartbeat thread, and reading a member's beat (straggler or silent?).
    elastic_world.py  one worker's epoch, members, gloo group and membership records; moving to
                      the next epoch through the rendezvous; the exit of a worker left behind.
    operation_log.py  the operation log: post, wait (deadlines, silent members, evicting stuck
                      ones), recover and re-post.
    mix1.py           Mix1 point to point with a deadline.
    comm.py           ElasticComm: the Comm a strategy sees (collectives over the operation log,
                      Mix1, the guard on what arrived).
    round_scalars.py  per-round logging scalars through the store.
    admission.py      admitting a restarted worker at a round end, and the donor's state transfer
                      (in comm/state_format.py's format, which cannot run code when read).
    runtime.py        ElasticRuntime: the loop's side (round end, rejoin, round fields, records).

Fault injection is a layer around these (comm/faulty.py), put on by the supervisor.

How a failure is handled (every worker runs the same code):

    post    every operation (all-reduce, gather, metric, barrier) gets a sequence number; all
            workers post the same operations in the same order (operation_log.py).
    wait    fails on a gloo error, a member's stopped heartbeat, the adaptive deadline, or an
            epoch another worker marked broken (operation_log.py). Groups of past epochs are kept,
            never destroyed (a gloo group's destructor waits for its pending operations, up to
            run.timeout_s).
    recover mark epoch e broken (the first reason wins) and re-rendezvous: the round closes
            once every old participant has left it or been dropped for a missed keep-alive
            (dead, stopped, cut off), and the survivors form the next one. A member the others
            went on without finds out before it asks again, or in the round, and exits with
            code 75; the launcher restarts it as a joiner. The survivors build the new group
            and re-post every operation from the lowest one any of them still has pending.
    rejoin  a restarted worker (incarnation > 1) waits on the rendezvous's wait list and is
            admitted at a round end, taking a live member's whole state (admission.py).

Two things never wait on a straggler (only the participants of blocking operations do): Mix1
(mix1.py) and the per-round logging scalars (round_scalars.py).

Membership changes are printed with a worker/round prefix and handed to worker 0's metrics log
as `"kind": "membership"` records.

With run.shards = S > 1 (docs/sharding.md) there is one such world per shard index s: its
members are the replicas, each represented by its shard-s process, and its keys live under the
store prefix `shard{s}`. A dead process takes its whole replica out (the launcher stops the
siblings and restarts all S), so every shard group loses and regains the same member. What must
agree across the S groups goes through the replica's ReplicaShards (comm/replica_shards.py): the
guard's norms, which Mix1 messages count (those that arrived at every shard), and when a restarted
replica is admitted (admission.py).
"""
