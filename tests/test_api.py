"""The public Task API (tfbig.api, tfbig.tasks.user) in one process: the post's MyModel
(examples/own_model.py) and a functional Keras model train, evaluate and predict through it;
bad input is refused by name before anything is written to the run directory; what a user
task cannot run is refused by flag."""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import own_model  # noqa: E402

import tfbig  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402

# Tiny and quick: no XLA compile, no CPU matmul probe for MFU, a short schedule.
FAST = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
            peak_tflops=1.0, log_every=1, eval_steps=0)


def run_dir_is_untouched(path):
    return not os.path.exists(path) or not os.listdir(path)


def test_my_model_trains_evaluates_and_predicts_through_the_api(tmp_path):
    run = tfbig.train(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                      model_dir=str(tmp_path / "run"), name="own_model",
                      tokens_per_example=16, **FAST)
    assert run.summary["step"] == 4 and len(run.losses) == 4
    assert run.losses[-1] < run.losses[0]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["model_config"] == {"task": "own_model"} and saved["model_format"] == "user"
    # the default metric: each example's loss, gathered, averaged once
    assert set(run.summary["eval"]) == {"loss"} and np.isfinite(run.summary["eval"]["loss"])
    metrics = tfbig.evaluate(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                             model_dir=str(tmp_path / "run"), name="own_model", **FAST)
    assert metrics["loss"] == pytest.approx(run.summary["eval"]["loss"], rel=1e-6)
    outputs = tfbig.predict(own_model.model_fn, own_model.dataset_fn,
                            model_dir=str(tmp_path / "run"), name="own_model", **FAST)
    assert outputs["outputs"].shape == (64, 16, 32)  # every validation example, in order
    inputs = own_model.sequences(64, seed=1)[:, :-1]
    np.testing.assert_allclose(outputs["outputs"][:3], run.model(inputs[:3]).numpy(),
                               rtol=1e-5, atol=1e-5)


class Functional(tfbig.Task):
    """A functional (not subclassed) Keras model: next-token logits with a metric of its own."""

    name = "functional"

    def build_model(self):
        tokens = keras.Input((16,), dtype="int32")
        x = keras.layers.Embedding(32, 16)(tokens)
        x = keras.layers.Dense(32, activation="relu")(x)
        return keras.Model(tokens, keras.layers.Dense(32)(x))

    def dataset(self, shard):
        return own_model.dataset_fn(shard)

    def loss(self, targets, outputs):
        return own_model.loss_fn(targets, outputs)

    def validation_outputs(self, targets, outputs):
        return {"correct": tf.reduce_mean(tf.cast(tf.equal(
            tf.argmax(outputs, -1, output_type=tf.int32), targets), tf.float32), axis=1)}

    def compute_metrics(self, gathered):
        return {"accuracy": float(gathered["correct"].mean()), "rows": len(gathered["correct"])}


def test_a_functional_model_trains_with_its_own_metric(tmp_path):
    config = tfbig.configure(model_dir=str(tmp_path / "run"), grad_accum_steps=2, **FAST)
    run = tfbig.train(Functional(), config)
    assert run.losses[-1] < run.losses[0]
    assert run.summary["eval"]["rows"] == 64 and 0 <= run.summary["eval"]["accuracy"] <= 1
    assert tfbig.evaluate(Functional(), config) == run.summary["eval"]


# ---- bad input: refused by name, nothing written ------------------------------------------------
PREBUILT = own_model.model_fn()


def _bad(**changes):
    functions = dict(model_fn=own_model.model_fn, loss_fn=own_model.loss_fn,
                     dataset_fn=own_model.dataset_fn)
    functions.update(changes)
    return functions


def _flat(shard):
    return own_model.dataset_fn(shard).unbatch().map(lambda x, y: (x[0], y[0]))


@pytest.mark.parametrize("functions, flags, message", [
    (_bad(model_fn=lambda: PREBUILT), {}, "made before it was called, outside the backend's "
                                          "scope"),
    (_bad(model_fn=lambda: own_model.MyModel(**own_model.SIZE)), {}, "without variables"),
    (_bad(loss_fn=lambda t, o: keras.losses.sparse_categorical_crossentropy(t, o, True)), {},
     "loss returned shape (4, 16) as its loss; it must be a scalar"),
    (_bad(loss_fn=lambda t, o: tf.reduce_sum(t)), {}, "loss returned a int32 tensor as its loss"),
    # (loss, {name: scalar}): more figures of the batch to log, each a float scalar
    (_bad(loss_fn=lambda t, o: (own_model.loss_fn(t, o), {"hits": tf.reduce_sum(t)})), {},
     "loss returned a int32 tensor as its metric 'hits'"),
    (_bad(loss_fn=lambda t, o: (own_model.loss_fn(t, o), {"loss": own_model.loss_fn(t, o)})),
     {}, "returned the metric name 'loss'; expected a string other than 'loss'"),
    (_bad(loss_fn=lambda t, o: (own_model.loss_fn(t, o),) * 3), {},
     "loss returned a tuple of 3; expected the loss, or (loss, {name: scalar})"),
    (_bad(dataset_fn=_flat), {}, "has no batch dimension"),
    (_bad(dataset_fn=lambda shard: own_model.dataset_fn(shard).rebatch(3)), {},
     "gave batches of [3] rows to replica 0 of 1; expected shard.batch_size=8"),
    (_bad(), {"batch_size": 7}, "--batch_size=7 must be a positive multiple"),
    (_bad(), {"activation_checkpointing": True, "checkpoint_layers": ("blocks.*",)},
     "'blocks.*' names no layer of MyModel (no attribute 'blocks')"),
    (_bad(), {"activation_checkpointing": True}, "names no layers to recompute"),
    # a tensor_layout is checked against the built model under every backend
    (_bad(), {"tensor_layout": {"my_model/transformer_block/no_such_dense": "column"}},
     "tensor_layout['my_model/transformer_block/no_such_dense']: names no weight of MyModel; "
     "the layers it could split are my_model/dense_4, my_model/token_and_position_embedding/"
     "embedding"),
    (_bad(), {"tensor_layout": {"transformer_blocks.*.fnn.layers.0": "column"}},
     "'transformer_blocks.*.fnn.layers.0' names no layer of MyModel (no attribute 'fnn')"),
    # a kind on a layer it does not split (more: tests/distribute/test_declared_layout.py)
    (_bad(), {"tensor_layout": {"transformer_blocks.0.att": "column"}},
     "= 'column': 'my_model/transformer_block/multi_head_attention' (MultiHeadAttention) is "
     "split by 'heads'; 'column' splits Dense layers"),
    (_bad(), {"tensor_layout": {"*/query": "heads"}}, "names 'my_model/transformer_block/"
     "multi_head_attention/query/kernel', not the weights of a keras.layers.Dense, "
     "MultiHeadAttention or Embedding"),
    (_bad(), {"tensor_layout": {**own_model.LAYOUT, "transformer_blocks.0.ffn.layers.0": "row"}},
     "'my_model/transformer_block/sequential/dense' is declared both 'column' and 'row'"),
    (_bad(), {"tensor_layout": {"output_layer": "rows"}},
     "tensor_layout['output_layer'] = 'rows': the kinds are 'column' and 'row' (a Dense), "
     "'heads' (a MultiHeadAttention) and 'vocab'"),
])
def test_bad_input_is_refused_by_name_before_the_run_directory_is_written(
        tmp_path, functions, flags, message):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as error:
        tfbig.train(functions["model_fn"], functions["loss_fn"], functions["dataset_fn"],
                    model_dir=str(run_dir), **{**FAST, "grad_accum_steps": 2, **flags})
    assert message in str(error.value)
    assert run_dir_is_untouched(run_dir)


@pytest.mark.parametrize("flags, message", [
    ({"strategy": "horovod", "tensor_parallel": 2}, "--tensor_parallel=2 is refused for a user "
                                                    "task: tensor parallelism"),
    ({"strategy": "pipeline"}, "--strategy=pipeline: pipeline stages"),
    ({"strategy": "horovod", "pipeline_stages": 2}, "--pipeline_stages=2 is refused"),
    ({"plan_only": True, "strategy": "horovod", "context_parallel": 2},
     "--context_parallel=2 with --plan_only is refused for a user task: context parallelism "
     "changes the activations and the step time, which the plan derives only from the task's "
     "transformer_shape"),
    ({"plan_only": True, "transformer_shape": {"hidden_size": 32, "num_layers": 2}},
     "transformer_shape {'hidden_size': 32, 'num_layers': 2}: missing num_heads, seq_length, "
     "vocab_size"),
    ({"init_checkpoint": "runs/x"}, "--init_checkpoint='runs/x' is refused"),
    ({"strategy": "horovod", "context_parallel": 2}, "--context_parallel=2 is refused for a "
     "user task: context parallelism cuts the layers a task declares in its context_layout"),
    ({"no_such_flag": 1}, "no_such_flag=1: not a tfbig-train flag"),
    # with a declared layout --tensor_parallel runs (tests/distribute/test_api_parallel.py),
    # but not these with it
    ({"strategy": "horovod", "tensor_parallel": 2, "sequence_parallel": True,
      "tensor_layout": own_model.LAYOUT}, "--sequence_parallel=True with --tensor_parallel=2 "
                                          "is refused for a user task"),
])
def test_what_a_user_task_cannot_run_is_refused_by_flag(tmp_path, flags, message):
    with pytest.raises(UsageError, match=None) as error:
        tfbig.train(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                    model_dir=str(tmp_path / "run"), **flags)
    assert message in str(error.value)
    assert run_dir_is_untouched(tmp_path / "run")


@pytest.mark.slow
def test_kill_9_and_resume_of_an_api_run_gives_bit_identical_weights(tmp_path):
    """examples/own_model.py (tfbig.train) killed after a random checkpointed step and started
    again ends with the uninterrupted run's weights and validation loss, bit for bit."""
    from kill_and_resume import assert_killed_and_rerun_equals_uninterrupted

    def command(out):
        return [sys.executable, "-m", "examples.own_model", f"--model_dir={out}",
                "--max_steps=8", "--checkpoint_every=1", "--log_every=1", "--deterministic",
                "--noxla", "--peak_tflops=1", "--batch_size=8"]

    assert_killed_and_rerun_equals_uninterrupted(command, tmp_path, 8, ["eval_results.json"])


# ---- --plan_only -----------------------------------------------------------------------------
def plan_device():
    """A fixed device for plans (no CPU probe): 1 TFLOP/s, 64 GB, 50 GB/s."""
    from tfbig.plan import hardware

    return hardware.Device("cpu", 1e12, 64e9, 50e9, 50e9, matmul_fraction=1.0,
                           reserve_bytes=0.0)


def test_plan_only_counts_the_built_models_state_and_says_what_is_unknown(tmp_path, capsys):
    """--plan_only trains nothing and writes nothing; the weights, gradients and optimizer
    slots per rank are 4 bytes per value the built model and tfbig's optimizer hold, sharded as
    each ZeRO stage shards them; activations and step time are named unknown."""
    from tfbig import api, optim

    found = tfbig.train(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        model_dir=str(tmp_path / "run"), plan_only=True, batch_size=8,
                        peak_tflops=1.0)  # no CPU matmul probe
    assert "unknown: activations, step time" in capsys.readouterr().out
    assert found.unknown == ("activations", "step time") and found.estimate is None
    assert run_dir_is_untouched(tmp_path / "run")
    model = own_model.model_fn()
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    slots = sum(int(np.prod(v.shape)) for v in optim.build_optimizer(
        tfbig.configure().train, model.trainable_variables).variables if len(v.shape))
    assert found.parameters == weights and slots == 2 * weights
    assert found.memory == {"parameters": 4 * weights, "gradients": 4 * weights,
                            "optimizer": 4 * slots}
    task = api._task(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn, {})
    for stage, sharded in ((1, {"optimizer"}), (2, {"optimizer", "gradients"}),
                           (3, {"optimizer", "gradients", "parameters"})):
        config = tfbig.configure(plan_only=True, batch_size=8, zero_stage=stage)
        memory = api.plan(task, config, plan_device(), world_size=4).memory
        for kind in ("parameters", "gradients"):
            assert memory[kind] == 4 * weights / (4 if kind in sharded else 1), (stage, kind)
        # ZeRO 1-2 keep a float32 master copy of the rank's slice beside its two slots
        assert memory["optimizer"] == 4 * (slots + (weights if stage < 3 else 0)) / 4


class DeclaredGPT(tfbig.Task):
    """tfbig's own GPT as a user model, its transformer_shape declared."""

    name = "gpt"  # the plan's header names the task: as tfbig-train's names the family
    transformer_shape = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=128,
                             vocab_size=8000)  # the "tiny" preset

    def build_model(self):
        from tfbig.models.configs import GPTConfig
        from tfbig.models.gpt import GPT

        model = GPT(GPTConfig.from_preset("tiny"))
        model.build((None, 128))
        return model


def test_a_declared_transformer_shape_plans_as_tfbigs_own_gpt_of_that_shape():
    """The plan of a user task declaring the tiny GPT's shape is tfbig-train --plan_only's of
    --model=gpt --preset=tiny, figure for figure, on 2 ranks with ZeRO 1 (its parameter
    count, counted on the built model, is the closed form's)."""
    from tfbig import api
    from tfbig.training.local_plan import training_plan

    flags = dict(plan_only=True, batch_size=8, zero_stage=1)
    found = api.plan(DeclaredGPT(), tfbig.configure(**flags), plan_device(), world_size=2)
    own = training_plan(tfbig.configure(model="gpt", preset="tiny", **flags), plan_device(),
                        world_size=2)
    assert found.unknown == () and "note:" not in found.text
    assert found.text.endswith("\n" + own)
    assert "activations" in found.memory and found.estimate.step_seconds > 0
