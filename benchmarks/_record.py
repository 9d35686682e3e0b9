"""`--record`: append a benchmark's JSON result, with where and when it ran, to its results file.

Every benchmark ends by printing one JSON line. With `--record` on its command line it also
appends that line to `benchmarks/results/<name>.jsonl`, wrapped with what a reader needs to
judge the figure: the CPU model and core count, the date (UTC), the load average at
the end (1, 5 and 15 minutes), the git commit and the command line. The docs'
Results page is rendered from these files (docs/hooks.py), so a figure shown there always
comes from a recorded run.

    import _record                      # strips --record from sys.argv, so argparse/absl never see it
    ...
    _record.emit({"benchmark": "input_pipeline", "ratio": 0.85, ...})

`python benchmarks/input_pipeline.py --record` prints the line and records it.
"""
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")


def _take_flag(argv, name="--record"):
    """Remove `name` from argv (in place); True when it was there."""
    found = name in argv
    argv[:] = [a for a in argv if a != name]
    return found


RECORD = _take_flag(sys.argv)  # at import: before the benchmark's own flag parser runs
_COMMAND = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]
                    + (["--record"] if RECORD else []))


def cpu_model():
    """The CPU's model name and count of cores this process may use, e.g. 'Intel(R) Xeon(R) ... x2'."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} x{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}"


def git_commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def record(result, name=None, results_dir=None):
    """Append `result` with machine, date, load, commit and command to <results_dir>/<name>.jsonl.

    Returns the written record. `name` defaults to result["benchmark"], else the script's name.
    """
    name = name or result.get("benchmark") or os.path.splitext(os.path.basename(sys.argv[0]))[0]
    entry = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.node(),
        "cpu": cpu_model(),
        "load": [round(x, 2) for x in os.getloadavg()],
        "git_commit": git_commit(),
        "command": _COMMAND,
        "result": result,
    }
    results_dir = results_dir or RESULTS_DIR
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def emit(result, name=None):
    """Print `result` as the benchmark's JSON line; with --record also append it (see record)."""
    print(json.dumps(result), flush=True)
    if RECORD:
        path = os.path.join(RESULTS_DIR, f"{record(result, name)['benchmark']}.jsonl")
        print(f"recorded in {os.path.relpath(path, ROOT)}", file=sys.stderr)
