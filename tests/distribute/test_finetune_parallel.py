"""Tensor-parallel and ZeRO fine-tuning: tfbig-classify and tfbig-squad (the Trainer running
tfbig.tasks.classify / tfbig.tasks.squad) under real `horovodrun -np 4 --gloo` launches of the
commands themselves, against one process on the same global batches: per-step losses, every
trained weight of the run's checkpoint (a tensor-parallel or ZeRO run's pieces joined;
tests/equality.py's rule), and the predictions and scores, made on every rank and gathered.

Scenarios, all slow (launches of 30-60 s each, over the default run's budget: the default run
has pretraining's TP and ZeRO/MiCS launches, tests/distribute/test_tensor_parallel.py and
test_zero.py, fine-tuning on two Horovod ranks, tests/test_classify.py, and the in-process
tests below): BERT classification at TP2 x DP2, BERT SQuAD with ZeRO-2 over partition groups
of 2 (MiCS, two replica groups), classification with ZeRO-1 over all 4 ranks, SQuAD ZeRO-3
over partition groups of 2, SQuAD ZeRO-2 in fp16 against one process of the same precision,
SQuAD at TP2 x DP2, SQuAD at TP2 x PP2 (tensor groups inside 2 cross-rank stages; every rank's
first-step gradients too, tests/distribute/squad_worker.py), and a Llama-family run's
classifier at TP2 x DP2 and ZeRO-3 and its span model at TP2 x DP2 (25-30 s each). In process
(default run): a split span model keeps the pooler frozen, and cross-rank stages of a
fine-tuning model are cut by its own head (what the TP launches first failed on). A SQuAD ZeRO
run's checkpoint is read back by one process (--strategy=horovod --zero_stage, re-sharded on
load) to the same predictions. Bad combinations are refused before any training, naming the
flags.
"""
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from equality import RecordedGradients  # noqa: E402
from test_classify import WORDS, _rows, squad_set  # noqa: E402 - the same words
from test_horovod import horovodrun, read  # noqa: E402
from test_llama_finetune import LLAMA, write_llama_run  # noqa: E402

from tfbig.checkpoints.checkpoint import model_variables  # noqa: E402
from tfbig.commands.classify import ClassifyOptions  # noqa: E402
from tfbig.commands.classify import fine_tune as classify  # noqa: E402
from tfbig.convert import run_dir  # noqa: E402
from tfbig.models.bert import BertConfig, BertForPretraining  # noqa: E402
from tfbig.models.llama import LlamaConfig  # noqa: E402
from tfbig.commands.squad import SquadOptions  # noqa: E402
from tfbig.commands.squad import fine_tune as squad  # noqa: E402

# vocabulary 20 and 2 heads: both split over a tensor group of 2
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no", "what"] + WORDS
STEPS = dict(max_steps=4, train_batch_size=8, learning_rate=3e-3, max_seq_length=24,
             xla=False, log_every=1)
BERT = dict(vocab_size=len(VOCAB), hidden_size=32, num_heads=2, num_layers=2,
            intermediate_size=64, seq_length=32, dropout=0.0)
ALBERT = dict(vocab_size=32, embedding_size=16, hidden_size=32, num_layers=2, num_heads=2,
              intermediate_size=48, seq_length=16, dropout=0.0)
FP16, BF16 = {"precision": "mixed_float16"}, {"precision": "mixed_bfloat16"}
PARALLEL_FLAGS = {"tensor_parallel", "sequence_parallel", "zero_stage", "shard_degree"}
FAST = {"peak_tflops": 1.0}  # MFU against a given peak: no CPU matmul probe per run
SCENARIOS = {  # name: (command, flags); all slow (the module's docstring says why)
    "classify_tp2_dp2": ("classify", {"tensor_parallel": 2}),
    "squad_zero2_mics": ("squad", {"zero_stage": 2, "shard_degree": 2}),
    # parameters sharded too, gathered per layer (the model's layout().gather_per_call), over 2 partition groups of 2;
    # each rank slices the --init_checkpoint backbone its deferred build loaded
    "classify_zero3_mics": ("classify", {"zero_stage": 3, "shard_degree": 2}),
    "classify_zero1": ("classify", {"zero_stage": 1}),
    # the span model's --init_checkpoint backbone loaded into ZeRO-3's slices alike (through
    # the Keras variables: run_dir.restore_backbone); 3 min on 2 busy cores
    "squad_zero3_mics": ("squad", {"zero_stage": 3, "shard_degree": 2}),
    "squad_zero2_mics_fp16": ("squad", {"zero_stage": 2, "shard_degree": 2, **FP16}),
    # the span model split (its frozen pooler stays frozen: tensor_layout.split_model); 65 s
    # idle: the in-process tests below cover it in the default run
    "squad_tp2_dp2": ("squad", {"tensor_parallel": 2}),
    # a Llama-family run's classifier (tests/test_llama_finetune.py): grouped-query heads, the
    # SwiGLU MLP and the word table split, the last-token head replicated
    "llama_classify_tp2_dp2": ("classify", {"tensor_parallel": 2, "backbone": "llama"}),
    # its weights sharded and gathered per layer (the classifier's layout().gather_per_call)
    "llama_classify_zero3": ("classify", {"zero_stage": 3, "backbone": "llama"}),
    # the span head on a split Llama (every position's logits, after the replicated final norm)
    "llama_squad_tp2_dp2": ("squad", {"tensor_parallel": 2, "backbone": "llama"}),
}


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
        (root / name).write_text(json.dumps(squad_set(count, seed)))
    write_llama_run(root)
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("finetune_parallel"))


def assert_same_checkpoints(ours, reference):
    """Two single-device checkpoints hold the same weights (rtol 1e-5)."""
    readers = [tf.train.load_checkpoint(str(path)) for path in (ours, reference)]
    keys = sorted(k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/"))
    assert keys == sorted(k for k in readers[0].get_variable_to_shape_map()
                          if k.startswith("model/")) and len(keys) > 20
    for key in keys:
        np.testing.assert_allclose(readers[0].get_tensor(key), readers[1].get_tensor(key),
                                   rtol=1e-5, atol=1e-6, err_msg=key)


def _options(command, files, flags):
    flags = dict(flags)
    common = {**STEPS, "init_checkpoint": str(files / flags.pop("backbone", "run")), **flags}
    if command == "classify":
        return {**common, "train_file": str(files / "train.jsonl"),
                "eval_file": str(files / "dev.jsonl")}
    return {**common, "train_file": str(files / "train.json"),
            "predict_file": str(files / "dev.json"), "doc_stride": 8, "max_query_length": 8}


OWN = {"classify": ClassifyOptions, "squad": SquadOptions}
RUN = {"classify": classify, "squad": squad}


def launch(root, command, flags, files):
    """`horovodrun -np 4 python -m tfbig.<command> --strategy=horovod ...`: the run directory."""
    module = {"classify": "tfbig.commands.classify", "squad": "tfbig.commands.squad"}[command]
    args = [f"--{k}={v}" for k, v in _options(command, files, flags).items()
            if not isinstance(v, bool)]
    args += [f"--{'' if v else 'no'}{k}" for k, v in _options(command, files, flags).items()
             if isinstance(v, bool)]
    out = root / "two"
    code = horovodrun(["-m", module, "--strategy=horovod", f"--output_dir={out}",
                       "--dropout=0.0", "--peak_tflops=1", *args], root / "log.txt",
                      ranks=("-np", "4", "-H", "localhost:4"))
    assert code == 0, read(root / "log.txt")[-6000:]
    return out


def whole_weights(run, command, backbone="run"):
    """{variable path: array} of the trained weights in run directory `run`'s newest checkpoint,
    a tensor-parallel or ZeRO run's pieces joined."""
    from tfbig.checkpoints.checkpoint import reader_key
    from tfbig.layouts import tensor_layout, zero_checkpoint
    from tfbig.models.bert import BertClassifier
    from tfbig.models.llama_heads import LlamaClassifier
    from tfbig.tasks.squad_model import build_model

    if backbone == "llama" and command == "classify":
        model = LlamaClassifier(LlamaConfig(**LLAMA), num_classes=2, name="llama_classifier")
        model.build()
    elif backbone == "llama":
        model = build_model(LlamaConfig(**LLAMA))
    elif command == "classify":
        model = BertClassifier(BertConfig(**BERT), num_classes=2, name="bert_classifier")
        model.build()
    else:
        model = build_model(BertConfig(**BERT))
    for layout, module in (("tensor.json", tensor_layout), ("zero.json", zero_checkpoint)):
        if (run / layout).exists():
            return module.assembled_weights(str(run), model)
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(run)))
    return {v.path: reader.get_tensor(reader_key(model, v)) for v in model.trainable_variables}


def _check(name, files, tmp_path):
    """Losses, trained weights and outputs of the 4-rank run equal one process's."""
    command, parallel = SCENARIOS[name]
    ours = launch(tmp_path, command, parallel, files)
    one = tmp_path / "one"
    flags = {k: v for k, v in parallel.items() if k not in PARALLEL_FLAGS}
    recorded = []
    RUN[command](OWN[command](**_options(command, files, flags), output_dir=str(one)),
                 before_fit=lambda trainer: recorded.append(RecordedGradients(trainer)),
                 dropout=0.0, **FAST)
    if flags.get("precision", "fp32") != "fp32":
        return _check_mixed(ours, one, flags["precision"], command)
    if command == "classify" and parallel.get("zero_stage"):  # the Trainer's ZeRO pieces
        layout = json.loads((ours / "zero.json").read_text())
        assert layout["zero_stage"] == parallel["zero_stage"], layout
    if parallel.get("tensor_parallel"):  # the weights were split (the backbone's plan)
        splits = json.loads((ours / "tensor.json").read_text())["splits"]
        assert len(splits) >= 13, sorted(splits)  # 6 (BERT) or 7 (Llama) per layer, table
    losses = [json.loads((run / "train_losses.json").read_text()) for run in (ours, one)]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    weights = whole_weights(ours, command, parallel.get("backbone", "run"))
    assert len(recorded[0].paths) > 20
    recorded[0].assert_equal({p: weights[p] for p in recorded[0].paths})
    outputs = {"classify": ["eval_results.json", "predictions.jsonl"],
               "squad": ["predictions.json", "eval_results.json"]}[command]
    for output in outputs:  # every rank predicted its rows, gathered in dataset order
        assert (ours / output).read_text() == (one / output).read_text(), output
    if command == "squad" and (ours / "zero.json").exists():
        # one process reads the sharded checkpoint back, re-sharded on load (predict only)
        options = {k: v for k, v in _options(command, files, {}).items()
                   if k not in ("train_file", "init_checkpoint")}
        (ours / "predictions.json").unlink()
        squad(SquadOptions(**options, output_dir=str(ours), strategy="horovod"),
              zero_stage=parallel["zero_stage"], **FAST)
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




@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fine_tuning_split_or_sharded_equals_one_process(name, files, tmp_path):
    _check(name, files, tmp_path)


SQUAD_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "squad_worker.py")
# tfbig-squad under TP2 x PP2 on 4 ranks (tensor groups inside each of 2 cross-rank stages),
# 1F1B over 2 micro-batches
TP_PP = {"tensor_parallel": 2, "pipeline_stages": 2, "num_microbatches": 2, "schedule": "1f1b"}


def _held(result, prefix):
    return {str(p): result[f"{prefix}{i}"] for i, p in enumerate(result["paths"])}


def _as_held(result, path, full):
    """`full` (one process's array) as rank `result` holds weight `path`: its slice if split."""
    from tfbig.layouts.tensor_layout import take_slice

    splits = json.loads(str(result["splits"]))
    return take_slice(full, *splits[path], int(result["tensor"]), 2) if path in splits else full


@pytest.mark.slow  # 3 min on 2 busy cores
@pytest.mark.multiproc
def test_squad_tp2_pp2_equals_one_process(files, tmp_path):
    """tfbig-squad --strategy=horovod --tensor_parallel=2 --pipeline_stages=2 (4 ranks) against
    one process on the same global batches: every rank's first-step gradients (every variable,
    every slice, rtol 1e-5), the losses of 4 steps, the trained weights (tests/equality.py's
    rule) and the predictions, made by the last stage's ranks and gathered."""
    ours, out = tmp_path / "four", tmp_path / "ranks"
    out.mkdir()
    options = {**_options("squad", files, {}), "strategy": "horovod", "output_dir": str(ours)}
    (tmp_path / "run.json").write_text(json.dumps({
        "options": options, "overrides": {**TP_PP, "dropout": 0.0, **FAST}, "out": str(out)}))
    code = horovodrun([SQUAD_WORKER, str(tmp_path / "run.json")], tmp_path / "log.txt",
                      ranks=("-np", "4", "-H", "localhost:4"))
    assert code == 0, read(tmp_path / "log.txt")[-6000:]
    one, recorded = tmp_path / "one", []
    squad(SquadOptions(**_options("squad", files, {}), output_dir=str(one)),
          before_fit=lambda trainer: recorded.append(RecordedGradients(trainer)),
          dropout=0.0, **FAST)
    reference, first = recorded[0], dict(zip(recorded[0].paths, recorded[0].gradients()[0]))
    losses = [json.loads((run / "train_losses.json").read_text()) for run in (ours, one)]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    covered = set()
    for rank in range(4):
        with np.load(out / f"rank{rank}.npz") as data:
            result = {key: data[key] for key in data.files}
        where = f"rank {rank} (stage {int(result['stage'])}, tensor {int(result['tensor'])})"
        for path, gradient in _held(result, "g").items():
            assert np.abs(first[path]).max() > 0, path
            np.testing.assert_allclose(gradient, _as_held(result, path, first[path]),
                                       rtol=1e-5, atol=1e-7, err_msg=f"{where}: {path}")
        for path, value in _held(result, "w").items():
            reference.assert_equal_piece(path, value, lambda full, path=path: _as_held(
                result, path, full), err_msg=where)
            covered.add((path, int(result["tensor"]) if path in json.loads(
                str(result["splits"])) else None))
        assert 0 < len(_held(result, "w")) < len(first), where  # a stage's share
    split = {p for p, t in covered if t is not None}
    assert split and covered == ({(p, t) for p in split for t in range(2)}
                                 | {(p, None) for p in set(first) - split})
    for output in ("predictions.json", "eval_results.json"):
        assert (ours / output).read_text() == (one / output).read_text(), output


@pytest.mark.parametrize("strategy, flags, message", [
    ("single", dict(tensor_parallel=2),
     r"--tensor_parallel=2 has no effect with --strategy=single; it applies to "
     r"--strategy=horovod"),
    ("multiworker", dict(zero_stage=1), r"--zero_stage=1 has no effect with "
                                        r"--strategy=multiworker"),
    ("horovod", dict(zero_stage=4), r"--zero_stage=4: expected 0 \(no sharding\), 1"),
    ("horovod", dict(tensor_parallel=2, pipeline_stages=2, zero_stage=2),
     r"--pipeline_stages=2 with --zero_stage=2 is not supported: each stage accumulates"),
    ("horovod", dict(sequence_parallel=True), r"--sequence_parallel needs --tensor_parallel >= 2"),
    ("horovod", dict(shard_degree=2), r"--shard_degree=2 needs --zero_stage=1, 2 or 3"),
])
@pytest.mark.parametrize("command", [  # squad: the same Trainer checks, seconds each (slow)
    "classify", pytest.param("squad", marks=pytest.mark.slow)])
def test_the_commands_refuse_what_the_trainer_refuses(command, strategy, flags, message, files,
                                                      tmp_path):
    """tfbig-classify's and tfbig-squad's layouts are the Trainer's: refused before training
    as tfbig-train's, naming the flags."""
    options = _options(command, files, {})
    with pytest.raises(ValueError, match=message):
        RUN[command](OWN[command](**options, strategy=strategy, output_dir=str(tmp_path / "o")),
                     **flags)
    assert not list((tmp_path / "o").glob("ckpt-*"))


def _squad_task():
    from tfbig.tasks.squad_model import build_model

    class Task:  # what split_model and stage_plan read of tfbig.tasks.squad.SquadTask
        seq_length = 24
        model_config = BertConfig(**BERT)

        def build_model(self):
            return build_model(self.model_config)

        def layer_specs(self):
            from tfbig.models.shapes import fine_tune_specs

            return fine_tune_specs(self.model_config, self.seq_length)

    return Task()


def test_a_split_span_model_keeps_its_pooler_frozen():
    """The span head reads tokens only, so tfbig.tasks.squad_model freezes the pooler; each tensor
    rank's model trains the same weights (a trained pooler had no gradient: the first TP
    step of tfbig-squad failed)."""
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.layouts.tensor_layout import split_model

    task = _squad_task()
    whole = {v.path for v in task.build_model().trainable_variables}
    local, _ = split_model(task, TensorGroup(None, 1, 2))
    assert {v.path for v in local.trainable_variables} == whole
    assert not any("pooler" in path for path in whole)


def test_cross_rank_stages_of_the_span_model_hold_only_their_layers():
    """--strategy=horovod --pipeline_stages cuts a fine-tuning model by its task's specs (the
    span head on the last stage), not pretraining's (whose heads read the word table and own
    no span head: every stage held the span head, the last a stray table copy)."""
    from tfbig.config import PipelineConfig
    from tfbig.layouts.tensor_plan import TensorGroup
    from tfbig.pipeline.cross_rank import stage_plan
    from tfbig.pipeline.tensor_stage import build_tensor_stage

    task = _squad_task()
    specs, plan = stage_plan(task, PipelineConfig(), 2)
    assert specs == task.layer_specs()
    held = [{v.path.split("/", 1)[1] for v in build_tensor_stage(
        task, plan, specs, stage, "/device:CPU:0", TensorGroup(None, 0, 2))[0].model
        .trainable_variables} for stage in range(2)]
    assert "backbone/embedding/word/embeddings" in held[0] - held[1]
    assert {"span_head/kernel", "span_head/bias"} <= held[1] - held[0]


@pytest.mark.parametrize("family, head", [("bert_classify", "classifier_head"),
                                          ("bert_squad", "span_head"),
                                          ("albert_squad", "span_head")])
def test_fine_tuning_plans_split_the_backbone_and_keep_the_head_whole(family, head):
    """tfbig.models.layout.fine_tune_layout: the backbone split as in pretraining (q, k, v, MLP and the
    word table halved), the task head replicated and outside the sequence-split region (its
    gradients are complete on every rank, never summed over the tensor group)."""
    from tfbig.layouts.tensor_plan import TensorGroup, whole_sequence_paths
    from tfbig.layouts.tensor_layout import split_model
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
