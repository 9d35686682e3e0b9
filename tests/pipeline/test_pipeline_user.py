"""A user's own Keras model pipelined by the stage cuts its task declares as data
(`Task.pipeline_layers`): examples/own_model.py's MyModel cut between own_model.PIPELINE's
layers, against one process on the same global batches (fp32; clipping at 0.5 active):
each step's loss, the first update's gradient of every weight and the trained weights
(tests/equality.py's rule).

Default run: --strategy=pipeline over 2 logical CPU devices (1F1B, 2 micro-batches; the
validation loss too) and the refusals, each before anything is
written, and the cross-rank pipeline on `horovodrun -np 2` (PP2, 1F1B, stopped after 2 steps
and resumed from its stage checkpoints). Slow: PP2 x DP2 on 4 ranks (GPipe, each stage
recomputed in its backward).
"""
import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "distribute"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from equality import GRADIENT_ATOL, GRADIENT_RTOL, RecordedGradients  # noqa: E402
from test_horovod import horovodrun, load, read  # noqa: E402

from tfbig.layouts.tensor_layout import take_slice  # noqa: E402

import own_model  # noqa: E402

from tfbig.api import _trainer, check_user_flags, configure  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.training.finetune import LossRecorder  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402
from tfbig.tasks.user_adapter import UserTask
from tfbig.training.trainer import Trainer  # noqa: E402

WORKER = os.path.join(HERE, "user_pipeline_worker.py")
STEPS = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
             peak_tflops=1.0, log_every=1, eval_steps=0, grad_clip_norm=0.5)
CROSS_RANK = {  # name: (flags, ranks, data-parallel replicas, interrupt_at)
    "pp2": (dict(strategy="horovod", pipeline_stages=2, num_microbatches=2, schedule="1f1b"),
            2, 1, 2),
    "pp2_dp2": (dict(strategy="horovod", pipeline_stages=2, num_microbatches=2,
                     schedule="gpipe", activation_checkpointing=True), 4, 2, 0),
    # the task's declared tensor_layout (own_model.LAYOUT) split inside each of 2 stages
    "pp2_tp2": (dict(strategy="horovod", pipeline_stages=2, tensor_parallel=2,
                     num_microbatches=2, schedule="1f1b"), 4, 1, 2),
    # each stage's sequences cut over 2 context ranks by the task's context_layout
    "pp2_cp2": (dict(strategy="horovod", pipeline_stages=2, context_parallel=2,
                     num_microbatches=2, schedule="gpipe"), 4, 1, 0),
}


def task(**options):
    return FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        name="own_model", **{"pipeline_layers": own_model.PIPELINE, **options})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process on STEPS (what every pipeline here is compared with): (losses,
    RecordedGradients)."""
    return reference(tmp_path_factory.mktemp("one_process"))


def reference(root):
    """One process on STEPS: (each step's loss, RecordedGradients, validation metrics)."""
    config = configure(model_dir=str(root), **STEPS)
    trainer = Trainer(config, task=UserTask(task()),
                      logger=LossRecorder(str(root), True, STEPS["max_steps"]))
    recorded = RecordedGradients(trainer)
    summary = trainer.fit()
    return trainer.logger.losses, recorded, summary["eval"]


def assert_first_gradients(ours, recorded, name):
    """{path: first-update gradient} of some weights against the reference's."""
    theirs = dict(zip(recorded.paths, recorded.gradients()[0]))
    for path, gradient in ours.items():
        np.testing.assert_allclose(gradient, theirs[path], rtol=GRADIENT_RTOL,
                                   atol=GRADIENT_ATOL, err_msg=f"{name}: gradient of {path}")


def test_my_model_in_two_stages_with_microbatches_equals_one_process(tmp_path, capsys,
                                                                     one_process):
    flags = dict(strategy="pipeline", pipeline_stages=2, num_microbatches=2, schedule="1f1b")
    losses, recorded, evaluation = one_process
    config = configure(model_dir=str(tmp_path / "pipe"), **STEPS, **flags)
    trainer = _trainer(task(), config, recorder=True)
    ours = RecordedGradients(trainer)
    summary = trainer.fit()
    # the validation split through the stages: the task's per-example losses, gathered
    assert summary["eval"]["loss"] == pytest.approx(evaluation["loss"], rel=1e-5)
    plan = capsys.readouterr().out
    assert "embedding_layer..transformer_blocks.0" in plan and "activations unknown" in plan
    devices = {v.value.device[-5:] for v in trainer.model.trainable_variables}
    assert devices == {"CPU:0", "CPU:1"}  # each stage's weights on its own device
    assert len(trainer.logger.losses) == 4 and losses[0] != losses[-1]
    np.testing.assert_allclose(trainer.logger.losses, losses, rtol=1e-5)
    assert_first_gradients(dict(zip(ours.paths, ours.gradients()[0])), recorded, "pipeline")
    recorded.assert_equal([v.numpy() for v in trainer.model.trainable_variables])


def train_refused(tmp_path, options=None, **flags):
    """The UsageError of training a task with `options` under `flags`; nothing written."""
    model_dir = tmp_path / "run"
    with pytest.raises(UsageError) as error:
        config = configure(model_dir=str(model_dir), **{**STEPS, "strategy": "pipeline",
                                                        "num_microbatches": 2, **flags})
        chosen = task(**(options or {}))
        check_user_flags(config, chosen)
        _trainer(chosen, config)
    assert not model_dir.exists()
    return str(error.value)  # (a task declaring none: tests/test_api.py)


class Skipping(own_model.MyModel):
    """MyModel whose forward skips its last block: the declared layers do not compose to it."""

    def call(self, inputs, training=None):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks[0](x, training=training)
        return self.output_layer(x)


def skipping_model():
    model = Skipping(**own_model.SIZE, rate=0.0)
    model(np.zeros((1, own_model.SIZE["maxlen"]), np.int32))
    return model


@pytest.mark.parametrize("options,flags,message", [
    ({"pipeline_layers": ("embedding_layer", "blocks.*", "output_layer")}, {},
     "'blocks.*' names no layer of MyModel (no attribute 'blocks')"),
    ({"pipeline_layers": ("embedding_layer", "transformer_blocks.0", "output_layer")}, {},
     "transformer_block_1/multi_head_attention"),  # a block left out: its weights in none
    ({"pipeline_layers": ("embedding_layer", "transformer_blocks.*", "transformer_blocks.1",
                          "output_layer")}, {}, "belongs to both 'transformer_blocks.1'"),
], ids=["no-such-layer", "weight-in-none", "shared"])
def test_a_pipeline_the_task_does_not_declare_correctly_is_refused(tmp_path, options, flags,
                                                                   message):
    assert message in train_refused(tmp_path, options, **flags)


def test_more_stages_than_declared_layers_are_refused():
    from tfbig.layouts.partition import partition

    specs = UserTask(task()).layer_specs()
    assert [s.name for s in specs] == ["embedding_layer", "transformer_blocks.0",
                                       "transformer_blocks.1", "output_layer"]
    assert specs[0].flops_per_token == 0  # embedding tables: lookups, no matmul FLOPs
    with pytest.raises(ValueError, match="--pipeline_stages=5: the model has 4 layers"):
        partition(specs, 5)


def test_layers_that_do_not_compose_to_the_forward_are_refused(tmp_path):
    options = {"pipeline_layers": own_model.PIPELINE}
    model_dir = tmp_path / "run"
    config = configure(model_dir=str(model_dir), **STEPS, strategy="pipeline",
                       num_microbatches=2)
    chosen = FunctionTask(skipping_model, own_model.loss_fn, own_model.dataset_fn, **options)
    with pytest.raises(UsageError, match="do not give the model's outputs"):
        _trainer(chosen, config)
    assert not model_dir.exists()


class Normalised(own_model.keras.Model):
    """Embedding, BatchNormalization, Dense: the statistics are non-trainable state."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        layers = own_model.layers
        self.embedding = layers.Embedding(own_model.SIZE["vocab_size"], 8)
        self.norm = layers.BatchNormalization()
        self.head = layers.Dense(own_model.SIZE["vocab_size"])

    def call(self, inputs, training=None):
        return self.head(self.norm(self.embedding(inputs), training=training))


def normalised_model():
    model = Normalised()
    model(np.zeros((1, own_model.SIZE["maxlen"]), np.int32))
    return model


def test_a_layer_with_non_trainable_state_is_refused(tmp_path):
    model_dir = tmp_path / "run"
    config = configure(model_dir=str(model_dir), **STEPS, strategy="pipeline",
                       num_microbatches=2)
    chosen = FunctionTask(normalised_model, own_model.loss_fn, own_model.dataset_fn,
                          pipeline_layers=("embedding", "norm", "head"))
    with pytest.raises(UsageError, match="'norm' keeps non-trainable state"):
        _trainer(chosen, config)
    assert not model_dir.exists()


def launch(tmp_path, name):
    flags, ranks, _, interrupt_at = CROSS_RANK[name]

    plan = [{"name": name, "flags": {**STEPS, **flags}, "model_dir": str(tmp_path / name),
             "out": str(tmp_path / "out"), "interrupt_at": interrupt_at}]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code = horovodrun([WORKER, str(tmp_path / "plan.json")], tmp_path / "log.txt",
                      ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"),
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})  # a resume's second mesh
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    return [load(tmp_path / "out", name, rank) for rank in range(ranks)]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [  # a launch each; the default run has a user model in stages
    # in one process (above) and GPT's stages across ranks (test_cross_rank)
    pytest.param("pp2", marks=pytest.mark.slow), pytest.param("pp2_dp2", marks=pytest.mark.slow),
    pytest.param("pp2_tp2", marks=pytest.mark.slow),
    pytest.param("pp2_cp2", marks=pytest.mark.slow)])
def test_my_model_in_stages_on_horovod_ranks_equals_one_process(tmp_path, one_process, name):
    """Each rank holds one stage's weights (placement by the declared layers; with
    --tensor_parallel its tensor rank's slices of the declared layout's; with
    --context_parallel half of each sequence, by the declared context_layout): every step's loss,
    first-update gradients and trained weights equal one process; pp2 and pp2_tp2 stop after
    2 steps and resume from their stage checkpoints."""
    flags, ranks, replicas, interrupt_at = CROSS_RANK[name]
    results = launch(tmp_path, name)
    losses, recorded, evaluation = one_process
    by_stage = {}
    for result in results:
        assert int(result["num_replicas"]) == replicas and int(result["step"]) == 4
        assert int(result["restored_step"]) == (interrupt_at or -1)
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-5, err_msg=name)
        assert float(result["eval_loss"]) == pytest.approx(evaluation["loss"], rel=1e-5)
        paths = [str(p) for p in result["paths"]]
        splits, tensor = json.loads(str(result["splits"])), int(result["tensor"])
        piece = {p: (lambda full, p=p: take_slice(full, *splits[p], tensor, 2) if p in splits
                     else full) for p in paths}  # this tensor rank's slice of a split weight
        theirs = dict(zip(recorded.paths, recorded.gradients()[0]))
        for i, p in enumerate(paths):
            np.testing.assert_allclose(result[f"g{i}"], piece[p](theirs[p]), rtol=GRADIENT_RTOL,
                                       atol=GRADIENT_ATOL, err_msg=f"{name}: gradient of {p}")
            recorded.assert_equal_piece(p, result[f"w{i}"], piece[p],
                                        err_msg=f"{name} stage {int(result['stage'])}")
        assert by_stage.setdefault((int(result["stage"]), tensor), paths) == paths
        if "tensor_parallel" in flags:  # each stage holds a block: its heads, column, row
            assert len(set(splits) & set(paths)) >= 3, name
    held = {p for paths in by_stage.values() for p in paths}
    assert len(held) == sum(map(len, by_stage.values())) // (  # each weight on one stage
        2 if "tensor_parallel" in flags else 1)
    assert sorted(held) == sorted(recorded.paths)
    if interrupt_at:
        assert (tmp_path / name / "pipeline" / "stage-1" / "checkpoint").exists()
