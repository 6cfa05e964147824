"""Fault tolerance across replicas, not inside them: 2 replicas of 2 shards (4 gloo processes),
one process of replica 1 killed mid-round. Its sibling goes down with it (the launcher stops the
replica whole), replica 0 goes on alone, and replica 1 comes back: both its shards take their
state from replica 0's matching shard, at the same round end in both shard groups.

FGD (GlobalM1LocalM2): Mix1 goes point to point with a deadline and counts a message only if it
arrived at every shard of the replica; with two replicas both mixes are complete, so the
replicas hold the same parameters at every round end, and the rejoined one must too.

Every worker sleeps 0.1 s after each inner step (an injected straggler on all of them: no CPU
used) so the restarted replica (two fresh processes importing torch) is back before the end.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from frugaltrain.metrics.log import read_metrics
from frugaltrain.train import checkpoint, launch

SETS = [
    "run.workers=2",
    "run.shards=2",
    "outer.strategy='fgd'",
    "outer.fgd.preset='GlobalM1LocalM2'",
    "model.n_layer=2",
    "outer.H=2",
    "run.steps=48",
    "run.eval_every=0",
    "run.checkpoint_every=8",
    "run.threads=1",
    "fault_tolerance.enabled=true",
    "run.timeout_s=20",
    "fault_tolerance.inject='kill:worker=1,round=3;slow:seconds=0.1'",
]


def _replica_params(ckpt, replica: int) -> dict[str, torch.Tensor]:
    """A replica's model from its DCP directory, whole, in this process."""
    path = ckpt / f"replica_{replica}"
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model = {
        k.removeprefix("model."): torch.empty(m.size)
        for k, m in meta.items()
        if k.startswith("model.")
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=path, no_dist=True)
    return model


def test_a_dead_process_takes_its_replica_out_and_the_replica_rejoins(
    config_factory, tmp_path, capfd
):
    cfg = config_factory(tmp_path, *SETS)
    run_dir = launch.new_run_dir(cfg)
    launch.run(cfg, run_dir)
    out = capfd.readouterr().out
    assert "[launcher] replica 1 (process 2) exited" in out and "restarting its 2 processes" in out

    records = read_metrics(run_dir / "metrics.jsonl")
    events = [r for r in records if r.get("kind") == "membership"]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "left" and events[0]["workers"] == [1], events
    assert "joined" in kinds and "rejoined" in kinds, events
    rejoined = next(e for e in events if e["event"] == "rejoined")
    assert rejoined["match"], rejoined  # every shard equals its donor's, bit for bit
    assert events[-1]["members"] == [0, 1]
    # Replica 0 went on: every round was logged.
    assert [r["round"] for r in records if r.get("kind") == "round"] == list(range(1, 25))

    # At the end both replicas hold the same parameters (complete mixes of two replicas).
    final = checkpoint.latest_intact(run_dir)
    assert final.name == "round_000024"
    a, b = _replica_params(final, 0), _replica_params(final, 1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
