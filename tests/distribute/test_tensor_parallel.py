"""Tensor parallelism (`--tensor_parallel`) through one real `horovodrun -np 4 --gloo` launch,
against the single-device run on the same global batch.

Scenarios (tests/distribute/horovod_worker.py plans; HOROVOD_DYNAMIC_PROCESS_SETS=1 lets one
launch build several rank grids): TP2 x DP2 with accumulation and clipping active (stopped after
2 steps and resumed from the per-rank checkpoints). A slow launch of its own runs TP2 x DP2 with
ZeRO-1, 2 and 3 (each tensor rank's optimizer state sharded over its data ranks), TP4 with
LAMB (its per-variable trust ratio over split variables), an fp16 step made non-finite on one
tensor rank, TP2 x DP2 with --sequence_parallel, ALBERT (factorised embedding, shared blocks,
MLM head with its vocabulary bias, LAMB) at TP2 x DP2, a TP2 x DP2 run started on the
single-device run's checkpoint after 2 steps, TP2 x DP2 with --activation_checkpointing, ALBERT with
--sequence_parallel, BERT (NSP, AdamW), BERT with --sequence_parallel and
--activation_checkpointing together, and TP2 x DP2 trained under fp16 loss scaling.
Each rank assembles the full weights and first-step gradients from its group's slices
(TensorParallelStrategy.gather_full) for the comparison.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_horovod import (ALBERT, BERT, WORKER, horovodrun, listed, load,  # noqa: E402
                          read, run_entry)
from equality import RecordedGradients  # noqa: E402
from test_trainer import ReplicasTask, make_cfg, weights  # noqa: E402

from horovod_worker import RecordingLogger  # noqa: E402
from tfbig.config import ParallelConfig  # noqa: E402
from tfbig.distribute.horovod import build_mesh  # noqa: E402
from tfbig.training.consolidate import consolidate  # noqa: E402
from tfbig.layouts.tensor_layout import join_slices, take_slice  # noqa: E402
from tfbig.convert.run_dir import load_model  # noqa: E402
from tfbig.optim import loss_scale  # noqa: E402
from tfbig.tasks import get_task  # noqa: E402
from tfbig.training.trainer import Trainer  # noqa: E402

RANKS = 4
# Clipping at 0.5 is active at every step; 2 micro-batches per data-parallel rank.
TRAIN = dict(max_steps=4, batch_size=8, grad_clip_norm=0.5, dropout=0.0, grad_accum_steps=2)
LAMB = dict(optimizer="lamb", learning_rate=1e-2, weight_decay=0.01, epsilon=1e-6)
BERT_TP = {**BERT, "learning_rate": 3e-3}
SCENARIOS = {  # name: (tensor_parallel, train options, worker options)
    # stopped after 2 steps and resumed from the per-rank checkpoints: the steps before and
    # after the restore are the same fit loop, so one run covers both
    "tp2_dp2": (2, {}, {"first_gradients": True, "norm_rows": True, "interrupt_at": 2,
                        "widest_activation": True}),
}
# Final weights after 4 steps: a split matmul sums in another order, and Adam turns a float32
# difference in a near-zero gradient into a step of up to the learning rate (BERT had entries
# 1.5e-6 and 2.1e-6 apart): tests/equality.py bounds each entry through the gradients.
# The slow launch: TP x ZeRO-1/2/3, TP4 with LAMB, ALBERT, BERT's plan (ALBERT's over a block
# per layer), fp16 training and its skipped step; the default run keeps TP on GPT at TP2 x DP2
# (ZeRO-1 runs by default under PP: test_cross_rank's pp2_dp2_zero1; BERT's and ALBERT's
# split layers under TP x PP are slow too: test_tensor_pipeline's pp2_tp2_masked_lm). Also
# slow: sequence parallelism (under TP x PP as well, test_tensor_pipeline's
# pp2_tp2_sequence), the start from a single-device checkpoint
# (test_a_single_device_checkpoint_restores_into_each_ranks_slices checks the slicing
# in-process, by default) and the dropout masks of tensor peers.
SLOW_SCENARIOS = {  # a launch of its own (slow), as SCENARIOS
    # optimizer slots of each tensor rank's variables sharded over its 2 data ranks (ZeRO-1),
    # stopped after 2 steps and resumed from the per-(tensor rank, slice) checkpoints
    "tp2_dp2_zero1": (2, {"zero_stage": 1}, {"first_gradients": True, "interrupt_at": 2}),
    # ZeRO-2: each micro-batch's gradients reduce-scattered over the tensor rank's partition
    # group; stopped after 2 steps and resumed; and with sequence parallelism's sums
    "tp2_dp2_zero2": (2, {"zero_stage": 2}, {"interrupt_at": 2}),
    "tp2_dp2_zero2_sequence": (2, {"zero_stage": 2, "sequence_parallel": True}, {}),
    # ZeRO-3: each tensor rank's slices sharded over its data ranks, gathered per block
    "tp2_dp2_zero3": (2, {"zero_stage": 3}, {"interrupt_at": 2}),
    "tp4_lamb": (4, {**LAMB, "grad_accum_steps": 1},
                 {"first_gradients": True, "widest_activation": True}),
    # fp16: rank 3's gradient slice of one split kernel is inf in the first step, its tensor
    # peer's slice is finite; every rank must skip that step (the default run skips a
    # poisoned fp16 step under plain Horovod: test_horovod)
    "tp2_dp2_fp16_skip": (2, {"precision": "mixed_float16", "max_steps": 2},
                          {"poison_gradient_rank": 3}),
    # ALBERT's shared blocks split over the tensor ranks with its vocabulary-parallel MLM
    # argmax (ALBERT under TP x PP, test_tensor_pipeline's albert_pp2_tp2_sequence, is slow
    # too: the default run splits GPT)
    "tp2_dp2_albert": (2, ALBERT, {"first_gradients": True, "mlm_argmax": True}),
    "tp2_dp2_sequence": (2, {"sequence_parallel": True},
                         {"first_gradients": True, "norm_rows": True}),
    # starts on the single-device run's checkpoint after 2 steps (made by the fixture)
    "tp2_dp2_from_one": (2, {}, {}),
    "tp2_dropout": (2, {"dropout": 0.1, "max_steps": 1}, {}),
    # BERT (a block per layer, no projection, NSP): ALBERT's plan over its own blocks. AdamW at
    # lr 3e-3: at 1e-2 one word-table entry of 10240 whose gradient is near zero ended 2e-6
    # apart after 4 steps (Adam's step does not shrink with the gradient), all else within
    # rtol 1e-5.
    "tp2_dp2_bert": (2, BERT_TP, {"first_gradients": True, "mlm_argmax": True}),
    "tp2_dp2_fp16": (2, {"precision": "mixed_float16"}, {}),
    "tp2_dp2_recompute": (2, {"activation_checkpointing": True}, {"first_gradients": True}),
    "tp2_dp2_albert_sequence": (2, {**ALBERT, "sequence_parallel": True},
                                {"first_gradients": True}),
    # BERT with sequence parallelism and per-block recompute together
    "tp2_dp2_bert_sequence_recompute": (2, {**BERT_TP, "sequence_parallel": True,
                                            "activation_checkpointing": True},
                                        {"first_gradients": True}),
}
NOT_TRAINED_LIKE_ONE = ("tp2_dropout", "tp2_dp2_fp16_skip")  # checked by tests of their own
EQUAL_TO_ONE_DEVICE = [name for name in SCENARIOS if name not in NOT_TRAINED_LIKE_ONE] + [
    pytest.param(name, marks=pytest.mark.slow) for name in SLOW_SCENARIOS
    if name not in NOT_TRAINED_LIKE_ONE]
FROM_ONE_AT = 2


def tp_cfg(data_dir, model_dir, tensor, sequence_parallel=False, activation_checkpointing=False,
           zero_stage=0, **train):
    cfg = make_cfg(data_dir, model_dir, strategy="horovod", **{**TRAIN, **train})
    cfg.parallel.tensor_parallel = tensor
    cfg.parallel.zero_stage = zero_stage
    cfg.parallel.sequence_parallel = sequence_parallel
    cfg.pipeline.activation_checkpointing = activation_checkpointing
    return cfg


def data_of(train, gpt_data, albert_data, bert_data):
    return {"albert": albert_data, "bert": bert_data}.get(train.get("model"), gpt_data)


def launch(root, scenarios, data):
    """One `horovodrun -np 4` running `scenarios` (as SCENARIOS); data: the fixtures'
    (gpt_data, albert_data, bert_data)."""
    out = root / "out"
    plan = [run_entry(name, tp_cfg(data_of(train, *data), root / name, tensor, **train), out,
                      **opts)
            for name, (tensor, train, opts) in scenarios.items()]
    if "tp2_dp2_from_one" in scenarios:
        reference(data[0], root / "tp2_dp2_from_one", RANKS // 2, max_steps=FROM_ONE_AT)
    os.makedirs(out)
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    command = ["-np", str(RANKS), "-H", f"localhost:{RANKS}"]
    # 9 layouts in one launch: ~3 min idle; 20 min were not enough at load 50 (other jobs on
    # the 2 cores)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=1800,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, ranks=command)
    assert code == 0, read(root / "log.txt")[-6000:]
    return root, out


@pytest.fixture(scope="module")
def runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("tensor_parallel"), SCENARIOS,
                  (gpt_data, albert_data, bert_data))


@pytest.fixture(scope="module")
def slow_runs(gpt_data, albert_data, bert_data, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("tensor_parallel_slow"), SLOW_SCENARIOS,
                  (gpt_data, albert_data, bert_data))


def reference(data_dir, model_dir, replicas, **train):
    """The single-device run on the examples the data-parallel ranks read together, and the
    averaged gradients of its first batch."""
    cfg = make_cfg(data_dir, model_dir, **{**TRAIN, **train})
    logger = RecordingLogger(cfg.train.model_dir, True, cfg.train.max_steps)
    trainer = Trainer(cfg, task=ReplicasTask(cfg.train, replicas, get_task(cfg.train, cfg)),
                      logger=logger)
    _, grads, _ = trainer.forward_backward(next(trainer._train_iterator()))
    grads = [g.numpy() for g in grads]
    trainer.recorded = RecordedGradients(trainer)
    trainer.summary = trainer.fit()
    return trainer, np.array([logger.losses[s][0] for s in sorted(logger.losses)]), grads


def shared_reference(shared, tmp_path_factory, data_dir, replicas, **train):
    """`reference`, run once per session for equal arguments: the scenarios that differ only
    in what does not change the math on one device (sequence parallelism, recompute, ZeRO)
    compare against the same run. Read-only."""
    train = {k: v for k, v in train.items()  # the same math on one device
             if k not in ("sequence_parallel", "activation_checkpointing", "zero_stage")}
    key = ("tensor_parallel", data_dir, replicas, json.dumps(train, sort_keys=True))
    return shared(key, lambda: reference(data_dir, tmp_path_factory.mktemp("reference"),
                                         replicas, **train))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EQUAL_TO_ONE_DEVICE)
def test_tensor_parallel_ranks_equal_one_process_on_the_same_data(gpt_data, albert_data,
                                                                  bert_data, request, shared,
                                                                  tmp_path_factory, name):
    slow = name in SLOW_SCENARIOS
    _, out = request.getfixturevalue("slow_runs" if slow else "runs")
    tensor, train, opts = (SLOW_SCENARIOS if slow else SCENARIOS)[name]
    ranks = [load(out, name, r) for r in range(RANKS)]
    single, losses, grads = shared_reference(
        shared, tmp_path_factory, data_of(train, gpt_data, albert_data, bert_data),
        RANKS // tensor, **train)
    first = ranks[0]
    assert np.all(first["grad_norms"] > TRAIN["grad_clip_norm"])  # clipping is active
    assert first["step"] == TRAIN["max_steps"]
    if train.get("precision") == "mixed_float16":
        # float16 matmuls: T partial products rounded to float16, then summed, differ from one
        # float16 product in the last bits, and Adam turns a gradient near zero into a step of
        # either sign: all weights within one step (peak lr 3e-3), nearly all within 1e-4.
        assert int(first["nonfinite_steps"]) == int(single.nonfinite_steps.numpy()) == 0
        assert float(first["loss_scale"]) == float(loss_scale(single.optimizer))
        np.testing.assert_allclose(first["losses"], losses, rtol=2e-3)
        ours = np.concatenate([w.ravel() for w in listed(first, "w")])
        theirs = np.concatenate([w.ravel() for w in weights(single)])
        assert np.max(np.abs(ours - theirs)) < 3e-3
        assert np.mean(np.abs(ours - theirs) < 1e-4) > 0.995
        return
    if name == "tp2_dp2_from_one":  # this run logged the steps after the restore
        assert list(first["loss_steps"]) == list(range(FROM_ONE_AT + 1, TRAIN["max_steps"] + 1))
        losses = losses[FROM_ONE_AT:]
    np.testing.assert_allclose(first["losses"], losses, rtol=1e-5)
    single.recorded.assert_equal(listed(first, "w"), err_msg=name)
    if opts.get("first_gradients"):
        assert len(listed(first, "gradients")) == len(grads)
        for ours, theirs in zip(listed(first, "gradients"), grads):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    for other in ranks[1:]:  # every rank's group assembles the same model
        for a, b in zip(listed(first, "w"), listed(other, "w")):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    if opts.get("interrupt_at"):
        assert int(first["restored_step"]) == opts["interrupt_at"]
    if opts.get("mlm_argmax"):  # the vocabulary-parallel argmax: same predictions
        for rank in ranks:
            assert len(np.unique(rank["argmax_full"])) > 1  # not one id everywhere
            np.testing.assert_array_equal(rank["argmax_ours"], rank["argmax_full"])
    if train.get("model") in ("albert", "bert"):
        accuracy = single.summary["eval"]["mlm_accuracy"]
        assert float(first["eval_mlm_accuracy"]) == pytest.approx(accuracy, rel=1e-5)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["tp2_dp2", pytest.param("tp4_lamb", marks=pytest.mark.slow)])
def test_each_rank_holds_its_slice_of_the_split_layers(gpt_data, request, tmp_path, name):
    root, out = request.getfixturevalue("slow_runs" if name in SLOW_SCENARIOS else "runs")
    tensor = {**SCENARIOS, **SLOW_SCENARIOS}[name][0]
    splits = json.loads((root / name / "tensor.json").read_text())["splits"]
    cfg = tp_cfg(gpt_data, tmp_path, 1)
    model = get_task(cfg.train, cfg).build_model()
    whole = sum(4 * v.numpy().size for v in model.trainable_variables if v.path not in splits)
    # the plan leaves whole: LayerNorms, the position table, row-parallel biases
    assert all(len(v.shape) == 1 or "position" in v.path
               for v in model.trainable_variables if v.path not in splits)
    full = sum(4 * v.numpy().size for v in model.trainable_variables)
    for rank in range(RANKS):
        result = load(out, name, rank)
        split = int(result["bytes_split_parameters"])
        assert int(result["bytes_replicated_parameters"]) == whole
        assert split * tensor == full - whole  # exactly 1/T of every split variable


@pytest.mark.multiproc
def test_every_rank_of_the_first_replica_writes_its_checkpoint(runs):
    root, _ = runs
    model_dir = root / "tp2_dp2"
    layout = json.loads((model_dir / "tensor.json").read_text())
    assert layout["tensor_parallel"] == 2
    assert layout["splits"]["gpt/block_0/attn/qkv/kernel"] == [-1, 3]
    assert layout["splits"]["gpt/embedding/token/embeddings"] == [0, 1]
    assert (model_dir / "tensor" / "rank-1" / "checkpoint").exists()


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["tp2_dp2", pytest.param("tp4_lamb", marks=pytest.mark.slow)])
def test_no_rank_forms_full_vocabulary_logits(request, name):
    _, out = request.getfixturevalue("slow_runs" if name in SLOW_SCENARIOS else "runs")
    tensor = {**SCENARIOS, **SLOW_SCENARIOS}[name][0]
    for rank in range(RANKS):  # vocab 320 over T ranks: the widest activation is 320 / T wide
        assert int(load(out, name, rank)["widest_activation"]) == 320 // tensor


@pytest.mark.slow
@pytest.mark.multiproc
def test_sequence_parallel_layer_norms_see_a_chunk_of_the_sequence(runs, slow_runs):
    (_, out), (_, slow_out) = runs, slow_runs
    for rank in range(RANKS):
        whole = int(load(out, "tp2_dp2", rank)["norm_rows"])
        assert int(load(slow_out, "tp2_dp2_sequence", rank)["norm_rows"]) == whole // 2


@pytest.mark.multiproc
def test_consolidated_checkpoint_resumes_on_one_device_and_generate_reads_the_pieces(
        gpt_data, runs, shared, tmp_path_factory, tmp_path):
    root, out = runs
    model_dir = root / "tp2_dp2"
    saved = load(out, "tp2_dp2", 0)
    before = sorted(os.listdir(model_dir))
    path = consolidate(str(model_dir), str(tmp_path / "one"))
    assert os.path.basename(path) == "ckpt-4" and sorted(os.listdir(model_dir)) == before
    cfg = tp_cfg(gpt_data, tmp_path / "one", 1, max_steps=6)
    cfg.train.strategy = "single"
    resumed = Trainer(cfg)
    assert int(resumed.step.numpy()) == 4
    for ours, theirs in zip(weights(resumed), listed(saved, "w")):
        np.testing.assert_array_equal(ours, theirs)
    # the optimizer state too: the single-device run's Adam moments after the same 4 steps
    # (atol 1e-7: with oneDNN's AVX2 kernels on an AMD EPYC one first moment of 4096, -4.1e-5,
    # ended 1.09e-8 apart; on Intel's AVX-512 ones all were within 1e-8)
    single, _, _ = shared_reference(shared, tmp_path_factory, gpt_data, RANKS // 2)
    for ours, theirs in zip(resumed.optimizer.variables, single.optimizer.variables):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-7)
    model, _ = load_model(str(model_dir))
    for ours, theirs in zip(model.trainable_variables, listed(saved, "w")):
        np.testing.assert_array_equal(ours.numpy(), theirs)
    resumed.fit()  # and trains on
    assert int(resumed.step.numpy()) == 6


@pytest.mark.slow
@pytest.mark.multiproc
def test_dropout_masks_are_shared_in_replicated_regions_and_own_in_split_heads(slow_runs):
    """A dropout's mask is a function of its generator state and the input shape: tensor peers
    (global ranks 0 and 1) hold equal states except for the attention-probability dropout of
    their own heads, which differ by the tensor rank."""
    _, out = slow_runs
    peers = [load(out, "tp2_dropout", r) for r in (0, 1)]
    own = np.flatnonzero(peers[0]["seed_own"]).tolist()
    count = len(peers[0]["seed_own"])
    assert len(own) == 2 and count == 1 + 2 * 3  # embedding; per block attn, resid, MLP
    assert np.isfinite(peers[0]["losses"]).all()
    for i in range(count):
        a, b = peers[0][f"seed{i}"], peers[1][f"seed{i}"]
        if i in own:
            np.testing.assert_array_equal(b - a, np.ones_like(a))
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.multiproc
def test_the_run_prints_its_rank_grid_and_what_each_tensor_rank_holds(runs):
    root, _ = runs
    log = read(root / "log.txt")
    assert "mesh: 4 ranks = data 2 x pipeline 1 x tensor 2" in log
    assert "tensor groups: [(0, 1), (2, 3)]" in log and "data groups: [(0, 2), (1, 3)]" in log
    assert "tensor parallel: each rank holds 1/2 of" in log
    assert "attention heads t*2..(t+1)*2-1, vocabulary rows t*160..(t+1)*160-1" in log


def test_a_single_device_checkpoint_restores_into_each_ranks_slices(gpt_data, tmp_path):
    """What a tensor-parallel run started on a single-device checkpoint holds: every weight and
    optimizer slot is its slice of the single-device state; dropout states as split_model."""
    import tensorflow as tf

    from tfbig.training.consolidate import OfflineSlice
    from tfbig.checkpoints.checkpoint import state_arrays
    from tfbig.distribute.tensor_parallel import restore_from_single_device

    class SliceOnLoad(OfflineSlice):
        def restore(self, trainer, path):
            restore_from_single_device(trainer, path, self.group, self.splits)

    cfg = tp_cfg(gpt_data, tmp_path, 1, max_steps=2, dropout=0.1)
    cfg.train.strategy = "single"
    single = Trainer(cfg)
    single.fit()
    path = tf.train.latest_checkpoint(str(tmp_path))
    full = state_arrays(single, {})
    pieces = []
    for rank in range(2):
        trainer = Trainer(cfg, strategy=SliceOnLoad(cfg, rank, 2, path))
        assert trainer.restored_from == path and int(trainer.step.numpy()) == 2
        pieces.append(state_arrays(trainer, trainer.strategy.splits))
    assert set(pieces[0]) == set(full)
    assert sum(piece is not None for _, piece in pieces[0].values()) > 20  # weights and slots
    for name, (value, _) in full.items():
        piece = pieces[0][name][1]
        values = [p[name][0] for p in pieces]
        if piece is not None:
            np.testing.assert_array_equal(join_slices(values, *piece), value)
        elif not name.startswith("rng/"):
            np.testing.assert_array_equal(values[0], value)
            np.testing.assert_array_equal(values[1], value)
        else:  # rank 0's generator states are the single device's; rank 1's own masks + 1
            np.testing.assert_array_equal(values[0], value)
            assert np.array_equal(values[1], value) or np.array_equal(values[1], value + 1)


def test_slices_of_q_k_v_blocks_join_back_to_the_full_array():
    full = np.arange(4 * 12).reshape(4, 12)  # 3 sections (q, k, v) of 4 columns
    pieces = [take_slice(full, -1, 3, t, 2) for t in range(2)]
    np.testing.assert_array_equal(pieces[0][:, :2], full[:, 0:2])  # q's first heads
    np.testing.assert_array_equal(pieces[0][:, 2:4], full[:, 4:6])  # k's first heads
    np.testing.assert_array_equal(join_slices(pieces, -1, 3), full)


@pytest.mark.parametrize("options, world, message", [
    (dict(tensor_parallel=3), 4, "--tensor_parallel=3 = 3 does not divide 4"),
    (dict(tensor_parallel=1, sequence_parallel=True), 4,
     "--sequence_parallel needs --tensor_parallel >= 2"),
])
def test_bad_tensor_parallel_flags_are_refused_before_training(options, world, message):
    with pytest.raises(ValueError, match=message):
        build_mesh(ParallelConfig(**options), world)


class _Task:
    """A model to split, without data."""

    seq_length = 16

    def __init__(self, **config):
        from tfbig.models.gpt import GPTConfig

        self.config = GPTConfig.from_preset("tiny", **config)

    def build_model(self):
        from tfbig.models.gpt import GPT

        model = GPT(self.config, name="gpt")
        model.build((None, self.seq_length))
        return model


@pytest.mark.parametrize("config, size, message", [
    (dict(vocab_size=320, hidden_size=32, num_heads=4), 3,
     "--tensor_parallel=3 does not divide num_heads=4"),
    (dict(vocab_size=321, hidden_size=32, num_heads=4), 2,
     r"--tensor_parallel=2 does not divide vocab_size \(pad the vocabulary"),
    (dict(vocab_size=320, hidden_size=32, num_heads=4, pre_layer_norm=False), 2,
     "no LayerNorm before its vocabulary projection"),
    (dict(vocab_size=321, hidden_size=24, num_heads=3, intermediate_size=48, sequence=True), 3,
     "the sequence length 16 must be a multiple of 3"),
])
def test_models_that_do_not_split_are_refused_with_the_reason(config, size, message):
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.layouts.tensor_layout import split_model

    sequence = config.pop("sequence", False)
    with pytest.raises(ValueError, match=message):
        split_model(_Task(**config), TensorGroup(None, 0, size, sequence))


@pytest.mark.parametrize("family", ["albert", "bert"])
def test_masked_lm_sequence_parallel_plan_keeps_the_heads_whole(family):
    """ALBERT's and BERT's heads read the [CLS] token and masked positions anywhere in the
    sequence: they run after the backbone's output is gathered, so their replicated weights'
    gradients are complete on every rank (not summed over the group); the rest is split like
    GPT's. BERT's blocks (one per layer) are each split as ALBERT's shared one."""
    from tfbig.layouts.tensor_plan import TensorGroup, whole_sequence_paths
    from tfbig.layouts.tensor_layout import split_model
    from tfbig.models.albert import AlbertConfig, AlbertForPretraining
    from tfbig.models.bert import BertConfig, BertForPretraining

    config, model_class, pair = {
        "albert": (AlbertConfig, AlbertForPretraining, "sop_head"),
        "bert": (BertConfig, BertForPretraining, "nsp_head")}[family]

    class MaskedLMTask:
        seq_length = 16

        def build_model(self):
            model = model_class(config.from_preset("tiny", vocab_size=320))
            model.build()
            return model

    model, splits = split_model(MaskedLMTask(), TensorGroup(None, 1, 2, True))
    whole = {p.split("/", 1)[1] for p in whole_sequence_paths(model)}  # below the model name
    split = {p.split("/", 1)[1] for p in splits}
    assert "mlm_head/bias" in split  # its vocabulary slice: never summed as replicated
    assert {p.rsplit("/", 1)[0] for p in whole - split} == {
        "mlm_head/dense", "mlm_head/norm", pair, "backbone/pooler"}
    if family == "bert":  # q, k, v and the first MLM layer of both blocks: half the columns
        assert {p for p in split if p.endswith("qkv/kernel")} == {
            "backbone/block_0/attn/qkv/kernel", "backbone/block_1/attn/qkv/kernel"}
        shapes = {v.path.split("/", 1)[1]: tuple(v.shape) for v in model.variables}
        assert shapes["backbone/block_1/attn/qkv/kernel"] == (32, 3 * 16)
        assert shapes["backbone/block_1/ffn/fc/kernel"] == (32, 64)
        assert shapes["backbone/embedding/word/embeddings"] == (160, 32)


@pytest.mark.parametrize("sequence", [False, True])
def test_sequence_parallel_dropouts_draw_their_own_masks(sequence):
    """Without sequence parallelism only the attention-probability dropouts (split heads) are
    offset by the tensor rank; with it also those of the sequence-split region (embedding,
    residuals), whose ranks hold different positions."""
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.layouts.tensor_layout import split_model

    import keras

    task = _Task(vocab_size=320, hidden_size=32, num_heads=4, num_layers=2, dropout=0.1)
    keras.utils.set_random_seed(0)
    full = [v.numpy() for v in task.build_model().variables if "seed_generator" in v.path]
    keras.utils.set_random_seed(0)
    local, _ = split_model(task, TensorGroup(None, 1, 2, sequence))
    seeds = [v for v in local.variables if "seed_generator" in v.path]
    attention = {id(b.attn.attn_dropout.seed_generator.state) for b in local.blocks}
    assert len(seeds) == len(full) == 1 + 2 * 3
    for v, value in zip(seeds, full):
        offset = 1 if sequence or id(v) in attention else 0
        np.testing.assert_array_equal(v.numpy() - value, np.full_like(value, offset))


def test_a_split_rank_holds_its_slice_of_the_single_device_initialisation():
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.layouts.tensor_layout import split_model

    import keras

    task = _Task(vocab_size=320, hidden_size=32, num_heads=4, num_layers=2)
    keras.utils.set_random_seed(0)
    reference = {v.path: v.numpy() for v in task.build_model().variables}
    keras.utils.set_random_seed(0)
    local, splits = split_model(task, TensorGroup(None, 1, 2))
    shapes = {v.path: tuple(v.shape) for v in local.variables}
    assert shapes["gpt/block_0/attn/qkv/kernel"] == (32, 48)  # 3 x (2 heads of 8)
    assert shapes["gpt/block_0/attn/proj/kernel"] == (16, 32)
    assert shapes["gpt/embedding/token/embeddings"] == (160, 32)
    for v in local.variables:
        if "seed_generator" in v.path:
            continue
        expected = reference[v.path]
        if v.path in splits:
            expected = take_slice(expected, *splits[v.path], 1, 2)
        np.testing.assert_array_equal(v.numpy(), expected)


@pytest.mark.multiproc
@pytest.mark.slow  # the slow launch's TP x ZeRO (PP x ZeRO-1's slot bytes: test_cross_rank)
@pytest.mark.parametrize("name", ["tp2_dp2_zero1", "tp2_dp2_zero3"])
def test_tensor_zero_ranks_hold_the_closed_form_of_their_state(gpt_data, request, name,
                                                              tmp_path):
    """TP2 x DP2 with --zero_stage=1: rank (d, t) holds tensor rank t's parameters whole
    (4 P_t bytes) and a 1/2 slice of each of them as master copy (4 S_t) and AdamW m, v (8 S_t),
    S_t = sum over t's variables of ceil(n / 2); its checkpoint piece is its own directory.
    --zero_stage=3: the parameters are those slices (the model's variables hold nothing)."""
    import math

    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.layouts.tensor_layout import split_model

    root, out = request.getfixturevalue("runs" if name in SCENARIOS else "slow_runs")
    cfg = tp_cfg(gpt_data, tmp_path, 2)
    task = get_task(cfg.train, cfg)
    stage = (SCENARIOS | SLOW_SCENARIOS)[name][1]["zero_stage"]
    for r in range(RANKS):
        result = load(out, name, r)
        tensor_rank = r % 2  # placement cluster: tensor ranks adjacent
        model, _ = split_model(task, TensorGroup(None, tensor_rank, 2))
        sizes = [math.prod(v.shape) for v in model.trainable_variables]
        slices = sum(math.ceil(n / 2) for n in sizes)
        assert int(result["bytes_parameters"]) == (0 if stage == 3 else 4 * sum(sizes))
        assert int(result["bytes_master_slices"]) == 4 * slices
        assert int(result["bytes_optimizer_slots"]) == 8 * slices
    for t, j in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        piece = root / name
        piece = piece / "tensor" / f"rank-{t}" if t else piece
        piece = piece / "zero" / f"shard-{j}" if j else piece
        assert (piece / "checkpoint").exists(), piece
    assert int(load(out, name, 0)["restored_step"]) == 2
    assert (root / name / "tensor.json").exists()
    assert (root / name / "zero.json").exists()
    model, _ = load_model(str(root / name))  # tfbig-generate joins the tensor pieces
    final = listed(load(out, name, 0), "w")
    for ours, theirs in zip(model.trainable_variables, final, strict=True):
        np.testing.assert_array_equal(ours.numpy(), theirs)
    with pytest.raises(ValueError, match=f"--zero_stage={stage} \\(zero.json\\)"):
        consolidate(str(root / name), str(tmp_path / "one"))


@pytest.mark.slow  # a launch of its own
@pytest.mark.multiproc
def test_a_non_finite_slice_on_one_tensor_rank_skips_the_step_on_all(slow_runs):
    """Only rank 3's slice of a split kernel is non-finite in step 1 (its tensor peer's is
    finite, and the data all-reduce reaches rank 1 only): every rank skips the step (weights
    unchanged, bit for bit; loss scale halved alike) instead of two applying it and waiting
    for the others in the clipping norm's sum, and step 2 trains all ranks alike."""
    from test_zero import check_the_poisoned_step_is_skipped_on_all

    _, out = slow_runs
    check_the_poisoned_step_is_skipped_on_all(out, "tp2_dp2_fp16_skip")
    for rank in range(RANKS):
        scales = load(out, "tp2_dp2_fp16_skip", rank)["loss_scales"]
        assert scales[1] == scales[0] / 2  # step 1 skipped, its scale halved, on every rank
