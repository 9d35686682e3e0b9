"""tfbig-squad on BERT: a random BERT written in the Hugging Face format, converted by
tfbig-convert, fine-tuned and scored from its run directory; WordPiece character spans give
back every answer; predicting again from --output_dir reads the BERT back. Two processes
(MultiWorkerMirrored workers under tfbig-launch, or horovodrun) equal one process on the same
global batches: losses, every trained weight (tests/equality.py), predictions and scores.
Slow: mixed_float16 against fp32, and kill -9 + rerun of a --deterministic run."""
import json
import os
import re
import sys

import keras
import numpy as np
import pytest
from safetensors.numpy import save_file

from tfbig.checkpoints.checkpoint import model_variables
from tfbig.commands.convert import ConvertOptions, convert
from tfbig.convert import bert_names
from tfbig.models.bert import BertConfig, BertForPretraining
from tfbig.data.squad import features as squad_features
from tfbig.tasks import squad_model
from tfbig.commands.squad import SquadOptions, fine_tune

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from equality import RecordedGradients  # noqa: E402


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
    config, tokenizer = squad_model.pretrained_config(bert_run[0])
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


# MFU against a given peak: no CPU matmul probe (seconds at each process's first fit)
FAST = {"peak_tflops": 1.0}


def test_fine_tune_bert_from_a_converted_run(bert_run, qa_sets, tmp_path):
    """Fine-tune, predict, score; a predict-only rerun (no --train_file) reads the fine-tuned
    BERT and its WordPiece vocabulary back from --output_dir and predicts the same."""
    run, weights = bert_run
    model = squad_model.build_model(squad_model.pretrained_config(run)[0], run)
    np.testing.assert_array_equal(model.backbone.blocks[1].ffn.fc.kernel.numpy(),
                                  weights["backbone/block_1/ffn/fc/kernel"])
    for name, split in (("train.json", "train"), ("dev.json", "dev")):
        (tmp_path / name).write_text(json.dumps(_first(qa_sets["2.0", split], 12)))
    options = SquadOptions(init_checkpoint=run, train_file=str(tmp_path / "train.json"),
                           predict_file=str(tmp_path / "dev.json"), output_dir=str(tmp_path / "o"),
                           max_seq_length=64, doc_stride=32, max_query_length=24,
                           train_batch_size=16, max_steps=3, learning_rate=1e-3, xla=False)
    scores = fine_tune(options, **FAST)
    assert {"exact", "f1", "HasAns_f1", "best_f1"} <= set(scores)
    assert json.loads((tmp_path / "o" / "eval_results.json").read_text()) == \
        pytest.approx(scores)
    saved = json.loads((tmp_path / "o" / "squad_config.json").read_text())
    assert saved["model_format"] == "bert" and saved["tokenizer"]["lowercase"] is True
    predictions = json.loads((tmp_path / "o" / "predictions.json").read_text())
    again = fine_tune(SquadOptions(**{**options.__dict__, "train_file": ""}), **FAST)
    assert again == pytest.approx(scores)  # the fine-tuned BERT and its vocabulary read back
    assert json.loads((tmp_path / "o" / "predictions.json").read_text()) == predictions
    assert os.path.isfile(tmp_path / "o" / "vocab.txt")


@pytest.mark.slow  # two fine-tunes; the fp16 step is tfbig-classify's, tested in the default run
def test_fine_tune_bert_in_mixed_float16(bert_run, qa_sets, tmp_path):
    """--precision=mixed_float16: the same steps as fp32 with the loss scaled by 2**15 (none
    skipped) give close but not equal losses."""
    (tmp_path / "train.json").write_text(json.dumps(_first(qa_sets["2.0", "train"], 12)))
    common = dict(init_checkpoint=bert_run[0], train_file=str(tmp_path / "train.json"),
                  max_seq_length=64, doc_stride=32, max_query_length=24, train_batch_size=16,
                  max_steps=3, learning_rate=1e-3, xla=False, log_every=1)
    losses = {}
    for precision in ("fp32", "mixed_float16"):
        fine_tune(SquadOptions(output_dir=str(tmp_path / precision), precision=precision,
                               **common), dropout=0.0, **FAST)
        losses[precision] = json.loads((tmp_path / precision / "train_losses.json").read_text())
    assert json.loads((tmp_path / "mixed_float16" / "loss_scales.json").read_text()) == \
        [2.0 ** 15] * 3
    assert not np.array_equal(losses["mixed_float16"], losses["fp32"])
    np.testing.assert_allclose(losses["mixed_float16"], losses["fp32"], rtol=5e-3)


def launch(strategy, flags, out, root):
    """Two processes of `python -m tfbig.commands.squad` under horovodrun or tfbig-launch."""
    import subprocess
    import sys

    launcher = ([os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H",
                 "localhost:2", "--gloo"] if strategy == "horovod" else
                [sys.executable, "-m", "tfbig.commands.launch", "--workers=2", "--"])
    command = launcher + [sys.executable, "-m", "tfbig.commands.squad", f"--strategy={strategy}",
                          f"--output_dir={out}", *flags]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})


def checkpoint_reader(directory):
    import tensorflow as tf

    return tf.train.load_checkpoint(tf.train.latest_checkpoint(str(directory)))


def assert_same_run(two, one, recorded):
    """Losses over steps, every fine-tuned weight (tests/equality.py's rule), predictions
    and scores of the two-process run `two` equal the one-process run's."""
    losses = [json.loads((run / "train_losses.json").read_text()) for run in (two, one)]
    assert len(losses[0]) == 4 and losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    from tfbig.checkpoints.checkpoint import reader_key

    reader, model = checkpoint_reader(two), recorded.trainer.model
    by_path = {v.path: v for v in model.trainable_variables}
    ours = {p: reader.get_tensor(reader_key(model, by_path[p])) for p in recorded.paths}
    assert len(ours) > 30
    recorded.assert_equal(ours)
    for name in ("predictions.json", "null_odds.json", "eval_results.json"):
        texts = [json.loads((run / name).read_text()) for run in (two, one)]
        assert texts[0] == pytest.approx(texts[1], abs=1e-4), name


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", [
    "horovod",  # one horovodrun launch: ~25 s idle
    # two TF_CONFIG workers (tfbig-launch): ~45 s idle; MultiWorker keeps its default case in
    # test_multiworker (GPT pretraining through the same loop)
    pytest.param("multiworker", marks=pytest.mark.slow)])
def test_two_processes_equal_one_on_the_same_global_batches(strategy, bert_run, qa_sets,
                                                            tmp_path):
    """Training on each process's half of every global batch, prediction on both processes
    gathered in dataset order: the same losses, weights, predictions and scores as one."""
    for name, split in (("train.json", "train"), ("dev.json", "dev")):
        (tmp_path / name).write_text(json.dumps(_first(qa_sets["2.0", split], 12)))
    common = dict(init_checkpoint=bert_run[0], train_file=str(tmp_path / "train.json"),
                  predict_file=str(tmp_path / "dev.json"), max_seq_length=64, doc_stride=32,
                  max_query_length=24, train_batch_size=8, max_steps=4, learning_rate=1e-3,
                  log_every=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = [f"--{k}={v}" for k, v in common.items()] + [
        "--noxla", "--dropout=0.0", "--peak_tflops=1"]
    done = launch(strategy, flags, tmp_path / "two", root)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    saved = json.loads((tmp_path / "two" / "config.json").read_text())
    assert saved["train"]["strategy"] == strategy and saved["train"]["batch_size"] == 8
    recorded = []
    fine_tune(SquadOptions(output_dir=str(tmp_path / "one"), xla=False, **common),
              before_fit=lambda trainer: recorded.append(RecordedGradients(trainer)),
              dropout=0.0, **FAST)
    assert_same_run(tmp_path / "two", tmp_path / "one", recorded[0])


@pytest.mark.slow  # three runs of the command on a loaded 2-core machine
def test_kill_9_and_the_same_command_again_equal_an_uninterrupted_run(bert_run, qa_sets,
                                                                      tmp_path):
    """tfbig-squad --deterministic killed (SIGKILL) after a random checkpointed step, then
    started again with the same flags: it resumes from the last checkpoint in --output_dir and
    ends with bit-identical weights and predictions.json."""
    from kill_and_resume import assert_killed_and_rerun_equals_uninterrupted

    for name, split in (("train.json", "train"), ("dev.json", "dev")):
        (tmp_path / name).write_text(json.dumps(_first(qa_sets["2.0", split], 6)))
    steps = 8

    def command(out):
        return [sys.executable, "-m", "tfbig.commands.squad", f"--init_checkpoint={bert_run[0]}",
                f"--train_file={tmp_path / 'train.json'}",
                f"--predict_file={tmp_path / 'dev.json'}", "--max_seq_length=64",
                "--doc_stride=32", "--max_query_length=24", "--train_batch_size=8",
                "--learning_rate=1e-3", f"--max_steps={steps}", "--log_every=1",
                "--deterministic", "--checkpoint_every=1", "--noxla", "--peak_tflops=1",
                "--monitor_interval_ms=0", f"--output_dir={out}"]

    assert_killed_and_rerun_equals_uninterrupted(
        command, tmp_path, steps, ("predictions.json", "null_odds.json", "eval_results.json"))