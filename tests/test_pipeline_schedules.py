"""Pipeline schedules as data: completeness, deadlock freedom, and the bubble / memory formulas.

Pure Python, no processes. The formulas (docs/design.md#pipeline-schedules) are exact under these
cost models, checked on the simulated timelines:

- GPipe, 1F1B: bubble (P-1)/(M+P-1) for *any* constant per-stage F and B costs (F=1, B=2 and
  others).
- Interleaved 1F1B: (P-1)/(V·M+P-1) when every model chunk costs 1/V of a rank's per-micro-batch F
  and B — i.e. constant per-chunk costs, here F=1, B=2 per chunk (and F=B=1).
- ZB-H1 with F = I = W = 1: (P-1)/(3M+P-1), strictly below 1F1B's (P-1)/(M+P-1) with F=1, B=I+W=2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from fivefold.formulas import pipeline_idle
from fivefold.observe.report import plot_timeline, to_chrome_trace
from fivefold.pipeline import (
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    B,
    DeadlockError,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    build_schedule,
    check_deadlock_free,
    gpipe,
    interleaved_1f1b,
    iter_steps,
    lower,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)
from fivefold.pipeline.simulator import OVERLAPPED, Timeline, bubble_formula, simulate

SIZES = [(1, 3), (2, 2), (2, 4), (2, 8), (3, 3), (3, 5), (4, 4), (4, 8), (4, 13), (5, 7), (8, 8), (8, 16)]
INTERLEAVED_SIZES = [(1, 2), (2, 2), (2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12), (8, 16)]


def all_schedules():
    for P, M in SIZES:
        for name in ("gpipe", "1f1b", "zb-h1"):
            yield build_schedule(name, P, M)
    for P, M in INTERLEAVED_SIZES:
        for V in (2, 3):
            yield build_schedule("interleaved", P, M, V)


# ---------------------------------------------------------------------------------------------
# bubble and memory formulas


@pytest.mark.parametrize("P,M", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_exact_for_any_constant_costs(name, P, M):
    # Warm-up costs (P-1)·F and cool-down (P-1)·B on the critical path, whatever F and B are,
    # so the textbook (P-1)/(M+P-1) is exact for F=1, B=2 — and for F=B or any other constant pair.
    for costs in ({F: 1, B: 2}, {F: 1, B: 1}, {F: 1.5, B: 4.0}):
        t = simulate(build_schedule(name, P, M), costs)
        assert math.isclose(t.bubble_fraction, bubble_formula(name, P, M), abs_tol=1e-12), (name, P, M, costs)
        assert math.isclose(t.makespan, (M + P - 1) * (costs[F] + costs[B]))


@pytest.mark.parametrize("P,M", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 6), (8, 16)])
@pytest.mark.parametrize("V", [2, 3])
def test_interleaved_bubble_is_exact_with_per_chunk_costs(P, M, V):
    # Megatron's analysis: a chunk holds 1/V of the rank's layers, so it costs F/V and B/V; with
    # constant per-chunk costs (here F=1, B=2 per chunk) the bubble is exactly (P-1)/(V·M+P-1).
    s = interleaved_1f1b(P, M, V)
    for costs in ({F: 1, B: 2}, {F: 1, B: 1}):
        t = simulate(s, costs)
        assert math.isclose(t.bubble_fraction, bubble_formula("interleaved", P, M, V), abs_tol=1e-12)
    # same work per rank as 1F1B with full-stage costs V·F, V·B — but a shorter step
    t_il = simulate(s, {F: 1, B: 2})
    t_1f1b = simulate(one_f_one_b(P, M), {F: V, B: 2 * V})
    assert t_il.makespan < t_1f1b.makespan
    assert math.isclose(t_1f1b.makespan - t_il.makespan, (P - 1) * 3 * (V - 1))


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (2, 8), (3, 5), (4, 4), (4, 8), (4, 13), (8, 8), (8, 24)])
def test_zero_bubble_h1_beats_1f1b_at_equal_peak_memory(P, M):
    zb = simulate(zero_bubble_h1(P, M))  # F=1, I=1, W=1
    ref = simulate(one_f_one_b(P, M))  # F=1, B=2 = I + W
    assert zb.bubble_fraction < ref.bubble_fraction
    assert math.isclose(zb.makespan, 3 * M + P - 1)  # 1F1B: 3·(M+P-1)
    assert math.isclose(zb.bubble_fraction, bubble_formula("zb-h1", P, M), abs_tol=1e-12)
    # activations live from F to W: every rank holds at most P micro-batches — 1F1B's peak (its first stage)
    assert max(zb.peak_in_flight) <= max(ref.peak_in_flight) == P
    assert zb.peak_in_flight[0] == ref.peak_in_flight[0] == P


def test_zero_bubble_h1_numbers_p4_m8():
    zb, ref = simulate(zero_bubble_h1(4, 8)), simulate(one_f_one_b(4, 8))
    assert (zb.makespan, ref.makespan) == (27, 33)
    assert math.isclose(zb.bubble_fraction, 3 / 27) and math.isclose(ref.bubble_fraction, 3 / 11)
    assert zb.peak_in_flight == [4, 4, 4, 4] and ref.peak_in_flight == [4, 3, 2, 1]


@pytest.mark.parametrize("P,M", SIZES)
def test_activations_in_flight(P, M):
    assert simulate(gpipe(P, M)).peak_in_flight == [M] * P
    peaks = simulate(one_f_one_b(P, M)).peak_in_flight
    assert peaks == [P - r for r in range(P)]
    assert peaks[0] == P  # M >= P


def test_bubble_formula_values():
    assert bubble_formula("gpipe", 4, 8) == bubble_formula("1f1b", 4, 8) == 3 / 11
    assert bubble_formula("interleaved", 4, 8, 2) == 3 / 19
    assert bubble_formula("zb-h1", 4, 8) == 3 / 27
    with pytest.raises(ValueError, match="no bubble formula"):
        bubble_formula("dualpipe", 4, 8)


# ---------------------------------------------------------------------------------------------
# completeness, lowering, deadlock freedom


def test_every_schedule_validates_lowers_and_is_deadlock_free():
    n = 0
    for s in all_schedules():
        validate(s)
        low = lower(s)
        assert low.is_lowered and lower(s).actions == low.actions
        validate(low)
        check_deadlock_free(low)
        check_deadlock_free(low, rendezvous=True)  # sends that block until matched (NCCL) are fine too
        # the compute order is unchanged, and with free communication the lowered lists run as fast
        assert [low.compute_actions(r) for r in range(s.n_ranks)] == s.actions
        assert math.isclose(simulate(low).makespan, simulate(s).makespan)
        n += 1
    assert n == len(SIZES) * 3 + len(INTERLEAVED_SIZES) * 2


def test_registry():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev"}
    assert build_schedule("interleaved", 2, 4, V=2).stage_to_rank == [0, 1, 0, 1]
    assert interleaved_1f1b(2, 4, 2).stages_of(1) == [1, 3]
    assert zero_bubble_h1(2, 2).split_backward and not one_f_one_b(2, 2).split_backward


def test_lowered_1f1b_lists_read_as_expected():
    low = lower(one_f_one_b(2, 3))
    assert [str(a) for a in low.actions[0]] == [
        "F0@s0", "SEND_F0@s0->r1",
        "F1@s0", "SEND_F1@s0->r1", "RECV_B0@s0<-r1",
        "B0@s0",
        "F2@s0", "SEND_F2@s0->r1", "RECV_B1@s0<-r1",
        "B1@s0", "RECV_B2@s0<-r1",
        "B2@s0",
    ]  # fmt: skip
    assert [str(a) for a in low.actions[1]] == [
        "RECV_F0@s1<-r0", "F0@s1", "B0@s1", "SEND_B0@s1->r0",
        "RECV_F1@s1<-r0", "F1@s1", "B1@s1", "SEND_B1@s1->r0",
        "RECV_F2@s1<-r0", "F2@s1", "B2@s1", "SEND_B2@s1->r0",
    ]  # fmt: skip


def test_interleaved_lowering_pairs_forward_and_backward_like_megatron():
    low = lower(interleaved_1f1b(2, 4, 2))
    rank0 = [str(a) for a in low.actions[0]]
    # steady state: receives for F and the B after it, then F B, then both sends in one batch
    i = rank0.index("B0@s2")
    assert rank0[i - 1] == "F2@s0" and rank0[i - 2] == "RECV_B0@s2<-r1"
    assert rank0[i + 1 : i + 3] == ["SEND_F2@s0->r1", "SEND_B0@s2->r1"]


def test_iter_steps_groups_communication_into_batches():
    steps = list(iter_steps(lower(one_f_one_b(2, 3)).actions[0]))
    assert [str(x) if isinstance(x, Action) else [str(a) for a in x] for x in steps[:4]] == [
        "F0@s0",
        ["SEND_F0@s0->r1"],
        "F1@s0",
        ["SEND_F1@s0->r1", "RECV_B0@s0<-r1"],
    ]


def test_same_rank_neighbours_need_no_communication():
    for s in (gpipe(1, 3), one_f_one_b(1, 2), zero_bubble_h1(1, 2), interleaved_1f1b(1, 2, 3)):
        low = lower(s)
        assert all(a.is_compute for a in low.actions[0])
        validate(low)
        check_deadlock_free(low)
    # interleaved P=1: stages 0, 1, 2 all on rank 0, run back to back
    t = simulate(interleaved_1f1b(1, 2, 3))
    assert t.bubble_fraction == 0


def test_action_matching_and_str():
    send = Action(SEND_F, 3, 1, peer=2)
    assert str(send) == "SEND_F3@s1->r2" and str(Action(F, 3, 1)) == "F3@s1"
    assert send.counterpart(1) == Action(RECV_F, 3, 2, peer=1)
    assert Action(RECV_F, 3, 2, peer=1).counterpart(2) == send
    assert Action(SEND_B, 0, 2, peer=0).counterpart(1) == Action(RECV_B, 0, 1, peer=1)
    with pytest.raises(ValueError, match="needs peer"):
        Action(SEND_F, 0, 0)
    with pytest.raises(ValueError, match="unknown action kind"):
        Action("X", 0, 0)


def _replace_rank(s: Schedule, rank: int, acts: list[Action]) -> Schedule:
    actions = [list(a) for a in s.actions]
    actions[rank] = acts
    return Schedule(s.name, s.n_ranks, s.n_microbatches, s.n_virtual, list(s.stage_to_rank), actions, s.is_lowered)


def test_dropped_recv_is_rejected():
    low = lower(one_f_one_b(2, 4))
    dropped = Action(RECV_F, 2, 1, peer=0)
    broken = _replace_rank(low, 1, [a for a in low.actions[1] if a != dropped])
    with pytest.raises(ScheduleError, match=r"SEND_F2@s0->r1 is never received.*no RECV_F2@s1<-r0"):
        validate(broken)
    with pytest.raises(ScheduleError, match=r"F2@s1 \(step \d+\) has no RECV_F2@s1<-r0"):
        validate(broken)
    with pytest.raises(DeadlockError, match=r"sends never received.*rank 0 SEND_F2@s0->r1"):
        check_deadlock_free(broken)


def test_swapped_order_that_deadlocks_is_rejected():
    # rank 1 insists on micro-batch 1 first, rank 0 waits for micro-batch 0's gradient before sending F1
    s = one_f_one_b(2, 2)
    rank1 = [Action(F, 1, 1), Action(B, 1, 1), Action(F, 0, 1), Action(B, 0, 1)]
    rank0 = [Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)]
    broken = _replace_rank(_replace_rank(s, 1, rank1), 0, rank0)
    validate(broken)  # each list on its own is complete and ordered
    low = lower(broken)
    validate(low)
    with pytest.raises(DeadlockError) as err:
        check_deadlock_free(low)
    msg = str(err.value)
    assert "deadlocks" in msg
    assert "rank 0: blocked at step 2 on RECV_B0@s0<-r1 (rank 1 has not sent SEND_B0@s1->r0)" in msg
    assert "rank 1: blocked at step 0 on RECV_F1@s1<-r0 (rank 0 has not sent SEND_F1@s0->r1)" in msg
    with pytest.raises(DeadlockError, match="deadlocks"):
        check_deadlock_free(low, rendezvous=True)
    with pytest.raises(DeadlockError, match="cannot finish"):
        simulate(broken)


def test_unpaired_interleaved_lowering_deadlocks_only_when_sends_block():
    s = interleaved_1f1b(2, 4, 2)
    plain = lower(Schedule(s.name, s.n_ranks, s.n_microbatches, s.n_virtual, s.stage_to_rank, s.actions))
    validate(plain)
    check_deadlock_free(plain)  # buffered sends: fine
    with pytest.raises(DeadlockError, match=r"rank 0: blocked at step \d+ in batch \[SEND_B0@s2->r1\]"):
        check_deadlock_free(plain, rendezvous=True)


def test_validate_reports_incomplete_and_misordered_lists():
    s = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match="micro-batch 1 stage 0: 0 forwards"):
        validate(_replace_rank(s, 0, [a for a in s.actions[0] if a != Action(F, 1, 0)]))
    with pytest.raises(ScheduleError, match="micro-batch 0 stage 1: 2 forwards"):
        validate(_replace_rank(s, 1, [Action(F, 0, 1)] + s.actions[1]))
    with pytest.raises(ScheduleError, match="stage 1 lives on rank 1"):
        validate(_replace_rank(s, 0, s.actions[0] + [Action(F, 0, 1)]))
    with pytest.raises(ScheduleError, match=r"B0@s1 \(step 0\) before F0@s1"):
        validate(_replace_rank(s, 1, [Action(B, 0, 1), Action(F, 0, 1), Action(F, 1, 1), Action(B, 1, 1)]))
    z = zero_bubble_h1(2, 2)
    with pytest.raises(ScheduleError, match="B=0 I=1 W=0"):
        validate(_replace_rank(z, 0, [a for a in z.actions[0] if a != Action(W, 1, 0)]))
    acts = [a for a in z.actions[1] if a != Action(W, 0, 1)]
    with pytest.raises(ScheduleError, match=r"W0@s1 \(step 0\) before I0@s1"):
        validate(_replace_rank(z, 1, [Action(W, 0, 1)] + acts))
    with pytest.raises(ScheduleError, match="not lowered"):
        validate(_replace_rank(s, 1, [Action(RECV_F, 0, 1, peer=0)] + s.actions[1]))


# ---------------------------------------------------------------------------------------------
# argument errors


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved"])
def test_fewer_microbatches_than_stages_is_an_error(name):
    with pytest.raises(ValueError, match=r"M=3 < P=4.*use M >= P"):
        build_schedule(name, 4, 3, V=2 if name == "interleaved" else 1)


def test_1f1b_error_explains_why():
    with pytest.raises(ValueError, match="first stage runs out of forwards before the first backward returns"):
        one_f_one_b(4, 3)


def test_interleaved_needs_a_multiple_of_p():
    with pytest.raises(ValueError, match=r"multiple of the pipeline size \(M=6, P=4, M % P = 2\).*Megatron"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="V=1 is plain 1F1B"):
        build_schedule("interleaved", 4, 8)


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="only 'interleaved' takes V > 1"):
        build_schedule("1f1b", 2, 4, V=2)
    with pytest.raises(ValueError, match="must be a positive integer"):
        gpipe(0, 4)


# ---------------------------------------------------------------------------------------------
# timelines: measured records, plot, chrome trace


def test_timeline_from_measured_records():
    # wall-clock seconds as the runtime would record them, with a receive wait it chose to log
    t = Timeline(
        [
            [(F, 0, 0, 100.0, 100.5), (Action(B, 0, 0), 101.5, 102.5)],
            [("RECV_F", 0, 1, 100.0, 100.5), (F, 0, 1, 100.5, 101.0), (B, 0, 1, 101.0, 101.5)],
        ],
        name="measured",
    )
    assert t.makespan == 2.5
    assert t.busy(0) == 1.5 and t.busy(1) == 1.0  # the RECV wait is not busy time
    assert math.isclose(t.bubble_fraction, 1 - 2.5 / 5.0)
    assert t.peak_in_flight == [1, 1]
    with pytest.raises(ValueError, match="ends"):
        Timeline([[(F, 0, 0, 2.0, 1.0)]])


def test_peak_in_flight_counts_until_w():
    rank0 = [(F, 0, 0, 0, 1), (F, 1, 0, 1, 2), (I, 0, 0, 2, 3), (I, 1, 0, 3, 4), (W, 0, 0, 4, 5), (W, 1, 0, 5, 6)]
    t = Timeline([rank0])
    assert t.peak_in_flight == [2]


def test_plot_timeline_writes_png(tmp_path):
    path = tmp_path / "plots" / "1f1b.png"
    plot_timeline(simulate(one_f_one_b(4, 8)), path, title="1F1B P=4 M=8")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024
    plot_timeline(simulate(interleaved_1f1b(2, 4, 2)), tmp_path / "il.png")
    plot_timeline(simulate(zero_bubble_h1(3, 6)), tmp_path / "zb.png")
    assert sorted(os.listdir(tmp_path)) == ["il.png", "plots", "zb.png"]  # no temporary files left
    assert os.listdir(tmp_path / "plots") == ["1f1b.png"]


def test_chrome_trace(tmp_path):
    s = zero_bubble_h1(4, 8)
    t = simulate(s)
    path = tmp_path / "trace.json"
    to_chrome_trace(t, path)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == sum(len(a) for a in s.actions) == 4 * 8 * 3
    assert {e["tid"] for e in events} == {0, 1, 2, 3} and {e["pid"] for e in events} == {0}
    first = min(events, key=lambda e: (e["tid"], e["ts"]))
    assert first["name"] == "F0@s0" and first["ts"] == 0 and first["dur"] == 1e6
    assert max(e["ts"] + e["dur"] for e in events) == t.makespan * 1e6


def test_side_by_side_passes_get_their_own_lane(tmp_path):
    t = simulate(build_schedule("dualpipev", 2, 4), costs={"F": 1, "B": 2, "I": 1, "W": 1, OVERLAPPED: 2.5})
    for r in range(2):
        lanes = t.lanes(r)
        assert max(lanes) == 1 and sum(lanes) == len(t.overlapped(r))  # one pass of each unit moves down a lane
        for lane in (0, 1):
            evs = sorted((e for e, k in zip(t.events[r], lanes) if k == lane), key=lambda e: e.start)
            assert all(a.end <= b.start for a, b in zip(evs, evs[1:]))
    # busy time counts a unit once
    assert t.busy(0) == pytest.approx(sum(e.duration for e in t.events[0]) - 2.5 * len(t.overlapped(0)))
    to_chrome_trace(t, tmp_path / "trace.json")
    names = {e["tid"]: e["args"]["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
             if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 0 (side by side)", 3: "rank 1 (side by side)"}
    plot_timeline(t, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_messages_between_two_ranks_must_be_posted_in_the_same_order():
    """p2p between a pair of ranks matches by posting order (no tags), not by identity: a V-shaped placement
    (rank 0: stages 0 and 3, rank 1: stages 1 and 2) where rank 1 sends a gradient before an activation that
    rank 0 receives first would hand each receive the other's tensor — complete, live, and wrong."""
    def v_shaped(rank1: list[Action]) -> Schedule:
        rank0 = [Action(F, m, 0) for m in range(4)]
        for m in range(4):
            rank0 += [Action(F, m, 3), Action(B, m, 3)]
        rank0 += [Action(B, m, 0) for m in range(4)]
        return Schedule("v", 2, 4, 2, [0, 1, 1, 0], [rank0, rank1])

    good = [a for m in range(4) for a in (Action(F, m, 1), Action(F, m, 2))]
    good += [a for m in range(4) for a in (Action(B, m, 2), Action(B, m, 1))]
    bad = [a for m in range(3) for a in (Action(F, m, 1), Action(F, m, 2))]
    bad += [Action(B, 0, 2), Action(B, 0, 1), Action(F, 3, 1), Action(F, 3, 2)]
    bad += [a for m in range(1, 4) for a in (Action(B, m, 2), Action(B, m, 1))]
    check_deadlock_free(lower(v_shaped(good)))
    low = lower(v_shaped(bad))
    validate(low)  # each list on its own is complete and ordered
    with pytest.raises(DeadlockError, match=r"(?s)would pair messages wrongly.*match in posting order"):
        check_deadlock_free(low)


# ---------------------------------------------------------------------------------------------
# DualPipeV: two stages per rank in a V (rank r: stages r and 2P-1-r), DeepSeek's message order.
DUALPIPEV_SIZES = [(P, M) for P in (2, 3, 4) for M in range(2 * P, 4 * P + 1)]


@pytest.mark.parametrize("P,M", DUALPIPEV_SIZES)
def test_dualpipev_is_valid_and_deadlock_free_under_both_semantics(P, M):
    s = build_schedule("dualpipev", P, M)
    assert s.is_lowered and s.stage_to_rank == list(range(P)) + list(reversed(range(P)))
    validate(s)  # every (F, backward, W) of every micro-batch on every stage, in dependency order
    check_deadlock_free(s)
    check_deadlock_free(s, rendezvous=True)  # each pair's messages posted in the same order on both sides
    for r in range(P):
        computes = s.compute_actions(r)
        assert sum(a.kind == "F" for a in computes) == 2 * M  # two stages per rank
        assert sum(a.kind == "W" for a in computes) == sum(a.kind == "I" for a in computes) > 0  # zero bubble
    # stages P-1 and P meet on the last rank: no message between them (forward or backward)
    last = s.actions[P - 1]
    assert not any((a.kind, a.stage) in {("SEND_F", P - 1), ("RECV_F", P), ("SEND_B", P), ("RECV_B", P - 1)}
                   for a in last)
    assert any(a.kind == "RECV_F" and a.stage == P - 1 for a in last) or P == 1


# stage pass costs (F, I, W); B = I + W. F&B: an overlapped unit's cost in DualPipeV, None: its passes in sequence
PASS_COSTS = [(1.0, 1.0, 1.0, None), (1.0, 1.0, 0.5, None), (1.0, 1.0, 1.0, 2.5), (1.0, 1.0, 0.5, 2.0)]


@pytest.mark.parametrize("F_,I_,W_,FB", PASS_COSTS)
@pytest.mark.parametrize("P,M", DUALPIPEV_SIZES)
def test_dualpipev_bubble_against_zb_h1_and_1f1b(P, M, F_, I_, W_, FB):
    """Per-rank idle time equals DeepSeek-V3's formulas (`formulas.pipeline_idle`): 1F1B and ZB-H1 on every rank,
    DualPipeV on every rank with its units in sequence and on the most idle rank with them overlapped. With the same
    stage costs (DualPipeV's chunks cost half a stage) DualPipeV's bubble is below ZB-H1's when F > W or its
    units overlap (F&B < F+B), and equal to it otherwise (F = W, units in sequence). Peak: 2P+1 half-size
    activations per rank (ZB-H1: P full ones)."""
    stage = {"F": F_, "I": I_, "W": W_, "B": I_ + W_}
    chunk = {k: v / 2 for k, v in stage.items()} | ({OVERLAPPED: FB / 2} if FB is not None else {})
    dual = simulate(build_schedule("dualpipev", P, M), costs=chunk)
    zb = simulate(build_schedule("zb-h1", P, M), costs=stage)
    one = simulate(build_schedule("1f1b", P, M), costs=stage)

    def idle(t):
        return [t.makespan - t.busy(r) for r in range(P)]

    B_ = stage["B"]
    assert idle(one) == pytest.approx([pipeline_idle("1f1b", P, F_, B_, W_)] * P)
    assert idle(zb) == pytest.approx([pipeline_idle("zb-h1", P, F_, B_, W_)] * P)
    want = pipeline_idle("dualpipev", P, F_ / 2, B_ / 2, W_ / 2, None if FB is None else FB / 2)
    if FB is None:
        assert idle(dual) == pytest.approx([want] * P)
    else:
        assert max(idle(dual)) == pytest.approx(want)
        assert dual.overlapped(0) and all({a.kind, b.kind} == {"F", "B"} for a, b in dual.overlapped(0))
    if F_ > W_ or FB is not None:
        assert dual.bubble_fraction < zb.bubble_fraction < one.bubble_fraction
    else:
        assert dual.bubble_fraction == pytest.approx(zb.bubble_fraction)
    assert dual.peak_in_flight == [2 * P + 1] * P


def test_dualpipev_marks_its_overlapped_units_and_validate_checks_them():
    s = build_schedule("dualpipev", 2, 4)
    for r in range(2):
        acts = s.actions[r]
        units = [(acts[i - 1], a) for i, a in enumerate(acts) if s.runs_beside_forward(r, a)]
        assert len(units) == len(s.side_by_side[r]) > 0
        assert all(f.kind == "F" and b.kind == "B" and f.microbatch != b.microbatch for f, b in units)
    assert "&B" in s.format()
    w = next(a for a in s.actions[0] if a.kind == "W")  # a pass that does not follow a forward
    with pytest.raises(ScheduleError, match="is marked to run beside a forward"):
        validate(dataclasses.replace(s, side_by_side=[s.side_by_side[0] | {w}, s.side_by_side[1]]))
    with pytest.raises(ScheduleError, match="is not in its list"):
        validate(dataclasses.replace(s, side_by_side=[s.side_by_side[0] | {Action(B, 0, 1)}, s.side_by_side[1]]))
    with pytest.raises(ScheduleError, match="1 entries for 2 ranks"):
        validate(dataclasses.replace(s, side_by_side=[s.side_by_side[0]]))
    # one micro-batch's forward and backward cannot overlap: its backward needs the forward's output
    same = Schedule("same", 1, 1, 1, [0], [[Action(F, 0, 0), Action(B, 0, 0)]],
                    side_by_side=[frozenset({Action(B, 0, 0)})])
    with pytest.raises(ScheduleError, match="one micro-batch's passes cannot overlap"):
        validate(same)


def test_dualpipev_needs_twice_as_many_microbatches_as_ranks():
    with pytest.raises(ValueError, match=r"dualpipev needs at least twice as many micro-batches .*M=5 < 2P=6"):
        build_schedule("dualpipev", 3, 5)
    with pytest.raises(ValueError, match="exactly two stages"):
        build_schedule("dualpipev", 2, 4, V=3)
