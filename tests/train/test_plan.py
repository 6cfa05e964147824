"""The planner (`frugaltrain plan`, outer.strategy = "auto"): its clock equals the simulator's for
every method it offers, every figure it prints carries its label, it names methods as a user
types them and never by a benchmark run, its pick comes as an [outer] table a config runs
(--write), --check trains the pick and DiLoCo on emulated links, bad input stops it before any
work, it times exactly one warm-up and three inner steps, auto runs a concrete method and a
resumed run keeps it, and its penalties file is what the benchmark's results give."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import tomllib

from frugaltrain.config import (
    AUTO_METHODS,
    FGD_PRESETS,
    PENALTIES,
    Config,
    ConfigError,
    build_config,
    load,
    load_config,
    read_toml,
    to_dict,
    to_toml,
)
from frugaltrain.metrics.report import time_to
from frugaltrain.sim import SimSection, simulate
from frugaltrain.sim import plan as planner
from frugaltrain.sim.clock import clock
from frugaltrain.sim.plan import (
    StepTime,
    baseline_H,
    format_plan,
    links_from_probe,
    links_given,
    load_penalties,
    make_plan,
    method_config,
    pick_table,
    plan_json,
)
from frugaltrain.train import checkpoint, plan_check, plan_cli
from frugaltrain.train.launch import prepare, run

ROOT = Path(__file__).resolve().parents[2]
TINY = ("run.workers=4", "run.eval_every=0", "model.n_layer=2")
# Links a tiny model notices: the last worker's slower, point-to-point below the all-reduce.
LINKS = {"bandwidth_bps": [2e6, 2e6, 2e6, 0.7e6], "p2p_bandwidth_ratio": 0.8}

# Variants beyond the examples' tables: every branch of the schedules in sim/clock.py.
VARIANTS = {
    "fgd-ring-mixed-bf16": (
        "outer.strategy='fgd'",
        "outer.fgd.mix1='ring'",
        "outer.fgd.momentum_policy='mixed'",
        "outer.fgd.mix2='complete'",
        "outer.fgd.mix2_momentum=true",
        "outer.param_codec='bf16'",
    ),
    "fgd-partial-mix1-topk": (
        "outer.strategy='fgd'",
        "outer.fgd.mix1_weight=0.5",
        "outer.fgd.mix2='exponential'",
        "outer.codec='topk:0.1'",
    ),
    "fgd-mix2-delay-momentum": (
        "outer.strategy='fgd'",
        "outer.fgd.mix2='pairs'",
        "outer.fgd.mix2_delay=2",
        "outer.fgd.mix2_momentum=true",
    ),
    "diloco-e3m0-reduce-scatter": (
        "outer.codec='e3m0'",
        "outer.coded_average='reduce_scatter'",
    ),
    "fgd-globalm2-reduce-scatter-early": (
        "outer.strategy='fgd'",
        "outer.fgd.preset='GlobalM2'",
        "outer.codec='e3m0'",
        "outer.coded_average='reduce_scatter'",
        "outer.fgd.mix2_delay=1",
    ),
    "streaming-no-overlap": (
        "outer.strategy='streaming'",
        "outer.streaming.fragments=2",
        "outer.streaming.overlap=0",
    ),
    "noloco-two-exchanges": ("outer.strategy='noloco'", "outer.param_codec='int8'"),
    "noloco-no-pull": ("outer.strategy='noloco'", "outer.noloco.consensus_pull=0"),
    "ddp-partial-round": ("outer.strategy='ddp'", "run.steps=10", "outer.H=4"),
}


def _engine_and_clock(cfg: Config, sim: SimSection):
    result = simulate(cfg, sim)
    return [r for r in result.records if r["kind"] == "round"], result.summary, clock(cfg, sim)


@pytest.mark.parametrize("method", list(AUTO_METHODS))
def test_clock_equals_the_simulator_for_every_method(make_config, method):
    # The same SimWorld timing code on the same posts: equal to the last bit, not approximately.
    cfg = method_config(make_config(*TINY), load_penalties()["methods"][method]["outer"])
    rounds, summary, c = _engine_and_clock(cfg, SimSection(step_s=0.05, **LINKS))
    assert c.steps == [r["step"] for r in rounds]
    assert c.sim_s == [r["time/sim_s"] for r in rounds]
    assert c.util == summary["util/compute"]
    assert c.bytes_sent == summary["comm/bytes_sent_per_worker"]
    assert c.at_step(cfg.run.steps) == summary["time/sim_s"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_clock_equals_the_simulator_on_every_branch(make_config, variant):
    cfg = make_config(*TINY, *VARIANTS[variant])
    rounds, summary, c = _engine_and_clock(cfg, SimSection(step_s=0.05, **LINKS))
    assert c.sim_s == [r["time/sim_s"] for r in rounds]
    assert c.bytes_sent == summary["comm/bytes_sent_per_worker"]


def test_a_step_early_two_phase_average_hides_both_phases_behind_the_step(make_config):
    """The chunk means go out when the first phase has arrived, not at the round's end: where
    both phases fit in the step a step-early round overlaps, it never blocks (the engine's
    clock, which the clock above equals); sent at the round's end, the same bytes block."""
    rs = ("outer.codec='e3m0'", "outer.coded_average='reduce_scatter'", "outer.H=5", "run.steps=10")
    early = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM2'", "outer.fgd.mix2_delay=1")
    sim = SimSection(step_s=1.0, bandwidth_bps=[20e6] * 4)
    assert clock(make_config(*TINY, *rs, *early), sim).blocking_s == 0
    assert clock(make_config(*TINY, *rs), sim).blocking_s > 0


def test_clock_equals_the_simulator_with_stragglers_and_drops(make_config):
    sets = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'", "run.steps=24")
    cfg = make_config(*TINY, *sets)
    sim = SimSection(
        compute="lognormal", step_s=0.05, step_sigma=0.3, straggler_prob=0.2, drop_prob=0.3,
        latency_s=0.01, fault_seed=3, **LINKS,
    )  # fmt: skip
    rounds, summary, c = _engine_and_clock(cfg, sim)
    faults = summary["faults"]  # drawn, and drawn alike: lost messages, all-reduces retried
    assert faults["drops"] > 0 and faults["allreduce_failures"] > 0
    assert c.sim_s == [r["time/sim_s"] for r in rounds]


@pytest.mark.parametrize("mix2", ["outer.fgd.mix2_delay=0", "outer.fgd.mix2_delay=1"])
def test_clock_equals_the_simulator_when_rounds_roll_back(make_config, mix2):
    # sim.allreduce_policy = rollback: a failed round restores every worker's state, its round
    # counter included (which draws the pairs), and the engine snapshots it at each round end.
    sets = ("outer.strategy='fgd'", "outer.fgd.mix2='pairs'", "run.steps=36")
    cfg = make_config(*TINY, *sets, mix2)
    sim = SimSection(step_s=0.05, drop_prob=0.1, allreduce_policy="rollback", **LINKS)
    rounds, summary, c = _engine_and_clock(cfg, sim)
    assert summary["faults"]["rollbacks"] > 0
    assert c.sim_s == [r["time/sim_s"] for r in rounds]


def test_clock_refuses_what_it_cannot_replay(make_config):
    cfg = make_config(*TINY)
    with pytest.raises(ConfigError, match="compute = 'measured'"):
        clock(cfg, SimSection(compute="measured"))
    with pytest.raises(ConfigError, match="a crash"):
        clock(cfg, SimSection(crash_worker=1, crash_round=1, crash_rounds=1))


def _plan(make_config, links=None, methods=None):
    cfg = make_config(*TINY)
    links = links or links_given([2.0], cfg.run.workers)
    return make_plan(cfg, links, StepTime(0.05, "measured (a test's figure)"), methods)


def test_the_table_labels_every_figure(make_config):
    text = format_plan(_plan(make_config))
    lines = text.splitlines()
    assert lines[1].startswith("step time: 0.05 s, measured")
    assert lines[2] == "links: 2 Mbit/s each, given"
    assert "measured on /usr/share/doc" in lines[3] and "tuned on stdlib" in lines[3]
    header = next(line for line in lines if line.startswith("| method"))
    for column in ("what it is", "U (simulated)", "s (simulated)", "x DiLoCo's (measured)"):
        assert column in header
    assert header.count("(estimated)") == 3
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(AUTO_METHODS)
    assert [r.split(" | ")[1] for r in rows] == list(AUTO_METHODS.values())
    assert "| 1.00 (3/3 seeds) |" in rows[0] and rows[0].endswith("| 1.00 | 1.00-1.00 |")
    pick = next(line for line in lines if line.startswith("pick: "))
    assert "shortest estimated time" in pick


def test_the_pick_ends_the_plan_as_an_outer_table_at_its_H(make_config):
    p = _plan(make_config)
    row = next(r for r in p.rows if r.method == p.pick)
    assert p.outer == row.outer and p.outer["H"] == row.H
    text = format_plan(p)
    assert text.split("pick: ")[1].startswith(f"{p.pick} ({AUTO_METHODS[p.pick]}): ")
    table = text[text.index("\n[outer]\n") :]
    assert tomllib.loads(table)["outer"] == p.outer  # pasted as printed, it reads back the same
    assert plan_json(p)["pick_outer"] == p.outer and plan_json(p)["pick_label"]


def test_a_table_carries_only_what_its_strategy_reads():
    # DDP was measured with an [outer] table carrying DiLoCo's lr: a config does not need it.
    measured = load_penalties()["methods"]["ddp"]["outer"]
    assert "lr" in measured and pick_table(measured, 7) == {"strategy": "ddp", "H": 7}
    overlap = load_penalties()["methods"]["diloco-overlap"]["outer"]
    assert pick_table(overlap, 5) == {"strategy": "diloco", "H": 5, **overlap}


def test_a_probe_is_measured_and_a_method_never_reached_gets_no_number(make_config, monkeypatch):
    probe = {"allreduce_effective_bps": 2e6, "pair_effective_bps": 1.6e6}
    p = _plan(make_config, links_from_probe(probe, 4, what="a test probe"))
    assert p.links.label == "measured" and p.links.p2p_ratio == pytest.approx(0.8)
    assert "point-to-point at 0.80x" in format_plan(p).splitlines()[2]
    rows = plan_json(p)["methods"]
    assert {"util_simulated", "clock_s_simulated", "steps_fraction_measured"} <= set(rows[0])
    assert {"time_to_loss_s_estimated", "x_diloco_estimated"} <= set(rows[0])
    pen = load_penalties()
    pen["methods"]["streaming"] |= {"steps_fraction": None, "reached": "0/3"}
    monkeypatch.setattr(planner, "load_penalties", lambda: pen)
    row = next(r for r in _plan(make_config).rows if r.method == "streaming")
    assert row.time_s is None and row.ratio is None and row.clock_s is not None
    assert "never reached DiLoCo's loss" in row.note


def test_a_method_past_diloco_steps_is_timed_past_them(make_config, monkeypatch):
    """A step penalty above 1 (the method reached DiLoCo's loss after DiLoCo's last step): the
    time is the clock at that many steps, past the clock of run.steps."""
    pen = load_penalties()
    pen["methods"]["streaming"] |= {"steps_fraction": 1.5, "reached": "3/3"}
    monkeypatch.setattr(planner, "load_penalties", lambda: pen)
    cfg = make_config(*TINY)
    row = next(r for r in _plan(make_config).rows if r.method == "streaming")
    links = links_given([2.0], cfg.run.workers)  # as _plan feeds it
    sim = SimSection(step_s=0.05, bandwidth_bps=links.bandwidth_bps, p2p_bandwidth_ratio=1.0)
    outer = pen["methods"]["streaming"]["outer"]
    H = cfg.outer.H
    c = clock(method_config(cfg, outer, math.ceil(1.5 * cfg.run.steps / H) * H), sim)
    assert row.clock_s == c.at_step(cfg.run.steps) < row.time_s
    assert row.time_s == c.at_step(1.5 * cfg.run.steps)


def test_a_method_measured_at_its_own_H_plans_at_that_fraction_of_outer_H(make_config):
    # DiLoCo in 4 bits ran at H = 5 against DiLoCo's 10: under outer.H = 6 it plans at 3, on
    # the clock of a run at H = 3; under outer.H = 5 at 2, which cannot end 15 steps on a round.
    entry = load_penalties()["methods"]["diloco-4bit"]
    assert entry["H_fraction"] == 0.5 and "H" not in entry["outer"]
    cfg = make_config(*TINY)
    rows = {r.method: r for r in _plan(make_config).rows}
    assert rows["diloco"].H == 6 and rows["diloco-4bit"].H == 3 and rows["streaming"].H == 6
    links = links_given([2.0], cfg.run.workers)  # as _plan feeds it
    sim = SimSection(step_s=0.05, bandwidth_bps=links.bandwidth_bps, p2p_bandwidth_ratio=1.0)
    steps = math.ceil(max(1.0, *entry["seeds"].values()) * cfg.run.steps / 3) * 3
    c = clock(method_config(cfg, entry["outer"], steps, H=3), sim)
    assert rows["diloco-4bit"].clock_s == c.at_step(cfg.run.steps)
    cfg = make_config(*TINY, "run.steps=15", "outer.H=5")
    p = make_plan(cfg, links, StepTime(0.05, "measured (a test's figure)"))
    rows = {r.method: r for r in p.rows}
    assert rows["diloco"].time_s is not None and rows["diloco-4bit"].time_s is None
    assert "must be a multiple of outer.H = 2" in rows["diloco-4bit"].note
    assert "diloco-4bit: not for this config" in format_plan(p)


def test_a_config_that_is_a_method_measured_at_a_fraction_of_H_plans_at_its_own_H(make_config):
    # diloco-4bit runs at H = 5, measured against DiLoCo at 10: DiLoCo plans at 10 and the
    # config's own method at the 5 it runs, not at 2 (half of 5).
    measured = load_penalties()["methods"]["diloco-4bit"]
    assert measured["H_fraction"] == 0.5
    own = [f"outer.{k}={v!r}" for k, v in measured["outer"].items()]
    cfg = make_config(*TINY, *own, "outer.H=5", "run.steps=30")
    assert baseline_H(cfg) == 10
    links = links_given([2.0], cfg.run.workers)
    p = make_plan(cfg, links, StepTime(0.05, "measured (a test's figure)"))
    rows = {r.method: r for r in p.rows}
    assert p.H == 10 and rows["diloco"].H == 10 and rows["diloco-4bit"].H == 5
    assert format_plan(p).startswith("plan: 4 workers, 30 inner steps, DiLoCo's outer.H = 10")
    # One key of [outer] otherwise: not that method, so outer.H is DiLoCo's as for any config.
    other = make_config(*TINY, *own, "outer.H=5", "run.steps=30", "outer.momentum=0.5")
    assert baseline_H(other) == 5


def test_the_default_job_plans_as_the_flagship_it_runs(make_config):
    # examples/default.toml's [outer] is diloco-overlap's table at H = 5, as the plan prints it.
    path = ROOT / "examples" / "default.toml"
    cfg = load(Config, str(path), [])
    methods = load_penalties()["methods"]
    assert read_toml(path)["outer"] == pick_table(methods["diloco-overlap"]["outer"], 5)
    assert cfg.outer.H == 5 and baseline_H(cfg) == 10
    # A key the method does not read (param_codec: no parameters sent) does not make it another
    # method; where parameters are sent (GlobalM1LocalM2's Mix1) it does.
    assert baseline_H(method_config(cfg, {**to_dict(cfg)["outer"], "param_codec": "int8"})) == 10
    at_half = {"fgd": {**methods["fgd"], "H_fraction": 0.5}}
    mix1 = method_config(make_config(*TINY, "outer.H=5", "run.steps=30"), methods["fgd"]["outer"])
    assert baseline_H(mix1, at_half) == 10
    other = method_config(mix1, {**to_dict(mix1)["outer"], "param_codec": "fp32"})
    assert baseline_H(other, at_half) == 5


def test_diloco_overlap_is_the_measured_early_globalm2_on_the_clock(make_config):
    # Its penalty was measured as fgd's GlobalM2 with Mix2 a step early; the table it ships is
    # DiLoCo with [outer.diloco] overlap = 1, the same training: the same clock, to the bit.
    lab = _benchmark().penalties(_benchmark().penalty_files())["methods"]
    ours = load_penalties()["methods"]["diloco-overlap"]
    assert lab[ours["run"]]["outer"]["fgd"] == {"preset": "GlobalM2", "mix2_delay": 1}
    cfg = make_config(*TINY, "run.steps=30", "outer.H=5")
    sim = SimSection(step_s=0.05, **LINKS)
    measured = clock(method_config(cfg, lab[ours["run"]]["outer"]), sim)
    shipped = clock(method_config(cfg, ours["outer"]), sim)
    assert shipped.sim_s == measured.sim_s and shipped.bytes_sent == measured.bytes_sent


def test_each_estimate_lies_between_its_fastest_and_slowest_seed(make_config):
    """The packaged penalties' seeds bracket each method's estimate; a seed that never reached
    DiLoCo's loss leaves the top open."""
    p = _plan(make_config)
    pen = load_penalties()["methods"]
    for r in p.rows:
        if r.time_s is None:
            assert r.seeds_s is None and r.seeds_ratio is None
            continue
        lo, hi = r.seeds_s
        every_seed = all(isinstance(v, float) for v in pen[r.method]["seeds"].values())
        assert lo <= r.time_s and (hi >= r.time_s if every_seed else hi is None)
        assert r.seeds_ratio[0] == pytest.approx(lo / p.rows[0].time_s)
    assert plan_json(p)["methods"][0]["x_diloco_seeds_estimated"] == (1.0, 1.0)


def _timed(method: str, time_s: float, seeds_s: tuple) -> planner.Row:
    return planner.Row(
        method, "diloco", True, util=0.5, clock_s=time_s, steps_fraction=1.0, seeds="3/3",
        time_s=time_s, ratio=time_s / 100, seeds_s=seeds_s,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "tie"),
    [
        ((9.0, 12.0), (11.0, 14.0), True),
        ((9.0, 12.0), (13.0, 14.0), False),
        ((9.0, None), (50.0, 60.0), True),  # the pick's slowest seed never got there
        ((9.0, 10.0), (5.0, None), True),
    ],
)
def test_a_near_tie_is_said_and_a_clear_lead_is_not(first, second, tie):
    ranked = [_timed("a", 10.0, first), _timed("b", 12.0, second)]
    reason = planner._reason(ranked)
    assert reason.startswith("the shortest estimated time to DiLoCo's loss, 10 s")
    assert ("a near tie" in reason) == tie


def test_the_pick_is_among_the_methods_asked_for_and_diloco_is_the_reference(make_config):
    p = _plan(make_config, methods=["ddp", "noloco"])
    assert [(r.method, r.candidate) for r in p.rows] == [
        ("diloco", False),
        ("ddp", True),
        ("noloco", True),
    ]
    assert p.pick == "noloco"  # a 2 Mbit/s link: ddp's all-reduce every step is far slower
    assert "(reference)" in format_plan(p)


def test_a_method_this_config_cannot_run_says_why(make_config):
    cfg = make_config(*TINY, "optim.name='forge-adamw'")
    p = make_plan(cfg, links_given([2.0], 4), StepTime(0.05, "measured"), ["ddp", "diloco"])
    ddp = next(r for r in p.rows if r.method == "ddp")
    assert ddp.time_s is None and "FORGE" in ddp.note and p.pick == "diloco"


def _cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = plan_cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config_file(make_config, tmp_path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(to_toml(make_config(*TINY)))
    return path


@pytest.fixture
def no_work(monkeypatch):
    """Fails a test that times a step or builds a clock."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(planner, "measure_step_time", refuse)
    monkeypatch.setattr(plan_cli, "measure_step_time", refuse)
    monkeypatch.setattr(planner, "clock", refuse)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _probe_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "probe.json"
    path.write_text(text)
    return str(path)


BAD = [
    ("no-link", [], "no links to plan on: pass --link-mbit"),
    ("both-links", ["--link-mbit", "2", "--link-json", "x.json"], "pass one of them"),
    ("rate-word", ["--link-mbit", "fast"], "--link-mbit 'fast': give rates in Mbit/s"),
    ("rate-count", ["--link-mbit", "1,2"], "--link-mbit = [1.0, 2.0]: give one rate > 0"),
    ("rate-zero", ["--link-mbit", "0"], "--link-mbit = [0.0]: give one rate > 0"),
    ("method", ["--link-mbit", "2", "--methods", "diloco,fast"], "--methods: unknown method"),
    (
        "run-name",  # a benchmark's run is no method a user can ask for
        ["--link-mbit", "2", "--methods", "GlobalM1LocalM2-int8"],
        "unknown method 'GlobalM1LocalM2-int8'; choose among diloco, diloco-4bit, diloco-overlap,",
    ),
    ("check-steps", ["--link-mbit", "2", "--check-steps", "4"], "add --check"),
    ("check-zero", ["--link-mbit", "2", "--check", "--check-steps", "0"], "give 1 or more"),
    ("json-missing", ["--link-json", "nope.json"], "not a readable JSON file"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_before_any_work(case, config_file, capsys, no_work):
    _, args, message = case
    code, out, err = _cli(["--config", str(config_file), *args], capsys)
    assert code == 2 and out == ""
    assert err.startswith("frugaltrain: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "text,message",
    [
        ("{not json", "not a readable JSON file (JSONDecodeError)"),
        ("[1, 2]", "a probe's JSON is an object"),
        ('{"allreduce_effective_bps": 1e6}', "no 'pair_effective_bps' number"),
        ('{"allreduce_effective_bps": 1e6, "pair_effective_bps": -1}', "must be > 0 bits/s"),
    ],
)
def test_a_bad_probe_file_is_refused(text, message, config_file, tmp_path, capsys, no_work):
    args = ["--config", str(config_file), "--link-json", _probe_file(tmp_path, text)]
    code, _, err = _cli(args, capsys)
    assert code == 2 and message in err and "--link-json" in err and "netlab probe --out" in err


def test_plan_times_one_warm_up_and_three_steps(config_file, tmp_path, capsys, monkeypatch):
    # Its runtime budget, counted: four inner steps of one worker, no training run.
    steps = []
    real = planner.inner_step
    monkeypatch.setattr(planner, "inner_step", lambda *a, **k: steps.append(a[2]) or real(*a, **k))
    out_json = tmp_path / "plan.json"
    code, out, _ = _cli(
        ["--config", str(config_file), "--link-mbit", "2", "--json", str(out_json)], capsys
    )
    assert code == 0 and steps == [0, 1, 2, 3]
    assert "mean of 3 inner steps after 1 warm-up" in out
    got = json.loads(out_json.read_text())
    assert (got["step_time"]["timed"], got["step_time"]["warmup"]) == (3, 1)
    assert got["pick"] in AUTO_METHODS and f"\npick: {got['pick']} (" in out


def _run_names() -> set[str]:
    """The benchmark's run names that are no user's name for a method: none may be printed.
    FGD's presets are the paper's words and config values (outer.fgd.preset), so they may."""
    bench = _benchmark()
    runs = set(bench.penalties(bench.penalty_files())["methods"]) | set(bench.METHODS)
    return runs - set(AUTO_METHODS) - set(FGD_PRESETS)


def _named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text) is not None


def test_the_plan_names_methods_as_a_user_types_them(config_file, tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    args = ["--config", str(config_file), "--link-mbit", "2", "--json", str(out_json)]
    code, out, _ = _cli(args, capsys)
    assert code == 0
    got = json.loads(out_json.read_text())
    got.pop("penalties")  # provenance: the results files the penalties come from
    for text in (out, json.dumps(got)):
        assert [name for name in _run_names() if _named(name, text)] == []
    assert [row["method"] for row in got["methods"]] == list(AUTO_METHODS)
    assert {row["label"] for row in got["methods"]} == set(AUTO_METHODS.values())


def test_write_gives_the_config_with_the_picks_outer(config_file, tmp_path, capsys):
    written, out_json = tmp_path / "picked.toml", tmp_path / "plan.json"
    args = ["--config", str(config_file), "--set", "run.steps=24", "--link-mbit", "2"]
    code, out, _ = _cli([*args, "--write", str(written), "--json", str(out_json)], capsys)
    assert code == 0 and f"wrote {written}" in out
    plan = json.loads(out_json.read_text())
    cfg = load_config(str(written))  # what `frugaltrain train --config` reads
    given = load_config(str(config_file), ["run.steps=24"])
    assert (
        cfg.outer == build_config(Config, {"outer": plan["pick_outer"], "run": {"steps": 24}}).outer
    )
    assert cfg.outer.H == plan["pick_outer"]["H"]
    assert {k: v for k, v in to_dict(cfg).items() if k != "outer"} == {
        k: v for k, v in to_dict(given).items() if k != "outer"
    }
    assert read_toml(written)["outer"] == plan["pick_outer"]  # the table as printed, no more


def test_check_steps_are_whole_rounds_of_both_methods():
    assert plan_check.check_steps(20, [10, 5], 160) == 20
    assert plan_check.check_steps(4, [6, 3], 12) == 6
    assert plan_check.check_steps(100, [10, 5], 40) == 40
    assert time_to(2.5, [1.0, 3.0], [3.0, 2.0]) == pytest.approx(2.0)
    assert time_to(1.0, [1.0, 3.0], [3.0, 2.0]) is None


def test_check_trains_the_pick_and_diloco_on_emulated_links(make_config, tmp_path, capsys):
    sets = ("run.workers=2", "run.steps=12", "run.eval_every=0", "run.eval_batches=1")
    path = tmp_path / "two.toml"
    path.write_text(to_toml(make_config(*sets)))
    out_json = tmp_path / "plan.json"
    args = ["--config", str(path), "--link-mbit", "4", "--methods", "diloco-4bit"]
    code, out, _ = _cli([*args, "--check", "--check-steps", "4", "--json", str(out_json)], capsys)
    assert code == 0
    got = json.loads(out_json.read_text())["check"]
    assert got["steps"] == 6  # 4 rounded up to whole rounds of H = 6 (DiLoCo) and 3
    assert [r["method"] for r in got["runs"]] == ["diloco", "diloco-4bit"]
    assert got["measure"] in (plan_check.TIME_TO_LOSS, plan_check.EQUAL_STEPS)
    assert got["x_diloco_measured_emulated"] > 0 and got["link_mbit_emulated"] == [4.0]
    for r in got["runs"]:
        ran = load_config(str(Path(r["run_dir"]) / "config.toml"))
        assert ran.run.link_mbit == [4.0] and ran.run.stop_at_round == 6 // r["H"]
    table = out[out.index("\ncheck: 6 inner steps") :]
    assert "wall clock, s (measured, emulated links)" in table
    assert "(measured, emulated links); the plan estimated" in table.splitlines()[-2]
    assert [name for name in _run_names() if _named(name, out)] == []


# ---------------------------------------------------------------- outer.strategy = "auto"


def test_auto_needs_links_named_by_key(make_config):
    with pytest.raises(ConfigError, match=r"^outer.auto.link_mbit = \[\]: outer.strategy"):
        make_config(*TINY, "outer.strategy='auto'")
    names = "'fast' is no method; choose among diloco, diloco-4bit, diloco-overlap,"
    with pytest.raises(ConfigError, match=r"outer.auto.methods = \['fast'\]: " + names):
        make_config(*TINY, "outer.strategy='auto'", "outer.auto.link_mbit=[2]",
                    "outer.auto.methods=['fast']")  # fmt: skip
    with pytest.raises(ConfigError, match="run.workers = 1: with one worker"):
        make_config("outer.strategy='auto'", "outer.auto.link_mbit=[2]")
    with pytest.raises(ConfigError, match="the simulator runs one method"):
        simulate(make_config(*TINY, "outer.strategy='auto'", "outer.auto.link_mbit=[2]"),
                 SimSection())  # fmt: skip


def test_auto_runs_the_pick_and_a_resumed_run_keeps_it(make_config, tmp_path, capsys, monkeypatch):
    sets = ("run.workers=2", "run.steps=12", "run.checkpoint_every=1", "run.stop_at_round=1")
    auto = tmp_path / "auto.toml"
    auto.write_text(
        to_toml(make_config(*sets, "outer.strategy='auto'", "outer.auto.link_mbit=[1]"))
    )
    cfg, run_dir, _ = prepare(str(auto), [], None)
    plan = json.loads((run_dir / "plan.json").read_text())
    pick = plan["pick"]
    assert cfg.outer.strategy in ("diloco", "fgd", "noloco", "streaming", "ddp")
    entry = load_penalties()["methods"][pick]
    assert plan["pick_outer"]["H"] == planner.method_H(make_config(*sets), entry)  # at its H
    assert (
        cfg.outer == build_config(Config, {"outer": plan["pick_outer"], "run": {"steps": 12}}).outer
    )
    logged = capsys.readouterr().out.splitlines()
    assert len(logged) == 1 and logged[0].startswith(f"outer.strategy = 'auto': running {pick}")
    assert "1 Mbit/s each (given)" in logged[0] and "s steps (measured)" in logged[0]

    (run_dir / "config.toml").write_text(to_toml(cfg))  # as train_from_cli writes it
    run(cfg, run_dir)  # to round 1, with a checkpoint
    saved = tomllib.loads((run_dir / "config.toml").read_text())
    assert saved["outer"]["strategy"] == cfg.outer.strategy

    def no_replanning(*args, **kwargs):
        raise AssertionError("a resumed run planned again")

    monkeypatch.setattr(planner, "resolve_auto", no_replanning)
    for config in (None, str(auto)):  # the run directory alone, or with the auto config again
        again, same_dir, ckpt = prepare(config, [], str(run_dir))
        assert same_dir == run_dir and ckpt == checkpoint.latest_intact(run_dir)
        assert to_dict(again)["outer"] == to_dict(cfg)["outer"]


def test_auto_picks_among_the_methods_it_is_given(make_config, monkeypatch):
    monkeypatch.setattr(planner, "measure_step_time", lambda cfg: StepTime(0.05, "measured"))
    auto = ("outer.strategy='auto'", "outer.auto.link_mbit=[2]")
    for methods in (["streaming", "fgd"], ["noloco"]):
        cfg = make_config(*TINY, *auto, f"outer.auto.methods={methods!r}")
        picked, plan = planner.resolve_auto(cfg)
        assert plan.pick in methods and [r.method for r in plan.rows if r.candidate] == methods
        strategy = load_penalties()["methods"][plan.pick]["outer"]["strategy"]
        assert picked.outer.strategy == strategy and picked.outer.H == plan.outer["H"]


# ---------------------------------------------------------------- the packaged penalties


def _benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports provenance.py beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "time_to_loss", ROOT / "benchmarks" / "time_to_loss.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_a_case_at_diloco_r_gets_the_rate_that_puts_its_all_reduce_there():
    bench = _benchmark()
    M, S, H, step_s = 4, 1_903_104, 10, 0.2
    ring_bits = 2 * (M - 1) / M * S * 8

    def allreduce_s(rate_mbit: float) -> float:  # a link on which gloo gets 80% of the rate
        return ring_bits / (0.8 * rate_mbit * 1e6)

    for r in (1.0, 2.0):
        got = bench.rate_for_r(r, step_s, H, M, S, allreduce_s)
        assert got["rate_mbit"] > got["nominal_mbit"]  # gloo gets less than the link carries
        assert allreduce_s(got["rate_mbit"]) / (H * step_s) == pytest.approx(r, rel=1e-3)
    assert bench.parse_case("r1=r1.5:8") == ("r1", "r1.5", 8.0)
    assert bench.parse_case("r2=11") == ("r2", "11", None)
    with pytest.raises(ValueError, match="--cases: 'r1=rx'"):
        bench.parse_case("r1=rx")


def test_packaged_penalties_are_what_the_results_give():
    bench = _benchmark()
    files = bench.penalty_files()
    # The planner offers only runs the benchmark measured in these files (each needs a
    # penalty), under the names a user types; each run's penalty comes from the first file
    # that measured it.
    measured = {m for _, record in files for m in record["methods"]}
    assert set(bench.PLANNER) <= measured and list(bench.PLANNER.values()) == list(AUTO_METHODS)
    pen = load_penalties()
    assert pen.pop("file") == PENALTIES and (ROOT / PENALTIES).is_file()  # the lab's file
    assert pen == json.loads(json.dumps(bench.packaged_penalties(files)))
    assert list(pen["methods"]) == list(AUTO_METHODS)
    assert {m["run"] for m in pen["methods"].values()} == set(bench.PLANNER)
    assert pen["methods"]["fgd"]["source"].endswith("time_to_loss_mix1_delta.json")
    assert pen["methods"]["diloco"]["source"].endswith("time_to_loss_past_h10.json")  # the first
    lab = bench.penalties(files)["methods"]
    assert lab["GlobalM1LocalM2"]["source"].endswith("time_to_loss_past_h10_rest.json")
    for m in ("diloco", "diloco-4bit", "streaming", "fgd"):  # as measured: a user's tables
        assert pen["methods"][m]["outer"] == lab[pen["methods"][m]["run"]]["outer"]
    # The default job's run measured as fgd's GlobalM2 a step early: as a user writes it.
    assert pen["methods"]["diloco-overlap"]["outer"] == {
        "strategy": "diloco", "lr": 1.0, "momentum": 0, "codec": "e3m0",
        "coded_average": "reduce_scatter", "diloco": {"overlap": 1},
    }  # fmt: skip


def test_penalties_refuse_results_of_another_setup():
    bench = _benchmark()
    files = bench.penalty_files()
    path, other = files[1]
    with pytest.raises(ValueError, match="steps = 100"):
        bench.penalties([files[0], (path, {**other, "steps": 100})])


def test_penalties_keep_the_outer_table_each_method_was_measured_with():
    # The examples' outer steps may change after a measurement; the planner must run a method
    # with the step its penalty was measured at, which only the results file knows.
    bench = _benchmark()
    (path, first), *rest = bench.penalty_files()
    measured = copy.deepcopy(first["outer_tables"])
    measured["diloco"] = {**measured["diloco"], "lr": 0.123}
    pen = bench.penalties([(path, {**first, "outer_tables": measured}), *rest])
    assert pen["methods"]["diloco"]["outer"]["lr"] == 0.123


def test_equal_wall_clock_ratio_reads_both_curves_where_the_sooner_ended():
    bench = _benchmark()
    diloco = {"wall_s_measured": [10.0, 20.0, 30.0], "val_loss": [3.0, 2.8, 2.6]}
    fast = {"wall_s_measured": [5.0, 10.0, 15.0], "val_loss": [3.1, 2.9, 2.7]}
    assert bench.equal_wall_x(fast, diloco) == pytest.approx(2.7 / 2.9)  # DiLoCo at 15 s: 2.9
    assert bench.equal_wall_x(diloco, fast) == pytest.approx(2.9 / 2.7)
    assert bench.equal_wall_x(diloco, diloco) == 1.0
    early = {"wall_s_measured": [1.0, 2.0], "val_loss": [3.0, 2.9]}  # before DiLoCo's first
    assert bench.equal_wall_x(early, diloco) is None


def test_a_run_past_diloco_steps_is_read_at_diloco_last_step_and_timed_past_it():
    bench = _benchmark()
    diloco = {"method": "diloco", "seed": 0, "step": [10, 20], "wall_s_measured": [10.0, 20.0],
              "val_loss": [3.0, 2.8], "U_measured": 0.5}  # fmt: skip
    longer = {"method": "streaming", "seed": 0, "step": [10, 20, 30],
              "wall_s_measured": [4.0, 8.0, 12.0], "val_loss": [3.1, 2.9, 2.7],
              "U_measured": 0.9}  # fmt: skip
    record = {"methods": ["diloco", "streaming"], "cases": {"r": {"runs": [diloco, longer]}}}
    got = {a["method"]: a for a in bench.analyze(record)}["streaming"]
    assert got["final_x"] == [pytest.approx(2.9 / 2.8)]  # its loss at DiLoCo's step 20
    assert got["ratios"] == [pytest.approx(10.0 / 20.0)]  # 2.8 reached halfway to step 30


def test_a_runs_wall_clock_splits_into_compute_blocking_by_operation_and_the_rest(tmp_path):
    # Two rounds of 5 steps; the second evaluates after its wall was taken, the first before.
    bench = _benchmark()
    rounds = [
        {"kind": "round", "step": 5, "time/wall_s": 2.0, "time/compute_s": 1.0,
         "time/blocking_s": 0.6, "comm/blocking_s/mix1": 0.2, "comm/blocking_s/mix2": 0.4,
         "comm/blocking_s/outer": 0.0, "loss/val": 3.0, "time/eval_s": 0.25},
        {"kind": "round", "step": 10, "time/wall_s": 4.0, "time/compute_s": 1.2,
         "time/blocking_s": 0.3, "comm/blocking_s/mix2": 0.3, "loss/val": 2.9,
         "time/eval_s": 0.5},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    c = bench.curve(tmp_path)
    assert c["blocking_s_by_op_measured"] == {"mix1": 0.2, "mix2": pytest.approx(0.7)}
    assert c["steps_run"] == 10
    assert c["other_s_measured"] == pytest.approx(4.0 - 2.2 - 0.9 - 0.25)  # the last eval: after
    assert c["wall_s_measured"] == [2.0, 4.0 - 0.25]  # the training clock: evaluations out
    assert bench.curve(tmp_path, "with-evals")["wall_s_measured"] == [2.25, 4.5]
    record = {"methods": ["x"], "cases": {"r": {"runs": [{"method": "x", **c}]}}}
    row = bench.time_split_table(record).splitlines()[-1]
    assert row == "| r | x | 0.220 | mix1 0.020, mix2 0.070 | 0.065 | 0.71 |"


def test_check_against_the_measurements_prints_every_case():
    bench = _benchmark()
    record = json.loads((ROOT / "benchmarks/results/time_to_loss.json").read_text())
    lines = bench.check_against(record).splitlines()
    assert lines[0].startswith("| case | method | plan, x DiLoCo (estimated; fastest-slowest")
    picks = [line for line in lines if ": pick " in line]
    assert [line.split(":")[0] for line in picks] == list(record["cases"])
    assert all("measured fastest" in line for line in picks)
    for case in bench.plan_cases(record):  # a near tie is named in the table and after it
        tie = case["near_tie"]
        line = next(p for p in picks if p.startswith(f"{case['case']}:"))
        assert (f"a near tie with {tie}" in line) if tie else ("near tie" not in line)
        row = f"| {case['case']} | {tie} | "
        assert not tie or "near tie" in next(x for x in lines if x.startswith(row))


def test_the_plan_names_its_penalties_file_and_refuses_a_missing_one(make_config, tmp_path):
    lines = format_plan(_plan(make_config)).splitlines()
    assert lines[3].startswith(f"steps to DiLoCo's loss: {PENALTIES}, measured on")
    with pytest.raises(ConfigError, match="--penalties 'nope.json': no such file"):
        load_penalties("nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(ConfigError, match="not a penalties file"):
        load_penalties(str(bad))
    sets = ("outer.strategy='auto'", "outer.auto.link_mbit=[20]", "run.workers=2")
    with pytest.raises(ConfigError, match="outer.auto.penalties = 'nope.json': no such file"):
        make_config(*sets, "outer.auto.penalties='nope.json'")
