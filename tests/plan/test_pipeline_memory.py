"""What a pipeline stage holds at its peak, measured, against tfbig-plan's per-stage estimate.

Each stage's column of the schedule runs alone on its logical CPU device
(tfbig.plan.measure.stage_alone: the activation and gradient a neighbour would send arrive
just before the op that reads them), and the CPU allocator's least peak over 5 steps, above
what was held before, is compared with `estimate.memory(..., stage=k)`'s gradients +
activations + send/receive buffers (tfbig.plan.measure.planned_stage_peak): GPipe within 10%,
checkpointed stages and 1F1B's first within 15%, 1F1B's last between 0.9 and 1.5x (`bounds`:
what moves their peaks). The
stages of a 2-stage GPT are cut by tfbig-train's FLOPs partition (3 blocks and the embedding,
1 block and the output matrix). These only agree because each stage runs its schedule in
order (tfbig.pipeline.stages waits for the values of its previous op): before, 1F1B's last
stage measured 1.7-2.1x its one micro-batch. One stage per Horovod rank:
benchmarks/plan_accuracy.py --cross_rank.
"""
import dataclasses

import pytest

from tfbig.plan import estimate
from tfbig.plan.measure import (allocator_peak, pipeline_step, planned_stage_peak, stage_alone,
                                stage_layers)

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
    return [(allocator_peak(stage_alone(strategy, k, MICRO_BATCH)),
             planned_stage_peak(MODEL, MICRO_BATCH, layout, k)) for k in (0, 1)]


# Measured/plan across runs (load 6-13): GPipe 0.98-1.06, checkpointed 0.93-1.09 (once 1.12),
# 1F1B stage 0 1.03-1.10, 1F1B's last stage 1.04-1.32 (1.32 in a CI run; checkpointed
# 0.93-1.21). At 1F1B's peak a micro-batch's backward is under way beside the held forwards:
# TF evaluates the GELU derivative's formula (four 4h-wide float32 temporaries; it needs only
# the GELU's input) whenever its input exists, and on the last stage the softmax gradient's
# product with the output gradient either reuses the stashed softmax gradient's buffer or
# takes a second logits-sized one (4.2 MB here), as the executor's order has it. The plan
# counts one derivative per layer, the MLP's two gradients and one logits-sized tensor. So
# 1F1B's last stage is not held to the plan: its bounds (0.9-1.5x) catch the order regression
# it guards against (two micro-batches alive: 1.7-2.1x) and a plan that counts too much.
def bounds(schedule, checkpointing, stage):
    """(lowest, highest) measured/planned ratio accepted."""
    if schedule == "1f1b" and stage == 1:
        return 0.9, 1.5
    tolerance = 0.15 if schedule == "1f1b" or checkpointing else 0.10
    return 1 - tolerance, 1 + tolerance


def check(schedule, num_microbatches, checkpointing):
    for stage, (held, planned) in enumerate(stage_peaks(schedule, num_microbatches,
                                                        checkpointing)):
        low, high = bounds(schedule, checkpointing, stage)
        assert low <= held / planned <= high, (stage, held / 1e6, planned / 1e6)


def test_1f1b_stages_hold_what_the_plan_says():
    """Stage 0 of 2 holds two micro-batches, the last one (M = 4); before the stages ran
    their ops in schedule order, the last measured 1.7-2.1x."""
    check("1f1b", 4, False)


def test_gpipe_stages_hold_what_the_plan_says():
    check("gpipe", 4, False)


def test_checkpointed_stages_hold_what_the_plan_says():
    check("gpipe", 4, True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, num_microbatches, checkpointing", [
    ("1f1b", 8, False), ("gpipe", 8, False), ("1f1b", 4, True), ("1f1b", 8, True),
    ("gpipe", 8, True)])
def test_more_pipeline_layouts_hold_what_the_plan_says(schedule, num_microbatches,
                                                       checkpointing):
    check(schedule, num_microbatches, checkpointing)
