"""Emulated links (run.link_mbit, comm/pacing.py): the pacer's queue on a fake clock, paced
operations of a fake two-worker comm and of two gloo processes (never earlier than the link
allows, results bit for bit those of unpaced ones), the config and flag, and the labels every
figure of such a run carries."""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.gloo_pool import free_port

from frugaltrain.comm import topology
from frugaltrain.comm.base import Comm, Exchange, Handle, ring_allreduce_bytes
from frugaltrain.comm.pacing import PAYLOAD_SHARE, Pacer, links_label, pacer_of
from frugaltrain.config import ConfigError
from frugaltrain.metrics.report import format_comparison, format_summary, summarize, time_to_loss
from frugaltrain.train.flags import add_train_flags, overrides

MBIT = 8.0  # 1e6 bytes per second: a byte count reads as microseconds


class FakeClock:
    """Seconds that move only when slept through (or when a test says compute took some)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def fake_pacer(mbit: float = MBIT) -> tuple[Pacer, FakeClock]:
    clock = FakeClock()
    return Pacer(mbit, payload_share=1.0, clock=clock, sleep=clock.sleep), clock


# ---------------------------------------------------------------- the pacer alone


def test_operations_queue_on_one_link_and_take_the_larger_direction():
    pacer, clock = fake_pacer()
    assert pacer.post(2_000_000, 1_000_000) == pytest.approx(2.0)  # full duplex: max, not sum
    assert pacer.post(0, 500_000) == pytest.approx(2.5)  # FIFO: starts when the first ends
    clock.now = 10.0  # the link has been idle since 2.5
    assert pacer.post(1_000_000, 0) == pytest.approx(11.0)  # starts when posted


def test_a_wait_after_the_link_is_done_sleeps_nothing():
    pacer, clock = fake_pacer()
    until = pacer.post(1_000_000, 1_000_000)
    clock.now = 3.0  # compute went on past the transfer's end
    pacer.sleep_until(until)
    assert clock.slept == []
    pacer.sleep_until(pacer.post(250_000, 0))
    assert clock.slept == [pytest.approx(0.25)] and clock.now == pytest.approx(3.25)


def test_handle_books_the_paced_sleep_as_blocking_time():
    pacer, clock = fake_pacer()
    stats = Comm().stats
    stats.current_op = "mix1"
    done = []
    handle = Handle(stats, lambda: done.append(True))
    handle.pace(pacer, pacer.post(1_500_000, 0))
    clock.now = 0.5  # half a second of compute after posting
    assert not handle.is_completed()
    handle.wait()
    assert done == [True] and clock.now == pytest.approx(1.5)
    assert stats.blocking_s == pytest.approx(1.0)
    assert stats.blocking_by_op == {"mix1": pytest.approx(1.0)}
    handle.wait()  # once only
    assert stats.blocking_s == pytest.approx(1.0)


def test_a_complete_handle_still_waits_for_its_link():
    pacer, clock = fake_pacer()
    handle = Handle(Comm().stats)  # nothing to wait for on the transport
    handle.pace(pacer, pacer.post(1_000_000, 0))
    assert not handle.is_completed()
    clock.now = 1.0
    assert handle.is_completed()
    handle.wait()
    assert clock.slept == []


def test_pacer_of_gives_each_worker_its_rate_and_a_replica_shares_its_link():
    assert pacer_of([], 3) is None
    assert pacer_of([20.0], 3).mbit == 20.0
    assert pacer_of([20.0, 20.0, 5.0], 2).mbit == 5.0
    assert pacer_of([20.0, 8.0], 1, shards=2).mbit == 4.0
    with pytest.raises(ValueError, match="> 0"):
        Pacer(0.0)
    clock = FakeClock()  # by default a link of R carries PAYLOAD_SHARE x R of payload
    assert Pacer(8.0, clock=clock).post(900_000, 0) == pytest.approx(7.2 / (PAYLOAD_SHARE * 8))
    assert links_label([20.0]) == "emulated 20 Mbit/s"
    assert links_label([20.0, 20.0, 5.5]) == "emulated 20,20,5.5 Mbit/s"


# ---------------------------------------------------------------- a fake two-worker comm


class PeerComm(Comm):
    """Worker 0 of two whose peer's contribution is `peer` times its own: every transport
    primitive is complete at once (only the pacing can make a wait take time). Records which
    path each mix took."""

    def __init__(self, peer: float = 3.0) -> None:
        super().__init__()
        self.members, self.world_size, self.peer = [0, 1], 2, peer
        self.apart: list[bool] = []

    def _all_reduce_sum(self, tensors, scale):
        def finish():
            for t in tensors:
                t.mul_((1 + self.peer) * scale)

        return Handle(self.stats, finish)

    def _all_gather(self, parts, seq):
        return Exchange(lambda: {0: parts, 1: [p * self.peer for p in parts]}, lambda: True)

    def _exchange(self, parts, send_to, recv_from, seq):
        got = {r: [p * self.peer for p in parts] for r in recv_from}
        return Exchange(lambda: got, lambda: True)

    def _mix_apart(self, tensors, w, codec, feedback):
        self.apart.append(True)
        return None  # the common path, like TorchDistComm

    def _metric_sum(self, t):
        t.mul_(1 + self.peer)


N = 250_000  # fp32 values: 1e6 bytes of payload


def _ops(comm: PeerComm) -> list[torch.Tensor]:
    """A blocking all-reduce, a non-blocking coded one and a blocking 2x2 mix; their results."""
    a = [torch.linspace(0, 1, N)]
    comm.all_reduce_mean_(a)
    b = [torch.linspace(-1, 1, N)]
    comm.all_reduce_mean_(b, codec="int8", blocking=False).wait()
    c = [torch.linspace(2, 3, N)]
    comm.mix_(c, np.array([[0.75, 0.25], [0.25, 0.75]]))
    return a + b + c


def test_a_paced_all_reduce_returns_at_the_links_end_and_not_before():
    comm = PeerComm()
    comm.pacer, clock = fake_pacer()
    x = [torch.ones(N)]
    comm.all_reduce_mean_(x)
    nbytes = ring_allreduce_bytes(4 * N, 2)  # 2 (M-1)/M S = S at M = 2
    assert comm.stats.bytes_sent == comm.stats.bytes_received == nbytes
    assert clock.now == pytest.approx(nbytes * 8 / (MBIT * 1e6))  # 1.0 s
    assert comm.stats.blocking_s == pytest.approx(1.0)
    assert torch.equal(x[0], torch.full((N,), 2.0))  # (1 + 3) / 2


def test_a_non_blocking_op_overlaps_compute_and_the_next_one_queues_behind_it():
    comm = PeerComm()
    comm.pacer, clock = fake_pacer()
    first = comm.all_reduce_mean_([torch.ones(N)], blocking=False)  # the link: 0 .. 1 s
    assert clock.now == 0.0  # posted, not waited
    clock.now = 0.25  # compute
    second = comm.mix_([torch.ones(N)], np.array([[0.5, 0.5], [0.5, 0.5]]), blocking=False)
    clock.now = 1.5  # more compute: the first is done, the second (1 .. 2 s) is not
    first.wait()
    assert clock.slept == []
    second.wait()
    assert clock.now == pytest.approx(2.0) and comm.stats.blocking_s == pytest.approx(0.5)


def test_pacing_changes_no_result_and_keeps_the_runtimes_own_path():
    plain, paced = PeerComm(), PeerComm()
    paced.pacer, clock = fake_pacer()
    for got, want in zip(_ops(paced), _ops(plain), strict=True):
        assert torch.equal(got, want)
    assert (paced.stats.bytes_sent, paced.stats.bytes_received) == (
        plain.stats.bytes_sent,
        plain.stats.bytes_received,
    )
    # Every op's bytes went through the one link, back to back (each was waited at once).
    sent, received = paced.stats.bytes_sent, paced.stats.bytes_received
    assert sent == received and clock.now == pytest.approx(sent * 8 / (MBIT * 1e6))
    # Only the non-blocking mix asks for the runtime's own path (the fault-tolerant Mix1).
    for comm in (plain, paced):
        comm.apart.clear()
        comm.mix_([torch.ones(4)], np.array([[0.5, 0.5], [0.5, 0.5]]), blocking=False).wait()
        comm.mix_([torch.ones(4)], np.array([[0.5, 0.5], [0.5, 0.5]]))
        assert comm.apart == [True]


def test_without_a_pacer_handles_are_untouched():
    comm = PeerComm()
    handle = comm.all_reduce_mean_([torch.ones(8)], blocking=False)
    assert handle._pacer is None and handle.is_completed() is False  # its wait_fn is pending
    handle.wait()
    assert comm.pacer is None


# ---------------------------------------------------------------- two gloo processes


def _gloo_worker(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from frugaltrain.comm.torchdist import TorchDistComm

    try:
        results = {}
        for paced in (False, True):
            comm = TorchDistComm()
            clock = FakeClock()
            if paced:
                comm.pacer = Pacer(MBIT, payload_share=1.0, clock=clock, sleep=clock.sleep)
            values, ends = [], []
            for kind, codec, blocking in (
                ("average", "fp32", True),
                ("average", "e3m0", False),
                ("pairs", "fp32", True),
            ):
                x = [torch.randn(N, generator=torch.Generator().manual_seed(rank + 7))]
                before = comm.stats.bytes_sent
                if kind == "average":
                    handle = comm.all_reduce_mean_(x, codec=codec, blocking=blocking)
                else:
                    w = topology.mixing_matrix("pairs", 2, round_idx=1, seed=0)
                    handle = comm.mix_(x, w, codec=codec, blocking=blocking)
                handle.wait()
                values.append(x[0])
                ends.append((clock.now, comm.stats.bytes_sent - before))
            results[paced] = (values, ends, comm.stats.blocking_s)
        out[rank] = results
    finally:
        dist.destroy_process_group()


def test_paced_gloo_ops_end_no_earlier_than_the_link_and_give_the_same_bits():
    out = mp.Manager().dict()
    mp.start_processes(_gloo_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    for rank in range(2):
        plain, paced = out[rank][False], out[rank][True]
        for got, want in zip(paced[0], plain[0], strict=True):
            assert torch.equal(got, want)
        # Each op was waited at once: on the fake clock it ends when the link has moved all
        # the bytes so far (sent = received here), at 1e6 bytes per second.
        total = 0
        for end, nbytes in paced[1]:
            total += nbytes
            assert nbytes > 0 and end == pytest.approx(total / 1e6)
        assert plain[1][-1][0] == 0.0  # the unpaced comm never slept


# ---------------------------------------------------------------- config and flag


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("run.workers=4", "run.link_mbit=[20, 5]"),
            r"run.link_mbit = \[20.0, 5.0\]: give one rate for every worker or run.workers = 4",
        ),
        (("run.workers=2", "run.link_mbit=[20, 0]"), "run.link_mbit = .*every rate must be > 0"),
        (("run.link_mbit=[-1]",), "every rate must be > 0"),
    ],
)
def test_a_wrong_count_or_rate_is_refused(make_config, sets, message):
    with pytest.raises(ConfigError, match=message):
        make_config(*sets)


def test_one_rate_or_one_per_worker_is_taken(make_config):
    assert make_config("run.workers=4", "run.link_mbit=[20]").run.link_mbit == [20.0]
    cfg = make_config("run.workers=2", "run.link_mbit=[20, 5]")
    assert cfg.run.link_mbit == [20.0, 5.0]
    assert make_config().run.link_mbit == []
    with pytest.warns(UserWarning, match="no effect with run.workers = 1"):
        make_config("run.link_mbit=[20]")


def test_the_flag_is_a_shortcut_for_the_key(make_config):
    p = argparse.ArgumentParser()
    add_train_flags(p)
    sets = overrides(p.parse_args(["--link-mbit", "20,20,20,5"]))
    assert sets == ["run.link_mbit=[20.0, 20.0, 20.0, 5.0]"]
    assert make_config("run.workers=4", *sets).run.link_mbit == [20.0, 20.0, 20.0, 5.0]
    with pytest.raises(ConfigError, match="--link-mbit '20Mbit': give rates in Mbit/s"):
        overrides(p.parse_args(["--link-mbit", "20Mbit"]))


def test_the_simulator_says_it_does_not_pace(text_dir):
    from frugaltrain.sim.config import load_sim_config

    sets = [f"data.path={str(text_dir)!r}", "run.workers=2", "run.link_mbit=[20]"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_sim_config(None, sets)
    assert any("run.link_mbit" in str(w.message) for w in caught)


# ---------------------------------------------------------------- labels


def _rounds(walls: list[float], losses: list[float], links: str | None) -> list[dict]:
    extra = {"links": links} if links else {}
    return [
        {
            "kind": "round",
            "round": i + 1,
            "step": 10 * (i + 1),
            "strategy": "diloco",
            "workers": 4,
            "clock": "measured",
            "tokens": 100 * (i + 1),
            "loss/train": loss,
            "loss/val": loss,
            "time/compute_s": 1.0,
            "time/blocking_s": 0.5,
            "comm/bytes_sent": 10,
            "comm/bytes_received": 10,
            "time/wall_s": t,
            **extra,
        }
        for i, (t, loss) in enumerate(zip(walls, losses, strict=True))
    ]


def test_time_to_loss_interpolates_between_evaluations():
    records = _rounds([10.0, 20.0, 30.0], [3.0, 2.0, 1.0], None)
    assert time_to_loss(records, 2.5) == pytest.approx(15.0)
    assert time_to_loss(records, 3.5) == pytest.approx(10.0)  # at the first evaluation
    assert time_to_loss(records, 1.0) == pytest.approx(30.0)
    assert time_to_loss(records, 0.5) is None


def test_the_side_by_side_gives_the_time_to_the_baselines_loss_as_a_ratio():
    ours = _rounds([10.0, 20.0, 30.0], [2.5, 1.5, 1.0], "emulated 20 Mbit/s")
    theirs = _rounds([20.0, 40.0], [2.0, 1.5], "emulated 20 Mbit/s")
    text = format_comparison(summarize(ours), summarize(theirs), ("fgd", "diloco"), (ours, theirs))
    row = next(
        line for line in text.splitlines() if line.startswith("wall s to the baseline's final")
    )
    assert "emulated 20 Mbit/s links" in row
    assert row.split()[-3:] == ["20", "40", "0.500"]  # ours reached 1.5 at 20 s, theirs at 40 s
    slow = _rounds([10.0, 20.0], [2.5, 1.8], None)
    text = format_comparison(summarize(slow), summarize(theirs), ("fgd", "diloco"), (slow, theirs))
    assert text.splitlines()[-1].endswith("not reached          40   not reached")


def test_an_emulated_runs_summary_and_plot_say_so(tmp_path, monkeypatch, make_config):
    from frugaltrain.train import baseline

    records = _rounds([10.0, 20.0], [2.0, 1.5], "emulated 20,5 Mbit/s")
    summary = summarize(records)
    assert summary["links"] == "emulated 20,5 Mbit/s"
    assert "wall s (measured, emulated 20,5 Mbit/s links)" in format_summary(summary)
    assert "links" not in summarize(_rounds([10.0], [2.0], None))  # unpaced: as before

    cfg = make_config("run.workers=2", "run.link_mbit=[20, 5]", "outer.strategy='fgd'")
    base = baseline.baseline_config(cfg, "diloco")
    assert base.run.link_mbit == [20.0, 5.0]  # the baseline runs on the same links
    run_dir, base_dir = tmp_path / "run", baseline.baseline_dir(base)
    for d in (run_dir, base_dir):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    labels = []
    monkeypatch.setattr(baseline, "plot_loss_vs_wall", lambda runs, path: labels.extend(runs))
    baseline.plot_beside(cfg, Path(run_dir), "diloco")
    assert [label for label, _ in labels] == [
        "fgd, H = 6 (run, measured, emulated 20,5 Mbit/s links)",
        "diloco, H = 6 (baseline, measured, emulated 20,5 Mbit/s links)",
    ]
