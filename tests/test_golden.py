"""Golden final parameters: a short seeded run of every outer strategy, FORGE as inner optimizer,
the simulator and both local launchers ends with the parameters recorded in
tests/golden/final_params.json. A refactor that changes behaviour changes a hash here.

The hashes are bitwise (sha256 of every worker's fp32 parameters). They hold on the CPU they were
recorded on: a CPU with other vector instructions (AMX, AVX-512 FP16, VNNI: other kernels) rounds
matmuls differently, so the file keeps one set per CPU feature set (`_cpu`). On a CPU with no set
recorded the test compares each worker's parameter norm to 1e-4 instead (a real behaviour change
moves it by far more) and says so in a warning. After an intended change regenerate with
FRUGALTRAIN_REGEN_GOLDEN=1 (this CPU's set only; review the diff); to add this CPU's set to the
others with the code unchanged, FRUGALTRAIN_REGEN_GOLDEN=add.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from helpers.gloo_pool import train_in_gloo_pool

from frugaltrain.config import to_toml
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train import launch

GOLDEN = Path(__file__).parent / "golden" / "final_params.json"
REGEN = os.environ.get("FRUGALTRAIN_REGEN_GOLDEN", "")
WORLD = 4
BASE = ("model.n_layer=2", "run.steps=12", "outer.H=4", "run.eval_every=0", "run.threads=1")
STRATEGIES = {
    "ddp": ("outer.strategy='ddp'",),
    "diloco": ("outer.strategy='diloco'",),
    "fgd-GlobalM1": ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'"),
    "fgd-GlobalM1LocalM2": ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'"),
    "noloco": ("outer.strategy='noloco'", "outer.momentum=0.5"),
    "streaming": (
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=1",
    ),
    "diloco-forge-adamw": ("outer.strategy='diloco'", "optim.name='forge-adamw'"),
}
SIMULATED = ("diloco", "fgd-GlobalM1LocalM2", "noloco")


def _digest(models_params: list[list[torch.Tensor]]) -> dict:
    """sha256 over every worker's fp32 parameters in order, plus each worker's fp64 norm."""
    h = hashlib.sha256()
    norms = []
    for params in models_params:
        for p in params:
            h.update(p.detach().float().contiguous().numpy().tobytes())
        norms.append(sum(p.detach().double().pow(2).sum().item() for p in params) ** 0.5)
    return {"sha256": h.hexdigest(), "norms": norms}


def _checkpoint_params(run_dir: Path, workers: int) -> list[list[torch.Tensor]]:
    last = sorted((run_dir / "checkpoints").glob("round_*"))[-1]
    states = [torch.load(last / f"worker_{i}.pt", weights_only=False) for i in range(workers)]
    return [list(s["model"].values()) for s in states]


@pytest.fixture(scope="module")
def digests(config_factory, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("golden")
    out: dict[str, dict] = {}

    jobs = []
    for name, sets in STRATEGIES.items():
        cfg = config_factory(root, *BASE, *sets, f"run.workers={WORLD}", f"run.name='{name}'")
        run_dir = launch.new_run_dir(cfg)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        jobs.append((name, cfg, str(run_dir)))
    real = train_in_gloo_pool(jobs, WORLD)
    for name in STRATEGIES:
        out[f"real/{name}"] = _digest([real[r][name] for r in range(WORLD)])

    for name in SIMULATED:
        cfg = config_factory(root, *BASE, *STRATEGIES[name], f"run.workers={WORLD}")
        result = simulate(cfg, SimSection(ratio=0.887), root / f"sim-{name}")
        out[f"sim/{name}"] = _digest([list(m.parameters()) for m in result.models])

    # The launchers: spawned local processes, and the fault-tolerant supervisor (no faults).
    for name, extra in (
        ("launch/fgd", ()),
        ("launch-ft/diloco", ("fault_tolerance.enabled=true",)),
    ):
        strategy = STRATEGIES["fgd-GlobalM1LocalM2" if "fgd" in name else "diloco"]
        cfg = config_factory(root, *BASE, *strategy, *extra, "run.workers=3")
        run_dir = launch.new_run_dir(cfg)
        launch.run(cfg, run_dir)
        out[name] = _digest(_checkpoint_params(run_dir, 3))
    return out


# CPU flags that select other matmul and reduction kernels, so other rounding.
_KERNEL_FLAGS = ("avx", "amx", "fma", "f16c", "vnni", "bf16", "fp16")


def _cpu() -> str:
    """The CPU feature set the hashes hold for: torch's capability, its version and a digest of
    the kernel-relevant CPU flags."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        line = next((x for x in cpuinfo.read_text().splitlines() if x.startswith("flags")), "")
        kept = sorted(f for f in line.split(":")[-1].split() if any(k in f for k in _KERNEL_FLAGS))
        flags = " flags " + hashlib.sha256(" ".join(kept).encode()).hexdigest()[:12]
    version = torch.__version__.split("+")[0]
    return f"{torch.backends.cpu.get_cpu_capability()} torch {version}{flags}"


def test_final_parameters_match_golden(digests):
    recorded = json.loads(GOLDEN.read_text())["cpus"] if GOLDEN.exists() else {}
    if REGEN:
        cpus = {**recorded, _cpu(): digests} if REGEN == "add" else {_cpu(): digests}
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"cpus": cpus}, indent=1) + "\n")
        pytest.skip(f"regenerated {GOLDEN.name} for {_cpu()}; review the diff")
    if _cpu() in recorded:
        for name, want in recorded[_cpu()].items():
            assert digests[name]["sha256"] == want["sha256"], name
        assert sorted(recorded[_cpu()]) == sorted(digests)
        return
    cpu, runs = next(iter(recorded.items()))
    warnings.warn(
        f"no golden hashes for this CPU ({_cpu()}): parameter norms compared at rel 1e-4 with "
        f"those of {cpu!r}, not bitwise; record this CPU with FRUGALTRAIN_REGEN_GOLDEN=add",
        stacklevel=1,
    )
    assert sorted(runs) == sorted(digests)
    for name, want in runs.items():  # other rounding of the same arithmetic: close, not bitwise
        assert digests[name]["norms"] == pytest.approx(want["norms"], rel=1e-4), name
