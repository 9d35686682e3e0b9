"""`tfbig-launch`: start N local worker processes of a tf.distribute multi-worker job.

Each worker gets a TF_CONFIG naming all workers on free localhost ports and its own index;
their output is streamed with a `[worker i]` prefix. If a worker fails, the others are killed
and tfbig-launch exits with that worker's code. SIGTERM/SIGINT are forwarded to every worker
(tfbig-train then saves a checkpoint and exits); a second one kills them.

Example:
    tfbig-launch --workers=2 -- tfbig-train --strategy=multiworker --preset=tiny
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tfbig.commands.cli import ArgumentParser

POLL_SECONDS = 0.2
PREEMPTED = 143  # tfbig-train after SIGTERM: checkpoint saved (128 + SIGTERM)
GRACE_SECONDS = 120  # how long preempted workers may take to finish their checkpoint


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


class Workers:
    """N worker processes of one command, each in its own process group."""

    def __init__(self, command, num_workers, env=None, stream=None):
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self.stopping = None  # time the workers were asked to stop (SIGTERM)
        addresses = [f"localhost:{port}" for port in free_ports(num_workers)]
        self.procs = []
        for index in range(num_workers):
            worker_env = {**(env or os.environ), "TF_CONFIG": tf_config(addresses, index),
                          "PYTHONUNBUFFERED": "1"}
            self.procs.append(subprocess.Popen(
                command, env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True))
        self.readers = [threading.Thread(target=self._pump, args=(i, p.stdout), daemon=True)
                        for i, p in enumerate(self.procs)]
        for reader in self.readers:
            reader.start()

    def _pump(self, index, pipe):
        for line in iter(pipe.readline, b""):
            with self.lock:
                self.stream.write(f"[worker {index}] " + line.decode(errors="replace"))
                self.stream.flush()

    def say(self, message):
        with self.lock:
            self.stream.write(f"[tfbig-launch] {message}\n")
            self.stream.flush()

    def signal_all(self, signum):
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except ProcessLookupError:
                    pass

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
            codes = [p.poll() for p in self.procs]
            running = any(c is None for c in codes)
            failed = [(i, exit_code(c)) for i, c in enumerate(codes) if c not in (None, 0)]
            preempted = failed and all(code == PREEMPTED for _, code in failed)
            if preempted and not self.stopping:
                self.stopping = time.monotonic()
            if failed and (not running or not preempted):
                index, code = failed[0]
                if running:
                    self.say(f"worker {index} exited with code {code}; killing the other workers")
                    self.signal_all(signal.SIGKILL)
                return self._finish(code)
            if not running:
                return self._finish(0)
            if self.stopping and time.monotonic() - self.stopping > GRACE_SECONDS:
                self.say(f"workers still running {GRACE_SECONDS}s after SIGTERM; killing them")
                self.signal_all(signal.SIGKILL)
                self.stopping = float("inf")
            time.sleep(POLL_SECONDS)

    def _finish(self, code):
        for proc in self.procs:
            proc.wait()
        for reader in self.readers:
            reader.join(timeout=5)
        return code


def main(argv=None):
    parser = ArgumentParser(
        prog="tfbig-launch", description=__doc__.split("\n\n")[0],
        usage="tfbig-launch --workers=N -- COMMAND [ARGS...]")
    parser.add_argument("--workers", type=int, default=2,
                        help="Number of local worker processes (default 2).")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="The worker command, after --, e.g. tfbig-train ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no worker command given; e.g. tfbig-launch --workers=2 -- tfbig-train "
                     "--strategy=multiworker")
    if args.workers < 1:
        parser.error(f"--workers={args.workers}: expected at least 1")
    try:
        workers = Workers(command, args.workers)
    except (FileNotFoundError, PermissionError) as error:
        parser.error(f"cannot start the worker command {command[0]!r}: {error.strerror}")
    received = []

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            workers.say(f"got signal {signum}: forwarding SIGTERM to the workers "
                        "(they save a checkpoint); send it again to kill them")
            workers.stop()
        else:
            workers.signal_all(signal.SIGKILL)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return workers.wait()


def run():
    sys.exit(main())


if __name__ == "__main__":
    run()
