"""tfbig-squad end to end on a tiny pretrained ALBERT: initialisation, files, scores, CLI."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfbig.tasks import squad_model
from tfbig.commands.squad import SquadOptions, fine_tune


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, qa_tokenizer, qa_play_paths):
    """A tfbig-train --model=albert run directory (tiny model, a few steps, seq 64)."""
    from tfbig.data import shakespeare
    from tfbig.config import ExperimentConfig
    from tfbig.data import prepare
    from tfbig.tasks import get_task
    from tfbig.training.trainer import Trainer

    text = tmp_path_factory.mktemp("pretrain_text")
    with open(qa_play_paths[0][0], encoding="utf-8") as file:
        for index, scene in enumerate(shakespeare.play_scenes(file.read())):
            (text / f"scene{index:02d}.txt").write_text(scene, encoding="utf-8")
    data_dir = str(tmp_path_factory.mktemp("pretrain_data"))
    prepare([str(text)], data_dir, seq_length=64, vocab_size=600, shard_size_mb=1,
            tokenizer=qa_tokenizer.path, validation_fraction=0.2, format="albert")
    cfg = ExperimentConfig()
    for key, value in dict(model="albert", preset="tiny", data_dir=data_dir, batch_size=8,
                           model_dir=str(tmp_path_factory.mktemp("pretrain_run")),
                           max_steps=3, eval_steps=1, optimizer="lamb", xla=False).items():
        setattr(cfg.train, key, value)
    Trainer(cfg, task=get_task(cfg.train, cfg)).fit()
    return cfg.train.model_dir


def write(tmp_path, name, dataset):
    path = str(tmp_path / name)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(dataset, file)
    return path


def options(tmp_path, qa_sets, **overrides):
    fields = dict(train_file=write(tmp_path, "train.json", qa_sets["2.0", "train"]),
                  predict_file=write(tmp_path, "dev.json", qa_sets["2.0", "dev"]),
                  output_dir=str(tmp_path / "out"), max_seq_length=64, doc_stride=32,
                  max_query_length=24, train_batch_size=16, max_steps=4, learning_rate=1e-3,
                  xla=False)
    return SquadOptions(**{**fields, **overrides})


# MFU against a given peak: no CPU matmul probe (seconds at each process's first fit)
FAST = {"peak_tflops": 1.0}


def test_backbone_starts_from_the_pretrained_checkpoint(pretrained_run):
    config, tokenizer = squad_model.pretrained_config(pretrained_run)
    assert os.path.basename(tokenizer.path) == "tokenizer.model" and config.vocab_size == 600
    model = squad_model.build_model(config, pretrained_run)
    reader = tf.train.load_checkpoint(pretrained_run)
    (key,) = [k for k in reader.get_variable_to_shape_map()
              if k.startswith("model/") and all(p in k for p in ("group_0", "ffn", "fc", "kernel"))]
    saved = reader.get_tensor(key)
    np.testing.assert_array_equal(model.backbone.group_0.ffn.fc.kernel.numpy(), saved)
    fresh = squad_model.build_model(config, None, seed=5)
    assert not np.array_equal(fresh.backbone.group_0.ffn.fc.kernel.numpy(), saved)


def test_fine_tune_predict_and_score_v2(pretrained_run, qa_sets, tmp_path):
    scores = fine_tune(options(tmp_path, qa_sets, init_checkpoint=pretrained_run), **FAST)
    out = tmp_path / "out"
    predictions = json.loads((out / "predictions.json").read_text())
    ids = {qa["id"] for a in qa_sets["2.0", "dev"]["data"] for p in a["paragraphs"]
           for qa in p["qas"]}
    assert set(predictions) == ids == set(json.loads((out / "null_odds.json").read_text()))
    assert json.loads((out / "eval_results.json").read_text()) == pytest.approx(scores)
    for key in ("exact", "f1", "HasAns_f1", "NoAns_f1", "best_f1", "null_score_diff_threshold"):
        assert np.isfinite(scores[key])
    assert scores["f1"] >= scores["best_f1"] - 1e-6  # the tuned threshold was used
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    assert all(len(candidates) <= 20 for candidates in nbest.values())
    # Predict-only, from the fine-tuned checkpoint, via the console script's code path.
    subprocess.run([sys.executable, "-m", "tfbig.commands.squad", f"--output_dir={out}",
                    f"--predict_file={tmp_path / 'dev.json'}",
                    "--max_seq_length=64", "--doc_stride=32", "--max_query_length=24",
                    f"--null_score_diff_threshold={scores['null_score_diff_threshold']}",
                    "--noxla", "--peak_tflops=1"], check=True, capture_output=True)
    assert json.loads((out / "predictions.json").read_text()) == predictions


def test_v1_from_random_init(pretrained_run, qa_sets, tmp_path):
    scores = fine_tune(options(tmp_path, qa_sets, init_checkpoint=pretrained_run,
                               random_init=True,
                               train_file=write(tmp_path, "t1.json", qa_sets["1.1", "train"]),
                               predict_file=write(tmp_path, "d1.json", qa_sets["1.1", "dev"])),
                       **FAST)
    assert set(scores) == {"exact", "f1", "total"} and 0 <= scores["f1"] <= 100
    predictions = json.loads((tmp_path / "out" / "predictions.json").read_text())
    nbest = json.loads((tmp_path / "out" / "nbest_predictions.json").read_text())
    # v1.1 has no null answer: each prediction is its question's best span. Only a question
    # none of whose top-20 starts and ends form a valid span (a barely trained model) gets "".
    assert predictions == {qid: spans[0]["text"] if spans else "" for qid, spans in nbest.items()}
    assert sum(bool(text) for text in predictions.values()) >= 0.9 * len(predictions)


def test_bad_inputs_are_clear_errors(tmp_path, qa_sets, pretrained_run):
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_format": "gpt"}))
    with pytest.raises(ValueError, match="holds a 'gpt' model"):
        fine_tune(options(tmp_path, qa_sets, init_checkpoint=str(tmp_path / "gpt")))
    with pytest.raises(ValueError, match="above the model's position table"):
        fine_tune(options(tmp_path, qa_sets, init_checkpoint=pretrained_run,
                          max_seq_length=256))
    with pytest.raises(ValueError, match="is SQuAD 2.0 but --version=1.1"):
        fine_tune(options(tmp_path, qa_sets, init_checkpoint=pretrained_run, version="1.1"))
    with pytest.raises(ValueError, match="no fine-tuned model in --output_dir"):
        fine_tune(options(tmp_path, qa_sets, init_checkpoint=pretrained_run, train_file="",
                          output_dir=str(tmp_path / "empty")))


def test_time_budget_is_refused_naming_the_reason(tmp_path):
    """tfbig-squad and tfbig-classify take tfbig-train's flags but --time_budget_minutes: the
    recipe's warmup and decay are shares of a step count known before the first step."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-m", "tfbig.commands.squad", "--time_budget_minutes=5",
         f"--output_dir={tmp_path / 'out'}", "--train_file=train.json"],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": root})
    assert result.returncode != 0
    assert "--time_budget_minutes is tfbig-train's; the fine-tuning commands train for " \
           "--num_train_epochs or --max_steps" in result.stderr, result.stderr[-2000:]
    assert "give --max_steps" in result.stderr and not (tmp_path / "out").exists()
