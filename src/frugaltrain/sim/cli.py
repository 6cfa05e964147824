"""`frugaltrain simulate CONFIG [--set KEY=VALUE ...]`: run a config's workers as virtual workers
on a simulated clock (sim/engine.py) and print the summary. The config is a training config plus
an optional [sim] table (sim/config.py); every time figure it prints is simulated.

    frugaltrain simulate examples/sim_fgd.toml --set sim.ratio=1.774 --set run.workers=16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from frugaltrain.config import ArgumentParser, ConfigError, add_set_flag


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="frugaltrain simulate", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="TOML config (training sections plus [sim])")
    add_set_flag(p, "sim.ratio=0.887")
    p.add_argument("--out", help="run directory (default: run.out_dir/run.name-sim)")
    args = p.parse_args(argv)
    from frugaltrain.sim.config import load_sim_config
    from frugaltrain.sim.engine import simulate

    try:
        cfg, sim = load_sim_config(args.config, args.set)
        out = Path(args.out) if args.out else Path(cfg.run.out_dir) / f"{cfg.run.name}-sim"
        result = simulate(cfg, sim, out)
    except ConfigError as e:
        print(f"frugaltrain: error: {e}", file=sys.stderr)
        return 2
    s = {k: v for k, v in result.summary.items() if k != "events"}
    print(json.dumps(s, indent=1))
    print(energy_line(result.summary))
    print(f"metrics: {out / 'metrics.jsonl'} (all times simulated)")
    return 0


def energy_line(s: dict) -> str:
    """One readable line: the simulated cluster's estimated energy and its parts, the analytic
    FLOPs, and what the simulation itself cost this host."""
    total = s["energy/joules"]
    share = f"{100 * s['energy/comm_j'] / total:.3g}%" if total > 0 else "-"
    host = s.get("energy/host_joules")
    host_j = "-" if host is None else f"{host:.4g} J"
    return (
        f"energy (simulated cluster) {total / 1e3:.4g} kJ = compute "
        f"{s['energy/compute_j'] / 1e3:.4g} kJ + idle {s['energy/idle_j'] / 1e3:.4g} kJ "
        f"+ comm {s['energy/comm_j']:.4g} J "
        f"({share} comm), {s['energy/label']}; training FLOPs {s['flops/train']:.4g} "
        f"({s['flops/label']}); this host: {host_j} ({s['energy/host_label']})"
    )


if __name__ == "__main__":
    sys.exit(main())
