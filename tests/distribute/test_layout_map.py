"""keras.distribution.LayoutMap read as a tensor layout (tfbig.tasks.layout_map): keras-hub's own
`get_layout_map` for its Llama and Qwen backbones, built on `tfbig.device_mesh`, splits their
unchanged model code over a tensor group. In one process (T ranks as threads whose collectives
meet in memory, tests/distribute/test_declared_layout.py's ThreadCollectives) the split model
gives the unsplit one's logits and every weight's gradient; on Horovod ranks (real processes)
`tfbig.train` equals one process: each step's loss and every trained weight. What a map says
that has no exact meaning here is refused by name before anything is built or written.
"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from equality import GRADIENT_ATOL, GRADIENT_RTOL, RecordedGradients  # noqa: E402
from test_declared_layout import Rank, ThreadCollectives, in_threads, seeded  # noqa: E402
from test_horovod import horovodrun, read  # noqa: E402

import layout_map_worker as worker  # noqa: E402

import tfbig  # noqa: E402
from tfbig.api import configure  # noqa: E402
from tfbig.distribute import tensor_collectives, tensor_layers  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.layouts.tensor_layout import join_slices, split_declared_model  # noqa: E402
from tfbig.layouts.tensor_plan import TensorGroup  # noqa: E402
from tfbig.tasks.user import FunctionTask  # noqa: E402
from tfbig.tasks.user_adapter import UserTask  # noqa: E402
from tfbig.tasks.user_layout import fresh_layer_names  # noqa: E402
from tfbig.training.finetune import LossRecorder  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

WORKER = os.path.join(HERE, "layout_map_worker.py")
FLAGS = dict(max_steps=4, batch_size=8, learning_rate=3e-3, warmup_steps=1, xla=False,
             log_every=1, eval_steps=0, grad_clip_norm=0.5, peak_tflops=1.0)
BLOCK = "transformer_layer_0"


def forward_backward(model, ids):
    """(logits, {path: gradient}) of one next-token batch."""
    with tf.GradientTape() as tape:
        logits = model(ids[:, :-1])
        loss = worker.loss_fn(ids[:, 1:], logits)
    grads = tape.gradient(loss, model.trainable_variables)
    return logits.numpy(), {v.path: tf.convert_to_tensor(g).numpy()
                            for v, g in zip(model.trainable_variables, grads)}


def heads_map(family, tensor_parallel):
    """keras-hub's map with attention split Megatron's way instead: q, k, v on their heads
    axis (column), the output projection on its heads axis (row, its input already split)."""
    layout = worker.layout_map(family, tensor_parallel)
    layout.pop("transformer_layer.*self_attention.*(query|key|value).kernel")
    layout.pop("transformer_layer.*attention_output.kernel")
    layout["self_attention.*(query|key|value).kernel"] = (None, "tensor", None)
    layout["attention_output.kernel"] = ("tensor", None, None)
    return layout


@pytest.mark.parametrize("family, tie, mapped", [
    ("llama", False, worker.layout_map),
    pytest.param("llama", True, worker.layout_map, marks=pytest.mark.slow),
    ("qwen", True, worker.layout_map),
    pytest.param("llama", False, heads_map, marks=pytest.mark.slow, id="llama-heads")])
def test_a_keras_hub_backbone_split_by_its_own_layout_map_equals_the_unsplit_one(
        monkeypatch, family, tie, mapped):
    """keras-hub's map (Gemma's training layout): the token table split over its vocabulary,
    q, k, v kernels (H, N, d) and the output projection (N, d, H) on their first, contracted
    axis (row: each rank takes its slice of a whole input, the partial products summed), the
    SwiGLU pair column and its down projection row. 2 thread-ranks: logits and each weight's
    gradient (slices joined) equal the unsplit model's; a tied table's reverse projection
    gives each rank its slice of the logits, gathered; Qwen's q, k, v biases are added once."""
    monkeypatch.setattr(tensor_collectives, "hvd", ThreadCollectives(2))
    # a heads split divides the KV heads too: 6 query heads and 2 KV heads there
    model_fn = worker.model_fn(family, tie, **({} if mapped is worker.layout_map else
                                               {"num_key_value_heads": 2}))
    task = UserTask(FunctionTask(model_fn, tensor_layout=mapped(family, 2)))
    with fresh_layer_names():
        full = seeded(model_fn)
    ranks = [seeded(lambda: split_declared_model(
        task, TensorGroup(Rank(rank), rank, 2), wrap=tensor_layers.wrap)) for rank in range(2)]
    splits = ranks[0][1]
    assert splits["token_embedding/embeddings"] == (0, 1)
    query = (0, 1) if mapped is worker.layout_map else (1, 1)  # (H, N, d): H or N
    assert splits[f"{BLOCK}/self_attention/query/kernel"] == query
    assert splits[f"{BLOCK}/self_attention/attention_output/kernel"] == (0, 1)  # (N, d, H): N
    assert splits[f"{BLOCK}/feedforward_gate_dense/kernel"] == (-1, 1)
    assert splits[f"{BLOCK}/feedforward_output_dense/kernel"] == (0, 1)
    assert len(splits) == 1 + 3 * 7  # q, k, v, output; gate, up, down
    held = ranks[0][0].get_layer(f"{family}_backbone").get_layer(BLOCK)
    query = (24, 6, 8) if mapped is worker.layout_map else (48, 3, 8)
    assert held._self_attention_layer._query_dense.kernel.shape == query

    ids = np.random.default_rng(3).integers(0, worker.VOCAB, (4, worker.SEQ + 1))
    logits, grads = forward_backward(full, ids)
    results = in_threads(lambda rank: forward_backward(ranks[rank][0], ids), 2)
    for rank_logits, _ in results:
        np.testing.assert_allclose(rank_logits, logits, rtol=1e-5, atol=1e-6)
    for v in full.trainable_variables:
        pieces = [rank_grads[v.path] for _, rank_grads in results]
        if v.path in splits:
            assert pieces[0].size == v.numpy().size // 2, v.path
            ours = join_slices(pieces, *splits[v.path])
        else:
            np.testing.assert_array_equal(pieces[0], pieces[1], err_msg=v.path)
            ours = pieces[0]
        assert np.any(grads[v.path]), v.path
        atol = max(GRADIENT_ATOL, 1e-6 * np.abs(grads[v.path]).max())
        np.testing.assert_allclose(ours, grads[v.path], rtol=GRADIENT_RTOL, atol=atol,
                                   err_msg=v.path)


def layout_of(entries, tensor_parallel=2, axis_names=("data", "tensor")):
    mesh = keras.distribution.DeviceMesh((1, tensor_parallel), axis_names,
                                         [f"rank:{r}" for r in range(tensor_parallel)])
    layout = keras.distribution.LayoutMap(mesh)
    for key, axes in entries.items():
        layout[key] = axes
    return layout


@pytest.mark.parametrize("entries, degree, message", [  # (the mesh's tensor axis: 2, or 5)
    pytest.param({"no_such_layer.*kernel": ("tensor", None)}, 2,
                 "tensor_layout['no_such_layer.*kernel']: matches no variable of BackboneLM",
                 id="no_variable"),
    pytest.param({"feedforward_gate_dense.kernel": ("tensor", "tensor")}, 2,
                 "splits 'transformer_layer_0/feedforward_gate_dense/kernel' (48, 64) on 2 axes",
                 id="two_axes"),
    pytest.param({"self_attention_layernorm.scale": ("tensor",)}, 2,
                 "splits 'transformer_layer_0/self_attention_layernorm/scale' (48,), which is "
                 "not the kernel of a Dense or EinsumDense", id="norm_scale"),
    pytest.param({"token_embedding/embeddings": (None, "tensor")}, 2,
                 "splits the embedding 'token_embedding/embeddings' (64, 48) along its width",
                 id="embedding_width"),
    pytest.param({"feedforward.*kernel": ("tensor", None),
                  "feedforward_gate.*": (None, "tensor")}, 2,
                 "'transformer_layer_0/feedforward_gate_dense/kernel' is also matched by "
                 "'feedforward.*kernel'", id="matched_twice"),
    pytest.param({"self_attention.*query.kernel": (None, None, "tensor")}, 5,
                 "--tensor_parallel=5 does not divide", id="not_divided"),
    pytest.param({"self_attention.*query.kernel": ("tensor", None, None)}, 4,
                 "the LayoutMap's mesh has a tensor axis of 2 and --tensor_parallel=4",
                 id="other_degree"),
])
def test_a_layout_map_without_exact_meaning_is_refused_by_name(entries, degree, message):
    task = UserTask(FunctionTask(worker.model_fn("llama"), name="LlamaTask",
                                 tensor_layout=layout_of(entries, 5 if degree == 5 else 2)))
    with pytest.raises((UsageError, ValueError)) as error:
        split_declared_model(task, TensorGroup(None, 0, degree))
    assert message in str(error.value)


def test_a_mesh_without_a_tensor_axis_is_refused_by_name():
    task = UserTask(FunctionTask(worker.model_fn("llama"), name="LlamaTask", tensor_layout=
                                 layout_of({"query.kernel": ("shards", None, None)},
                                           axis_names=("batch", "shards"))))
    with pytest.raises(UsageError, match=r"has axes \('batch', 'shards'\) and none named "
                                         r"'tensor' \(tfbig.device_mesh\) or 'model'"):
        task.declared_layout(task.build_model())


def test_keras_hubs_default_axis_names_read_as_tfbigs():
    """`get_layout_map(mesh)` with keras-hub's defaults ("batch" x "model", as a JAX user
    builds it) declares the same splits as the map on tfbig.device_mesh's "data" x "tensor"."""
    import keras_hub

    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["rank:0", "rank:1"])
    defaults = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    assert defaults["token_embedding/embeddings"].axes == ("model", "batch")
    declared = {}
    for name, mapped in (("defaults", defaults), ("tfbig", worker.layout_map("llama", 2))):
        task = UserTask(FunctionTask(worker.model_fn("llama"), name="LlamaTask",
                                     tensor_layout=mapped))
        with fresh_layer_names():
            declared[name] = [(layer.path, kind, axis) for layer, kind, axis in
                              task.declared_layout(task.build_model(), degree=2)]
    assert len(declared["tfbig"]) == 1 + 3 * 7 and declared["defaults"] == declared["tfbig"]


def test_tfbig_device_mesh_is_what_keras_hub_builds_its_map_on():
    mesh = tfbig.device_mesh(tensor_parallel=2, data_parallel=3)
    assert mesh.shape == (3, 2) and mesh.axis_names == ("data", "tensor")
    layout = worker.layout_map("llama", 2)
    assert layout["token_embedding/embeddings"].axes == ("tensor", "data")


def test_the_plan_counts_what_each_rank_of_a_layout_map_holds(tmp_path):
    """tfbig's plan of a user task split by keras-hub's map: each tensor rank holds every
    weight the map leaves whole and 1/T of each it splits, counted on the built model."""
    from tfbig.api import plan

    task = FunctionTask(worker.model_fn("llama"), worker.loss_fn, worker.dataset_fn,
                        name="llama_lm", tensor_layout=worker.layout_map("llama", 2))
    found = plan(task, configure(model_dir=str(tmp_path), strategy="horovod", tensor_parallel=2,
                                 batch_size=8), world_size=2)
    with fresh_layer_names():
        model = worker.model_fn("llama")()
    layout = worker.layout_map("llama", 2)
    split = sum(v.numpy().size for v in model.trainable_variables
                if layout[v.path] is not None)  # (LayoutMap.__getitem__: the regex match)
    whole = sum(v.numpy().size for v in model.trainable_variables) - split
    assert whole == 64 * 48 + 7 * 48  # the untied reverse table, 7 RMSNorm scales
    assert f"each of 2 ranks holds {whole + split // 2:,} of them" in found.text
    assert found.memory["parameters"] == 4 * (whole + split // 2)


def one_process(family, model_dir):
    """The same task and flags in this process, unsplit: (losses, RecordedGradients)."""
    task = UserTask(FunctionTask(worker.model_fn(family), worker.loss_fn, worker.dataset_fn,
                                 name=f"{family}_lm"))
    trainer = Trainer(configure(model_dir=str(model_dir), **FLAGS), task=task,
                      logger=LossRecorder(str(model_dir), True, 4))
    recorded = RecordedGradients(trainer)
    trainer.fit()
    return trainer.logger.losses, recorded


TRAINED = {"llama_tp2": ("llama", 2, {"tensor_parallel": 2}),
           "llama_tp2_dp2": ("llama", 4, {"tensor_parallel": 2}),
           "qwen_tp2": ("qwen", 2, {"tensor_parallel": 2}),
           # composed: the blocks recomputed (their collectives run again in the backward),
           # the optimizer slots sharded over the 2 data-parallel replicas
           "llama_tp2_recompute": ("llama", 2, {"tensor_parallel": 2,
                                                "activation_checkpointing": True}),
           "llama_tp2_dp2_zero1": ("llama", 4, {"tensor_parallel": 2, "zero_stage": 1})}


@pytest.mark.multiproc
@pytest.mark.slow  # (the threads above are the default run's proof of the split)
@pytest.mark.parametrize("name", sorted(TRAINED))
def test_tfbig_train_of_a_keras_hub_backbone_with_its_layout_map_equals_one_process(
        tmp_path, name):
    """`tfbig.train(..., tensor_layout=LlamaBackbone.get_layout_map(tfbig.device_mesh(...)))`
    on Horovod ranks (TP2; TP2 x DP2 on 4; with the blocks recomputed; with ZeRO-1): each
    step's loss (rtol 1e-5) and every trained weight, gathered whole, equal one process's
    (tests/equality.py's rule)."""
    family, ranks, flags = TRAINED[name]
    flags = {**FLAGS, "strategy": "horovod", **flags}
    code = horovodrun([WORKER, family, str(tmp_path / name), json.dumps(flags)],
                      tmp_path / "log.txt", ranks=("-np", str(ranks), "-H", f"localhost:{ranks}"))
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    layout = json.loads((tmp_path / name / "tensor.json").read_text())
    assert layout["tensor_parallel"] == 2 and len(layout["splits"]) == 1 + 3 * 7
    losses, recorded = one_process(family, tmp_path / "one")
    ours = json.loads((tmp_path / name / "losses.json").read_text())
    assert len(ours) == 4 and ours[0] != ours[-1]
    np.testing.assert_allclose(ours, losses, rtol=1e-5)
    paths = json.loads((tmp_path / name / "weights.json").read_text())
    with np.load(tmp_path / name / "weights.npz") as saved:
        weights = dict(zip(paths, (saved[f"arr_{i}"] for i in range(len(paths)))))
    assert sorted(weights) == sorted(recorded.paths)
    recorded.assert_equal({p: weights[p] for p in recorded.paths}, err_msg=name)
