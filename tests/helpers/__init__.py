"""What several test folders share: worker pools on real gloo, sharded pools, tiny models, the
records a fault-tolerant run leaves, and a run across machines on this host."""
