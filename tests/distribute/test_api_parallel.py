"""The post's MyModel (examples/own_model.py) through the public API on real multi-process
launches equals one process on the same global batches: each step's loss (rtol 1e-5) and every
trained weight (tests/equality.py's rule, fp32), the sharded runs' pieces joined.

Default run: one `horovodrun -np 2 --gloo` launch (data parallel with activation checkpointing
of the layers the task names and 2 accumulation steps). Slow: tensor parallelism over 2 ranks
with the layout the task declares (own_model.LAYOUT: vocabulary, attention heads and
feed-forward pairs; first-step gradients compared too; alone, x DP2, and x DP2 under ZeRO-3),
ZeRO-3
on 4 ranks over MiCS partition groups of 2 (the task's named layers gathered one at a time),
the tensor-parallel and ZeRO-3 runs also consolidated (tfbig.consolidate_run) to the weights
they report,
context parallelism over 2 ranks with the layers the task declares (own_model.CONTEXT), alone
and x DP2 under ZeRO-3 on 4 ranks, 2 MultiWorkerMirrored workers under tfbig-launch, and
MirroredStrategy over 2 logical CPU devices in one process (one input pipeline whose
consecutive batches go to the replicas).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from equality import GRADIENT_ATOL, GRADIENT_RTOL, RecordedGradients  # noqa: E402
from test_horovod import horovodrun, read  # noqa: E402

import own_model  # noqa: E402

from tfbig.api import configure  # noqa: E402
from tfbig.checkpoints.checkpoint import reader_key  # noqa: E402
from tfbig.training.finetune import LossRecorder  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402
from tfbig.tasks.user_layout import fresh_layer_names
from tfbig.tasks.user_adapter import UserTask
from tfbig.training.trainer import Trainer  # noqa: E402
from tfbig.training.precision import precision_policy

WORKER = os.path.join(HERE, "api_worker.py")
# Clipping at 0.5 is active, so averaging twice or clipping before averaging would show.
STEPS = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
             peak_tflops=1.0, log_every=1, eval_steps=0, grad_clip_norm=0.5)
PARALLEL = {"strategy", "zero_stage", "shard_degree", "tensor_parallel", "context_parallel"}
HOROVOD = {"dp2_recompute_accum2": {"strategy": "horovod", "activation_checkpointing": True,
                                    "grad_accum_steps": 2}}
ZERO3 = {"zero3_mics": {"strategy": "horovod", "zero_stage": 3, "shard_degree": 2}}
MULTIWORKER = {"multiworker": {"strategy": "multiworker"}}
MIRRORED = {"mirrored": {"strategy": "mirrored"}}
# name -> (flags, ranks, data-parallel replicas)
CONTEXT = {"cp2": ({"strategy": "horovod", "context_parallel": 2}, 2, 1),
           # 2 context groups, ZeRO-3 over each context rank's 2 data ranks: the task's named
           # layers gathered one at a time around the context-parallel attention
           "cp2_dp2_zero3": ({"strategy": "horovod", "context_parallel": 2, "zero_stage": 3},
                             4, 2)}
# name -> (flags, ranks, data-parallel replicas)
TENSOR = {"tp2": ({"strategy": "horovod", "tensor_parallel": 2}, 2, 1),
          "tp2_dp2": ({"strategy": "horovod", "tensor_parallel": 2}, 4, 2),
          # each tensor rank's slices sharded over its 2 data ranks, the task's named layers
          # gathered one at a time
          "tp2_dp2_zero3": ({"strategy": "horovod", "tensor_parallel": 2, "zero_stage": 3},
                            4, 2)}


def write_plan(root, scenarios, tensor_layout=None, context_layout=None):
    plan = [{"name": name, "flags": {**STEPS, **flags}, "model_dir": str(root / name),
             "tensor_layout": tensor_layout, "context_layout": context_layout}
            for name, flags in scenarios.items()]
    (root / "plan.json").write_text(json.dumps(plan))
    return root / "plan.json"


def reference(root, flags):
    """One process on the same flags (the parallel ones dropped): (losses, RecordedGradients)."""
    flags = {k: v for k, v in {**STEPS, **flags}.items() if k not in PARALLEL}
    config = configure(model_dir=str(root), **flags)
    task = UserTask(FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                                 name="own_model", checkpoint_layers=("transformer_blocks.*",)))
    with precision_policy(config.train.precision):
        trainer = Trainer(config, task=task, logger=LossRecorder(str(root), True, 4))
        recorded = RecordedGradients(trainer)
        trainer.fit()
    return trainer.logger.losses, recorded


def trained_weights(run_dir):
    """{variable path: array} of the run's newest checkpoint, a ZeRO run's slices joined."""
    from tfbig.layouts import tensor_layout, zero_checkpoint

    with fresh_layer_names():  # the layer names of the run's own build
        model = own_model.model_fn()
    if (run_dir / "tensor.json").exists():  # with ZeRO too: each rank's slices joined first
        return tensor_layout.assembled_weights(str(run_dir), model)
    if (run_dir / "zero.json").exists():
        return zero_checkpoint.assembled_weights(str(run_dir), model)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run_dir)))
    return {v.path: reader.get_tensor(reader_key(model, v)) for v in model.trainable_variables}


def reported_weights(run_dir):
    """{variable path: array} of the trained weights the run reported (api_worker.py)."""
    paths = json.loads((run_dir / "weights.json").read_text())
    with np.load(run_dir / "weights.npz") as saved:
        return dict(zip(paths, (saved[f"arr_{i}"] for i in range(len(paths)))))


def assert_consolidated_equals_reported(run_dir, **task_options):
    """tfbig.consolidate_run of the run: a single-device checkpoint holding, bit for bit, the
    weights the run reported, at its last step."""
    import tfbig

    path = tfbig.consolidate_run(own_model.model_fn, str(run_dir), str(run_dir) + "_single",
                                 name="own_model", **task_options)
    with fresh_layer_names():
        model = own_model.model_fn()
    reader = tf.train.load_checkpoint(path)
    reported = reported_weights(run_dir)
    assert sorted(reported) == sorted(v.path for v in model.trainable_variables)
    for v in model.trainable_variables:
        np.testing.assert_array_equal(reader.get_tensor(reader_key(model, v)), reported[v.path],
                                      err_msg=v.path)
    assert reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == STEPS["max_steps"]


def assert_equals_one_process(root, name, flags, replicas):
    world = json.loads((root / name / "world.json").read_text())
    assert world["num_replicas"] == replicas, world
    losses, recorded = reference(root / f"{name}_one", flags)
    ours = json.loads((root / name / "losses.json").read_text())
    assert len(ours) == 4 and ours[0] != ours[-1]
    np.testing.assert_allclose(ours, losses, rtol=1e-5, err_msg=name)
    weights = trained_weights(root / name)
    assert len(recorded.paths) == 36
    # the names of a model built in another process: the same (tasks.user_layout.fresh_layer_names)
    assert sorted(weights) == sorted(recorded.paths)
    recorded.assert_equal({p: weights[p] for p in recorded.paths}, err_msg=name)
    return recorded


@pytest.mark.slow  # a launch; a user model split by its declared layout equals one process by default in test_layout_map and test_declared_layout, and trains through the API under Horovod (one rank, ZeRO-3) in test_api_consolidate
def test_my_model_on_two_horovod_ranks_equals_one_process(tmp_path):
    code = horovodrun([WORKER, str(write_plan(tmp_path, HOROVOD))], tmp_path / "log.txt")
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    for name, flags in HOROVOD.items():
        assert_equals_one_process(tmp_path, name, flags, replicas=2)


@pytest.mark.slow
def test_my_model_under_zero3_on_four_ranks_equals_one_process(tmp_path):
    code = horovodrun([WORKER, str(write_plan(tmp_path, ZERO3))], tmp_path / "log.txt",
                      ranks=("-np", "4", "-H", "localhost:4"))
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    assert json.loads((tmp_path / "zero3_mics" / "zero.json").read_text())["zero_stage"] == 3
    assert_equals_one_process(tmp_path, "zero3_mics", ZERO3["zero3_mics"], replicas=4)
    assert_consolidated_equals_reported(tmp_path / "zero3_mics",
                                        checkpoint_layers=("transformer_blocks.*",))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONTEXT))
def test_my_model_with_a_declared_context_layout_equals_one_process(tmp_path, name):
    """MyModel's sequences cut over 2 context ranks by the layers its task declares
    (own_model.CONTEXT: its token and position embeddings at each rank's positions, each
    keras MultiHeadAttention over the keys and values gathered from both, the logits gathered
    whole for loss_fn), on 2 ranks and with ZeRO-3 on 4 (2 context groups): each step's loss
    and the trained weights equal one process."""
    flags, ranks, replicas = CONTEXT[name]
    plan = write_plan(tmp_path, {name: flags}, context_layout=own_model.CONTEXT)
    code = horovodrun([WORKER, str(plan)], tmp_path / "log.txt",
                      ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"))
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    assert "context parallel: 2 ranks per sequence of 16" in read(tmp_path / "log.txt")
    assert_equals_one_process(tmp_path, name, flags, replicas=replicas)


@pytest.mark.slow
def test_my_model_on_two_multiworker_workers_equals_one_process(tmp_path):
    plan = write_plan(tmp_path, MULTIWORKER)
    done = subprocess.run([sys.executable, "-m", "tfbig.commands.launch", "--workers=2", "--",
                           sys.executable, WORKER, str(plan)], cwd=ROOT, text=True,
                          capture_output=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert_equals_one_process(tmp_path, "multiworker", MULTIWORKER["multiworker"], replicas=2)


@pytest.mark.slow
def test_my_model_mirrored_over_two_cpu_devices_equals_one_process(tmp_path):
    done = subprocess.run([sys.executable, WORKER, str(write_plan(tmp_path, MIRRORED)), "2"],
                          cwd=ROOT, text=True, capture_output=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert_equals_one_process(tmp_path, "mirrored", MIRRORED["mirrored"], replicas=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TENSOR))
def test_my_model_with_a_declared_layout_under_tensor_parallelism_equals_one_process(
        tmp_path, name):
    """MyModel with its token table and output Dense split over the vocabulary, its attention
    over the heads and its feed-forward Dense pairs column/row (own_model.LAYOUT) over 2 Horovod
    ranks of a tensor group (tp2: one group; tp2_dp2: 2 data-parallel replicas of one on 4
    ranks; tp2_dp2_zero3: each tensor rank's slices sharded over its 2 data ranks): each step's
    loss, each weight's first-step gradient (the ranks' slices joined)
    and the trained weights (joined from the ranks' checkpoints) equal one process; the run
    consolidated (tfbig.consolidate_run) holds the weights it reports."""
    flags, ranks, replicas = TENSOR[name]
    plan = write_plan(tmp_path, {name: flags}, tensor_layout=own_model.LAYOUT)
    code = horovodrun([WORKER, str(plan)], tmp_path / "log.txt",
                      ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"))
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    layout = json.loads((tmp_path / name / "tensor.json").read_text())
    # per block: q, k, v (W, b) and the output W of the heads, the FFN's (W, b; W); the token
    # table; the output Dense (W, b)
    assert layout["tensor_parallel"] == 2 and len(layout["splits"]) == 2 * (7 + 3) + 1 + 2
    recorded = assert_equals_one_process(tmp_path, name, flags, replicas=replicas)
    paths = json.loads((tmp_path / name / "gradients.json").read_text())
    with np.load(tmp_path / name / "gradients.npz") as saved:
        ours = dict(zip(paths, (saved[f"arr_{i}"] for i in range(len(paths)))))
    assert sorted(ours) == sorted(recorded.paths)
    for path, theirs in zip(recorded.paths, recorded.gradients()[0]):
        np.testing.assert_allclose(ours[path], theirs, rtol=GRADIENT_RTOL, atol=GRADIENT_ATOL,
                                   err_msg=path)
    if "zero_stage" not in flags:  # consolidate_run refuses TP x ZeRO (sliced optimizer slots)
        assert_consolidated_equals_reported(tmp_path / name, tensor_layout=own_model.LAYOUT)
