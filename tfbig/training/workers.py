"""The processes of one job on this machine: N TF_CONFIG workers on free localhost ports, or
one launcher command (horovodrun, mpirun, srun...) that starts its own, their output streamed
with a `[worker i]` prefix; when one fails, every process of the job (and each one they
started) is stopped. What `tfbig-launch` and its supervisor (tfbig.training.supervisor) run."""
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
