"""Every bad input is refused before any work: exit status 2, one line on stderr that names the
key, flag or file (and the fix), no traceback, and nothing written: no run directory, earlier
checkpoints untouched. The cases cover command-line flags, config keys, data, models,
checkpoints, fault specs and unsupported combinations, across the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frugaltrain import cli
from frugaltrain.config import to_toml

# (id, arguments of `frugaltrain train` after the base flags, what the message must name)
TRAIN = [
    ("workers-word", ["--workers", "two"], "argument --workers: invalid int value"),
    ("steps-word", ["--steps", "many"], "argument --steps"),
    ("H-word", ["-H", "x"], "argument -H"),
    ("unknown-flag", ["--bogus"], "unrecognized arguments: --bogus"),
    ("set-no-equals", ["--set", "outer.H"], "expected section.key=value"),
    ("set-no-section", ["--set", "H=5"], "unknown key H"),
    ("unknown-section", ["--set", "outer2.H=5"], "unknown key outer2"),
    ("unknown-key", ["--set", "outer.Hh=5"], "unknown key outer.Hh"),
    ("section-as-value", ["--set", "outer=5"], "outer is a section"),
    ("workers-0", ["--set", "run.workers=0"], "run.workers = 0: must be at least 1"),
    ("workers-float", ["--set", "run.workers=1.5"], "run.workers = 1.5: expected int"),
    ("steps-0", ["--set", "run.steps=0"], "run.steps = 0: must be at least 1"),
    ("steps-negative", ["--steps", "-5"], "run.steps = -5: must be at least 1"),
    ("eval-every", ["--set", "run.eval_every=-1"], "run.eval_every = -1: must be >= 0"),
    ("eval-batches", ["--set", "run.eval_batches=0"], "run.eval_batches = 0"),
    ("backend", ["--set", "run.backend=mpi"], "run.backend = 'mpi': choose one of auto"),
    ("device", ["--set", "run.device=tpu"], "run.device = 'tpu': choose one of cpu"),
    ("cuda-without-gpu", ["--set", "run.device=cuda"], "run.device = 'cuda': torch sees no GPU"),
    ("dtype", ["--set", "run.dtype=fp8"], "run.dtype = 'fp8': choose one of fp32, bf16"),
    ("timeout-0", ["--set", "run.timeout_s=0"], "run.timeout_s = 0.0: must be positive"),
    ("timeout-inf", ["--set", "run.timeout_s=inf"], "run.timeout_s = inf: must be a finite"),
    ("timeout-nan", ["--set", "run.timeout_s=nan"], "run.timeout_s = nan: must be a finite"),
    (
        "coordinator-wait",
        ["--set", "fault_tolerance.coordinator_wait_s=200"],  # run.timeout_s is 300
        "fault_tolerance.coordinator_wait_s = 200.0: must be at most half of run.timeout_s",
    ),
    (
        "mix1-deadline",
        ["--set", "fault_tolerance.mix1_deadline_s=-1"],
        "fault_tolerance.mix1_deadline_s = -1.0",
    ),
    (
        "deadline-factor",
        ["--set", "fault_tolerance.deadline_factor=0.5"],
        "fault_tolerance.deadline_factor = 0.5",
    ),
    (
        "deadline-floor",
        ["--set", "fault_tolerance.deadline_floor_s=0"],
        "fault_tolerance.deadline_floor_s = 0",
    ),
    (
        "max-restarts",
        ["--set", "fault_tolerance.max_restarts=-1"],
        "fault_tolerance.max_restarts = -1",
    ),
    ("name-escapes", ["--name", "../escape"], "run.name = '../escape': must be a plain name"),
    ("name-absolute", ["--name", "/tmp/abs"], "run.name = '/tmp/abs': must be a plain name"),
    ("name-nested", ["--name", "a/b"], "run.name = 'a/b': must be a plain name"),
    ("name-dotdot", ["--name", ".."], "run.name = '..': must be a plain name"),
    ("progress-int", ["--set", "run.progress=1"], "run.progress = 1: expected true or false"),
    ("tensorboard-word", ["--set", "run.tensorboard=yes"], "run.tensorboard = 'yes': expected"),
    ("wandb-online", ["--set", "run.wandb=online"], "'online' is refused too: log offline"),
    ("wandb-word", ["--set", "run.wandb=on"], "run.wandb = 'on': choose '' (off) or 'offline'"),
    ("threads-type", ["--set", "run.threads='two'"], "run.threads = 'two': expected int"),
    ("sharding", ["--set", "data.sharding=random"], "data.sharding = 'random': choose one"),
    ("val-fraction-0", ["--set", "data.val_fraction=0"], "data.val_fraction = 0.0: must be"),
    ("val-fraction-big", ["--set", "data.val_fraction=1.5"], "data.val_fraction = 1.5"),
    ("seq-len", ["--set", "data.seq_len=1"], "data.seq_len = 1: must be at least 2"),
    ("batch-size", ["--set", "data.batch_size=0"], "data.batch_size = 0: must be at least 1"),
    ("max-bytes", ["--set", "data.max_bytes=-1"], "data.max_bytes = -1: must be >= 0"),
    ("num-shards", ["--set", "data.num_shards=-1"], "data.num_shards = -1: must be >= 0"),
    (
        "shards-fewer-than-workers",
        ["--set", "run.workers=4", "--set", "data.num_shards=2"],
        "data.num_shards = 2: fewer shards than run.workers = 4",
    ),
    ("data-missing", ["--set", "data.path='/nonexistent/corpus'"], "no such file or directory"),
    ("shard-too-small", ["--set", "data.max_bytes=100"], "a worker's shard has only"),
    ("n-layer", ["--set", "model.n_layer=0"], "model.n_layer = 0: must be at least 1"),
    ("n-head-0", ["--set", "model.n_head=0"], "model.n_head = 0: must be at least 1"),
    ("n-head-divides", ["--set", "model.n_head=3"], "model.n_head = 3: must divide model.n_embd"),
    ("n-kv-head", ["--set", "model.n_kv_head=3"], "model.n_kv_head = 3: must divide"),
    ("vocab-1", ["--set", "model.vocab_size=1"], "model.vocab_size = 1: must be at least 2"),
    ("vocab-small", ["--set", "model.vocab_size=100"], "model.vocab_size = 100: the model has"),
    ("dropout-1", ["--set", "model.dropout=1.0"], "model.dropout = 1.0: must be in [0, 1)"),
    ("dropout-neg", ["--set", "model.dropout=-0.1"], "model.dropout = -0.1"),
    ("family", ["--set", "model.family=mamba"], "model.family = 'mamba': choose one of gpt"),
    ("pretrained-gpt", ["--set", "model.pretrained='/x'"], "set model.family = 'hf'"),
    ("hf-alone", ["--set", "model.family=hf"], "needs exactly one of model.pretrained"),
    (
        "pretrained-missing",
        ["--set", "model.family=hf", "--set", "model.pretrained='/nonexistent/model'"],
        "model.pretrained = '/nonexistent/model': /nonexistent/model/config.json not found",
    ),
    ("intermediate", ["--set", "model.intermediate_size=-1"], "model.intermediate_size = -1"),
    (
        "too-big-for-ram",
        ["--set", "model.n_layer=64", "--set", "model.n_embd=16384", "--set", "model.n_head=16"],
        "of RAM is available; use a smaller model (model.n_layer, model.n_embd)",
    ),
    ("optim-name", ["--inner-optimizer", "sgd"], "optim.name = 'sgd': choose one of adamw"),
    ("lr-0", ["--set", "optim.lr=0"], "optim.lr = 0.0: must be positive"),
    ("lr-inf", ["--set", "optim.lr=inf"], "optim.lr = inf: must be a finite number"),
    ("betas-short", ["--set", "optim.betas=[0.9]"], "optim.betas = [0.9]: expected 2 values"),
    ("betas-1", ["--set", "optim.betas=[0.9,1.0]"], "optim.betas = (0.9, 1.0): each must be"),
    ("eps-nan", ["--set", "optim.eps=nan"], "optim.eps = nan: must be a finite number"),
    ("warmup", ["--set", "optim.warmup_steps=-1"], "optim.warmup_steps = -1: must be >= 0"),
    ("min-lr-ratio", ["--set", "optim.min_lr_ratio=2"], "optim.min_lr_ratio = 2.0"),
    ("grad-clip", ["--set", "optim.grad_clip=-1"], "optim.grad_clip = -1.0: must be >= 0"),
    ("strategy", ["--outer", "fedavg"], "outer.strategy = 'fedavg': choose one of ddp"),
    ("H-0", ["-H", "0"], "outer.H = 0: must be at least 1"),
    ("H-over-steps", ["-H", "1000"], "outer.H = 1000: exceeds run.steps = 12"),
    ("steps-multiple", ["--steps", "13"], "run.steps = 13: must be a multiple of outer.H = 6"),
    ("outer-lr", ["--set", "outer.lr=0"], "outer.lr = 0.0: must be positive"),
    ("momentum-1", ["--set", "outer.momentum=1.0"], "outer.momentum = 1.0: must be in [0, 1)"),
    ("codec", ["--codec", "fp8"], "outer.codec = 'fp8': choose one of fp32"),
    ("preset", ["--outer", "fgd", "--preset", "Global"], "outer.fgd.preset = 'Global': choose one"),
    ("preset-diloco", ["--preset", "GlobalM1"], "presets name fgd variants"),
    (
        "preset-conflict",
        ["--outer", "fgd", "--preset", "GlobalM1", "--mix2", "ring"],
        "outer.fgd.mix2 = 'ring': conflicts with outer.fgd.preset = 'GlobalM1'",
    ),
    ("mix1", ["--outer", "fgd", "--mix1", "star"], "outer.fgd.mix1 = 'star': choose one of"),
    (
        "mix2-params",
        ["--outer", "fgd", "--mix2", "pairs", "--mix2-params", "embed+nope"],
        "outer.fgd.mix2_params = 'embed+nope': part 'nope' selects no tensor of this model",
    ),
    (
        "mix2-params-mix2-off",
        ["--outer", "fgd", "--mix2-params", "nope"],
        "outer.fgd.mix2_params = 'nope': part 'nope' selects no tensor of this model",
    ),
    (
        "mix2-params-grammar",
        ["--outer", "fgd", "--mix2-params", "bogus:7"],
        "outer.fgd.mix2_params = 'bogus:7': choose all, none, or '+'-joined parts",
    ),
    ("mix2-params-empty-part", ["--mix2-params", "embed+"], "outer.fgd.mix2_params = 'embed+'"),
    (
        "old-flat-key",
        ["--set", "outer.mix1=ring"],
        "unknown key outer.mix1: it is now outer.fgd.mix1",
    ),
    (
        "old-flat-key-streaming",
        ["--set", "outer.fragments=2"],
        "unknown key outer.fragments: it is now outer.streaming.fragments",
    ),
    ("momentum-policy", ["--momentum-policy", "global"], "outer.fgd.momentum_policy = 'global'"),
    (
        "mix1-weight",
        ["--set", "outer.fgd.mix1_weight=2"],
        "outer.fgd.mix1_weight = 2.0: must be in",
    ),
    (
        "group-size",
        ["--set", "outer.noloco.group_size=1"],
        "outer.noloco.group_size = 1: must be at least 2",
    ),
    ("pull", ["--set", "outer.noloco.consensus_pull=-1"], "outer.noloco.consensus_pull = -1.0"),
    (
        "merge-alpha",
        ["--set", "outer.streaming.merge_alpha=2"],
        "outer.streaming.merge_alpha = 2.0: must be in",
    ),
    (
        "fragments-0",
        ["--set", "outer.streaming.fragments=0"],
        "outer.streaming.fragments = 0: must be at least 1",
    ),
    (
        "fragments-over-layers",
        [
            "--outer",
            "streaming",
            "--set",
            "outer.streaming.fragments=2",
            "--set",
            "outer.streaming.overlap=0",
        ],
        "outer.streaming.fragments = 2: cannot exceed model.n_layer = 1",
    ),
    (
        "overlap",
        [
            "--outer",
            "streaming",
            "--set",
            "outer.streaming.fragments=1",
            "--set",
            "outer.streaming.overlap=6",
        ],
        "outer.streaming.overlap = 6: must be in [0, outer.H / outer.streaming.fragments = 6)",
    ),
    (
        "forge-ddp",
        ["--outer", "ddp", "--workers", "2", "--inner-optimizer", "forge-adamw"],
        "optim.name = 'forge-adamw': FORGE updates weights inside backward",
    ),
    (
        "forge-bf16",
        ["--inner-optimizer", "forge-adamw", "--set", "run.dtype=bf16"],
        "run.dtype = 'bf16': FORGE updates weights inside backward",
    ),
    ("shards-0", ["--shards", "0"], "run.shards = 0: must be at least 1"),
    ("shards-word", ["--shards", "two"], "argument --shards: invalid int value"),
    (
        "shards-batch",
        ["--shards", "3"],
        "data.batch_size = 16: must be a multiple of run.shards = 3",
    ),
    (
        "shards-forge",
        ["--shards", "2", "--inner-optimizer", "forge-adamw"],
        "optim.name = 'forge-adamw': FORGE updates whole weights inside backward",
    ),
    (
        "shards-ddp",
        ["--shards", "2", "--outer", "ddp"],
        "outer.strategy = 'ddp': ddp averages gradients every step",
    ),
    ("inject-kind", ["--inject", "explode:worker=1"], "unknown fault 'explode'"),
    ("inject-worker", ["--inject", "kill:worker=9,round=1"], "kill names worker 9"),
    ("inject-round", ["--inject", "kill:worker=0,round=99"], "fires in round 99 but the run"),
    ("inject-p", ["--inject", "drop:p=1.5"], "p must be in [0, 1)"),
    ("inject-partition", ["--inject", "partition:worker=0,round=1"], "needs ['round', 'sec"),
    ("inject-slow", ["--inject", "slow:worker=0"], "needs factor= or seconds="),
    ("baseline", ["--baseline", "fedavg"], "--baseline 'fedavg': choose one of ddp"),
    ("config-missing", ["--config", "/nonexistent.toml"], "'/nonexistent.toml' does not exist"),
    ("markov-number", ["--set", "data.path='markov:order=x'"], "data.path = 'markov:order=x'"),
    ("out-dir-file", ["--set", "run.out_dir='/etc/hostname'"], "run.out_dir = '/etc/hostname'"),
]


@pytest.fixture
def out(tmp_path) -> Path:
    path = tmp_path / "runs"
    path.mkdir()
    return path


def _main(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def _assert_refused(code: int, lines: list[str], expected: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1, lines  # one line, no traceback
    assert lines[0].startswith("frugaltrain") and ": error: " in lines[0], lines
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("args, expected", [c[1:] for c in TRAIN], ids=[c[0] for c in TRAIN])
def test_train_refuses_bad_input_before_any_work(args, expected, text_dir, out, capsys):
    base = ["train", "--set", f"data.path={str(text_dir)!r}", "--set", f"run.out_dir={str(out)!r}"]
    base += ["--steps", "12", "-H", "6", "--set", "model.n_layer=1", "--set", "model.n_embd=32"]
    base += ["--set", "model.n_head=2", "--set", "data.seq_len=32", "--set", "run.progress=false"]
    code, lines = _main([*base, *args], capsys)
    _assert_refused(code, lines, expected)
    assert list(out.iterdir()) == []  # no run directory


def test_bad_data_files_are_named_with_the_byte_offset(tmp_path, out, capsys):
    blob = tmp_path / "data.txt"
    blob.write_bytes(b"text " * 2000 + b"\x00binary tail")  # past the first 4 KB
    code, lines = _main(["train", "--set", f"data.path={str(blob)!r}"], capsys)
    _assert_refused(code, lines, "binary data (a NUL byte) at byte offset 10000")
    empty = tmp_path / "empty"
    empty.mkdir()
    code, lines = _main(["train", "--set", f"data.path={str(empty)!r}"], capsys)
    _assert_refused(code, lines, "contains no readable text")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nworkers = 2")
    code, lines = _main(["train", "--config", str(bad)], capsys)
    _assert_refused(code, lines, "is not valid TOML")


RESUME = [
    ("changed-model", ["--set", "model.n_embd=64"], "different model/data/optim/outer config"),
    ("changed-workers", ["--workers", "2"], "written by 1 workers but run.workers = 2"),
    ("changed-seed", ["--set", "run.seed=3"], "different model/data/optim/outer config or seed"),
    (
        "reshard-sparse-feedback",
        ["--shards", "2", "--set", "outer.codec='topk:0.1'"],
        "outer.codec = 'topk:0.1' keeps each shard's unsent residual",
    ),
    ("bad-key", ["--set", "outer.Hh=1"], "unknown key outer.Hh"),
]


@pytest.mark.parametrize("args, expected", [c[1:] for c in RESUME], ids=[c[0] for c in RESUME])
def test_resume_refuses_changes_and_leaves_checkpoints_alone(finished_run, args, expected, capsys):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    code, lines = _main(["train", "--resume", str(finished_run), *args], capsys)
    _assert_refused(code, lines, expected)
    assert {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()} == before


def test_resume_refuses_a_conflicting_config_and_broken_run_dirs(
    finished_run, make_config, tmp_path, capsys
):
    other = tmp_path / "other.toml"
    other.write_text(to_toml(make_config("run.steps=12", "outer.lr=0.5")))
    code, lines = _main(["train", "--config", str(other), "--resume", str(finished_run)], capsys)
    _assert_refused(code, lines, "differs from")
    code, lines = _main(["train", "--resume", str(tmp_path / "nope")], capsys)
    _assert_refused(code, lines, "no config.toml there; pass a run directory")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((finished_run / "config.toml").read_text())
    code, lines = _main(["train", "--resume", str(bare)], capsys)
    _assert_refused(code, lines, "no complete checkpoint")
    for ckpt in sorted((finished_run / "checkpoints").iterdir()):
        (ckpt / "COMPLETE").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable COMPLETE manifest"):
        code, lines = _main(["train", "--resume", str(finished_run)], capsys)
    _assert_refused(code, lines, "no intact checkpoint")


OTHER = [
    ("report-missing", ["report", "/nonexistent/run"], "has no metrics.jsonl"),
    ("export-missing", ["export", "/nonexistent/run", "--out", "x"], "no config.toml there"),
    ("export-no-out", ["export", "/nonexistent/run"], "the following arguments are required"),
    ("data-vocab", ["data", "tokenizer", "--vocab-size", "10", "--out", "t"], "--vocab-size 10"),
    (
        "data-input",
        ["data", "tokenizer", "--input", "/nonexistent", "--vocab-size", "300", "--out", "t"],
        "/nonexistent",
    ),
    (
        "data-tokenizer",
        ["data", "prepare", "--tokenizer", "/nonexistent/tok", "--out", "s"],
        "/nonexistent/tok",
    ),
    ("simulate-key", ["simulate", "--set", "sim.warp=1"], "unknown key sim.warp"),
    ("simulate-ratio", ["simulate", "--set", "sim.ratio=-1"], "sim.ratio = -1.0: must be >= 0"),
    ("simulate-crash", ["simulate", "--set", "sim.crash_worker=7"], "sim.crash_worker = 7"),
    ("simulate-shards", ["simulate", "--set", "run.shards=2"], "run.shards = 2: the simulator"),
    ("compare-method", ["compare", "--methods", "foo", "--out", "c"], "unknown method 'foo'"),
    ("flow-mode", ["flow", "train", "--set", "run.mode=weird"], "run.mode = 'weird'"),
    ("flow-flag", ["flow", "train", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in OTHER], ids=[c[0] for c in OTHER])
def test_other_commands_refuse_bad_input(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative outputs would land here
    code, lines = _main(argv, capsys)
    _assert_refused(code, lines, expected)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_matrix_is_large():
    assert len(TRAIN) + len(RESUME) + len(OTHER) + 3 + 5 >= 80


def test_an_error_inside_a_worker_is_one_line_with_its_traceback_in_the_run_dir(
    text_dir, out, capsys
):
    args = ["train", "--workers", "2", "--set", f"data.path={str(text_dir)!r}", "--steps", "12"]
    args += ["-H", "6", "--set", f"run.out_dir={str(out)!r}", "--set", "optim.lr=1e30"]
    args += ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "run.progress=false"]
    args += ["--set", "optim.warmup_steps=0", "--set", "run.threads=1"]
    code, lines = _main(args, capsys)
    assert code == 1 and len(lines) == 1, lines  # a failed run, not bad input
    assert "FloatingPointError: [worker" in lines[0] and "non-finite loss" in lines[0]
    (run_dir,) = out.iterdir()
    logs = sorted(run_dir.glob("worker_*.log"))
    assert logs and "Traceback" in logs[0].read_text()
    assert json.loads(json.dumps(lines[0]))  # printable as it is


def test_coordinator_resume_names_a_damaged_store_journal(config_factory, tmp_path, capsys):
    """One line naming the journal and the way on, before the port opens; nothing written."""
    from frugaltrain.cluster.auth import new_token

    cfg = config_factory(tmp_path / "out", "fault_tolerance.enabled=true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(cfg))
    (run_dir / "store.journal").write_bytes(b"not a journal\n")
    new_token(tmp_path / "run.token")
    argv = ["coordinator", "--resume", str(run_dir), "--token", str(tmp_path / "run.token")]
    assert cli.main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "store.journal" in err[0] and "aside" in err[0], err
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml", "store.journal"]


def test_a_coordinator_without_its_key_file_says_so_before_the_port_opens(
    tmp_path, capsys, monkeypatch
):
    """The token file travels to every machine, its key file stays on the coordinator: a
    coordinator started with a copied token and no key is refused in one line."""
    from frugaltrain.cluster.auth import new_token

    token = new_token(tmp_path / "run.token")
    token.key_file.unlink()
    monkeypatch.chdir(tmp_path)  # a run directory would appear here
    assert cli.main(["coordinator", "--token", str(token.path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(token.key_file) in err[0] and "--new-token" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["run.token"]
