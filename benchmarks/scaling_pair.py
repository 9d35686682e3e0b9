"""Horovod vs MultiWorkerMirrored scaling in one run: the two benchmarks' 1- and 2-process runs
interleaved (hvd 1, mw 1, hvd 2, mw 2, ... --repeats times), so both see the same machine load.

    python benchmarks/scaling_pair.py --repeats=3

Each backend's efficiency = best tokens/s with 2 processes / (2 x best with 1), as in
horovod_scaling.py and multiworker_scaling.py (same flags, same model, one thread per process);
the JSON line carries both, their ratio (horovod / multiworker), the load average before and
after, and the CPU model. On a shared machine the ratio is the figure to trust.

The ceiling: each repeat also starts two independent 1-process Horovod runs at once (no
communication between them). Their summed tokens/s over twice the best lone run is what two
processes get from this machine's cores, caches and memory when both compute
(`corun_ceiling`); `of_ceiling` = efficiency / ceiling is the share of it a backend keeps, the
part that communication and its threads decide.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import threading
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scaling  # noqa: E402
import horovod_scaling  # noqa: E402
import multiworker_scaling  # noqa: E402
from sharded_memory import cpu_model  # noqa: E402

BACKENDS = {"horovod": horovod_scaling.measure, "multiworker": multiworker_scaling.measure}


def main():
    args = _scaling.parse_args(__doc__.split("\n\n")[0], "process",
                               extra_flags=horovod_scaling.FLAGS)
    args.data_dir = _scaling.prepare_data(args)
    load_before = os.getloadavg()
    runs = {(b, n): [] for b in BACKENDS for n in (1, 2)}
    corun = []  # summed tokens/s of two lone processes running at once
    with tempfile.TemporaryDirectory(prefix="tfbig-scaling-pair-") as directory:
        for repeat in range(args.repeats):
            for n in (1, 2):
                for backend, measure in BACKENDS.items():
                    run_dir = os.path.join(directory, str(repeat), f"{backend}{n}")
                    os.makedirs(run_dir)
                    runs[backend, n].append(measure(args, n, run_dir)["tokens_per_sec"])
            corun.append(sum(two_at_once(args, os.path.join(directory, str(repeat)))))
    best = {key: max(values) for key, values in runs.items()}
    efficiency = {b: best[b, 2] / (2 * best[b, 1]) for b in BACKENDS}
    ceiling = max(corun) / (2 * max(best["horovod", 1], best["multiworker", 1]))
    _record.emit({
        "benchmark": "scaling_pair", "efficiency": {b: round(e, 4) for b, e in efficiency.items()},
        "horovod_over_multiworker": round(efficiency["horovod"] / efficiency["multiworker"], 4),
        "corun_ceiling": round(ceiling, 4),
        "of_ceiling": {b: round(e / ceiling, 4) for b, e in efficiency.items()},
        "tokens_per_sec": {f"{b}_{n}": [round(t, 1) for t in v] for (b, n), v in runs.items()},
        "corun_tokens_per_sec": [round(t, 1) for t in corun],
        "preset": args.preset, "seq_length": args.seq_length,
        "per_process_batch": args.per_process_batch, "steps": args.steps,
        "repeats": args.repeats, "xla": args.xla, "threads_per_process": 1,
        "hvd_thread_policy": args.hvd_thread_policy,
        "horovod_cycle_time_ms": os.environ.get("HOROVOD_CYCLE_TIME", "1 (default)"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "cpu": cpu_model()})


def two_at_once(args, directory):
    """tokens/s of two 1-process Horovod runs started together, independent of each other."""
    results = [None, None]

    def one(i):
        run_dir = os.path.join(directory, f"corun{i}")
        os.makedirs(run_dir)
        results[i] = horovod_scaling.measure(args, 1, run_dir)["tokens_per_sec"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if None in results:
        raise SystemExit("a co-run process failed (see above)")
    return results


if __name__ == "__main__":
    main()
