"""tfbig-prep --tokenizer=DIR and tfbig-generate with the tokenizers Llama-family checkpoints
ship: a Hugging Face tokenizer.json (Llama 3, Qwen, SmolLM: byte-level BPE with special tokens)
and a SentencePiece tokenizer.model (Llama 2, Mistral: BPE with byte fallback, <unk> <s> </s>
at ids 0-2, no newline piece, no [CLS]).

Both are trained here by their own libraries (`tokenizers`, `sentencepiece`), the way those
checkpoints' were; nothing is downloaded. Every document of every shard is the library's own
encoding of a document of the input, ended by the end-of-document id."""
import filecmp
import json
import os
import shutil
import sys

import numpy as np
import pytest
import sentencepiece as spm
import tensorflow as tf

from tfbig.data import load_manifest, load_tokenizer, prepare
from tfbig.data.tokenizer import Tokenizer, for_run, tokenizer_file
from tfbig.data.tokenizer_json import TokenizerJson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_trainer import make_cfg  # noqa: E402

ODD = "Héllo,  WÖRLD!! Ça va? «Quoi» naïve café... 東京は晴れ。 Привет, мир!\n\tTabbed line."
SEQ = 16


def _byte_level_tokenizer_json(lines, path, specials=("<|begin_of_text|>", "<|end_of_text|>")):
    """A Llama 3-style tokenizer.json: byte-level BPE, its special tokens added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(path))
    return str(path)


def _llama2_sentencepiece(lines, prefix):
    """A Llama 2-style SentencePiece model: BPE, byte fallback, <unk> <s> </s> = 0, 1, 2, text
    as it is (identity normalisation, whitespace kept, a dummy prefix space)."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=500, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False)
    return prefix + ".model"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, scenes):
    """{"llama3": directory with tokenizer.json, "llama2": with tokenizer.model, "text": input}."""
    root = tmp_path_factory.mktemp("llama_tokenizers")
    text = root / "text"
    text.mkdir()
    for index, scene in enumerate(scenes[:20]):
        (text / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    (text / "odd.txt").write_text(f"{ODD}\n{scenes[0][:300]}\n", encoding="utf-8")
    lines = [line for p in sorted(text.iterdir())
             for line in p.read_text(encoding="utf-8").split("\n") if line.strip()]
    dirs = {"text": text}
    for name in ("llama3", "llama2"):
        dirs[name] = root / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _byte_level_tokenizer_json(lines, dirs["llama3"] / "tokenizer.json")
    shutil.copyfile(_llama2_sentencepiece(lines, str(root / "sp")),
                    dirs["llama2"] / "tokenizer.model")
    return dirs


def _documents(manifest, eos):
    """Token ids of every whole document in the shards (between two end-of-document ids)."""
    spec = {"input_ids": tf.io.FixedLenFeature([SEQ + 1], tf.int64)}
    documents = []
    for split in ("train", "validation"):
        for path in manifest.shard_paths(split):
            records = tf.data.TFRecordDataset(path).batch(1 << 16).get_single_element()
            stream = tf.io.parse_example(records, spec)["input_ids"].numpy().reshape(-1)
            ends = np.flatnonzero(stream == eos)
            documents += [stream[a:b].tolist() for a, b in zip(ends[:-1] + 1, ends[1:])]
    return documents


def _prepared(checkpoints, tmp_path, name):
    source = str(checkpoints[name])
    vocab_size = load_tokenizer(tokenizer_file(source)).vocab_size
    data = tmp_path / f"data_{name}"
    manifest = prepare([str(checkpoints["text"])], str(data), seq_length=SEQ,
                       vocab_size=vocab_size, tokenizer=source, validation_fraction=0.2)
    return manifest, data


def test_prep_with_a_tokenizer_json_holds_its_ids(checkpoints, tmp_path):
    from tokenizers import Tokenizer as Library

    manifest, data = _prepared(checkpoints, tmp_path, "llama3")
    given = checkpoints["llama3"] / "tokenizer.json"
    assert tokenizer_file(str(checkpoints["llama3"])) == str(given)
    assert manifest.tokenizer == "tokenizer.json"
    assert filecmp.cmp(given, data / "tokenizer.json", shallow=False)
    library = Library.from_file(str(given))
    assert manifest.eos_id == library.token_to_id("<|end_of_text|>") == 1
    assert manifest.vocab_size == library.get_vocab_size(with_added_tokens=True)
    documents = _documents(load_manifest(str(data)), manifest.eos_id)
    assert len(documents) >= 8
    corpus = "".join(p.read_text(encoding="utf-8") for p in checkpoints["text"].iterdir())
    texts = [library.decode(ids) for ids in documents]
    assert all(text in corpus for text in texts)
    assert documents == [library.encode(t, add_special_tokens=False).ids for t in texts]
    ours = load_tokenizer(str(data / "tokenizer.json"))
    assert isinstance(ours, TokenizerJson) and ours.decode(ours.encode(ODD)) == ODD
    # bits per byte stay exact: the bytes each id spells, summed over a split, are its text
    lengths, train = ours.piece_byte_lengths(), load_manifest(str(data)).split("train")
    spec = {"input_ids": tf.io.FixedLenFeature([SEQ + 1], tf.int64)}
    total = 0
    for path in manifest.shard_paths("train"):
        records = tf.data.TFRecordDataset(path).batch(1 << 16).get_single_element()
        total += int(lengths[tf.io.parse_example(records, spec)["input_ids"].numpy()].sum())
    assert total == train.bytes


def test_prep_with_a_llama2_sentencepiece_model_holds_its_ids(checkpoints, tmp_path):
    """Not taken for a released ALBERT model (no newline piece, but no [CLS] either)."""
    manifest, data = _prepared(checkpoints, tmp_path, "llama2")
    assert manifest.tokenizer == "tokenizer.model" and manifest.eos_id == 2
    processor = spm.SentencePieceProcessor(model_file=str(checkpoints["llama2"] /
                                                          "tokenizer.model"))
    assert processor.id_to_piece(2) == "</s>"
    ours = load_tokenizer(str(data / "tokenizer.model"))
    assert type(ours) is Tokenizer
    documents = _documents(load_manifest(str(data)), 2)
    assert len(documents) >= 8
    texts = [processor.decode(ids) for ids in documents]
    assert documents == [processor.encode(t) for t in texts]
    assert any("\n" in t for t in texts)  # newlines through byte fallback
    assert ours.decode(ours.encode(ODD)) == ODD


def test_tokenizer_json_is_refused_where_it_cannot_work(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.json is a Hugging Face tokenizer\.json "
                                         r".*--format=albert needs its own"):
        prepare([str(checkpoints["text"])], str(tmp_path / "albert"), seq_length=SEQ,
                format="albert", vocab_size=600, tokenizer=str(checkpoints["llama3"]),
                validation_fraction=0)
    lines = ["some text here"] * 20
    no_eos = _byte_level_tokenizer_json(lines, tmp_path / "tokenizer.json", ("<pad>",))
    with pytest.raises(ValueError, match=r"has no end-of-document"):
        prepare([str(checkpoints["text"])], str(tmp_path / "gpt"), seq_length=SEQ,
                vocab_size=load_tokenizer(no_eos).vocab_size, tokenizer=no_eos,
                validation_fraction=0)
    assert not (tmp_path / "gpt" / "manifest.json").exists()


def _generates_through(model, tokenizer):
    """tfbig-generate's decoding: the model's greedy ids (recomputed whole at each step here),
    decoded by the run's tokenizer."""
    from tfbig.models.generation import sample_text

    prompt = "ROMEO: 東京"
    ids = tokenizer.encode(prompt)
    for _ in range(5):
        ids.append(int(np.argmax(model(np.array([ids], np.int32))[0, -1])))
    text = sample_text(model, tokenizer, prompt, 5, temperature=0.0)
    assert text == tokenizer.decode([int(i) for i in ids if i != tokenizer.eos_id])
    assert text.startswith(prompt) and len(text) > len(prompt)


def test_a_run_directory_carries_a_tokenizer_json_that_generation_reads(checkpoints, tmp_path):
    """What tfbig-train copies into --model_dir for tokenizer.json data, and the config.json
    entry that makes tfbig-generate read it; a converted checkpoint lists it among its
    Hugging Face files."""
    from tfbig.data import run_tokenizer_files
    from tfbig.models.llama import Llama, LlamaConfig

    _, data = _prepared(checkpoints, tmp_path, "llama3")
    files, entry = run_tokenizer_files(str(data / "tokenizer.json"))
    assert files == {"tokenizer.json": str(data / "tokenizer.json")}
    assert entry == {"kind": "tokenizer_json", "vocab_file": "tokenizer.json"}
    for name, kind in (("run", entry), ("converted", {"kind": "huggingface_files", "files": [
            "tokenizer.json", "tokenizer_config.json"]})):
        (tmp_path / name).mkdir()
        shutil.copyfile(data / "tokenizer.json", tmp_path / name / "tokenizer.json")
        (tmp_path / name / "config.json").write_text(json.dumps({"tokenizer": kind}))
        assert isinstance(for_run(str(tmp_path / name)), TokenizerJson)
    tokenizer = for_run(str(tmp_path / "run"))
    model = Llama(LlamaConfig.from_preset("tiny", vocab_size=tokenizer.vocab_size,
                                          hidden_size=16, num_heads=2, num_kv_heads=1,
                                          intermediate_size=32))
    _generates_through(model, tokenizer)


@pytest.mark.slow
def test_a_llama_run_on_tokenizer_json_data_generates_text_through_it(checkpoints, tmp_path):
    """tfbig-train copies the tokenizer.json into the run; tfbig-generate decodes through it."""
    from tfbig.convert.run_dir import load_model
    from tfbig.training.trainer import Trainer

    _, data = _prepared(checkpoints, tmp_path, "llama3")
    run = tmp_path / "run"
    Trainer(make_cfg(str(data), run, model="llama", max_steps=2, seq_length=SEQ)).fit()
    saved = json.loads((run / "config.json").read_text())
    assert saved["tokenizer"] == {"kind": "tokenizer_json", "vocab_file": "tokenizer.json"}
    assert filecmp.cmp(data / "tokenizer.json", run / "tokenizer.json", shallow=False)
    tokenizer = for_run(str(run))
    assert isinstance(tokenizer, TokenizerJson)
    model, _ = load_model(str(run))
    _generates_through(model, tokenizer)
