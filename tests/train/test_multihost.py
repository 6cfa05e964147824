"""The multi-machine launch, run as two torchrun node agents on one machine: the documented
command on each "machine", one c10d rendezvous endpoint on a free port, one run directory. A
worker of node 1 is SIGKILLed mid-run; torchrun restarts every worker and they go on from the
newest checkpoint. A second launch of the same two agents resumes the stopped run. The result
equals, bit for bit, the simulation of the same config (one process, a second), which
tests/sim/test_sim_equality.py proves equal to locally spawned worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.gloo_pool import free_port

from frugaltrain.cli import main
from frugaltrain.config import Config, ConfigError, to_toml
from frugaltrain.metrics.log import read_metrics
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train import checkpoint, launch, nodes

# One worker per node: two per node cost twice the time (process starts) and test no more
# on two nodes than tests/train/test_launch_torchrun.py does on one (a second local rank).
NODES, PER_NODE = 2, 1
WORKERS = NODES * PER_NODE
SETS = (
    f"run.workers={WORKERS}",
    "run.steps=48",  # 8 rounds of H = 6
    "run.checkpoint_every=1",
    "run.deterministic_comm=true",
    "run.name='mh'",
)


def _node_agents(args: list[str], cwd: Path, tag: str, wrapper: bool) -> list[subprocess.Popen]:
    """Two node agents, as on two machines: the same command, one endpoint on a free port.
    Plain torchrun (node 0 told to host the rendezvous store: on real machines torchrun sees
    that from the endpoint's host name), or `frugaltrain train --nodes`, which runs torchrun."""
    endpoint = f"127.0.0.1:{free_port()}"
    # TMPDIR: torchrun keeps its log directory there; the test's own, not the machine's /tmp.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(cwd)}
    if not wrapper:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    agents = []
    for node in range(NODES):
        if wrapper:
            cmd = [sys.executable, "-m", "frugaltrain", "train", f"--nodes={NODES}"]
            cmd += ["--node-rank", str(node), "--rdzv", endpoint, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}"]
            cmd += [f"--nproc-per-node={PER_NODE}", "--rdzv-backend=c10d", "--rdzv-id=mh"]
            cmd += [f"--rdzv-endpoint={endpoint}", f"--rdzv-conf=is_host={node == 0}"]
            cmd += ["--max-restarts=1", "-m", "frugaltrain", "train", *args]
        log = open(cwd / f"{tag}_node{node}.log", "w")  # noqa: SIM115
        # A session of its own: the finally below can stop all the agent started.
        agents.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    return agents


FINISH_S = 240  # both agents' runs, one deadline: the tests' pytest timeouts leave room for it


def _finish(agents: list[subprocess.Popen], cwd: Path, tag: str) -> list[str]:
    """Wait for both agents, FINISH_S in all; returns their logs (each must have succeeded)."""
    deadline = time.monotonic() + FINISH_S
    for agent in agents:
        agent.wait(timeout=max(0.0, deadline - time.monotonic()))
    logs = [(cwd / f"{tag}_node{k}.log").read_text() for k in range(NODES)]
    for agent, log in zip(agents, logs, strict=True):
        assert agent.returncode == 0, log[-4000:]
    return logs


def _stop(agents: list[subprocess.Popen]) -> None:
    """Kill what is left: each agent's workers (torchrun gives them sessions of their own), then
    the agent's session."""
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # each may end by itself meanwhile
                for pid in _workers_of(agent):
                    os.kill(pid, signal.SIGKILL)
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def _workers_of(agent: subprocess.Popen) -> dict[int, dict[str, str]]:
    """The worker processes torchrun started under `agent`: pid -> their environment."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == agent.pid:
                raw = (proc / "environ").read_bytes().split(b"\0")
                found[int(proc.name)] = dict(v.decode().split("=", 1) for v in raw if b"=" in v)
        except OSError:  # exited meanwhile
            continue
    return found


def _wait_for(path: Path, agents: list[subprocess.Popen], timeout_s: float = 90) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert all(a.poll() is None for a in agents), "an agent exited before " + str(path)
        assert time.monotonic() - t0 < timeout_s, f"no {path} after {timeout_s} s"
        time.sleep(0.02)


def _kill_one_worker(agents: list[subprocess.Popen]) -> dict[str, str]:
    """SIGKILL one of node 1's workers (stopped first, so it cannot finish meanwhile); returns
    its environment. Checks that the two nodes hold distinct node ranks and global ranks."""
    workers = [_workers_of(a) for a in agents]
    assert [len(w) for w in workers] == [PER_NODE] * NODES, workers
    groups = [{env["GROUP_RANK"] for env in w.values()} for w in workers]
    assert len(groups[0]) == len(groups[1]) == 1 and groups[0] != groups[1]
    ranks = sorted(int(env["RANK"]) for w in workers for env in w.values())
    assert ranks == list(range(WORKERS))
    pid, env = max(workers[1].items())
    os.kill(pid, signal.SIGSTOP)
    state, t0 = "R", time.monotonic()
    while state not in ("T", "Z") and time.monotonic() - t0 < 10:  # the signal is asynchronous
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "T", f"worker {pid} had finished before it was stopped ({state})"
    os.kill(pid, signal.SIGKILL)
    return env


@dataclass
class FirstLaunch:
    """What the first launch left: its config and directory, and what was seen right after."""

    cfg: Config
    root: Path
    run_dir: Path
    killed: dict[str, str]  # the killed worker's environment
    logs: list[str]  # each agent's output
    dirs: list[str]  # the run directories under run.out_dir
    rounds: list[int]  # the round records then in metrics.jsonl
    manifest: dict  # the COMPLETE manifest of the last checkpoint


@pytest.fixture(scope="module")
def first_launch(config_factory, tmp_path_factory) -> FirstLaunch:
    """Two node agents (plain torchrun, --max-restarts 1) train to round 5; node 1's worker is
    SIGKILLed after the first checkpoint."""
    root = tmp_path_factory.mktemp("multihost")
    cfg = config_factory(root / "runs", *SETS)
    (root / "mh.toml").write_text(to_toml(cfg))
    run_dir = root / "runs" / "mh"
    args = ["--config", str(root / "mh.toml"), "--set", "run.stop_at_round=5"]
    agents = _node_agents(args, root, "first", wrapper=False)
    try:
        _wait_for(run_dir / "checkpoints" / "round_000001" / "COMPLETE", agents)
        killed = _kill_one_worker(agents)
        logs = _finish(agents, root, "first")
    finally:
        _stop(agents)
    last = checkpoint.latest_complete(run_dir)
    checkpoint.verify(last)
    return FirstLaunch(
        cfg=cfg,
        root=root,
        run_dir=run_dir,
        killed=killed,
        logs=logs,
        dirs=[p.name for p in (root / "runs").iterdir()],
        rounds=[
            r["round"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "round"
        ],
        manifest=json.loads((last / "COMPLETE").read_text()),
    )


@pytest.mark.timeout(420)  # with the first launch's setup: 90 s to start, FINISH_S to end
def test_two_node_agents_survive_a_killed_worker(first_launch):
    run = first_launch
    assert f"local_rank: {run.killed['LOCAL_RANK']}" in run.logs[1]
    assert "exitcode: -9" in run.logs[1]  # torchrun saw its worker killed, and restarted
    assert "resuming from round_00000" in "".join(run.logs)  # rank 0 says where it went on
    assert run.dirs == ["mh"]  # the restart kept the run directory
    assert run.manifest["round"] == 5  # both nodes wrote this one, listing every worker
    assert sorted(run.manifest["files"]) == [f"worker_{r}.pt" for r in range(WORKERS)]
    assert run.rounds == [1, 2, 3, 4, 5]  # each round logged once, redone rounds included


@pytest.mark.timeout(420)  # the first launch's setup, if this runs first, then FINISH_S
def test_two_node_agents_resume_exactly(first_launch):
    """The same two machines resume the stopped run to its end, by `frugaltrain train --nodes`
    this time; equal, bit for bit, to the simulation of the whole run."""
    run = first_launch
    agents = _node_agents(["--resume", str(run.run_dir)], run.root, "second", wrapper=True)
    try:
        logs = _finish(agents, run.root, "second")
    finally:
        _stop(agents)
    assert "[launcher] machine 1 of 2: torchrun --nnodes=2 --nproc-per-node=1" in logs[1]
    assert "resuming from round_000005" in "".join(logs)
    final = checkpoint.latest_complete(run.run_dir)
    assert final.name == "round_000008"
    records = read_metrics(run.run_dir / "metrics.jsonl")
    assert [r["round"] for r in records if r.get("kind") == "round"] == list(range(1, 9))
    assert [r["step"] for r in records if r.get("kind") == "step"] == list(range(1, 49))

    reference = simulate(run.cfg, SimSection(ratio=0.887), run.root / "sim")
    for rank, model in enumerate(reference.models):
        state = torch.load(final / f"worker_{rank}.pt", weights_only=False)
        assert state["step"] == 48
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), state["model"][name]), (rank, name)


def test_torchrun_refuses_what_it_cannot_run(make_config, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    ft = make_config("fault_tolerance.enabled=true")
    with pytest.raises(ConfigError, match="fault_tolerance.enabled = true: under torchrun"):
        launch._join_torchrun(ft)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        launch._join_torchrun(make_config())


def test_nodes_flags_build_the_torchrun_command(make_config):
    cfg = make_config("run.workers=4", "run.name='job'")
    argv = ["--nodes", "2", "--node-rank=1", "--rdzv", "h:29400", "--config", "c.toml"]
    cmd = nodes.torchrun_command(cfg, 2, 1, "h:29400", [*argv, "--set", "run.steps=9"])
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=h:29400",
        "--rdzv-id=frugaltrain-job",
        "--rdzv-conf=is_host=0",
        "--max-restarts=3",
        *("-m", "frugaltrain", "train", "--config", "c.toml", "--set", "run.steps=9"),
    ]
    assert "--rdzv-conf=is_host=1" in nodes.torchrun_command(cfg, 2, 0, "h:29400", [])


@pytest.mark.parametrize(
    ("sets", "where", "argv", "error"),
    [
        (("run.workers=3",), (2, 0, "h:1"), [], "make run.workers a multiple of 2"),
        ((), (2, 2, "h:1"), [], r"--node-rank 2: give N >= 1 machines and this machine's rank"),
        ((), (2, 0, "h"), [], "--rdzv 'h': give HOST:PORT"),
        ((), (None, 1, None), [], "--nodes, --node-rank and --rdzv go together"),
        ((), (2, 0, "h:1"), ["--baseline", "diloco"], "launch the baseline on its own"),
        (
            ("fault_tolerance.enabled=true",),
            (2, 0, "h:1"),
            [],
            "fault_tolerance.enabled = true: under",
        ),
    ],
)
def test_nodes_flags_refuse_bad_input(make_config, sets, where, argv, error):
    with pytest.raises(ConfigError, match=error):
        nodes.torchrun_command(make_config("run.workers=2", *sets), *where, argv)


def test_nodes_flags_are_checked_before_torchrun_starts(tmp_path, capsys):
    assert main(["train", "--node-rank", "1", "--rdzv", "h:1"]) == 2
    assert "--nodes, --node-rank and --rdzv go together" in capsys.readouterr().err
    assert main(["train", "--nodes", "2", "--node-rank", "1", "--resume", str(tmp_path)]) == 2
    assert f"--resume {tmp_path}: no config.toml there" in capsys.readouterr().err
