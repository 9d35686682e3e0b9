"""tfbig-classify: a tiny random BERT in a run directory learns a pair task whose label is
which of two words the first sentence holds (accuracy >= 0.9 on held-out pairs), the scores
agree with the written predictions, and bad columns/labels are errors naming the file. Two
processes (MultiWorkerMirrored workers under tfbig-launch, or horovodrun) equal one process on
the same global batches: losses and every fine-tuned weight."""
import json

import keras
import numpy as np
import pytest

from tfbig.checkpoint import model_variables
from tfbig.classify import ClassifyOptions, fine_tune, scores
from tfbig.convert import run_dir
from tfbig.errors import UsageError
from tfbig.models.bert import BertConfig, BertForPretraining

WORDS = "the a cat dog sat ran on mat big small red blue".split()


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
        learning_rate=3e-3, max_steps=150))
    assert result["accuracy"] >= 0.9
    predicted = [json.loads(line)["label"] for line in
                 (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    truth = [r["label"] for r in dev_rows]
    assert result["accuracy"] == pytest.approx(np.mean(np.array(predicted) == np.array(truth)))
    assert json.loads((tmp_path / "out" / "labels.json").read_text()) == ["contradict", "entail"]


def test_scores_f1_by_hand():
    labels, predicted = np.array([0, 1, 1, 1, 0]), np.array([0, 1, 0, 1, 1])
    assert scores(labels, predicted, 2) == {"accuracy": 0.6, "f1": pytest.approx(2 / 3)}
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
    """Two processes of `python -m tfbig.classify` under horovodrun or tfbig-launch."""
    import os
    import subprocess
    import sys

    program = [sys.executable, "-m", "tfbig.classify", f"--strategy={strategy}",
               f"--output_dir={out}", *flags]
    launcher = ([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
                 "localhost:2", "--gloo"] if strategy == "horovod" else
                [sys.executable, "-m", "launch.local", "--workers=2", "--"])
    return subprocess.run(launcher + program, cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": root,
                                            "TF_CPP_MIN_LOG_LEVEL": "2"})


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", [
    "multiworker",  # two TF_CONFIG workers (tfbig-launch): ~15 s idle
    pytest.param("horovod", marks=pytest.mark.slow)])  # one horovodrun launch: ~25 s idle
def test_two_processes_equal_one_on_the_same_global_batches(strategy, bert_run, tmp_path):
    import os

    import tensorflow as tf

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(64, 2)))
    common = dict(init_checkpoint=str(bert_run / "run"), train_file=str(train),
                  max_seq_length=24, train_batch_size=8, learning_rate=3e-3, max_steps=4)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [f"--{k}={v}" for k, v in common.items()] + ["--noxla"]
    done = _launch(strategy, flags, tmp_path / "two", root)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):  # two processes, each training on its half of every global batch
        assert f"4 steps on 2 replica(s) (rank {rank})" in done.stdout + done.stderr
    fine_tune(ClassifyOptions(output_dir=str(tmp_path / "one"), xla=False, **common))
    losses = [json.loads((tmp_path / run / "train_losses.json").read_text())
              for run in ("two", "one")]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    readers = [tf.train.load_checkpoint(str(tmp_path / run / "finetuned"))
               for run in ("two", "one")]
    keys = [k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/")]
    assert len(keys) > 30
    for key in keys:
        ours, theirs = readers[0].get_tensor(key), readers[1].get_tensor(key)
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("strategy", ["pipeline", "mirrored"])
def test_other_strategies_are_refused_naming_the_flag(strategy, bert_run):
    with pytest.raises(UsageError, match=rf"--strategy='{strategy}': tfbig-classify runs on "
                                         r"single \| horovod \| multiworker; pipeline"):
        fine_tune(ClassifyOptions(init_checkpoint=str(bert_run / "run"), train_file="t.tsv",
                                  strategy=strategy))
