"""Runs under `horovodrun` for tests/plan/test_memory.py: each rank holds one pipeline stage
(--strategy=horovod --pipeline_stages=K) and measures the CPU allocator's peak of a
forward/backward step above what it held before (its own process: one stage's bytes), and the
bytes of the tensors alive at the step's peak (tfbig.training.measure.tensor_peak).

    horovodrun -np K -H localhost:K --gloo python pipeline_peak_worker.py CASES_JSON OUT_DIR

CASES_JSON: a list of {"name", "model" (GPTConfig fields over the tiny preset), "micro_batch",
"layout" (estimate.Layout fields)}; writes OUT_DIR/NAME.rank{R}.json: {"stage", "peak",
"tensor_peak", "stage_layers"}.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402

from tfbig.plan.estimate import Layout  # noqa: E402
from tfbig.training.measure import allocator_peak, pipeline_step, stage_layers, tensor_peak  # noqa: E402


def main(cases_path, out_dir):
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        layout = Layout(**case["layout"])
        strategy, step = pipeline_step(case["model"], case["micro_batch"], layout,
                                       case.get("boundaries", ""), cross_rank=True)
        peak, tensors = allocator_peak(step), tensor_peak(step)
        with open(os.path.join(out_dir, f"{case['name']}.rank{hvd.rank()}.json"), "w") as f:
            json.dump({"stage": strategy.stage_index, "peak": peak, "tensor_peak": tensors,
                       "stage_layers": stage_layers(strategy.plan)}, f)
    hvd.join()
    strategy.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
