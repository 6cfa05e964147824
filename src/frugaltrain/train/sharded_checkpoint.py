"""Checkpoints of sharded replicas (run.shards > 1) with torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/round_000010/replica_0/ ... replica_{M-1}/, one DCP checkpoint per
replica written by its S processes (`__s_0.distcp` each, and shard 0 the `.metadata`), then the
same COMPLETE manifest as worker files (train/checkpoint.py), with "shards": S.

What is in a replica's checkpoint, and how it reshards:

    model, inner        FSDP2's DTensors (get_state_dict: keyed by parameter name); DCP keeps
                        every tensor's global shape and each shard's offsets, so a replica
                        saved by S processes loads into any S', 1 included (a plain model)
    outer, momentum     the outer strategy's x and outer momentum, shard by shard, saved as
                        DTensors of their parameter's layout: they reshard the same way
    progress            step, round, tokens, data position, schedule, outer optimizer groups
    process.shard{s}    what is each process's own: its RNG, and a sparse codec's error
                        feedback (a flat residual of this shard's elements, which does not
                        reshard: the launcher refuses a sparse codec with another S)

Guarantees, next to DCP's: each process hashes the files it wrote (a `.sha256` beside each,
written atomically) and COMPLETE is written last, after every replica's save has returned; a
file changed afterwards fails `verify` by its hash, and a crash mid-save leaves no COMPLETE, so
`--resume` never takes it (train/checkpoint.py). DCP writes its data files in place (not through
a temporary name); its `.metadata` comes last.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from frugaltrain.train import checkpoint
from frugaltrain.train.sharding import Shards, like, shard_full


def replica_dir(ckpt_dir: Path, replica: int) -> Path:
    return Path(ckpt_dir) / f"replica_{replica}"


def _blob(value) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def _unblob(buf: io.BytesIO):
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def save(w, ckpt_dir: Path, replica: int) -> None:
    """Write worker `w`'s replica (collective over its S processes) to ckpt_dir/replica_N and
    hash this process's files. `w` is a train.loop.Worker with shards."""
    shards: Shards = w.shards
    path = replica_dir(ckpt_dir, replica)
    model_sd, inner_sd = get_state_dict(w.model, w.inner)
    whole = w.state()
    outer = whole["outer"]
    params = dict(w.model.named_parameters())
    momenta = {i: s["momentum_buffer"] for i, s in outer["opt"]["state"].items()}
    state = {
        "model": model_sd,
        "inner": inner_sd,
        "outer": _global(params, w.strategy.names, outer["outer"]),
        "progress": _blob(_progress(whole)),
        f"process.shard{shards.index}": _blob({"rng": whole["rng"], "feedback": outer["feedback"]}),
    }
    if momenta:
        names = w.strategy.names
        state["momentum"] = {names[i]: like(params[names[i]], m) for i, m in momenta.items()}
    dcp.save(state, checkpoint_id=path, process_group=shards.group)
    mine = sorted(path.glob(f"__{shards.index}_*.distcp"))
    if shards.index == 0:
        mine.append(path / ".metadata")
    for f in mine:
        checkpoint.write_hash(f)


def _progress(whole: dict) -> dict:
    """What every process of a replica holds alike (saved once)."""
    keep = {k: whole[k] for k in ("step", "round", "tokens", "data", "schedule")}
    outer = whole["outer"]
    return {**keep, "outer_round": outer["round"], "outer_groups": outer["opt"]["param_groups"]}


def load(w, ckpt_dir: Path, replica: int) -> dict:
    """Load replica `replica` of a DCP checkpoint into worker `w` (any shards: the model and
    inner optimizer go in here, resharded by DCP); returns the rest as a worker state for
    `Worker.load(state, weights=False)`."""
    shards: Shards | None = w.shards
    path = replica_dir(ckpt_dir, replica)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_sd, inner_sd = get_state_dict(w.model, w.inner)
    params = dict(w.model.named_parameters())
    names = w.strategy.names
    local = w.strategy.state_dict()["outer"]
    state = {
        "model": model_sd,
        "inner": inner_sd,
        "outer": _global(params, names, local),
        "progress": io.BytesIO(),
    }
    own = f"process.shard{shards.index if shards else 0}"
    own = own if own in saved else "process.shard0"  # resharded: shard 0's RNG
    state[own] = io.BytesIO()
    moved = [i for i, n in enumerate(names) if f"momentum.{n}" in saved]  # after a round
    if moved:
        zeros = [torch.zeros_like(local[i]) for i in moved]
        state["momentum"] = _global(params, [names[i] for i in moved], zeros)
    if shards is None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(state, checkpoint_id=path, process_group=shards.group)
    set_state_dict(
        w.model, w.inner, model_state_dict=state["model"], optim_state_dict=state["inner"]
    )
    return _worker_state(state, names, _unblob(state["progress"]), _unblob(state[own]))


def _worker_state(state: dict, names: list[str], progress: dict, mine: dict) -> dict:
    """A loaded DCP state in the form of train.loop.Worker.state() (local tensors), without
    the model and inner optimizer (already in place)."""
    local = [_local(state["outer"][n]) for n in names]
    momenta = state.get("momentum", {})
    moved = {
        i: {"momentum_buffer": _local(momenta[n])} for i, n in enumerate(names) if n in momenta
    }
    opt = {"state": moved, "param_groups": progress["outer_groups"]}
    outer = {"outer": local, "opt": opt, "round": progress["outer_round"]}
    return {
        "schedule": progress["schedule"],
        "outer": {**outer, "feedback": mine["feedback"]},
        "rng": mine["rng"],
        "data": progress["data"],
        "step": progress["step"],
        "round": progress["round"],
        "tokens": progress["tokens"],
    }


def _global(params: dict, names: list[str], local: list[torch.Tensor]) -> dict:
    """{name: the local shard as a tensor of its parameter's global layout}."""
    return {n: like(params[n], x) for n, x in zip(names, local, strict=True)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def shard_worker_state(state: dict, w) -> dict:
    """A whole worker's state (a worker file, written with run.shards = 1) cut to this
    process's shards, in the form `Worker.load` takes for a sharded worker."""
    params = dict(w.model.named_parameters())
    model = {k: shard_full(params[k], v) if k in params else v for k, v in state["model"].items()}
    order = [p for g in w.inner.param_groups for p in g["params"]]
    inner = dict(state["inner"])
    inner["state"] = {
        i: {k: _cut(order[i], v) for k, v in s.items()} for i, s in state["inner"]["state"].items()
    }
    outer = dict(state["outer"])
    named = [params[n] for n in w.strategy.names]
    outer["outer"] = [shard_full(p, x) for p, x in zip(named, outer["outer"], strict=True)]
    opt = dict(outer["opt"])
    opt["state"] = {
        i: {k: _cut(named[i], v) for k, v in s.items()} for i, s in opt["state"].items()
    }
    outer["opt"] = opt
    return {**state, "model": model, "inner": inner, "outer": outer}


def _cut(param: torch.Tensor, value):
    """An optimizer state entry of `param`: its shard if it is a tensor of the param's shape."""
    if torch.is_tensor(value) and value.shape == param.shape:
        return shard_full(param, value)
    return value
