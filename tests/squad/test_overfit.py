"""The SQuAD chain is sound: features -> labels -> loss -> post-processing -> official scores.

A small randomly initialised ALBERT fine-tuned on 64 questions of the embedded v2.0 set (answerable
and unanswerable) must answer those same questions almost perfectly. A defect anywhere in the
chain (labels off by one token, a window that loses the answer, spans mapped to the wrong
characters, a wrong null rule) caps this score far below 95.
"""
import pytest

from tfbig.models.albert import AlbertConfig
from tfbig.squad import evaluate, finetune, postprocess
from tfbig.squad.features import convert_examples, examples_from_dataset, first_questions


@pytest.mark.slow
def test_fine_tuning_fits_64_training_questions(qa_sets, qa_tokenizer):
    dataset = first_questions(qa_sets["2.0", "train"], 64)
    examples = examples_from_dataset(dataset)
    assert len(examples) == 64 and 0 < sum(e.is_impossible for e in examples) < 64
    features = convert_examples(examples, qa_tokenizer, max_seq_length=128, doc_stride=64,
                                max_query_length=32)
    config = AlbertConfig(vocab_size=qa_tokenizer.vocab_size, embedding_size=64, hidden_size=128,
                          num_layers=4, num_heads=4, seq_length=128)
    model = finetune.build_model(config, seed=0)
    losses = finetune.train(model, features, batch_size=16, max_steps=400, learning_rate=1e-3,
                            warmup_fraction=0.05, weight_decay=0.0, log=None)
    starts, ends = finetune.predict(model, features)
    answers, diffs, _ = postprocess.best_spans(examples, features, starts, ends)
    predictions = postprocess.apply_null_threshold(answers, diffs, 0.0)
    scores = evaluate.evaluate(dataset, predictions, "2.0")
    print({"first_loss": losses[0], "last_loss": losses[-1], **scores})
    assert scores["HasAns_f1"] >= 95 and scores["NoAns_f1"] >= 95 and scores["f1"] >= 95
