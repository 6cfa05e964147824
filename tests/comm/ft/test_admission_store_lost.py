"""A member at a round end when the run's store is lost there (its coordinator gone at that very
moment, across machines): it admits nobody, keeps the joiners' records it has not logged yet for
later, and goes on without an error; the next round end's all-reduce stops the run as designed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from frugaltrain.comm.ft.admission import Admission
from frugaltrain.comm.ft.elastic_world import ElasticWorld


class LostStore:
    """A store whose coordinator is gone: every call fails as gloo's TCP store fails."""

    def __init__(self) -> None:
        self.calls = 0

    def _lost(self, *args) -> None:
        self.calls += 1
        raise dist.DistNetworkError("Connection reset by peer. The coordinator is gone")

    check = get = compare_set = _lost


def _member(store: LostStore) -> SimpleNamespace:
    """The parts of an ElasticWorld that a round end's admission reads, with its own guard."""
    w = SimpleNamespace(rank=1, round=3, epoch=0, store=store, store_lost=False)
    w.me = SimpleNamespace(held_store=True)  # across machines: a lost store is survivable
    w.has = lambda key: ElasticWorld.has(w, key)
    w.guarded = lambda call, default: ElasticWorld.guarded(w, call, default)
    w.lose_store = lambda why: ElasticWorld.lose_store(w, why)
    w.rendezvous = lambda *a: pytest.fail("admitted with the store lost")
    return w


@pytest.mark.parametrize("logs", [True, False])
def test_a_round_end_with_the_store_lost_admits_nobody_and_goes_on(logs, capsys):
    store = LostStore()
    world = _member(store)
    oplog = SimpleNamespace(world=world, finish_pending=lambda: pytest.fail("admission began"))
    admission = Admission(oplog, mix1=None, means=None, shard_link=None, logs=logs)
    admission._records_due = ["record/a-joiner"]  # joined at the last round end
    admission.at_round_end(3, state_fn=lambda: pytest.fail("sent a state"))
    assert world.store_lost and store.calls == 1  # the first store call finds it lost; no more
    assert admission._records_due == ["record/a-joiner"]  # kept, not lost
    assert "the run's store is gone (Connection reset by peer)" in capsys.readouterr().out
