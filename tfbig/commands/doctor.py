"""`tfbig-doctor`: check a cluster before training on it, and calibrate tfbig-plan to it.

Launched as training is (alone, horovodrun, mpirun, srun), every rank measures its build, its
device and a tiny training step; the ranks then measure collectives together; rank 0 prints the
report (stragglers and problems first) and writes it as JSON (--output) and as a calibration
for `tfbig-plan --calibration` (--calibration_out).

Example:
    tfbig-doctor --quick
    horovodrun -np 4 -H localhost:4 --gloo tfbig-doctor --output=doctor.json \
        --calibration_out=calibration.json --strict
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfbig.commands import cli  # noqa: E402
from tfbig.doctor.checks import PROG, run_checks  # noqa: E402

REQUIRABLE = ("gloo", "mpi", "nccl")


def parse(argv):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="", help="write the report as JSON to this file")
    parser.add_argument("--calibration_out", default="",
                        help="write the calibration tfbig-plan --calibration reads "
                             "(schema: tfbig.plan.calibration)")
    parser.add_argument("--quick", action="store_true",
                        help="collectives up to 1 MiB, two matmul sizes, 0.1 s per probe "
                             "(under a minute on a CPU)")
    parser.add_argument("--max_bytes", type=int, default=0,
                        help="largest collective in bytes (0: 256 MiB, 1 MiB with --quick); "
                             "capped by memory")
    parser.add_argument("--precisions", default="fp32,bf16,fp16",
                        help="matmul precisions measured, from fp32, bf16, fp16")
    parser.add_argument("--require", default="",
                        help="what Horovod must be built with, from gloo, mpi, nccl "
                             "(comma-separated); a missing one is a named problem")
    parser.add_argument("--straggler_threshold", type=float, default=0.2,
                        help="a rank or host this fraction below the median is a straggler")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 when a straggler or a problem is found")
    args = parser.parse_args(argv)
    args.precisions = _listed(parser, "precisions", args.precisions, ("fp32", "bf16", "fp16"))
    args.require = _listed(parser, "require", args.require, REQUIRABLE)
    if not 0 < args.straggler_threshold < 1:
        parser.error(f"--straggler_threshold={args.straggler_threshold}: expected a fraction "
                     f"between 0 and 1")
    if args.max_bytes < 0:
        parser.error(f"--max_bytes={args.max_bytes}: expected a positive number of bytes")
    return args


def _listed(parser, flag, value, valid):
    names = [v for v in value.split(",") if v]
    unknown = [v for v in names if v not in valid]
    if unknown:
        parser.error(f"--{flag}={value}: {', '.join(unknown)} not one of {', '.join(valid)}")
    return names


def main(argv=None):
    """Run the checks; returns the exit status (1 with --strict and a finding)."""
    args = parse(sys.argv[1:] if argv is None else argv)
    cli.quiet_cuda_probe()
    from tfbig.doctor import findings

    ranks, report = run_checks(args)
    if ranks.rank == 0:
        print(findings.text(report), flush=True)
        for path, content in ((args.output, report), (args.calibration_out,
                                                        args.calibration_out
                                                        and findings.calibration(report))):
            if path:
                with open(path, "w") as f:
                    json.dump(content, f, indent=1)
                print(f"{PROG}: wrote {path}")
    found = report["stragglers"] or report["problems"]
    return 1 if args.strict and found else 0


def run():
    sys.exit(main())


if __name__ == "__main__":
    run()
