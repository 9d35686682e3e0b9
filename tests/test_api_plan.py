"""--plan_only of a user task (tfbig.api.plan, tfbig.plan.user) under --tensor_parallel with a
declared tensor_layout, --context_parallel and --calibration: the state per rank is what the
ranks' split models hold, and a declared transformer_shape plans as tfbig's own GPT of that
shape (tfbig-train --plan_only) on the same layout and calibration."""
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "plan"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import own_model  # noqa: E402
from test_api import DeclaredGPT, plan_device  # noqa: E402
from test_calibration import write as write_calibration  # noqa: E402

import tfbig  # noqa: E402
from tfbig import api, optim  # noqa: E402
from tfbig.layouts.tensor_plan import TensorGroup  # noqa: E402
from tfbig.layouts.tensor_layout import split_declared_model
from tfbig.errors import UsageError  # noqa: E402
from tfbig.training.local_plan import training_plan  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402
from tfbig.tasks.user_adapter import UserTask

# tfbig's GPT declared as Megatron splits it: QKV and fc by columns, the projections by rows
GPT_LAYOUT = {"blocks.*.attn.qkv": "column", "blocks.*.attn.proj": "row",
              "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}


def own_model_task(**options):
    return FunctionTask(own_model.model_fn, own_model.loss_fn, own_model.dataset_fn,
                        name="own_model", **options)


def held_state_bytes(task, rank, size):
    """{parameters, gradients, optimizer}: bytes of the variables tensor rank `rank` of `size`
    holds after split_declared_model, its gradients and tfbig's optimizer slots built on
    them."""
    model, _ = split_declared_model(UserTask(task), TensorGroup(None, rank, size))
    weights = sum(v.numpy().size for v in model.trainable_variables)
    slots = optim.build_optimizer(tfbig.configure().train, model.trainable_variables).variables
    return {"parameters": 4 * weights, "gradients": 4 * weights,
            "optimizer": 4 * sum(v.numpy().size for v in slots if len(v.shape))}


def test_tensor_parallel_state_per_rank_is_what_each_split_rank_holds():
    """--tensor_parallel=2 with own_model.LAYOUT (halved: the token table, each block's
    attention query/key/value kernels and biases and output kernel, the feed-forward column
    Dense's kernel and bias and the row Dense's kernel, the output Dense's kernel and bias;
    whole: the attention output and row biases, the position table and the LayerNorms): the
    planned state per rank is the bytes both ranks' split models hold, and data parallelism
    over the copies (4 ranks: 2 replicas) changes none of it."""
    task = own_model_task(tensor_layout=own_model.LAYOUT)
    config = tfbig.configure(plan_only=True, batch_size=8, strategy="horovod", tensor_parallel=2)
    held = held_state_bytes(task, 0, 2)
    assert held == held_state_bytes(task, 1, 2)
    whole = sum(int(np.prod(v.shape)) for v in own_model.model_fn().trainable_variables)
    size = own_model.SIZE
    embed, ff, vocab = size["embed_dim"], size["feed_forward_dim"], size["vocab_size"]
    block = 3 * (embed * embed + embed) + embed * embed + embed * ff + ff + ff * embed
    split = vocab * embed + size["num_layers"] * block + embed * vocab + vocab
    for world_size in (2, 4):
        found = api.plan(task, config, plan_device(), world_size=world_size)
        assert found.memory == held, world_size
        assert found.parameters == whole and found.memory["parameters"] == 4 * (whole - split / 2)
        assert f"layout: {world_size // 2} data-parallel replica(s) x 2 tensor-parallel ranks" \
            in found.text
        assert found.unknown == ("activations", "step time")


def test_tensor_parallel_plan_refuses_what_training_refuses():
    task = own_model_task(tensor_layout=own_model.LAYOUT)
    config = tfbig.configure(plan_only=True, batch_size=8, strategy="horovod", tensor_parallel=3)
    with pytest.raises(UsageError, match=r"--tensor_parallel=3 does not divide "
                                         r"my_model/token_and_position_embedding/embedding's "
                                         r"vocabulary \(input_dim\)=32"):
        api.plan(task, config, plan_device(), world_size=3)
    config = tfbig.configure(plan_only=True, batch_size=8, strategy="horovod", tensor_parallel=2)
    with pytest.raises(UsageError, match="= 2 ranks per model copy does not divide the 1 "
                                         "rank"):
        api.plan(task, config, plan_device(), world_size=1)


class LaidOutGPT(DeclaredGPT):
    tensor_layout = GPT_LAYOUT


def test_a_declared_shape_plans_tensor_parallelism_as_tfbigs_own_gpt():
    """Under --tensor_parallel=2 the declared tiny GPT's activations, communication and the
    compute, element-wise and tensor all-reduce times are those tfbig-train --plan_only plans
    for the tiny GPT on that layout; its state per rank is what the declared layout leaves on
    a rank (the embedding and LayerNorms whole, where tfbig's own GPT splits its vocabulary
    too)."""
    flags = dict(plan_only=True, batch_size=8, strategy="horovod", tensor_parallel=2)
    found = api.plan(LaidOutGPT(), tfbig.configure(**flags), plan_device(), world_size=2)
    config = tfbig.configure(model="gpt", preset="tiny", **flags)
    own = training_plan(config, plan_device(), world_size=2)
    theirs = _own_estimate(config)  # what training_plan prints
    assert found.estimate.layout == theirs.layout and "recommended: D1 P1 T2 M1" in own
    for kind in ("activations", "communication", "reserve"):
        assert found.memory[kind] == theirs.memory[kind], kind
    for part in ("compute", "elementwise", "tensor", "context", "pipeline"):
        assert found.estimate.time[part] == theirs.time[part], part
    assert found.memory["parameters"] == held_state_bytes(LaidOutGPT(), 0, 2)["parameters"]
    assert found.memory["parameters"] > theirs.memory["parameters"]  # the vocabulary whole
    assert "note: activations and step time are tfbig's GPT's of this shape split 2 ways" \
        in found.text


def _own_estimate(config):
    """The planner's Estimate of tfbig's tiny GPT under `config` on 2 ranks of plan_device()
    (tfbig.training.local_plan.training_plan's search)."""
    from tfbig.plan import hardware, search
    from tfbig.models import shapes as models

    shape = models.shape_of(models.model_config("gpt", "tiny"), "gpt", 128)
    cluster = hardware.Cluster(plan_device(), 2, 1, plan_device().local_bandwidth)
    return search.search(shape, cluster, config.train.precision, config.train.batch_size,
                         fixed=search.layout_from_config(config))[0]


def test_a_declared_shape_plans_context_parallelism_as_tfbigs_own_gpt():
    flags = dict(plan_only=True, batch_size=8, strategy="horovod", context_parallel=2)
    found = api.plan(DeclaredGPT(), tfbig.configure(**flags), plan_device(), world_size=2)
    own = training_plan(tfbig.configure(model="gpt", preset="tiny", **flags), plan_device(),
                        world_size=2)
    assert "recommended: D1 P1 C2 T1 M1" in own and found.text.endswith("\n" + own)
    assert "--context_parallel trains only models with a context plan" in found.text


def test_a_calibration_plans_a_declared_shape_as_tfbigs_own_gpt(tmp_path):
    """--calibration: the declared tiny GPT's plan prints calibrated and spec figures side by
    side, figure for figure tfbig-train --plan_only's of the tiny GPT."""
    flags = dict(plan_only=True, batch_size=8, precision="fp32",
                 calibration=write_calibration(tmp_path))
    found = api.plan(DeclaredGPT(), tfbig.configure(**flags), plan_device(), world_size=2)
    own = training_plan(tfbig.configure(model="gpt", preset="tiny", **flags), plan_device(),
                        world_size=2)
    assert "calibrated vs spec: step" in own and found.text.endswith("\n" + own)


def test_a_calibration_changes_nothing_of_a_plan_without_a_shape(tmp_path):
    task = own_model_task()
    plain = api.plan(task, tfbig.configure(plan_only=True, batch_size=8), plan_device(), 2)
    config = tfbig.configure(plan_only=True, batch_size=8,
                             calibration=write_calibration(tmp_path))
    found = api.plan(task, config, plan_device(), 2)
    assert found.memory == plain.memory and found.unknown == plain.unknown
    assert "changes nothing this plan gives" in found.text
    config.train.calibration = str(tmp_path / "none.json")
    with pytest.raises(UsageError, match="none.json: no such file; write one with tfbig-doctor"):
        api.plan(task, config, plan_device(), 2)
