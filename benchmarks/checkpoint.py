"""What a checkpoint save costs the step loop: synchronous vs --async_checkpoint.

One Trainer (the `small` GPT by default) runs the same stretch of steps three ways, in turns for
--repeats rounds: without saves (the reference), with a synchronous save every --save_every
steps, and with an asynchronous one (the loop waits for the host copy; the write runs beside the
next steps, so whatever it takes from the cores those steps pay too). The cost of a save in the
loop is (wall time of the stretch with saves - without) / saves; each stretch ends with
--save_every steps after its last save, and the last write is waited for outside the timing.
One asynchronous save is made, and reported, before the timed stretches (the recorded runs
before the Trainer traced the copy at its start paid the trace there).
The stretch's steps are the loop's own (`Trainer._train_step`, each loss read back).

    python benchmarks/checkpoint.py                         # small GPT, batch 4 x 256 tokens
    python benchmarks/checkpoint.py --preset=tiny --save_every=2 --saves=2
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/checkpoint.py --zero_stage=3 \
        --dir=/tmp/checkpoint-bench

Under horovodrun (--strategy=horovod, e.g. with --zero_stage=3) every rank runs the same
stretches, each saving its own piece; rank 0 prints (and records) the figures, the bytes of
every rank's piece as checkpoint_bytes.

Prints one JSON line last: seconds per step, each mode's cost per save, the async/sync ratio
(goal: <= 0.10), the host copy's and the background write's seconds, the checkpoint's bytes.
"""
import _record  # --record: append the result to benchmarks/results (strips the flag from sys.argv)
import contextlib
import glob
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "small", "GPT preset.")
flags.DEFINE_integer("batch_size", 4, "Sequences per step.")
flags.DEFINE_integer("seq_length", 256, "Tokens per sequence.")
flags.DEFINE_integer("save_every", 3, "Steps between saves.")
flags.DEFINE_integer("saves", 2, "Saves per timed stretch.")
flags.DEFINE_integer("repeats", 3, "Rounds over the three modes; the median of each is used.")
flags.DEFINE_string("data_dir", "", "Prepared data (default: the embedded corpus, cached).")
flags.DEFINE_string("dir", "", "Where the runs write (default: a new temporary directory); "
                    "under horovodrun one directory every rank names.")
flags.DEFINE_integer("zero_stage", 0, "Under horovodrun: ZeRO stage of the layout (0: plain data "
                     "parallel).")


def make_trainer(model_dir):
    from tfbig.config import ExperimentConfig
    from tfbig.training.trainer import Trainer

    cfg = ExperimentConfig()
    for key, value in dict(preset=FLAGS.preset, batch_size=FLAGS.batch_size,
                           seq_length=FLAGS.seq_length, data_dir=FLAGS.data_dir,
                           model_dir=model_dir, max_steps=10 ** 6, warmup_steps=1,
                           sample_tokens=0, checkpoint_every=10 ** 9, keep_checkpoints=2).items():
        setattr(cfg.train, key, value)
    if "HOROVOD_RANK" in os.environ:  # started by horovodrun: one rank of a Horovod layout
        cfg.train.strategy, cfg.parallel.zero_stage = "horovod", FLAGS.zero_stage
    elif FLAGS.zero_stage:
        raise app.UsageError("--zero_stage needs ranks: run this under horovodrun (see above)")
    cfg.profile.monitor_interval_ms = 0
    return Trainer(cfg)


def stretch(trainer, batches, mode, model_dir):
    """(wall seconds of the stretch, [seconds the loop waited in each save])."""
    saving = mode != "none"
    trainer.async_checkpoint = mode == "async"
    trainer.cfg.train.model_dir, trainer._managers = model_dir, {}  # a fresh writer per stretch
    waits = []
    start = time.perf_counter()
    for step in range(1, FLAGS.save_every * (FLAGS.saves + 1) + 1):
        trainer._train_step(next(batches))["loss"].numpy()
        if saving and step % FLAGS.save_every == 0 and len(waits) < FLAGS.saves:
            begin = time.perf_counter()
            trainer.save()
            waits.append(time.perf_counter() - begin)
    elapsed = time.perf_counter() - start
    trainer.wait_for_checkpoint()  # the last write, outside the timing
    return elapsed, waits


def main(argv):
    del argv
    times = {"none": [], "sync": [], "async": []}
    waits = {"sync": [], "async": []}
    write_seconds = []
    if "HOROVOD_RANK" in os.environ and not FLAGS.dir:
        raise app.UsageError("under horovodrun, name the ranks' one directory with --dir")
    with contextlib.nullcontext(FLAGS.dir) if FLAGS.dir else tempfile.TemporaryDirectory() as root:
        trainer = make_trainer(os.path.join(root, "run"))
        batches = trainer._train_iterator()
        for _ in range(2):  # compile, settle
            trainer._train_step(next(batches))["loss"].numpy()
        trainer.async_checkpoint = True  # a first asynchronous save, untimed
        trainer.cfg.train.model_dir = os.path.join(root, "first")
        begin = time.perf_counter()
        trainer.save()
        first_save = time.perf_counter() - begin
        trainer.wait_for_checkpoint()
        for round_index in range(FLAGS.repeats):
            for mode in times:
                model_dir = os.path.join(root, f"{mode}-{round_index}")
                elapsed, waited = stretch(trainer, batches, mode, model_dir)
                times[mode].append(elapsed)
                if mode != "none":
                    waits[mode] += waited
                if mode == "async":  # this rank's writer (its piece's directory)
                    write_seconds.append(next(iter(trainer._managers.values())).write_seconds)
                shown = ", ".join(f"{w:.2f}" for w in waited)
                print(f"round {round_index} {mode}: {elapsed:.2f} s"
                      + (f", loop waits {shown} s" if waited else ""), flush=True)
        size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "**", "ckpt-*"),
                                                           recursive=True)
                   if os.path.isfile(p))  # every rank's piece under a sharded layout
    steps = FLAGS.save_every * (FLAGS.saves + 1)
    reference = statistics.median(times["none"])
    cost = {mode: (statistics.median(times[mode]) - reference) / FLAGS.saves
            for mode in ("sync", "async")}
    if not trainer.strategy.is_chief:
        return
    _record.emit({
        "benchmark": "checkpoint", "preset": FLAGS.preset, "batch_size": FLAGS.batch_size,
        "ranks": trainer.strategy.num_replicas, "zero_stage": FLAGS.zero_stage,
        "seq_length": FLAGS.seq_length, "save_every": FLAGS.save_every, "saves": FLAGS.saves,
        "repeats": FLAGS.repeats, "checkpoint_bytes": size // FLAGS.saves,
        "seconds_per_step": round(reference / steps, 4),
        "sync_cost_per_save_s": round(cost["sync"], 3),
        "async_cost_per_save_s": round(cost["async"], 3),
        "async_over_sync": round(cost["async"] / cost["sync"], 3) if cost["sync"] > 0 else None,
        "sync_wait_s": round(statistics.median(waits["sync"]), 3),
        "async_wait_s": round(statistics.median(waits["async"]), 3),
        "async_write_s": round(statistics.median(write_seconds), 3),
        "async_first_save_s": round(first_save, 3),  # untimed
        "stretch_seconds": {m: [round(t, 2) for t in v] for m, v in times.items()}})


if __name__ == "__main__":
    app.run(main)
