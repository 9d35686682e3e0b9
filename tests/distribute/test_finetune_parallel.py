"""Tensor-parallel and ZeRO fine-tuning (tfbig-classify, tfbig-squad with --strategy=horovod
--tensor_parallel / --zero_stage) through real `horovodrun -np 4 --gloo` launches, against one
process on the same global batches: per-step losses, every weight of the single-device
checkpoint the chief writes, and the first step's per-variable gradients (fp32); the chief's
predictions and scores (made with the assembled model) equal one process's, and a predict-only
run in one process reads the checkpoint back to the same answers.

Scenarios (tests/distribute/finetune_worker.py): the default launch runs BERT classification at
TP2 x DP2, BERT SQuAD with ZeRO-2 over partition groups of 2 (MiCS, two replica groups),
classification with ZeRO-3 (parameters gathered per layer) over partition groups of 2, and, in
fp16 at TP2 x DP2, one overflowing gradient slice on one rank that must skip the step on every
rank (that scenario runs no command); a slow launch runs BERT SQuAD at TP2 x DP2 with
--sequence_parallel, classification with ZeRO-1 over all 4 ranks, ALBERT (factorised
embedding, shared blocks) span fine-tuning at TP2 x DP2, mixed precision against one process of
the same precision (classification TP2 x DP2 fp16 and SQuAD ZeRO-2 fp16, both with the skip;
SQuAD TP2 x DP2 bf16, classification ZeRO-1 bf16), ZeRO-3 for BERT SQuAD over all 4 ranks
and ALBERT over groups of 2, and classification at TP2 x DP2 with ZeRO-1 (each tensor rank's
optimizer state sharded over its 2 data ranks). Rank 0's model state is checked against the
closed form.
Bad combinations are refused before any training, naming the flags.
"""
import dataclasses
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_classify import WORDS, _rows  # noqa: E402 - the same GLUE-style rows
from test_horovod import horovodrun, read  # noqa: E402

from tfbig.checkpoint import model_variables  # noqa: E402
from tfbig.classify import ClassifyOptions  # noqa: E402
from tfbig.classify import fine_tune as classify  # noqa: E402
from tfbig.convert import run_dir  # noqa: E402
from tfbig.distribute.finetune_parallel import ParallelOptions  # noqa: E402
from tfbig.errors import UsageError  # noqa: E402
from tfbig.models.bert import BertConfig, BertForPretraining  # noqa: E402
from tfbig.squad.cli import SquadOptions  # noqa: E402
from tfbig.squad.cli import fine_tune as squad  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "finetune_worker.py")
# vocabulary 20 and 2 heads: both split over a tensor group of 2
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no", "what"] + WORDS
STEPS = dict(max_steps=4, train_batch_size=8, learning_rate=3e-3, max_seq_length=24,
             xla=False)
BERT = dict(vocab_size=len(VOCAB), hidden_size=32, num_heads=2, num_layers=2,
            intermediate_size=64, seq_length=32, dropout=0.0)
ALBERT = dict(vocab_size=32, embedding_size=16, hidden_size=32, num_layers=2, num_heads=2,
              intermediate_size=48, seq_length=16, dropout=0.0)
FP16, BF16 = {"precision": "mixed_float16"}, {"precision": "mixed_bfloat16"}
SCENARIOS = {  # name: (command, options)
    "classify_tp2_dp2": ("classify", {"tensor_parallel": 2}),
    "squad_zero2_mics": ("squad", {"zero_stage": 2, "shard_degree": 2}),
    # parameters sharded too, gathered per layer (zero3.PLANS), over 2 partition groups of 2;
    # each rank slices the --init_checkpoint backbone its deferred build loaded
    "classify_zero3_mics": ("classify", {"zero_stage": 3, "shard_degree": 2}),
    # fp16: an overflow in one tensor rank's slice skips the step on all (no command run)
    "classify_tp2_dp2_fp16_skip": ("classify", {"tensor_parallel": 2, **FP16}),
}
SKIP_ONLY = {"classify_tp2_dp2_fp16_skip"}
SLOW_SCENARIOS = {
    "squad_tp2_dp2_sequence": ("squad", {"tensor_parallel": 2, "sequence_parallel": True}),
    "classify_zero1": ("classify", {"zero_stage": 1}),
    "albert_tp2_dp2": ("albert", {"tensor_parallel": 2}),
    # mixed precision: the skip as above, then the command follows one process of the same
    # precision
    "classify_tp2_dp2_fp16": ("classify", {"tensor_parallel": 2, **FP16}),
    "squad_zero2_mics_fp16": ("squad", {"zero_stage": 2, "shard_degree": 2, **FP16}),
    "squad_tp2_dp2_bf16": ("squad", {"tensor_parallel": 2, **BF16}),
    "classify_zero1_bf16": ("classify", {"zero_stage": 1, **BF16}),
    # ZeRO-3 over all 4 ranks: the pooler the span head leaves untrained keeps frozen slices
    "squad_zero3": ("squad", {"zero_stage": 3}),
    "albert_zero3_mics": ("albert", {"zero_stage": 3, "shard_degree": 2}),
    # each tensor rank's optimizer slots sharded over its 2 data ranks
    "classify_tp2_zero1": ("classify", {"tensor_parallel": 2, "zero_stage": 1}),
}
PARALLEL_FLAGS = {f.name for f in dataclasses.fields(ParallelOptions)}


def _squad_set(count, seed):
    """SQuAD 1.1 JSON: a 10-word context, the answer its words 4-5."""
    rng, paragraphs = np.random.default_rng(seed), []
    for i in range(count):
        words = list(rng.choice(WORDS, 10))
        start = len(" ".join(words[:3])) + 1
        paragraphs.append({"context": " ".join(words), "qas": [{
            "id": f"q{seed}-{i}", "question": "what " + " ".join(words[:3]),
            "answers": [{"text": " ".join(words[3:5]), "answer_start": start}]}]})
    return {"version": "1.1", "data": [{"title": "words", "paragraphs": paragraphs}]}


def write_files(root):
    """A random BERT run directory (tfbig-convert's layout) and the classification / SQuAD
    files under `root` (also tests/pipeline/test_pipeline_finetune.py's)."""
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    config = BertConfig(**BERT)
    keras.utils.set_random_seed(1)
    model = BertForPretraining(config)
    model.build()
    run_dir.write(str(root / "run"), config, {k: v.numpy() for k, v in
                                               model_variables(model).items()},
                  str(root / "vocab.txt"), True, "test")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(48, 2)))
    (root / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(16, 3)))
    for name, count, seed in (("train.json", 32, 4), ("dev.json", 8, 5)):
        (root / name).write_text(json.dumps(_squad_set(count, seed)))
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("finetune_parallel"))


def assert_same_checkpoints(ours, reference):
    """Two single-device fine-tuned checkpoints hold the same weights (rtol 1e-5)."""
    readers = [tf.train.load_checkpoint(str(path)) for path in (ours, reference)]
    keys = sorted(k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/"))
    assert keys == sorted(k for k in readers[0].get_variable_to_shape_map()
                          if k.startswith("model/")) and len(keys) > 20
    for key in keys:  # one single-device checkpoint: whole arrays under the same keys
        np.testing.assert_allclose(readers[0].get_tensor(key), readers[1].get_tensor(key),
                                   rtol=1e-5, atol=1e-6, err_msg=key)


def _options(command, files, parallel):
    if command == "albert":
        return {"config": ALBERT, "parallel": parallel, "batch_size": 8, "max_steps": 4,
                "learning_rate": 3e-3}
    common = {**STEPS, "init_checkpoint": str(files / "run"), **parallel}
    if command == "classify":
        return {**common, "train_file": str(files / "train.jsonl"),
                "eval_file": str(files / "dev.jsonl")}
    return {**common, "train_file": str(files / "train.json"),
            "predict_file": str(files / "dev.json"), "doc_stride": 8, "max_query_length": 8}


def launch(root, scenarios, files, timeout):
    plan = [{"name": name, "command": command, "out": str(root / "out"),
             "options": _options(command, files, {"strategy": "horovod", **parallel}
                                 if command != "albert" else parallel),
             "skip_only": name in SKIP_ONLY}
            for name, (command, parallel) in scenarios.items()]
    with open(root / "plan.json", "w") as f:
        json.dump(plan, f)
    code = horovodrun([WORKER, str(root / "plan.json")], root / "log.txt", timeout=timeout,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                      ranks=("-np", "4", "-H", "localhost:4"))
    assert code == 0, read(root / "log.txt")[-6000:]
    return root / "out"


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    return launch(tmp_path_factory.mktemp("launch"), SCENARIOS, files, timeout=900)


@pytest.fixture(scope="module")
def slow_runs(files, tmp_path_factory):
    # a loaded 2-core machine (load 30) took over 900 s for it
    return launch(tmp_path_factory.mktemp("launch_slow"), SLOW_SCENARIOS, files, timeout=1800)


def whole_weights(run, command):
    """{variable path: array} of the fine-tuned model of run directory `run`: tfbig-squad's
    single-device `finetuned` checkpoint; tfbig-classify's (the Trainer's) newest checkpoint,
    a tensor-parallel or ZeRO run's pieces joined."""
    from tfbig.checkpoint import reader_key
    from tfbig.distribute import tensor_layout, zero_checkpoint
    from tfbig.models.bert import BertClassifier

    if command != "classify":
        reader = tf.train.load_checkpoint(str(run / "finetuned"))
        return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
                if k.startswith("model/")}
    model = BertClassifier(BertConfig(**BERT), num_classes=2, name="bert_classifier")
    model.build()
    for layout, module in (("tensor.json", tensor_layout), ("zero.json", zero_checkpoint)):
        if (run / layout).exists():
            return module.assembled_weights(str(run), model)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run)))
    return {v.path: reader.get_tensor(reader_key(model, v)) for v in model.trainable_variables}


def assert_same_weights(ours, reference, command):
    mine, theirs = whole_weights(ours, command), whole_weights(reference, command)
    assert len(theirs) > 20 and set(theirs) <= set(mine)
    for key, value in theirs.items():
        np.testing.assert_allclose(mine[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def _reference(command, files, out, flags):
    """One process on the same global batches (the command itself, --strategy=single, with
    the scenario's other `flags`: --precision)."""
    if command == "classify":
        classify(ClassifyOptions(**_options(command, files, flags), output_dir=str(out)))
    elif command == "squad":
        squad(SquadOptions(**_options(command, files, flags), output_dir=str(out)))
    else:
        _albert_reference(out)


def _albert_reference(out):
    from finetune_worker import albert_features

    from tfbig.distribute.finetune import write_checkpoint
    from tfbig.distribute.base import Strategy
    from tfbig.models.albert import AlbertConfig
    from tfbig.squad import finetune

    config = AlbertConfig(**ALBERT)
    model = finetune.build_model(config, None, seed=0)
    losses = finetune.train(model, albert_features(config, 64, config.seq_length, 0),
                            batch_size=8, learning_rate=3e-3, max_steps=4, xla=False, log=None)
    write_checkpoint(Strategy(), model, str(out))
    (out / "train_losses.json").write_text(json.dumps(losses))


def _check(out, name, files, tmp_path):
    """Losses, checkpoint weights, first-step gradients and outputs equal one process's."""
    if name in SKIP_ONLY:
        return _check_skipped(out, name)
    command, parallel = {**SCENARIOS, **SLOW_SCENARIOS}[name]
    one = tmp_path / "one"
    flags = {k: v for k, v in parallel.items() if k not in PARALLEL_FLAGS}
    _reference(command, files, one, flags)
    if flags.get("precision", "fp32") != "fp32":
        _check_mixed(out / name, one, flags["precision"], command)
        if flags["precision"] == "mixed_float16":
            _check_skipped(out, name)
        return
    ours = out / name
    if command == "classify" and parallel.get("zero_stage"):  # the Trainer's ZeRO pieces
        layout = json.loads((ours / "zero.json").read_text())
        assert layout["zero_stage"] == parallel["zero_stage"], layout
    losses = [json.loads((run / "train_losses.json").read_text()) for run in (ours, one)]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert_same_weights(ours, one, command)
    with np.load(out / f"{name}.gradients.npz") as grads:
        paths = [k[len("ours/"):] for k in grads.files if k.startswith("ours/")]
        assert len(paths) > 20 and len(paths) == sum(k.startswith("held/") for k in grads.files)
        for path in paths:
            assert np.abs(grads[f"reference/{path}"]).max() > 0, path
            np.testing.assert_allclose(grads[f"ours/{path}"], grads[f"reference/{path}"],
                                       rtol=1e-5, atol=1e-7, err_msg=path)
        _check_bytes(name, grads)
    outputs = {"classify": ["eval_results.json", "predictions.jsonl"],
               "squad": ["predictions.json", "eval_results.json"]}.get(command, [])
    for output in outputs:  # squad: the chief's assembled model; classify: every rank
        assert (ours / output).read_text() == (one / output).read_text(), output
    if command == "squad":  # one process reads the written checkpoint back (predict only)
        options = {k: v for k, v in _options(command, files, {}).items()
                   if k not in ("train_file", "init_checkpoint")}
        squad(SquadOptions(**options, output_dir=str(ours)))
        assert (ours / "predictions.json").read_text() == (one / "predictions.json").read_text()


def _weights(run, command):
    weights = whole_weights(run, command)
    keys = sorted(weights)
    return keys, [weights[k] for k in keys]


# Mixed precision against one process of the same precision: the float16/bfloat16 products of
# 2 rows per replica (4 ranks) vs 8 rows in one process, and split matmuls' partial sums, are
# rounded apart in the last bits of an 11/8-bit mantissa, and float32 sums of gradients run in
# another order. (loss rtol, largest weight difference, share of weights within 1e-4); the
# largest is one AdamW step (learning rate 3e-3: its first steps move a weight by about the
# learning rate whatever the gradient's size, so a near-zero gradient rounded to the other
# sign moves it the other way). Measured (4 steps): losses within 1.2e-5 (fp16) and 5e-5
# (bf16) relative; weights within 1.4e-5 (TP2 fp16), 9.3e-5 (ZeRO-2 fp16), 6.3e-5 (ZeRO-1
# bf16) and 5e-4 (TP2 bf16, 99.6% within 1e-4).
MIXED_TOLERANCE = {"mixed_float16": (2e-4, 3e-3, 0.99), "mixed_bfloat16": (1e-3, 3e-3, 0.98)}


def _check_mixed(ours, one, precision, command):
    loss_rtol, largest, share = MIXED_TOLERANCE[precision]
    losses = [json.loads((run / "train_losses.json").read_text()) for run in (ours, one)]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=loss_rtol)
    if (one / "loss_scales.json").exists():  # classify fp16: the same scales, no skipped step
        assert (ours / "loss_scales.json").read_text() == (one / "loss_scales.json").read_text()
    (keys, mine), (their_keys, theirs) = _weights(ours, command), _weights(one, command)
    assert keys == their_keys and len(keys) > 20
    diff = np.concatenate([np.abs(a - b).ravel() for a, b in zip(mine, theirs)])
    print(f"{ours.name}: losses {losses}, weights: largest difference {diff.max():.3g}, "
          f"share within 1e-4 {np.mean(diff < 1e-4):.4f}")
    assert diff.max() < largest and np.mean(diff < 1e-4) > share


def _check_skipped(out, name):
    """Every rank skipped the step of rank 3's overflow (weights as before, loss scale
    halved) and then trained the next step to the same weights."""
    ranks = [np.load(out / f"{name}.skip.rank{r}.npz") for r in range(4)]
    count = sum(k.startswith("before/") for k in ranks[0].files)
    assert count > 20
    for rank in ranks:
        scales = rank["scales"]
        assert scales[1] == scales[0] / 2 and scales[2] == scales[1], scales
        moved = 0.0
        for i in range(count):
            np.testing.assert_array_equal(rank[f"skipped/{i}"], rank[f"before/{i}"])
            np.testing.assert_array_equal(rank[f"next/{i}"], ranks[0][f"next/{i}"])
            moved = max(moved, np.abs(rank[f"next/{i}"] - rank[f"before/{i}"]).max())
        assert moved > 1e-3  # the step after it trained


def _check_bytes(name, grads):
    """The model state rank 0 held against the closed form (fp32): ZeRO: its P parameters
    (none with stage 3), S = sum of ceil(n / N) master elements over the variables it trains,
    2 S AdamW moments (stage 3 also the frozen slices of the weights it does not train); TP:
    the split variables' 1/T, the replicated ones whole."""
    full = 4 * sum(grads[k].size for k in grads.files if k.startswith("reference/"))
    local = [int(grads[k]) for k in grads.files if k.startswith("held/")]
    frozen = [int(grads[k]) for k in grads.files if k.startswith("frozen/")]
    held = {k[len("bytes/"):]: int(grads[k]) for k in grads.files if k.startswith("bytes/")}
    command, parallel = {**SCENARIOS, **SLOW_SCENARIOS}[name]
    tensor, stage = parallel.get("tensor_parallel", 1), parallel.get("zero_stage", 0)
    if stage:
        shards = parallel.get("shard_degree") or 4 // tensor
        master = 4 * sum(-(-n // shards) for n in local)
        expected = {"parameters": 0 if stage == 3 else 4 * sum(local), "master_slices": master,
                    "optimizer_slots": 2 * master}
        if frozen:
            expected["frozen_slices"] = 4 * sum(-(-n // shards) for n in frozen)
        assert held == expected, held
        # span fine-tuning leaves the pooler untrained: frozen slices
        assert bool(frozen) == (stage == 3 and command != "classify"), frozen
        if tensor > 1:  # TP x ZeRO-1: the tensor rank's slices, ~1/T
            assert full / tensor < held["parameters"] < 0.6 * full, (held, full)
        return
    assert held["parameters"] == 4 * sum(local)
    if tensor > 1:
        assert full / tensor < held["parameters"] < 0.6 * full, (held, full)  # ~1/T
    if "split_parameters" in held:  # TP alone
        split, replicated = held["split_parameters"], held["replicated_parameters"]
        assert split * tensor > full / 2 and split * tensor + replicated == full, held


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fine_tuning_split_or_sharded_equals_one_process(runs, name, files, tmp_path):
    _check(runs, name, files, tmp_path)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(SLOW_SCENARIOS))
def test_more_layouts_equal_one_process(slow_runs, name, files, tmp_path):
    _check(slow_runs, name, files, tmp_path)


@pytest.mark.parametrize("flags, message", [
    (dict(tensor_parallel=2), r"--tensor_parallel=2 needs --strategy=horovod \(got "
                              r"--strategy=single\): tfbig-\w+ splits or shards"),
    (dict(strategy="multiworker", zero_stage=1), r"--zero_stage=1 needs --strategy=horovod"),
    (dict(strategy="horovod", zero_stage=4), r"--zero_stage=4: tfbig-\w+ takes 0 \(none\), 1 "
                                             r"\(optimizer slots\), 2 \(\+ gradients\) or 3"),
    (dict(strategy="horovod", zero_stage=3, precision="mixed_float16"),
     r"--precision=mixed_float16 with --zero_stage=3: tfbig-\w+ shards the parameters in fp32 "
     r"only"),
    (dict(strategy="horovod", tensor_parallel=2, zero_stage=2),
     r"--tensor_parallel=2 with --zero_stage=2: not built"),
    (dict(strategy="horovod", tensor_parallel=2, zero_stage=1, precision="mixed_bfloat16"),
     r"--precision=mixed_bfloat16 with --tensor_parallel=2 --zero_stage=1: tfbig-\w+ runs that "
     r"layout in fp32 only"),
    (dict(strategy="horovod", sequence_parallel=True),
     r"--sequence_parallel needs --tensor_parallel >= 2"),
    (dict(strategy="horovod", shard_degree=2), r"--shard_degree=2 needs --zero_stage=1, 2 or 3"),
    (dict(strategy="pipeline", zero_stage=1), r"--zero_stage=1 needs --strategy=horovod \(got "
                                              r"--strategy=pipeline\)"),
])
def test_unbuilt_combinations_are_refused_before_training(flags, message, files, tmp_path):
    options = {**_options("squad", files, {}), **flags, "output_dir": str(tmp_path / "o")}
    with pytest.raises(UsageError, match=message):
        squad(SquadOptions(**options))
    assert not (tmp_path / "o" / "finetuned.index").exists()


@pytest.mark.parametrize("strategy, flags, message", [
    ("single", dict(tensor_parallel=2),
     r"--tensor_parallel=2 has no effect with --strategy=single; it applies to "
     r"--strategy=horovod"),
    ("multiworker", dict(zero_stage=1), r"--zero_stage=1 has no effect with "
                                        r"--strategy=multiworker"),
    ("horovod", dict(zero_stage=4), r"--zero_stage=4: expected 0 \(no sharding\), 1"),
    ("horovod", dict(tensor_parallel=2, zero_stage=2),
     r"--tensor_parallel=2 with --zero_stage=2 is not supported by --strategy=horovod yet"),
    ("horovod", dict(sequence_parallel=True), r"--sequence_parallel needs --tensor_parallel >= 2"),
    ("horovod", dict(shard_degree=2), r"--shard_degree=2 needs --zero_stage=1, 2 or 3"),
])
def test_tfbig_classify_refuses_what_the_trainer_refuses(strategy, flags, message, files,
                                                         tmp_path):
    """tfbig-classify's layouts are the Trainer's: refused before training as tfbig-train's."""
    options = {k: v for k, v in _options("classify", files, {}).items()}
    with pytest.raises(ValueError, match=message):
        classify(ClassifyOptions(**options, strategy=strategy, output_dir=str(tmp_path / "o")),
                 **flags)
    assert not list((tmp_path / "o").glob("ckpt-*"))


@pytest.mark.parametrize("family, head", [("bert_classify", "classifier_head"),
                                          ("bert_squad", "span_head"),
                                          ("albert_squad", "span_head")])
def test_fine_tuning_plans_split_the_backbone_and_keep_the_head_whole(family, head):
    """tensor_layout.fine_tune_plan: the backbone split as in pretraining (q, k, v, MLP and the
    word table halved), the task head replicated and outside the sequence-split region (its
    gradients are complete on every rank, never summed over the tensor group)."""
    from tfbig.distribute.tensor_layout import TensorGroup, split_model, whole_sequence_paths
    from tfbig.models.albert import AlbertConfig, AlbertForQuestionAnswering
    from tfbig.models.bert import BertClassifier, BertForQuestionAnswering

    build = {"bert_classify": lambda: BertClassifier(BertConfig(**BERT), num_classes=3),
             "bert_squad": lambda: BertForQuestionAnswering(BertConfig(**BERT)),
             "albert_squad": lambda: AlbertForQuestionAnswering(AlbertConfig(**ALBERT))}[family]

    class Task:
        seq_length = 16

        def build_model(self):
            model = build()
            model.build()
            return model

    model, splits = split_model(Task(), TensorGroup(None, 1, 2, True))
    split = {p.split("/", 1)[1] for p in splits}
    whole = {p.split("/", 1)[1] for p in whole_sequence_paths(model)}
    assert not any(p.startswith(head) for p in split)
    assert {f"{head}/kernel", f"{head}/bias"} <= whole and "backbone/pooler/kernel" in whole
    assert "backbone/embedding/word/embeddings" in split
    shapes = {v.path.split("/", 1)[1]: tuple(v.shape) for v in model.variables}
    blocks = "backbone/group_0" if family == "albert_squad" else "backbone/block_1"
    assert shapes[f"{blocks}/attn/qkv/kernel"] == (32, 3 * 16)
    assert shapes[f"{head}/kernel"] == (32, 3 if family == "bert_classify" else 2)
