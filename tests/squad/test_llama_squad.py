"""tfbig-squad on a Llama-family run with a Llama 3-style tokenizer.json (byte-level BPE): the
library's offsets give back every answer's text, a random Llama fine-tunes, predicts and
scores (features `</s> question </s> context </s>`), and a predict-only rerun reads the
fine-tuned Llama and its tokenizer back from --output_dir to the same predictions. The span
model itself (every position's start/end logits of the final norm) equals its parts."""
import json
import os

import keras
import numpy as np
import pytest

from tfbig.checkpoints.checkpoint import model_variables
from tfbig.commands.squad import SquadOptions, fine_tune
from tfbig.convert import run_dir
from tfbig.data.squad import features as squad_features
from tfbig.data.tokenizer_json import RUN_ENTRY
from tfbig.models.llama import Llama, LlamaConfig
from tfbig.tasks import squad_model

FAST = {"peak_tflops": 1.0}  # MFU against a given peak: no CPU matmul probe


def _contexts(squad):
    return [p["context"] for a in squad["data"] for p in a["paragraphs"]]


def _first(squad, paragraphs):
    article = squad["data"][0]
    return {**squad, "data": [{**article, "paragraphs": article["paragraphs"][:paragraphs]}]}


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory, qa_sets):
    """A random Llama (hidden 32, 4 query / 2 key-value heads) with a byte-level BPE
    tokenizer.json trained on the plays, as tfbig-convert writes a Hugging Face Llama 3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("llama_squad")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        [c for s in qa_sets.values() for c in _contexts(s)], trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(root / "tokenizer.json"))
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, num_heads=4,
                         num_kv_heads=2, num_layers=2, intermediate_size=48, seq_length=64)
    keras.utils.set_random_seed(0)
    model = Llama(config)
    model.build()
    weights = {k: v.numpy() for k, v in model_variables(model).items()}
    run_dir.write_run(str(root / "run"), config, weights, RUN_ENTRY,
                      {"tokenizer.json": str(root / "tokenizer.json")}, "test", "llama")
    return str(root / "run"), weights


def test_tokenizer_json_offsets_give_back_every_answer(llama_run, qa_sets):
    config, tokenizer = squad_model.pretrained_config(llama_run[0])
    assert isinstance(config, LlamaConfig)
    checked = 0
    for article in qa_sets["1.1", "train"]["data"]:
        for paragraph in article["paragraphs"][:20]:
            context = paragraph["context"]
            ids, starts, ends = squad_features.token_char_spans(tokenizer, context)
            assert ids.tolist() == tokenizer.encode(context)
            for qa in paragraph["qas"]:
                answer = qa["answers"][0]
                first, last = squad_features.answer_token_span(
                    starts, ends, answer["answer_start"],
                    answer["answer_start"] + len(answer["text"]))
                assert context[starts[first]:ends[last]] == answer["text"]
                checked += 1
    assert checked > 20


def test_the_span_model_reads_every_positions_final_norm(llama_run):
    run, weights = llama_run
    config = squad_model.pretrained_config(run)[0]
    model = squad_model.build_model(config, run)
    np.testing.assert_array_equal(model.backbone.blocks[1].mlp.down.kernel.numpy(),
                                  weights["block_1/mlp/down/kernel"])
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)).astype("int32")
    inputs = {"input_ids": ids, "segment_ids": 0 * ids, "input_mask": 1 + 0 * ids}
    out = model(inputs)
    hidden, _ = model.backbone.hidden_states(ids)
    logits = model.backbone.final_norm(hidden).numpy() @ model.span_head.kernel.numpy() \
        + model.span_head.bias.numpy()
    np.testing.assert_allclose(out["start_logits"].numpy(), logits[..., 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["end_logits"].numpy(), logits[..., 1], rtol=1e-5, atol=1e-6)
    assert not model.backbone.head.trainable


def test_fine_tune_a_llama_and_predict_again_from_its_output_dir(llama_run, qa_sets, tmp_path):
    run, _ = llama_run
    for name, split in (("train.json", "train"), ("dev.json", "dev")):
        (tmp_path / name).write_text(json.dumps(_first(qa_sets["2.0", split], 12)))
    options = SquadOptions(init_checkpoint=run, train_file=str(tmp_path / "train.json"),
                           predict_file=str(tmp_path / "dev.json"), output_dir=str(tmp_path / "o"),
                           max_seq_length=64, doc_stride=32, max_query_length=24,
                           train_batch_size=16, max_steps=3, learning_rate=1e-3, xla=False,
                           log_every=1)
    scores = fine_tune(options, **FAST)
    assert {"exact", "f1", "HasAns_f1", "best_f1"} <= set(scores)
    losses = json.loads((tmp_path / "o" / "train_losses.json").read_text())
    assert len(losses) == 3 and losses[-1] < losses[0]
    saved = json.loads((tmp_path / "o" / "squad_config.json").read_text())
    assert saved["model_format"] == "llama" and saved["tokenizer"]["kind"] == "tokenizer_json"
    predictions = json.loads((tmp_path / "o" / "predictions.json").read_text())
    nbest = json.loads((tmp_path / "o" / "nbest_predictions.json").read_text())
    dev = {p["context"]: [q["id"] for q in p["qas"]] for p in
           _first(qa_sets["2.0", "dev"], 12)["data"][0]["paragraphs"]}
    for context, ids in dev.items():  # every question's candidates are spans of its context
        assert all(nbest[i] and all(c["text"] in context for c in nbest[i]) for i in ids)
    again = fine_tune(SquadOptions(**{**options.__dict__, "train_file": ""}), **FAST)
    assert again == pytest.approx(scores)  # the fine-tuned Llama and its tokenizer read back
    assert json.loads((tmp_path / "o" / "predictions.json").read_text()) == predictions
    assert os.path.isfile(tmp_path / "o" / "tokenizer.json")
