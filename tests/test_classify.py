"""tfbig-classify: a tiny random BERT in a run directory learns a pair task whose label is
which of two words the first sentence holds (accuracy >= 0.9 on held-out pairs), the scores
agree with the written predictions, and bad columns/labels are errors naming the file. Two
processes (MultiWorkerMirrored workers under tfbig-launch, or horovodrun) equal one process on
the same global batches: losses and every fine-tuned weight."""
import json

import keras
import numpy as np
import pytest

from tfbig.checkpoints.checkpoint import model_variables
from tfbig.commands.classify import ClassifyOptions, fine_tune
from tfbig.tasks.classify import read_examples, scores
from tfbig.convert import run_dir
from tfbig.errors import UsageError
from tfbig.models.bert import BertConfig, BertForPretraining

WORDS = "the a cat dog sat ran on mat big small red blue".split()
# MFU against a given peak: no CPU matmul probe (seconds at each process's first fit)
FAST = {"peak_tflops": 1.0}


def _rows(count, seed):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        key = rng.choice(["yes", "no"])
        a = list(rng.choice(WORDS, 6))
        a.insert(int(rng.integers(0, 7)), key)
        rows.append({"sentence1": " ".join(a), "sentence2": " ".join(rng.choice(WORDS, 5)),
                     "label": "entail" if key == "yes" else "contradict"})
    return rows


def squad_set(count, seed):
    """SQuAD 1.1 JSON: a 10-word context, the answer its words 4-5."""
    rng, paragraphs = np.random.default_rng(seed), []
    for i in range(count):
        words = list(rng.choice(WORDS, 10))
        start = len(" ".join(words[:3])) + 1
        paragraphs.append({"context": " ".join(words), "qas": [{
            "id": f"q{seed}-{i}", "question": "what " + " ".join(words[:3]),
            "answers": [{"text": " ".join(words[3:5]), "answer_start": start}]}]})
    return {"version": "1.1", "data": [{"title": "words", "paragraphs": paragraphs}]}


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "yes", "no"]
                               + WORDS) + "\n")
    config = BertConfig(vocab_size=19, hidden_size=32, num_heads=2, num_layers=2,
                        seq_length=32, dropout=0.0)
    keras.utils.set_random_seed(1)
    model = BertForPretraining(config)
    model.build()
    run_dir.write(str(root / "run"), config, {k: v.numpy() for k, v in
                                               model_variables(model).items()},
                  str(vocab), True, "test")
    return root


def test_learns_a_pair_task_and_scores_match_predictions(bert_run, tmp_path):
    train, dev = tmp_path / "train.tsv", tmp_path / "dev.jsonl"
    header = "sentence1\tsentence2\tlabel\n"
    train.write_text(header + "".join(f"{r['sentence1']}\t{r['sentence2']}\t{r['label']}\n"
                                      for r in _rows(128, 0)))
    dev_rows = _rows(40, 1)
    dev.write_text("".join(json.dumps(r) + "\n" for r in dev_rows))
    result = fine_tune(ClassifyOptions(
        init_checkpoint=str(bert_run / "run"), train_file=str(train), eval_file=str(dev),
        output_dir=str(tmp_path / "out"), max_seq_length=24, train_batch_size=16,
        learning_rate=3e-3, max_steps=150), **FAST)
    assert result["accuracy"] >= 0.9
    rows = [json.loads(line) for line in
            (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    predicted = [row["label"] for row in rows]
    assert [row["idx"] for row in rows] == list(range(40))  # no idx column: the row number
    truth = [r["label"] for r in dev_rows]
    assert result["accuracy"] == pytest.approx(np.mean(np.array(predicted) == np.array(truth)))
    assert json.loads((tmp_path / "out" / "labels.json").read_text()) == ["contradict", "entail"]


def test_example_index_is_glues_column_or_the_row_number(tmp_path):
    tsv = tmp_path / "test.tsv"  # GLUE's own files start with an "index" column
    tsv.write_text("index\tsentence1\tsentence2\tlabel\n7\ta b\tc\tx\n9\td\te\ty\n")
    assert [e[3] for e in read_examples(str(tsv), ClassifyOptions())] == [7, 9]
    jsonl = tmp_path / "dev.jsonl"
    jsonl.write_text('{"idx": 3, "sentence1": "a", "sentence2": "b", "label": "x"}\n'
                     '{"sentence1": "c", "sentence2": "d", "label": "y"}\n')
    assert [e[3] for e in read_examples(str(jsonl), ClassifyOptions())] == [3, 1]


def test_scores_f1_by_hand():
    labels, predicted = np.array([0, 1, 1, 1, 0]), np.array([0, 1, 0, 1, 1])
    # MCC: (TP x TN - FP x FN) / sqrt(...) = (2 x 1 - 1 x 1) / sqrt(3 x 3 x 2 x 2) = 1/6
    assert scores(labels, predicted, 2) == {"accuracy": 0.6, "f1": pytest.approx(2 / 3),
                                            "mcc": pytest.approx(1 / 6)}
    three = scores(np.array([0, 1, 2]), np.array([0, 1, 1]), 3)  # F1s 1, 2/3, 0: macro 5/9
    assert three["f1"] == pytest.approx(5 / 9)


def test_bad_columns_and_labels_name_the_file(bert_run, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(20, 0)))
    with pytest.raises(UsageError, match=r"train\.jsonl: no examples or no column \['gold'\]"):
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"),
                                  train_file=str(train), label="gold", max_seq_length=24))
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({**_rows(1, 2)[0], "label": "neutral"}) + "\n")
    with pytest.raises(UsageError, match=r"dev\.jsonl: labels \['neutral'\] are not in"):
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                                  eval_file=str(dev), output_dir=str(tmp_path / "o"),
                                  max_seq_length=24, max_steps=1, train_batch_size=4))


def _launch(strategy, flags, out, root):
    """Two processes of `python -m tfbig.commands.classify` under horovodrun or tfbig-launch."""
    import os
    import subprocess
    import sys

    program = [sys.executable, "-m", "tfbig.commands.classify", f"--strategy={strategy}",
               f"--output_dir={out}", *flags]
    launcher = ([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
                 "localhost:2", "--gloo"] if strategy == "horovod" else
                [sys.executable, "-m", "tfbig.commands.launch", "--workers=2", "--"])
    return subprocess.run(launcher + program, cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": root,
                                            "TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", [  # the default run: fp16 on Horovod ranks (below) and
    # SQuAD on TF_CONFIG workers (tests/squad/test_bert_squad.py)
    pytest.param("multiworker", marks=pytest.mark.slow),  # two TF_CONFIG workers: ~15 s idle
    pytest.param("horovod", marks=pytest.mark.slow)])  # one horovodrun launch: ~25 s idle
def test_two_processes_equal_one_on_the_same_global_batches(strategy, bert_run, tmp_path):
    """Training: losses and every weight of the final checkpoint; prediction on both
    processes, gathered: the same predictions.jsonl and scores on 13 examples (uneven)."""
    import os

    import tensorflow as tf

    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(64, 2)))
    dev.write_text("".join(json.dumps(r) + "\n" for r in _rows(13, 5)))
    common = dict(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                  eval_file=str(dev), max_seq_length=24, train_batch_size=8,
                  learning_rate=3e-3, max_steps=4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [f"--{k}={v}" for k, v in common.items()] + ["--noxla", "--peak_tflops=1"]
    done = _launch(strategy, flags, tmp_path / "two", root)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    saved = json.loads((tmp_path / "two" / "config.json").read_text())
    assert saved["train"]["strategy"] == strategy and saved["train"]["batch_size"] == 8
    fine_tune(ClassifyOptions(output_dir=str(tmp_path / "one"), xla=False, **common), **FAST)
    losses = [json.loads((tmp_path / run / "train_losses.json").read_text())
              for run in ("two", "one")]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    readers = [tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path / run)))
               for run in ("two", "one")]
    keys = [k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/")]
    assert len(keys) > 30
    for key in keys:
        ours, theirs = readers[0].get_tensor(key), readers[1].get_tensor(key)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=key)
    predictions = [(tmp_path / run / "predictions.jsonl").read_text().splitlines()
                   for run in ("two", "one")]
    assert len(predictions[1]) == 13 and predictions[0] == predictions[1]
    scores_ = [json.loads((tmp_path / run / "eval_results.json").read_text())
               for run in ("two", "one")]
    assert scores_[0] == pytest.approx(scores_[1], abs=1e-12)


def test_an_unknown_strategy_is_refused_naming_the_flag(bert_run, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(8, 0)))
    with pytest.raises(ValueError, match=r"--strategy='tpu': expected one of"):
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                                  output_dir=str(tmp_path / "o"), strategy="tpu",
                                  max_seq_length=24))


PRECISION = dict(max_seq_length=24, train_batch_size=8, learning_rate=3e-3, max_steps=4,
                 xla=False)


@pytest.mark.slow  # two fine-tunings; mixed precision's half compute: tests/test_trainer.py's bf16/fp16 cases
def test_mixed_precision_computes_in_half_and_stays_close_to_fp32(bert_run, tmp_path):
    """--precision: the same steps in fp32, mixed_float16 (loss scaled by 2**15, nothing
    skipped) and mixed_bfloat16 give close but not equal losses; the global dtype policy is
    float32 again afterwards."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(32, 3)))
    losses = {}
    for precision in ("fp32", "mixed_float16", "mixed_bfloat16"):
        out = tmp_path / precision
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                                  output_dir=str(out), precision=precision, **PRECISION),
                  **FAST)
        losses[precision] = np.array(json.loads((out / "train_losses.json").read_text()))
        assert keras.mixed_precision.global_policy().name == "float32"
    assert json.loads((tmp_path / "mixed_float16" / "loss_scales.json").read_text()) == \
        [2.0 ** 15] * 4  # at each step: none skipped
    assert not (tmp_path / "fp32" / "loss_scales.json").exists()
    for precision, rtol in (("mixed_float16", 5e-3), ("mixed_bfloat16", 3e-2)):
        assert not np.array_equal(losses[precision], losses["fp32"]), precision
        np.testing.assert_allclose(losses[precision], losses["fp32"], rtol=rtol,
                                   err_msg=precision)


def test_unknown_precision_is_refused_naming_the_flag(bert_run):
    with pytest.raises(ValueError, match=r"--precision='fp8': expected one of"):
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"), train_file="t.tsv",
                                  precision="fp8"))


def _launch_worker(strategy, run, tmp_path):
    """Two processes of tests/classify_worker.py under horovodrun or tfbig-launch."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    launcher = ([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
                 "localhost:2", "--gloo"] if strategy == "horovod" else
                [sys.executable, "-m", "tfbig.commands.launch", "--workers=2", "--"])
    worker = os.path.join(root, "tests", "classify_worker.py")
    return subprocess.run(launcher + [sys.executable, worker, str(path)], cwd=root,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", [  # a launch each (slow): the default run fine-tunes on
    # two TF_CONFIG workers in test_bert_squad and skips a poisoned fp16 step on Horovod ranks
    # in test_horovod
    pytest.param("horovod", marks=pytest.mark.slow),  # one horovodrun launch
    pytest.param("multiworker", marks=pytest.mark.slow)])  # two TF_CONFIG workers
def test_fp16_two_processes_skip_a_poisoned_step_and_equal_one(strategy, bert_run, tmp_path):
    """--precision=mixed_float16 on 2 processes, step 1's loss and gradients NaN on process 1
    only: both skip it (weights unchanged, loss scale halved), and every loss scale is the
    single-process run's on the doubled batch (poisoned alike); losses and final weights equal
    it within fp16 rounding."""
    from classify_worker import poisoned_run

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(64, 2)))
    common = dict(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                  output_dir=str(tmp_path / "run"), precision="mixed_float16", **PRECISION)
    done = _launch_worker(strategy, {"options": {**common, "strategy": strategy},
                                     "poison_step": 1, "poisoned_rank": 1,
                                     "out": str(tmp_path)}, tmp_path)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in (0, 1)]
    _, single = poisoned_run(ClassifyOptions(**{**common, "output_dir": str(tmp_path / "one")}),
                             1, poisoned=True)
    scales = np.array(single["scales"])
    assert np.sum(scales[1:] < scales[:-1]) == 1 and scales[2] == scales[1] / 2  # 1 skipped
    count = len([k for k in single if k.startswith("final")])
    assert count > 30
    for rank, result in enumerate(ranks):
        where = f"rank {rank}"
        np.testing.assert_array_equal(result["scales"], scales, err_msg=where)
        assert np.isnan(result["losses"][1]), where  # averaged with the poisoned process's
        for i in range(count):  # the skipped step changed nothing
            np.testing.assert_array_equal(result[f"initial{i}"], result[f"after{i}"])
        kept = [0, 2, 3]
        np.testing.assert_allclose(result["losses"][kept], np.array(single["losses"])[kept],
                                   rtol=2e-4, err_msg=where)  # measured 2e-6
        ours = np.concatenate([result[f"final{i}"].ravel() for i in range(count)])
        theirs = np.concatenate([single[f"final{i}"].ravel() for i in range(count)])
        initial = np.concatenate([result[f"initial{i}"].ravel() for i in range(count)])
        # fp16 products of 4 rows (each process) vs 8 rows: measured max 2.0e-4, 98% within 1e-5
        assert np.max(np.abs(ours - theirs)) < 1e-3, where
        assert np.mean(np.abs(ours - theirs) < 1e-5) > 0.95, where
        # it trained: 3 updates moved 46% of the entries by more than 1e-4 (the rest: table
        # rows of tokens the batches lack, which get no gradient)
        assert np.mean(np.abs(ours - initial) > 1e-4) > 0.3, where
    for i in range(count):  # the two processes hold the same weights
        np.testing.assert_array_equal(ranks[0][f"final{i}"], ranks[1][f"final{i}"])


@pytest.mark.slow  # ~85 s on a loaded 2-core machine: three runs of the command
def test_kill_9_and_the_same_command_again_equal_an_uninterrupted_run(bert_run, tmp_path):
    """tfbig-classify --deterministic killed (SIGKILL) after a random checkpointed step, then
    started again with the same flags: it resumes from the last checkpoint in --output_dir and
    ends with bit-identical weights and predictions."""
    import sys

    from kill_and_resume import assert_killed_and_rerun_equals_uninterrupted

    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(48, 7)))
    dev.write_text("".join(json.dumps(r) + "\n" for r in _rows(11, 8)))
    steps = 8

    def command(out):
        return [sys.executable, "-m", "tfbig.commands.classify", f"--init_checkpoint={bert_run / 'run'}",
                f"--train_file={train}", f"--eval_file={dev}", "--max_seq_length=24",
                "--train_batch_size=8", "--learning_rate=3e-3", f"--max_steps={steps}",
                "--deterministic", "--checkpoint_every=1", "--noxla", "--peak_tflops=1",
                "--monitor_interval_ms=0", f"--output_dir={out}"]

    assert_killed_and_rerun_equals_uninterrupted(
        command, tmp_path, steps, ("predictions.jsonl", "eval_results.json"))