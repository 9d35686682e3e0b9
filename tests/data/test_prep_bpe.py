"""tfbig-prep --tokenizer=<a GPT-2's directory>: shards in GPT-2's byte-level BPE ids, equal to
tfbig.data.bpe's and keras-hub's GPT2Tokenizer's (its TensorFlow path: GPT-2's own regex) on
every document, multilingual ones included; the vocab.json + merges.txt pair is what the data
directory carries."""
import filecmp
import os

import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from tfbig.data import load_manifest, prepare
from tfbig.data.bpe import ByteLevelBPE
from tfbig.data.tokenizer import tokenizer_file


def _shard_rows(path, width):
    """The (records, width) token ids of one shard, in file order."""
    spec = {"input_ids": tf.io.FixedLenFeature([width], tf.int64)}
    records = tf.data.TFRecordDataset(path).batch(1 << 16).get_single_element()
    return tf.io.parse_example(records, spec)["input_ids"].numpy()


def test_shards_hold_the_gpt2_tokenizers_ids(gpt2_bpe):
    run, data = gpt2_bpe["run"], gpt2_bpe["data"]
    manifest = load_manifest(data)
    assert (manifest.tokenizer, manifest.vocab_size) == ("vocab.json", gpt2_bpe["vocab_size"])
    for name in ("vocab.json", "merges.txt"):  # the run's own files, byte for byte
        assert filecmp.cmp(os.path.join(run, name), os.path.join(data, name), shallow=False)
    ours = ByteLevelBPE.load(os.path.join(run, "vocab.json"), os.path.join(run, "merges.txt"))
    theirs = keras_hub.models.GPT2Tokenizer(vocabulary=os.path.join(run, "vocab.json"),
                                            merges=os.path.join(run, "merges.txt"),
                                            _allow_python_workflow=False)
    assert manifest.eos_id == ours.eos_id
    corpus, documents = "".join(gpt2_bpe["texts"]), []
    for split in ("train", "validation"):
        for path in manifest.shard_paths(split):
            stream = _shard_rows(path, 17).reshape(-1)
            ends = np.flatnonzero(stream == ours.eos_id)
            documents += [stream[start:end].tolist()  # whole documents between two eos
                          for start, end in zip(ends[:-1] + 1, ends[1:])]
    assert len(documents) >= 20
    texts = [ours.decode(ids) for ids in documents]
    assert all(text in corpus for text in texts)
    assert documents == [ours.encode(text) for text in texts]
    sample = texts[:6]  # keras-hub's tokenizer is slow: a few documents, one call
    assert documents[:6] == [[int(i) for i in ids] for ids in theirs(sample)]
    multilingual = [t for t in gpt2_bpe["texts"] if "東京" in t][0]
    assert ours.encode(multilingual) == [int(i) for i in theirs(multilingual)]
    # bits per byte stay exact: the bytes each id spells, summed over a split, are its text
    train = manifest.split("train")
    lengths = ours.piece_byte_lengths()
    assert sum(int(lengths[_shard_rows(p, 17)].sum()) for p in manifest.shard_paths("train")) \
        == train.bytes


def test_a_bpe_tokenizer_is_refused_where_it_cannot_work(gpt2_bpe, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("some text\n" * 50)
    with pytest.raises(ValueError, match=r"--tokenizer=.*vocab\.json is GPT-2's byte-level BPE, "
                                         r"which has no \[CLS\]"):
        prepare([str(text)], str(tmp_path / "albert"), seq_length=16, format="albert",
                validation_fraction=0,
                vocab_size=gpt2_bpe["vocab_size"], tokenizer=gpt2_bpe["run"])
    with pytest.raises(ValueError, match=r"--tokenizer=.*vocab_size=.* but --vocab_size=7"):
        prepare([str(text)], str(tmp_path / "gpt"), seq_length=16, vocab_size=7,
                validation_fraction=0,
                tokenizer=gpt2_bpe["hf"])
    with pytest.raises(ValueError, match=r"--tokenizer=.*: a directory without vocab\.json"):
        tokenizer_file(str(tmp_path))
    assert tokenizer_file(gpt2_bpe["hf"]) == os.path.join(gpt2_bpe["hf"], "vocab.json")
