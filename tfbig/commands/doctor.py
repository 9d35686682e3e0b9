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

PROG = "tfbig-doctor"
REQUIRABLE = ("gloo", "mpi", "nccl")
# (largest collective, matmul sizes on a CPU, on a GPU, seconds per timed probe, bandwidth probe)
MODES = {"quick": (2 ** 20, (128, 512), (1024, 4096), 0.1, 2 ** 24),
         "full": (2 ** 28, (64, 256, 1024, 2048), (1024, 4096, 8192), 0.5, 2 ** 28)}


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


def largest_collective(args, local_ranks):
    """--max_bytes (or the mode's), capped so that a host's ranks hold their buffers (input,
    output and Horovod's copy of each) in an eighth of its free memory."""
    import psutil

    wanted = args.max_bytes or MODES["quick" if args.quick else "full"][0]
    return min(wanted, psutil.virtual_memory().available // (8 * 4 * local_ranks))


def measure_rank(args, ranks):
    """This rank's record: host, build, device and its rates."""
    from tfbig.doctor import findings, probes

    _, cpu_sizes, gpu_sizes, seconds, bandwidth_bytes = MODES["quick" if args.quick else "full"]
    device, description = probes.rank_device(ranks.local_rank)
    delay = probes.test_delay(ranks.rank)
    precisions = probes.precisions_run(device)
    sizes = gpu_sizes if description["kind"] == "gpu" else cpu_sizes
    runnable = [p for p in args.precisions if precisions[p]]
    return {"rank": ranks.rank, "host": probes.host_name(), "local_rank": ranks.local_rank,
            "build": probes.build_info(), "device": description,
            "memory_bytes": probes.memory_bytes(description["kind"]),
            "interconnect": probes.interconnect(), "xla": probes.xla_compiles(device),
            "precisions": precisions,
            "matmul_tflops": {p: {s: v / 1e12 for s, v in rates.items()} for p, rates in
                              probes.matmul_flops(device, sizes, runnable, seconds,
                                                  delay).items()},
            "memory_bandwidth_gbps": probes.memory_bandwidth(device, bandwidth_bytes, seconds,
                                                             delay) / 1e9,
            "softmax_bandwidth_gbps": probes.normalisation_bandwidth(
                device, bandwidth_bytes, seconds, delay) / 1e9,
            "update_us_per_variable": 1e6 * probes.update_seconds_per_variable(device, seconds,
                                                                              delay),
            "steps_per_sec": probes.step_rate(device, seconds, delay),
            "spec": findings.spec_of(description)}, device


def run_checks(args):
    """The report (a dict), the same on every rank."""
    from tfbig.doctor import collectives, findings

    ranks = collectives.Ranks()
    record, device = measure_rank(args, ranks)
    records = ranks.gather(record)
    rank_hosts = {r["rank"]: r["host"] for r in records}
    hosts = list(dict.fromkeys(rank_hosts.values()))
    local_ranks = max(list(rank_hosts.values()).count(h) for h in hosts)
    max_bytes = largest_collective(args, local_ranks)
    measured = (collectives.measure_all(ranks, rank_hosts, max_bytes, args.quick)
                if ranks.size > 1 else {"skipped": "one rank"})
    correctness = ranks.gather(collectives.training_step_check(ranks, device))
    worst = max(correctness, key=lambda c: c["relative_difference"])
    report = {"tool": PROG, "ranks": ranks.size, "hosts": hosts,
              "rank_hosts": {str(k): v for k, v in rank_hosts.items()},
              "controller": ranks.controller, "max_collective_bytes": max_bytes,
              "per_rank": records, "collectives": measured, "correctness": worst}
    report["stragglers"] = findings.stragglers(records, args.straggler_threshold)
    report["problems"] = findings.problems(records, worst, args.require, hosts)
    return ranks, report


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
