"""Activation checkpointing / offloading (tfbig.distribute.recompute) against the plain model
(GPT and an MoE Llama; BERT and ALBERT in the slow run): same loss and per-variable gradients
(fp32, rtol 1e-5) with dropout active, inside the XLA-compiled forward/backward (the MoE's
outside XLA); offloaded block inputs are placed on the host."""
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_trainer import make_cfg  # noqa: E402

from tfbig import config as config_lib  # noqa: E402
from tfbig.distribute import recompute  # noqa: E402
from tfbig.distribute.base import SingleDevice, accumulate_gradients  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402


def build(cfg):
    keras.utils.set_random_seed(0)
    task = get_task(cfg.train, cfg)
    return task, SingleDevice(cfg).build_model(task)


def batch_of(task, cfg, accum=2):
    data = task.dataset("train", cfg.train.batch_size // accum, shuffle=False)
    return next(iter(data.batch(accum, drop_remainder=True)))


def forward_backward(task, model, batch, jit_compile=True):
    variables = model.trainable_variables
    fn = tf.function(lambda b: accumulate_gradients(
        lambda m, training: task.loss(model, m, training=training), variables, b,
        lambda loss: loss), jit_compile=jit_compile)
    states = [v.numpy() for v in model.non_trainable_variables]
    loss, grads, _ = fn(batch)
    after = [v.numpy() for v in model.non_trainable_variables]
    for v, s in zip(model.non_trainable_variables, states):  # the next call starts the same
        v.assign(s)
    return fn, float(loss), [g.numpy() for g in grads], after


# BERT's and ALBERT's cases compile two models each (slow); BERT's recompute stays in the
# default run inside the tensor-parallel and cross-rank pipeline launches.
# gpt-blockwise: blockwise attention's dropout masks come from the same seed states, so the
# recompute draws them again too.
@pytest.mark.parametrize("model,offload", [
    # recompute with the checkpointed activations offloaded to the host; without (slow)
    ("gpt", True), pytest.param("gpt", False, marks=pytest.mark.slow),
    # blockwise attention's own backward under recompute (its gradients against dense are
    # checked by default in tests/models/test_attention.py)
    pytest.param("gpt-blockwise", False, marks=pytest.mark.slow),
    pytest.param("bert", False, marks=pytest.mark.slow),
    pytest.param("albert", False, marks=pytest.mark.slow),
    # an MoE Llama: its blocks also return the router's statistics, whose losses reach the
    # router's gradient through the recompute; outside XLA (the experts' groups vary)
    ("moe", False)])
def test_gradients_equal_the_plain_model(gpt_data, albert_data, bert_data, tmp_path, model,
                                         offload):
    model, _, attention = model.partition("-")
    data = {"gpt": gpt_data, "albert": albert_data, "bert": bert_data, "moe": gpt_data}[model]
    extra = dict(seq_length=32, preset="tiny") if model not in ("gpt", "moe") else {}
    if attention:
        extra.update(attention=attention, attention_block_size=8)
    if model == "moe":
        model, extra = "llama", dict(preset="tiny-moe", num_layers=0, hidden_size=0,
                                     num_heads=0, xla=False)
    cfg = make_cfg(data, tmp_path, **{"model": model, "dropout": 0.1, "xla": True, **extra})
    if model == "albert":
        cfg.albert.num_groups = 1  # one shared block called num_layers times
    task, plain = build(cfg)
    batch = batch_of(task, cfg)
    _, loss, grads, states = forward_backward(task, plain, batch, cfg.train.xla)
    cfg.pipeline.activation_checkpointing, cfg.pipeline.offload_activations = True, offload
    task, ckpt = build(cfg)
    assert len(recompute.transformer_blocks(ckpt)) == (1 if model == "albert" else 2)
    fn, loss_r, grads_r, states_r = forward_backward(task, ckpt, batch, cfg.train.xla)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-5)
    for a, b, v in zip(grads_r, grads, ckpt.trainable_variables):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=v.path)
    for a, b in zip(states_r, states):  # seed states end where the plain step leaves them
        np.testing.assert_array_equal(a, b)
    assert any(np.abs(g).sum() > 0 for g in grads)
    graph = fn.get_concrete_function(batch).graph
    offloaded = [op for op in graph.get_operations() if recompute.OFFLOAD_NAME in op.name]
    if offload:  # one host copy per block call and micro-batch
        assert offloaded and all("CPU" in op.device for op in offloaded), offloaded
    else:
        assert not offloaded


def test_offload_needs_checkpointing(gpt_data, tmp_path):
    cfg = make_cfg(gpt_data, tmp_path)
    cfg.pipeline.offload_activations = True
    with pytest.raises(ValueError, match="--offload_activations needs --activation_checkpointing"):
        config_lib.check_applicable(cfg)
    cfg.pipeline.activation_checkpointing, cfg.train.strategy = True, "pipeline"
    with pytest.raises(ValueError, match="--offload_activations=True has no effect"):
        config_lib.check_applicable(cfg)
