"""`tfbig-train`: the main job. Flags map one to one onto tfbig.config.ExperimentConfig.

With no data flags it prepares the embedded Shakespeare corpus once (cached), trains a small
GPT, evaluates bits per byte on held-out plays and prints a generated sample.

Example:
    tfbig-train --preset=tiny --max_steps=50 --model_dir=/tmp/run
"""
import functools
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.commands import recipes  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.training import budget  # noqa: E402

config_lib.define_flags()

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: schedulers (TFJob ExitCode policy) restart it


def main(argv, started=None):
    """`started`: time.monotonic() of the command's start, which the time budget and the last
    line count from (`run` gives the process's start; default: now)."""
    started = time.monotonic() if started is None else started
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}; every option is a --flag")
    recipes.apply(flags.FLAGS)  # e.g. LAMB for ALBERT, the main job's schedule for gpt/small
    _check_given(flags.FLAGS)
    if flags.FLAGS.plan_only:  # before any data or model is built
        from tfbig.training.local_plan import first_process, training_plan

        if flags.FLAGS.init_checkpoint:
            raise UsageError("--plan_only plans the model of --preset and its overrides; with "
                             "--init_checkpoint the architecture is that directory's: drop one")

        cfg = config_lib.from_flags(flags.FLAGS)
        config_lib.check_applicable(cfg)
        text = training_plan(cfg)  # every rank plans (and checks) the same layout
        if first_process():  # one copy per job, not one per rank of horovodrun or TF_CONFIG
            print(text)
        return
    import tensorflow as tf

    from tfbig.training import preflight
    from tfbig.training.trainer import Trainer

    cfg = config_lib.from_flags(flags.FLAGS)
    try:
        trainer = Trainer(cfg, started=started)  # a time budget counts from here
        if trainer.strategy.is_chief and _samples(trainer):
            preflight.check_tokenizer(trainer.task)  # needed for the sample at the end
        summary = trainer.fit()
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as error:
        message = _peer_failure(error, cfg.train.model_dir)
        if not message:
            raise
        sys.exit(message)
    if summary.get("preempted"):  # checkpoint saved; the next start resumes from it
        trainer.strategy.shutdown()
        sys.exit(PREEMPTED_EXIT_CODE)
    if trainer.strategy.is_chief:
        print(f"checkpoint: {summary['checkpoint']}")
        if summary["eval"]:
            print("validation: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["eval"].items()))
        if _samples(trainer):
            from tfbig.models.generation import sample_text

            text = sample_text(trainer.model, trainer.task.tokenizer(), "",
                               min(trainer.cfg.train.sample_tokens, trainer.model.config.seq_length - 1),
                               seed=trainer.cfg.train.seed)
            print("sample:\n" + text)
        print(done_line(summary, time.monotonic() - started))
    trainer.strategy.shutdown()


def _check_given(flag_values):
    """Refuse a value that the flags' 0 default cannot stand for when it is given: a capacity
    factor of 0 means "unset" (the preset's dropless routing) in a config, not a factor."""
    given = flag_values["capacity_factor"]
    if given.present and given.value <= 0:
        raise UsageError(f"--capacity_factor={given.value:g}: expected a factor > 0 such as "
                         f"1.25 (each expert takes at most ceil(factor x tokens x k / E) of a "
                         f"micro-batch's assignments); leave the flag out for dropless routing")


def done_line(summary, seconds):
    """The run's last line, one a user can paste: steps, this process's wall time (data
    preparation included) and the validation bits per byte."""
    minutes, rest = divmod(round(seconds), 60)
    line = f"done: step {summary['step']}, {minutes} min {rest} s wall in this process"
    bpb = summary["eval"].get("bits_per_byte") if summary["eval"] else None
    return line + (f", validation bits per byte {bpb:.4f}" if bpb is not None else "")


def _samples(trainer):
    """Whether the chief prints a text sample at the end (a GPT it holds whole)."""
    return bool(trainer.cfg.train.sample_tokens and trainer.task.format == "gpt"
                and trainer.strategy.whole_model)


def _peer_failure(error, model_dir):
    """One clear message for a collective that failed because another worker died or hung
    (None if `error` is not about other workers)."""
    lines = [line.strip() for line in str(error.message).splitlines()]
    cause = [line for line in lines if not line.startswith("Detected at") and any(
        key in line for key in ("Collective", "unhealthy", "remote target", "/job:"))][:3]
    if not cause:
        return None
    return (f"{type(error).__name__}: {' | '.join(cause)}\n"
            "tfbig-train: stopped because another worker died, hung or became unreachable "
            "during a collective (see its log; a hung one fails after --collective_timeout). "
            f"Start the job again to resume from the last checkpoint in --model_dir={model_dir}.")


def help_sections():
    """--help groups: one per ExperimentConfig section (train, pipeline, horovod, ...)."""
    import dataclasses

    return [(name, [f.name for f in dataclasses.fields(section)])
            for name, section in config_lib.SECTIONS.items()]


def run():
    from tfbig.commands import cli

    # the process's start: the interpreter and the imports are part of the command's time
    cli.run_app("tfbig-train", functools.partial(main, started=budget.command_start()),
                __doc__ + "\n" + recipes.describe(), help_sections())


if __name__ == "__main__":
    run()
