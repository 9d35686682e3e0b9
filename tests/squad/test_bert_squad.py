"""tfbig-squad on BERT: a random BERT written in the Hugging Face format, converted by
tfbig-convert, fine-tuned and scored from its run directory; WordPiece character spans give
back every answer; predicting again from --output_dir reads the BERT back."""
import json
import os
import re

import keras
import numpy as np
import pytest
from safetensors.numpy import save_file

from tfbig.checkpoint import model_variables
from tfbig.convert import ConvertOptions, bert_names, convert
from tfbig.models.bert import BertConfig, BertForPretraining
from tfbig.squad import features as squad_features
from tfbig.squad import finetune
from tfbig.squad.cli import SquadOptions, fine_tune


def _contexts(squad):
    return [p["context"] for a in squad["data"] for p in a["paragraphs"]]


def _first(squad, paragraphs):
    """The first `paragraphs` paragraphs of the first article (keeps the test short)."""
    article = squad["data"][0]
    return {**squad, "data": [{**article, "paragraphs": article["paragraphs"][:paragraphs]}]}


def _vocab(texts, path, size=600):
    """Special pieces, every character (and its ## form), then the most frequent words."""
    words, chars = {}, set()
    for text in texts:
        lowered = text.lower()
        chars |= {c for c in lowered if not c.isspace()}
        for word in re.findall(r"\w+", lowered):
            words[word] = words.get(word, 0) + 1
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(chars) + \
        ["##" + c for c in sorted(chars)]
    pieces += [w for w, _ in sorted(words.items(), key=lambda kv: -kv[1]) if w not in chars]
    pieces = pieces[:size]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(pieces) + "\n")
    return path, len(pieces)


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, qa_sets):
    """A random BERT (hidden 36, 3 heads) in a Hugging Face directory, converted."""
    root = tmp_path_factory.mktemp("bert_squad")
    texts = [c for s in qa_sets.values() for c in _contexts(s)]
    vocab, size = _vocab(texts, str(root / "vocab.txt"))
    config = BertConfig(vocab_size=size, hidden_size=36, num_heads=3, intermediate_size=52,
                        num_layers=2, seq_length=64, dropout=0.0)
    keras.utils.set_random_seed(0)
    model = BertForPretraining(config)
    model.build()
    weights = {k: v.numpy() for k, v in model_variables(model).items()}
    hf = root / "hf"
    hf.mkdir()
    save_file(bert_names.google_to_hf(bert_names.tfbig_to_google(weights, 2)),
              str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({
        "model_type": "bert", "vocab_size": size, "hidden_size": 36, "num_hidden_layers": 2,
        "num_attention_heads": 3, "intermediate_size": 52, "max_position_embeddings": 64,
        "hidden_act": "gelu_new", "hidden_dropout_prob": 0.0}))
    (hf / "vocab.txt").write_text(open(vocab, encoding="utf-8").read(), encoding="utf-8")
    convert(ConvertOptions(source=str(hf), output_dir=str(root / "run")))
    return str(root / "run"), weights


def test_wordpiece_spans_give_back_every_answer(bert_run, qa_sets):
    config, tokenizer = finetune.pretrained_config(bert_run[0])
    assert isinstance(config, BertConfig) and tokenizer.lowercase
    squad = qa_sets["1.1", "train"]
    checked = 0
    for article in squad["data"]:
        for paragraph in article["paragraphs"][:20]:
            ids, starts, ends = squad_features.token_char_spans(tokenizer, paragraph["context"])
            assert len(ids) == len(tokenizer.encode(paragraph["context"]))
            for qa in paragraph["qas"]:
                answer = qa["answers"][0]
                first, last = squad_features.answer_token_span(
                    starts, ends, answer["answer_start"],
                    answer["answer_start"] + len(answer["text"]))
                span = paragraph["context"][starts[first]:ends[last]]
                assert span == answer["text"], (span, answer["text"])
                checked += 1
    assert checked > 20


def test_fine_tune_bert_from_a_converted_run(bert_run, qa_sets, tmp_path):
    run, weights = bert_run
    model = finetune.build_model(finetune.pretrained_config(run)[0], run)
    np.testing.assert_array_equal(model.backbone.blocks[1].ffn.fc.kernel.numpy(),
                                  weights["backbone/block_1/ffn/fc/kernel"])
    for name, split in (("train.json", "train"), ("dev.json", "dev")):
        (tmp_path / name).write_text(json.dumps(_first(qa_sets["2.0", split], 12)))
    options = SquadOptions(init_checkpoint=run, train_file=str(tmp_path / "train.json"),
                           predict_file=str(tmp_path / "dev.json"), output_dir=str(tmp_path / "o"),
                           max_seq_length=64, doc_stride=32, max_query_length=24,
                           train_batch_size=16, max_steps=3, learning_rate=1e-3, xla=False)
    scores = fine_tune(options)
    assert {"exact", "f1", "HasAns_f1", "best_f1"} <= set(scores)
    saved = json.loads((tmp_path / "o" / "squad_config.json").read_text())
    assert saved["model_format"] == "bert" and saved["tokenizer"]["lowercase"] is True
    predictions = json.loads((tmp_path / "o" / "predictions.json").read_text())
    again = fine_tune(SquadOptions(**{**options.__dict__, "train_file": ""}))
    assert again == scores  # the fine-tuned BERT and its WordPiece vocabulary read back
    assert json.loads((tmp_path / "o" / "predictions.json").read_text()) == predictions
    assert os.path.isfile(tmp_path / "o" / "vocab.txt")


@pytest.mark.slow  # two fine-tunes; the fp16 step is tfbig-classify's, tested in the default run
def test_fine_tune_bert_in_mixed_float16(bert_run, qa_sets, tmp_path, capsys):
    """--precision=mixed_float16: the same steps as fp32 with the loss scaled by 2**15 (none
    skipped, as the log says) give close but not equal losses."""
    (tmp_path / "train.json").write_text(json.dumps(_first(qa_sets["2.0", "train"], 12)))
    common = dict(init_checkpoint=bert_run[0], train_file=str(tmp_path / "train.json"),
                  max_seq_length=64, doc_stride=32, max_query_length=24, train_batch_size=16,
                  max_steps=3, learning_rate=1e-3, dropout=0.0, xla=False)
    losses = {}
    for precision in ("fp32", "mixed_float16"):
        fine_tune(SquadOptions(output_dir=str(tmp_path / precision), precision=precision,
                               **common))
        losses[precision] = json.loads((tmp_path / precision / "train_losses.json").read_text())
    assert "| loss scale 32768, 0 skipped" in capsys.readouterr().out
    assert not np.array_equal(losses["mixed_float16"], losses["fp32"])
    np.testing.assert_allclose(losses["mixed_float16"], losses["fp32"], rtol=5e-3)


@pytest.mark.slow  # one horovodrun or tfbig-launch launch: ~25 s idle
@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["horovod", "multiworker"])
def test_two_processes_equal_one_on_the_same_global_batches(strategy, bert_run, qa_sets,
                                                            tmp_path):
    import subprocess
    import sys

    import tensorflow as tf

    (tmp_path / "train.json").write_text(json.dumps(_first(qa_sets["2.0", "train"], 12)))
    common = dict(init_checkpoint=bert_run[0], train_file=str(tmp_path / "train.json"),
                  max_seq_length=64, doc_stride=32, max_query_length=24, train_batch_size=8,
                  max_steps=4, learning_rate=1e-3, dropout=0.0, xla=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launcher = ([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
                 "localhost:2", "--gloo"] if strategy == "horovod" else
                [sys.executable, "-m", "launch.local", "--workers=2", "--"])
    command = launcher + [sys.executable, "-m", "tfbig.squad.cli", f"--strategy={strategy}",
                          f"--output_dir={tmp_path / 'two'}",
                          *[f"--{k}={v}" for k, v in common.items() if k != "xla"], "--noxla"]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for rank in (0, 1):  # two processes, each training on its half of every global batch
        assert f"4 steps on 2 replica(s) (rank {rank})" in output
    fine_tune(SquadOptions(output_dir=str(tmp_path / "one"), **common))
    losses = [json.loads((tmp_path / run / "train_losses.json").read_text())
              for run in ("two", "one")]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    readers = [tf.train.load_checkpoint(str(tmp_path / run / "finetuned")) for run in ("two", "one")]
    keys = [k for k in readers[1].get_variable_to_shape_map() if k.startswith("model/")]
    assert len(keys) > 30
    for key in keys:
        np.testing.assert_allclose(readers[0].get_tensor(key), readers[1].get_tensor(key),
                                   rtol=1e-5, atol=1e-6, err_msg=key)
