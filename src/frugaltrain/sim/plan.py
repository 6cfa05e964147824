"""Which outer method reaches DiLoCo's model quality soonest in wall clock on your links: the
planner behind `frugaltrain plan` and `outer.strategy = "auto"`. It takes seconds.

Per method (config.AUTO_METHODS, by the name a user types: each an [outer] table as measured,
at DiLoCo's H or the fraction of it a method was measured at: H = 5 against DiLoCo's 10 plans
half of it). DiLoCo's H is the config's outer.H, unless the config is itself such a method:
then it is twice, or whatever the fraction makes it (baseline_H):

    step time      measured: 1 warm-up and 3 timed inner steps of this config's model, batch
                   and inner optimizer on this machine (step.inner_step), one step time for all
    links          given (each worker's rate in Mbit/s, point-to-point at the same rate) or
                   measured (a probe's effective all-reduce rate and pair-exchange ratio)
    clock          simulated: the simulator's clock of run.steps for the method (sim/clock.py,
                   equal to `simulate`'s), compute fixed at the step time
    steps needed   measured: the fraction of DiLoCo's steps the method took to reach DiLoCo's
                   final validation loss in benchmarks/time_to_loss.py (mean over seeds; the
                   penalties file says on which corpus, tuned on which)
    time to loss   estimated: the clock at that fraction of run.steps, and its ratio to DiLoCo's

The pick is the method with the shortest estimated time, given as the [outer] table that runs it
in this config (pick_table: its H resolved). Each method's estimate is also given at
its fastest and its slowest measured seed; where the pick's and the next method's overlap, the
reason says it is a near tie that the penalties cannot break. A method that never reached DiLoCo's
loss in the measurements gets no estimate, and one this config cannot run (e.g. ddp with FORGE)
says why. Evaluations are not counted (they cost every method the same).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
import warnings
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from frugaltrain.config import (
    AUTO_METHODS,
    OUTER_KEYS,
    PENALTIES,
    Config,
    ConfigError,
    build_config,
    to_dict,
)
from frugaltrain.config.base import section_toml
from frugaltrain.data.corpus import BatchSampler, load_corpus, shard_tokens, worker_seed
from frugaltrain.models import build_model
from frugaltrain.optim import build_inner_optimizer, build_schedule
from frugaltrain.sim.clock import clock
from frugaltrain.sim.config import SimSection
from frugaltrain.step import inner_step, worker_threads

BASELINE = "diloco"


def load_penalties(path: str = PENALTIES, key: str = "--penalties") -> dict:
    """The step penalties in `path` (relative to the working directory; config.PENALTIES by
    default): each method's [outer] table and measured step penalty, by the names of
    config.AUTO_METHODS, written by `python benchmarks/time_to_loss.py --penalties FILE` (each
    entry's "run" and "source": the run and the results file it was measured in). The package
    ships no measurement; the file's path goes in the "file" field, which a plan prints. A
    missing or unreadable file is refused naming `key`."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(
            f"{key} {path!r}: no such file; the planner weighs methods by measured step "
            "penalties: run from the repository's root (benchmarks/results/penalties.json) or "
            "write them with `python benchmarks/time_to_loss.py --penalties FILE`"
        )
    try:
        penalties = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key} {path!r}: not a penalties file ({e})") from None
    if not isinstance(penalties, dict) or not isinstance(penalties.get("methods"), dict):
        raise ConfigError(f'{key} {path!r}: not a penalties file (no "methods" table)')
    return {**penalties, "file": str(path)}


def check_methods(names: list[str], key: str, known: Collection[str] = AUTO_METHODS) -> None:
    """Refuse a method the planner does not know, naming the flag or key it came from."""
    for name in names:
        if name not in known:
            raise ConfigError(f"{key}: unknown method {name!r}; choose among {', '.join(known)}")


def method_H(cfg: Config, entry: dict, baseline: int | None = None) -> int:
    """The method's outer.H under `cfg`: DiLoCo's (`baseline`, default baseline_H), or for a
    method measured at a fraction of DiLoCo's H (penalties.json's H_fraction, e.g. 0.5 for
    rounds twice as often) that fraction of it, rounded, at least 1."""
    H = baseline or baseline_H(cfg)
    return max(1, round(H * entry.get("H_fraction", 1.0)))


def baseline_H(cfg: Config, methods: dict | None = None) -> int:
    """DiLoCo's outer.H in the plan: the config's, unless the config's [outer] table is a
    method measured at a fraction of DiLoCo's H; then its H over that fraction, so the method
    plans at the H it runs (examples/default.toml: diloco-overlap at H = 5, measured against
    DiLoCo at 10, plans DiLoCo at 10 and itself at 5)."""
    own = _outer_without_H(cfg)
    for entry in (methods or load_penalties()["methods"]).values():
        fraction = entry.get("H_fraction", 1.0)
        if fraction == 1.0:
            continue
        try:
            same = _outer_without_H(method_config(cfg, entry["outer"])) == own
        except ConfigError:  # a method this config cannot run is not the config's own
            continue
        if same:
            return max(1, round(cfg.outer.H / fraction))
    return cfg.outer.H


def _outer_without_H(cfg: Config) -> dict:
    """[outer] less H, and less param_codec where no parameters are sent (fgd without Mix1,
    e.g. GlobalM2): a key the method does not read does not make it another method."""
    outer = to_dict(cfg)["outer"]
    outer.pop("H")
    o = cfg.outer
    if not (o.strategy == "noloco" or (o.strategy == "fgd" and o.fgd.mix1 != "none")):
        outer.pop("param_codec")
    return outer


def method_config(
    cfg: Config, outer: dict, steps: int | None = None, H: int | None = None
) -> Config:
    """`cfg` with the method's [outer] table in place of its own at outer.H = `H` (default: the
    config's), run for `steps` (default: its own run.steps); a ConfigError if this config cannot
    run the method."""
    raw = to_dict(cfg)
    raw["outer"] = {**copy.deepcopy(outer), "H": H or cfg.outer.H}
    if steps is not None:
        raw["run"]["steps"] = steps
    with warnings.catch_warnings():  # the table holds only keys its strategy reads
        warnings.simplefilter("ignore")
        return build_config(Config, raw)


def pick_table(outer: dict, H: int) -> dict:
    """A method's [outer] table as a config writes it: strategy, H, then the keys of the
    measured table its strategy reads (a measured table may carry others, e.g. ddp's lr), its
    own sub-table included."""
    strategy = outer["strategy"]
    reads = OUTER_KEYS[strategy]
    table = {"strategy": strategy, "H": H}
    for key, value in outer.items():
        if key == strategy or (key in reads and key not in table and not isinstance(value, dict)):
            table[key] = copy.deepcopy(value)
    return table


def outer_toml(table: dict) -> str:
    """An [outer] table (pick_table) as TOML, sub-tables ([outer.diloco]) after it."""
    return section_toml("outer", table).rstrip("\n")


# ---------------------------------------------------------------- what the plan is fed


@dataclass
class Links:
    """The workers' links as the simulator's network takes them."""

    bandwidth_bps: list[float]
    """Each worker's all-reduce rate, bits/s (one value: every worker)."""
    p2p_ratio: float
    """A pair exchange's effective rate over the all-reduce's (sim.p2p_bandwidth_ratio)."""
    label: str
    """given or measured."""
    what: str
    """Where they come from, in words."""


_FIX = "write one with `frugaltrain netlab probe --out FILE`"


def links_given(mbit: list[float], workers: int, key: str = "--link-mbit") -> Links:
    """Rates as stated, in Mbit/s: one for every worker or one per worker."""
    if len(mbit) not in (1, workers) or not all(r > 0 for r in mbit):
        raise ConfigError(
            f"{key} = {mbit}: give one rate > 0 (Mbit/s) for every worker or one per worker "
            f"(run.workers = {workers})"
        )
    rates = "/".join(f"{r:g}" for r in mbit)
    each = " each" if len(mbit) == 1 else ""
    return Links([r * 1e6 for r in mbit], 1.0, "given", f"{rates} Mbit/s{each}")


def links_from_probe(
    probe: dict, workers: int, rates_mbit: list[float] | None = None, what: str = "a probe"
) -> Links:
    """Links from a probe's JSON (comm/probe.py's keys). With the links' nominal rates (the
    probe's "rates_mbit", or given), each link keeps the share of its rate the probe found, as
    the ring runs at its slowest link (benchmarks/time_to_loss.py does the same); without,
    every link gets the all-reduce's effective rate."""
    try:
        ar, pair = float(probe["allreduce_effective_bps"]), float(probe["pair_effective_bps"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{what}: no {e} number: a link probe's JSON has allreduce_effective_bps and "
            f"pair_effective_bps; {_FIX}"
        ) from None
    if not (ar > 0 and pair > 0):
        raise ConfigError(
            f"{what}: effective rates must be > 0 bits/s, got {ar:g} and {pair:g}; {_FIX}"
        )
    rates = rates_mbit or probe.get("rates_mbit")
    if rates and len(rates) not in (1, workers):
        raise ConfigError(
            f"{what}: rates_mbit has {len(rates)} rates for {workers} workers; give one or "
            f"{workers}"
        )
    bandwidth = [r * ar / min(rates) for r in rates] if rates else [ar]
    return Links(
        bandwidth,
        pair / ar,
        "measured",
        f"all-reduce {ar / 1e6:.3g} Mbit/s, pair exchange {pair / 1e6:.3g} Mbit/s ({what})",
    )


def read_probe(path: str, workers: int, key: str = "--link-json") -> Links:
    try:
        probe = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{key} = {path!r}: not a readable JSON file ({e.__class__.__name__}); {_FIX}"
        ) from None
    if not isinstance(probe, dict):
        raise ConfigError(
            f"{key} = {path!r}: a probe's JSON is an object, got {probe!r:.40}; {_FIX}"
        )
    return links_from_probe(probe, workers, what=f"{key} = {path!r}")


@dataclass
class StepTime:
    """Seconds of one inner step, and how they were had."""

    seconds: float
    label: str
    """measured, with how."""
    timed: int = 0
    """Inner steps timed (after the warm-up)."""
    warmup: int = 0


class _NoOuter:
    """The outer strategy of a timed step: nothing (its communication is the clock's part)."""

    def before_step(self, step: int) -> None:
        pass

    def sync_grads(self) -> None:
        pass


@dataclass
class _Trainee:
    model: torch.nn.Module
    inner: torch.optim.Optimizer
    schedule: object
    strategy: object = field(default_factory=_NoOuter)


def measure_step_time(cfg: Config, timed: int = 3, warmup: int = 1) -> StepTime:
    """Wall seconds of one inner step of worker 0 (its model, batch and inner optimizer, on
    run.device with the threads a worker gets, step.worker_threads): the mean of `timed`
    steps after `warmup` steps that are not counted."""
    device = torch.device("cuda:0" if cfg.run.device == "cuda" else "cpu")
    d, threads = cfg.data, worker_threads(cfg)
    corpus = load_corpus(d.path, d.max_bytes, d.val_fraction)
    shard = shard_tokens(corpus.train, 0, cfg.run.workers, d.num_shards, d.sharding)
    sampler = BatchSampler(shard, d.seq_len, d.batch_size, worker_seed(cfg.run.seed, 0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build_model(cfg).to(device)
        model.train()
        inner = build_inner_optimizer(model, cfg.optim)
        w = _Trainee(model, inner, build_schedule(inner, cfg.optim, cfg.run.steps))
        seconds = []
        for k in range(warmup + timed):
            batch = tuple(t.to(device) for t in sampler.batch(k))
            _sync(device)
            t0 = time.perf_counter()
            inner_step(w, cfg, k, lambda b=batch: b, device=device, who="plan")
            _sync(device)
            seconds.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    how = f"mean of {timed} inner steps after {warmup} warm-up, {device.type}"
    how += f", {threads} thread{'s' * (threads > 1)}" if device.type == "cpu" else ""
    return StepTime(statistics.mean(seconds[warmup:]), f"measured ({how})", timed, warmup)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the plan


@dataclass
class Row:
    """One method's line of the plan; None where there is no figure (`note` says why)."""

    method: str
    strategy: str
    candidate: bool
    """Among the methods to pick from (DiLoCo is always planned: the reference)."""
    H: int = 0
    """Its outer.H (method_H)."""
    outer: dict = field(default_factory=dict)
    """Its [outer] table at that H, as a config writes it (pick_table)."""
    util: float | None = None
    """Compute utilization on the simulated clock."""
    clock_s: float | None = None
    """Simulated seconds of the whole run.steps."""
    steps_fraction: float | None = None
    """Measured fraction of DiLoCo's steps to DiLoCo's final loss."""
    seeds: str = ""
    """Seeds that reached it in the measurements, e.g. 2/3."""
    time_s: float | None = None
    """Estimated seconds to DiLoCo's final loss."""
    ratio: float | None = None
    """time_s over DiLoCo's."""
    seeds_s: tuple[float, float | None] | None = None
    """Estimated seconds at the fastest and the slowest seed's penalty; None at the top: a seed
    never reached DiLoCo's loss."""
    seeds_ratio: tuple[float, float | None] | None = None
    """seeds_s over DiLoCo's time."""
    note: str = ""

    @property
    def label(self) -> str:
        """The method in words (config.AUTO_METHODS)."""
        return AUTO_METHODS.get(self.method, "")


@dataclass
class Plan:
    workers: int
    steps: int
    H: int
    """DiLoCo's outer.H (baseline_H); each row has its method's."""
    step: StepTime
    links: Links
    penalties: dict
    """The penalties' provenance (penalties.json less its methods)."""
    rows: list[Row]
    pick: str | None
    reason: str
    near_tie: str | None = None
    """The next method, where its estimates over the measured seeds overlap the pick's."""
    outer: dict | None = None
    """The pick's [outer] table at its outer.H (pick_table): what a config runs it with."""


def _row(
    cfg: Config, name: str, entry: dict, links: Links, step: StepTime, pick: bool, baseline: int
) -> Row:
    H = method_H(cfg, entry, baseline)
    outer = pick_table(entry["outer"], H)
    row = Row(name, entry["outer"]["strategy"], pick, H, outer, seeds=entry["reached"])
    per_seed = _seed_fractions(entry)
    # A method that needed more than DiLoCo's steps: its clock runs on past run.steps, in
    # whole rounds, to its slowest seed.
    longest = max([1.0, entry["steps_fraction"] or 1.0, *(f for f in per_seed if f)])
    steps = math.ceil(longest * cfg.run.steps / H) * H
    try:
        if cfg.run.steps % H:  # the method's own run must end on a round too
            method_config(cfg, entry["outer"], H=H)
        mcfg = method_config(cfg, entry["outer"], steps, H)
        sim = SimSection(
            step_s=step.seconds,
            bandwidth_bps=links.bandwidth_bps,
            p2p_bandwidth_ratio=links.p2p_ratio,
        )
        c = clock(mcfg, sim)
    except ConfigError as e:
        row.note = f"not for this config: {e}"
        return row
    row.util, row.clock_s = c.util, c.at_step(cfg.run.steps)
    row.steps_fraction = entry["steps_fraction"]
    if row.steps_fraction is None:
        row.note = f"never reached DiLoCo's loss in the measurements ({entry['reached']} seeds)"
    else:
        row.time_s = c.at_step(row.steps_fraction * cfg.run.steps)
        at = lambda f: c.at_step(f * cfg.run.steps)  # noqa: E731
        reached = [f for f in per_seed if f is not None] or [row.steps_fraction]
        row.seeds_s = (at(min(reached)), at(max(reached)) if None not in per_seed else None)
    return row


def _seed_fractions(entry: dict) -> list[float | None]:
    """Each measured seed's step penalty; None for a seed that never reached DiLoCo's loss."""
    return [v if isinstance(v, int | float) else None for v in entry.get("seeds", {}).values()]


def make_plan(
    cfg: Config,
    links: Links,
    step: StepTime,
    methods: list[str] | None = None,
    penalties: dict | None = None,
) -> Plan:
    """Every method's predicted time to DiLoCo's loss on `links` at `step`, and the pick among
    `methods` (default: all of the table's); `penalties`: the step penalties' table (default:
    config.PENALTIES's, `load_penalties`, whose methods are config.AUTO_METHODS; the benchmark
    passes its own, by run name)."""
    pen = penalties or load_penalties()
    methods = list(methods or pen["methods"])
    check_methods(methods, "methods", pen["methods"])
    if cfg.run.workers < 2:
        raise ConfigError(
            f"run.workers = {cfg.run.workers}: with one worker every outer method is the same "
            "training; plan a run of 2 or more workers"
        )
    names = methods if BASELINE in methods else [BASELINE, *methods]
    H = baseline_H(cfg, pen["methods"])
    rows = [_row(cfg, m, pen["methods"][m], links, step, m in methods, H) for m in names]
    base = next(r for r in rows if r.method == BASELINE)
    for r in rows:
        if r.time_s is not None and base.time_s:
            r.ratio = r.time_s / base.time_s
            lo, hi = r.seeds_s
            r.seeds_ratio = (lo / base.time_s, None if hi is None else hi / base.time_s)
    ranked = sorted((r for r in rows if r.candidate and r.time_s is not None), key=_time)
    meta = {k: v for k, v in pen.items() if k != "methods"}
    plan = Plan(cfg.run.workers, cfg.run.steps, H, step, links, meta, rows, None, "")
    plan.pick = ranked[0].method if ranked else None
    plan.outer = ranked[0].outer if ranked else None
    plan.reason = _reason(ranked)
    if len(ranked) > 1 and _overlap(ranked[0], ranked[1]):
        plan.near_tie = ranked[1].method
    return plan


def _time(r: Row) -> float:
    return r.time_s


def _reason(ranked: list[Row]) -> str:
    if not ranked:
        return "no method to pick: none of them has an estimate here (see the notes)"
    best = ranked[0]
    why = (
        f"the shortest estimated time to DiLoCo's loss, {best.time_s:.4g} s"
        + (f" ({best.ratio:.2f}x DiLoCo's)" if best.ratio is not None else "")
        + f": {best.steps_fraction:.2f} of the steps (measured, {best.seeds} seeds reached it)"
        f" on a {best.clock_s:.4g} s clock (simulated, U = {best.util:.2f})"
    )
    if len(ranked) > 1:
        nxt = ranked[1]
        ratio = f"{nxt.ratio:.2f}x" if nxt.ratio is not None else f"{nxt.time_s:.4g} s"
        why += f"; next {nxt.method} at {ratio}"
        if _overlap(best, nxt):
            why += (
                f"; a near tie: over the measured seeds {best.method} takes "
                f"{seed_span(best.seeds_s)} s and {nxt.method} {seed_span(nxt.seeds_s)} s, which "
                "overlap, so the penalties cannot rank the two"
            )
    return why


def _overlap(a: Row, b: Row) -> bool:
    """Whether two rows' estimates over the measured seeds overlap (an open top overlaps)."""
    (a_lo, a_hi), (b_lo, b_hi) = a.seeds_s, b.seeds_s
    return (a_hi is None or b_lo <= a_hi) and (b_hi is None or a_lo <= b_hi)


def seed_span(lo_hi: tuple[float, float | None] | None, fmt: str = ".4g") -> str:
    """A span over the measured seeds as text ("-" for none; an open top: "not reached")."""
    if lo_hi is None:
        return "-"
    lo, hi = lo_hi
    return f"{lo:{fmt}}-" + ("not reached" if hi is None else f"{hi:{fmt}}")


# ---------------------------------------------------------------- the table and the JSON


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_plan(plan: Plan) -> str:
    """The plan as printed: what it was fed, one row per method (each column labelled), the
    pick with its reason, and last the pick's [outer] table to paste."""
    p, pen = plan, plan.penalties
    lines = [
        f"plan: {p.workers} workers, {p.steps} inner steps, DiLoCo's outer.H = {p.H}",
        f"step time: {p.step.seconds:.4g} s, {p.step.label}",
        f"links: {p.links.what}, {p.links.label}"
        + (f"; point-to-point at {p.links.p2p_ratio:.2f}x" if p.links.label == "measured" else ""),
        f"steps to DiLoCo's loss: {pen.get('file', 'the given table')}, measured on "
        f"{pen['measured_on']} with {pen['workers']} "
        f"workers, {pen['steps']} steps, H = {pen['H']}, seeds {_seeds(pen['seeds'])} "
        f"({_files(pen['source'])}, {pen['date'][:10]}); tuned on {pen['tuned_on']}",
        "",
        "| method | what it is | outer.H | U (simulated) | clock of run.steps, s (simulated) "
        "| steps to DiLoCo's loss, x DiLoCo's (measured) | time to DiLoCo's loss, s (estimated) "
        "| x DiLoCo (estimated) | x DiLoCo, fastest-slowest seed (estimated) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in p.rows:
        name = r.method if r.candidate else f"{r.method} (reference)"
        frac = "not reached" if r.steps_fraction is None else f"{r.steps_fraction:.2f}"
        frac += f" ({r.seeds} seeds)"
        lines.append(
            f"| {name} | {r.label} | {r.H} | {_f(r.util, '.2f')} | {_f(r.clock_s, '.4g')} | {frac} "
            f"| {_f(r.time_s, '.4g')} | {_f(r.ratio, '.2f')} | {seed_span(r.seeds_ratio, '.2f')} |"
        )
    lines += [f"{r.method}: {r.note}" for r in p.rows if r.note.startswith("not for")]
    if p.pick is None:
        lines.append(f"pick: -: {p.reason}")
        return "\n".join(lines)
    lines += [
        f"pick: {p.pick} ({AUTO_METHODS.get(p.pick, p.pick)}): {p.reason}",
        "",
        "its [outer], at this config's H (in place of your [outer] table; --write FILE writes "
        "your config with it):",
        "",
        outer_toml(p.outer),
    ]
    return "\n".join(lines)


def _seeds(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds))


def _files(source: str) -> str:
    """The penalties' results files, in a few words (--json names each)."""
    files = source.split(", ")
    return files[0] if len(files) == 1 else f"{len(files)} files of benchmarks/results/, in --json"


def plan_json(plan: Plan) -> dict:
    """The same as JSON, each figure under a key that says what it is."""
    rows = [
        {
            "method": r.method,
            "label": r.label,
            "strategy": r.strategy,
            "candidate": r.candidate,
            "H": r.H,
            "outer": r.outer,
            "util_simulated": r.util,
            "clock_s_simulated": r.clock_s,
            "steps_fraction_measured": r.steps_fraction,
            "seeds_reached": r.seeds,
            "time_to_loss_s_estimated": r.time_s,
            "x_diloco_estimated": r.ratio,
            "x_diloco_seeds_estimated": r.seeds_ratio,
            "note": r.note,
        }
        for r in plan.rows
    ]
    return {
        "workers": plan.workers,
        "steps": plan.steps,
        "H": plan.H,
        "step_time": asdict(plan.step),
        "links": asdict(plan.links),
        "penalties": plan.penalties,
        "methods": rows,
        "pick": plan.pick,
        "pick_label": AUTO_METHODS.get(plan.pick, "") if plan.pick else None,
        "pick_outer": plan.outer,
        "near_tie": plan.near_tie,
        "reason": plan.reason,
    }


# ---------------------------------------------------------------- outer.strategy = "auto"


def resolve_auto(cfg: Config) -> tuple[Config, Plan]:
    """`cfg` with outer.strategy = 'auto' replaced by the method the plan picks on
    [outer.auto]'s links (its [outer] table at its H: Plan.outer), and the plan."""
    a = cfg.outer.auto
    if a.link_json:
        links = read_probe(a.link_json, cfg.run.workers, "outer.auto.link_json")
    else:
        links = links_given(a.link_mbit, cfg.run.workers, "outer.auto.link_mbit")
    pen = load_penalties(a.penalties, "outer.auto.penalties")
    plan = make_plan(cfg, links, measure_step_time(cfg), a.methods or None, pen)
    if plan.pick is None:
        raise ConfigError(
            f"outer.strategy = 'auto': {plan.reason}; set outer.strategy to a method, or "
            "outer.auto.methods to ones with an estimate"
        )
    return method_config(cfg, plan.outer, H=plan.outer["H"]), plan
