"""The same data whatever the layout, through the command line: `tfbig-train` on one process and
under `horovodrun` (plain data parallel, TP x DP, ZeRO-3, PP x DP) logs the same loss at every
step on the embedded corpus with the same flags, its input pipelines read the same examples
(--data_trace), and a checkpoint resumed on another number of ranks continues with exactly the
examples of the uninterrupted run.

The embedded corpus is prepared once per host (tfbig's cache, as a user's first run does).
Losses are read from the run's TensorBoard events (full float32); they may differ in the last
bits across world sizes (the all-reduce sums in another order): rtol 1e-5.
"""
import glob
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, BATCH = 4, 8
FLAGS = dict(preset="tiny", num_layers=2, hidden_size=16, num_heads=2, batch_size=BATCH, max_steps=STEPS,
             learning_rate=3e-3, warmup_steps=1, dropout=0.0, log_every=1, eval_steps=1, checkpoint_every=2,
             keep_checkpoints=5, deterministic=True, sample_tokens=0, xla=False, monitor_interval_ms=0)
TIMEOUT = 420


def train(model_dir, ranks=1, **extra):
    """Run tfbig-train (under horovodrun -np `ranks` when ranks > 1); returns model_dir."""
    flags = [f"--{k}={v}" for k, v in {**FLAGS, "model_dir": model_dir, "data_trace": f"{model_dir}/trace",
                                       **extra}.items()]
    command = [os.path.join(BIN, "tfbig-train"), *flags]
    if ranks > 1:
        command = [os.path.join(BIN, "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
                   *command, "--strategy=horovod"]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with open(f"{model_dir}.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, open(f"{model_dir}.log").read()[-4000:]
    return model_dir


def losses(model_dir):
    """{step: training loss} from the run's TensorBoard events."""
    import tensorflow as tf

    found = {}
    for path in glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "loss":
                    found[event.step] = float(tf.make_ndarray(value.tensor))
    return found


def trace(model_dir):
    """{global position: CRC-32 of its record} over every input pipeline of the run (--data_trace)."""
    seen = {}
    for path in glob.glob(os.path.join(model_dir, "trace", "*.tsv")):
        for line in open(path):
            position, crc = map(int, line.split())
            assert seen.setdefault(position, crc) == crc, f"position {position} read as two records"
    return seen


def assert_same_run(run, reference, first_step=1):
    expected = {s: v for s, v in losses(reference).items() if s >= first_step}
    got = losses(run)
    assert sorted(got) == sorted(expected) == list(range(first_step, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    wanted = range((first_step - 1) * BATCH, STEPS * BATCH)  # the examples of those steps
    mine, theirs = trace(run), trace(reference)
    assert all(p in mine for p in wanted) and min(mine) == (first_step - 1) * BATCH
    assert [mine[p] for p in wanted] == [theirs[p] for p in wanted]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(str(tmp_path_factory.mktemp("order") / "one"))


@pytest.mark.slow  # two launches; the Horovod, ZeRO and TP equality tests compare each rank with one process reading the same global examples (ReplicasTask)
@pytest.mark.multiproc
def test_two_ranks_train_on_the_examples_of_one_process(one_process, tmp_path):
    assert_same_run(train(str(tmp_path / "np2"), ranks=2), one_process)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("ranks,layout", [
    (4, {}), (4, {"tensor_parallel": 2}), (4, {"zero_stage": 3, "shard_degree": 2}),
    (4, {"pipeline_stages": 2, "num_microbatches": 2}), (1, {"grad_accum_steps": 4})],
    ids=["dp4", "tp2xdp2", "zero3x2", "pp2xdp2", "accum4"])
def test_every_layout_trains_on_the_examples_of_one_process(one_process, tmp_path, ranks, layout):
    assert_same_run(train(str(tmp_path / "run"), ranks=ranks, **layout), one_process)


def checkpoint_at(model_dir, step, into):
    """A copy of `model_dir` as it was after its checkpoint at `step` (later checkpoints and
    events removed): what a run stopped there left."""
    import tensorflow as tf

    shutil.copytree(model_dir, into)
    shutil.rmtree(os.path.join(into, "trace"))
    shutil.rmtree(os.path.join(into, "train"))
    state = tf.train.get_checkpoint_state(into)
    kept = [p for p in state.all_model_checkpoint_paths if int(p.rsplit("-", 1)[1]) <= step]
    for path in state.all_model_checkpoint_paths:
        if path not in kept:
            for name in glob.glob(glob.escape(path) + ".*"):
                os.remove(name)
    prefix = os.path.join(into, os.path.basename(kept[-1]))
    tf.compat.v1.train.update_checkpoint_state(into, prefix, [os.path.join(into, os.path.basename(p)) for p in kept])
    return into


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("resumed_ranks", [2, 1])
def test_a_four_rank_checkpoint_resumed_on_fewer_ranks_reads_the_same_examples(tmp_path_factory, one_process,
                                                                                resumed_ranks):
    straight = tmp_path_factory.getbasetemp() / "straight-np4"
    if not straight.exists():  # the uninterrupted 4-rank run, shared by both resumes
        train(str(straight), ranks=4)
    resumed = checkpoint_at(str(straight), 2, str(tmp_path_factory.mktemp("resumed") / "run"))
    train(resumed, ranks=resumed_ranks)
    assert_same_run(resumed, str(straight), first_step=3)
    assert_same_run(str(straight), one_process)
