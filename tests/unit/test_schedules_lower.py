"""The p2p lowering (``parbench.schedules.lower``) checked without ranks, for every registered
schedule, and the action text form (``Action.from_str`` / ``str``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parbench.schedules import (
    P2P_KINDS,
    SCHEDULES,
    Action,
    ActionKind,
    ScheduleError,
    continuous_schedule,
    lower,
    make_schedule,
    p2p_problems,
    parse_row,
    row_text,
    step_bounds,
    validate,
)
from parbench.schedules.lower import transfer_key

#: a shape every registered schedule accepts (DualPipe: even p, m >= 2p; Chimera: p | m)
SHAPES = [(2, 4), (4, 8), (6, 12)]


def _built(name: str, p: int, m: int):
    return validate(make_schedule(name, p, m))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("lookahead", [0, 1])
def test_every_schedule_lowers_to_matched_ordered_deadlock_free_p2p(name, p, m, lookahead):
    schedule = _built(name, p, m)
    lowered = lower(schedule, lookahead=lookahead)
    assert p2p_problems(lowered) == []
    for r, row in enumerate(lowered.actions):
        # the compute actions are the schedule's, in its order; p2p entries only in between
        assert [a for a in row if a.kind not in P2P_KINDS] == schedule.actions[r]
        # one send per cross-rank transfer the schedule implies (its validator's count)
    sends = sum(a.kind in (ActionKind.SEND_F, ActionKind.SEND_B)
                for row in lowered.actions for a in row)
    assert sends == len(schedule.comm())


def test_sends_and_receives_pair_in_the_same_order_per_pair_of_ranks():
    """The property NCCL needs, stated directly on 1F1B p=4 m=8: for every ordered pair the
    receiver's list of keys from the sender is the sender's list of keys to the receiver."""
    lowered = lower(_built("1f1b", 4, 8), lookahead=1)
    for src in range(4):
        for dst in range(4):
            out = [transfer_key(a) for a in lowered.actions[src]
                   if a.kind in ("SF", "SB") and lowered.peer(a) == dst]
            got = [transfer_key(a) for a in lowered.actions[dst]
                   if a.kind in ("RF", "RB") and lowered.peer(a) == src]
            assert out == got
            assert bool(out) == (abs(src - dst) == 1)


def test_a_receiver_posts_earlier_messages_from_one_sender_first():
    """ZB-V p=2: rank 1's B0 of stage 2 needs the gradient from rank 0 (stage 3), which rank 0
    sends after the activation of F2 (stage 0 -> 1). Even without lookahead, rank 1 posts
    that activation's receive first, in the same batch, so the pair's orders agree."""
    lowered = lower(_built("zbv", 2, 4), lookahead=0)
    assert p2p_problems(lowered) == []
    row = lowered.text()[1].split()
    at = row.index("B0s2")
    assert row[at - 3:at] == ["SF1s2", "RF2s1", "RB0s2"]


def test_the_checks_catch_a_swapped_pair_a_lost_send_and_a_late_receive():
    lowered = lower(_built("1f1b", 3, 6), lookahead=0)
    row = list(lowered.actions[1])
    recvs = [i for i, a in enumerate(row) if a.kind == "RF"]
    i, j = recvs[0], recvs[1]
    swapped = row[:]
    swapped[i], swapped[j] = swapped[j], swapped[i]
    bad = replace(lowered, actions=[lowered.actions[0], swapped, lowered.actions[2]])
    assert any("orders differ" in msg or "not before" in msg for msg in p2p_problems(bad))
    lost = [a for a in lowered.actions[0] if a.kind != "SF" or a.mb != 2]
    bad = replace(lowered, actions=[lost, *lowered.actions[1:]])
    assert any("sent once and received once" in msg for msg in p2p_problems(bad))
    late = row[:]
    k = late.index(Action(ActionKind.FORWARD, 0, 1))
    late.insert(k + 1, late.pop(recvs[0]))  # the receive after its consumer
    bad = replace(lowered, actions=[lowered.actions[0], late, lowered.actions[2]])
    assert any("not before its compute" in msg for msg in p2p_problems(bad))


def test_the_rendezvous_model_has_power():
    """Under rendezvous batches (NCCL with messages larger than its buffers) the 1F1B family
    is safe, while looped BFS's two ranks both send before either receives: the check says
    so (a model that passed everything could not fail)."""
    assert p2p_problems(lower(_built("1f1b", 4, 8)), rendezvous=True) == []
    assert p2p_problems(lower(_built("gpipe", 4, 8)), rendezvous=True) == []
    problems = p2p_problems(lower(_built("bfs", 2, 4)), rendezvous=True)
    assert problems == ["bfs: the lowered lists deadlock with rendezvous batches"]


def test_a_continuous_run_is_lowered_without_posting_across_a_step():
    p, m, steps = 3, 4, 3
    run = continuous_schedule("pipedream", p, m, steps)
    bounds = step_bounds(run, m, steps)
    cuts = [[b[r][0] for b in bounds] for r in range(p)]
    lowered = lower(run, lookahead=1, cuts=cuts)
    assert p2p_problems(lowered) == []
    for r in range(p):
        for t in range(steps):
            lo, hi = bounds[t][r]
            part = lowered.actions[r][lowered.starts[r][lo]:lowered.starts[r][hi]]
            compute = [a for a in part if a.kind not in P2P_KINDS]
            assert compute == run.actions[r][lo:hi]
            # every receive posted in step t feeds a compute action of step t
            consumers = {(a.mb, a.stage) for a in compute}
            assert all((a.mb, a.stage) in consumers for a in part if a.kind in ("RF", "RB"))


# ---- text ----------------------------------------------------------------------------
kinds = st.sampled_from(list(ActionKind))
actions = st.builds(Action, kinds, st.integers(0, 10**6), st.integers(0, 999), st.integers(0, 1))


@given(st.lists(actions, max_size=20))
@settings(max_examples=60, deadline=None)
def test_actions_round_trip_through_text(row):
    for a in row:
        assert Action.from_str(str(a)) == a
    assert parse_row(row_text(row)) == row


def test_text_forms_and_bad_text():
    assert str(Action("F", 3, 0)) == "F3s0" and str(Action("BW", 3, 5, 1)) == "BW3s5p1"
    assert Action.from_str("SF2s1") == Action(ActionKind.SEND_F, 2, 1)
    assert Action.from_str("RB0s3p1") == Action(ActionKind.RECV_B, 0, 3, 1)
    for text in ("X3s0", "F3", "F-1s0", "Fs0", "F3s0q"):
        with pytest.raises(ScheduleError, match="is not KIND MB s STAGE"):
            Action.from_str(text)


def test_a_schedule_stated_as_text_validates_and_lowers():
    """A suite or a test can state a schedule's rows as text: 1F1B on two ranks by hand."""
    base = make_schedule("1f1b", 2, 2)
    hand = base.with_text(["F0s0 F1s0 BW0s0 BW1s0", "F0s1 BW0s1 F1s1 BW1s1"])
    assert hand.actions == base.actions and base.text() == hand.text()
    wrong = base.with_text(["BW0s0 F0s0 F1s0 BW1s0", "F0s1 BW0s1 F1s1 BW1s1"])
    with pytest.raises(ScheduleError):
        validate(wrong)
    assert p2p_problems(lower(validate(hand))) == []
    lowered = lower(hand, lookahead=0).text()
    assert lowered == ["F0s0 SF0s0 F1s0 SF1s0 RB0s0 BW0s0 RB1s0 BW1s0",
                       "RF0s1 F0s1 BW0s1 SB0s1 RF1s1 F1s1 BW1s1 SB1s1"]
