"""Elastic Horovod (--elastic): a rank killed with SIGKILL mid-run, training goes on with one,
a new rank joins when the discovery script reports a slot again; the run consumes exactly the
records of an uninterrupted run and matches its losses (real horovodrun, localhost, Gloo), for
tfbig's GPT and Llama and for a user task (tfbig.Task)."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_worker import (ROWS_KEY, USER_ROWS_KEY, fingerprint,  # noqa: E402
                            own_model_task)
from equality import RecordedGradients  # noqa: E402
from test_trainer import make_cfg  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.config import ExperimentConfig, check_applicable  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.training.logs import RunLogger  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
MAX_STEPS = 24
TRAIN = dict(max_steps=MAX_STEPS, batch_size=8, grad_accum_steps=2, grad_clip_norm=0.5,
             dropout=0.0, checkpoint_every=10, eval_steps=1)


def elastic_cfg(data_dir, model_dir, zero_stage=0, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **TRAIN, **train)
    cfg.parallel.zero_stage = zero_stage
    cfg.horovod.elastic = True
    cfg.horovod.elastic_commit_every = 2
    return cfg


def write_hosts(path, hosts, slots=1):
    with open(path + ".tmp", "w") as f:
        f.write("".join(f"{h}:{slots}\n" for h in hosts))
    os.replace(path + ".tmp", path)


def records(out):
    """{pid: [step entries]} written by every process of the run."""
    found = {}
    for path in glob.glob(os.path.join(out, "pid*.jsonl")):
        with open(path) as f:
            found[path] = [json.loads(line) for line in f if line.strip()]
    return found


def progress(out):
    return max((e["step"] for entries in records(out).values() for e in entries), default=0)


def wait_for(predicate, timeout, what, proc, log):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {what}:\n"
                                 + open(log).read()[-4000:])
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n"
                                 + open(log).read()[-4000:])
        time.sleep(0.2)


def last_execution(out):
    """Per step, each rank's entry of the step's newest execution (the steps after the last
    commit run again, in the smaller world, after a rank dies)."""
    by_step = {}
    for entries in records(out).values():
        for e in entries:
            by_step.setdefault(e["step"], []).append(e)
    final = {}
    for step, entries in by_step.items():
        world = max(entries, key=lambda e: e["time"])["world"]
        latest = {e["rank"]: e for e in sorted(entries, key=lambda e: e["time"])
                  if e["world"] == world}
        final[step] = [latest[rank] for rank in range(world)]
    return final


def start(tmp_path, cfg, slots=1, **plan):
    """Launch `cfg` on 2 elastic hosts of `slots` ranks each (elastic_worker.py; `plan`: its
    options), listed in a file the discovery script reads. Returns (process, out dir, log,
    hosts file)."""
    out = tmp_path / "out"
    os.makedirs(out)
    with open(tmp_path / "plan.json", "w") as f:
        json.dump({"config": config_lib.to_dict(cfg), "out": str(out),
                   "step_seconds": 0.3, **plan}, f)
    hosts = str(tmp_path / "hosts.txt")
    write_hosts(hosts, ["localhost", "127.0.0.1"], slots)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log = str(tmp_path / "log.txt")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [HOROVODRUN, "--gloo", "-np", str(2 * slots), "--min-np", str(slots),
               "--max-np", str(2 * slots),
               "--host-discovery-script", str(discover), sys.executable,
               os.path.join(HERE, "elastic_worker.py"), str(tmp_path / "plan.json")]
    proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)
    return proc, out, log, hosts


def finished(proc, out, log, resets):
    """The run's end: exit 0 after MAX_STEPS with these world resets; each step's newest
    execution per rank."""
    output = open(log).read()
    assert proc.returncode == 0, output[-5000:]
    with open(out / "final.json") as f:
        final = json.load(f)
    assert final["step"] == MAX_STEPS
    assert final["resets"][:len(resets)] == resets and final["world"] == resets[-1][1], final
    steps = last_execution(str(out))
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    return steps


def killed_and_rejoined(tmp_path, cfg, slots=1, **plan):
    """Run `cfg` on 2 elastic hosts of `slots` ranks, SIGKILL rank 1 after step 5 (Horovod
    drops its host whole), let one host train on, then report a host again: the run ends on 2
    hosts after resets 2 -> 1 -> 2 hosts' ranks. Returns (out dir, each step's newest
    execution per rank)."""
    proc, out, log, hosts = start(tmp_path, cfg, slots, **plan)
    one, two = slots, 2 * slots  # ranks on one host, on two
    try:
        wait_for(lambda: progress(out) >= 5, 300, "step 5", proc, log)
        ranks = {int(open(p).read()): p for p in glob.glob(str(out / "pid*.rank"))}
        victim = int(os.path.basename(ranks[1])[3:-5])
        os.kill(victim, signal.SIGKILL)
        killed_at = progress(out)
        wait_for(lambda: any(e["world"] == one and e["step"] > killed_at + 2
                             for es in records(out).values() for e in es),
                 120, "training on with one host", proc, log)
        # A slot again, on a new host name (the dead rank's host is blacklisted by Horovod).
        write_hosts(hosts, ["localhost", "127.0.0.1", os.uname().nodename], slots)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = finished(proc, out, log, [[two, one], [one, two]])
    worlds = [len(steps[s]) for s in sorted(steps)]
    assert one in worlds and worlds[0] == two and worlds[-1] == two, worlds  # 2 -> 1 -> 2 hosts
    return out, steps


def assert_matches_the_uninterrupted_run(out, steps, reference_cfg, task=None, key=ROWS_KEY,
                                         in_order=True):
    """The uninterrupted reference (one process, same global batch, same global record order)
    consumed the same records at every step (batch[`key`]: each example's ids; `in_order`:
    rank by rank in the reference's order, else as a set), logged the same losses and ends
    with the same weights."""
    consumed = []

    class Reference(Trainer):
        def _train_iterator(self):
            for batch in super()._train_iterator():
                ids = batch[key].numpy()
                consumed.append(ids.reshape(-1, ids.shape[-1]))
                yield batch

    logger = Losses(reference_cfg.train.model_dir, True, MAX_STEPS)
    reference = Reference(reference_cfg, task=task, logger=logger)
    recorded = RecordedGradients(reference)
    reference.fit()
    for step in range(1, MAX_STEPS + 1):
        # Each rank reads its contiguous slice of the step's global batch (tfbig.data.order).
        ranks = steps[step]
        world = len(ranks)
        read = [int(x) for e in ranks for x in e["rows"]]
        expected = [fingerprint(r) for r in consumed[step - 1]]
        if not in_order:
            read, expected = sorted(read), sorted(expected)
        assert read == expected, f"step {step} (world {world})"
        assert ranks[0]["loss"] == pytest.approx(logger.losses[step], rel=1e-5), step
    # Weights after 24 steps: the world of 1 sums a step's micro-batch gradients in another
    # order than the world of 2's all-reduce, and Adam turns a float32 difference in a
    # near-zero gradient into a step of either sign (one entry of a 96-entry variable ended
    # 1.1e-6 apart): tests/equality.py bounds each entry through the gradients.
    with np.load(out / "final.npz") as final_weights:
        recorded.assert_equal([final_weights[f"arr_{i}"] for i in range(len(recorded.paths))])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("model,zero_stage", [("gpt", 0), ("llama", 0), ("gpt", 1),
                                              ("llama", 2), ("gpt", 3)])
def test_rank_killed_and_replaced_run_matches_the_uninterrupted_one(gpt_data, tmp_path, model,
                                                                    zero_stage):
    """With --zero_stage the optimizer slots (stage 3: and the parameters) are gathered whole
    at each commit and sliced again over each world (2 -> 1 -> 2 ranks: slices of another
    size, new variables)."""
    out, steps = killed_and_rejoined(tmp_path, elastic_cfg(
        gpt_data, tmp_path / "run", model=model, zero_stage=zero_stage))
    assert_matches_the_uninterrupted_run(out, steps, make_cfg(
        gpt_data, tmp_path / "reference", **TRAIN, model=model))


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_host_of_two_ranks_lost_and_one_added_matches_the_uninterrupted_run(gpt_data,
                                                                              tmp_path):
    """Hosts of 2 slots each, ZeRO-1 over the whole world: a process killed, Horovod drops its
    host whole (4 -> 2 ranks: the other process of that host is stopped too), then a new host
    joins (2 -> 4); the run equals one process. (The same hosts with CP2, each context group a
    Horovod process set added in each world: every rank aborted in Gloo, exit 134, as the
    process was killed; composition.REFUSED names every layout with groups.)"""
    out, steps = killed_and_rejoined(tmp_path, elastic_cfg(gpt_data, tmp_path / "run", 1),
                                     slots=2)
    assert_matches_the_uninterrupted_run(out, steps, make_cfg(
        gpt_data, tmp_path / "reference", **TRAIN))


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [pytest.param(0, marks=pytest.mark.slow),
                                        pytest.param(1, marks=pytest.mark.slow), 3])
def test_a_rank_lost_before_step_one_leaves_the_other_training_alone(gpt_data, tmp_path,
                                                                     zero_stage):
    """Rank 1 dies as the ranks' first collective begins (the sync of the state, while the
    other one may still build and compile): rank 0's broadcast fails, which is a reset like a
    loss mid-run, not the end of the job. Rank 0 trains every step alone, equal to one process
    (with ZeRO-1/3: its slices, made for 2 ranks, made again whole for 1)."""
    cfg = elastic_cfg(gpt_data, tmp_path / "run", zero_stage=zero_stage)
    proc, out, log, _ = start(tmp_path, cfg, die_before_first_sync=1, step_seconds=0.0)
    try:
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    steps = finished(proc, out, log, [[2, 1]])
    assert all(len(steps[s]) == 1 for s in steps), "a step ran with 2 ranks"
    assert_matches_the_uninterrupted_run(out, steps,
                                         make_cfg(gpt_data, tmp_path / "reference", **TRAIN))


def user_cfg(model_dir, **flags):
    """examples/own_model.py's run of TRAIN's schedule, as tfbig.train configures it."""
    import tfbig

    return tfbig.configure(model_dir=str(model_dir), learning_rate=3e-3, warmup_steps=2,
                           log_every=1, deterministic=True, xla=False, peak_tflops=1.0,
                           **TRAIN, **flags)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_user_task_rank_killed_and_replaced_matches_the_uninterrupted_one(tmp_path,
                                                                            zero_stage):
    """The same for a user model (tfbig.Task: examples/own_model.py's MyModel, its loss and
    its DataShard-sharded tf.data pipeline): its model and optimizer are committed and
    restored, its dataset made again for each world from the global position. Its pipeline
    deals each global batch's examples to the ranks in turn (`shard(count, index)`), not in
    contiguous slices as tfbig's data layer does: each step reads the same examples, in
    another order between ranks."""
    cfg = user_cfg(tmp_path / "run", strategy="horovod", elastic=True,
                   elastic_commit_every=2, zero_stage=zero_stage)
    out, steps = killed_and_rejoined(tmp_path, cfg, user_task=True)
    reference_cfg = user_cfg(tmp_path / "reference")
    assert_matches_the_uninterrupted_run(out, steps, reference_cfg,
                                         own_model_task(reference_cfg), USER_ROWS_KEY,
                                         in_order=False)


class Losses(RunLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = {}

    def scalars(self, split, step, values):
        if split == "train":
            self.losses[step] = values["loss"]
        super().scalars(split, step, values)


@pytest.mark.parametrize("field", ["shard_degree", "tensor_parallel", "pipeline_stages",
                                   "context_parallel"])
def test_elastic_refuses_layouts_that_depend_on_the_world_size(field):
    """Each needs process sets, which Horovod's elastic mode does not survive a lost rank with
    (tried: CP2 x DP2 on hosts of 2 slots, a process killed: every rank aborted in Gloo with
    exit 134; without process sets the same hosts went 4 -> 2 -> 4 ranks: the slow test
    above)."""
    from tfbig.distribute.elastic import check_elastic

    cfg = ExperimentConfig()
    cfg.train.strategy, cfg.horovod.elastic = "horovod", True
    setattr(cfg.pipeline if field == "pipeline_stages" else cfg.parallel, field, 2)
    with pytest.raises(UsageError) as error:
        check_elastic(cfg)
    assert str(error.value) == (
        f"--elastic with --{field}=2 is not supported: its groups are Horovod process sets, "
        f"and Horovod's elastic mode does not survive a lost rank while process sets exist "
        f"(Horovod 0.28.1: every rank aborts in Gloo, horovod/horovod#4021); an elastic run is "
        f"data parallel, ZeRO-sharded over its whole world at most")


def test_elastic_is_refused_with_a_cross_rank_pipeline():
    cfg = ExperimentConfig()
    cfg.train.strategy, cfg.horovod.elastic = "pipeline", True
    with pytest.raises(ValueError, match=r"^--elastic=True has no effect with "
                                         r"--strategy=pipeline; it applies to --strategy=horovod$"):
        check_applicable(cfg)

