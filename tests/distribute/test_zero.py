"""ZeRO stages 1-3 with MiCS partition groups (`--zero_stage`, `--shard_degree`) through one real
`horovodrun -np 4 --gloo` launch, against the single-device run on the same global batch.

Scenarios (tests/distribute/horovod_worker.py plans; HOROVOD_DYNAMIC_PROCESS_SETS=1 lets one
process build several rank grids): stage 1, 2 and 3 at shard degree 2 (2 partition groups of 2,
the 2-hop sync) and 4 (one group, plain ZeRO), with accumulation and clipping active, AdamW and
LAMB, ALBERT (with LAMB under stage 3), bf16 and an untied GPT under stage 3, per-variable
gradients of the first batch, resumes from the per-slice checkpoints, and an fp16 step made
non-finite on one rank only (then trained as the single-device mixed run). A slow launch of its
own runs fp16/bf16 under stages 1-2 against plain Horovod of the same precision (the default
run keeps fp16 under plain Horovod and tensor parallelism), GPT at stage 3, degree 2 in fp32
and fp16, and BERT under stage 3 (SLOW_SCENARIOS).
"""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import (ALBERT, BERT, ROOT, WORKER, horovodrun, listed,  # noqa: E402
                          load, read, run_entry)
from test_trainer import ReplicasTask, make_cfg, weights  # noqa: E402

from horovod_worker import PoisonedTask, RecordingLogger, UntiedTask  # noqa: E402
from equality import RecordedGradients  # noqa: E402
from tfbig import config as config_lib  # noqa: E402
from tfbig.config import ParallelConfig  # noqa: E402
from tfbig.commands.consolidate import main as consolidate_main  # noqa: E402
from tfbig.distribute.horovod import build_mesh  # noqa: E402
from tfbig.optim import loss_scale  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

RANKS = 4
LAUNCH_TIMEOUT = 1800  # ten runs of 4 ranks on 2 shared cores: minutes when the machine is busy
# Clipping at 0.5 is active at every step; 2 micro-batches of 2 sequences per rank.
TRAIN = dict(max_steps=4, batch_size=16, grad_clip_norm=0.5, dropout=0.0, grad_accum_steps=2)
LAMB = dict(optimizer="lamb", learning_rate=1e-2, weight_decay=0.01, epsilon=1e-6)
FP16, BF16 = {"precision": "mixed_float16"}, {"precision": "mixed_bfloat16"}
SCENARIOS = {  # name: (zero_stage, shard_degree, data, train options, worker options)
    # stage 3: parameters sharded too, gathered per layer (tfbig/distribute/zero3.py)
    "z3_d4_lamb_resumed": (3, 4, "gpt_data", LAMB, {"first_gradients": True,
                                                    "interrupt_at": 2}),
}
# The default launch keeps one case of stage 3 (degree 4, LAMB, a resume from the slices);
# stage 1 runs by default under PP x ZeRO-1 (test_cross_rank's pp2_dp2_zero1, its slot bytes
# against the whole stage's too). The slow launch: stage 2 at degree 4 with LAMB, stage 1
# at degree 2 (2 partition groups: the 2-hop sync) and with a resume, stage 3 at degree 2 in
# fp32 and fp16, ALBERT under stages 2 and 3, BERT under stage 3, bf16.
SLOW_SCENARIOS = {"z2_d4_lamb": (2, 4, "gpt_data", LAMB, {}),
                  "z1_d2": (1, 2, "gpt_data", {}, {}),
                  # ALBERT's shared block with LAMB: the trust ratio's norms over all slices
                  "z3_d2_albert_lamb": (3, 2, "albert_data", {**ALBERT, **LAMB},
                                        {"first_gradients": True}),
                  "z3_d2": (3, 2, "gpt_data", {}, {"first_gradients": True}),
                  # fp16 on stage 3 (the skip is the same code for stages 2 and 3:
                  # all_reduce_gradients); the default run skips a poisoned fp16 step under
                  # plain Horovod (test_horovod) and tensor parallelism (test_tensor_parallel)
                  "z3_d2_fp16_skip": (3, 2, "gpt_data", {"precision": "mixed_float16"},
                                      {"poison_rank": 3}),
                  # bf16 compute on stage 3, and a GPT with its own output projection
                  # (tie_embeddings off); the default run has bf16 in test_trainer
                  "z3_d4_bf16_untied": (3, 4, "gpt_data", {"precision": "mixed_bfloat16"},
                                        {"first_gradients": True, "untied": True}),
                  "z2_d2_albert": (2, 2, "albert_data", ALBERT, {}),
                  "z1_d4_resumed": (1, 4, "gpt_data", {}, {"interrupt_at": 2}),
                  # --async_checkpoint=on: each rank's slices written beside training (a
                  # save at every step; the resume reads the pieces of step 2)
                  "z3_d2_async_resumed": (3, 2, "gpt_data", {"async_checkpoint": "on",
                                                             "checkpoint_every": 1},
                                          {"interrupt_at": 2}),
                  # BERT: a gather per block (one per layer), its word table per step (tied
                  # to the MLM head)
                  "z3_d2_bert": (3, 2, "bert_data", BERT, {"first_gradients": True}),
}
# A launch of its own (slow): Llama (RMSNorm, RoPE, SwiGLU, 4 query / 2 key-value heads) under
# MiCS: 2 partition groups of 2 ranks, stage 2 and stage 3 (a gather per block), resumed
LLAMA_SCENARIOS = {"llama_z2_d2": (2, 2, "gpt_data", {"model": "llama"}, {}),
                   "llama_z3_d2_resumed": (3, 2, "gpt_data", {"model": "llama"},
                                           {"first_gradients": True, "interrupt_at": 2})}
OWN_TESTS = ("z3_d2_fp16_skip",)  # trained as the single-device mixed run: tests of its own
SLOW = [pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SCENARIOS
        if name not in OWN_TESTS]
SLOW_STAGE_3 = [pytest.param(name, marks=pytest.mark.slow) for name, scenario
                in SLOW_SCENARIOS.items() if scenario[0] == 3 and name not in OWN_TESTS]
EQUAL_TO_ONE_DEVICE = ["z3_d4_lamb_resumed"] + SLOW + [
    pytest.param(name, marks=pytest.mark.slow) for name in LLAMA_SCENARIOS]
# Tolerances against the single-device run: fp32 tight; bf16 compute rounds the activations
# of a micro-batch of 2 (here) vs 8 (single device) sequences and sums the gradients in a
# different order, each to 8 bits of mantissa: (losses rtol, weights and gradients atol).
TOLERANCE = {"z3_d4_bf16_untied": (1e-2, 1e-2)}


def zero_cfg(data_dir, model_dir, stage, degree, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **train})
    cfg.parallel.zero_stage, cfg.parallel.shard_degree = stage, degree
    return cfg


def launch(root, scenarios, data):
    """One `horovodrun -np 4` running `scenarios` (as SCENARIOS); data: {name: directory}."""
    out = root / "out"
    plan = [run_entry(name, zero_cfg(data[d], root / name, stage, degree, **train), out, **opts)
            for name, (stage, degree, d, train, opts) in scenarios.items()]
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    command = ["-np", str(RANKS), "-H", f"localhost:{RANKS}"]
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt",
                      timeout=LAUNCH_TIMEOUT, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=command)
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("zero"), SCENARIOS,
                  {"gpt_data": gpt_data, "albert_data": albert_data, "bert_data": bert_data})


@pytest.fixture(scope="module")
def llama_runs(gpt_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("zero_llama"), LLAMA_SCENARIOS, {"gpt_data": gpt_data})


def launch_of(request, scenario):
    """(root, out) of the launch that ran `scenario` (the default, the slow or Llama's)."""
    return request.getfixturevalue("slow_runs" if scenario in SLOW_SCENARIOS else
                                   "llama_runs" if scenario in LLAMA_SCENARIOS else "runs")


def reference(data_dir, model_dir, task=None, **train):
    """The single-device run on the examples the 4 ranks read together, and the averaged
    gradients of its first batch. task: a task class (default: the config's)."""
    cfg = make_cfg(data_dir, model_dir, **{**TRAIN, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    inner = task(cfg.train) if task else get_task(cfg.train, cfg)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, RANKS, inner), logger=logger)
    trainer.initial = weights(trainer)
    _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
    trainer.recorded = RecordedGradients(trainer)
    trainer.fit()
    return (trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)]),
            [g.numpy() for g in grads])


def shared_reference(shared, tmp_path_factory, data_dir, task=None, **train):
    """`reference`, run once per session for equal arguments: the stages and shard degrees
    of one optimizer and model all compare against the same single-device run (it does not
    depend on them). Read-only."""
    key = ("zero", data_dir, task and task.__name__, json.dumps(train, sort_keys=True))
    return shared(key, lambda: reference(data_dir, tmp_path_factory.mktemp("reference"),
                                         task=task, **train))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EQUAL_TO_ONE_DEVICE)
def test_sharded_ranks_equal_one_process_on_the_same_data(request, shared, tmp_path_factory,
                                                          name):
    _, out = launch_of(request, name)
    _, _, data, train, opts = {**SCENARIOS, **SLOW_SCENARIOS, **LLAMA_SCENARIOS}[name]
    ranks = [load(out, name, r) for r in range(RANKS)]
    single, losses, grads = shared_reference(
        shared, tmp_path_factory, request.getfixturevalue(data),
        task=UntiedTask if opts.get("untied") else None, **train)
    loss_rtol, atol = TOLERANCE.get(name, (1e-5, None))
    first = ranks[0]
    if opts.get("untied"):  # the output projection (hidden, vocab) is a variable of its own
        assert [w.shape for w in single.model.trainable_variables if "head" in w.path] == [
            (single.task.model_config.hidden_size, single.task.model_config.vocab_size)]
    if opts.get("first_gradients"):  # per variable, gathered from the reduce-scattered slices
        assert len(listed(first, "gradients")) == len(grads)
        for ours, theirs in zip(listed(first, "gradients"), grads):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=atol or 1e-7)
    assert len(listed(first, "initial")) == len(single.initial)
    for ours, theirs in zip(listed(first, "initial"), single.initial):
        np.testing.assert_array_equal(ours, theirs)  # the same initialisation, bit for bit
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    np.testing.assert_allclose(first["losses"], losses, rtol=loss_rtol)
    # the global norm is over all slices: it equals the single device's
    assert first["step"] == TRAIN["max_steps"]
    if atol is None:  # float32: tests/equality.py's rule
        single.recorded.assert_equal(listed(first, "w"), err_msg=name)
    else:
        for ours, theirs in zip(listed(first, "w"), weights(single)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=atol)
    for other in ranks[1:]:  # every rank gathers the same full parameters
        for a, b in zip(listed(first, "w"), listed(other, "w")):
            np.testing.assert_array_equal(a, b)
    if name.endswith("_resumed"):
        assert int(first["restored_step"]) == 2


@pytest.mark.multiproc
@pytest.mark.slow  # the slow launch's stages 1 and 2 (PP x ZeRO-1's slot bytes: default)
@pytest.mark.parametrize("name", ["z2_d4_lamb", "z1_d2"])
def test_per_rank_model_state_is_the_closed_form(request, name):
    _, out = launch_of(request, name)
    degree = {**SCENARIOS, **SLOW_SCENARIOS}[name][1]
    for r in range(RANKS):
        result = load(out, name, r)
        sizes = [w.size for w in listed(result, "w")]
        params = sum(sizes)
        slices = sum(math.ceil(n / degree) for n in sizes)  # each variable padded to N slices
        assert int(result["bytes_parameters"]) == 4 * params
        assert int(result["bytes_master_slices"]) == 4 * slices
        assert int(result["bytes_optimizer_slots"]) == 8 * slices  # m and v of this slice
        assert slices * degree < params + degree * len(sizes)  # padding < one element a slice


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z3_d4_lamb_resumed"] + SLOW_STAGE_3)
def test_stage_3_ranks_hold_only_their_slices(request, name):
    """(4 + 4 + 8) P / N: float32 parameter slices, gradient slices (transient, of the same
    size: not a variable) and m, v; the model's own variables hold no value at all."""
    _, out = launch_of(request, name)
    degree = {**SCENARIOS, **SLOW_SCENARIOS}[name][1]
    for r in range(RANKS):
        result = load(out, name, r)
        sizes = [w.size for w in listed(result, "w")]
        slices = sum(math.ceil(n / degree) for n in sizes)
        assert int(result["bytes_parameters"]) == 0
        assert int(result["bytes_master_slices"]) == 4 * slices  # the parameters themselves
        assert int(result["bytes_optimizer_slots"]) == 8 * slices
        assert 12 * slices < 12 * sum(sizes) / degree + 12 * len(sizes)


@pytest.mark.slow  # the slow launch's stage 2
@pytest.mark.multiproc
def test_slice_checkpoints_are_written_by_their_owners(slow_runs):
    root, _ = slow_runs
    model_dir = root / "z2_d4_lamb"
    assert json.loads((model_dir / "zero.json").read_text()) == {
        "zero_stage": 2, "shard_degree": 4, "data": 4, "world_size": 4}
    for j in range(1, 4):
        assert (model_dir / "zero" / f"shard-{j}" / "checkpoint").exists()


@pytest.mark.slow  # the slow launch's degree-2 run
@pytest.mark.multiproc
def test_a_replica_partition_group_writes_no_slices(slow_runs):
    root, _ = slow_runs
    # degree 2: the second partition group (ranks 2, 3) is a replica and writes nothing
    assert sorted(p.name for p in (root / "z1_d2" / "zero").iterdir()) == ["shard-1"]


def check_the_poisoned_step_is_skipped_on_all(out, name):
    ranks = [load(out, name, r) for r in range(RANKS)]
    for result in ranks:
        assert int(result["nonfinite_steps"]) == 1
        assert float(result["scale_after_poison"]) == float(ranks[0]["scale_after_poison"])
        for before, after in zip(listed(result, "initial"), listed(result, "after_poison")):
            np.testing.assert_array_equal(before, after)  # the poisoned step changed nothing
    for a, b in zip(listed(ranks[0], "w"), listed(ranks[3], "w")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_non_finite_slice_on_one_rank_skips_the_step_on_all(slow_runs):
    check_the_poisoned_step_is_skipped_on_all(slow_runs[1], "z3_d2_fp16_skip")


@pytest.mark.slow
@pytest.mark.multiproc
def test_fp16_stage_3_trains_as_the_single_device_mixed_run(slow_runs, gpt_data, tmp_path):
    """mixed_float16 with dynamic loss scaling, stage 3 at degree 2: the poisoned first step
    (skipped everywhere) and the 3 steps after it follow the single-device mixed run on the
    same batches, poisoned alike. fp16 activations of 2 vs 8 sequences per micro-batch and
    another summation order: losses within rtol 1e-3, weights within atol 2e-3 (measured:
    losses inside 1e-3, one weight of 4096 off by 1.1e-3, the rest inside 1e-3)."""
    _, out = slow_runs
    ours = load(out, "z3_d2_fp16_skip", 0)
    cfg = make_cfg(gpt_data, tmp_path, **{**TRAIN, **SLOW_SCENARIOS["z3_d2_fp16_skip"][3]})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    task = PoisonedTask(cfg.train)
    single = Trainer(cfg, task=ReplicasTask(cfg.train, RANKS, task), logger=logger)
    task.poison.assign(float("inf"))
    single.fit(steps=1)
    assert float(loss_scale(single.optimizer)) == float(ours["scale_after_poison"])
    task.poison.assign(1.0)
    single.fit()
    assert int(single.nonfinite_steps.numpy()) == int(ours["nonfinite_steps"]) == 1
    losses = np.array([logger.losses[s][0] for s in sorted(logger.losses)])
    assert not np.isfinite(losses[0]) and np.all(np.isfinite(losses[1:]))
    np.testing.assert_allclose(ours["losses"], losses, rtol=1e-3)
    for a, b in zip(listed(ours, "w"), weights(single)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-3)
    # it trained: the weights moved more than twice the tolerance they are compared at
    assert np.abs(listed(ours, "w")[0] - listed(ours, "initial")[0]).max() > 2 * 2e-3


# ---- mixed precision under stages 1-2: equal to plain Horovod of the same precision ------
MIXED_SLOW = {  # a launch of its own (slow), as SCENARIOS
    "hvd_fp16_skip": (0, 0, "gpt_data", FP16, {"poison_rank": 3}),
    "z2_d2_fp16_skip": (2, 2, "gpt_data", FP16, {"poison_rank": 3}),
    "hvd_bf16": (0, 0, "gpt_data", BF16, {}),
    "z1_d4_bf16": (1, 4, "gpt_data", BF16, {}),
    "z2_d2_bf16": (2, 2, "gpt_data", BF16, {}),
    "z1_d4_fp16_skip": (1, 4, "gpt_data", FP16, {"poison_rank": 3}),
}
MIXED = {"z2_d2_fp16_skip": "hvd_fp16_skip",  # sharded run: its unsharded Horovod run
         "z1_d4_fp16_skip": "hvd_fp16_skip", "z1_d4_bf16": "hvd_bf16", "z2_d2_bf16": "hvd_bf16"}
# Both runs compute bit-identical local gradients from identical weights; they differ only in
# how the gradients are summed (reduce-scatter in the partition group + all-reduce across
# groups vs one all-reduce; stage 2 also averages each micro-batch before summing them) and
# in the clipping norm (summed over slices): float32 rounding, which fp16/bf16 activations
# then carry on. (losses rtol, weights atol); measured: the losses of all 4 steps equal to the
# last bit, the weights within 1.2e-7 (fp16), 6e-8 (bf16, stage 2), 7.5e-9 (bf16, stage 1).
MIXED_TOLERANCE = {"mixed_float16": (1e-6, 1e-6), "mixed_bfloat16": (1e-6, 1e-6)}


@pytest.fixture(scope="module")
def slow_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("slow"), {**MIXED_SLOW, **SLOW_SCENARIOS},
                  {"gpt_data": gpt_data, "albert_data": albert_data, "bert_data": bert_data})


def check_sharded_mixed_equals_unsharded(ours, theirs):
    """ZeRO run `ours` vs plain Horovod run `theirs` of the same precision (rank results)."""
    precision = ours[0]["precision"]
    loss_rtol, atol = MIXED_TOLERANCE[str(precision)]
    for mine, ref in zip(ours, theirs):
        assert int(mine["step"]) == int(ref["step"]) == TRAIN["max_steps"]
        # the loss scale of every step and the skipped steps: exactly the unsharded run's
        np.testing.assert_array_equal(mine["loss_scales"], ref["loss_scales"])
        assert int(mine["nonfinite_steps"]) == int(ref["nonfinite_steps"])
        assert float(mine["loss_scale"]) == float(ref["loss_scale"])
        np.testing.assert_array_equal(np.isfinite(mine["losses"]), np.isfinite(ref["losses"]))
        finite = np.isfinite(ref["losses"])
        np.testing.assert_allclose(mine["losses"][finite], ref["losses"][finite], rtol=loss_rtol)
        for a, b in zip(listed(mine, "initial"), listed(ref, "initial")):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(listed(mine, "w"), listed(ref, "w")):
            np.testing.assert_allclose(a, b, rtol=0, atol=atol)
        for a, b in zip(listed(mine, "w"), listed(ours[0], "w")):  # every rank the same
            np.testing.assert_array_equal(a, b)
    moved = max(np.abs(a - b).max() for a, b in zip(listed(ours[0], "w"),
                                                   listed(ours[0], "initial")))
    assert moved > 100 * atol  # it trained: far more than the tolerance


@pytest.mark.slow
@pytest.mark.multiproc
def test_fp16_stage_2_equals_unsharded_horovod_fp16(slow_runs):
    """mixed_float16, stage 2 at degree 2, rank 3's first step non-finite: the same skip
    on every rank, the same loss scale trajectory and (within float32 rounding) weights as
    plain Horovod."""
    _, out = slow_runs
    check_the_poisoned_step_is_skipped_on_all(out, "z2_d2_fp16_skip")
    ours = [load(out, "z2_d2_fp16_skip", r) for r in range(RANKS)]
    theirs = [load(out, "hvd_fp16_skip", r) for r in range(RANKS)]
    assert float(ours[0]["loss_scales"][1]) == float(ours[0]["loss_scales"][0]) / 2
    check_sharded_mixed_equals_unsharded(ours, theirs)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z1_d4_fp16_skip", "z1_d4_bf16", "z2_d2_bf16"])
def test_mixed_precision_stages_1_2_equal_unsharded_horovod(slow_runs, name):
    _, out = slow_runs
    ours = [load(out, name, r) for r in range(RANKS)]
    theirs = [load(out, MIXED[name], r) for r in range(RANKS)]
    check_sharded_mixed_equals_unsharded(ours, theirs)


@pytest.mark.parametrize("options, world, message", [
    (dict(zero_stage=5), 4, "--zero_stage=5: expected 0 (no sharding), 1"),
    (dict(zero_stage=1, shard_degree=3), 4, "--shard_degree=3 does not divide the 4"),
    (dict(shard_degree=2), 4, "--shard_degree=2 needs --zero_stage=1, 2 or 3"),
])
def test_bad_sharding_flags_are_refused_before_training(options, world, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_mesh(ParallelConfig(**options), world)


# ---- re-sharding on load and consolidation ------------------------------------------------
RESUMED = dict(LAMB, max_steps=6)  # two more steps after the 4 of the source run
RESHARD = {  # name: (source scenario of the 4-rank launch, zero_stage, shard_degree, ranks)
    "z3_d4_to_1_process": ("z3_d4_lamb_resumed", 3, 1, 1),
    "z3_d4_to_z3_d2": ("z3_d4_lamb_resumed", 3, 2, 2),
    "z2_d4_to_z1_d2": ("z2_d4_lamb", 1, 2, 2),
}


def resume_elsewhere(request, gpt_data, root, ranks):
    """Copies of the source runs' directories resumed on `ranks` processes (1: a plain
    process, Horovod's world of one)."""
    out = root / "out"
    plan = []
    for name, (source, stage, degree, n) in RESHARD.items():
        if n == ranks:
            shutil.copytree(launch_of(request, source)[0] / source, root / name)
            plan.append(run_entry(name, zero_cfg(gpt_data, root / name, stage, degree,
                                                 **RESUMED), out))
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    if ranks == 1:
        env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
        with open(root / "log.txt", "w") as log:
            code = subprocess.run([sys.executable, WORKER, str(root / "plan.json")], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
    else:
        code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt",
                          ranks=["-np", str(ranks), "-H", f"localhost:{ranks}"])
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def on_one_process(request, gpt_data, tmp_path_factory):
    return resume_elsewhere(request, gpt_data, tmp_path_factory.mktemp("one"), 1)


@pytest.fixture(scope="module")
def on_two_ranks(request, gpt_data, tmp_path_factory):
    return resume_elsewhere(request, gpt_data, tmp_path_factory.mktemp("two"), 2)


def single_device(data_dir, model_dir, replicas, **train):
    """A single-device trainer in `model_dir` (restored) reading what `replicas` ranks read."""
    cfg = make_cfg(data_dir, model_dir, **{**TRAIN, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    task = get_task(cfg.train, cfg)
    return Trainer(cfg, task=ReplicasTask(cfg.train, replicas, task) if replicas > 1 else task,
                   logger=logger)


def consolidate(model_dir, out_dir):
    assert consolidate_main([str(model_dir), str(out_dir)]) == 0
    assert not (out_dir / "zero.json").exists()


def check_resumed(request, resumed, gpt_data, tmp_path, name):
    source, _, _, replicas = RESHARD[name]
    source_root, source_out = launch_of(request, source)
    root, out = resumed
    final = listed(load(source_out, source, 0), "w")
    ranks = [load(out, name, r) for r in range(replicas)]
    for result in ranks:  # re-sharded on load: the source's final weights, bit for bit
        for ours, theirs in zip(listed(result, "initial"), final):
            np.testing.assert_array_equal(ours, theirs)
    # the single-device run resumed from the consolidated source continues the same way
    consolidate(source_root / source, tmp_path / "source")
    reference = single_device(gpt_data, tmp_path / "source", replicas, **RESUMED)
    assert int(reference.step.numpy()) == 4
    for ours, theirs in zip(weights(reference), final):
        np.testing.assert_array_equal(ours, theirs)
    recorded = RecordedGradients(reference)
    reference.fit()
    losses = [reference.logger.losses[s][0] for s in sorted(reference.logger.losses)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5)
    assert list(ranks[0]["loss_steps"]) == [5, 6]
    recorded.assert_equal(listed(ranks[0], "w"), err_msg=name)
    # and so does the optimizer state (consolidated from the re-sharded run's slices)
    consolidate(root / name, tmp_path / "resumed")
    mine = single_device(gpt_data, tmp_path / "resumed", 1, **RESUMED)
    assert int(mine.step.numpy()) == 6
    assert len(mine.optimizer.variables) == len(reference.optimizer.variables)
    for ours, theirs in zip(mine.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a process of its own after the launch; a stage-3 checkpoint is read by one process by default in test_generate_reads_a_stage_3_checkpoint and test_export_reads_a_stage_3_checkpoint
@pytest.mark.multiproc
def test_a_4_rank_stage_3_checkpoint_resumes_on_1_process(request, on_one_process, gpt_data,
                                                           tmp_path):
    check_resumed(request, on_one_process, gpt_data, tmp_path, "z3_d4_to_1_process")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z3_d4_to_z3_d2", "z2_d4_to_z1_d2"])
def test_a_4_rank_checkpoint_resumes_on_2_ranks(request, on_two_ranks, gpt_data, tmp_path, name):
    check_resumed(request, on_two_ranks, gpt_data, tmp_path, name)


@pytest.mark.multiproc
def test_generate_reads_a_stage_3_checkpoint(runs):
    from tfbig.convert.run_dir import load_model

    root, out = runs
    model, _ = load_model(str(root / "z3_d4_lamb_resumed"))
    for ours, theirs in zip(weights_of(model), listed(load(out, "z3_d4_lamb_resumed", 0), "w")):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["z3_d4_lamb_resumed",
                                  pytest.param("z3_d4_bf16_untied", marks=pytest.mark.slow)])
def test_export_reads_a_stage_3_checkpoint(request, tmp_path, name):
    """tfbig-export straight from the per-rank slices (no consolidation first): the SavedModel
    computes the logits of the model built from the run's final weights (tied, and untied in
    the slow launch)."""
    import tensorflow as tf

    from tfbig.commands.export import export
    from tfbig.convert.run_dir import load_model

    root, out = launch_of(request, name)
    model, _ = load_model(str(root / name))
    final = listed(load(out, name, 0), "w")
    for ours, theirs in zip(weights_of(model), final):
        np.testing.assert_array_equal(ours, theirs)
    loaded = tf.saved_model.load(export(str(root / name), str(tmp_path / "saved")))
    ids = tf.constant([[1, 5, 9, 2, 7]], tf.int32)
    logits = loaded.signatures["serving_default"](token_ids=ids)["logits"]
    np.testing.assert_allclose(logits, model(ids, training=False), rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_a_run_without_zero_refuses_a_zero_directory(runs, gpt_data, tmp_path):
    root, _ = runs
    shutil.copytree(root / "z3_d4_lamb_resumed", tmp_path / "run")
    with pytest.raises(ValueError, match=r"holds a --zero_stage checkpoint \(its zero.json\): "
                                         r"resume it with --strategy=horovod"):
        Trainer(make_cfg(gpt_data, tmp_path / "run", **TRAIN))


def weights_of(model):
    return [v.numpy() for v in model.trainable_variables]


def test_consolidation_refuses_a_run_without_slices(tmp_path, capsys):
    assert consolidate_main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "has none of tensor.json, pipeline.json, zero.json: it is not a sharded run" in \
        capsys.readouterr().err
    assert consolidate_main([str(tmp_path)]) == 2


def test_stage_3_refuses_a_model_without_a_gather_plan():
    import keras

    from tfbig.distribute import zero3

    with pytest.raises(ValueError, match="--zero_stage=3: no gather plan for Sequential"):
        zero3.plan_layers(keras.Sequential([keras.layers.Dense(2)]))


# ---- delayed initialisation: no rank ever holds the whole model ---------------------------
WIDE = dict(hidden_size=1024, num_layers=8, num_heads=8, max_steps=1)  # 100M parameters


@pytest.mark.slow
@pytest.mark.multiproc
def test_stage_3_ranks_never_hold_the_whole_model(gpt_data, tmp_path):
    """Peak resident memory of each stage-3 rank after building the trainer (model, slices,
    optimizer) stays well below the 16 P bytes one process needs for the full state and below
    what one plain process reaches building the same trainer; what the build added is its
    12 S bytes of slices and moments plus one variable's initial value (a materialised fp32
    model would add 4 P more)."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_memory_worker.py")
    single = make_cfg(gpt_data, tmp_path / "single", **WIDE)
    sharded = zero_cfg(gpt_data, tmp_path / "sharded", 3, 4, **WIDE)
    for name, cfg in (("single", single), ("sharded", sharded)):
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump(config_lib.to_dict(cfg), f)
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, worker, str(tmp_path / "single.json"),
                    str(tmp_path / "single")], env=env, check=True, timeout=600)
    code = horovodrun([worker, str(tmp_path / "sharded.json"), str(tmp_path / "sharded")],
                      tmp_path / "log.txt", ranks=["-np", "4", "-H", "localhost:4"])
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    one = json.loads((tmp_path / "single.rank0.json").read_text())
    full_state = 16 * one["params"]
    assert one["params"] > 100e6
    for r in range(4):
        rank = json.loads((tmp_path / f"sharded.rank{r}.json").read_text())
        held = sum(rank["state"].values())
        assert rank["state"]["parameters"] == 0 and held < 0.2 * full_state
        assert rank["peak_rss"] < 0.8 * full_state, (rank, full_state)
        assert rank["peak_rss"] < 0.8 * one["peak_rss"], (rank, one)
        # a materialised fp32 model would add 4 P beside the slices; half of that is the line
        assert rank["peak_rss"] - rank["peak_rss_before"] < held + 2 * one["params"], rank
