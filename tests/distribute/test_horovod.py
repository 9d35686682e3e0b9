"""--strategy=horovod through real `horovodrun -np 2 --gloo` launches, against the single-device
reference on the same data.

One launch (module fixture `runs`) trains every scenario of a plan in tests/distribute/
horovod_worker.py; each rank saves its weights, optimizer state and losses. The reference is
the single-device trainer reading, per step, exactly the examples both ranks read together
(`ReplicasTask`). A slow launch runs --init_checkpoint, ALBERT, BERT,
--activation_checkpointing, the float16 allreduce, the compiled update, a time budget and the
user-style script horovod_post_style.py; the kill test (slow) has a launch of its own.
Every launch is bounded by a timeout.
"""
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equality import RecordedGradients  # noqa: E402
from test_trainer import ReplicasTask, make_cfg, weights  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.convert import init_checkpoint  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "horovod_worker.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")
TIMEOUT = 1200  # a launch takes ~1 min idle; 8 when other jobs load the 2 cores

# Clipping at 0.5 is active (the averaged gradient norm is above it at every step), so
# averaging twice, summing, or clipping before averaging would all change the weights.
# eval_steps=0: the whole validation split (217 GPT records: the last global batch padded)
EQUIVALENCE = dict(max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0, eval_steps=0)
# ALBERT (MLM + SOP, LAMB as its recipe) on the same loop; shards of seq_length 32.
ALBERT = dict(model="albert", seq_length=32, optimizer="lamb", learning_rate=1e-2,
              weight_decay=0.01, epsilon=1e-6)
# BERT (MLM + NSP, AdamW) on the same loop; shards of seq_length 32 (conftest's bert_data).
BERT = dict(model="bert", seq_length=32, learning_rate=1e-2, weight_decay=0.01, epsilon=1e-6)
# From a converted GPT-2 (conftest's gpt2_bpe): its config.json is the architecture, so the
# size flags of make_cfg go back to their defaults.
INIT = dict(preset="small", num_layers=0, hidden_size=0, num_heads=0)



def rank_threads(num_ranks):
    """TensorFlow's thread pools for one of `num_ranks` CPU ranks on this host, as
    launch/horovod_local.sh sets them: the cores shared out, one inter-op thread (by default
    every rank sizes its pools to all cores: 4 ranks on 2 cores ran 4x the threads the cores
    hold). Values already in the environment win."""
    threads = str(max(1, (os.cpu_count() or 1) // num_ranks))
    wanted = {"TF_NUM_INTRAOP_THREADS": threads, "TF_NUM_INTEROP_THREADS": "1",
              "OMP_NUM_THREADS": threads}
    return {k: v for k, v in wanted.items() if k not in os.environ}


def horovodrun(args, log_path, timeout=TIMEOUT, env=None, wait=True,
               ranks=("-np", "2", "-H", "localhost:2")):
    """`horovodrun -np 2 -H localhost:2 --gloo python ARGS` (or `ranks`), output to `log_path`."""
    command = [HOROVODRUN, *ranks, "--gloo", sys.executable, *args]
    num_ranks = int(ranks[list(ranks).index("-np") + 1])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}", "TF_CPP_MIN_LOG_LEVEL": "2",
           **rank_threads(num_ranks), **(env or {})}
    log = open(log_path, "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    if not wait:
        return proc
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def run_plan(root, plan, ranks, timeout=1800):
    """WORKER over `plan` (run_entry dicts) on `ranks` localhost processes with dynamic
    process sets, ROOT/plan.json and ROOT/log.txt beside; asserts it exited cleanly."""
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=timeout,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"))
    assert code == 0, read(root / "log.txt")[-6000:]


def read(path):
    with open(path) as f:
        return f.read()


def load(out, name, rank):
    with np.load(os.path.join(out, f"{name}.rank{rank}.npz")) as data:
        return {key: data[key] for key in data.files}


def listed(result, prefix):
    return [result[f"{prefix}{i}"] for i in range(sum(k[len(prefix):].isdigit() and
                                                       k.startswith(prefix) for k in result))]


def run_entry(name, cfg, out, **options):
    return {"name": name, "config": config_lib.to_dict(cfg), "out": str(out), **options}


def horovod_cfg(gpt_data, model_dir, scale_lr=False, hvd_fp16_allreduce=False, **train):
    cfg = make_cfg(gpt_data, model_dir, strategy="horovod", **{**EQUIVALENCE, **train})
    cfg.horovod.scale_lr = scale_lr
    cfg.horovod.hvd_fp16_allreduce = hvd_fp16_allreduce
    return cfg


def recompute_cfg(cfg):
    """`cfg` with every transformer block recomputed in the backward (the reference is not)."""
    cfg.pipeline.activation_checkpointing = True
    return cfg


class Runs:
    """The results of the shared launch: `runs[name]` is (rank 0, rank 1) result dicts."""

    def __init__(self, root, out, output):
        self.root, self.out, self.output = root, out, output

    def __getitem__(self, name):
        return load(self.out, name, 0), load(self.out, name, 1)


@pytest.fixture(scope="module")
def runs(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("horovod")
    out = root / "out"
    plan = [
        run_entry("plain", horovod_cfg(gpt_data, root / "plain"), out, per_rank_model_dir=True),
        run_entry("accum", horovod_cfg(gpt_data, root / "accum", grad_accum_steps=2), out,
                  timeline=str(root / "accum_timeline.json")),
        run_entry("resumed", horovod_cfg(gpt_data, root / "resumed"), out, interrupt_at=2,
                  per_rank_model_dir=True),
        run_entry("fp16_skip", horovod_cfg(gpt_data, root / "fp16skip", scale_lr=True,
                                           precision="mixed_float16"), out, poison_rank=1,
                  seed_by_rank=True),
        run_entry("preempted", horovod_cfg(gpt_data, root / "preempted", max_steps=6), out,
                  sigterm={"rank": 1, "step": 2}),
    ]
    return launch(root, plan, env={"HOROVOD_TIMELINE": "DYNAMIC"})


# A launch of their own (slow). Horovod averages whatever gradients the task and model give,
# so the default run keeps BERT fine-tuning on 2 ranks (test_classify, test_bert_squad),
# and recompute's checkpointed blocks (base Strategy.build_model, as on one device:
# test_recompute's GPT cases) feed the allreduce "accum" checks. Also slow: the float16
# allreduce, the compiled update (test_compiled_step has a Horovod case of its own), the time
# budget's step count across ranks and the user-style script (test_api_parallel trains a user
# model on 2 Horovod ranks).
SLOW = ["init", "albert", "bert", "recompute", "fp16_skip_compiled", "fp16_allreduce",
        "compiled", "budget", "post"]


@pytest.fixture(scope="module")
def slow_runs(gpt2_bpe, gpt_data, albert_data, bert_data, tmp_path_factory):
    """A launch of its own (slow): --init_checkpoint from a converted GPT-2, ALBERT, BERT,
    --activation_checkpointing, and SLOW's GPT scenarios."""
    root = tmp_path_factory.mktemp("horovod_slow")
    out = root / "out"
    return launch(root, [
        {"post_style": [gpt_data, str(root / "post"), str(out)]},
        run_entry("plain", horovod_cfg(gpt_data, root / "plain"), out),  # the reference
        run_entry("fp16_allreduce", horovod_cfg(gpt_data, root / "fp16ar",
                                                hvd_fp16_allreduce=True), out),
        # --xla: the update after the allreduce is one XLA program (tfbig.training.step)
        run_entry("compiled", horovod_cfg(gpt_data, root / "compiled", xla=True), out),
        run_entry("budget", horovod_cfg(gpt_data, root / "budget", max_steps=0,
                                        time_budget_minutes=5.0, warmup_steps=10), out, steps=10),
        run_entry("init", horovod_cfg(gpt2_bpe["data"], root / "init",
                                      init_checkpoint=gpt2_bpe["run"], **INIT), out),
        run_entry("albert", horovod_cfg(albert_data, root / "albert", **ALBERT), out),
        run_entry("bert", horovod_cfg(bert_data, root / "bert", **BERT), out),
        run_entry("recompute", recompute_cfg(horovod_cfg(gpt_data, root / "recompute",
                                                         grad_accum_steps=2)), out),
        run_entry("fp16_skip_compiled", horovod_cfg(
            gpt_data, root / "fp16skipxla", scale_lr=True, precision="mixed_float16", xla=True),
            out, poison_rank=1, seed_by_rank=True)])


def launch(root, plan, env=None):
    """One 2-rank launch of horovod_worker.py running `plan`'s scenarios."""
    out = root / "out"
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", env=env)
    output = read(root / "log.txt")
    assert code == 0, output[-6000:]
    return Runs(root, out, output)


def reference(data_dir, model_dir, **train):
    """The single-device run on the examples both ranks read together; (trainer, losses)."""
    cfg = make_cfg(data_dir, model_dir, **{**EQUIVALENCE, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    inner = get_task(*init_checkpoint.task_inputs(cfg.train, cfg))
    init_checkpoint.apply(inner, cfg)  # --init_checkpoint's architecture for the wrapped task
    task = ReplicasTask(cfg.train, 2, inner)
    trainer = Trainer(cfg, task=task, logger=logger)
    trainer.recorded = RecordedGradients(trainer)
    trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)])


def shared_reference(shared, tmp_path_factory, data_dir, **train):
    """`reference`, run once per session for equal arguments (e.g. "accum" and "recompute"
    both compare against one device accumulating 2 micro-batches). Read-only."""
    key = ("horovod", data_dir, json.dumps(train, sort_keys=True))
    return shared(key, lambda: reference(data_dir, tmp_path_factory.mktemp("reference"),
                                         **train))


def timeline_counts(path):
    """{(tensor name, activity): times begun} from a Horovod timeline (written by rank 0)."""
    text = read(path).rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    return collections.Counter((names.get(e["pid"]), e["name"]) for e in events
                               if e.get("ph") == "B")


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["plain", "accum", "resumed", "fp16_skip", "preempted"] + [
    pytest.param(name, marks=pytest.mark.slow) for name in SLOW])
def test_ranks_end_with_bit_identical_weights_and_optimizer_state(request, name):
    first, second = request.getfixturevalue("slow_runs" if name in SLOW else "runs")[name]
    assert first["num_replicas"] == 2 and first["step"] == second["step"] > 0
    keys = [k for k in first if k[0] in "wo" and k[1:].isdigit()]
    assert len(keys) > 20
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    np.testing.assert_array_equal(first["losses"], second["losses"])


@pytest.mark.multiproc
@pytest.mark.parametrize("name,data,train", [pytest.param("plain", "gpt_data", {},
                                                          marks=pytest.mark.slow),
                                             ("accum", "gpt_data", {"grad_accum_steps": 2}),
                                             # the compiled update against one device's
                                             # forward/backward compiled, update op by op
                                             pytest.param("compiled", "gpt_data",
                                                          {"xla": True, "compile_update": False},
                                                          marks=pytest.mark.slow),
                                             # checkpointed ranks vs a plain single device
                                             pytest.param("recompute", "gpt_data",
                                                          {"grad_accum_steps": 2},
                                                          marks=pytest.mark.slow),
                                             pytest.param("albert", "albert_data", ALBERT,
                                                          marks=pytest.mark.slow),
                                             pytest.param("bert", "bert_data", BERT,
                                                          marks=pytest.mark.slow),
                                             # rank 0 loads --init_checkpoint, rank 1 gets it
                                             # through the broadcast
                                             pytest.param("init", "gpt2_bpe", INIT,
                                                          marks=pytest.mark.slow)])
def test_two_ranks_equal_one_process_on_the_same_data(request, shared, tmp_path_factory, name,
                                                      data, train):
    first, _ = request.getfixturevalue("slow_runs" if name in SLOW else "runs")[name]
    data = request.getfixturevalue(data)
    if name == "init":
        data, train = data["data"], {**train, "init_checkpoint": data["run"]}
    single, losses = shared_reference(shared, tmp_path_factory, data, **train)
    assert np.all(first["grad_norms"] > EQUIVALENCE["grad_clip_norm"])  # clipping is active
    assert len(losses) == len(first["losses"]) == EQUIVALENCE["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    reference_weights = weights(single)
    assert len(reference_weights) == len(listed(first, "w"))
    # The key bias's gradient is zero in exact arithmetic (softmax ignores a per-row shift):
    # Adam may turn its float noise into steps of either sign (tests/equality.py).
    for path, ours in zip(single.recorded.paths, listed(first, "w")):
        if name == "init" and ours.shape == (3 * 24,):  # the converted GPT-2's qkv bias: the
            # O(0.1) weights of the converted model leave its key third more gradient noise
            # than GRADIENT_ATOL (1.8e-4 apart seen), so it is left out; the losses cover it
            single.recorded.assert_equal_piece(
                path, np.delete(ours, np.s_[24:48]), lambda full: np.delete(full, np.s_[24:48]))
        else:
            single.recorded.assert_equal_piece(path, ours, err_msg=name)
    # each rank evaluated its share of the split, gathered in order: one process's figures
    assert float(first["eval_loss"]) == pytest.approx(single.evaluate()["loss"], rel=1e-5)


@pytest.mark.multiproc
def test_one_gradient_allreduce_per_optimizer_step(runs):
    first, _ = runs["accum"]
    num_grads = len(listed(first, "w"))
    counts = timeline_counts(runs.root / "accum_timeline.json")
    # One grouped allreduce names its n tensors "..._{i}of{n}": the gradients plus the
    # stop-request flag that travels with them.
    group = num_grads + 1
    grads = {name: n for (name, activity), n in counts.items()
             if activity == "NEGOTIATE_ALLREDUCE" and name.endswith(f"of{group}")}
    assert len(grads) == group
    # 4 optimizer steps of 2 micro-batches each: 4 allreduces per gradient, not 8.
    assert set(grads.values()) == {EQUIVALENCE["max_steps"]}, grads


@pytest.mark.multiproc
def test_only_rank_0_writes_files(runs):
    # "plain" gave each rank its own --model_dir, as on hosts with local disks.
    rank0, rank1 = runs.root / "plain" / "rank0", runs.root / "plain" / "rank1"
    assert not rank1.exists() or not any(rank1.iterdir()), list(rank1.rglob("*"))
    written = {p.name for p in rank0.iterdir()}
    assert {"config.json", "checkpoint", "ckpt-4.index"} <= written, written
    assert list(rank0.rglob("events.out.tfevents.*"))
    assert "[0]<stdout>:[" in runs.output and "[1]<stdout>:[" not in runs.output  # progress


@pytest.mark.slow  # a launch of its own
@pytest.mark.multiproc
def test_a_time_budget_gives_every_rank_the_same_step_count(slow_runs):
    # Each rank times its own steps; the count comes from the slowest figures of all ranks.
    runs = slow_runs
    ranks = runs["budget"]
    with open(runs.root / "budget" / "config.json") as f:
        record = json.load(f)["budget"]
    assert ranks[0]["max_steps"] == ranks[1]["max_steps"] == record["max_steps"] > 10
    assert ranks[0]["step"] == ranks[1]["step"] == 10


def test_scale_lr_multiplies_the_learning_rate_by_the_number_of_processes(runs):
    scaled, _ = runs["fp16_skip"]  # --scale_lr, and the learning rate schedule of "plain"
    plain, _ = runs["plain"]
    assert plain["learning_rates"][1] > 0
    np.testing.assert_allclose(scaled["learning_rates"], 2 * plain["learning_rates"], rtol=1e-6)


@pytest.mark.multiproc
def test_resume_under_horovod_continues_the_run_from_rank_0s_local_disk(runs):
    # Each rank has its own --model_dir, so rank 1 finds no checkpoint: it must take the step,
    # input position and weights rank 0 restored, or the ranks would read and run apart.
    resumed, other = runs["resumed"]
    assert not os.path.exists(runs.root / "resumed" / "rank1" / "checkpoint")
    straight, _ = runs["plain"]  # the same config, uninterrupted
    assert int(resumed["restored_step"]) == int(other["restored_step"]) == 2
    assert resumed["step"] == straight["step"] == EQUIVALENCE["max_steps"]
    np.testing.assert_allclose(resumed["losses"], straight["losses"], rtol=1e-6)
    for ours, theirs in zip(listed(resumed, "w"), listed(straight, "w")):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-8)
    assert int(other["step"]) == EQUIVALENCE["max_steps"]
    np.testing.assert_array_equal(resumed["losses"], other["losses"])
    assert os.path.exists(runs.root / "resumed" / "rank0" / "ckpt-4.index")


@pytest.mark.slow  # a launch of its own
@pytest.mark.multiproc
def test_fp16_allreduce_sends_float16_and_stays_close(slow_runs):
    compressed, _ = slow_runs["fp16_allreduce"]
    plain, _ = slow_runs["plain"]
    pairs = list(zip(listed(compressed, "w"), listed(plain, "w")))
    assert any(not np.array_equal(a, b) for a, b in pairs)  # float16 rounding changed them
    np.testing.assert_allclose(compressed["losses"], plain["losses"], rtol=1e-3)
    for a, b in pairs:
        # Float16 rounding can flip the sign of a near-zero gradient, and Adam turns that into up
        # to a whole step (lr 3e-3) on that entry: on the examples of the global data order
        # (tfbig.data.order) one entry of 4096 ended 1.3e-3 apart, in another launch one of
        # 10240 5.1e-4. So: every entry within the 4 steps' reach, all but 0.1% (at least one)
        # within a sixth of one step.
        diff = np.abs(a - b)
        assert diff.max() <= EQUIVALENCE["max_steps"] * 3e-3, diff.max()
        assert np.count_nonzero(diff > 5e-4) <= max(1, diff.size // 1000), np.sort(diff.ravel())[-5:]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fp16_skip", pytest.param("fp16_skip_compiled",
                                                            marks=pytest.mark.slow)])
def test_non_finite_fp16_step_on_one_rank_is_skipped_on_every_rank(request, name):
    runs = request.getfixturevalue("slow_runs" if name in SLOW else "runs")
    for result in runs[name]:  # rank 1's loss was inf in step 1, rank 0's finite
        for initial, after in zip(listed(result, "initial"), listed(result, "after_poison")):
            np.testing.assert_array_equal(initial, after)  # the update was skipped
        assert int(result["nonfinite_steps"]) == 1
        assert float(result["scale_after_poison"]) == 2.0 ** 14  # halved from 2 ** 15
        assert int(result["step"]) == 4 and np.isfinite(result["losses"][-1])
        assert any(not np.array_equal(a, b) for a, b in
                   zip(listed(result, "initial"), listed(result, "w")))  # later steps trained


@pytest.mark.multiproc
def test_trainer_broadcasts_rank_0_state_to_differently_seeded_ranks(runs):
    seeded = runs["fp16_skip"]  # rank r used seed r; the broadcast gave both rank 0's weights
    plain, _ = runs["plain"]  # seed 0 on both ranks
    for rank0, rank1, seed0 in zip(listed(seeded[0], "initial"), listed(seeded[1], "initial"),
                                   listed(plain, "initial")):
        np.testing.assert_array_equal(rank0, rank1)
        np.testing.assert_array_equal(rank1, seed0)
    assert any(not np.array_equal(a, b) for a, b in
               zip(listed(seeded[0], "initial"), listed(seeded[0], "w")))


@pytest.mark.multiproc
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(runs):
    first, second = runs["preempted"]  # rank 1 alone got SIGTERM while logging step 2
    assert bool(first["preempted"]) and bool(second["preempted"])
    # The request travels with step 3's gradient allreduce; both stop after step 3.
    assert int(first["step"]) == int(second["step"]) == 3
    assert os.path.exists(runs.root / "preempted" / "ckpt-3.index")


@pytest.mark.multiproc
def test_horovod_background_threads_do_not_preempt_compute_on_cpu(runs):
    # --hvd_thread_policy=auto and no GPU: Horovod's background loop and Gloo's threads run
    # SCHED_BATCH (their 1 ms negotiation cycles wait for a free core instead of preempting
    # the step), while the threads that train stay under the normal policy.
    for result in runs["plain"]:
        assert len(result["background_policies"]) >= 2  # Horovod's loop, Gloo's device thread
        assert set(result["background_policies"].tolist()) == {os.SCHED_BATCH}
        assert int(result["main_policy"]) == os.SCHED_OTHER


def test_thread_policy_batch_applies_to_the_given_threads_and_normal_leaves_them():
    from tfbig.distribute import horovod_keras

    ready, release, seen = threading.Event(), threading.Event(), {}

    def idle():
        seen["tid"] = threading.get_native_id()
        ready.set()
        release.wait(30)

    thread = threading.Thread(target=idle)
    thread.start()
    try:
        ready.wait(30)
        tid = seen["tid"]
        assert horovod_keras.set_thread_policy({tid}, "normal") == "normal"
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert horovod_keras.set_thread_policy({tid}, "batch") == "batch"
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # only the given thread
        with pytest.raises(ValueError, match="--hvd_thread_policy='fifo'"):
            horovod_keras.set_thread_policy({tid}, "fifo")
    finally:
        release.set()
        thread.join()


@pytest.mark.slow  # a launch of its own
@pytest.mark.multiproc
def test_post_style_script_with_the_keras3_helper(slow_runs):
    runs = slow_runs
    first, second = runs["post"]
    initial = list(zip(listed(first, "initial"), listed(second, "initial")))
    assert any(not np.array_equal(a, b) for a, b in initial)  # seeded differently per rank
    for key in first:
        if key[0] in "wo" and key[1:].isdigit():  # equal after the broadcast
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert first["losses"][-1] < first["losses"][0] - 0.2
    assert os.path.exists(runs.root / "post" / "ckpt-1.index")  # rank 0's checkpoint


def launch_local(flags, log_path, wait=True):
    """launch/horovod_local.sh 2 FLAGS: tfbig-train --strategy=horovod on 2 CPU processes."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    log = open(log_path, "w")
    proc = subprocess.Popen([os.path.join(ROOT, "launch", "horovod_local.sh"), "2", *flags],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            start_new_session=True)
    if wait:
        try:
            proc.wait(timeout=TIMEOUT)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return proc


def cli_flags(gpt_data, model_dir, **train):
    values = {**dict(data_dir=gpt_data, model_dir=model_dir, preset="tiny", num_layers=2,
                     hidden_size=32, num_heads=4, seq_length=16, batch_size=8, log_every=1,
                     eval_steps=1, sample_tokens=0, xla=False), **train}
    return [f"--{k}={v}" for k, v in values.items()]


@pytest.mark.slow
@pytest.mark.multiproc
def test_tfbig_train_under_the_local_launch_script(gpt_data, tmp_path):
    model_dir = tmp_path / "run"
    proc = launch_local(cli_flags(gpt_data, model_dir, max_steps=3, scale_lr=True,
                                  hvd_fp16_allreduce=True), tmp_path / "log.txt")
    output = read(tmp_path / "log.txt")
    assert proc.returncode == 0, output[-5000:]
    assert "horovodrun -np 2 -H localhost:2 --gloo tfbig-train --strategy=horovod" in output
    assert "[0]<stdout>:checkpoint:" in output and "[1]<stdout>" not in output
    assert os.path.exists(model_dir / "ckpt-3.index")
    with open(model_dir / "config.json") as f:
        saved = json.load(f)
    assert saved["train"]["strategy"] == "horovod" and saved["horovod"]["scale_lr"] is True


def horovod_rank_pid(rank, marker):
    """The Python process of Horovod rank `rank` whose command line contains `marker`."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            if (any(marker in part for part in proc.info["cmdline"] or [])
                    and "python" in os.path.basename(proc.info["cmdline"][0])
                    and proc.environ().get("HOROVOD_RANK") == str(rank)):
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.slow  # ~30 s; a death ending the job: test_multiworker's dead worker, the supervisor's tests
@pytest.mark.multiproc
def test_killing_one_rank_fails_the_job_fast(gpt_data, tmp_path):
    model_dir = str(tmp_path / "run")
    log = tmp_path / "log.txt"
    proc = launch_local(cli_flags(gpt_data, model_dir, max_steps=100000,
                                  checkpoint_every=100000), log, wait=False)
    try:
        wait_for(lambda: "step 3/" in read(log), 240, "training to start", proc)
        victim = horovod_rank_pid(1, model_dir)
        assert victim, "rank 1 not found"
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=60)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = read(log)
    assert proc.returncode != 0, output[-3000:]
    assert "Process name: 1" in output and "Exit code: 137" in output, output[-3000:]
    assert seconds < 60


def wait_for(predicate, timeout, what, proc):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def dry_run(script, *args):
    proc = subprocess.run([os.path.join(ROOT, "launch", script), *args], cwd=ROOT,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=30)
    return proc.returncode, proc.stderr


def test_launch_scripts_count_processes_from_hosts():
    code, output = dry_run("horovod_multihost.sh", "launch/hostfile.example", "--preset=tiny")
    assert code == 0, output
    assert ("+ horovodrun -np 16 -hostfile launch/hostfile.example --gloo tfbig-train "
            "--strategy=horovod --preset=tiny") in output
    code, output = dry_run("mpirun.sh", "node1:2,node2:4", "--preset=tiny")
    assert code == 0 and "+ mpirun -np 6 -H node1:2,node2:4 -bind-to none" in output, output
    assert output.rstrip().endswith("tfbig-train --strategy=horovod --preset=tiny")
    code, output = dry_run("mpirun.sh", "launch/hostfile.example")
    assert code == 0 and "-np 16 -hostfile launch/hostfile.example" in output, output
    code, output = dry_run("horovod_multihost.sh", "no/such/hostfile")
    assert code == 2 and "no/such/hostfile not found" in output
