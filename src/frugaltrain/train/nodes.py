"""`frugaltrain train --nodes N --node-rank K --rdzv HOST:PORT`: this machine's share of a run
across N machines, started by torchrun with what such a run needs (docs/multihost.md). Every
machine runs the same command with its own K; K = 0 on the machine at HOST.

    frugaltrain train --nodes 2 --node-rank 1 --rdzv 10.0.0.1:29400 --config my.toml

runs, on that machine (run.workers = 8, fault_tolerance.max_restarts = 3, run.name = "my"):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc-per-node=4 \\
        --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=frugaltrain-my \\
        --rdzv-conf=is_host=0 --max-restarts=3 -m frugaltrain train --config my.toml
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from frugaltrain.config import Config, ConfigError, build_config, load_config, read_toml
from frugaltrain.train.launch import check_torchrun

NODE_FLAGS = ("--nodes", "--node-rank", "--rdzv")


def node_config(config_path: str | None, overrides: list[str], resume: str | None) -> Config:
    """The config the workers will run: the given one, or the saved one of a resumed run."""
    if not resume:
        return load_config(config_path, overrides)
    saved = Path(resume) / "config.toml"
    if not saved.is_file():
        raise ConfigError(f"--resume {resume}: no config.toml there; pass a run directory")
    return build_config(Config, read_toml(saved), overrides)


def torchrun_command(
    cfg: Config, nodes: int | None, node_rank: int | None, rdzv: str | None, argv: list[str]
) -> list[str]:
    """The torchrun command line of machine `node_rank`; `argv` are this command's `train`
    arguments, passed on without the node flags."""
    if nodes is None or node_rank is None or rdzv is None:
        raise ConfigError(
            "--nodes, --node-rank and --rdzv go together: --nodes N --node-rank K "
            "--rdzv HOST:PORT on each of the N machines"
        )
    if nodes < 1 or not 0 <= node_rank < nodes:
        raise ConfigError(
            f"--nodes {nodes} --node-rank {node_rank}: give N >= 1 machines and this machine's "
            f"rank K in 0..N-1 (0 on the machine at --rdzv)"
        )
    if cfg.run.workers % nodes:
        raise ConfigError(
            f"run.workers = {cfg.run.workers}: every machine runs run.workers / --nodes workers; "
            f"make run.workers a multiple of {nodes}"
        )
    host, _, port = rdzv.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"--rdzv {rdzv!r}: give HOST:PORT, machine 0's address as the others reach it and a "
            "free port there, e.g. --rdzv 10.0.0.1:29400"
        )
    if any(a == "--baseline" or a.startswith("--baseline=") for a in argv):
        raise ConfigError("--baseline runs a second local run; launch the baseline on its own")
    check_torchrun(cfg)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}"]
    # A worker is run.shards processes with consecutive ranks: whole replicas on each machine.
    per_node = cfg.run.workers * cfg.run.shards // nodes
    cmd += [f"--nproc-per-node={per_node}", "--rdzv-backend=c10d"]
    cmd += [f"--rdzv-endpoint={rdzv}", f"--rdzv-id=frugaltrain-{cfg.run.name}"]
    # Machine 0 hosts the rendezvous store; said explicitly, not guessed from host names.
    cmd += [
        f"--rdzv-conf=is_host={int(node_rank == 0)}",
        f"--max-restarts={cfg.fault_tolerance.max_restarts}",
    ]
    return [*cmd, "-m", "frugaltrain", "train", *_without_node_flags(argv)]


def _without_node_flags(argv: list[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in NODE_FLAGS:
            skip = True  # and its value
        elif not arg.startswith(tuple(f"{flag}=" for flag in NODE_FLAGS)):
            kept.append(arg)
    return kept


def launch_node(
    config_path: str | None,
    overrides: list[str],
    resume: str | None,
    nodes: int | None,
    node_rank: int | None,
    rdzv: str | None,
    argv: list[str],
) -> int:
    """Check the run, then become torchrun for this machine's workers (never returns)."""
    cmd = torchrun_command(
        node_config(config_path, overrides, resume), nodes, node_rank, rdzv, argv
    )
    # Restarts need the workers' store apart from torchrun's own, whose keys outlive the
    # workers that wrote them (restarted workers would dial the dead ones' addresses).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    print(f"[launcher] machine {node_rank} of {nodes}: torchrun {shlex.join(cmd[3:])}", flush=True)
    os.execve(sys.executable, cmd, env)
    return 1  # not reached
