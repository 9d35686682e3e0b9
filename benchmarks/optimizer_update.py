"""Microseconds tfbig's optimizer update costs per variable, compiled vs op by op.

The doctor's probe (tfbig.doctor.probes.update_seconds_per_variable: global-norm clipping and
AdamW on 64 variables of 16 values, so the bytes are nothing) measured both ways in this one
run, alternating, `--repeats` times each: in one XLA program, as the Trainer's compiled step
runs it (tfbig.training.step), and op by op in a tf.function (--compile_update=false, the step
before issue 43). The ratio is of the medians.

A third figure, `reads`, is a tf.function that only reads the same resource variables (the 64
weights and AdamW's two slots each) and sums them: what a call costs per variable before any
update math, compiled or not. Where it is most of both figures, the cost is per resource
variable the function touches, and XLA cannot remove it.

    python benchmarks/optimizer_update.py [--seconds=3] [--repeats=3] [--record]
"""
import argparse
import os
import statistics

import _record

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per figure")
    parser.add_argument("--repeats", type=int, default=3, help="figures per way, alternating")
    args = parser.parse_args()
    from tfbig.doctor.probes import UPDATE_VARIABLES, update_seconds_per_variable

    figures = {"compiled": [], "op_by_op": [], "reads": []}
    for _ in range(args.repeats):
        for way in figures:
            if way == "reads":
                seconds = read_seconds_per_variable(args.seconds)
            else:
                seconds = update_seconds_per_variable("/CPU:0", args.seconds,
                                                      compiled=way == "compiled")
            figures[way].append(round(1e6 * seconds, 2))
    compiled, op_by_op, reads = (statistics.median(figures[w])
                                 for w in ("compiled", "op_by_op", "reads"))
    _record.emit({"benchmark": "optimizer_update", "variables": UPDATE_VARIABLES,
                  "us_per_variable_compiled": compiled, "us_per_variable_op_by_op": op_by_op,
                  "op_by_op_over_compiled": round(op_by_op / compiled, 2),
                  "us_per_variable_reads": reads,
                  "reads_over_compiled": round(reads / compiled, 2),
                  "runs_us_per_variable": figures, "load": [round(x, 2) for x in os.getloadavg()]})


def read_seconds_per_variable(seconds):
    """Seconds per weight of a tf.function that reads the probe's weights and their AdamW
    slots (the resources the update touches) and returns their sum: no update math."""
    import tensorflow as tf

    from tfbig.doctor.probes import UPDATE_VARIABLES, typical_seconds, update_probe_state

    with tf.device("/CPU:0"):
        variables, optimizer = update_probe_state()
        slots = [v for v in optimizer.variables if v.shape == (16,)]
        assert len(slots) == 2 * UPDATE_VARIABLES, len(slots)

        @tf.function
        def read():
            return tf.add_n([tf.reduce_sum(v) for v in variables + slots])

        return typical_seconds(lambda: read().numpy(), seconds) / UPDATE_VARIABLES


if __name__ == "__main__":
    main()
