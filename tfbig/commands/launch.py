"""`tfbig-launch`: start N local worker processes of a tf.distribute multi-worker job, or run
a launcher command (horovodrun, mpirun, srun...) that starts its own; with --max_restarts,
restart the whole job when any process dies (tfbig.training.supervisor).

Each worker gets a TF_CONFIG naming all workers on free localhost ports and its own index
(tfbig.training.workers). If a worker fails, the others (and every process they started) are
killed and tfbig-launch exits with that worker's code. SIGTERM/SIGINT are forwarded to every
process (tfbig-train then saves a checkpoint and exits); a second one kills them.

Example:
    tfbig-launch --workers=2 -- tfbig-train --strategy=multiworker --preset=tiny
    tfbig-launch --max_restarts=3 -- horovodrun -np 2 -H localhost:2 --gloo tfbig-train ...
"""
import argparse
import signal
import sys

from tfbig.commands.cli import ArgumentParser
from tfbig.errors import UsageError
from tfbig.training import supervisor
from tfbig.training.workers import Workers, is_launcher


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
