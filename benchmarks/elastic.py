"""Elastic Horovod: how long a run stalls when a rank dies and when a new rank joins.

Starts `horovodrun --gloo -np 2 --min-np 1 --max-np 2 --host-discovery-script` on this machine
(hosts "localhost" and "127.0.0.1", one slot each), trains with --elastic, SIGKILLs rank 1
after --warm_steps steps, and once the survivor trains alone makes the discovery script report
a slot on a third local host name. Every process logs each completed step's wall time.

    death_to_step_seconds     SIGKILL of rank 1 -> the survivor's next completed step
    arrival_to_step_seconds   the discovery script reports the new slot -> the new rank's
                              first completed step (includes starting Python and TensorFlow)
    process_start_to_step_seconds  the new process's start -> its first completed step
and, measured in the same run for scale, the median step time before the kill
(`*_in_steps` = the stall divided by it). Goal: both stalls under 30 s.

Example:
    python benchmarks/elastic.py --preset=tiny --seq_length=128 --per_rank_batch=16
Prints one JSON line last.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import glob
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.time()  # a worker's process start, before TensorFlow is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _scaling  # noqa: E402

HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
GOAL_SECONDS = 30.0


def worker(config_path, out_dir):
    """One elastic rank: train, appending {"time", "step", "world"} per step to a file."""
    from tfbig import config as config_lib
    from tfbig.training.registry import get_strategy
    from tfbig.training.trainer import Trainer

    with open(config_path) as f:
        cfg = config_lib.from_dict(json.load(f))
    strategy = get_strategy("horovod", cfg)
    with open(os.path.join(out_dir, f"pid{os.getpid()}.json"), "w") as f:
        json.dump({"rank": strategy.rank, "start": STARTED}, f)
    steps = open(os.path.join(out_dir, f"pid{os.getpid()}.jsonl"), "a")

    class Timed(Trainer):
        def _log_train(self, step, out, perf):
            steps.write(json.dumps({"time": time.time(), "step": step,
                                    "world": self.strategy.num_replicas}) + "\n")
            steps.flush()
            return super()._log_train(step, out, perf)

    Timed(cfg, strategy=strategy).fit()


def entries(out_dir):
    """[(pid, entry)] of every step logged so far, in time order."""
    found = []
    for path in glob.glob(os.path.join(out_dir, "pid*.jsonl")):
        pid = int(os.path.basename(path)[3:-6])
        with open(path) as f:
            found += [(pid, json.loads(line)) for line in f if line.endswith("\n")]
    return sorted(found, key=lambda item: item[1]["time"])


def wait_for(condition, proc, what, timeout=600):
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            raise SystemExit(f"the elastic run ended (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def write_hosts(path, hosts):
    with open(path + ".tmp", "w") as f:
        f.write("".join(f"{host}:1\n" for host in hosts))
    os.replace(path + ".tmp", path)


def measure(args, directory):
    config = _scaling.write_experiment(args, "horovod", 2, directory, horovod={
        "elastic": True, "elastic_commit_every": args.commit_every})
    with open(config) as f:  # log every step, train until stopped
        experiment = json.load(f)
    experiment["train"].update(log_every=1, max_steps=10 ** 6, checkpoint_every=10 ** 6)
    with open(config, "w") as f:
        json.dump(experiment, f)
    out = os.path.join(directory, "out")
    os.makedirs(out)
    hosts = os.path.join(directory, "hosts.txt")
    write_hosts(hosts, ["localhost", "127.0.0.1"])
    discover = os.path.join(directory, "discover.sh")
    with open(discover, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(discover, 0o755)
    command = [HOROVODRUN, "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
               "--host-discovery-script", discover, sys.executable, os.path.abspath(__file__),
               "--worker", config, out]
    log = open(os.path.join(directory, "log.txt"), "w")
    proc = subprocess.Popen(command, env={**os.environ, **_scaling.ONE_THREAD}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _timeline(args, proc, out, hosts)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _timeline(args, proc, out, hosts):
    wait_for(lambda: len({e["step"] for _, e in entries(out)}) >= args.warm_steps, proc,
             f"{args.warm_steps} steps")
    pids = {}
    for path in glob.glob(os.path.join(out, "pid*.json")):
        with open(path) as f:
            pids[json.load(f)["rank"]] = int(os.path.basename(path)[3:-5])
    times = [e["time"] for pid, e in entries(out) if pid == pids[0]][-11:]
    step_seconds = statistics.median(b - a for a, b in zip(times, times[1:]))
    os.kill(pids[1], signal.SIGKILL)
    killed = time.time()
    recovered = wait_for(lambda: next((e for _, e in entries(out) if e["time"] > killed
                                       and e["world"] == 1), None), proc, "a step on one rank")
    wait_for(lambda: sum(e["time"] > recovered["time"] for _, e in entries(out)) >= 3, proc,
             "three more steps on one rank")
    added = time.time()
    write_hosts(hosts, ["localhost", "127.0.0.1", socket.gethostname()])  # the dead rank's
    # host stays blacklisted by Horovod: the new slot is on a third name for this machine
    known = set(pids.values())
    pid, joined = wait_for(lambda: next(((p, e) for p, e in entries(out) if p not in known),
                                        None), proc, "the new rank's first step")
    with open(os.path.join(out, f"pid{pid}.json")) as f:
        started = json.load(f)["start"]
    return {"death_to_step_seconds": recovered["time"] - killed,
            "arrival_to_step_seconds": joined["time"] - added,
            "process_start_to_step_seconds": joined["time"] - started,
            "step_seconds": step_seconds}


def main():
    args = _scaling.parse_args(__doc__.split("\n\n")[0], "rank", extra_flags=[
        (("--warm_steps",), {"type": int, "default": 20,
                             "help": "steps trained by 2 ranks before rank 1 is killed"}),
        (("--commit_every",), {"type": int, "default": 5, "help": "--elastic_commit_every"})])
    if args.worker:
        return worker(*args.worker)
    args.data_dir = _scaling.prepare_data(args)
    with tempfile.TemporaryDirectory(prefix="tfbig-elastic-") as directory:
        result = measure(args, directory)
    step = result["step_seconds"]
    print(f"rank lost -> next step {result['death_to_step_seconds']:.1f} s; new rank -> first "
          f"step {result['arrival_to_step_seconds']:.1f} s (goal < {GOAL_SECONDS:.0f} s)",
          file=sys.stderr)
    _record.emit({
        "benchmark": "elastic", **{k: round(v, 3) for k, v in result.items()},
        "death_to_step_in_steps": round(result["death_to_step_seconds"] / step, 1),
        "arrival_to_step_in_steps": round(result["arrival_to_step_seconds"] / step, 1),
        "goal_seconds": GOAL_SECONDS,
        "within_goal": max(result["death_to_step_seconds"],
                           result["arrival_to_step_seconds"]) < GOAL_SECONDS,
        **{k: v for k, v in vars(args).items()
           if k not in ("worker", "data_dir", "steps", "repeats")},
        "load_average": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
