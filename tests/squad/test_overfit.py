"""The SQuAD chain is sound: features -> labels -> loss -> post-processing -> official scores.

A small randomly initialised ALBERT fine-tuned (the Trainer running tfbig.tasks.squad) on 64
questions of the embedded v2.0 set (answerable and unanswerable) must answer those same
questions almost perfectly. A defect anywhere in the chain (labels off by one token, a window
that loses the answer, spans mapped to the wrong characters, a wrong null rule) caps this score
far below 95.
"""
import json

import pytest

from tfbig.training import finetune
from tfbig.models.albert import AlbertConfig
from tfbig.commands.squad import SquadOptions
from tfbig.data.squad.features import examples_from_dataset, first_questions


@pytest.mark.slow
def test_fine_tuning_fits_64_training_questions(qa_sets, qa_tokenizer, tmp_path):
    from tfbig.tasks.squad import SquadTask
    from tfbig.training.trainer import Trainer

    dataset = first_questions(qa_sets["2.0", "train"], 64)
    examples = examples_from_dataset(dataset)
    assert len(examples) == 64 and 0 < sum(e.is_impossible for e in examples) < 64
    path = tmp_path / "train.json"
    path.write_text(json.dumps(dataset))
    options = SquadOptions(train_file=str(path), predict_file=str(path),
                           output_dir=str(tmp_path / "out"), max_seq_length=128, doc_stride=64,
                           max_query_length=32, null_score_diff_threshold=0.0,
                           train_batch_size=16, max_steps=400, learning_rate=1e-3,
                           warmup_proportion=0.05, weight_decay=0.0, log_every=100)
    config = AlbertConfig(vocab_size=qa_tokenizer.vocab_size, embedding_size=64, hidden_size=128,
                          num_layers=4, num_heads=4, seq_length=128)
    cfg = finetune.experiment(options, "squad", peak_tflops=1.0)
    task = SquadTask(cfg.train, options, config, qa_tokenizer)
    finetune.set_steps(cfg, options, task.manifest.splits["train"].records)
    scores = Trainer(cfg, task=task).fit()["eval"]
    print(scores)
    assert scores["HasAns_f1"] >= 95 and scores["NoAns_f1"] >= 95 and scores["f1"] >= 95
