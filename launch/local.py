"""`tfbig-launch`: start N local worker processes of a tf.distribute multi-worker job, or run
a launcher command (horovodrun, mpirun, srun...) that starts its own; with --max_restarts,
restart the whole job when any process dies (launch/supervisor.py).

Each worker gets a TF_CONFIG naming all workers on free localhost ports and its own index;
their output is streamed with a `[worker i]` prefix. If a worker fails, the others (and every
process they started) are killed and tfbig-launch exits with that worker's code. SIGTERM/SIGINT
are forwarded to every process (tfbig-train then saves a checkpoint and exits); a second one
kills them.

Example:
    tfbig-launch --workers=2 -- tfbig-train --strategy=multiworker --preset=tiny
    tfbig-launch --max_restarts=3 -- horovodrun -np 2 -H localhost:2 --gloo tfbig-train ...
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil

from tfbig.commands.cli import ArgumentParser
from tfbig.errors import UsageError

POLL_SECONDS = 0.2
PREEMPTED = 143  # tfbig-train after SIGTERM: checkpoint saved (128 + SIGTERM)
GRACE_SECONDS = 120  # how long preempted workers may take to finish their checkpoint
TRACK_SECONDS = 1.0  # how often the processes the job started are listed (to stop them all)
LAUNCHERS = ("horovodrun", "mpirun", "mpiexec", "srun", "torchrun")  # start the processes themselves
_PROGRESS = re.compile(r"\bstep (\d+)/(?:\d+|\?)")  # tfbig-train's progress line
# horovodrun's report of the first rank that failed (gloo_run), and mpirun's
_RANK_FAILED = (re.compile(r"Process name: (?P<rank>\S+)\s*Exit code: (?P<code>-?\d+)"),
                re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node \S+ exited on signal "
                           r"(?P<signal>\d+)"))


def free_ports(count, host="localhost"):
    """`count` distinct ports the OS reports free on `host` (held open until all are picked)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses, index):
    """The TF_CONFIG of worker `index` in a cluster of `addresses` (worker 0 is the chief)."""
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def exit_code(returncode):
    """A process's exit status as a shell reports it (killed by signal s -> 128 + s)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode):
    """'killed by SIGKILL (exit code 137)' or 'exit code 1', from a Popen returncode."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name} (exit code {exit_code(returncode)})"
    return f"exit code {returncode}"


def is_launcher(command):
    """Whether `command` starts the job's processes itself (horovodrun, mpirun, ...)."""
    return os.path.basename(command[0]) in LAUNCHERS


class Workers:
    """The processes of one start of a job, each in its own process group: N workers of one
    command (TF_CONFIG set, output prefixed `[worker i]`), or, with launcher=True, the command
    once as it is (a launcher that starts the ranks; its output passed through).

    Every process they start is listed as it appears (a launcher's ranks run in sessions of
    their own), so `kill` stops them all. After `wait`, `failure` says which one failed and how,
    and `last_step` is the last progress line's step (None if none was seen)."""

    def __init__(self, command, num_workers, env=None, stream=None, launcher=False):
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self.stopping = None  # time the workers were asked to stop (SIGTERM)
        self.launcher = launcher
        self.failure = None
        self.last_step = None
        self.rank_failure = None  # what a launcher said of its first failed rank
        self._window = ""  # a launcher's last output, where that report is looked for
        addresses = [f"localhost:{port}" for port in free_ports(num_workers)]
        self.procs = []
        for index in range(num_workers):
            worker_env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}
            if not launcher:
                worker_env["TF_CONFIG"] = tf_config(addresses, index)
            self.procs.append(subprocess.Popen(
                command, env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
        self.names = ([os.path.basename(command[0])] if launcher
                      else [f"worker {i}" for i in range(num_workers)])
        self.started = {}  # pid -> psutil.Process of everything the processes started
        self.tracked = 0.0
        self.readers = [threading.Thread(target=self._pump, args=(i, p.stdout), daemon=True)
                        for i, p in enumerate(self.procs)]
        for reader in self.readers:
            reader.start()

    def _pump(self, index, pipe):
        prefix = "" if self.launcher else f"[worker {index}] "
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            self._note(text)
            with self.lock:
                self.stream.write(prefix + text)
                self.stream.flush()

    def _note(self, text):
        """Keep the last progress step and a launcher's report of a failed rank."""
        step = _PROGRESS.search(text)
        if step:
            self.last_step = int(step.group(1))
        if self.launcher:
            self._window = (self._window + text)[-400:]  # a report spans lines
            for pattern in _RANK_FAILED:
                found = pattern.search(self._window)
                if found and not self.rank_failure:
                    self.rank_failure = found.groupdict()

    def say(self, message):
        with self.lock:
            self.stream.write(f"[tfbig-launch] {message}\n")
            self.stream.flush()

    def _track(self, force=False):
        """List what the processes started, every TRACK_SECONDS."""
        if not force and time.monotonic() - self.tracked < TRACK_SECONDS:
            return
        self.tracked = time.monotonic()
        ours = {proc.pid for proc in self.procs}
        # this process starts nothing but the job: every descendant is one of its processes
        # (a rank whose parent exited is adopted: tfbig-launch is a child subreaper)
        for child in psutil.Process().children(recursive=True):
            if child.pid not in ours:
                self.started.setdefault(child.pid, child)

    def signal_all(self, signum):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass
        for child in self.started.values():
            try:
                if child.is_running():  # (psutil checks it is the same process, not a new pid)
                    child.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    def kill(self, timeout=60):
        """SIGKILL every process of the job, and wait until all are gone (a restart must not
        meet an old rank still writing a checkpoint)."""
        self._track(force=True)
        self.signal_all(signal.SIGKILL)
        psutil.wait_procs([c for c in self.started.values() if c.is_running()], timeout=timeout)
        for proc in self.procs:
            proc.wait()

    def stop(self):
        """Ask every worker to save a checkpoint and exit (SIGTERM)."""
        self.stopping = self.stopping or time.monotonic()
        self.signal_all(signal.SIGTERM)

    def wait(self):
        """Wait for all workers; on the first failure kill the rest. Returns the exit code.

        A worker that exits with 143 (preempted, checkpoint saved) is not a failure the others
        are killed for: they get GRACE_SECONDS to save their part of the checkpoint too.
        """
        while True:
            self._track()
            codes = [p.poll() for p in self.procs]
            running = any(c is None for c in codes)
            # a process killed by a signal first: the others may have failed because of it
            failed = sorted(((c >= 0, i, c) for i, c in enumerate(codes) if c not in (None, 0)))
            preempted = failed and all(exit_code(c) == PREEMPTED for _, _, c in failed)
            if preempted and not self.stopping:
                self.stopping = time.monotonic()
            if failed and (not running or not preempted):
                _, index, returncode = failed[0]
                self.failure = self._describe(index, returncode)
                if running:
                    self.say(f"{self.names[index]} exited with code {exit_code(returncode)}; "
                             "killing the other workers")
                self.kill()
                return self._finish(exit_code(returncode))
            if not running:
                return self._finish(0)
            if self.stopping and time.monotonic() - self.stopping > GRACE_SECONDS:
                self.say(f"workers still running {GRACE_SECONDS}s after SIGTERM; killing them")
                self.signal_all(signal.SIGKILL)
                self.stopping = float("inf")
            time.sleep(POLL_SECONDS)

    def _describe(self, index, returncode):
        """'worker 1 (pid 42) was killed by SIGKILL (exit code 137)'; for a launcher, with
        the rank it named."""
        text = f"{self.names[index]} (pid {self.procs[index].pid}) "
        text += ("was " if returncode < 0 else "ended with ") + describe_exit(returncode)
        rank = self.rank_failure
        if rank:
            how = (describe_exit(-int(rank["signal"])) if rank.get("signal")
                   else describe_exit(int(rank["code"])))
            text += f" after its rank {rank['rank']} ended: {how}"
        return text

    def _finish(self, code):
        for proc in self.procs:
            proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        return code


def main(argv=None):
    parser = ArgumentParser(
        prog="tfbig-launch", description=__doc__.split("\n\n")[0],
        usage="tfbig-launch [--workers=N | --launcher] [--max_restarts=N] -- COMMAND [ARGS...]")
    parser.add_argument("--workers", type=int, default=None,
                        help="Number of local worker processes, each with its TF_CONFIG "
                             "(default 2; not with a launcher command).")
    parser.add_argument("--launcher", action="store_true",
                        help="The command starts every process of the job itself: run it once, "
                             "without TF_CONFIG (default for horovodrun, mpirun, mpiexec, srun "
                             "and torchrun).")
    parser.add_argument("--max_restarts", type=int, default=0,
                        help="Restart the whole job this many times at most when any process "
                             "dies or the job fails; it resumes from the newest intact "
                             "checkpoint (default 0: the first failure ends it).")
    parser.add_argument("--restart_backoff", type=float, default=10.0,
                        help="Seconds before the first restart, doubled for each further one, "
                             "at most 300 (default 10).")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="The worker or launcher command, after --, e.g. tfbig-train ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no worker command given; e.g. tfbig-launch --workers=2 -- tfbig-train "
                     "--strategy=multiworker")
    launcher = args.launcher or is_launcher(command)
    if launcher and args.workers is not None:
        parser.error(f"--workers={args.workers} with the launcher command {command[0]!r}, which "
                     "starts the processes itself (its own -np or the like): drop --workers")
    workers = 1 if launcher else 2 if args.workers is None else args.workers
    if workers < 1:
        parser.error(f"--workers={args.workers}: expected at least 1")
    from launch import supervisor

    _adopt_orphans()
    model_dir = supervisor.run_dir(command)
    try:
        supervisor.check_run_dir(command, model_dir)
        job = supervisor.Supervisor(lambda: _start(parser, command, workers, launcher),
                                    args.max_restarts, args.restart_backoff, model_dir, _say)
    except UsageError as error:
        parser.error(str(error))
    received = []

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            _say(f"got signal {signum}: forwarding SIGTERM to the workers "
                 "(they save a checkpoint); send it again to kill them")
            job.stop()
        else:
            job.stop(kill=True)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return job.run()


def _adopt_orphans():
    """Make this process the parent of any process of the job whose own parent exits (Linux's
    PR_SET_CHILD_SUBREAPER), so `Workers.kill` still finds it; elsewhere, nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _start(parser, command, workers, launcher):
    try:
        return Workers(command, workers, launcher=launcher)
    except (FileNotFoundError, PermissionError) as error:
        parser.error(f"cannot start the worker command {command[0]!r}: {error.strerror}")


def _say(message):
    print(f"[tfbig-launch] {message}", flush=True)


def run():
    sys.exit(main())


if __name__ == "__main__":
    run()
