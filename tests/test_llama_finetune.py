"""tfbig-classify and tfbig-squad on a Llama-family run: the classifier reads each sequence's
last real token (NumPy reference; padding after it changes nothing), the features are
`a </s> b </s>` with the run's own tokenizer.json, a tiny random Llama learns the pair task of
tests/test_classify.py (accuracy >= 0.9 on held-out pairs) and the span task of
tests/distribute/test_finetune_parallel.py (exact match >= 90 on held-out questions), and an
MoE backbone is refused by name before anything is written. Split and sharded runs equal one
process in tests/distribute/test_finetune_parallel.py (llama_* scenarios); SQuAD's own text
with a byte-level BPE tokenizer.json: tests/squad/test_llama_squad.py."""
import json

import keras
import numpy as np
import pytest

from test_classify import FAST, WORDS, _rows, squad_set
from tfbig.checkpoints.checkpoint import model_variables
from tfbig.commands.classify import ClassifyOptions, fine_tune
from tfbig.commands.squad import SquadOptions
from tfbig.commands.squad import fine_tune as squad
from tfbig.convert import run_dir
from tfbig.data.tokenizer_json import RUN_ENTRY, TokenizerJson
from tfbig.errors import UsageError
from tfbig.models.llama import Llama, LlamaConfig
from tfbig.models.llama_heads import LlamaClassifier
from tfbig.tasks.classify import encode

VOCAB = ["<unk>", "</s>", "<s>", "yes", "no", "what"] + WORDS  # 18 ids: split over 2 ranks
LLAMA = dict(vocab_size=len(VOCAB), hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2,
             intermediate_size=48, seq_length=32)


def write_llama_run(root, name="llama", **overrides):
    """A random Llama run directory (tfbig-convert's layout) with a word-level tokenizer.json
    whose end-of-document token is </s>; returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["</s>", "<s>"])
    backend.save(str(root / "tokenizer.json"))
    config = LlamaConfig(**{**LLAMA, **overrides})
    keras.utils.set_random_seed(1)
    model = Llama(config)
    model.build()
    run_dir.write_run(str(root / name), config, {k: v.numpy() for k, v in
                                                  model_variables(model).items()},
                      RUN_ENTRY, {"tokenizer.json": str(root / "tokenizer.json")}, "test",
                      "llama")
    return root / name


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return write_llama_run(tmp_path_factory.mktemp("llama_classify"))


def test_the_classifier_reads_the_last_real_token():
    keras.utils.set_random_seed(0)
    model = LlamaClassifier(LlamaConfig(**LLAMA), num_classes=3)
    model.build()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(VOCAB), (2, 10)).astype("int32")
    mask = np.array([[1] * 10, [1] * 6 + [0] * 4], "int32")
    logits = model({"input_ids": ids, "segment_ids": 0 * ids, "input_mask": mask})["logits"]
    hidden, _ = model.backbone.hidden_states(ids)
    states = model.backbone.final_norm(hidden).numpy()
    head = model.classifier_head
    reference = np.stack([states[0, 9], states[1, 5]]) @ head.kernel.numpy() + head.bias.numpy()
    np.testing.assert_allclose(logits.numpy(), reference, rtol=1e-5, atol=1e-6)
    other = ids.copy()
    other[1, 6:] = (other[1, 6:] + 1) % len(VOCAB)  # other padding: causal attention hides it
    again = model({"input_ids": other, "segment_ids": 0 * ids, "input_mask": mask})["logits"]
    np.testing.assert_array_equal(again.numpy(), logits.numpy())
    assert not model.backbone.head.trainable  # no head reads the vocabulary projection
    assert {v.path.split("/")[-2] for v in model.trainable_variables} >= {"classifier_head"}


def test_features_are_a_eos_b_eos_with_the_longer_text_cut_first(llama_run):
    tokenizer = TokenizerJson.load(str(llama_run / "tokenizer.json"))
    examples = [("the cat sat on the mat", "a dog", "x", 0), ("big red", None, "y", 1)]
    arrays = encode(examples, tokenizer, 8, {"x": 0, "y": 1}, decoder=True)
    ids = {w: i for i, w in enumerate(VOCAB)}
    # 8 = 2 ends + 6 tokens: "the cat sat on the mat" (6) cut to 4 beside "a dog" (2)
    assert arrays["input_ids"][0].tolist() == [ids[w] for w in
                                               "the cat sat on </s> a dog </s>".split()]
    assert arrays["segment_ids"][0].tolist() == [0] * 5 + [1] * 3
    assert arrays["input_ids"][1].tolist() == [ids["big"], ids["red"], ids["</s>"]] + [0] * 5
    assert arrays["input_mask"][1].tolist() == [1] * 3 + [0] * 5
    assert arrays["labels"].tolist() == [0, 1]


def test_a_llama_learns_a_pair_task(llama_run, tmp_path):
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(128, 0)))
    dev.write_text("".join(json.dumps(r) + "\n" for r in _rows(40, 1)))
    out = tmp_path / "out"
    result = fine_tune(ClassifyOptions(
        init_checkpoint=str(llama_run), train_file=str(train), eval_file=str(dev),
        output_dir=str(out), max_seq_length=24, train_batch_size=16, learning_rate=3e-3,
        max_steps=150, xla=False), **FAST)
    assert result["accuracy"] >= 0.9, result
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_format"] == "classify" and (out / "tokenizer.json").is_file()
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 40


def test_a_llama_learns_a_span_task(llama_run, tmp_path):
    """The answer is the context's words 4-5, the question its words 1-3: the start token is
    the one after the context's copy of the question's last word."""
    for name, count, seed in (("train.json", 128, 4), ("dev.json", 32, 5)):
        (tmp_path / name).write_text(json.dumps(squad_set(count, seed)))
    result = squad(SquadOptions(
        init_checkpoint=str(llama_run), train_file=str(tmp_path / "train.json"),
        predict_file=str(tmp_path / "dev.json"), output_dir=str(tmp_path / "out"),
        max_seq_length=24, doc_stride=8, max_query_length=8, train_batch_size=16,
        learning_rate=3e-3, max_steps=150, xla=False), **FAST)
    assert result["exact"] >= 90, result  # measured 100 after 150 steps


def test_an_moe_backbone_is_refused_before_anything_is_written(tmp_path):
    run = write_llama_run(tmp_path, "moe", num_experts=4, experts_per_token=2,
                          moe_intermediate_size=16)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in _rows(8, 0)))
    with pytest.raises(ValueError, match=r"--init_checkpoint=.*moe: an MoE Llama "
                                         r"\(num_experts=4\)"):
        fine_tune(ClassifyOptions(init_checkpoint=str(run), train_file=str(train),
                                  output_dir=str(tmp_path / "out"), max_seq_length=24))
    assert not (tmp_path / "out").exists()


def test_a_gpt_run_is_refused_naming_the_families(llama_run, tmp_path):
    config = json.loads((llama_run / "config.json").read_text())
    other = tmp_path / "gpt"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_format": "gpt"}))
    with pytest.raises(UsageError, match=r"model_format='gpt'; expected one of "
                                         r"\['bert', 'llama'\]"):
        fine_tune(ClassifyOptions(init_checkpoint=str(other), train_file="t.jsonl"))
