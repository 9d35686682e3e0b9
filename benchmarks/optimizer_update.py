"""Microseconds tfbig's optimizer update costs per variable, compiled vs op by op.

The doctor's probe (tfbig.doctor.probes.update_seconds_per_variable: global-norm clipping and
AdamW on 64 variables of 16 values, so the bytes are nothing) measured both ways in this one
run, alternating, `--repeats` times each: in one XLA program, as the Trainer's compiled step
runs it (tfbig.training.step), and op by op in a tf.function (--compile_update=false, the step
before issue 43). The ratio is of the medians.

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

    figures = {"compiled": [], "op_by_op": []}
    for _ in range(args.repeats):
        for way in figures:
            seconds = update_seconds_per_variable("/CPU:0", args.seconds,
                                                  compiled=way == "compiled")
            figures[way].append(round(1e6 * seconds, 2))
    compiled, op_by_op = (statistics.median(figures[w]) for w in ("compiled", "op_by_op"))
    _record.emit({"benchmark": "optimizer_update", "variables": UPDATE_VARIABLES,
                  "us_per_variable_compiled": compiled, "us_per_variable_op_by_op": op_by_op,
                  "op_by_op_over_compiled": round(op_by_op / compiled, 2),
                  "runs_us_per_variable": figures, "load": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
