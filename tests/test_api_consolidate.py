"""tfbig.consolidate_run: a sharded run of a user's own model (examples/own_model.py) written as
one single-device checkpoint holding the weights the run itself reports; `python -m
tfbig.training.consolidate`, which cannot build a user's model, refuses such a run naming the API.

Default run: one process under --strategy=horovod --zero_stage=3 (Horovod of one rank, in this
process). Multi-rank runs (ZeRO-3 on 4 ranks over MiCS groups, tensor parallelism with the
declared layout) are consolidated in tests/distribute/test_api_parallel.py (slow)."""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import own_model  # noqa: E402

import tfbig  # noqa: E402
from tfbig.commands import consolidate as consolidate_command  # noqa: E402
from tfbig.checkpoints.checkpoint import reader_key  # noqa: E402
from tfbig.tasks.user_layout import fresh_layer_names  # noqa: E402

BLOCKS = ("transformer_blocks.*",)  # what ZeRO-3 gathers one at a time


def training_only(shard):
    """own_model's batches, no validation split (nothing evaluated: a quicker run)."""
    return own_model.dataset_fn(shard) if shard.training else None


def consolidated_weights(path):
    """{variable path: array} of the trainable weights in single-device checkpoint `path`."""
    with fresh_layer_names():  # the names of the run's own build
        model = own_model.model_fn()
    reader = tf.train.load_checkpoint(path)
    return {v.path: reader.get_tensor(reader_key(model, v)) for v in model.trainable_variables}


def test_a_zero3_run_of_a_user_model_consolidates_to_the_weights_it_reports(tmp_path, capsys):
    run = tfbig.train(own_model.model_fn, own_model.loss_fn, training_only,
                      model_dir=str(tmp_path / "run"), name="own_model",
                      checkpoint_layers=BLOCKS, strategy="horovod", zero_stage=3, max_steps=1,
                      batch_size=8, xla=False, peak_tflops=1.0, log_every=1)
    variables = run.model.trainable_variables
    reported = dict(zip([v.path for v in variables],
                        run.trainer.strategy.gather_full(variables)))
    run.close()
    assert (tmp_path / "run" / "zero.json").exists()
    # the command cannot build the user's model: it names the API, and writes nothing
    assert consolidate_command.main([str(tmp_path / "run"), str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err
    assert "is a run of your own model (task 'own_model', trained with tfbig.train)" in err
    assert "tfbig.consolidate_run(task_or_model_fn, MODEL_DIR, OUT_DIR)" in err
    assert not (tmp_path / "cli").exists()
    with pytest.raises(ValueError, match="was trained as task 'own_model'; the task given is "
                                         "named 'task' \\(give it name='own_model'\\)"):
        tfbig.consolidate_run(own_model.model_fn, str(tmp_path / "run"), str(tmp_path / "x"))
    path = tfbig.consolidate_run(own_model.model_fn, str(tmp_path / "run"),
                                 str(tmp_path / "single"), name="own_model",
                                 checkpoint_layers=BLOCKS)
    weights = consolidated_weights(path)
    assert sorted(weights) == sorted(reported) and len(weights) == 36
    for name, value in reported.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
    assert tf.train.load_checkpoint(path).get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 1
    saved = json.loads((tmp_path / "single" / "config.json").read_text())
    assert saved["model_format"] == "user" and saved["model_config"] == {"task": "own_model"}
    assert saved["train"]["strategy"] == "single" and saved["parallel"]["zero_stage"] == 0
    assert not (tmp_path / "single" / "zero.json").exists()
    # one process resumes the consolidated run where the sharded one stopped
    resumed = tfbig.train(own_model.model_fn, own_model.loss_fn, training_only,
                          model_dir=str(tmp_path / "single"), name="own_model",
                          checkpoint_layers=BLOCKS, max_steps=2, batch_size=8, xla=False,
                          peak_tflops=1.0, log_every=1)
    assert resumed.trainer.restored_from == path and resumed.summary["step"] == 2
    assert len(resumed.losses) == 1
