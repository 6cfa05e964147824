"""Watching a run: TensorBoard events hold exactly what metrics.jsonl holds (a real 2-worker run
and a simulated one), the per-peer figures agree with the round means already logged, the
summary names the slowest peers, `report --plot-bytes` compares runs, and a missing package or
a network-bound wandb mode is refused before any work."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest

from frugaltrain import cli
from frugaltrain.config import ConfigError, to_toml
from frugaltrain.metrics.log import MetricsLog, read_metrics
from frugaltrain.metrics.peers import blocking_ops, fields_from_means, post_vector, vector_size
from frugaltrain.metrics.report import format_summary, summarize
from frugaltrain.metrics.sinks import TensorBoardSink, WandbSink
from frugaltrain.sim import SimSection, simulate
from frugaltrain.train import launch
from frugaltrain.train.round_log import RoundLog, RoundScalars

WORKERS = 2
REAL = ("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1LocalM2'", "run.threads=1")
# Streaming names one operation per fragment: the per-op split must follow the config.
SIM = (
    "outer.strategy='streaming'",
    "outer.streaming.fragments=2",
    "outer.streaming.overlap=1",
    "model.n_layer=2",
)


@pytest.fixture(scope="module")
def real_run(config_factory, tmp_path_factory) -> Path:
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("real")
    cfg = config_factory(root, *REAL, f"run.workers={WORKERS}", "run.tensorboard=true")
    run_dir = launch.new_run_dir(cfg)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    launch.run(cfg, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def sim_run(config_factory, tmp_path_factory) -> Path:
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("sim")
    cfg = config_factory(root, *SIM, f"run.workers={WORKERS}", "run.tensorboard=true")
    simulate(cfg, SimSection(ratio=0.887, compute="lognormal", step_sigma=0.3), root / "sim")
    return root / "sim"


def _rounds(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "round"]


def _expected_scalars(records: list[dict]) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, written out here independently of metrics/sinks.py."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if r["kind"] == "step":
            out.setdefault("step/loss/train", {})[r["step"]] = r["loss/train"]
            out.setdefault("step/lr", {})[r["step"]] = r["lr"]
        if r["kind"] != "round":
            continue
        for key, value in r.items():
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, v in items:
                if key != "step" and isinstance(v, (int, float)):
                    tag = key if i is None else f"{key}/{i}"
                    out.setdefault(tag, {})[r["step"]] = float(v)
    return out


@pytest.mark.parametrize("which", ["real_run", "sim_run"])
def test_tensorboard_events_hold_every_scalar_of_metrics_jsonl(which, request):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = request.getfixturevalue(which)
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    expected = _expected_scalars(read_metrics(run_dir / "metrics.jsonl"))
    assert "loss/val_workers/1" in expected and "peer/bytes_sent/1" in expected
    assert set(acc.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert set(got) == set(by_step), tag
        for step, value in by_step.items():  # events store float32
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (tag, step)


@pytest.mark.parametrize("which", ["real_run", "sim_run"])
def test_per_peer_figures_agree_with_the_round_means(which, request):
    rounds = _rounds(request.getfixturevalue(which))
    simulated = which == "sim_run"
    ops = {"fragment0", "fragment1"} if simulated else {"mix1", "mix2"}
    assert len(rounds) == 2
    for r in rounds:
        assert r["clock"] == ("simulated" if simulated else "measured")
        for key in ("bytes_sent", "bytes_received", "blocking_s", "compute_s"):
            assert len(r[f"peer/{key}"]) == WORKERS and None not in r[f"peer/{key}"]
        for key in ("bytes_sent", "bytes_received"):  # the logged mean is truncated to bytes
            mean = sum(r[f"peer/{key}"]) / WORKERS
            assert abs(mean - r[f"comm/{key}"]) <= 1, key
        for key in ("blocking_s", "compute_s"):
            assert sum(r[f"peer/{key}"]) / WORKERS == pytest.approx(r[f"time/{key}"], rel=1e-9)
        prefix = "comm/blocking_s/"
        split = {k.removeprefix(prefix): v for k, v in r.items() if k.startswith(prefix)}
        assert set(split) == ops, split
        # Seconds add up in a different order than the worker's total: fp64 rounding only.
        assert sum(split.values()) == pytest.approx(r["time/blocking_s"], rel=1e-9, abs=1e-12)
        assert r["comm/rejected"] == 0 and r["comm/membership_changes"] == 0
    if simulated:  # lognormal step times: the peers differ, each on the simulated clock
        assert len(set(rounds[0]["peer/compute_s"])) == WORKERS


@pytest.mark.parametrize("which, clock", [("real_run", "measured"), ("sim_run", "simulated")])
def test_the_summary_names_the_slowest_peers(which, clock, request):
    rounds = _rounds(request.getfixturevalue(which))
    summary = summarize(rounds)
    compute = [sum(r["peer/compute_s"][i] for r in rounds) for i in range(WORKERS)]
    slowest = max(range(WORKERS), key=compute.__getitem__)
    assert summary["peer/compute_s"] == pytest.approx(compute)
    table = format_summary(summary)
    row = next(line for line in table.splitlines() if line.startswith("slowest peer"))
    assert f"({clock})" in row and f"worker {slowest}: " in row
    assert f"peer with most blocking comm s ({clock})" in table
    assert f"peer with most bytes sent (model-counted, {clock} run)" in table


def test_report_plots_loss_against_bytes_for_several_runs(real_run, sim_run, tmp_path, capsys):
    out = tmp_path / "loss_vs_bytes.png"
    assert cli.main(["report", str(real_run), str(sim_run), "--plot-bytes", str(out)]) == 0
    assert out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert f"loss vs bytes: {out}" in printed and printed.count("slowest peer") == 2


def test_report_refuses_a_run_without_metrics_before_writing(real_run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "cmp.png"
    before = (real_run / "loss.png").stat().st_mtime_ns
    code = cli.main(["report", str(real_run), str(empty), "--plot-bytes", str(out)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert f"{empty / 'metrics.jsonl'} not found" in lines[0]
    assert not out.exists() and (real_run / "loss.png").stat().st_mtime_ns == before
    code = cli.main(["report", str(real_run), "--plot-bytes", str(tmp_path / "no" / "x.png")])
    assert code == 2 and "--plot-bytes" in capsys.readouterr().err


def test_a_missing_tensorboard_is_refused_before_any_work(
    make_config, text_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = tmp_path / "runs"
    out.mkdir()
    argv = ["train", "--set", f"data.path={str(text_dir)!r}", "--set", f"run.out_dir={str(out)!r}"]
    argv += ["--steps", "12", "-H", "6", "--set", "run.tensorboard=true"]
    code = cli.main(argv)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "run.tensorboard = true needs the tensorboard package" in lines[0]
    assert "pip install 'frugaltrain[tensorboard]'" in lines[0]
    assert list(out.iterdir()) == []
    with pytest.raises(ConfigError, match=r"frugaltrain\[tensorboard\]"):
        simulate(make_config("run.tensorboard=true"), SimSection(), tmp_path / "sim")
    assert not (tmp_path / "sim").exists()
    with pytest.raises(ConfigError, match=r"frugaltrain\[tensorboard\]"):
        TensorBoardSink(tmp_path / "tb")


def test_wandb_modes_other_than_offline_are_refused(make_config):
    with pytest.raises(ConfigError, match="run.wandb = 'online': .* never talks to the network"):
        make_config("run.wandb='online'")
    with pytest.raises(ConfigError, match="run.wandb = 'yes': choose '' \\(off\\) or 'offline'"):
        make_config("run.wandb='yes'")


def test_a_missing_wandb_names_its_extra(make_config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        ConfigError, match=r"run.wandb = 'offline' needs the wandb package.*frugaltrain\[wandb\]"
    ):
        simulate(make_config("run.wandb='offline'"), SimSection(), tmp_path / "sim")


def test_the_wandb_sink_logs_offline_against_the_inner_step(tmp_path, monkeypatch):
    """With a stand-in wandb module: what the sink asks of wandb, whether or not it is here."""
    calls: list = []

    class Run:
        def define_metric(self, name, **kw):
            calls.append(("define", name, kw))

        def log(self, values):
            calls.append(("log", values))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=[WandbSink(tmp_path, {"run": {}})])
    log.write({"kind": "step", "step": 6, "loss/train": 2.5, "lr": 1e-3})
    log.write({"kind": "membership", "event": "left", "round": 1})
    log.write({"kind": "round", "step": 6, "clock": "measured", "loss/val_workers": [2.0, 3.0]})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "offline"
    assert calls[0][1]["dir"] == str(tmp_path)
    assert ("define", "*", {"step_metric": "inner_step"}) in calls
    logged = [c[1] for c in calls if c[0] == "log"]
    assert logged == [
        {"inner_step": 6, "step/loss/train": 2.5, "step/lr": 1e-3},
        {"inner_step": 6, "loss/val_workers/0": 2.0, "loss/val_workers/1": 3.0},
    ]
    assert calls[-1] == ("finish",)


def test_wandb_offline_run_writes_its_files(make_config, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make_config(f"run.workers={WORKERS}", "run.wandb='offline'")
    simulate(cfg, SimSection(ratio=0.887), tmp_path / "sim")
    assert list((tmp_path / "sim" / "wandb").glob("offline-run-*"))


def _round_log(tmp_path: Path, workers: int, ops: tuple[str, ...]) -> RoundLog:
    path = tmp_path / "metrics.jsonl"
    return RoundLog(path, enabled=True, resumed_at=None, workers=workers, bar=None, ops=ops)


def test_peer_figures_survive_the_mean_over_whoever_posted(make_config, tmp_path):
    """Each worker posts its figures in its own slot; the mean over the workers that posted
    (all, or fewer under fault tolerance) gives back every figure, and nothing for the absent."""
    ops = blocking_ops(make_config("outer.strategy='fgd'"))
    figures = [
        {"bytes_sent": 100 * (r + 1), "bytes_received": 7, "blocking_s": 0.5 * r, "compute_s": 2.0}
        | {"feedback_norm": 0.25 * r}
        for r in range(4)
    ]
    by_op = [{"mix1": 0.1 * r, "mix2": 0.4 * r, "made-up": 1.0} for r in range(4)]
    posts = [post_vector(r, 4, figures[r], by_op[r], ops) for r in (0, 1, 3)]  # worker 2 is down
    assert all(len(p) == vector_size(4, ops) for p in posts)
    means = [sum(col) / len(posts) for col in zip(*posts, strict=True)]
    fields = fields_from_means(means, 4, ops)
    assert fields["peer/bytes_sent"] == [100, 200, None, 400]
    assert fields["peer/blocking_s"] == pytest.approx([0.0, 0.5, None, 1.5])
    assert fields["peer/feedback_norm"] == pytest.approx([0.0, 0.25, None, 0.75])
    assert fields["comm/blocking_s/mix2"] == pytest.approx(0.4 * 4 / 3)
    assert fields["comm/blocking_s/other"] == pytest.approx(1.0)  # an unknown name is kept
    assert "comm/blocking_s/outer" not in fields  # never ran: left out, not a zero


def test_rejections_and_membership_changes_are_counted_in_the_round_record(tmp_path):
    ops = ("outer", "other")
    log = _round_log(tmp_path, 2, ops)
    own = {"bytes_sent": 1, "bytes_received": 1, "blocking_s": 0.0, "compute_s": 1.0}
    own["feedback_norm"] = 0.0  # a dense codec: left out of the record
    posts = [post_vector(r, 2, own, {"outer": 0.0}, ops) for r in range(2)]
    peers = [sum(col) / 2 for col in zip(*posts, strict=True)]
    means = RoundScalars(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, peers=peers).pack()
    log.events([{"kind": "rejected", "workers": [1], "round": 1}])
    log.events([{"kind": "membership", "event": "left", "round": 1}])
    log.round({"kind": "round", "step": 6, "energy/label": "x"}, lambda: means, False)
    log.events([{"kind": "rejected", "workers": [0, 1], "round": 2}])
    log.round({"kind": "round", "step": 12, "energy/label": "x"}, lambda: means, False)
    log.close()
    rounds = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "round"]
    assert [r["comm/rejected"] for r in rounds] == [1, 2]
    assert [r["comm/membership_changes"] for r in rounds] == [1, 0]
    assert all(math.isclose(r["comm/blocking_s/outer"], 0.0) for r in rounds)


def test_evaluation_without_diagnostics_reports_the_same_loss_and_no_agreement(
    config_factory, tmp_path
):
    """run.eval_diagnostics = false drops the all-reduce of every parameter (and what it
    measures) from evaluations; the workers' mean validation loss is the same number."""
    got = {}
    for diagnostics in (True, False):
        sets = ("outer.strategy='diloco'", "run.threads=1", f"run.workers={WORKERS}")
        cfg = config_factory(
            tmp_path / str(diagnostics), *sets, f"run.eval_diagnostics={str(diagnostics).lower()}"
        )
        run_dir = launch.new_run_dir(cfg)
        (run_dir / "config.toml").write_text(to_toml(cfg))
        launch.run(cfg, run_dir)
        got[diagnostics] = [r for r in _rounds(run_dir) if "loss/val" in r]
    assert [r["step"] for r in got[True]] == [r["step"] for r in got[False]] == [6, 12]
    for on, off in zip(got[True], got[False], strict=True):
        assert off["loss/val"] == pytest.approx(on["loss/val"], rel=1e-6)
        assert "consensus/total" in on and "loss/val_avg_model" in on
        assert not [k for k in off if k.startswith(("consensus/", "disagreement/"))]
        assert "loss/val_avg_model" not in off and "loss/val_workers" not in off


def test_a_baseline_takes_overrides_of_its_own_checked_before_any_work(make_config, tmp_path):
    from frugaltrain.train.baseline import baseline_config

    cfg = make_config("outer.strategy='diloco'", "outer.diloco.overlap=1", "outer.codec='e3m0'")
    base = baseline_config(cfg, "diloco", ["outer.H=12"])
    assert (base.outer.H, base.outer.diloco.overlap, base.outer.codec) == (12, 0, "fp32")
    assert (cfg.outer.H, cfg.run.name) == (6, base.run.name.removesuffix("-diloco"))
    with pytest.raises(ConfigError, match="unknown key outer.Hx"):
        baseline_config(cfg, "diloco", ["outer.Hx=12"])
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    args = ["train", "--config", str(path), "--baseline-set", "outer.H=12"]
    assert cli.main(args) == 2  # --baseline-set without --baseline
    assert cli.main([*args, "--baseline", "diloco", "--baseline-set", "outer.H=7"]) == 2
    assert not list(Path(cfg.run.out_dir).glob("*/metrics.jsonl"))  # refused before any work


def test_a_run_beside_its_baseline_plots_both_against_wall_clock(make_config, tmp_path, capsys):
    from frugaltrain.metrics.log import read_metrics
    from frugaltrain.metrics.report import wall_curve
    from frugaltrain.train.baseline import baseline_config, baseline_dir

    cfg = make_config("outer.strategy='fgd'", "outer.fgd.preset='GlobalM1'", "outer.codec='int8'")
    assert baseline_config(cfg, "diloco").outer.codec == "fp32"  # the baseline sends exact values
    coded = make_config("outer.codec='e3m0'", "outer.coded_average='reduce_scatter'")
    assert baseline_config(coded, "diloco").outer.coded_average == "all_gather"
    path = tmp_path / "run.toml"
    path.write_text(to_toml(cfg))
    assert cli.main(["train", "--config", str(path), "--baseline", "diloco"]) == 0
    out = capsys.readouterr().out
    assert "fgd int8, H = 6 beside diloco, H = 6 (baseline measured now" in out  # codec tells
    plot = Path(out.split("plot: ")[-1].split()[0])
    assert plot.name == "beside_diloco.png" and plot.stat().st_size > 0
    theirs = read_metrics(baseline_dir(baseline_config(cfg, "diloco")) / "metrics.jsonl")
    walls, losses = wall_curve(theirs)
    assert len(walls) == len(losses) == 2 and walls[0] < walls[1]  # evaluations at steps 6, 12
