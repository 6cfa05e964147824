"""The control plane across machines, torch-free: what holds a run together while machines come
and go, as opposed to the data plane (comm/) that moves the tensors.

`frugaltrain coordinator` runs on these modules alone, so it stays a small process that trains
nothing; each machine's agent (train/agent.py, which starts the torch workers) and the local
launcher use them too, and the fault-tolerant runtime (comm/ft/, comm/rendezvous*.py) reads the
same store keys and rendezvous JSON. No module here imports torch, nor anything above config/,
metrics/ and faults (tests/test_architecture.py checks both).

The modules:

    coordinator.py      `frugaltrain coordinator`: holds the run's config, run directory and
                        slots, hosts the store behind the gateway, relays metrics, and resumes.
    store.py            the run's store: torch's TCPStore wire protocol served without torch,
                        with a journal so that a restarted coordinator finds it as it was.
    gateway.py          the coordinator's authenticated port, and a joining machine's tunnel
                        (StoreTunnel) through which its processes reach the store.
    auth.py             the run token and the mutual challenge-response; MAC-framed channels.
    keys.py             the fault-tolerant runtime's store keys, in one place.
    rendezvous_json.py  the rendezvous state as the store keeps it (JSON): parse, expire, refresh,
                        close, without torch elastic.
    run_store.py        the run's store as the processes watching a run use it: close or refresh
                        every shard group's rendezvous, forget a process that exited.
    run_dir.py          a run's directory: RUN.OUT_DIR/RUN.NAME, or the first free NAME-i.
    metrics_relay.py    the coordinator's metrics.jsonl, merged from the lines machines relay.
    status.py           status.html and metrics.prom (node_exporter) from a run directory, every
                        few seconds; `frugaltrain status RUN_DIR` prints the same.

docs/multihost.md shows a run across machines; docs/security.md what the token protects.
"""
