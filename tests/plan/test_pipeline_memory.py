"""What a pipeline stage holds at its peak, measured, against tfbig-plan's per-stage estimate.

Each stage's column of the schedule runs alone on its logical CPU device
(tfbig.training.measure.stage_alone: the activation and gradient a neighbour would send arrive
just before the op that reads them), and the bytes of the tensors alive together at its peak
(tfbig.training.measure.tensor_peak: the allocator's records of each allocation, replayed; the
least of 3 steps) are compared with `estimate.memory(..., stage=k)`'s gradients + activations +
send/receive buffers (tfbig.training.measure.planned_stage_peak), within 10% (`bounds`). The
stages of a 2-stage GPT are cut by tfbig-train's FLOPs partition (3 blocks and the embedding,
1 block and the output matrix). These only agree because each stage runs its schedule in
order (tfbig.pipeline.stages waits for the values of its previous op): before, 1F1B's last
stage measured 1.7-2.1x its one micro-batch. One stage per Horovod rank:
benchmarks/plan_accuracy.py --cross_rank.
"""
import dataclasses

import pytest

from tfbig.plan import estimate
from tfbig.training.measure import (pipeline_step, planned_stage_peak, stage_alone, stage_layers,
    tensor_peak)

# megabytes per stage and micro-batch: the closed form, not the allocator's rounding, is
# what is measured
MODEL = dict(hidden_size=128, num_layers=4, num_heads=2, seq_length=128, vocab_size=2048)
MICRO_BATCH = 4


def stage_peaks(schedule, num_microbatches, checkpointing):
    """[(measured, planned) bytes] of the two stages of a 2-stage GPT."""
    layout = estimate.Layout(pipeline=2, num_microbatches=num_microbatches, schedule=schedule,
                             activation_checkpointing=checkpointing)
    strategy, _ = pipeline_step(MODEL, MICRO_BATCH, layout)
    layout = dataclasses.replace(layout, stage_layers=stage_layers(strategy.plan))
    assert layout.stage_layers == (3, 1)
    return [(tensor_peak(stage_alone(strategy, k, MICRO_BATCH)),
             planned_stage_peak(MODEL, MICRO_BATCH, layout, k)) for k in (0, 1)]


# Measured/plan, the tensors' bytes (least of 3 steps; single steps of one case differ by at
# most ~4%, one GELU temporary more or less), stage 0 / 1, micro-batch 4, M = 4: GPipe
# 0.94-0.95 / 0.99, checkpointed 0.95-1.00 / 0.93-0.95, 1F1B 0.95 / 0.96-0.98 (load 4-8).
# Checkpointed GPipe's last stage measured 0.89 in CI (13.37 MB against 14.95: the plan
# counted the input of the micro-batch being recomputed both as kept and as its first layer's);
# with it counted once, 0.91-0.95 here (13.37-13.89 MB against 14.69).
# What moved 1F1B's last stage by up to 1.3x, traced: the GELU derivative formed as soon as
# its input existed (now it waits for the output's gradient: tfbig.models.activations.gelu), the
# output matrix's weight gradient running beside the last block's backward or not, keeping
# the logits' gradient alive (now the stage's layers wait for its head:
# tfbig.pipeline.stages), and the allocator counting the slack of its chunks (4.2-7.6 MB for
# a 4.2 MB tensor): the allocator's least peak of 5 steps is 0.93-1.24 of the plan
# (benchmarks/plan_accuracy.py prints it too).
TOLERANCE = 0.10


def check(schedule, num_microbatches, checkpointing):
    for stage, (held, planned) in enumerate(stage_peaks(schedule, num_microbatches,
                                                        checkpointing)):
        assert held / planned == pytest.approx(1, abs=TOLERANCE), (stage, held / 1e6,
                                                                     planned / 1e6)


def test_1f1b_stages_hold_what_the_plan_says():
    """Stage 0 of 2 holds two micro-batches, the last one (M = 4); before the stages ran
    their ops in schedule order, the last measured 1.7-2.1x, and before it waited for its
    head's backward and the GELU derivative for its output's gradient, 1.0-1.3x."""
    check("1f1b", 4, False)


@pytest.mark.slow  # the 1F1B stages' case stays in the default run (the same counting)
def test_gpipe_stages_hold_what_the_plan_says():
    check("gpipe", 4, False)


@pytest.mark.slow  # the 1F1B stages' case stays in the default run (the same counting)
def test_checkpointed_stages_hold_what_the_plan_says():
    check("gpipe", 4, True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, num_microbatches, checkpointing", [
    ("1f1b", 8, False), ("gpipe", 8, False), ("1f1b", 4, True), ("1f1b", 8, True),
    ("gpipe", 8, True)])
def test_more_pipeline_layouts_hold_what_the_plan_says(schedule, num_microbatches,
                                                       checkpointing):
    check(schedule, num_microbatches, checkpointing)
