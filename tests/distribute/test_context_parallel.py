"""Context parallelism (`--context_parallel`) through real `horovodrun --gloo` launches, against
the single-device run on the same global batch.

The default run keeps one launch of 2 ranks: GPT (causal) at CP2. Slow launches run BERT
(bidirectional, padding masks, MLM + NSP) at CP2 on 2 ranks, and on 4 ranks CP2 x DP2 (GPT and
BERT), CP2 x TP2 (with --sequence_parallel too), CP2 x DP2 with ZeRO-1 and with ZeRO-3 (both
stopped after 2 steps and resumed from the checkpoint), with ZeRO-2, and ALBERT at CP2 x DP2.
Each compares per-variable first-step gradients, the losses of every step, the final weights
(tests/equality.py) and the validation loss (the context group's per-sequence outputs averaged,
then gathered) with one device (batch 8, 2 micro-batches per replica, clipping active).
"""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import ALBERT, BERT, WORKER, horovodrun, listed, load, read, run_entry  # noqa: E402
from test_tensor_parallel import TRAIN, data_of, shared_reference  # noqa: E402
from test_trainer import make_cfg  # noqa: E402

from tfbig.config import ExperimentConfig, ParallelConfig  # noqa: E402
from tfbig.distribute.context_layers import ContextGroup, check_sequence  # noqa: E402
from tfbig.distribute.horovod import build_mesh  # noqa: E402

BERT_CP = {**BERT, "learning_rate": 3e-3}  # as test_tensor_parallel's BERT_TP
SCENARIOS = {  # name: (context, tensor, train options, worker options); 2 ranks
    "cp2": (2, 1, {}, {"first_gradients": True}),
}
SLOW_PAIR = {  # 2 ranks
    "cp2_bert": (2, 1, BERT_CP, {"first_gradients": True}),
}
SLOW_SCENARIOS = {  # 4 ranks
    "cp2_dp2": (2, 1, {}, {"first_gradients": True}),
    "cp2_dp2_bert": (2, 1, BERT_CP, {"first_gradients": True}),
    "cp2_tp2": (2, 2, {}, {"first_gradients": True}),
    # each norm on its tensor rank's half of the rank's two chunks (--sequence_parallel)
    "cp2_tp2_sequence": (2, 2, {"sequence_parallel": True}, {"first_gradients": True,
                                                             "norm_rows": True}),
    # ZeRO-1: first_gradients would be this rank's slice (its sync reduce-scatters them)
    "cp2_dp2_zero1": (2, 1, {"zero_stage": 1}, {"interrupt_at": 2}),
    "cp2_dp2_albert": (2, 1, ALBERT, {"first_gradients": True}),
    # ZeRO-3: the parameters gathered per layer over the data ranks of one context index
    "cp2_dp2_zero3": (2, 1, {"zero_stage": 3}, {"interrupt_at": 2}),
    "cp2_dp2_zero2": (2, 1, {"zero_stage": 2}, {}),
}


def cp_cfg(data_dir, model_dir, context, tensor, zero_stage=0, sequence_parallel=False,
           **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **train})
    cfg.parallel.context_parallel = context
    cfg.parallel.tensor_parallel = tensor
    cfg.parallel.zero_stage = zero_stage
    cfg.parallel.sequence_parallel = sequence_parallel
    return cfg


def launch(root, scenarios, data, ranks):
    out = root / "out"
    plan = [run_entry(name, cp_cfg(data_of(train, *data), root / name, context, tensor, **train),
                      out, **opts) for name, (context, tensor, train, opts) in scenarios.items()]
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=1800,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=["-np", str(ranks), "-H", f"localhost:{ranks}"])
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("context_parallel"), SCENARIOS,
                  (gpt_data, albert_data, bert_data), 2)


@pytest.fixture(scope="module")
def slow_pair_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("context_parallel_pair"), SLOW_PAIR,
                  (gpt_data, albert_data, bert_data), 2)


@pytest.fixture(scope="module")
def slow_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("context_parallel_slow"), SLOW_SCENARIOS,
                  (gpt_data, albert_data, bert_data), 4)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(SCENARIOS) + [
    pytest.param(name, marks=pytest.mark.slow) for name in [*SLOW_PAIR, *SLOW_SCENARIOS]])
def test_context_parallel_ranks_equal_one_process_on_the_same_data(
        gpt_data, albert_data, bert_data, request, shared, tmp_path_factory, name):
    fixture, scenarios, world = next(
        (fixture, scenarios, world) for fixture, scenarios, world in (
            ("runs", SCENARIOS, 2), ("slow_pair_runs", SLOW_PAIR, 2),
            ("slow_runs", SLOW_SCENARIOS, 4)) if name in scenarios)
    root, out = request.getfixturevalue(fixture)
    context, tensor, train, opts = scenarios[name]
    ranks = [load(out, name, r) for r in range(world)]
    single, losses, grads = shared_reference(
        shared, tmp_path_factory, data_of(train, gpt_data, albert_data, bert_data),
        world // (context * tensor), **train)
    first = ranks[0]
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    assert first["step"] == TRAIN["max_steps"]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    single.recorded.assert_equal(listed(first, "w"), err_msg=name)
    if opts.get("first_gradients"):
        assert len(listed(first, "gradients")) == len(grads)
        for ours, theirs in zip(listed(first, "gradients"), grads):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    for other in ranks[1:]:  # every rank ends with the same model
        for a, b in zip(listed(first, "w"), listed(other, "w")):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(first["eval_loss"]) == pytest.approx(single.summary["eval"]["loss"], rel=1e-5)
    if opts.get("interrupt_at"):
        assert int(first["restored_step"]) == opts["interrupt_at"]
    log = read(root / "log.txt")
    assert "context parallel: 2 ranks per sequence of" in log


@pytest.mark.multiproc
def test_only_context_rank_zero_writes_checkpoints(runs):
    root, _ = runs
    log = read(root / "log.txt")
    assert "mesh: 2 ranks = data 1 x pipeline 1 x context 2 x tensor 1" in log
    assert "rank 0 positions 0..3 and 12..15, rank 1 positions 4..7 and 8..11" in log
    assert (root / "cp2" / "checkpoint").exists()


def test_each_rank_holds_chunks_i_and_2c_minus_1_minus_i():
    group = ContextGroup(None, 1, 4, 32)  # 8 chunks of 4
    assert group.positions().tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert group.offsets() == (4, 24)
    gathered = group.gathered_positions()
    assert sorted(gathered.tolist()) == list(range(32))
    # causal work per rank: the keys its two chunks see are the same on every rank
    work = [sum(p + 1 for p in ContextGroup(None, r, 4, 32).positions()) for r in range(4)]
    assert len(set(work)) == 1


def _cfg(**parallel):
    cfg = ExperimentConfig()
    cfg.train.strategy = "horovod"
    for key, value in parallel.items():
        setattr(cfg.parallel if hasattr(cfg.parallel, key) else cfg.pipeline, key, value)
    return cfg


@pytest.mark.multiproc
@pytest.mark.slow
def test_sequence_parallel_norms_see_a_quarter_of_the_sequence_under_cp2_tp2(slow_runs):
    """CP2 x TP2 with --sequence_parallel: a context rank holds 2 of the 4 chunks of a
    sequence (half of it) and each of its tensor ranks norms half of those positions."""
    _, out = slow_runs
    for rank in range(4):  # make_cfg's sequences of 16
        assert int(load(out, "cp2_tp2_sequence", rank)["norm_rows"]) == 16 // 4


@pytest.mark.parametrize("options, message", [
    (dict(context_parallel=3), r"--context_parallel=3 x --tensor_parallel=1 = 3 does not "
                               r"divide 4"),
])
def test_bad_context_parallel_flags_are_refused_before_training(options, message):
    with pytest.raises(ValueError, match=message):
        build_mesh(ParallelConfig(**options), 4)


def test_context_parallel_with_a_pipeline_splits_each_stage_over_a_context_group():
    """CP x PP builds the data x pipeline x context grid (tests/pipeline/test_cross_rank.py's
    cp2_pp2 trains it): stage k's context rank c sends to context rank c of stage k+1."""
    from tfbig.pipeline.cross_rank import pipeline_mesh

    mesh = pipeline_mesh(_cfg(context_parallel=2, pipeline_stages=2), 8)
    assert (mesh.data, mesh.pipeline, mesh.context) == (2, 2, 2)
    for rank in range(8):
        coords = mesh.coords(rank)
        assert {mesh.coords(r)["context"] for r in mesh.group("pipeline", rank)} == {
            coords["context"]}
        assert {mesh.coords(r)["pipeline"] for r in mesh.group("context", rank)} == {
            coords["pipeline"]}


def test_a_sequence_the_chunks_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="sequence length 18 is not a multiple of 2 x 2"):
        check_sequence(18, 2)


def test_a_model_without_a_context_plan_is_refused_by_name():
    from tfbig.distribute.context_layers import plan_for

    classifier = type("BertClassifier", (), {})()
    with pytest.raises(ValueError, match="no context-parallel plan for BertClassifier"):
        plan_for(classifier)


def test_a_keras_attention_under_the_context_wrap_equals_the_layer_itself():
    """A keras MultiHeadAttention that a user task's context_layout names ("attention") gets a
    `_compute_attention` that attends from the rank's two chunks, each at its position offset,
    over the keys and values gathered from the context group. On a group of one (Horovod of
    one rank, in this process: chunks 0 and 1 of 2) its outputs and every gradient equal the
    layer's own causal attention (Keras' kernel); a mask it cannot honour is refused."""
    import keras

    from tfbig.distribute.context_layers import wrap
    from tfbig.distribute.horovod_keras import hvd

    if not hvd.is_initialized():
        hvd.init()
    x = tf.random.stateless_normal((2, 16, 12), seed=(1, 2))
    ours, theirs = (keras.layers.MultiHeadAttention(3, key_dim=4) for _ in range(2))
    for layer in (ours, theirs):
        layer(x, x, use_causal_mask=True)  # built
    theirs.set_weights(ours.get_weights())
    wrap(ours, "attention", ContextGroup(hvd.global_process_set, 0, 1, 16))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        outputs = [layer(x, x, use_causal_mask=True) for layer in (ours, theirs)]
        losses = [tf.reduce_sum(out * tf.range(12, dtype=tf.float32)) for out in outputs]
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)
    for layer, loss in zip((ours, theirs), losses):
        layer.grads = tape.gradient(loss, [x] + layer.trainable_variables)
    # float32 sums in another order; the key bias's gradient is zero up to that noise
    scale = max(float(np.abs(g).max()) for g in theirs.grads)
    for a, b in zip(ours.grads, theirs.grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
    with pytest.raises(ValueError, match="was called with an attention mask"):
        ours(x, x, attention_mask=tf.ones((2, 16, 16), tf.bool))


@pytest.mark.parametrize("declared, message", [
    ({"embedding_layer.lookup": "tokens"}, r"context_layout\['embedding_layer.lookup'\] = "
                                           r"'tokens' names no layer; expected a "
                                           r"keras.layers.Embedding"),
    ({"output_layer": "attention"}, r"context_layout\['output_layer'\] = 'attention' names "
                                    r"Dense \S+; expected a keras.layers.MultiHeadAttention "
                                    r"with value_dim"),
    ({"output_layer": "rows"}, r"context_layout\['output_layer'\] = 'rows': expected one of "
                               r"\['attention', 'output', 'positions', 'tokens'\]"),
])
def test_a_user_context_layout_is_checked_on_the_built_model(declared, message):
    from tfbig.distribute.context_layers import user_plan

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples"))
    import own_model

    assert user_plan(own_model.model_fn(), own_model.CONTEXT, "own_model") == list(
        own_model.CONTEXT.items())
    with pytest.raises(ValueError, match=r"own_model\." + message):
        user_plan(own_model.model_fn(), declared, "own_model")
