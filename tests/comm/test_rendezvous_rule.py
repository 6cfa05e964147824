"""The rules every participant of a rendezvous round applies (comm/rendezvous.py `decide`, and
`donor_after` for each joiner's donor)."""

from __future__ import annotations

from frugaltrain.comm.rendezvous import decide, donor_after


def _who(worker: int, epoch: int, purpose: str, round_idx: int = 7) -> dict:
    return {"worker": worker, "epoch": epoch, "purpose": purpose, "round": round_idx}


def test_first_start_takes_everybody_and_admits_nobody():
    who = [_who(w, -1, "start", 0) for w in (2, 0, 1)]
    assert decide(who) == ([0, 1, 2], [], [], [])


def test_recovery_keeps_the_survivors_and_defers_a_joiner():
    # Worker 2 died; its restarted incarnation is already waiting when the others recover
    # mid-round: it took part in none of the operations they re-post, so it waits.
    who = [_who(0, 4, "recover"), _who(1, 4, "recover"), _who(2, -1, "join")]
    assert decide(who) == ([0, 1], [], [], [2])


def test_admission_needs_every_member_at_the_same_round_end():
    members_ready = [_who(0, 4, "admit"), _who(1, 4, "admit"), _who(2, -1, "join")]
    assert decide(members_ready) == ([0, 1, 2], [2], [], [])
    one_recovering = [_who(0, 4, "admit"), _who(1, 4, "recover"), _who(2, -1, "join")]
    assert decide(one_recovering) == ([0, 1], [], [], [2])
    different_rounds = [_who(0, 4, "admit", 7), _who(1, 4, "admit", 8), _who(2, -1, "join")]
    assert decide(different_rounds) == ([0, 1], [], [], [2])


def test_a_member_the_others_went_on_without_is_stale():
    # Worker 1 was cut off in epoch 3; workers 0 and 2 formed epoch 4 without it. When it comes
    # back it meets them in their next round: it must restart, not carry on with old state.
    who = [_who(0, 4, "admit"), _who(1, 3, "recover"), _who(2, 4, "admit")]
    assert decide(who) == ([0, 2], [], [1], [])


def test_only_joiners_left_wait():
    assert decide([_who(3, -1, "join")]) == ([], [], [], [3])


def test_a_joiner_asks_the_next_donor_after_each_refusal_wrapping_around():
    old = [4, 0, 2]  # the old members, in any order
    assert donor_after(old, []) == (0, False)  # the lowest first
    assert donor_after(old, [0]) == (2, False)
    assert donor_after(old, [0, 2]) == (4, False)
    assert donor_after(old, [4]) == (0, False)  # after the highest: the lowest again
    assert donor_after(old, [2, 4]) == (0, False)
    assert donor_after(old, [3]) == (4, False)  # refused a worker no longer a member


def test_the_donor_order_starts_over_once_every_old_member_was_refused():
    assert donor_after([0, 2, 4], [0, 2, 4]) == (0, True)
    assert donor_after([0, 2, 4], [2, 4, 0]) == (2, True)  # from after the last one refused
    assert donor_after([1], [1]) == (1, True)  # one old member: it is asked again
