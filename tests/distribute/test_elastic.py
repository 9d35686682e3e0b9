"""Elastic Horovod (--elastic): a rank killed with SIGKILL mid-run, training goes on with one,
a new rank joins when the discovery script reports a slot again; the run consumes exactly the
records of an uninterrupted run and matches its losses (real horovodrun, localhost, Gloo), for
tfbig's GPT and Llama and for a user task (tfbig.Task). A layout with groups (TP2) changes
worlds by restarts under tfbig-launch --max_restarts: a host lost, then listed again, and the
weights at the end equal one process's."""
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


RESTART_STEPS = 80


def cli_flags(data_dir, model_dir, **more):
    """tfbig-train's flags of make_cfg's tiny GPT (and `more`)."""
    flags = dict(data_dir=data_dir, model_dir=model_dir, preset="tiny", seq_length=16,
                 num_layers=2, hidden_size=32, num_heads=4, dropout=0.0, batch_size=8,
                 max_steps=RESTART_STEPS, learning_rate=3e-3, warmup_steps=2, log_every=1,
                 checkpoint_every=4, eval_steps=1, grad_clip_norm=0.5, sample_tokens=0,
                 peak_tflops=1.0)
    flags.update(more)
    words = [f"--{k}={v}" for k, v in flags.items()]
    return words + ["--deterministic", "--noxla"]


def train_processes(model_dir):
    """{pid: the HOROVOD_HOSTNAME of its environment} of the running tfbig-train processes of
    `model_dir`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"tfbig.commands.train" in words and f"--model_dir={model_dir}".encode() in words:
            found[int(pid)] = env.get(b"HOROVOD_HOSTNAME", b"").decode()
    return found


def logged_steps(log):
    """The step of each progress line of the log, in order."""
    import re

    return [int(m) for m in re.findall(r"\] step (\d+)/", open(log).read())]


@pytest.mark.multiproc
def test_a_sigterm_to_one_tensor_rank_stops_both_after_the_same_step(gpt_data, tmp_path):
    """TP2 (one data replica: each rank its own data group): a SIGTERM to tensor rank 1 alone
    stops both ranks after the same step, each saving its pieces of that step, exit 143 (the
    stop requests agree over the whole world, not only over a data group; without that the two
    ranks stopped after different steps and the launch failed)."""
    run, log = tmp_path / "run", str(tmp_path / "log.txt")
    command = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m",
               "tfbig.commands.train", *cli_flags(gpt_data, str(run), strategy="horovod",
                                                   tensor_parallel=2, max_steps=2000,
                                                   checkpoint_every=1000)]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: max(logged_steps(log), default=0) >= 3, 300, "step 3", proc, log)
        ranks = {pid: open(f"/proc/{pid}/environ", "rb").read() for pid in train_processes(run)}
        second = [pid for pid, env in ranks.items() if b"HOROVOD_RANK=1\0" in env]
        assert len(second) == 1, ranks.keys()
        os.kill(second[0], signal.SIGTERM)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = open(log).read()
    assert proc.returncode != 0 and "preempted (SIGTERM) after step" in output, output[-4000:]
    newest = [open(path).readline() for path in (run / "checkpoint",
                                                  run / "tensor" / "rank-1" / "checkpoint")]
    assert newest[0] == newest[1], newest  # both tensor ranks' pieces of the same step
    assert max(logged_steps(log)) < 2000


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tensor_parallel", "context_parallel"])
def test_a_layout_with_groups_restarts_in_the_world_left_and_in_a_larger_one(gpt_data,
                                                                             tmp_path, layout):
    """--elastic --tensor_parallel=2 (--context_parallel=2) under `tfbig-launch
    --max_restarts` and an elastic horovodrun on 2 hosts of 2 slots (TP2 x DP2). After a
    checkpoint, one process of the second host is killed and the discovery script stops
    listing that host: every rank ends (Gloo aborts the ranks of the groups' process sets),
    horovodrun fails, tfbig-launch starts the job again on the host left (TP2 x DP1), resumed
    from the newest checkpoint; the host listed again, every rank saves a checkpoint and stops
    (exit 143), and the third start trains TP2 x DP2 to the end. (horovodrun's -np is
    --min-np: each start waits for -np slots and takes every slot listed, up to --max-np;
    without --network-interface an elastic start waits for two hosts to find their common
    interfaces.) The final weights equal one
    process's on the same global batches (tests/equality.py's rule)."""
    from tfbig.convert.run_dir import load_model

    run, hosts, log = tmp_path / "run", str(tmp_path / "hosts.txt"), str(tmp_path / "log.txt")
    write_hosts(hosts, ["localhost", "127.0.0.1"], 2)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    command = [sys.executable, "-m", "tfbig.commands.launch", "--max_restarts=3",
               "--restart_backoff=1", "--", HOROVODRUN, "--gloo", "-np", "2", "--min-np", "2",
               "--max-np", "4", "--network-interface", "lo",  # (one host: no interface probe)
               "--host-discovery-script", str(discover), sys.executable, "-m",
               "tfbig.commands.train", *cli_flags(gpt_data, str(run), strategy="horovod",
                                                   elastic=True, **{layout: 2})]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: max(logged_steps(log), default=0) >= 9, 300, "the step-8 checkpoint",
                 proc, log)
        second = [pid for pid, host in train_processes(run).items() if host == "127.0.0.1"]
        assert len(second) == 2, train_processes(run)
        write_hosts(hosts, ["localhost"], 2)  # the host is gone ...
        os.kill(second[0], signal.SIGKILL)  # ... with its processes
        # the host is back once the ranks on one host train (and listen for the driver's
        # notices)
        wait_for(lambda: open(log).read().count("resumed from") >= 1, 300,
                 "the restart on one host", proc, log)
        resumed = len(logged_steps(log))
        wait_for(lambda: len(logged_steps(log)) >= resumed + 2, 120, "steps on one host",
                 proc, log)
        write_hosts(hosts, ["localhost", "127.0.0.1"], 2)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = open(log).read()
    assert proc.returncode == 0, output[-6000:]
    assert output.count("[tfbig-launch] restart ") == 2, output[-6000:]
    assert "the discovery script reports other hosts" in output
    assert output.count("resumed from") == 2
    steps = logged_steps(log)
    assert steps[-1] == RESTART_STEPS and len(steps) > RESTART_STEPS  # steps again after a loss
    reference = Trainer(make_cfg(gpt_data, tmp_path / "reference", max_steps=RESTART_STEPS,
                                 grad_clip_norm=0.5, eval_steps=1))
    recorded = RecordedGradients(reference)
    reference.fit()
    model, _ = load_model(str(run))  # any layout's pieces, read back as tfbig-generate does
    ours = {v.path: v.numpy() for v in model.trainable_variables}
    recorded.assert_equal([ours[path] for path in recorded.paths])


def test_elastic_is_refused_with_a_cross_rank_pipeline():
    cfg = ExperimentConfig()
    cfg.train.strategy, cfg.horovod.elastic = "pipeline", True
    with pytest.raises(ValueError, match=r"^--elastic=True has no effect with "
                                         r"--strategy=pipeline; it applies to --strategy=horovod$"):
        check_applicable(cfg)

