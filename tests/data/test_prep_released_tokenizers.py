"""tfbig-prep --tokenizer=DIR with the tokenizers converted checkpoints come with: ALBERT's
released SentencePiece model (spiece.model in a Hugging Face directory, 30k-clean.model in
Google's) for --format=albert (BERT's vocab.txt in Hugging Face and Google directories:
tests/bert/test_bert_data.py).

The ALBERT model is trained here by the `sentencepiece` library the way ALBERT's was (unigram,
<pad> <unk> [CLS] [SEP] [MASK] at ids 0-4, no end-of-document id, lower-cased text). The ids
tfbig gives every line are those of tf-models-official's port of ALBERT's own tokenization
(`preprocess_text` + `FullSentencePieceTokenizer`), and every sentence of every shard example
is a run of the ids of its document's lines."""
import filecmp
import hashlib
import json
import shutil

import numpy as np
import pytest
import sentencepiece as spm

from tfbig.data import load_manifest, load_tokenizer, prepare
from tfbig.data.albert_spm import AlbertSentencePiece
from tfbig.data.tokenizer import tokenizer_file

ODD = ("Héllo,  WÖRLD!! Ça va? «Quoi» naïve café... In 1990, 42,5% (a+b)=c; "
       "東京は晴れ。 Привет, мир! ``quoted''")
ALBERT_SYMBOLS = ["(", ")", '"', "-", ".", "–", "£", "€"]  # ALBERT's user-defined pieces


def _albert_sentencepiece(lines, prefix, vocab_size=700, control=("[CLS]", "[SEP]", "[MASK]")):
    """A unigram model with ALBERT's ids and symbols, trained on lower-cased `lines`."""
    from official.nlp.tools.tokenization import preprocess_text

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([preprocess_text(line, lower=True) for line in lines]),
        model_prefix=prefix, vocab_size=vocab_size, model_type="unigram", pad_id=0, unk_id=1,
        eos_id=-1, bos_id=-1, control_symbols=list(control),
        user_defined_symbols=ALBERT_SYMBOLS, character_coverage=0.99995, minloglevel=2)
    return prefix + ".model"


@pytest.fixture(scope="module")
def albert_dirs(tmp_path_factory, scenes):
    """(Hugging Face ALBERT directory, Google ALBERT directory, input directory of scenes)."""
    root = tmp_path_factory.mktemp("albert_spm")
    lines = [line for scene in scenes for line in scene.split("\n") if line.strip()] + [ODD]
    model = _albert_sentencepiece(lines, str(root / "trained"))
    hf, google, text = root / "albert-base-v2", root / "albert_base", root / "text"
    for directory in (hf, google, text):
        directory.mkdir()
    shutil.copyfile(model, hf / "spiece.model")
    (hf / "config.json").write_text(json.dumps({"model_type": "albert", "vocab_size": 700}))
    shutil.copyfile(model, google / "30k-clean.model")
    (google / "albert_config.json").write_text(json.dumps({"vocab_size": 700}))
    for index, scene in enumerate(scenes[:24]):
        (text / f"scene{index:03d}.txt").write_text(scene, encoding="utf-8")
    (text / "odd.txt").write_text(f"{ODD}\nIt was 1990, then.\n{ODD}\n", encoding="utf-8")
    return hf, google, text


def _reference(model_file):
    """line -> ids, by tf-models-official's port of ALBERT's tokenization."""
    from official.nlp.tools import tokenization

    tokenizer = tokenization.FullSentencePieceTokenizer(model_file)
    return lambda line: tokenizer.convert_tokens_to_ids(
        tokenizer.tokenize(tokenization.preprocess_text(line, lower=True)))


def test_albert_sentencepiece_ids_equal_albert_tokenization(albert_dirs):
    hf, google, text = albert_dirs
    assert tokenizer_file(str(hf)) == str(hf / "spiece.model")
    assert tokenizer_file(str(google)) == str(google / "30k-clean.model")
    ours = load_tokenizer(str(hf / "spiece.model"))
    assert isinstance(ours, AlbertSentencePiece) and ours.lowercase
    sep = ours.piece_id("[SEP]")
    assert (ours.piece_id("[CLS]"), sep, ours.piece_id("[MASK]"), ours.pad_id) == (2, 3, 4, 0)
    documents = [p.read_text(encoding="utf-8") for p in sorted(text.iterdir())]
    reference, checked = _reference(str(hf / "spiece.model")), 0
    for document in documents:
        expected = []
        for line in document.split("\n"):
            ids = reference(line) if line.strip() else []
            expected += ids + [sep] if ids else []
            checked += bool(ids)
        assert ours.encode(document) == expected
    assert checked > 500


def _shard_examples(manifest):
    """[(input ids with the masked tokens put back, [SEP] positions)] of every train example."""
    import tensorflow as tf

    width, predictions = manifest.seq_length, 20
    spec = {"input_ids": tf.io.FixedLenFeature([width], tf.int64),
            "masked_lm_positions": tf.io.FixedLenFeature([predictions], tf.int64),
            "masked_lm_ids": tf.io.FixedLenFeature([predictions], tf.int64),
            "masked_lm_weights": tf.io.FixedLenFeature([predictions], tf.float32)}
    rows = []
    for path in manifest.shard_paths("train"):
        records = tf.data.TFRecordDataset(path).batch(1 << 16).get_single_element()
        batch = {k: v.numpy() for k, v in tf.io.parse_example(records, spec).items()}
        for i in range(len(batch["input_ids"])):
            ids = batch["input_ids"][i].copy()
            real = batch["masked_lm_weights"][i] > 0
            ids[batch["masked_lm_positions"][i][real]] = batch["masked_lm_ids"][i][real]
            rows.append(ids)
    return rows


def test_prep_albert_with_a_released_sentencepiece_directory(albert_dirs, tmp_path):
    """The model is copied beside the shards (sha256 in the manifest); every example is
    [CLS] A [SEP] B [SEP] where A and B are runs of one document's line ids."""
    hf, _, text = albert_dirs
    manifest = prepare([str(text)], str(tmp_path / "data"), seq_length=48, vocab_size=700,
                       format="albert", tokenizer=str(hf), validation_fraction=0)
    data = tmp_path / "data"
    assert manifest.tokenizer == "tokenizer.model"
    assert filecmp.cmp(hf / "spiece.model", data / "tokenizer.model", shallow=False)
    assert manifest.tokenizer_sha256 == hashlib.sha256(
        (hf / "spiece.model").read_bytes()).hexdigest()
    ours = load_tokenizer(str(data / "tokenizer.model"))
    sep = ours.piece_id("[SEP]")
    streams = [" " + " ".join(map(str, [i for i in ours.encode(p.read_text(encoding="utf-8"))
                                        if i != sep])) + " " for p in sorted(text.iterdir())]
    rows = _shard_examples(load_manifest(str(data)))
    assert len(rows) > 50
    for ids in rows:
        ids = ids[:int(np.flatnonzero(ids)[-1]) + 1]
        ends = np.flatnonzero(ids == sep)
        assert ids[0] == ours.piece_id("[CLS]") and len(ends) == 2 and ends[1] == len(ids) - 1
        for sentence in (ids[1:ends[0]], ids[ends[0] + 1:ends[1]]):
            run = " " + " ".join(map(str, sentence)) + " "
            assert any(run in stream for stream in streams), run


def test_released_sentencepiece_is_refused_where_it_cannot_work(albert_dirs, tmp_path):
    hf, _, text = albert_dirs
    with pytest.raises(ValueError, match=r"spiece\.model is a released ALBERT SentencePiece "
                                         r"model .*--format=albert"):
        prepare([str(text)], str(tmp_path / "gpt"), seq_length=16, vocab_size=700,
                tokenizer=str(hf), validation_fraction=0)
    with pytest.raises(ValueError, match=r"spiece\.model: --format=bert needs a WordPiece"):
        prepare([str(text)], str(tmp_path / "bert"), seq_length=16, vocab_size=700,
                format="bert", tokenizer=str(hf), validation_fraction=0)
    lines = [p.read_text(encoding="utf-8") for p in sorted(text.iterdir())]
    no_mask = _albert_sentencepiece(lines, str(tmp_path / "no_mask"), 300, ("[CLS]", "[SEP]"))
    with pytest.raises(ValueError, match=r"no_mask\.model: no \['\[MASK\]'\] in this "
                                         r"SentencePiece model"):
        load_tokenizer(no_mask)
