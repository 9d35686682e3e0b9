"""GPipe and 1F1B op orders: complete, dependency-respecting, memory-bounded, bubble as theory."""
import pytest

from tfbig.pipeline.schedules import (Op, get_schedule, gpipe, issue_order, makespan,
                                      one_f_one_b, timeline)


def in_flight(stage_ops):
    """Most micro-batches forwarded and not yet backwarded at any point of a stage's order."""
    live = peak = 0
    for op in stage_ops:
        live += 1 if op.kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 1), (2, 1), (2, 4), (4, 8), (8, 3)])
def test_every_stage_runs_each_forward_and_backward_once(schedule, num_stages, num_microbatches):
    ops = schedule(num_stages, num_microbatches)
    expected = sorted([Op("F", m) for m in range(num_microbatches)]
                      + [Op("B", m) for m in range(num_microbatches)])
    assert len(ops) == num_stages
    for stage_ops in ops:
        assert sorted(stage_ops) == expected
        for m in range(num_microbatches):  # a micro-batch's backward follows its forward
            assert stage_ops.index(Op("F", m)) < stage_ops.index(Op("B", m))


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 4), (4, 8), (4, 2), (8, 16)])
def test_1f1b_keeps_at_most_k_minus_s_alive_and_gpipe_keeps_all(num_stages, num_microbatches):
    for s, stage_ops in enumerate(one_f_one_b(num_stages, num_microbatches)):
        assert in_flight(stage_ops) == min(num_stages - s, num_microbatches)
    for stage_ops in gpipe(num_stages, num_microbatches):
        assert in_flight(stage_ops) == num_microbatches


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 1), (2, 8), (4, 4), (8, 32)])
def test_balanced_makespan_is_m_plus_k_minus_1_slots(name, num_stages, num_microbatches):
    """Equal stages: step = (M + K - 1)(t_f + t_b), i.e. bubble = (K - 1) / (M + K - 1)."""
    ops = get_schedule(name)(num_stages, num_microbatches)
    span = makespan(ops, forward_time=1.0, backward_time=2.0)
    assert span == pytest.approx((num_microbatches + num_stages - 1) * 3.0)
    busy = num_microbatches * 3.0
    assert 1 - busy / span == pytest.approx((num_stages - 1) / (num_microbatches + num_stages - 1))


def test_timeline_respects_dependencies_and_stage_order():
    ops = one_f_one_b(4, 6)
    times = timeline(ops, forward_time=[1, 2, 1, 1], backward_time=[2, 3, 2, 2])
    for (s, op), (start, end) in times.items():
        if op.kind == "F" and s > 0:
            assert start >= times[(s - 1, op)][1]
        if op.kind == "B" and s < 3:
            assert start >= times[(s + 1, op)][1]
    for s, stage_ops in enumerate(ops):
        ends = [times[(s, op)] for op in stage_ops]
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # one op at a time
    # The slowest stage (stage 1: 5 per micro-batch) sets the pace once the pipeline is full.
    assert makespan(ops, [1, 2, 1, 1], [2, 3, 2, 2]) >= 6 * 5


def test_issue_order_puts_every_dependency_first():
    ops = one_f_one_b(4, 8)
    order = issue_order(ops)
    position = {key: i for i, key in enumerate(order)}
    for s, op in order:
        if op.kind == "F" and s > 0:
            assert position[(s - 1, op)] < position[(s, op)]
        if op.kind == "B" and s < 3:
            assert position[(s + 1, op)] < position[(s, op)]


def test_a_deadlocking_order_is_refused():
    ops = [[Op("B", 0), Op("F", 0)], [Op("F", 0), Op("B", 0)]]  # stage 0 waits on itself
    with pytest.raises(ValueError, match="deadlocks"):
        timeline(ops)


def test_unknown_schedule_names_the_flag():
    with pytest.raises(ValueError, match=r"--schedule='interleaved': expected one of"):
        get_schedule("interleaved")
