"""`tfbig-launch --max_restarts=N`: restart the whole job when any of its processes dies.

When a worker (or the launcher command: horovodrun, mpirun, ...) ends with anything but
success, every process of the job is stopped (SIGKILL, waited for), and after a back-off all are
started again with the same command; tfbig-train resumes from the newest intact checkpoint in
--model_dir (tfbig.checkpoints.integrity) at the exact data position (the checkpoint holds the global
batches consumed). Each restart is logged with its cause: which process, its signal or exit
code, the last step it logged and the checkpoint step the job resumes from.

Not restarted: exit code 2 (tfbig's one-line user errors, a non-finite loss: a restart fails the
same way), a job the supervisor itself was asked to stop (SIGTERM/SIGINT), and a failure after
the budget of --max_restarts restarts is spent. The back-off doubles after each restart, from
--restart_backoff seconds up to BACKOFF_CAP.

Before the first start, a command whose explicit model flags (--model, --preset, --num_layers,
--hidden_size, ...) contradict the config.json of a --model_dir that holds a checkpoint is
refused, nothing started or changed (tfbig-train's own check refuses the rest, with exit 2).

Example:
    tfbig-launch --max_restarts=3 --workers=2 -- tfbig-train --strategy=multiworker ...
    tfbig-launch --max_restarts=3 -- horovodrun -np 2 -H localhost:2 --gloo tfbig-train ...
"""
import json
import os
import re
import signal
import threading
import time

from tfbig.checkpoints import integrity
from tfbig.config import TrainConfig
from tfbig.errors import USER_ERROR_EXIT_CODE, UsageError
from tfbig.models.common import COMPUTE_FIELDS
from tfbig.training import goodput

BACKOFF_CAP = 300.0  # seconds: the longest wait between restarts
_STATE_ENTRY = re.compile(r'^(?:all_)?model_checkpoint_paths?: "(.*)"$')
_STEP = re.compile(r"-(\d+)$")
_TRAINERS = ("tfbig-train", "tfbig.train", "tfbig.commands.train")
# Model flags whose value keeps the preset's (0, a negative dropout): nothing to compare.
_KEEPS_PRESET = {"num_layers": 0, "hidden_size": 0, "num_heads": 0}


def command_flags(command):
    """{name: value} of the --name=value, --name value, --name and --noname words of a command
    (a later one wins, as absl reads them)."""
    flags = {}
    for i, word in enumerate(command):
        if not word.startswith("--") or word == "--":
            continue
        name, equals, value = word[2:].partition("=")
        if equals:
            flags[name] = value
        elif i + 1 < len(command) and not command[i + 1].startswith("-"):
            flags[name] = command[i + 1]
        elif name.startswith("no") and len(name) > 2:
            flags[name[2:]] = "false"
        else:
            flags[name] = "true"
    return flags


def run_dir(command):
    """The --model_dir the command trains in: its flag, tfbig-train's default when the command
    runs tfbig-train without one, else None (then restarts cannot name the checkpoint step)."""
    flags = command_flags(command)
    if "model_dir" in flags:
        return flags["model_dir"]
    if any(os.path.basename(word) in _TRAINERS for word in command):
        return TrainConfig().model_dir
    return None


def checkpoint_prefixes(model_dir):
    """Checkpoint prefixes TensorFlow's `checkpoint` state file lists, newest first (read as
    text: the supervisor does not import TensorFlow)."""
    try:
        with open(os.path.join(model_dir, "checkpoint")) as f:
            entries = [m.group(1) for m in map(_STATE_ENTRY.match, f.read().splitlines()) if m]
    except OSError:
        return []
    prefixes = [e if os.path.isabs(e) else os.path.join(model_dir, e) for e in entries[1:] or entries]
    return list(reversed(list(dict.fromkeys(prefixes))))


def resume_point(model_dir):
    """(step of the newest intact checkpoint or None, [damaged prefixes newer than it])."""
    damaged = []
    for prefix in checkpoint_prefixes(model_dir):
        if integrity.verify_checkpoint(prefix):
            damaged.append(prefix)
            continue
        step = _STEP.search(prefix)
        return (int(step.group(1)) if step else None), damaged
    return None, damaged


def describe_resume(model_dir):
    """Where a restarted job resumes, in words."""
    if model_dir is None:
        return "the command has no --model_dir, so the checkpoint step is not known"
    step, damaged = resume_point(model_dir)
    skipped = f" ({len(damaged)} newer damaged checkpoint(s) skipped)" if damaged else ""
    if step is not None:
        return f"it resumes from the checkpoint of step {step} in --model_dir={model_dir}{skipped}"
    if damaged:
        return (f"--model_dir={model_dir} holds no intact checkpoint ({', '.join(damaged)} "
                "damaged): tfbig-train refuses to start, nothing is overwritten")
    return f"--model_dir={model_dir} holds no checkpoint yet: the job starts again from step 0"


def _same(value, saved):
    """Whether a flag's text means the saved config value."""
    try:
        return type(saved)(json.loads(value) if not isinstance(saved, str) else value) == saved
    except (ValueError, TypeError):
        return False


def _keeps_preset(name, value):
    try:
        number = float(value)
    except ValueError:
        return False
    return number < 0 if name == "dropout" else _KEEPS_PRESET.get(name) == number


def check_run_dir(command, model_dir):
    """Refuse (UsageError) a command whose explicit model flags contradict the config.json of a
    --model_dir holding a checkpoint: the job would fail at every start, or worse."""
    path = os.path.join(model_dir or "", "config.json")
    if not model_dir or not os.path.isfile(path) or not checkpoint_prefixes(model_dir):
        return
    with open(path) as f:
        saved = json.load(f)
    flags = command_flags(command)
    train, model = saved.get("train", {}), saved.get("model_config", {})
    differ = [(name, flags[name], train[name]) for name in ("model", "preset")
              if name in flags and name in train and flags[name] != train[name]]
    differ += [(name, value, model[name]) for name, value in flags.items()
               if name in model and name not in COMPUTE_FIELDS + ("seq_length", "vocab_size")
               and not _keeps_preset(name, value) and not _same(value, model[name])]
    if differ:
        raise UsageError(
            f"--model_dir={model_dir} holds a checkpoint of another model than the command asks "
            "for: " + ", ".join(f"--{n}={v} (its config.json: {s!r})" for n, v, s in differ)
            + ". Use another --model_dir, or the run's own flags; nothing was started or changed")


class Supervisor:
    """Starts the job, and starts it again after a failure, within a budget of restarts.

    start() -> a started job with wait() -> exit code, and after it `failure` (which process
    and how) and `last_step`; say(message) logs one line."""

    def __init__(self, start, max_restarts, backoff, model_dir, say):
        if max_restarts < 0:
            raise UsageError(f"--max_restarts={max_restarts}: expected 0 (no restart) or more")
        if backoff < 0:
            raise UsageError(f"--restart_backoff={backoff:g}: expected seconds, 0 or more")
        self.start, self.max_restarts, self.backoff = start, max_restarts, backoff
        self.model_dir, self.say = model_dir, say
        self.job = None
        self.restarts = 0
        self.stopped = threading.Event()  # the supervisor was asked to stop: no more restarts

    def stop(self, kill=False):
        """Stop the job for good: SIGTERM (checkpoint saved) or, with kill, SIGKILL."""
        self.stopped.set()
        if self.job is not None:
            self.job.signal_all(signal.SIGKILL) if kill else self.job.stop()

    def _rank_code(self):
        """The exit code of the rank a launcher named as the first to fail (None if none)."""
        rank = getattr(self.job, "rank_failure", None) or {}
        return int(rank["code"]) if rank.get("code") else None

    def run(self):
        """Run the job to success, or to a failure not restarted; returns its exit code."""
        while True:
            self.job = self.start()
            if self.stopped.is_set():  # asked to stop while it started
                self.job.stop()
            code = self.job.wait()
            died = time.time()  # for the run's goodput: a restart's time starts here
            if code == 0 or self.stopped.is_set() or not self.max_restarts:
                return code
            cause = f"{self.job.failure or f'the job ended with exit code {code}'}"
            if self.job.last_step is not None:
                cause += f", after its progress line of step {self.job.last_step}"
            if USER_ERROR_EXIT_CODE in (code, self._rank_code()):
                self.say(f"not restarting: {cause}; exit code {code} is an error a restart "
                         "repeats (a flag, a file, a non-finite loss), see the line above")
                return code
            if self.restarts >= self.max_restarts:
                self.say(f"not restarting: {cause}; the budget of --max_restarts="
                         f"{self.max_restarts} restarts is spent")
                return code
            self.restarts += 1
            delay = min(self.backoff * 2 ** (self.restarts - 1), BACKOFF_CAP)
            self.say(f"restart {self.restarts} of {self.max_restarts} in {delay:g} s: {cause}; "
                     f"{describe_resume(self.model_dir)}")
            if self.stopped.wait(delay):
                self.say("asked to stop during the back-off: not restarting")
                return code
            goodput.record_restart(self.model_dir, died, time.time(), cause)
